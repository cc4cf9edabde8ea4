"""The one seam through which NeMo-RL's wrappers hand a plugin loss their context.

NeMo-RL calls the loss through one of three wrappers from ``nemo_rl.algorithms.loss`` (the
same interfaces in v0.6.0, v0.7.0 and main), each holding something the loss's arguments do
not carry:

* ``wrap_loss_fn_with_input_preparation`` (no packing; Megatron), and
  ``SequencePackingFusionLossWrapper`` (Megatron with ``sequence_packing.fuse_loss``): the
  keywords NeMo-RL bound (``functools.partial``) into their ``prepare_fn``:
  ``sampling_params`` (training-time top-k/top-p) and, from v0.7.0, ``chunk_size``
  (``policy.logprob_chunk_size``). A LOGIT-input loss (``sharded_logits_input``) needs them:
  NeMo-RL applies them only in its own log-prob preparation.
* ``SequencePackingLossWrapper`` (packing without ``fuse_loss``, the DTensor worker,
  automodel), which calls the loss once per sequence: those keywords, and its whole
  microbatch ``data`` and sequence count, with which the loss gathers its per-sequence calls
  into one (:mod:`nemo_rs_plugin.nemo_rl.packing`).

:func:`install` puts the plugin's own versions in place of those three names, in
``nemo_rl.algorithms.loss`` (where NeMo-RL's worker code imports them from),
``nemo_rl.algorithms.loss.wrapper`` and every NeMo-RL module already imported that holds
NeMo-RL's originals (a worker that imported its training code before it unpickled the loss).
Each is NeMo-RL's own: a subclass, or a function that calls NeMo-RL's. When the loss is a
plugin loss (it has ``nemo_rl_call``), it opens a :class:`~nemo_rs_plugin.nemo_rl.packing.HostCall`
holding that context on the loss around NeMo-RL's own call, which runs unchanged; for any other
loss it is NeMo-RL's call and nothing else. The loss reads the context only while it is open:
nothing is read from the call stack.

When it runs: the start-up hook's activation, when NeMo-RL imports ``nemo_rl.algorithms.loss``
(in the driver, before any worker code imports the names), and the plugin loss's construction
and unpickling (in NeMo-RL's Ray workers, whose environments may lack the start-up hook).

If it cannot run (a NeMo-RL without one of the names): :func:`install` returns the problems,
the activation warns, and the plugin loss refuses to be built (:func:`require`), rather than be
called without its context. NeMo-RL's original ``SequencePackingLossWrapper`` also refuses a
plugin loss (a reference to it the installation could not reach), so the loss is never
called per sequence without knowing it.
"""

from __future__ import annotations

import functools
import sys
from typing import Any, Callable, Mapping, Optional

from nemo_rs_plugin.nemo_rl.packing import HostCall

__all__ = [
    "LOSS_PACKAGE",
    "SEAM_NAMES",
    "SeamNotInstalledError",
    "install",
    "installed_in",
    "prepare_keywords",
    "require",
]

#: NeMo-RL's package whose wrappers the seam replaces, and the module that defines them.
LOSS_PACKAGE = "nemo_rl.algorithms.loss"
WRAPPER_MODULE = "nemo_rl.algorithms.loss.wrapper"
#: The names replaced (NeMo-RL v0.6.0, v0.7.0 and main).
PER_SEQUENCE = "SequencePackingLossWrapper"
FUSED = "SequencePackingFusionLossWrapper"
UNPACKED = "wrap_loss_fn_with_input_preparation"
SEAM_NAMES = (PER_SEQUENCE, FUSED, UNPACKED)
#: Marks the plugin's replacements (holding NeMo-RL's original), and a package installed into.
MARK = "_nemo_rs_seam_original"
INSTALLED = "_nemo_rs_seam_installed"
#: The plugin loss's method that takes a HostCall (``RSClippedPGLossFn.nemo_rl_call``).
ENTRY = "nemo_rl_call"


class SeamNotInstalledError(RuntimeError):
    """NeMo-RL's wrappers cannot hand the plugin loss its context (a NeMo-RL that changed them)."""


def prepare_keywords(prepare_fn: Any) -> dict:
    """The keywords NeMo-RL bound into a wrapper's ``prepare_fn`` (``{}``: not a ``functools.partial``)."""
    return dict(prepare_fn.keywords) if isinstance(prepare_fn, functools.partial) else {}


def _entry(loss_fn: Any) -> Optional[Callable[[HostCall], Any]]:
    return getattr(loss_fn, ENTRY, None)


def _refuse_original(original: type) -> None:
    """NeMo-RL's own per-sequence wrapper refuses a plugin loss (its subclass, the seam's, does not)."""
    init = original.__init__  # type: ignore[misc]
    if getattr(init, MARK, None) is not None:
        return

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        loss_fn = kwargs.get("loss_fn", args[0] if args else None)
        if type(self) is original and _entry(loss_fn) is not None:
            raise SeamNotInstalledError(
                f"NeMo-RL's own {PER_SEQUENCE} was given a nemo-rs-plugin loss: it was reached through a "
                f"reference the plugin could not replace ({original.__module__}), and would call the loss "
                "once per sequence without its microbatch. Run `nemo-rs doctor`."
            )
        init(self, *args, **kwargs)

    setattr(__init__, MARK, init)
    __init__.__wrapped__ = init  # type: ignore[attr-defined]
    __init__.__doc__ = init.__doc__
    original.__init__ = __init__  # type: ignore[misc]


def _per_sequence_wrapper(original: type) -> type:
    """NeMo-RL's ``SequencePackingLossWrapper``, handing a plugin loss its microbatch and keywords."""

    def __call__(self: Any, next_token_logits: Any, data: Any, *args: Any, **kwargs: Any) -> Any:
        entry = _entry(self.loss_fn)
        if entry is None:
            return original.__call__(self, next_token_logits, data, *args, **kwargs)
        call = HostCall(prepare_keywords(self.prepare_fn), data, len(self.cu_seqlens_q) - 1)
        with entry(call):
            result = original.__call__(self, next_token_logits, data, *args, **kwargs)
        call.check_complete()
        return result

    return _subclass(original, __call__)


def _fused_wrapper(original: type) -> type:
    """NeMo-RL's ``SequencePackingFusionLossWrapper`` (one call), handing a plugin loss its keywords."""

    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        entry = _entry(self.loss_fn)
        if entry is None:
            return original.__call__(self, *args, **kwargs)
        with entry(HostCall(prepare_keywords(self.prepare_fn))):
            return original.__call__(self, *args, **kwargs)

    return _subclass(original, __call__)


def _subclass(original: type, call: Callable[..., Any]) -> type:
    call.__doc__ = original.__call__.__doc__
    cls = type(original.__name__, (original,), {"__call__": call, "__module__": __name__, MARK: original})
    cls.__qualname__ = original.__qualname__
    cls.__doc__ = original.__doc__
    return cls


def _unpacked_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    """NeMo-RL's ``wrap_loss_fn_with_input_preparation``, handing a plugin loss its ``prepare_fn``'s keywords."""

    @functools.wraps(original)
    def wrap_loss_fn_with_input_preparation(
        next_token_logits: Any,
        data: Any,
        global_valid_seqs: Any,
        global_valid_toks: Any,
        loss_fn: Any,
        prepare_fn: Any,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        entry = _entry(loss_fn)
        if entry is None:
            return original(
                next_token_logits, data, global_valid_seqs, global_valid_toks, loss_fn, prepare_fn, *args, **kwargs
            )
        with entry(HostCall(prepare_keywords(prepare_fn))):
            return original(
                next_token_logits, data, global_valid_seqs, global_valid_toks, loss_fn, prepare_fn, *args, **kwargs
            )

    setattr(wrap_loss_fn_with_input_preparation, MARK, original)
    return wrap_loss_fn_with_input_preparation


_MAKERS: Mapping[str, Callable[[Any], Any]] = {
    PER_SEQUENCE: _per_sequence_wrapper,
    FUSED: _fused_wrapper,
    UNPACKED: _unpacked_wrapper,
}
#: id(NeMo-RL's original) -> (original, the plugin's replacement): one replacement per original.
_REPLACEMENTS: dict[int, tuple[Any, Any]] = {}


def _replacement(name: str, original: Any) -> Any:
    entry = _REPLACEMENTS.get(id(original))
    if entry is None or entry[0] is not original:
        entry = (original, _MAKERS[name](original))
        _REPLACEMENTS[id(original)] = entry
    return entry[1]


def installed_in(module: Any) -> list[str]:
    """The seam's names that ``module`` binds to the plugin's replacements."""
    return [name for name in SEAM_NAMES if getattr(getattr(module, name, None), MARK, None) is not None]


def install(package: Any = None) -> list[str]:
    """Put the plugin's wrappers in place of NeMo-RL's (idempotent); returns the problems (``[]``: in place).

    ``package``: NeMo-RL's ``nemo_rl.algorithms.loss`` (default: the imported one; none imported
    means nothing to do yet). Every module named ``nemo_rl`` or ``nemo_rl.*`` already imported
    that binds one of NeMo-RL's originals gets the replacement too.
    """
    package = package if package is not None else sys.modules.get(LOSS_PACKAGE)
    if package is None:
        return []
    if getattr(package, INSTALLED, False):
        return []
    problems = []
    swaps = {}
    for name in SEAM_NAMES:
        current = getattr(package, name, None)
        original = getattr(current, MARK, current)
        if original is None or not callable(original) or (name != UNPACKED and not isinstance(original, type)):
            problems.append(
                f"{LOSS_PACKAGE} has no {'function' if name == UNPACKED else 'class'} {name}: this NeMo-RL calls "
                "the loss some other way, and nemo-rs-plugin cannot hand its loss the wrapper's context there"
            )
            continue
        swaps[id(original)] = (original, _replacement(name, original), name)
    if PER_SEQUENCE in [n for _, _, n in swaps.values()]:
        _refuse_original(next(o for o, _, n in swaps.values() if n == PER_SEQUENCE))
    modules = [package] + [
        m for k, m in list(sys.modules.items()) if (k == "nemo_rl" or k.startswith("nemo_rl.")) and m is not package
    ]
    for module in modules:
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for key, value in list(namespace.items()):
            swap = swaps.get(id(value))
            if swap is not None and swap[0] is value:
                setattr(module, key, swap[1])
    if not problems:
        setattr(package, INSTALLED, True)
    return problems


def require(package: Any = None) -> None:
    """:func:`install`, raising :class:`SeamNotInstalledError` with the problems where it cannot."""
    problems = install(package)
    if problems:
        raise SeamNotInstalledError(
            "nemo-rs-plugin cannot train with this NeMo-RL's loss wrappers:\n  " + "\n  ".join(problems)
        )
