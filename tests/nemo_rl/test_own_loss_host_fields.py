"""Guards the run-time half of the host-field rule (nemo_rl/activation.py, nemo_rl/host.py).

When a section builds NeMo-RL's own loss, a NeMo-RL field that the running NeMo-RL does not
declare (``use_cispo`` on v0.6.0) is refused at construction, as ``nemo-rs check`` refuses it:
NeMo-RL's loss would ignore it and train plain PPO. The host's fields are stood in for here;
tests/tools/test_cli_host_fields.py runs the same rule against the real checkouts.
"""

import pytest

from nemo_rs_plugin.core.settings.config import ConfigError
from nemo_rs_plugin.nemo_rl import activation, host


@pytest.fixture
def v060_like(monkeypatch):
    fields = {k: None for k in host.UPSTREAM_FIELDS if k not in ("use_cispo", "positive_example_nll_weight")}
    monkeypatch.setattr(host, "host_config_fields", lambda: fields)
    monkeypatch.setattr(host, "host_version", lambda: "0.6.0")


def test_own_loss_with_a_field_the_host_lacks_is_refused(v060_like):
    with pytest.raises(ConfigError) as info:
        activation.check_host_loss_config({"use_cispo": True, "positive_example_nll_weight": 0.1})
    lines = info.value.problems
    assert len(lines) == 2
    assert lines[0].startswith("loss_fn.use_cispo: got true; NeMo-RL 0.6.0 has no use_cispo"), lines[0]
    assert any("positive_example_nll_weight" in line and "0.6.0" in line for line in lines)


def test_own_loss_at_defaults_or_on_a_host_that_has_them_passes(v060_like, monkeypatch):
    activation.check_host_loss_config({"use_cispo": False, "positive_example_nll_weight": 0.0})
    monkeypatch.setattr(host, "host_config_fields", lambda: {k: None for k in host.UPSTREAM_FIELDS})
    activation.check_host_loss_config({"use_cispo": True})
