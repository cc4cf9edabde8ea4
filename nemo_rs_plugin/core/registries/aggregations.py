"""A sequence filter's aggregations: one entry per ``agg``, from its partial statistic to its value.

A sequence filter aggregates its per-token statistic over a sequence's tokens. Where context
parallelism splits a sequence, each rank holds part of its tokens, so an aggregation is three
steps: the **stage statistic** each rank computes over its tokens (one class per shape, its
fields' metadata saying which are reduced by MAX; the others are summed), the **reduction**
over the ranks (one collective for every row: ``SequenceStatistics.reduce``), and the
**finalisation**: the value(s) compared with the bounds, from the reduced rows. An entry
holds all three, its flags (what the configuration's checks and ``nemo-rs check`` read) and
how a default filter label names it. The filters (``correction/filters.py``), the statistics'
allowed aggregations (``filter_statistics.py``), the filter's checks and labels and ``check``
read :data:`SEQUENCE_AGGREGATIONS`; nothing else compares an aggregation's name. A new
aggregation is one entry here (and its name in ``rejection_filter.FilterAgg``, which a test
holds equal to the keys), plus its reference formula in the tests.

References:
    - ``mean`` of the ratio (Geo-RS): Liu, Li et al., "When Speed Kills Stability: Demystifying RL
      Collapse from the Training-Inference Mismatch", https://yingru.notion.site/When-Speed-Kills-Stability-Demystifying-RL-Collapse-from-the-Training-Inference-Mismatch-271211a558b7808d8b12d403fd15edda
    - ``mean``, ``sum``, ``max`` of the KL estimators and ``min``/``any`` of the ratio: AReaL PR #1088,
      https://github.com/inclusionAI/AReaL/pull/1088
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Union

import torch

from nemo_rs_plugin.core.masking import EPS, extrema_penalty

__all__ = [
    "DEFAULT_AGGREGATION",
    "REDUCED_BY_MAX",
    "SEQUENCE_AGGREGATIONS",
    "MaximumStageStatistics",
    "MinimumStageStatistics",
    "RangeStageStatistics",
    "SequenceAggregation",
    "SequenceStage",
    "SequenceStageStatistics",
    "TokenStageStatistics",
    "TotalStageStatistics",
    "sequence_aggregation",
]

#: Field metadata of the stage rows reduced by MAX over the ranks (the others are summed).
REDUCED_BY_MAX = {"reduce": "max"}


@dataclass(frozen=True)
class TokenStageStatistics:
    """``[B]`` rows of one token filter: what it removed from the rows' valid tokens."""

    rejected: torch.Tensor  # valid tokens it rejects (of those the earlier token filters kept)
    # Of those, the negative-advantage ones (only when some filter is advantage-conditioned).
    rejected_negative: Optional[torch.Tensor] = None


@dataclass(frozen=True)
class SequenceStageStatistics:
    """``[B]`` rows of one sequence filter, over the valid tokens alive at its stage.

    One subclass per shape of the aggregate a filter's ``agg`` needs (its entry's ``stage``),
    each with exactly its rows.
    """

    count: torch.Tensor  # tokens alive at this stage
    nonfinite: torch.Tensor  # of those, with a non-finite log-ratio
    # Of those, the negative-advantage ones (set exactly when some filter is advantage-conditioned).
    negative: Optional[torch.Tensor]


@dataclass(frozen=True)
class TotalStageStatistics(SequenceStageStatistics):
    """``agg`` ``mean`` or ``sum``: the row's sum of the statistic."""

    total: torch.Tensor


@dataclass(frozen=True)
class MaximumStageStatistics(SequenceStageStatistics):
    """``agg`` ``max``: the row's maximum of the statistic (reduced by MAX)."""

    maximum: torch.Tensor = field(metadata=REDUCED_BY_MAX)


@dataclass(frozen=True)
class MinimumStageStatistics(SequenceStageStatistics):
    """``agg`` ``min``: the row's maximum of the negated statistic (reduced by MAX)."""

    negated_minimum: torch.Tensor = field(metadata=REDUCED_BY_MAX)


@dataclass(frozen=True)
class RangeStageStatistics(SequenceStageStatistics):
    """``agg`` ``any``: the row's maximum and the maximum of its negation (both reduced by MAX)."""

    maximum: torch.Tensor = field(metadata=REDUCED_BY_MAX)
    negated_minimum: torch.Tensor = field(metadata=REDUCED_BY_MAX)


SequenceStage = Union[TotalStageStatistics, MaximumStageStatistics, MinimumStageStatistics, RangeStageStatistics]


@dataclass(frozen=True)
class StageInputs:
    """What a stage statistic is computed from, ``[B, T]`` and ``[B]``, on this rank's tokens.

    Attributes:
        masked: the statistic on the stage's finite tokens, 0 elsewhere.
        finite: 0/1, the stage's tokens whose log-ratio is finite.
        count, nonfinite, negative: the :class:`SequenceStageStatistics` rows.
        big: ``finfo(dtype).max``: the maximum of a row without a token is ``-big``.
    """

    masked: torch.Tensor
    finite: torch.Tensor
    count: torch.Tensor
    nonfinite: torch.Tensor
    negative: Optional[torch.Tensor]
    big: float


@dataclass(frozen=True)
class SequenceAggregation:
    """One sequence aggregation (a filter's ``agg``).

    Attributes:
        name: the ``agg`` value.
        label: how a default filter label names it (``max`` and ``min`` read ``largest`` and
            ``smallest``: NeMo-RL's workers scale a metric whose name holds ``_max`` or ``_min``
            as an extreme, and a filter's shares are sums).
        words: the aggregate in words, ``{statistic}`` standing for the token statistic (a
            statistic may word it its own way: ``FilterStatistic.sequence_words``).
        stage: the stage statistic's class (its rows, and which are reduced by MAX).
        partial: this rank's stage statistic from :class:`StageInputs`.
        finalize: ``(value compared with lower, value compared with upper)`` from the reduced
            stage (the same tensor twice, but for a two-sided aggregation).
        arithmetic: defined for every statistic; else only for one compared in log space (the
            ratio), whose ``min`` and ``any`` bound single tokens' ratios.
        sums_tokens: its value is built from the sum of the tokens' statistic (a shift of every
            token's log-ratio moves it wholly; ``nemo-rs check``'s note on stale sequences).
        keeps_token_range: its value lies in the token statistic's range (a sum does not).
    """

    name: str
    label: str
    words: str
    stage: type
    partial: Callable[[StageInputs], SequenceStage]
    finalize: Callable[[SequenceStage], tuple[torch.Tensor, torch.Tensor]]
    arithmetic: bool
    sums_tokens: bool = False
    keeps_token_range: bool = True

    @property
    def two_sided(self) -> bool:
        """Lower and upper bound compare different values (``any``: the row's minimum and maximum)."""
        return self.stage is RangeStageStatistics


def _row_max(x: torch.Tensor, penalty: torch.Tensor, big: float) -> torch.Tensor:
    """``[B]`` max over the stage's finite tokens of ``x`` (the penalty pushes the others out); ``-big`` for none.

    T = 0 happens in a CP shard or a batch of prompts without a response, where ``amax`` raises.
    """
    if x.shape[-1] == 0:
        return x.new_full(x.shape[:-1], -big)
    return (x - penalty).amax(-1)


def _total(i: StageInputs) -> SequenceStage:
    return TotalStageStatistics(i.count, i.nonfinite, i.negative, total=i.masked.sum(-1))


def _maximum(i: StageInputs) -> SequenceStage:
    maximum = _row_max(i.masked, extrema_penalty(i.finite), i.big)
    return MaximumStageStatistics(i.count, i.nonfinite, i.negative, maximum)


def _minimum(i: StageInputs) -> SequenceStage:
    negated_minimum = _row_max(-i.masked, extrema_penalty(i.finite), i.big)
    return MinimumStageStatistics(i.count, i.nonfinite, i.negative, negated_minimum)


def _range(i: StageInputs) -> SequenceStage:
    penalty = extrema_penalty(i.finite)  # once for both ends
    maximum, negated_minimum = _row_max(i.masked, penalty, i.big), _row_max(-i.masked, penalty, i.big)
    return RangeStageStatistics(i.count, i.nonfinite, i.negative, maximum, negated_minimum)


# The finalisations read their own stage class (an entry pairs them; the asserts say so to mypy).
def _mean(s: SequenceStage) -> tuple[torch.Tensor, torch.Tensor]:
    assert isinstance(s, TotalStageStatistics)
    stat = s.total / (s.count + EPS)
    return stat, stat


def _sum(s: SequenceStage) -> tuple[torch.Tensor, torch.Tensor]:
    assert isinstance(s, TotalStageStatistics)
    return s.total, s.total


def _largest(s: SequenceStage) -> tuple[torch.Tensor, torch.Tensor]:
    assert isinstance(s, MaximumStageStatistics)
    return s.maximum, s.maximum


def _smallest(s: SequenceStage) -> tuple[torch.Tensor, torch.Tensor]:
    assert isinstance(s, MinimumStageStatistics)
    stat = -s.negated_minimum
    return stat, stat


def _extremes(s: SequenceStage) -> tuple[torch.Tensor, torch.Tensor]:
    assert isinstance(s, RangeStageStatistics)
    return -s.negated_minimum, s.maximum


SEQUENCE_AGGREGATIONS: dict[str, SequenceAggregation] = {
    a.name: a
    for a in (
        SequenceAggregation(
            "mean",
            "mean",
            "the mean over its tokens of {statistic}",
            TotalStageStatistics,
            _total,
            _mean,
            arithmetic=True,
            sums_tokens=True,
        ),
        SequenceAggregation(
            "sum",
            "sum",
            "the sum over its tokens of {statistic}",
            TotalStageStatistics,
            _total,
            _sum,
            arithmetic=True,
            sums_tokens=True,
            keeps_token_range=False,
        ),
        SequenceAggregation(
            "max",
            "largest",
            "the max over its tokens of {statistic}",
            MaximumStageStatistics,
            _maximum,
            _largest,
            arithmetic=True,
        ),
        SequenceAggregation(
            "min",
            "smallest",
            "the min over its tokens of {statistic}",
            MinimumStageStatistics,
            _minimum,
            _smallest,
            arithmetic=False,
        ),
        SequenceAggregation(
            "any",
            "any",
            "every one of its tokens' {statistic} (one outside the bounds rejects it)",
            RangeStageStatistics,
            _range,
            _extremes,
            arithmetic=False,
        ),
    )
}


#: A sequence filter without ``agg``: the mean (over the log-ratios: Geo-RS's geometric mean).
DEFAULT_AGGREGATION = "mean"


def sequence_aggregation(name: str) -> SequenceAggregation:
    """The entry of ``name``; an unknown name is an error, never a default."""
    try:
        return SEQUENCE_AGGREGATIONS[name]
    except KeyError:
        allowed = ", ".join(map(repr, SEQUENCE_AGGREGATIONS))
        raise ValueError(f"rejection_sampling: agg {name!r}; allowed: {allowed}") from None
