"""All collectives of the loss, in one place.

When context parallelism (CP), or a sequence-parallel tensor-parallel (TP) layout, splits a
sequence's tokens over ranks, each rank holds only part of every per-sequence statistic. A
mask derived from a partial sum is wrong and differs between ranks, so every per-sequence
statistic passes through :func:`reduce_sequence_statistics` *before* any mask or weight is
derived from it. With no group (or a group of one rank, or no initialised process group)
every function here is a no-op that issues no collective, so the same code serves
single-process runs on NeMo-RL's gathered log-probs.

Entry points:

* :class:`SequenceGroups`: the process groups that split a sequence's tokens, and the
  data-parallel group that holds the other sequences of the batch.
* :func:`reduce_sequence_statistics`: detached statistics that feed masks: one SUM and at
  most one MAX all-reduce per group, O(batch) bytes.
* :func:`reduce_batch_totals`: detached totals over the whole batch (IS batch
  normalisation): one SUM of two numbers per group.
* :func:`all_reduce_sum_with_grad`: differentiable SUM (GSPO ratio, sequence-level loss).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, overload

import torch
import torch.distributed as dist

__all__ = [
    "SequenceGroups",
    "reduce_sequence_statistics",
    "reduce_batch_totals",
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


class SequenceGroups(NamedTuple):
    """Process groups over which a sequence's tokens are split, and the batch's other ranks.

    Attributes:
        groups: the groups to reduce over, in order (typically the CP group; add the TP group
            only when tokens, not just vocabulary, are split over TP ranks). Passing
            Megatron's combined ``tensor_and_context_parallel`` group instead of two groups
            halves the number of collectives.
        data_parallel: the data-parallel group: ranks that hold *other* sequences of the same
            batch (Megatron's ``get_data_parallel_group()``, without CP). Only batch-wide
            totals (``is_batch_normalization: data_parallel``) are reduced over it; no
            per-sequence statistic ever is. ``None`` when there is none.

    A ``NamedTuple`` rather than a dataclass: torch.compile (dynamo, torch 2.11) cannot wrap a
    dataclass instance it meets without a source (a method default of an object built inside
    the compiled core), which broke the core into 13 graphs; a tuple it wraps.
    """

    groups: tuple[Any, ...] = ()
    data_parallel: Any = None

    @classmethod
    def of(cls, *groups: Any, data_parallel: Any = None) -> "SequenceGroups":
        """Build from groups, dropping ``None`` and single-rank groups."""
        dp = data_parallel if group_is_active(data_parallel) else None
        return cls(tuple(g for g in groups if group_is_active(g)), dp)

    @property
    def active(self) -> bool:
        """True when any reduction will actually be issued.

        ``len``, not ``bool``: torch 2.11's dynamo cannot trace ``bool`` of a tuple (a graph break).
        """
        return len(self.groups) > 0


NO_GROUPS = SequenceGroups()


@overload
def reduce_sequence_statistics(
    sums: torch.Tensor, maxima: torch.Tensor, groups: SequenceGroups = ...
) -> tuple[torch.Tensor, torch.Tensor]: ...


@overload
def reduce_sequence_statistics(
    sums: torch.Tensor, maxima: None, groups: SequenceGroups = ...
) -> tuple[torch.Tensor, None]: ...


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


def reduce_batch_totals(
    totals: torch.Tensor,
    groups: SequenceGroups = NO_GROUPS,
    *,
    tokens_split: bool,
    across_data_parallel: bool,
) -> torch.Tensor:
    """SUM-all-reduce detached totals of the whole batch (e.g. ``[sum of weights, units]``).

    SUM over ``groups.groups`` when ``tokens_split`` (the totals are sums over local tokens,
    and a sequence's tokens are split across those ranks; per-sequence values are already
    identical there and must not be summed again), then over ``groups.data_parallel`` when
    ``across_data_parallel`` (its ranks hold the batch's other sequences). One collective of
    ``totals.numel()`` numbers per group; none without groups.
    """
    targets = list(groups.groups) if tokens_split else []
    if across_data_parallel and groups.data_parallel is not None:
        targets.append(groups.data_parallel)
    sums, _ = reduce_sequence_statistics(totals.unsqueeze(-1), None, SequenceGroups(tuple(targets)))
    return sums.squeeze(-1)


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
