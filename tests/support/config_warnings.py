"""ConfigWarnings that configurations drawn at random raise as a side effect, for ``pytestmark``.

Legal settings that do nothing (an IS level with the correction off, ``rejection_denominator:
kept`` with no filter) warn by design; tests that draw configurations at random land on them,
and the warning is not their subject. Each entry is a ``filterwarnings`` mark for one message.
"""

from __future__ import annotations

import pytest

DRAWN_CONFIG_WARNINGS = [
    pytest.mark.filterwarnings(
        r"ignore:loss_fn\.is_correction_level. got '\w+' with use_importance_sampling_correction. false"
        ":nemo_rs_plugin.core.settings.config.ConfigWarning"
    ),
    pytest.mark.filterwarnings(
        r"ignore:loss_fn\.rejection_denominator. got 'kept' with no rejection_sampling filter"
        ":nemo_rs_plugin.core.settings.config.ConfigWarning"
    ),
]
