# A NeMo-RL whose GRPO module builds the loss through the loss module (no name
# ClippedPGLossFn there); everything else is tests/fake_hosts/supported.
import os

__version__ = "0.9.0+fake-elsewhere"
__path__.append(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "supported", "nemo_rl"))
