"""How the declared metrics are evaluated: the kernels behind ``MetricSet``.

Row totals one dot product at a time (the CPU form: no copy), masked totals stacked into one
matrix-vector product per mask (the GPU form: a handful of kernels whatever the number of
metrics), masked extrema in one ``amin`` and one ``amax``, and the one reduction of the
stacked vector over the ranks that split a sequence (SUM, MAX, MIN rows; replicated rows
untouched); and the few values computed on the host from the transferred ones (the
:data:`HostFormula` entries: data, so that the metric set evaluates them without calling back
into the module that declared them). :mod:`nemo_rs_plugin.core.reporting.metrics` declares and finalizes;
this module computes.
"""

from __future__ import annotations

import math
from typing import Iterable, Mapping, NamedTuple, Sequence, Union

import torch

from nemo_rs_plugin.core.distributed import SequenceGroups, reduce_sequence_statistics

__all__ = [
    "ClippedExtreme",
    "Constant",
    "EffectiveSampleSize",
    "HostFormula",
    "host_value",
    "masked_extrema",
    "masked_extremum",
    "reduce_over_ranks",
    "row_totals",
    "stacked_masked_totals",
]


class Constant(NamedTuple):
    """A value known without reading a tensor (a term that is off, a count known to be 0)."""

    value: float = 0.0


class EffectiveSampleSize(NamedTuple):
    """``(sum w)^2 / (n sum w^2)`` from the normalised sums named here (the normalisation cancels); 0 without units."""

    mean: str
    sq_mean: str
    units: str


class ClippedExtreme(NamedTuple):
    """``source`` clipped to ``[low, high]``; the "no unit" sentinels (+-inf) stay as they are.

    The clamp is monotonic, so the extremes of clip(r) are clip(extremes of r).
    """

    source: str
    low: float
    high: float


#: A metric computed on the host from the reduced, transferred values (``MetricSet.derive``).
HostFormula = Union[Constant, EffectiveSampleSize, ClippedExtreme]


def host_value(formula: HostFormula, out: Mapping[str, float]) -> float:
    """The value of ``formula`` over the transferred values ``out`` (hidden ``_`` entries included)."""
    if isinstance(formula, Constant):
        return formula.value
    if isinstance(formula, EffectiveSampleSize):
        mean, sq_mean, units = out[formula.mean], out[formula.sq_mean], out[formula.units]
        return mean * mean / (units * sq_mean) if sq_mean > 0 and units > 0 else 0.0
    value = out[formula.source]
    return value if not math.isfinite(value) else min(max(value, formula.low), formula.high)


def row_totals(
    rows: Iterable[torch.Tensor],
    mask: torch.Tensor,
    flat_masks: list[tuple[torch.Tensor, torch.dtype, torch.Tensor]],
    out: list[torch.Tensor],
) -> int:
    """Append ``sum(row * mask)`` of each row to ``out``, a 0-dim tensor each (the CPU form); the row count.

    One dot product per row, read where it is (a row of another shape is expanded to the mask's,
    a view) and released before the next is taken from ``rows``. ``flat_masks`` holds each mask
    flattened in each row dtype, ``(mask, dtype, flat)``, found by identity: the caller keeps it
    for the whole call, so a mask is cast and flattened once per call, not once per row. No stack
    here: ``MetricSet.stack`` stacks every value once.
    """
    count = 0
    shape = mask.shape
    for row in rows:
        if row.requires_grad:
            row = row.detach()
        if row.shape != shape:
            row = row.expand(shape)
        flat = None
        for known, dtype, cast in flat_masks:
            if known is mask and dtype == row.dtype:
                flat = cast
                break
        if flat is None:
            flat = (mask if mask.dtype == row.dtype else mask.to(row.dtype)).reshape(-1)
            flat_masks.append((mask, row.dtype, flat))
        out.append(torch.dot(row.reshape(-1), flat))
        del row  # released before the next row is built
        count += 1
    return count


def stacked_masked_totals(groups: list, mask: torch.Tensor) -> torch.Tensor:
    """``[k]`` totals ``sum(row * mask)`` of every row of every group (a list or a stacked tensor).

    The batched form: a group given stacked (``[k, *mask.shape]``) is one matrix-vector product
    where it is, with no copy; each run of rows given one by one is one ``stack`` and one product.
    """
    first = groups[0] if isinstance(groups[0], torch.Tensor) else groups[0][0]
    flat_mask = (mask if mask.dtype == first.dtype else mask.to(first.dtype)).reshape(-1)
    parts: list[torch.Tensor] = []
    loose: list[torch.Tensor] = []

    def flush() -> None:
        if loose:
            rows = [r.expand(mask.shape) if r.shape != mask.shape else r for r in loose]
            parts.append(torch.stack(rows).reshape(len(rows), -1) @ flat_mask)
            loose.clear()

    for group in groups:
        if isinstance(group, torch.Tensor) and group.shape[1:] == mask.shape:
            flush()  # keep the rows in declaration order
            matrix = group.detach()  # already one [k, *mask.shape] tensor: no copy
            parts.append(matrix.reshape(matrix.shape[0], -1) @ flat_mask)
        else:
            loose.extend(r.detach() for r in (group if isinstance(group, (list, tuple)) else group.unbind(0)))
    flush()
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def masked_extrema(values: list[torch.Tensor], penalties: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``([k] minima, [k] maxima)`` of each ``values[i]`` where its penalty is 0 (``+-finfo.max`` if nowhere).

    One ``amin`` and one ``amax`` for all of them (the CPU form passes one row at a time).
    """
    big = torch.finfo(values[0].dtype).max
    k = len(values)
    if values[0].numel() == 0:
        return values[0].new_full((k,), big), values[0].new_full((k,), -big)
    v = torch.stack(values).reshape(k, -1) if k > 1 else values[0].reshape(1, -1)
    if all(p is penalties[0] for p in penalties):
        p = penalties[0].reshape(1, -1)  # one mask for all: broadcast, no stack
    else:
        p = torch.stack([q.expand(values[0].shape) for q in penalties]).reshape(k, -1)
    return (v + p).amin(-1), (v - p).amax(-1)


def masked_extremum(values: torch.Tensor, penalty: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(min, max)`` of ``values`` where ``penalty`` is 0, each 0-dim (``+-finfo.max`` if nowhere); the CPU form."""
    if values.requires_grad:
        values = values.detach()
    if values.numel() == 0:
        big = torch.finfo(values.dtype).max
        return values.new_full((), big), values.new_full((), -big)
    return (values + penalty).amin(), (values - penalty).amax()


def reduce_over_ranks(values: torch.Tensor, reductions: Sequence[str], groups: SequenceGroups) -> torch.Tensor:
    """``values`` reduced over ``groups`` by each entry's reduction, in one SUM and one MAX collective."""
    is_sum = torch.tensor([r == "sum" for r in reductions], device=values.device)
    is_max = torch.tensor([r == "max" for r in reductions], device=values.device)
    is_min = torch.tensor([r == "min" for r in reductions], device=values.device)
    summed = torch.where(is_sum, values, torch.zeros_like(values))
    # Extrema in one MAX collective: minima negated; other entries are neutral.
    neutral = torch.full_like(values, -float("inf"))
    maxed = torch.where(is_max, values, torch.where(is_min, -values, neutral))
    summed, maxed = reduce_sequence_statistics(summed.unsqueeze(0), maxed.unsqueeze(0), groups)
    summed, maxed = summed[0], maxed[0]
    values = torch.where(is_sum, summed, values)
    values = torch.where(is_max, maxed, values)
    return torch.where(is_min, -maxed, values)
