"""Rejection filters: token statistics, the local plan of each filter, the sequence decisions.

A filter reads a per-token statistic of a log-ratio (:func:`token_filter_statistic` of
:func:`filter_log_ratio`). :func:`plan_filters` makes the token filters' decisions (local) and
records the sequence filters' partial statistics; after the reduction :func:`apply_filters`
decides on sequences from the reduced statistics only and declares the per-stage metrics.
See: docs/guide.md#rejection-sampling and docs/guide.md#filter-statistics.

References:
    - Geo-RS: Liu, Li et al., "When Speed Kills Stability: Demystifying RL Collapse from the
      Training-Inference Mismatch", https://yingru.notion.site/When-Speed-Kills-Stability-Demystifying-RL-Collapse-from-the-Training-Inference-Mismatch-271211a558b7808d8b12d403fd15edda
    - Token-MIS: IcePop (Ant Group's Ling team), https://ringtech.notion.site/icepop; the Ring-1T
      report, https://arxiv.org/abs/2510.18855
    - Filter fields (level, metric, agg, bounds), denominators unchanged: AReaL PR #1088,
      https://github.com/inclusionAI/AReaL/pull/1088
    - Stage order, Geo-RS then Token-MIS: AReaL PR #1218, https://github.com/inclusionAI/AReaL/pull/1218
    - Product and geometric masks, outlier-token veto (``agg: any``): SkyRL PR #849,
      https://github.com/NovaSky-AI/SkyRL/pull/849
    - OPSM (``advantage_sign: negative``): DeepSeek-AI, "DeepSeek-V3.2: Pushing the Frontier of Open
      Large Language Models", https://arxiv.org/abs/2512.02556
    - DPPO (``prob_diff`` per ``advantage_sign``, ``applies_to: policy_gradient``): Qi et al., "Rethinking
      the Trust Region in LLM Reinforcement Learning", https://arxiv.org/abs/2602.04879; prime-rl's default
      loss, https://docs.primeintellect.ai/prime-rl/algorithms
    - IPO (two-sided ``prob_diff``): prime-rl, https://docs.primeintellect.ai/prime-rl/ipo.md
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from nemo_rs_plugin.core.correction.statistics import (
    SequenceStage,
    SequenceStatistics,
    StageStatistics,
    TokenStageStatistics,
)
from nemo_rs_plugin.core.masking import TokenMasks, nonfinite, out_of_bounds, row_dot, sanitize
from nemo_rs_plugin.core.registries.aggregations import StageInputs
from nemo_rs_plugin.core.registries.filter_options import LogRatio
from nemo_rs_plugin.core.registries.filter_statistics import PROBABILITY_CLAMP, filter_statistic_entry
from nemo_rs_plugin.core.reporting.metrics import MetricSet
from nemo_rs_plugin.core.settings.rejection_filter import StageSettings

__all__ = [
    "PROBABILITY_CLAMP",
    "PolicyLogProbs",
    "RejectionOutcome",
    "apply_filters",
    "filter_log_ratio",
    "filter_statistic",
    "plan_filters",
    "plan_sequence_filter",
    "plan_token_filter",
    "sequence_filter_statistic",
    "token_filter_statistic",
]

# The loss's own counts (metric_catalog.DIAGNOSTIC_CATALOG; Diagnostics.dropped_sequences and
# valid_sequences): sequences dropped and sequences with a valid token, for the run-time warning.
DROPPED_SEQUENCES, VALID_SEQUENCES = "_rs_seq_dropped", "_rs_seq_valid"


@dataclass
class PolicyLogProbs:
    """Detached per-token log-probs a filter's ``log_ratio`` may compare, ``[B, T]`` each.

    Raw values (non-finite entries included): :func:`filter_log_ratio` sanitises them and
    marks where the log-ratio was not finite. ``prev`` is ``curr`` under a forced on-policy
    ratio.
    """

    curr: torch.Tensor
    prev: torch.Tensor
    gen: torch.Tensor


def token_filter_statistic(
    d: torch.Tensor,
    statistic: str,
    target: Optional[torch.Tensor] = None,
    behaviour: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Per-token value of a filter's ``statistic``, from ``d = target - behaviour`` (log-probs).

    The entry of :data:`~nemo_rs_plugin.core.registries.filter_statistics.FILTER_STATISTICS` computes it
    (its formula is there); ``ratio`` is returned in log space (``d`` itself: bounds are compared
    as logs). The probability-space statistics read ``target`` and ``behaviour`` themselves.
    """
    return filter_statistic_entry(statistic).token_value(d, target, behaviour)


def filter_log_ratio(
    log_ratio: LogRatio,
    d: torch.Tensor,  # [B, T] prev - gen, sanitised
    d_finite: torch.Tensor,  # [B, T] 0/1
    log_probs: Optional[PolicyLogProbs],
    needs_log_probs: bool,
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """``(d, d_finite, target, behaviour)`` for a filter's ``log_ratio`` ``"a-b"``.

    ``d = log pi_a - log pi_b`` with non-finite entries replaced by 0 and ``d_finite`` the
    0/1 mask of where it was finite; ``target``/``behaviour`` are the sanitised log-probs of
    ``a`` and ``b`` (``None`` unless ``needs_log_probs``). ``prev-gen`` reuses the loss's
    ``d``; the others read :class:`PolicyLogProbs`.
    """
    target: Optional[torch.Tensor] = None
    behaviour: Optional[torch.Tensor] = None
    if not log_ratio.is_loss_log_ratio or needs_log_probs:
        if log_probs is None:
            raise ValueError(
                f"log_ratio {log_ratio.name!r}: this filter needs the policies' log-probs "
                "(compute_correction(..., log_probs=PolicyLogProbs(...)))"
            )
        target_raw = getattr(log_probs, log_ratio.target).detach()
        behaviour_raw = getattr(log_probs, log_ratio.behaviour).detach()
        target, behaviour = sanitize(target_raw), sanitize(behaviour_raw)
    if log_ratio.is_loss_log_ratio:
        return d, d_finite, target, behaviour
    d_raw = target_raw - behaviour_raw
    return sanitize(d_raw), 1.0 - nonfinite(d_raw), target, behaviour


# ------------------------------------------------------------------ plan (local)
def plan_filters(
    filters: Sequence[StageSettings],
    d: torch.Tensor,  # [B, T] prev - gen, sanitised, detached
    masks: TokenMasks,
    negative: Optional[torch.Tensor],  # [B, T] 0/1 negative advantage; None if no filter is conditioned
    log_probs: Optional[PolicyLogProbs],
    positive: Optional[torch.Tensor] = None,  # [B, T] 0/1 positive advantage; None if no filter needs it
) -> tuple[tuple[StageStatistics, ...], torch.Tensor, Optional[torch.Tensor]]:
    """Token-filter masks (local decisions) and the local statistics of sequence filters.

    A sequence filter reads the valid tokens that the token filters listed before it kept.
    Returns each stage's local statistics, the ``[B, T]`` 0/1 mask of valid tokens every
    token filter with ``applies_to: loss`` kept, and the ``[B, T]`` 0/1 mask of tokens whose
    policy-gradient term no ``applies_to: policy_gradient`` filter removed (``None`` when
    there is no such filter).
    """
    stages: list[StageStatistics] = []
    alive = masks.valid_bin  # [B, T] valid tokens kept by the token filters so far
    policy_gradient_alive = None  # [B, T] 1 where no policy-gradient-only filter rejected the token
    stage: StageStatistics
    for f in filters:
        stat, f_finite = filter_statistic(f, d, masks, log_probs)
        per_token = not f.level_entry.whole_sequences
        if per_token and not f.scope_entry.leaves_loss:
            # Its candidates: tokens still in the loss whose policy-gradient term is still there
            # (a token two such filters reject is counted by the first only).
            candidates = alive if policy_gradient_alive is None else alive * policy_gradient_alive
            stage, kept = plan_token_filter(f, stat, f_finite, candidates, negative, positive)
            removed = candidates - kept
            policy_gradient_alive = (
                (1.0 - removed) if policy_gradient_alive is None else policy_gradient_alive - removed
            )
        elif per_token:
            stage, alive = plan_token_filter(f, stat, f_finite, alive, negative, positive)
        else:
            stage = plan_sequence_filter(f, stat, f_finite, alive, negative, torch.finfo(d.dtype).max)
        stages.append(stage)
    return tuple(stages), alive, policy_gradient_alive


def filter_statistic(
    f: StageSettings, d: torch.Tensor, masks: TokenMasks, log_probs: Optional[PolicyLogProbs]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, T]`` the filter's statistic (finite) and the 0/1 mask of where its log-ratio was finite."""
    entry = f.statistic_entry
    fd, f_finite, target, behaviour = filter_log_ratio(
        f.log_ratio_entry, d, masks.d_finite, log_probs, entry.needs_probabilities
    )
    stat = entry.token_value(fd, target, behaviour)
    if not entry.log_space:  # fd is finite (the ratio's log is fd); the others can overflow: keep them finite
        big = torch.finfo(d.dtype).max
        stat = torch.nan_to_num(stat, nan=0.0, posinf=big, neginf=-big)
    return stat, f_finite


def plan_token_filter(
    f: StageSettings,
    stat: torch.Tensor,  # [B, T]
    f_finite: torch.Tensor,  # [B, T] 0/1
    alive: torch.Tensor,  # [B, T] 0/1 valid tokens the earlier token filters kept
    negative: Optional[torch.Tensor],  # [B, T] 0/1
    positive: Optional[torch.Tensor] = None,  # [B, T] 0/1
) -> tuple[TokenStageStatistics, torch.Tensor]:
    """The token filter's per-row statistics and the tokens still alive after it."""
    lo, hi = f.bounds
    # Tokens this filter may reject: all, or only those whose advantage has the filter's sign
    # (None: the caller has no advantages, as in calibration; every token is eligible).
    sign = f.sign_entry
    eligible = None if sign is None else (negative if sign.sign < 0 else positive)
    in_band = f_finite.masked_fill(out_of_bounds(stat, lo, hi), 0.0)  # non-finite d: out of band
    keep_tok = in_band if eligible is None else 1.0 - (1.0 - in_band) * eligible
    kept = alive * keep_tok
    rejected = alive - kept
    stage = TokenStageStatistics(
        rejected=rejected.sum(-1),
        rejected_negative=row_dot(rejected, negative) if negative is not None else None,
    )
    return stage, kept


def plan_sequence_filter(
    f: StageSettings,
    stat: torch.Tensor,  # [B, T]
    f_finite: torch.Tensor,  # [B, T] 0/1
    alive: torch.Tensor,  # [B, T] 0/1 valid tokens the earlier token filters kept
    negative: Optional[torch.Tensor],  # [B, T] 0/1
    big: float,  # finfo(d.dtype).max: the maximum of a row without a token is -big
) -> SequenceStage:
    """The sequence filter's partial per-row statistics over the tokens alive at its stage.

    Its aggregation's stage statistic (:data:`~nemo_rs_plugin.core.registries.aggregations.SEQUENCE_AGGREGATIONS`).
    """
    alive_fin = alive * f_finite
    entry = f.aggregation_entry
    assert entry is not None, "a sequence filter has an aggregation"
    return entry.partial(
        StageInputs(
            masked=stat * alive_fin,  # [B, T], 0 off the stage's tokens
            finite=alive_fin,
            count=alive.sum(-1),
            nonfinite=(alive - alive_fin).sum(-1),
            negative=row_dot(alive, negative) if negative is not None else None,
            big=big,
        )
    )


# ------------------------------------------------------------------ decisions (reduced statistics)
def _sequence_rejects(f: StageSettings, s: SequenceStage) -> torch.Tensor:
    """``[B]`` bool: the sequence filter rejects the row, decided on reduced statistics."""
    lo, hi = f.bounds
    low, high = sequence_filter_statistic(f, s)
    if low is high:
        reject = out_of_bounds(low, lo, hi)
    else:  # any: some valid token outside the bounds
        reject = out_of_bounds(high, None, hi) | out_of_bounds(low, lo, None)
    reject = reject | (s.nonfinite > 0)
    # A sequence with no token left at this stage is never rejected (and never NaN).
    return reject & (s.count > 0)


def sequence_filter_statistic(f: StageSettings, s: SequenceStage) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B]`` (statistic compared with ``lower``, statistic compared with ``upper``), reduced rows.

    The aggregation of the filter over the stage's tokens, in the bounds' space (log space
    for ``ratio``): its entry's finalisation (``mean`` = total / count, ``sum`` = total, ``max``,
    ``min``; the same tensor on both sides, except ``any`` = (row minimum, row maximum)).
    """
    entry = f.aggregation_entry
    assert entry is not None, "a sequence filter has an aggregation"
    return entry.finalize(s)


@dataclass
class RejectionOutcome:
    """The sequence-level result of the filters, from reduced statistics (``[B]`` each)."""

    sequence_kept: torch.Tensor  # 0/1: no unconditional sequence filter rejected the row
    conditional_rows: Optional[torch.Tensor]  # 0/1: an advantage-conditioned sequence filter
    # rejected the row, which loses its negative-advantage tokens (None: no such filter)
    kept_tokens: torch.Tensor  # valid tokens of the row still in the loss (weighted like valid)
    sequence_in_loss: torch.Tensor  # 0/1: not dropped as a whole sequence


def apply_filters(
    filters: Sequence[StageSettings],
    stats: SequenceStatistics,  # reduced
    sample_mask: torch.Tensor,  # [B]
    metrics: MetricSet,
) -> RejectionOutcome:
    """Run the sequence decisions in stage order and record per-stage metrics.

    Every number comes from the reduced per-row statistics, so the metrics are identical on
    all ranks and cost O(batch). A stage's metrics count only what it removed from the
    loss: units an earlier stage had already removed are not counted again.
    """
    seq_kept = torch.ones_like(sample_mask)  # [B] 0/1 rows no sequence filter rejected so far
    conditional = torch.zeros_like(sample_mask)  # [B] rows an advantage-conditioned filter rejected
    conditional_touched = torch.zeros_like(sample_mask)  # [B] ... and that lost a token to it
    for f, s in zip(filters, stats.stages):
        key = f"rs/{f.label}"
        live = seq_kept * sample_mask  # rows still alive at this stage, weighted like valid
        if isinstance(s, TokenStageStatistics):
            rejected = s.rejected  # tokens this filter rejected per row
            if s.rejected_negative is not None:  # a filter is advantage-conditioned: not those it removed
                rejected = rejected - conditional * s.rejected_negative
            metrics.add_total(f"{key}/token_rejected_frac", rejected @ live)
            touched = torch.sign(rejected)
            metrics.add_total(f"{key}/seq_touched_frac", touched @ live)
            continue
        rejects = _sequence_rejects(f, s)  # [B] bool
        rejected = torch.where(rejects, live, 0.0)  # [B]
        in_loss = s.count  # the tokens those rows still have at this stage
        negative_alive = s.negative  # [B] set exactly when some filter is advantage-conditioned
        if negative_alive is not None:
            in_loss = in_loss - conditional * negative_alive
        if f.sign_entry is not None and negative_alive is not None:  # negative: the one sign a sequence filter takes
            # Rows that lose negative-advantage tokens now (not already removed earlier).
            newly = rejected * (1.0 - conditional) * torch.sign(negative_alive)
            conditional = torch.maximum(conditional, torch.sign(rejected))
            conditional_touched = torch.maximum(conditional_touched, torch.sign(newly))
            metrics.add_total(f"{key}/seq_rejected_frac", newly.sum())
            metrics.add_total(f"{key}/token_rejected_frac", newly @ negative_alive)
            continue
        seq_kept = seq_kept.masked_fill(rejects, 0.0)
        metrics.add_total(f"{key}/seq_rejected_frac", rejected.sum())
        metrics.add_total(f"{key}/token_rejected_frac", rejected @ in_loss)
    outcome = _outcome(stats, seq_kept, conditional, conditional_touched)
    metrics.add_total("rs_token_rejected_frac", stats.valid.sum() - outcome.kept_tokens.sum())
    dropped = torch.maximum(1.0 - seq_kept, conditional_touched)
    metrics.add_total("rs_seq_rejected_frac", dropped @ sample_mask)
    # This microbatch's own counts (not normalised), for the run-time warning of core/reporting/health.py.
    metrics.add_total(DROPPED_SEQUENCES, dropped @ sample_mask)
    metrics.add_total(VALID_SEQUENCES, torch.sign(stats.valid) @ sample_mask)
    return outcome


def _outcome(
    stats: SequenceStatistics,
    seq_kept: torch.Tensor,  # [B] 0/1 no unconditional sequence filter rejected the row
    conditional: torch.Tensor,  # [B] 0/1 rows an advantage-conditioned filter rejected
    conditional_touched: torch.Tensor,  # [B] 0/1 ... and that lost a token to it
) -> RejectionOutcome:
    """The tokens and sequences still in the loss after every filter."""
    kept_tokens = stats.kept  # [B] valid tokens every token filter kept (weighted)
    sequence_in_loss = seq_kept
    conditional_rows = None
    if stats.kept_negative is not None:  # set exactly when some filter is advantage-conditioned
        kept_tokens = kept_tokens - conditional * stats.kept_negative
        # A conditionally rejected row that has no token left leaves as a whole sequence.
        emptied = conditional_touched * (kept_tokens <= 0).to(seq_kept.dtype)
        sequence_in_loss = seq_kept * (1.0 - emptied)
        conditional_rows = conditional
    kept_tokens = kept_tokens * seq_kept
    return RejectionOutcome(seq_kept, conditional_rows, kept_tokens, sequence_in_loss)
