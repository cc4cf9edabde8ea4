"""The per-sequence statistics of the correction, typed, and the correction's only collectives.

:func:`~nemo_rs_plugin.core.correction.pipeline.plan_correction` fills a
:class:`SequenceStatistics` with this rank's partial ``[B]`` rows;
:meth:`SequenceStatistics.reduce` passes every row through **one** call of
:func:`~nemo_rs_plugin.core.distributed.reduce_sequence_statistics` (one SUM and at most one
MAX all-reduce when sequences are sharded) and returns the same structure, reduced;
:func:`~nemo_rs_plugin.core.correction.pipeline.apply_correction` reads it by attribute. A
statistic is a named field, so a misspelt name fails where it is written, never as a silent
wrong row.

:func:`batch_normalize_weights` (IS weights over their batch mean: one more SUM of two
numbers) lives here too, so that every collective of the correction is issued from this module.

References:
    - GSPO (``ratio_tokens``, the tokens its sequence ratio averages): Zheng et al., "Group Sequence
      Policy Optimization", https://arxiv.org/abs/2507.18071
    - Geo-RS (the geometric mean ``exp(d_sum / valid)``): Liu, Li et al., "When Speed Kills Stability:
      Demystifying RL Collapse from the Training-Inference Mismatch", https://yingru.notion.site/When-Speed-Kills-Stability-Demystifying-RL-Collapse-from-the-Training-Inference-Mismatch-271211a558b7808d8b12d403fd15edda
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Optional, Union

import torch

from nemo_rs_plugin.core.distributed import (
    NO_GROUPS,
    SequenceGroups,
    reduce_batch_totals,
    reduce_sequence_statistics,
)
from nemo_rs_plugin.core.masking import EPS, masked_sum
from nemo_rs_plugin.core.registries.aggregations import (
    REDUCED_BY_MAX,
    MaximumStageStatistics,
    MinimumStageStatistics,
    RangeStageStatistics,
    SequenceStage,
    SequenceStageStatistics,
    TokenStageStatistics,
    TotalStageStatistics,
)
from nemo_rs_plugin.core.registries.is_levels import is_level

__all__ = [
    "BATCH_MEAN_FLOOR",
    "MaximumStageStatistics",
    "MinimumStageStatistics",
    "RangeStageStatistics",
    "SequenceStage",
    "SequenceStageStatistics",
    "SequenceStatistics",
    "StageStatistics",
    "TokenStageStatistics",
    "TotalStageStatistics",
    "batch_normalize_weights",
]

# A batch mean at or below this leaves the weights unnormalised (VERL and slime's guard).
BATCH_MEAN_FLOOR = 1e-8

StageStatistics = Union[TokenStageStatistics, SequenceStage]


@dataclass(frozen=True)
class SequenceStatistics:
    """Every per-sequence statistic of one correction, ``[B]`` each: local, or reduced by :meth:`reduce`.

    ``stages`` has one entry per rejection filter, in order. ``kept_negative`` is set when
    some filter is advantage-conditioned, ``ratio_tokens`` with the GSPO ratio.
    """

    d_sum: torch.Tensor  # sum_t m d
    valid: torch.Tensor  # n_i = sum_t m
    token_mask: torch.Tensor  # token_mask tokens
    nonfinite: torch.Tensor  # valid tokens with a non-finite d
    kept: torch.Tensor  # valid tokens every token filter kept (weighted like valid)
    stages: tuple[StageStatistics, ...] = ()
    kept_negative: Optional[torch.Tensor] = None  # their negative-advantage part
    ratio_tokens: Optional[torch.Tensor] = None  # the GSPO ratio's tokens

    def reduce(self, groups: SequenceGroups = NO_GROUPS) -> "SequenceStatistics":
        """The same statistics after one SUM (and at most one MAX) collective over ``groups``.

        Identical on every rank of a group afterwards; detached.
        """
        parts = (*self.stages, self)  # the order _rebuilt reads them back in
        if not groups.active:
            # No collective: the rows stay where they are (packing them into one [K, B] tensor
            # would cost a copy, and a compiled core a kernel, for nothing).
            stages = tuple(_detached(stage) for stage in self.stages)
            return _detached(self, stages=stages)
        sums = [row for part in parts for row in _rows(part, False)]
        maxima = [row for part in parts for row in _rows(part, True)]
        stacked_sums = torch.stack(sums)  # [K, B]
        # [J, B]; without a MAX row an empty [0, B] view, for which no collective is issued
        summed, maxed = reduce_sequence_statistics(
            stacked_sums, torch.stack(maxima) if maxima else stacked_sums[:0], groups
        )
        cursor = {False: 0, True: 0}
        stages = tuple(_rebuilt(stage, summed, maxed, cursor) for stage in self.stages)
        return _rebuilt(self, summed, maxed, cursor, stages=stages)


def _tensor_fields(cls: type) -> tuple[tuple[str, bool], ...]:
    """``(name, max-reduced)`` of a statistics class's tensor fields, in declaration order."""
    return tuple((f.name, f.metadata == REDUCED_BY_MAX) for f in fields(cls) if f.name != "stages")


# Computed once at import: the traced (optionally compiled) code reads constant names only.
_FIELDS = {
    cls: _tensor_fields(cls)
    for cls in (
        SequenceStatistics,
        TokenStageStatistics,
        TotalStageStatistics,
        MaximumStageStatistics,
        MinimumStageStatistics,
        RangeStageStatistics,
    )
}


def _rows(part: Any, maxima: bool) -> list[torch.Tensor]:
    """The rows of ``part`` that are set and reduced by MAX (``maxima``) or by SUM."""
    rows = []
    for name, is_max in _FIELDS[type(part)]:
        row = getattr(part, name)
        if row is not None and is_max == maxima:
            rows.append(row)
    return rows


def _detached(part: Any, **extra: Any) -> Any:
    """``part`` with every set row detached (what :meth:`SequenceStatistics.reduce` returns unsharded)."""
    values = dict(extra)
    for name, _ in _FIELDS[type(part)]:
        row = getattr(part, name)
        values[name] = row.detach() if row is not None else None
    return type(part)(**values)


def _rebuilt(part: Any, summed: torch.Tensor, maxed: torch.Tensor, cursor: dict, **extra: Any) -> Any:
    """``part`` with its set rows replaced by the next reduced ones, read in :func:`_rows` order."""
    values = dict(extra)
    for is_max in (False, True):
        for name, field_max in _FIELDS[type(part)]:
            if field_max != is_max:
                continue
            if getattr(part, name) is None:
                values[name] = None
            else:
                values[name] = (maxed if is_max else summed)[cursor[is_max]]
                cursor[is_max] += 1
    return type(part)(**values)


def batch_normalize_weights(
    weight: torch.Tensor,  # [B, T] (token level) or [B, 1] (sequence levels), truncated
    units: torch.Tensor,  # [B, T] valid tokens, or [B] sequences with a valid token
    level: str,
    scope: str,
    groups: SequenceGroups = NO_GROUPS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """IS weights over their batch mean, and the 0-dim factor divided by.

    ``w / mu`` with ``mu = sum_u m_u w_u / sum_u m_u`` over the IS level's units ``u``
    before rejection (``m`` = ``units``): valid tokens at the ``token`` level (VERL and
    slime), sequences with a valid token at the sequence levels (VERL; slime's sequence mean
    also counts empty sequences, as 0). Weights zeroed by truncation count as 0; where
    ``mu <= 1e-8`` the weights are left as they are (factor 1), as both peers do.

    ``scope`` ``microbatch``: the units of this call. Token totals are partial sums when CP
    splits the tokens, so they are summed over ``groups.groups``; per-sequence weights are
    already identical there. ``data_parallel``: also summed over ``groups.data_parallel``,
    the ranks holding the batch's other sequences.
    """
    token_level = is_level(level).per_token
    if token_level:
        totals = torch.stack([masked_sum(weight, units), units.sum()])
    else:
        w_seq = weight.squeeze(-1)  # [B]
        totals = torch.stack([(w_seq * units).sum(), units.sum()])
    totals = reduce_batch_totals(
        totals, groups, tokens_split=token_level, across_data_parallel=scope == "data_parallel"
    )
    mean = totals[0] / totals[1].clamp_min(EPS)
    factor = torch.where(mean > BATCH_MEAN_FLOOR, mean, torch.ones_like(mean))
    return weight / factor, factor
