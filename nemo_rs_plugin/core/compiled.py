"""Opt-in ``torch.compile`` of the loss's pure-tensor core (the recipe field ``loss_fn.compile``).

:meth:`CorrectedPGLoss.compute <nemo_rs_plugin.core.loss.CorrectedPGLoss.compute>` runs in three
parts: input validation (Python, eager), the tensor math (``CorrectedPGLoss._tensors``: the
loss and the metrics evaluated into one ``[M]`` vector by ``MetricSet.stack``, no host
transfer; only that vector leaves the graph) and
:meth:`MetricSet.finalize <nemo_rs_plugin.core.reporting.metrics.MetricSet.finalize>` (the one ``tolist()``,
eager). With ``compile: true`` in the loss section the middle part is
``torch.compile(..., dynamic=True)``: sequence length and batch size are symbolic from the
first call, so microbatches of other sizes reuse the same graph instead of recompiling.
Each distinct configuration (its flags are guarded constants) compiles once; the compiled
function is built once per process and backend (``CorrectedPGLoss(compile_backend=...)``,
default ``inductor``; ``aot_eager`` traces the same graph without generating kernels).

Inductor runs with ``force_pointwise_cat`` (:data:`INDUCTOR_OPTIONS`): the core ends in one
``[M]`` vector of a few dozen metrics, and by default each ``cat``/``stack`` input is a copy
kernel of its own (always on CPU, past eight inputs on CUDA), most of the plain
configuration's kernels. As one pointwise kernel the vector costs one kernel (the counts:
``benchmarks/bench_kernels.py``, docs/performance.md#torchcompile).

Left eager, whatever the field says:

* the sharded TP/CP path (``groups`` active): its collectives stay outside the graph;
* any call while ``torch.compiler.is_compiling()`` (the caller compiles the loss itself).

See docs/performance.md#torchcompile.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

import torch

from nemo_rs_plugin.core.evaluation import EvaluationForm

__all__ = ["INDUCTOR_OPTIONS", "core_fn"]

_COMPILED: dict[tuple[Callable, str], Callable] = {}

# Every cat/stack of the core as one pointwise kernel instead of a copy kernel per input.
INDUCTOR_OPTIONS = {"force_pointwise_cat": True}


def _compile(fn: Callable, backend: str) -> Callable:
    options: Optional[dict[str, Union[str, int, bool, Callable[..., Any]]]] = None
    if backend == "inductor":
        from torch._inductor import config as inductor_config

        options = {k: v for k, v in INDUCTOR_OPTIONS.items() if hasattr(inductor_config, k)}
    return torch.compile(fn, dynamic=True, backend=backend, options=options or None)


def core_fn(loss: Any, form: EvaluationForm) -> Callable:
    """The function computing ``(loss, MetricSet)`` for ``loss`` (called with ``loss`` first).

    The plain ``type(loss)._tensors``, or where ``form.compiled`` its compiled twin for
    ``loss.compile_backend`` (built on first use and shared by every instance).
    """
    fn = type(loss)._tensors
    if not form.compiled:
        return fn
    backend = loss.compile_backend
    compiled = _COMPILED.get((fn, backend))
    if compiled is None:
        compiled = _COMPILED[(fn, backend)] = _with_tracing_settings(_compile(fn, backend))
    return compiled


def _with_tracing_settings(compiled: Callable) -> Callable:
    """Run ``compiled`` with duck sizing off and Python floats specialised (tracing settings).

    Duck sizing (torch's default) gives two dimensions that happen to be equal at the first
    call one symbol, and a later microbatch where they differ recompiles: e.g. the batch
    size and the length of the global batch a ``rewards`` view was sliced from. Unspecialised
    floats (``specialize_float=False``, the default under ``dynamic=True``) make every Python
    float the core reads (``EPS``, clip bounds, the KL coefficient: constants of a
    configuration) a graph input that each call converts to a tensor on the host; specialised,
    they are constants of the graph, guarded by value (so a float that changes per call would
    recompile: ``CorrectedPGLoss.compute`` turns Python-number global counts into tensors
    before the core).

    Both settings are read only while dynamo traces, which may happen on any call (a
    recompilation), so they are set around each call: as plain attribute writes, since
    ``config.patch`` builds a context-manager class per call (~16 us, 3-4% of a lone B = 1
    call; benchmarks/bench_packing.py --compiled).
    """
    try:
        from torch._dynamo import config as dynamo_config
        from torch.fx.experimental import _config as fx_config
    except ImportError:  # pragma: no cover - older torch: keep its defaults
        return compiled
    settings = [
        (module, name, value)
        for module, name, value in ((fx_config, "use_duck_shape", False), (dynamo_config, "specialize_float", True))
        if hasattr(module, name)
    ]

    def run(*args, **kwargs):
        saved = [getattr(module, name) for module, name, _ in settings]
        try:
            for module, name, value in settings:
                setattr(module, name, value)
            return compiled(*args, **kwargs)
        finally:
            for (module, name, _), old in zip(settings, saved):
                setattr(module, name, old)

    return run
