"""How one loss call is evaluated: :class:`EvaluationForm`, one object decided before the tensor math.

The same values in every form (``tests/core/test_metrics.py`` and ``test_inputs.py`` compare them);
what differs is the cost on each device:

* **row by row** (the CPU's, eager): each per-token row of a metric or an input check is reduced
  on its own, with no copy: on a CPU, copying rows into a matrix costs more than it saves. With
  ``host_reads`` (unsharded), checks may read a value on the host to skip work they can tell is
  not needed: inputs that are all finite are used as given, a log-prob input nowhere above 0
  needs no comparison;
* **batched** (an accelerator's, eager): rows stacked and reduced together, a handful of kernels
  whatever their number, and no host read before the one transfer at the end of the call;
* **compiled** (``compile: true``): the tensor core under ``torch.compile``, row by row unless the
  loss forces a form (inductor fuses the per-row reductions into one multi-output reduction,
  where stacking adds copies and a matmul), no host read.

``CorrectedPGLoss.compute`` decides the form once per call, outside any compiled region
(:func:`evaluation_form`): from the device, whether the call is
sharded and whether the caller compiles, none of which the loss knows when it is built. A
compiled core specialises on the form's plain bools.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

__all__ = ["ROW_BY_ROW", "EvaluationForm", "batched_evaluation", "evaluation_form"]


def batched_evaluation(device: torch.device, forced: Optional[bool] = None) -> bool:
    """Whether per-token rows are stacked and reduced together (few kernels) or one by one (no copies).

    Stacked on accelerators, where a kernel launch costs more than a copy of a ``[B, T]`` row;
    row by row on the CPU, where it is the other way round. ``forced`` (``CorrectedPGLoss``'s
    ``batched_metrics``) picks either (``benchmarks/bench_ops.py`` counts both; the tests
    compare them).
    """
    if forced is not None:
        return forced
    return device.type != "cpu"


@dataclass(frozen=True)
class EvaluationForm:
    """The form of one evaluation (see the module docstring); the default: row by row, nothing read on the host."""

    batched: bool = False
    """Per-token rows stacked and reduced together (the accelerator form) rather than one by one."""
    host_reads: bool = False
    """Checks may read a tensor's value on the host to skip work (eager, CPU, row by row, unsharded)."""
    compiled: bool = False
    """The tensor core runs under ``torch.compile``."""

    @classmethod
    def for_device(cls, device: torch.device, batched: Optional[bool] = None) -> "EvaluationForm":
        """The eager form of ``device`` with nothing read on the host (``batched`` forces the rows' form)."""
        return cls(batched=batched_evaluation(device, batched))


#: The default form: eager, row by row, nothing read on the host (a standalone caller's; the same values as any).
ROW_BY_ROW = EvaluationForm()


def evaluation_form(loss: Any, device: torch.device, groups: Any) -> EvaluationForm:
    """The :class:`~nemo_rs_plugin.core.evaluation.EvaluationForm` of a call of ``loss`` on ``device``.

    ``compiled``: ``loss.cfg.compile`` is on, the call is not sharded (``groups`` active: the
    collectives stay eager) and the caller is not compiling the loss itself. ``batched``: by device
    (:func:`batched_evaluation`) when eager, row by row when compiled
    (inductor fuses the per-row reductions into one multi-output reduction, where stacking the rows
    for a matrix-vector product adds copies and a matmul: ``benchmarks/bench_kernels.py``,
    docs/performance.md#torchcompile), unless ``loss.batched_metrics`` forces a form.
    ``host_reads``: only where a read costs no device sync and changes no graph: eager (neither
    compiled here nor inside the caller's compile), on the CPU, row by row (the batched form on a CPU
    stands for the accelerator and reads nothing), unsharded (every rank of a sharded call must
    declare the same metric rows, whatever its own values). Everywhere else the loss makes its one
    host transfer at the end of the call and nothing else.
    """
    sharded = bool(getattr(groups, "active", False))
    callers_compile = torch.compiler.is_compiling()
    compiled = bool(loss.cfg.compile) and not sharded and not callers_compile
    forced = loss.batched_metrics
    batched = batched_evaluation(device, False if forced is None and compiled else forced)
    host_reads = device.type == "cpu" and not batched and not compiled and not sharded and not callers_compile
    return EvaluationForm(batched=batched, host_reads=host_reads, compiled=compiled)
