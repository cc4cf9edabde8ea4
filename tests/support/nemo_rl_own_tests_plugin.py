"""pytest plugin: NeMo-RL's own loss tests, with ``RSClippedPGLossFn`` in place of its loss.

``python -m pytest -p tests.support.nemo_rl_own_tests_plugin <checkout>/tests/unit/algorithms/test_loss_functions.py``
(run from this repository's root, the checkout on ``PYTHONPATH``). NeMo-RL's test module
imports ``ClippedPGLossFn`` from ``nemo_rl.algorithms.loss`` when it is collected; this plugin
puts the plugin's subclass under that name first, so every test of NeMo-RL's that builds its
loss builds ours, unchanged otherwise. The terminal summary reports how many plugin losses
were built, so a substitution that silently stopped working shows as zero.
"""

from __future__ import annotations

BUILT = {"count": 0}


def pytest_configure(config):
    from tests.support import nemo_rl_shims

    nemo_rl_shims.install()
    import nemo_rl.algorithms.loss as host_loss

    from nemo_rs_plugin.nemo_rl.loss_fn import RSClippedPGLossFn

    class CountingRSClippedPGLossFn(RSClippedPGLossFn):
        def __init__(self, *args, **kwargs):
            BUILT["count"] += 1
            super().__init__(*args, **kwargs)

    CountingRSClippedPGLossFn.__name__ = CountingRSClippedPGLossFn.__qualname__ = "RSClippedPGLossFn"
    host_loss.ClippedPGLossFn = CountingRSClippedPGLossFn


def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_line(f"nemo-rs-plugin: RSClippedPGLossFn built {BUILT['count']} times")
