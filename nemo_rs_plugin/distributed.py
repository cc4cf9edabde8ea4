"""All collectives of the loss, in one place.

When context parallelism (CP), or a sequence-parallel tensor-parallel (TP) layout, splits a
sequence's tokens over ranks, each rank holds only part of every per-sequence statistic. A
mask derived from a partial sum is wrong and differs between ranks, so every per-sequence
statistic passes through :func:`reduce_sequence_statistics` *before* any mask or weight is
derived from it. With no group (or a group of one rank, or no initialised process group)
every function here is a no-op that issues no collective, so the same code serves
single-process runs on NeMo-RL's gathered log-probs.

Entry points:

* :class:`SequenceGroups`: the process groups that split a sequence's tokens.
* :func:`reduce_sequence_statistics`: detached statistics that feed masks: one SUM and at
  most one MAX all-reduce per group, O(batch) bytes.
* :func:`all_reduce_sum_with_grad`: differentiable SUM (GSPO ratio, sequence-level loss).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist

__all__ = [
    "SequenceGroups",
    "reduce_sequence_statistics",
    "all_reduce_sum_with_grad",
    "group_is_active",
]


def group_is_active(group: Any) -> bool:
    """True when ``group`` is a process group of more than one rank.

    ``None``, an uninitialised ``torch.distributed`` or a group of one rank mean "nothing to
    reduce". We never fall back to the WORLD group: a missing group is a no-op, not WORLD.
    """
    if group is None or not dist.is_available() or not dist.is_initialized():
        return False
    return dist.get_world_size(group) > 1


@dataclass(frozen=True)
class SequenceGroups:
    """Process groups over which a sequence's tokens are split.

    Attributes:
        groups: the groups to reduce over, in order (typically the CP group; add the TP group
            only when tokens, not just vocabulary, are split over TP ranks). Passing
            Megatron's combined ``tensor_and_context_parallel`` group instead of two groups
            halves the number of collectives.
    """

    groups: tuple[Any, ...] = field(default_factory=tuple)

    @classmethod
    def of(cls, *groups: Any) -> "SequenceGroups":
        """Build from groups, dropping ``None`` and single-rank groups."""
        return cls(tuple(g for g in groups if group_is_active(g)))

    @property
    def active(self) -> bool:
        """True when any reduction will actually be issued."""
        return bool(self.groups)


NO_GROUPS = SequenceGroups()


def reduce_sequence_statistics(
    sums: torch.Tensor,
    maxima: Optional[torch.Tensor],
    groups: SequenceGroups = NO_GROUPS,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """All-reduce detached per-sequence statistics over the groups that split sequences.

    SUM over each group for ``sums`` (masked sums of log-ratios and KL estimates, valid-token
    counts, non-finite counts) and MAX for ``maxima`` (per-sequence maxima; minima are passed
    negated). A sequence's tokens are split across those ranks, so these partial values must
    be reduced *before* thresholding, or the ranks disagree on which sequences to reject.

    Args:
        sums: ``[K, B]`` stacked statistics to sum.
        maxima: ``[J, B]`` stacked statistics to max-reduce, or ``None``.
        groups: the groups that split the sequences; empty means no collective.

    Returns:
        The reduced ``(sums, maxima)``, detached.
    """
    sums = sums.detach()
    maxima = maxima.detach() if maxima is not None else None
    if not groups.active:
        return sums, maxima
    sums = sums.clone()
    maxima = maxima.clone() if maxima is not None and maxima.numel() else maxima
    for group in groups.groups:
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
        if maxima is not None and maxima.numel():
            dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=group)
    return sums, maxima


class _AllReduceSumWithGrad(torch.autograd.Function):
    """SUM all-reduce whose backward is a SUM all-reduce of the gradient.

    Each rank's loss uses the reduced value ``S = sum_r x_r``; the training objective is the
    sum of the ranks' losses (their gradients are summed across CP by the data-parallel
    reduction), so ``dL/dx_r = sum_r' dL_r'/dS``.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:  # noqa: D102
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: D102
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad, None


def all_reduce_sum_with_grad(x: torch.Tensor, groups: SequenceGroups = NO_GROUPS) -> torch.Tensor:
    """Differentiable SUM over the groups that split sequences (no-op without groups)."""
    for group in groups.groups:
        x = _AllReduceSumWithGrad.apply(x, group)
    return x
