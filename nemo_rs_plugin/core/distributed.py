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
* :func:`agree_before_collectives`: the ranks of the loss's groups agree that every rank's
  inputs are well-formed (the same shapes, no local problem) before the first collective whose
  size depends on them; otherwise every rank raises a ``ValueError`` with the cause, and none waits.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Sequence, overload

import torch
import torch.distributed as dist

__all__ = [
    "SequenceGroups",
    "reduce_sequence_statistics",
    "reduce_batch_totals",
    "all_reduce_sum_with_grad",
    "group_is_active",
    "agree_before_collectives",
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


#: Bytes of a problem's text carried in the call header (a longer text is cut there).
_HEADER_TEXT_BYTES = 1024
#: Dimensions of each tensor's shape in the header (the loss's inputs have at most 3).
_HEADER_DIMS = 3


def agree_before_collectives(
    problem: Optional[BaseException],
    shapes: Sequence[tuple[str, Optional[tuple[int, ...]]]],
    groups: Sequence[tuple[str, Any]],
    device: torch.device,
) -> None:
    """Every rank of ``groups`` learns whether any rank has a problem, before a collective that would wait for it.

    A problem one rank sees alone (a tensor's shape, a local setting) would otherwise raise on
    that rank while its peers wait in the loss's next collective until the job's collective
    timeout (NCCL: 10-30 minutes). Each rank sends a fixed-size header (its global rank, its
    problem's text, the shape of each named tensor) to its peers with one ``all_gather`` per
    group, in order. A tensor whose shape differs between ranks is a problem of its own, named
    with the shape on each rank. A rank that learns of a problem in one group passes it on in
    the next, so over a TP x CP grid every rank knows it after the two gathers. Then every rank
    raises a ``ValueError`` with that text: the same text within a group (a shape that differs
    only between groups of the other kind is named by the ranks each group compared); with no
    problem anywhere, nothing happens.

    Args:
        problem: this rank's local problem (an exception it caught), or ``None``.
        shapes: ``(name, shape or None)`` of the tensors every rank of a group must hold alike,
            in the same order on every rank.
        groups: ``(label, process group)`` pairs (``"tensor-parallel"``, ...); ``None`` and
            one-rank groups are skipped. Without any active group ``problem`` is raised as it is.
        device: the device of the inputs. Under NCCL the header travels on a side stream of that
            device rather than the compute stream; NCCL still runs a communicator's collectives
            in order, so reading it waits for the collectives the forward pass queued on the same
            group (Megatron's TP all-reduces), not for the rest of the queued compute.

    Cost: one all-gather of ``3 + 4 * len(shapes) + 128`` int64 numbers per rank and group, and
    one read of the gathered rows on the host per call (per sequence under NeMo-RL's
    per-sequence packing wrapper): docs/performance.md#call-header.
    """
    active = [(label, group) for label, group in groups if group_is_active(group)]
    if not active:
        if problem is not None:
            raise problem
        return
    rank = dist.get_rank()
    text = None if problem is None else f"rank {rank}: {type(problem).__name__}: {problem}"
    for label, group in active:
        rows = _all_gather_header(_encode_header(rank, text, shapes), group, device)
        # A problem already known (this rank's, or passed on by a peer) before a new disagreement:
        # every rank then names the first problem found, in the groups' order.
        text = _first_problem(rows) or _shape_disagreement(rows, shapes, label)
    if text is not None:
        error = ValueError(f"{text} (every rank of the loss's tensor- and context-parallel groups raises this error)")
        raise error from problem


def _encode_header(
    rank: int, text: Optional[str], shapes: Sequence[tuple[str, Optional[tuple[int, ...]]]]
) -> list[int]:
    """``[rank, has problem, text bytes, 4 ints per shape (ndim or -1, dims), the text as int64 words]``."""
    # Cut at a character's boundary: every rank decodes the same bytes, so the cut must not split one.
    raw = (text or "").encode("utf-8")[:_HEADER_TEXT_BYTES].decode("utf-8", "ignore").encode("utf-8")
    header = [rank, int(text is not None), len(raw)]
    for _, shape in shapes:
        dims = list(shape or ())[:_HEADER_DIMS]
        header += [-1 if shape is None else len(shape)] + dims + [0] * (_HEADER_DIMS - len(dims))
    padded = raw.ljust(_HEADER_TEXT_BYTES, b"\0")
    header += [int.from_bytes(padded[i : i + 8], "little", signed=True) for i in range(0, _HEADER_TEXT_BYTES, 8)]
    return header


def _all_gather_header(header: list[int], group: Any, device: torch.device) -> list[list[int]]:
    """Every rank's header in ``group``, read on the host."""
    size = dist.get_world_size(group)
    if device.type == "cuda" and "nccl" in str(dist.get_backend(group)).lower():
        with torch.cuda.stream(_header_stream(device)):
            local = torch.tensor(header, dtype=torch.int64, device=device)
            parts = [torch.empty_like(local) for _ in range(size)]
            dist.all_gather(parts, local, group=group)
            return torch.stack(parts).tolist()
    local = torch.tensor(header, dtype=torch.int64)
    parts = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(parts, local, group=group)
    return torch.stack(parts).tolist()


#: One side stream per CUDA device for the header (a stream per call would spread the caching
#: allocator's small blocks over many streams).
_HEADER_STREAMS: dict[Any, Any] = {}


def _header_stream(device: torch.device) -> Any:
    key = device.index if device.index is not None else torch.cuda.current_device()
    if key not in _HEADER_STREAMS:
        _HEADER_STREAMS[key] = torch.cuda.Stream(device=key)
    return _HEADER_STREAMS[key]


def _decode_text(row: list[int], n_shapes: int) -> str:
    start = 3 + (1 + _HEADER_DIMS) * n_shapes
    raw = b"".join(int(w).to_bytes(8, "little", signed=True) for w in row[start:])
    return raw[: row[2]].decode("utf-8", errors="replace")


def _first_problem(rows: list[list[int]]) -> Optional[str]:
    """The text of the first rank (in group order) that reports a problem."""
    n_shapes = (len(rows[0]) - 3 - _HEADER_TEXT_BYTES // 8) // (1 + _HEADER_DIMS)
    for row in rows:
        if row[1]:
            return _decode_text(row, n_shapes)
    return None


def _shape_disagreement(
    rows: list[list[int]], shapes: Sequence[tuple[str, Optional[tuple[int, ...]]]], label: str
) -> Optional[str]:
    """The first named tensor whose shape differs between the ranks, with the shape on each rank."""
    width = 1 + _HEADER_DIMS
    for i, (name, _) in enumerate(shapes):
        cut = slice(3 + i * width, 3 + (i + 1) * width)
        seen: dict[str, list[int]] = {}
        for row in rows:
            ndim, *dims = row[cut]
            shown = "absent" if ndim < 0 else str(tuple(dims[: min(ndim, _HEADER_DIMS)]))
            seen.setdefault(shown, []).append(row[0])
        if len(seen) > 1:
            sides = "; ".join(
                f"{shape} on rank{'s' * (len(r) > 1)} {', '.join(map(str, r))}" for shape, r in seen.items()
            )
            return (
                f"{name}: shape differs between the ranks of one {label} group ({sides}); every rank of the "
                f"group must be given the same shapes (the same microbatch, its logits cut alike)"
            )
    return None
