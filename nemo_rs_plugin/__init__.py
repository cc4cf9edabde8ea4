"""nemo-rs-plugin: decoupled IS correction and rejection sampling for NeMo-RL's clipped PG loss.

The package is built in layers, each importing only the ones below it:

* :mod:`nemo_rs_plugin.core`: the tensor math (config, IS weights, rejection filters, the loss);
  imports torch and pydantic, never NeMo-RL or Megatron.
* :mod:`nemo_rs_plugin.parallel`: the sharded TP/CP input path (vocab-parallel log-probs, the
  CP layout) on top of the core.
* :mod:`nemo_rs_plugin.nemo_rl`: the NeMo-RL glue (``RSClippedPGLossFn``, the host-version
  rules, the activation the start-up hook calls, the loss registry).
* :mod:`nemo_rs_plugin.tools`: the ``nemo-rs`` command (check, simulate, recipes, doctor, lab).

The names below resolve on first use, so that ``import nemo_rs_plugin`` itself costs nothing
(the start-up hook and the doctor import standard-library-only modules of the package).
``RSClippedPGLossFn`` needs NeMo-RL; the rest does not.
"""

import importlib

__version__ = "0.2.0"

_PUBLIC = {
    "ConfigError": "nemo_rs_plugin.core.settings.config",
    "RejectionFilter": "nemo_rs_plugin.core.settings.config",
    "RSClippedPGLossConfig": "nemo_rs_plugin.core.settings.config",
    "SequenceFilter": "nemo_rs_plugin.core.settings.config",
    "TokenFilter": "nemo_rs_plugin.core.settings.config",
    "SequenceGroups": "nemo_rs_plugin.core.distributed",
    "CorrectedPGLoss": "nemo_rs_plugin.core.loss",
    "LossInputs": "nemo_rs_plugin.core.loss",
    "metric_normalizations": "nemo_rs_plugin.core.loss",
    "RSClippedPGLossFn": "nemo_rs_plugin.nemo_rl.loss_fn",
}

__all__ = [*_PUBLIC, "__version__"]


def __getattr__(name: str):
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'nemo_rs_plugin' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_PUBLIC))
