"""Run-time shims that let NeMo-RL's source archives import on Python 3.11 with CPU-only torch.

Test-only; nothing in NeMo-RL or megatron-core is edited. Each shim works around one thing
that the CPU test machine lacks (see ``../shared/nemo-rl/README.md``):

* pydantic rejects ``typing.TypedDict`` inside models before Python 3.12, and NeMo-RL v0.7.0
  and main use it there: alias it to ``typing_extensions.TypedDict``.
* NeMo-RL calls ``tensor.cuda()`` unconditionally in a few helpers, and
  ``AllGatherCPTensor.backward`` builds an index with ``pin_memory=True``: without CUDA,
  ``.cuda()`` returns the tensor itself and ``pin_memory`` is dropped.
* ``nemo_rl.models.megatron.train`` (home of ``LossPostProcessor``) imports Megatron-Bridge,
  Megatron-LM's ``megatron.training`` and NVIDIA ModelOpt, none of which install on a CPU
  machine, and NeMo-RL main names megatron-core modules newer than the PyPI release. A finder
  placed *last* on ``sys.meta_path`` (so it is asked only after the real import failed) gives
  empty stand-in modules for those names; none of them is used on the loss path, and
  :func:`stand_ins` lists which were needed, so a test can say so.
* NeMo-RL main builds megatron-core's ``PackedSeqParams`` with ``total_tokens`` (a field of
  the newer megatron-core it pins, read only by Mamba layers); PyPI's megatron-core lacks it:
  the class gets that one optional field.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

_STAND_IN_PREFIXES = ("megatron.bridge", "megatron.training", "megatron.core.", "modelopt")


class _StandInModule(types.ModuleType):
    """A module whose every public attribute is a fresh empty class (import-time names only)."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        value = type(name, (), {"__module__": self.__name__, "__init__": lambda self, *a, **k: None})
        setattr(self, name, value)
        return value


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname.startswith(_STAND_IN_PREFIXES) or fullname in {"modelopt"}:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StandInModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


def stand_ins() -> list[str]:
    """Names of the modules that were replaced by stand-ins in this process."""
    return sorted(name for name, mod in sys.modules.items() if isinstance(mod, _StandInModule))


def install() -> None:
    """Install every shim (idempotent). Call before the first NeMo-RL import."""
    if getattr(install, "_done", False):
        return
    install._done = True
    if sys.version_info < (3, 12):
        import typing

        import typing_extensions

        typing.TypedDict = typing_extensions.TypedDict

    import torch

    if not torch.cuda.is_available():
        torch.Tensor.cuda = lambda self, *args, **kwargs: self
        original_tensor = torch.tensor

        def tensor_without_pinning(*args, **kwargs):
            kwargs.pop("pin_memory", None)
            return original_tensor(*args, **kwargs)

        torch.tensor = tensor_without_pinning
    sys.meta_path.append(_StandInFinder())
    _packed_seq_params_total_tokens()


def _packed_seq_params_total_tokens() -> None:
    try:
        from megatron.core import packed_seq_params
    except ImportError:
        return
    import dataclasses

    base = packed_seq_params.PackedSeqParams
    if "total_tokens" in {f.name for f in dataclasses.fields(base)}:
        return
    packed_seq_params.PackedSeqParams = dataclasses.make_dataclass(
        "PackedSeqParams", [("total_tokens", "int | None", dataclasses.field(default=None))], bases=(base,)
    )
