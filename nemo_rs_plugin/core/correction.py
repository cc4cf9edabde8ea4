"""Off-policy correction: IS weights at a chosen level, truncation, and rejection sampling.

Problem: the log-probs reported by the inference engine (``gen``) differ from the training
engine's (``prev``): kernel and precision mismatch, MoE routing, staleness in async runs.
With ``d = prev - gen`` per token, the IS weight ``pi_prev / pi_gen`` corrects the policy
gradient; truncation bounds its variance; rejection sampling drops tokens or sequences whose
mismatch is too large to correct.

Entry points (all pure torch; no NeMo-RL, no Megatron, no ``.item()``):

* :func:`token_filter_statistic`, :func:`filter_log_ratio`: token-level building blocks.
* the pipeline, in three visible steps (the loss calls them in order; :func:`compute_correction`
  chains them): :func:`plan_correction` computes every local decision and every partial
  per-sequence statistic; :meth:`CorrectionPlan.reduce` passes all of them through **one** call
  of :func:`~nemo_rs_plugin.core.distributed.reduce_sequence_statistics` (one SUM and one MAX
  all-reduce when sequences are sharded); :func:`apply_correction` derives masks, weights and
  metrics from the reduced statistics only.
* :func:`batch_normalize_weights`: IS weights over their batch mean (one more SUM of two
  numbers, over the data-parallel group too when asked).

IS weights and masks are detached: they change the measure the gradient is estimated under,
not the objective being differentiated.
See: docs/guide.md#is-correction-level, docs/guide.md#rejection-sampling, docs/guide.md#filter-statistics
and docs/guide.md#batch-normalisation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from nemo_rs_plugin.core.config import RejectionFilter, RSClippedPGLossConfig
from nemo_rs_plugin.core.distributed import (
    NO_GROUPS,
    SequenceGroups,
    reduce_batch_totals,
    reduce_sequence_statistics,
)
from nemo_rs_plugin.core.masking import (
    EPS,
    TokenMasks,
    extrema_penalty,
    finite_exp,
    masked_sum,
    nonfinite,
    out_of_bounds,
    sanitize,
)
from nemo_rs_plugin.core.metrics import GlobalCounts, MetricSet, batched_evaluation
from nemo_rs_plugin.core.policy_loss import kl_estimate

__all__ = [
    "BATCH_MEAN_FLOOR",
    "CorrectionPlan",
    "CorrectionResult",
    "PolicyLogProbs",
    "PROBABILITY_CLAMP",
    "ReducedStatistics",
    "apply_correction",
    "batch_normalize_weights",
    "compute_correction",
    "filter_log_ratio",
    "finite_exp",
    "is_weights",
    "plan_correction",
    "token_filter_statistic",
    "truncate_weights",
]

# Probability-space statistics clamp the sampled token's probabilities to [1e-6, 1 - 1e-6]
# (OpenRLHF's clamp), which keeps both logs of the binary KL finite.
PROBABILITY_CLAMP = 1e-6
# A batch mean at or below this leaves the weights unnormalised (VERL and slime's guard).
BATCH_MEAN_FLOOR = 1e-8


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
    metric: str,
    target: Optional[torch.Tensor] = None,
    behaviour: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Per-token statistic of a filter, from ``d = target - behaviour`` (log-probs).

    ``ratio`` is returned in log space (``d`` itself; bounds are compared as ``log``);
    ``kl_k1 = -d``, ``kl_k2 = d^2/2``, ``kl_k3 = exp(d) - 1 - d`` estimate
    KL(behaviour || target); ``mult_prob_error = exp(|d|)``. The probability-space
    statistics read ``p_a = exp(target)`` and ``p_b = exp(behaviour)``, both clamped to
    ``[1e-6, 1 - 1e-6]``: ``binary_kl = p_b log(p_b/p_a) + (1-p_b) log((1-p_b)/(1-p_a))``,
    ``total_variation = |p_b - p_a|``.
    """
    if metric == "ratio":
        return d
    if metric in ("kl_k1", "kl_k2", "kl_k3"):
        return kl_estimate(d, metric[3:])
    if metric == "mult_prob_error":
        return torch.exp(d.abs())
    if metric in ("binary_kl", "total_variation"):
        if target is None or behaviour is None:
            raise ValueError(f"metric {metric!r} needs the target and behaviour log-probs")
        p_a = target.exp().clamp(PROBABILITY_CLAMP, 1.0 - PROBABILITY_CLAMP)
        p_b = behaviour.exp().clamp(PROBABILITY_CLAMP, 1.0 - PROBABILITY_CLAMP)
        if metric == "total_variation":
            return (p_b - p_a).abs()
        return p_b * (p_b / p_a).log() + (1.0 - p_b) * ((1.0 - p_b) / (1.0 - p_a)).log()
    raise ValueError(
        f"metric: got {metric!r}; allowed: ratio, kl_k1, kl_k2, kl_k3, mult_prob_error, binary_kl, total_variation"
    )


def filter_log_ratio(
    log_ratio: str,
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
    target_name, behaviour_name = log_ratio.split("-")
    if log_ratio != "prev-gen" or needs_log_probs:
        if log_probs is None:
            raise ValueError(
                f"log_ratio {log_ratio!r}: this filter needs the policies' log-probs "
                "(compute_correction(..., log_probs=PolicyLogProbs(...)))"
            )
        target_raw = getattr(log_probs, target_name).detach()
        behaviour_raw = getattr(log_probs, behaviour_name).detach()
        target, behaviour = sanitize(target_raw), sanitize(behaviour_raw)
    else:
        target = behaviour = None
    if log_ratio == "prev-gen":
        return d, d_finite, target, behaviour
    d_raw = target_raw - behaviour_raw
    return sanitize(d_raw), 1.0 - nonfinite(d_raw), target, behaviour


def _log_bound(v: Optional[float]) -> Optional[float]:
    if v is None:
        return None
    return -math.inf if v == 0 else math.log(v)


def _filter_bounds(f: RejectionFilter) -> tuple[Optional[float], Optional[float]]:
    """Bounds in the space the statistic lives in (log space for ratios)."""
    if f.metric == "ratio":
        return _log_bound(f.lower), _log_bound(f.upper)
    return f.lower, f.upper


@dataclass
class CorrectionResult:
    """What the loss needs from the correction layer; every tensor is detached.

    Attributes:
        is_weight: ``[B, T]`` or ``[B, 1]`` IS weight after truncation (1 where unused).
        keep: ``[B, T]`` float, 1 for units kept by rejection sampling and finite inputs.
        loss_tokens: ``[B, T]`` ``valid * keep``, the tokens that reach the loss.
        seq_token_count: ``[B]`` valid tokens per sequence over all ranks (``sum_t m``);
            ``None`` when :func:`needs_sequence_statistics` is false, like the next three.
        seq_mask_count: ``[B]`` ``token_mask`` tokens per sequence over all ranks.
        kept_token_count: ``[]`` kept valid tokens over all ranks (for ``kept`` denominators).
        kept_seq_count: ``[]`` kept valid sequences.
        ratio_mask: ``[B, T]`` the tokens the GSPO ratio averages over: ``token_mask`` tokens
            with finite inputs, less valid tokens a token filter rejected (``None`` without
            the GSPO ratio; with no token filter it is NeMo-RL's mask).
        ratio_token_count: ``[B]`` ``ratio_mask`` tokens per sequence over all ranks: the GSPO
            ratio's denominator.
        metrics: the :class:`~nemo_rs_plugin.core.metrics.MetricSet` the correction declared its
            metrics in.
    """

    is_weight: torch.Tensor
    keep: torch.Tensor
    loss_tokens: torch.Tensor
    seq_token_count: Optional[torch.Tensor]
    seq_mask_count: Optional[torch.Tensor]
    kept_token_count: Optional[torch.Tensor]
    kept_seq_count: Optional[torch.Tensor]
    ratio_token_count: Optional[torch.Tensor]
    ratio_mask: Optional[torch.Tensor]
    metrics: MetricSet


class _StatPack:
    """Named ``[B]`` per-sequence statistics, reduced together: plan, reduce once, then read.

    ``add_sum``/``add_max`` record this rank's partial value of a statistic under a name;
    :meth:`reduce` runs the one SUM (and at most one MAX) collective over the groups that
    split the sequences and returns :class:`ReducedStatistics`, read by the same names. A
    name read that was never added is a ``KeyError`` naming it, not a silent wrong row.
    """

    def __init__(self) -> None:
        self._sums: dict[str, torch.Tensor] = {}
        self._maxima: dict[str, torch.Tensor] = {}

    def add_sum(self, name: str, row: torch.Tensor) -> str:
        if name in self._sums:
            raise KeyError(f"per-sequence statistic {name!r} added twice")
        self._sums[name] = row
        return name

    def add_max(self, name: str, row: torch.Tensor) -> str:
        if name in self._maxima:
            raise KeyError(f"per-sequence maximum {name!r} added twice")
        self._maxima[name] = row
        return name

    def reduce(self, groups: SequenceGroups) -> "ReducedStatistics":
        sums = torch.stack(list(self._sums.values()))  # [K, B]
        maxima = torch.stack(list(self._maxima.values())) if self._maxima else None  # [J, B]
        sums, maxima = reduce_sequence_statistics(sums, maxima, groups)
        return ReducedStatistics(
            dict(zip(self._sums, sums)),
            dict(zip(self._maxima, maxima)) if maxima is not None else {},
        )


@dataclass(frozen=True)
class ReducedStatistics:
    """The per-sequence statistics after the reduction, identical on every rank of a group."""

    sums: dict
    maxima: dict

    def sum(self, name: str) -> torch.Tensor:
        return self.sums[name]

    def max(self, name: str) -> torch.Tensor:
        return self.maxima[name]


@dataclass
class _Stage:
    """One rejection filter, with the names of its per-sequence statistics (``None``: unused)."""

    spec: RejectionFilter
    keep_tok: Optional[torch.Tensor] = None  # token filter: [B, T] 0/1
    touched: Optional[str] = None  # token filter: tokens it rejects per row
    count: Optional[str] = None  # sequence filter: tokens alive at this stage per row
    nonfinite: Optional[str] = None  # sequence filter: of those, with a non-finite log-ratio
    total: Optional[str] = None  # sequence filter (mean, sum): sum of the statistic
    maximum: Optional[str] = None  # sequence filter (max, any): max of the statistic
    negated_minimum: Optional[str] = None  # sequence filter (min, any): max of -statistic
    # Only when some filter is advantage-conditioned: per row, the negative-advantage tokens
    # a token filter rejects, or those alive at a sequence filter.
    negative: Optional[str] = None


_PROBABILITY_METRICS = ("binary_kl", "total_variation")


def needs_sequence_statistics(cfg: RSClippedPGLossConfig) -> bool:
    """Whether anything in this configuration reads a per-sequence statistic.

    NeMo-RL's default (token IS level, token-level loss, no filter) reads none, and then no
    per-sequence sum is computed or reduced at all.
    """
    return (
        cfg.effective_is_level != "token"
        or cfg.truncated_importance_sampling_type == "seq-mask-tis"
        or bool(cfg.rejection_sampling)
        or not cfg.token_level_loss
        or cfg.positive_example_nll_weight > 0
        or cfg.rejection_denominator == "kept"
    )


@dataclass
class CorrectionPlan:
    """Step 1 of the correction: every local decision and every partial per-sequence statistic.

    Built by :func:`plan_correction`; :meth:`reduce` is step 2 (the one collective), and
    :func:`apply_correction` step 3 (decisions and weights from reduced statistics only).
    """

    d: torch.Tensor  # [B, T] prev - gen, sanitised, detached
    masks: TokenMasks
    stages: list[_Stage]
    alive: Optional[torch.Tensor]  # [B, T] valid tokens every token filter kept (None: no statistics)
    negative: Optional[torch.Tensor]  # [B, T] 0/1 negative advantage, for conditioned filters
    ratio_mask: Optional[torch.Tensor]  # [B, T] the GSPO ratio's tokens
    pack: Optional[_StatPack]  # None when no per-sequence statistic is needed

    def reduce(self, groups: SequenceGroups = NO_GROUPS) -> Optional[ReducedStatistics]:
        """All per-sequence statistics through one SUM (and one MAX) collective; ``None`` if there are none."""
        return self.pack.reduce(groups) if self.pack is not None else None


def plan_correction(
    cfg: RSClippedPGLossConfig,
    d: torch.Tensor,
    masks: TokenMasks,
    *,
    log_probs: Optional[PolicyLogProbs] = None,
    advantages: Optional[torch.Tensor] = None,
) -> CorrectionPlan:
    """Token-filter decisions (local) and the local per-sequence statistics of everything else.

    ``d = prev - gen`` (``[B, T]``, non-finite entries already 0). ``log_probs`` is needed by
    filters whose ``log_ratio`` is not ``prev-gen`` or whose statistic lives in probability
    space; ``advantages`` by advantage-conditioned filters. Nothing here reads a statistic of
    another rank.
    """
    d = d.detach()
    negative = None  # [B, T] 0/1 tokens with a negative advantage
    if any(f.negative_advantages_only for f in cfg.rejection_sampling):
        if advantages is None:
            raise ValueError(
                "rejection_sampling: a filter with negative_advantages_only needs the "
                "advantages (compute_correction(..., advantages=...))"
            )
        negative = (sanitize(advantages.detach()) < 0).to(d.dtype)
    if not needs_sequence_statistics(cfg):
        return CorrectionPlan(d, masks, [], None, negative, None, None)
    pack = _StatPack()
    stages, alive = _plan_stages(cfg, d, masks, negative, log_probs, pack)
    pack.add_sum("d_sum", (d * masks.valid).sum(-1))  # sum_t m d
    pack.add_sum("valid", masks.valid.sum(-1))  # n_i
    pack.add_sum("token_mask", masks.token_mask.sum(-1).to(d.dtype))  # token_mask count
    pack.add_sum("nonfinite", (masks.valid_bin * (1.0 - masks.d_finite)).sum(-1))
    ratio_mask = None
    if cfg.sequence_level_importance_ratios:
        # The GSPO ratio averages over the row's token_mask tokens with finite inputs, less
        # the valid tokens a token filter rejected (a rejected token gets no gradient; as
        # VERL, whose rejection edits the response mask its GSPO ratio reads).
        ratio_mask = masks.token_mask * masks.inputs_finite * (1.0 - masks.valid_bin + alive)
        pack.add_sum("ratio_tokens", ratio_mask.sum(-1).to(d.dtype))
    return CorrectionPlan(d, masks, stages, alive, negative, ratio_mask, pack)


def _plan_stages(
    cfg: RSClippedPGLossConfig,
    d: torch.Tensor,  # [B, T]
    masks: TokenMasks,
    negative: Optional[torch.Tensor],  # [B, T] 0/1 negative advantage; None if unused
    log_probs: Optional[PolicyLogProbs],
    pack: _StatPack,
) -> tuple[list[_Stage], torch.Tensor]:
    """Token-filter masks (local decisions) and the local statistics of sequence filters.

    A sequence filter reads the valid tokens that the token filters listed before it kept.
    Returns the stages and the ``[B, T]`` 0/1 mask of valid tokens every token filter kept;
    adds to ``pack`` each stage's statistics and, per row, ``kept`` (those tokens, weighted
    like ``valid``) and ``kept_negative`` (their negative-advantage part, only when some
    filter is advantage-conditioned).
    """
    big = torch.finfo(d.dtype).max
    stages = []
    alive = masks.valid_bin  # [B, T] valid tokens kept by the token filters so far
    for i, f in enumerate(cfg.rejection_sampling):
        name = f"stage{i}"
        lo, hi = _filter_bounds(f)
        fd, f_finite, target, behaviour = filter_log_ratio(
            f.log_ratio, d, masks.d_finite, log_probs, f.metric in _PROBABILITY_METRICS
        )
        stat = token_filter_statistic(fd, f.metric, target, behaviour)
        if f.metric != "ratio":  # fd is finite; the statistics can overflow: keep them finite
            stat = torch.nan_to_num(stat, nan=0.0, posinf=big, neginf=-big)
        stage = _Stage(spec=f)
        # Tokens this filter may reject: all, or only those with a negative advantage.
        eligible = negative if f.negative_advantages_only else None  # [B, T] or None
        if f.level == "token":
            in_band = f_finite.masked_fill(out_of_bounds(stat, lo, hi), 0.0)  # non-finite d: out of band
            stage.keep_tok = in_band if eligible is None else 1.0 - (1.0 - in_band) * eligible
            kept = alive * stage.keep_tok
            rejected = alive - kept
            stage.touched = pack.add_sum(f"{name}/touched", rejected.sum(-1))
            if negative is not None:
                stage.negative = pack.add_sum(f"{name}/negative", (rejected * negative).sum(-1))
            alive = kept
        else:
            alive_fin = alive * f_finite
            stage.count = pack.add_sum(f"{name}/count", alive.sum(-1))
            stage.nonfinite = pack.add_sum(f"{name}/nonfinite", (alive - alive_fin).sum(-1))
            if negative is not None:
                stage.negative = pack.add_sum(f"{name}/negative", (alive * negative).sum(-1))
            agg = f.aggregation
            masked = stat * alive_fin  # [B, T], 0 off the stage's tokens
            if agg in ("mean", "sum"):
                stage.total = pack.add_sum(f"{name}/total", masked.sum(-1))
            if agg in ("max", "min", "any"):
                penalty = extrema_penalty(alive_fin)  # pushes other tokens out of max/min
                if agg in ("max", "any"):
                    stage.maximum = pack.add_max(f"{name}/max", _row_max(masked - penalty, -big))
                if agg in ("min", "any"):
                    stage.negated_minimum = pack.add_max(f"{name}/negated_min", _row_max(-masked - penalty, -big))
        stages.append(stage)
    pack.add_sum("kept", (alive * masks.valid).sum(-1))
    if negative is not None:
        pack.add_sum("kept_negative", (alive * masks.valid * negative).sum(-1))
    return stages, alive


def _row_max(x: torch.Tensor, empty: float) -> torch.Tensor:
    """``[B]`` max over the last dimension; ``empty`` when it has no position.

    T = 0 happens in a CP shard or a batch of prompts without a response, where ``amax`` raises.
    """
    if x.shape[-1] == 0:
        return x.new_full(x.shape[:-1], empty)
    return x.amax(-1)


def _sequence_rejects(stage: _Stage, stats: ReducedStatistics) -> torch.Tensor:
    """``[B]`` bool: the sequence filter rejects the row, decided on reduced statistics."""
    f = stage.spec
    lo, hi = _filter_bounds(f)
    count = stats.sum(stage.count)
    agg = f.aggregation
    if agg == "mean":
        reject = out_of_bounds(stats.sum(stage.total) / (count + EPS), lo, hi)
    elif agg == "sum":
        reject = out_of_bounds(stats.sum(stage.total), lo, hi)
    elif agg == "max":
        reject = out_of_bounds(stats.max(stage.maximum), lo, hi)
    elif agg == "min":
        reject = out_of_bounds(-stats.max(stage.negated_minimum), lo, hi)
    else:  # any: some valid token outside the bounds
        above = out_of_bounds(stats.max(stage.maximum), None, hi)
        reject = above | out_of_bounds(-stats.max(stage.negated_minimum), lo, None)
    reject = reject | (stats.sum(stage.nonfinite) > 0)
    # A sequence with no token left at this stage is never rejected (and never NaN).
    return reject & (count > 0)


@dataclass
class _RejectionOutcome:
    """The sequence-level result of the filters, from reduced statistics (``[B]`` each)."""

    sequence_kept: torch.Tensor  # 0/1: no unconditional sequence filter rejected the row
    conditional_rows: Optional[torch.Tensor]  # 0/1: an advantage-conditioned sequence filter
    # rejected the row, which loses its negative-advantage tokens (None: no such filter)
    kept_tokens: torch.Tensor  # valid tokens of the row still in the loss (weighted like valid)
    sequence_in_loss: torch.Tensor  # 0/1: not dropped as a whole sequence


def _apply_stages(
    stages: list[_Stage],
    stats: ReducedStatistics,
    seq_valid: torch.Tensor,  # [B] valid tokens (weighted, reduced)
    sample_mask: torch.Tensor,  # [B]
    metrics: MetricSet,
) -> _RejectionOutcome:
    """Run the sequence decisions in stage order and record per-stage metrics.

    Every number comes from the reduced per-row statistics, so the metrics are identical on
    all ranks and cost O(batch). A stage's metrics count only what it removed from the
    loss: units an earlier stage had already removed are not counted again.
    """
    seq_kept = torch.ones_like(sample_mask)  # [B] 0/1 rows no sequence filter rejected so far
    conditional = torch.zeros_like(sample_mask)  # [B] rows an advantage-conditioned filter rejected
    conditional_touched = torch.zeros_like(sample_mask)  # [B] ... and that lost a token to it
    for stage in stages:
        key = f"rs/{stage.spec.label}"
        live = seq_kept * sample_mask  # rows still alive at this stage, weighted like valid
        if stage.keep_tok is not None:
            rejected = stats.sum(stage.touched)  # tokens this filter rejected per row
            if stage.negative is not None:  # not those an earlier conditional rejection removed
                rejected = rejected - conditional * stats.sum(stage.negative)
            metrics.add_total(f"{key}/token_rejected_frac", rejected @ live, "tokens", "replicated")
            touched = torch.sign(rejected)
            metrics.add_total(f"{key}/seq_touched_frac", touched @ live, "sequences", "replicated")
            continue
        rejects = _sequence_rejects(stage, stats)  # [B] bool
        rejected = torch.where(rejects, live, 0.0)  # [B]
        in_loss = stats.sum(stage.count)  # the tokens those rows still have at this stage
        if stage.negative is not None:
            in_loss = in_loss - conditional * stats.sum(stage.negative)
        if stage.spec.negative_advantages_only:
            negative_alive = stats.sum(stage.negative)  # [B]
            # Rows that lose negative-advantage tokens now (not already removed earlier).
            newly = rejected * (1.0 - conditional) * torch.sign(negative_alive)
            conditional = torch.maximum(conditional, torch.sign(rejected))
            conditional_touched = torch.maximum(conditional_touched, torch.sign(newly))
            metrics.add_total(f"{key}/seq_rejected_frac", newly.sum(), "sequences", "replicated")
            metrics.add_total(f"{key}/token_rejected_frac", newly @ negative_alive, "tokens", "replicated")
            continue
        seq_kept = seq_kept.masked_fill(rejects, 0.0)
        metrics.add_total(f"{key}/seq_rejected_frac", rejected.sum(), "sequences", "replicated")
        metrics.add_total(f"{key}/token_rejected_frac", rejected @ in_loss, "tokens", "replicated")
    kept_rows = stats.sum("kept")  # [B] valid tokens every token filter kept (weighted)
    kept_tokens = kept_rows
    sequence_in_loss = seq_kept
    conditional_rows = None
    if "kept_negative" in stats.sums:  # some filter is advantage-conditioned
        conditional_rows = conditional
        kept_tokens = kept_rows - conditional * stats.sum("kept_negative")
        # A conditionally rejected row that has no token left leaves as a whole sequence.
        emptied = conditional_touched * (kept_tokens <= 0).to(seq_kept.dtype)
        sequence_in_loss = seq_kept * (1.0 - emptied)
    kept_tokens = kept_tokens * seq_kept
    metrics.add_total("rs_token_rejected_frac", seq_valid.sum() - kept_tokens.sum(), "tokens", "replicated")
    dropped = torch.maximum(1.0 - seq_kept, conditional_touched)
    metrics.add_total("rs_seq_rejected_frac", dropped @ sample_mask, "sequences", "replicated")
    return _RejectionOutcome(seq_kept, conditional_rows, kept_tokens, sequence_in_loss)


def apply_correction(
    cfg: RSClippedPGLossConfig,
    plan: CorrectionPlan,
    stats: Optional[ReducedStatistics],
    metrics: MetricSet,
    groups: SequenceGroups = NO_GROUPS,
) -> CorrectionResult:
    """Step 3: sequence decisions, the combined mask, IS weights, truncation, batch normalisation.

    Reads only ``stats`` (reduced over ``groups`` by :meth:`CorrectionPlan.reduce`) and local
    token values, so every rank of a group decides alike. Declares the correction's metrics
    in ``metrics``. ``groups`` is used only by ``is_batch_normalization`` (one more SUM of
    two numbers).

    IS weight per level (``n_i = sum_t m_it``):
    ``token``: ``w_it = exp(d_it)``; ``sequence``: ``w_i = exp(sum_t m_it d_it)``;
    ``sequence_mean``: ``w_i = exp(sum_t m_it d_it / n_i)``.
    """
    masks = plan.masks
    sample_mask = masks.sample_mask
    seq_d_sum = seq_valid = seq_ntok = seq_nonfinite = has_tokens = None
    if stats is not None:
        seq_d_sum, seq_valid, seq_ntok = stats.sum("d_sum"), stats.sum("valid"), stats.sum("token_mask")
        seq_nonfinite = stats.sum("nonfinite")
        has_tokens = (seq_valid > 0).to(seq_valid.dtype)  # [B] 0/1

    # ---- rejection: sequence decisions, the combined mask, per-stage metrics ----
    seq_in_loss = torch.ones_like(sample_mask)
    keep = masks.inputs_finite  # [B, T]
    kept_token_count = kept_seq_count = ratio_token_count = None
    if plan.stages:
        outcome = _apply_stages(plan.stages, stats, seq_valid, sample_mask, metrics)
        keep = plan.alive * outcome.sequence_kept.unsqueeze(-1) * masks.inputs_finite
        if outcome.conditional_rows is not None:
            keep = keep * (1.0 - outcome.conditional_rows.unsqueeze(-1) * plan.negative)
        seq_in_loss = outcome.sequence_in_loss
        kept_token_count = outcome.kept_tokens.sum()
    elif stats is not None:
        kept_token_count = stats.sum("kept").sum()
    loss_tokens = masks.valid * keep  # [B, T] valid tokens that reach the loss
    if stats is not None:
        if cfg.sequence_level_importance_ratios:
            ratio_token_count = stats.sum("ratio_tokens")
        kept_seq_count = (seq_in_loss * sample_mask) @ has_tokens

    # ---- IS weights at the chosen level, truncation, batch normalisation ----
    level = cfg.effective_is_level
    raw_weight = is_weights(level, plan.d, masks.d_finite, seq_d_sum, seq_valid, seq_nonfinite)
    kind = cfg.truncated_importance_sampling_type
    seq_mean_log_ratio = seq_d_sum / (seq_ntok + EPS) if kind == "seq-mask-tis" else None
    weight, oob = truncate_weights(
        raw_weight,
        kind,
        cfg.truncated_importance_sampling_ratio_min,
        cfg.truncated_importance_sampling_ratio,
        seq_mean_log_ratio,
    )
    if kind == "seq-mask-tis":
        metrics.add_masked_total("is_oob_ratio", oob, sample_mask, "sequences", "replicated")
    elif kind is not None:
        metrics.add_masked_total("is_oob_ratio", oob, masks.valid, "tokens", "sum")
    if cfg.is_batch_normalization is not None:
        units = masks.valid if level == "token" else sample_mask * has_tokens
        weight, factor = batch_normalize_weights(weight, units, level, cfg.is_batch_normalization, groups)
        metrics.add("is_batch_norm_factor", factor, "none", "replicated")
    if level == "token":
        _record_token_weight_metrics(metrics, raw_weight, weight, masks, loss_tokens)
    else:
        _record_sequence_weight_metrics(metrics, raw_weight, weight, sample_mask * has_tokens, seq_in_loss)
    return CorrectionResult(
        is_weight=weight,
        keep=keep,
        loss_tokens=loss_tokens,
        seq_token_count=seq_valid,
        seq_mask_count=seq_ntok,
        kept_token_count=kept_token_count,
        kept_seq_count=kept_seq_count,
        ratio_token_count=ratio_token_count,
        ratio_mask=plan.ratio_mask,
        metrics=metrics,
    )


def compute_correction(
    cfg: RSClippedPGLossConfig,
    d: torch.Tensor,
    masks: TokenMasks,
    counts: GlobalCounts,
    groups: SequenceGroups = NO_GROUPS,
    *,
    log_probs: Optional[PolicyLogProbs] = None,
    advantages: Optional[torch.Tensor] = None,
) -> CorrectionResult:
    """The whole correction of one microbatch: :func:`plan_correction`, the reduction, :func:`apply_correction`.

    ``d = prev - gen`` (``[B, T]``, non-finite entries already replaced by 0; ``masks.d_finite``
    marks them); ``counts`` are NeMo-RL's global valid tokens and sequences.

    Order: token filters are local decisions and run first; each sequence filter aggregates
    over the valid tokens kept by the token filters listed *before* it (SkyRL's order when a
    token filter comes first, VERL's when it comes after); all per-sequence statistics are
    reduced over ``groups`` in one step; then sequence decisions, IS weights, truncation and
    the batch normalisation (:func:`batch_normalize_weights`). The metrics are in
    ``result.metrics`` (``result.metrics.finalize(groups)`` reads them).

    Token masks are 0/1 floats throughout: on CPU, float arithmetic is several times cheaper
    than boolean ops, and none of it syncs with the host.
    """
    plan = plan_correction(cfg, d, masks, log_probs=log_probs, advantages=advantages)
    stats = plan.reduce(groups)
    return apply_correction(cfg, plan, stats, MetricSet(counts, batched_evaluation(d.device)), groups)


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
    token_level = level == "token"
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


def is_weights(
    level: str,
    d: torch.Tensor,  # [B, T]
    d_finite: torch.Tensor,  # [B, T] float 0/1
    seq_d_sum: Optional[torch.Tensor],  # [B] sum_t m d, reduced over ranks
    seq_n: Optional[torch.Tensor],  # [B] n_i, reduced over ranks
    seq_nonfinite: Optional[torch.Tensor],  # [B] valid tokens with non-finite d, reduced over ranks
) -> torch.Tensor:
    """Untruncated IS weight: ``[B, T]`` for ``token``, ``[B, 1]`` for the sequence levels.

    ``token``: ``exp(d_t)``; ``sequence``: ``exp(sum_t m d)``; ``sequence_mean``:
    ``exp(sum_t m d / n)``. A non-finite log-ratio gives weight 0 (its token, or its sequence).
    """
    if level == "token":
        return finite_exp(d) * d_finite  # d is 0 where it was not finite: weight 0 there
    seq_log_w = seq_d_sum if level == "sequence" else seq_d_sum / (seq_n + EPS)
    return finite_exp(seq_log_w).masked_fill(seq_nonfinite > 0, 0.0).unsqueeze(-1)


def truncate_weights(
    raw_weight: torch.Tensor,  # [B, T] or [B, 1]
    kind: Optional[str],
    lower: Optional[float],
    upper: float,
    seq_mean_log_ratio: Optional[torch.Tensor] = None,  # [B] sum_t token_mask d / n (seq-mask-tis)
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """NeMo-RL's truncation ``kind`` on the chosen level: ``(weight, out_of_bounds)``.

    ``tis``: ``clamp(w, lower or 0, upper)``; ``icepop``: ``w`` inside ``[lower, upper]``,
    else 0; ``seq-mask-tis``: sequences whose geometric mean ``exp(seq_mean_log_ratio)`` is
    outside ``[lower, upper]`` get 0, the others keep the untruncated weight (NeMo-RL's
    rule: the mean runs over ``token_mask``, non-finite log-ratios counted as 0).
    ``out_of_bounds`` is the float 0/1 mask of the units whose raw weight (or geometric mean)
    lies outside: ``w``'s shape for ``tis``/``icepop``, ``[B]`` for ``seq-mask-tis``, ``None``
    without truncation.
    """
    if kind is None:
        return raw_weight, None
    if kind == "tis":
        lower = 0.0 if lower is None else lower
        oob = out_of_bounds(raw_weight, lower, upper)
        return raw_weight.clamp(lower, upper), oob.to(raw_weight.dtype)
    if kind == "icepop":
        oob = out_of_bounds(raw_weight, lower, upper)
        return raw_weight.masked_fill(oob, 0.0), oob.to(raw_weight.dtype)
    oob = out_of_bounds(torch.exp(seq_mean_log_ratio), lower, upper)  # seq-mask-tis, [B]
    return raw_weight.masked_fill(oob.unsqueeze(-1), 0.0), oob.to(raw_weight.dtype)


def _record_token_weight_metrics(
    metrics: MetricSet,
    raw_weight: torch.Tensor,  # [B, T]
    weight: torch.Tensor,  # [B, T] truncated (and normalised)
    masks: TokenMasks,
    loss_tokens: torch.Tensor,  # [B, T] valid tokens that reach the loss
) -> None:
    """Per-token IS weight statistics: sums over tokens / ``global_valid_toks``, summed over CP ranks.

    ``is_weight_raw_*`` over valid tokens before truncation, ``is_weight_*`` over the tokens
    that reach the loss; ``is_ess = (sum w)^2 / (n sum w^2)`` of the applied weights (per
    microbatch; ``is_weight_mean^2 / is_weight_sq_mean`` gives it globally).
    """
    metrics.add_masked_total("is_weight_raw_mean", raw_weight, masks.valid, "tokens", "sum")
    metrics.add_masked_totals(
        ["is_weight_mean", "is_weight_sq_mean"], [weight, weight * weight], loss_tokens, "tokens", "sum"
    )
    metrics.add_total("_ess_units", masks.valid.sum(), "tokens", "sum")
    metrics.add_masked_extrema("is_weight_raw_min", "is_weight_raw_max", raw_weight, masks.usable_penalty)
    applied_penalty = extrema_penalty(torch.sign(weight * loss_tokens))  # kept tokens with a weight
    metrics.add_masked_extrema("is_weight_min", "is_weight_max", weight, applied_penalty)
    metrics.derive("is_ess", "none", _effective_sample_size)


def _record_sequence_weight_metrics(
    metrics: MetricSet,
    raw_weight: torch.Tensor,  # [B, 1]
    weight: torch.Tensor,  # [B, 1] truncated (and normalised)
    units: torch.Tensor,  # [B] sample_mask of sequences with a valid token
    seq_in_loss: torch.Tensor,  # [B] 0/1 not dropped by a sequence filter
) -> None:
    """Per-sequence IS weight statistics: sums over sequences / ``global_valid_seqs``, identical on CP ranks.

    As :func:`_record_token_weight_metrics`, with a sequence (that has a valid token) as the unit.
    """
    raw, applied = raw_weight.squeeze(-1), weight.squeeze(-1)
    kept_units = units * seq_in_loss
    metrics.add_masked_total("is_weight_raw_mean", raw, units, "sequences", "replicated")
    metrics.add_masked_totals(
        ["is_weight_mean", "is_weight_sq_mean"],
        [applied, applied * applied],
        kept_units,
        "sequences",
        "replicated",
    )
    metrics.add_total("_ess_units", units.sum(), "sequences", "replicated")
    metrics.add_masked_extrema("is_weight_raw_min", "is_weight_raw_max", raw, extrema_penalty(torch.sign(units)))
    metrics.add_masked_extrema(
        "is_weight_min", "is_weight_max", applied, extrema_penalty(torch.sign(applied * kept_units))
    )
    metrics.derive("is_ess", "none", _effective_sample_size)


def _effective_sample_size(out: dict[str, float]) -> float:
    """``(sum w)^2 / (n sum w^2)`` from the three normalised sums (the normalisation cancels)."""
    mean, sq_mean, units = out["is_weight_mean"], out["is_weight_sq_mean"], out["_ess_units"]
    return mean * mean / (units * sq_mean) if sq_mean > 0 and units > 0 else 0.0
