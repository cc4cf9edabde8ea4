"""The correction of one microbatch in three visible steps: plan (local), reduce (one collective), apply.

:func:`plan_correction` computes every local decision and every partial per-sequence
statistic; :meth:`CorrectionPlan.reduce` passes all of them through one collective
(:meth:`~nemo_rs_plugin.core.correction.statistics.SequenceStatistics.reduce`);
:func:`apply_correction` derives masks, weights and metrics from the reduced statistics only.
The loss calls them in order; :func:`compute_correction` chains them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from nemo_rs_plugin.core.config import RSClippedPGLossConfig
from nemo_rs_plugin.core.correction.filters import PolicyLogProbs, apply_filters, plan_filters
from nemo_rs_plugin.core.correction.statistics import SequenceStatistics, batch_normalize_weights
from nemo_rs_plugin.core.correction.weights import (
    apply_truncation,
    is_weights,
    record_sequence_weight_metrics,
    record_token_weight_metrics,
)
from nemo_rs_plugin.core.distributed import NO_GROUPS, SequenceGroups
from nemo_rs_plugin.core.masking import TokenMasks, sanitize
from nemo_rs_plugin.core.metrics import GlobalCounts, MetricSet, batched_evaluation

__all__ = [
    "CorrectionPlan",
    "CorrectionResult",
    "apply_correction",
    "compute_correction",
    "needs_sequence_statistics",
    "plan_correction",
]


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
        policy_gradient_keep: ``[B, T]`` 0/1, the tokens whose policy-gradient term no filter
            with ``applies_to: policy_gradient`` removed (``None`` without such a filter); the
            loss multiplies its policy-gradient term by it, on top of ``keep``.
        metrics: the :class:`~nemo_rs_plugin.core.metrics.MetricSet` the correction declared its
            metrics in.
        batch_norm_factor: ``[]`` the mean the weights were divided by (``None`` without
            ``is_batch_normalization``).
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
    policy_gradient_keep: Optional[torch.Tensor] = None
    batch_norm_factor: Optional[torch.Tensor] = None


def needs_sequence_statistics(cfg: RSClippedPGLossConfig) -> bool:
    """Whether anything in this configuration reads a per-sequence statistic.

    NeMo-RL's default (token IS level, token-level loss, no filter) reads none, and then no
    per-sequence sum is computed or reduced at all.
    """
    return (
        not cfg.is_level_entry.per_token
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
    alive: Optional[torch.Tensor]  # [B, T] valid tokens every token filter kept (None: no statistics)
    negative: Optional[torch.Tensor]  # [B, T] 0/1 negative advantage, for conditioned filters
    ratio_mask: Optional[torch.Tensor]  # [B, T] the GSPO ratio's tokens
    statistics: Optional[SequenceStatistics]  # local; None when no per-sequence statistic is needed
    # [B, T] tokens whose policy-gradient term no policy-gradient-only filter removed (None: no such filter)
    policy_gradient_keep: Optional[torch.Tensor] = None

    def reduce(self, groups: SequenceGroups = NO_GROUPS) -> Optional[SequenceStatistics]:
        """All per-sequence statistics through one SUM (and one MAX) collective; ``None`` if there are none."""
        return self.statistics.reduce(groups) if self.statistics is not None else None


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
    negative = positive = None  # [B, T] 0/1 tokens with a negative / positive advantage
    conditions = {f.advantage_condition for f in cfg.rejection_sampling} - {None}
    if conditions:
        if advantages is None:
            raise ValueError(
                "rejection_sampling: a filter with negative_advantages_only or advantage_sign needs the "
                "advantages (compute_correction(..., advantages=...))"
            )
        clean_advantages = sanitize(advantages.detach())
        if "negative" in conditions:
            negative = (clean_advantages < 0).to(d.dtype)
        if "positive" in conditions:
            positive = (clean_advantages > 0).to(d.dtype)
    if not needs_sequence_statistics(cfg):
        return CorrectionPlan(d=d, masks=masks, alive=None, negative=negative, ratio_mask=None, statistics=None)
    stages, alive, policy_gradient_keep = plan_filters(cfg.rejection_sampling, d, masks, negative, log_probs, positive)
    ratio_mask = None
    if cfg.sequence_level_importance_ratios:
        # The GSPO ratio averages over the row's token_mask tokens with finite inputs, less
        # the valid tokens a token filter rejected (a rejected token gets no gradient; as
        # VERL, whose rejection edits the response mask its GSPO ratio reads).
        ratio_mask = masks.where_inputs_finite(masks.token_mask) * (1.0 - masks.valid_bin + alive)
    statistics = SequenceStatistics(
        d_sum=(d * masks.valid).sum(-1),  # sum_t m d
        valid=masks.valid.sum(-1),  # n_i
        token_mask=masks.token_mask.sum(-1).to(d.dtype),
        nonfinite=masks.nonfinite_d_per_sequence(),
        kept=(alive * masks.valid).sum(-1),
        stages=stages,
        kept_negative=(alive * masks.valid * negative).sum(-1) if negative is not None else None,
        ratio_tokens=ratio_mask.sum(-1).to(d.dtype) if ratio_mask is not None else None,
    )
    return CorrectionPlan(
        d=d,
        masks=masks,
        alive=alive,
        negative=negative,
        ratio_mask=ratio_mask,
        statistics=statistics,
        policy_gradient_keep=policy_gradient_keep,
    )


def _apply_rejection(
    cfg: RSClippedPGLossConfig,
    plan: CorrectionPlan,
    stats: Optional[SequenceStatistics],
    metrics: MetricSet,
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """``(keep, seq_in_loss, kept_token_count)``: sequence decisions, the combined mask, per-stage metrics."""
    masks = plan.masks
    seq_in_loss = torch.ones_like(masks.sample_mask)
    keep = masks.inputs_finite  # [B, T]
    kept_token_count = None
    if cfg.rejection_sampling:
        outcome = apply_filters(cfg.rejection_sampling, stats, masks.sample_mask, metrics)
        keep = masks.where_inputs_finite(plan.alive * outcome.sequence_kept.unsqueeze(-1))
        if outcome.conditional_rows is not None:
            keep = keep * (1.0 - outcome.conditional_rows.unsqueeze(-1) * plan.negative)
        seq_in_loss = outcome.sequence_in_loss
        kept_token_count = outcome.kept_tokens.sum()
    elif stats is not None:
        kept_token_count = stats.kept.sum()
    return keep, seq_in_loss, kept_token_count


def apply_correction(
    cfg: RSClippedPGLossConfig,
    plan: CorrectionPlan,
    stats: Optional[SequenceStatistics],
    metrics: MetricSet,
    groups: SequenceGroups = NO_GROUPS,
    batch_norm_factor: Optional[torch.Tensor] = None,
) -> CorrectionResult:
    """Step 3: sequence decisions, the combined mask, IS weights, truncation, batch normalisation.

    Reads only ``stats`` (reduced over ``groups`` by :meth:`CorrectionPlan.reduce`) and local
    token values, so every rank of a group decides alike. Declares the correction's metrics
    in ``metrics``. ``groups`` is used only by ``is_batch_normalization`` (one more SUM of
    two numbers), unless ``batch_norm_factor`` gives the mean to divide by (computed on the
    whole microbatch when this call sees one of its sequences:
    :mod:`nemo_rs_plugin.core.microbatch`); then nothing is reduced.

    IS weight per level: :data:`~nemo_rs_plugin.core.is_levels.IS_LEVELS`.
    """
    masks = plan.masks
    sample_mask = masks.sample_mask
    seq_d_sum = seq_valid = seq_ntok = seq_nonfinite = has_tokens = None
    if stats is not None:
        seq_d_sum, seq_valid, seq_ntok, seq_nonfinite = stats.d_sum, stats.valid, stats.token_mask, stats.nonfinite
        has_tokens = (seq_valid > 0).to(seq_valid.dtype)  # [B] 0/1

    keep, seq_in_loss, kept_token_count = _apply_rejection(cfg, plan, stats, metrics)
    # [B, T] valid tokens that reach the loss (without filters keep is inputs_finite)
    loss_tokens = masks.valid * keep if cfg.rejection_sampling else masks.where_inputs_finite(masks.valid)
    kept_seq_count = ratio_token_count = None
    if stats is not None:
        if cfg.sequence_level_importance_ratios:
            ratio_token_count = stats.ratio_tokens
        kept_seq_count = (seq_in_loss * sample_mask) @ has_tokens

    # ---- IS weights at the chosen level, truncation, batch normalisation ----
    level = cfg.effective_is_level
    d_finite = None if masks.all_finite else masks.d_finite
    raw_weight = is_weights(level, plan.d, d_finite, seq_d_sum, seq_valid, seq_nonfinite)
    weight = apply_truncation(cfg, raw_weight, seq_d_sum, seq_ntok, masks, metrics)
    factor = None
    if cfg.is_batch_normalization is not None:
        if batch_norm_factor is not None:
            weight, factor = weight / batch_norm_factor, batch_norm_factor
        else:
            units = masks.valid if cfg.is_level_entry.per_token else sample_mask * has_tokens
            weight, factor = batch_normalize_weights(weight, units, level, cfg.is_batch_normalization, groups)
        metrics.add("is_batch_norm_factor", factor, "none", "replicated", per_call=True)
    if cfg.is_level_entry.per_token:
        record_token_weight_metrics(metrics, raw_weight, weight, masks, loss_tokens)
    else:
        record_sequence_weight_metrics(metrics, raw_weight, weight, sample_mask * has_tokens, seq_in_loss)
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
        policy_gradient_keep=plan.policy_gradient_keep,
        batch_norm_factor=factor,
    )


# 7 parameters: the one-call public API (tools/simulate, the tests) takes the loss's inputs by name;
# plan_correction -> reduce -> apply_correction is the small-step form.
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
    the batch normalisation (:func:`~nemo_rs_plugin.core.correction.statistics.batch_normalize_weights`).
    The metrics are in ``result.metrics`` (``result.metrics.finalize(groups)`` reads them).

    Token masks are 0/1 floats throughout: on CPU, float arithmetic is several times cheaper
    than boolean ops, and none of it syncs with the host.
    """
    plan = plan_correction(cfg, d, masks, log_probs=log_probs, advantages=advantages)
    stats = plan.reduce(groups)
    return apply_correction(cfg, plan, stats, MetricSet(counts, batched_evaluation(d.device)), groups)
