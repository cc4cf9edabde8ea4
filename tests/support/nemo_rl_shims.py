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
* ``uvicorn``, ``fastapi``, ``mlflow``, ``swanlab``, ``wandb``, ``hydra``: imported by NeMo-RL
  main's loss module chain (servers, loggers) and never called on the loss path; the lent GPU
  machine lacks them, so its comparison with NeMo-RL's loss stands them in the same way.
* ``ray``: NeMo-RL's loss module reaches it at import time (``@ray.remote`` classes of the
  cluster code), never on the loss path. On a machine without ray (the lent GPU machine has no
  network and no room for its wheel) a permissive stand-in answers those import-time uses:
  every attribute is a callable that returns what it decorates. Only when the real ``ray``
  is missing: the finder is asked last.
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
# Top-level packages NeMo-RL main's loss module reaches only at import time (its servers, loggers
# and config CLI), missing on the lent GPU machine: stood in only when the real import failed.
_IMPORT_TIME_ONLY = {"modelopt", "uvicorn", "fastapi", "mlflow", "swanlab", "wandb", "hydra"}


class _StandInModule(types.ModuleType):
    """A module whose every public attribute is a fresh empty class (import-time names only)."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        value = type(name, (), {"__module__": self.__name__, "__init__": lambda self, *a, **k: None})
        setattr(self, name, value)
        return value


class _Anything:
    """Import-time stand-in for a ray name: a decorator, a decorator factory, a base, a type hint."""

    def __init__(self, name: str = "ray") -> None:
        self._name = name

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and not kwargs and callable(args[0]):
            return args[0]  # @ray.remote on a class or function: leave it as it is
        return self  # @ray.remote(num_gpus=1): a decorator that leaves its target as it is

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything(f"{self._name}.{name}")

    def __getitem__(self, item):
        return self

    def __mro_entries__(self, bases):
        return (object,)


class _RayStandInModule(types.ModuleType):
    """``ray`` (and its submodules) when ray is not installed: see :class:`_Anything`."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        value = _Anything(f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        top = fullname.split(".")[0]
        if fullname.startswith(_STAND_IN_PREFIXES) or top in _IMPORT_TIME_ONLY or top == "ray":
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        is_ray = spec.name == "ray" or spec.name.startswith("ray.")
        module = (_RayStandInModule if is_ray else _StandInModule)(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


def stand_ins() -> list[str]:
    """Names of the modules that were replaced by stand-ins in this process."""
    return sorted(name for name, mod in sys.modules.items() if isinstance(mod, (_StandInModule, _RayStandInModule)))


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
