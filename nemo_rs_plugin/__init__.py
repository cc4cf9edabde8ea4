"""nemo-rs-plugin: decoupled IS correction and rejection sampling for NeMo-RL's clipped PG loss.

The core (config, math, loss) imports only torch and pydantic. ``RSClippedPGLossFn``, the
subclass of NeMo-RL's ``ClippedPGLossFn``, is resolved lazily and needs NeMo-RL.
"""

from nemo_rs_plugin.config import ConfigError, RejectionFilter, RSClippedPGLossConfig
from nemo_rs_plugin.distributed import SequenceGroups
from nemo_rs_plugin.loss import CorrectedPGLoss, LossInputs, metric_normalizations

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "RSClippedPGLossFn",
    "LossInputs",
    "RejectionFilter",
    "CorrectedPGLoss",
    "RSClippedPGLossConfig",
    "SequenceGroups",
    "metric_normalizations",
    "__version__",
]


def __getattr__(name: str):
    # The NeMo-RL subclass needs NeMo-RL; import it only when asked for, so that the core
    # stays usable without NeMo-RL (the ImportError explains how NeMo-RL is installed).
    if name == "RSClippedPGLoss":
        import warnings

        warnings.warn(
            "nemo_rs_plugin.RSClippedPGLoss is now CorrectedPGLoss (RSClippedPGLossFn is the NeMo-RL class); "
            "the old name will be removed",
            DeprecationWarning,
            stacklevel=2,
        )
        return CorrectedPGLoss
    if name == "RSClippedPGLossFn":
        from nemo_rs_plugin.nemo_rl_adapter import RSClippedPGLossFn

        return RSClippedPGLossFn
    raise AttributeError(f"module 'nemo_rs_plugin' has no attribute {name!r}")
