"""The correction of one microbatch in three visible steps: plan (local), reduce (one collective), apply.

:func:`plan_correction` computes every local decision and every partial per-sequence
statistic; :meth:`CorrectionPlan.reduce` passes all of them through one collective
(:meth:`~nemo_rs_plugin.core.correction.statistics.SequenceStatistics.reduce`);
:func:`apply_correction` derives masks, weights and metrics from the reduced statistics only.
The loss's call (``CorrectedPGLoss._tensors``) calls the three in order, where its reader follows
them; :func:`compute_correction` chains them in one call for the loss's microbatch totals and
the one-call API (``nemo-rs simulate``, the tests).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from nemo_rs_plugin.core.correction.filters import PolicyLogProbs, apply_filters, plan_filters
from nemo_rs_plugin.core.correction.statistics import SequenceStatistics, batch_normalize_weights
from nemo_rs_plugin.core.correction.weights import (
    apply_truncation,
    is_weights,
    record_sequence_weight_metrics,
    record_token_weight_metrics,
)
from nemo_rs_plugin.core.distributed import NO_GROUPS, SequenceGroups
from nemo_rs_plugin.core.evaluation import EvaluationForm
from nemo_rs_plugin.core.masking import TokenMasks, row_dot, sanitize
from nemo_rs_plugin.core.reporting.metric_catalog import declared_specs
from nemo_rs_plugin.core.reporting.metrics import GlobalCounts, MetricSet
from nemo_rs_plugin.core.settings.config import RSClippedPGLossConfig
from nemo_rs_plugin.core.settings.rejection_filter import StageSettings

__all__ = [
    "CorrectionPlan",
    "CorrectionResult",
    "RatioTokens",
    "SequenceCounts",
    "apply_correction",
    "compute_correction",
    "needs_sequence_statistics",
    "plan_correction",
]


@dataclass
class SequenceCounts:
    """Per-sequence counts over all ranks: present exactly when :func:`needs_sequence_statistics` holds.

    Attributes:
        token_count: ``[B]`` valid tokens per sequence (``sum_t m``).
        mask_count: ``[B]`` ``token_mask`` tokens per sequence.
        kept_tokens: ``[]`` kept valid tokens, with ``rejection_denominator: kept`` (its only
            reader; ``None`` otherwise).
        kept_sequences: ``[]`` kept valid sequences, likewise.
    """

    token_count: torch.Tensor
    mask_count: torch.Tensor
    kept_tokens: Optional[torch.Tensor]
    kept_sequences: Optional[torch.Tensor]


@dataclass
class RatioTokens:
    """The tokens GSPO's sequence ratio averages over: present exactly with the GSPO ratio.

    Attributes:
        mask: ``[B, T]`` ``token_mask`` tokens with finite inputs, less valid tokens a token
            filter rejected (with no token filter it is NeMo-RL's mask).
        count: ``[B]`` ``mask`` tokens per sequence over all ranks: the ratio's denominator.
    """

    mask: torch.Tensor
    count: torch.Tensor


@dataclass
class CorrectionResult:
    """What the loss needs from the correction layer; every tensor is detached.

    Attributes:
        is_weight: ``[B, T]`` or ``[B, 1]`` IS weight after truncation (1 where unused).
        keep: ``[B, T]`` float, 1 for units kept by rejection sampling and finite inputs.
        loss_tokens: ``[B, T]`` ``valid * keep``, the tokens that reach the loss.
        metrics: the :class:`~nemo_rs_plugin.core.reporting.metrics.MetricSet` the correction declared its
            metrics in.
        sequences: the per-sequence counts (``None`` exactly when
            :func:`needs_sequence_statistics` is false: nothing reads them).
        ratio: the GSPO ratio's tokens (``None`` without the GSPO ratio).
        policy_gradient_keep: ``[B, T]`` 0/1, the tokens whose policy-gradient term no filter
            with ``applies_to: policy_gradient`` removed (``None`` without such a filter); the
            loss multiplies its policy-gradient term by it, on top of ``keep``.
        batch_norm_factor: ``[]`` the mean the weights were divided by (``None`` without
            ``is_batch_normalization``).
    """

    is_weight: torch.Tensor
    keep: torch.Tensor
    loss_tokens: torch.Tensor
    metrics: MetricSet
    sequences: Optional[SequenceCounts]
    ratio: Optional[RatioTokens] = None
    policy_gradient_keep: Optional[torch.Tensor] = None
    batch_norm_factor: Optional[torch.Tensor] = None


def needs_sequence_statistics(cfg: RSClippedPGLossConfig) -> bool:
    """Whether anything in this configuration reads a per-sequence statistic.

    NeMo-RL's default (token IS level, token-level loss, no filter) reads none, and then no
    per-sequence sum is computed or reduced at all. (``len`` of the stage tuple, not ``bool``:
    dynamo in torch 2.11 cannot trace ``bool`` of a tuple, and that one call broke the compiled
    core of every configuration with a filter into 15 graphs on a GPU.)
    """
    return (
        not cfg.is_level_entry.per_token
        or (cfg.truncation_entry is not None and cfg.truncation_entry.per_sequence)
        or len(cfg.rejection_sampling) > 0
        or not cfg.token_level_loss
        or cfg.positive_example_nll_weight > 0
        or cfg.denominator_entry.counts_kept
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
    # the filters, as plan_correction was given them: apply_correction decides with the same ones
    stages: Sequence[StageSettings] = ()

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
    stages: Optional[Sequence[StageSettings]] = None,
) -> CorrectionPlan:
    """Token-filter decisions (local) and the local per-sequence statistics of everything else.

    ``d = prev - gen`` (``[B, T]``, non-finite entries already 0). ``log_probs`` is needed by
    filters whose ``log_ratio`` is not ``prev-gen`` or whose statistic lives in probability
    space; ``advantages`` by advantage-conditioned filters. ``stages``: ``cfg.rejection_sampling``
    resolved once (:meth:`~nemo_rs_plugin.core.settings.rejection_filter.RejectionFilter.resolved`,
    the loss's); ``None`` reads the configuration's. Nothing here reads a statistic of another rank.
    """
    d = d.detach()
    if stages is None:
        stages = cfg.rejection_sampling
    elif len(stages) != len(cfg.rejection_sampling):  # the rest of the call reads the configuration's
        raise ValueError(
            f"stages: {len(stages)} given for the configuration's {len(cfg.rejection_sampling)} "
            "rejection_sampling stages; pass resolved_stages(cfg.rejection_sampling)"
        )
    negative = positive = None  # [B, T] 0/1 tokens with a negative / positive advantage
    signs = {f.sign_entry.sign for f in stages if f.sign_entry is not None}
    if signs:
        if advantages is None:
            raise ValueError(
                "rejection_sampling: a filter with advantage_sign needs the "
                "advantages (compute_correction(..., advantages=...))"
            )
        clean_advantages = sanitize(advantages.detach())
        if -1.0 in signs:
            negative = (clean_advantages < 0).to(d.dtype)
        if 1.0 in signs:
            positive = (clean_advantages > 0).to(d.dtype)
    if not needs_sequence_statistics(cfg):
        return CorrectionPlan(
            d=d, masks=masks, alive=None, negative=negative, ratio_mask=None, statistics=None, stages=stages
        )
    stage_statistics, alive, policy_gradient_keep = plan_filters(stages, d, masks, negative, log_probs, positive)
    ratio_mask = None
    if cfg.sequence_level_importance_ratios:
        # The GSPO ratio averages over the row's token_mask tokens with finite inputs, less
        # the valid tokens a token filter rejected (a rejected token gets no gradient; as
        # VERL, whose rejection edits the response mask its GSPO ratio reads).
        ratio_mask = masks.where_inputs_finite(masks.token_mask) * (1.0 - masks.valid_bin + alive)
    valid_per_row = masks.valid.sum(-1)
    # Without a token filter every valid token is alive (alive is valid_bin, and valid_bin * valid = valid).
    kept_per_row = valid_per_row if alive is masks.valid_bin else row_dot(alive, masks.valid)
    statistics = SequenceStatistics(
        d_sum=row_dot(d, masks.valid),  # sum_t m d
        valid=valid_per_row,  # n_i
        token_mask=masks.token_mask.sum(-1).to(d.dtype),
        nonfinite=masks.nonfinite_d_per_sequence(),
        kept=kept_per_row,
        stages=stage_statistics,
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
        stages=stages,
    )


def apply_correction(
    cfg: RSClippedPGLossConfig,
    plan: CorrectionPlan,
    stats: Optional[SequenceStatistics],
    metrics: MetricSet,
    groups: SequenceGroups = NO_GROUPS,
    batch_norm_factor: Optional[torch.Tensor] = None,
) -> CorrectionResult:
    """Step 3: sequence decisions, the combined mask, IS weights, truncation, batch normalisation.

    Reads only ``stats`` (reduced over ``groups`` by :meth:`CorrectionPlan.reduce`; ``None``
    exactly when :func:`needs_sequence_statistics` is false) and local token values, so every
    rank of a group decides alike. Declares the correction's metrics in ``metrics``.
    ``groups`` is used only by ``is_batch_normalization`` (one more SUM of two numbers),
    unless ``batch_norm_factor`` gives the mean to divide by (computed on the whole
    microbatch when this call sees one of its sequences:
    :mod:`nemo_rs_plugin.core.batch.microbatch`); then nothing is reduced.

    IS weight per level: :data:`~nemo_rs_plugin.core.registries.is_levels.IS_LEVELS`.
    """
    masks = plan.masks
    sample_mask = masks.sample_mask
    level_entry = cfg.is_level_entry  # read four times below: looked up once
    sequences = ratio = None
    seq_in_loss = has_tokens = None  # [B] 0/1 rows no filter dropped, rows with a valid token (None: not read)
    if stats is None:  # token level, token-level loss, no filter: nothing reads a sequence
        keep = masks.inputs_finite
        loss_tokens = masks.where_inputs_finite(masks.valid)
    else:
        if not plan.stages or plan.alive is None:  # alive: set with the statistics
            keep, kept_per_row = masks.inputs_finite, stats.kept
        else:  # sequence decisions, the combined mask, per-stage metrics
            outcome = apply_filters(plan.stages, stats, sample_mask, metrics)
            keep = masks.where_inputs_finite(plan.alive * outcome.sequence_kept.unsqueeze(-1))
            if outcome.conditional_rows is not None and plan.negative is not None:  # set together
                keep = keep * (1.0 - outcome.conditional_rows.unsqueeze(-1) * plan.negative)
            seq_in_loss, kept_per_row = outcome.sequence_in_loss, outcome.kept_tokens
        # [B, T] valid tokens that reach the loss (without filters keep is inputs_finite)
        loss_tokens = masks.valid * keep if plan.stages else masks.where_inputs_finite(masks.valid)
        # Computed where read only (each is a kernel on every call): the weights' units of a
        # per-sequence level, the kept counts of rejection_denominator: kept.
        kept_denominators = cfg.denominator_entry.counts_kept
        if not level_entry.per_token or kept_denominators:
            has_tokens = (stats.valid > 0).to(stats.valid.dtype)
        kept_tokens = kept_sequences = None
        if kept_denominators and has_tokens is not None:  # has_tokens: set just above
            in_loss = sample_mask if seq_in_loss is None else seq_in_loss * sample_mask
            kept_tokens, kept_sequences = kept_per_row.sum(), in_loss @ has_tokens
        sequences = SequenceCounts(stats.valid, stats.token_mask, kept_tokens, kept_sequences)
        if plan.ratio_mask is not None and stats.ratio_tokens is not None:  # the GSPO ratio's, set together
            ratio = RatioTokens(plan.ratio_mask, stats.ratio_tokens)

    # ---- IS weights at the chosen level, truncation, batch normalisation ----
    level = level_entry.name
    d_finite = None if masks.all_finite else masks.d_finite
    raw_weight = is_weights(level, plan.d, d_finite, stats)
    weight = apply_truncation(cfg, raw_weight, stats, masks, metrics)
    # The units a weight belongs to: valid tokens, or sequences with a valid token (a
    # per-sequence level always has statistics: is_weights raised otherwise).
    if level_entry.per_token or has_tokens is None:
        weight_units = masks.valid
    else:
        weight_units = sample_mask * has_tokens
    factor = None
    if cfg.is_batch_normalization is not None:
        if batch_norm_factor is not None:
            weight, factor = weight / batch_norm_factor, batch_norm_factor
        else:
            weight, factor = batch_normalize_weights(weight, weight_units, level, cfg.is_batch_normalization, groups)
        metrics.add("is_batch_norm_factor", factor)
    if level_entry.per_token:
        record_token_weight_metrics(metrics, raw_weight, weight, masks, loss_tokens)
    else:
        record_sequence_weight_metrics(metrics, raw_weight, weight, weight_units, seq_in_loss)
    return CorrectionResult(
        is_weight=weight,
        keep=keep,
        loss_tokens=loss_tokens,
        metrics=metrics,
        sequences=sequences,
        ratio=ratio,
        policy_gradient_keep=plan.policy_gradient_keep,
        batch_norm_factor=factor,
    )


# plan -> reduce -> apply in one call: the loss's microbatch totals and the one-call public API
# (tools/simulate, the tests, which pass the loss's inputs by name and get a metric set of their
# own). The loss's own call writes the three steps out, in order, where its reader follows them.
def compute_correction(
    cfg: RSClippedPGLossConfig,
    d: torch.Tensor,
    masks: TokenMasks,
    groups: SequenceGroups = NO_GROUPS,
    *,
    counts: Optional[GlobalCounts] = None,
    log_probs: Optional[PolicyLogProbs] = None,
    advantages: Optional[torch.Tensor] = None,
    metrics: Optional[MetricSet] = None,
    batch_norm_factor: Optional[torch.Tensor] = None,
    stages: Optional[Sequence[StageSettings]] = None,
) -> CorrectionResult:
    """The whole correction of one microbatch: :func:`plan_correction`, the reduction, :func:`apply_correction`.

    ``d = prev - gen`` (``[B, T]``, non-finite entries already replaced by 0; ``masks.d_finite``
    marks them); ``counts`` are NeMo-RL's global valid tokens and sequences, for a metric set of
    its own in the device's form; ``metrics``: declare into this one instead (the loss's; then
    ``counts`` may be ``None``). ``batch_norm_factor``: as :func:`apply_correction`; ``stages``: as
    :func:`plan_correction`.

    Order: token filters are local decisions and run first; each sequence filter aggregates
    over the valid tokens kept by the token filters listed *before* it (SkyRL's order when a
    token filter comes first, VERL's when it comes after); all per-sequence statistics are
    reduced over ``groups`` in one step; then sequence decisions, IS weights, truncation and
    the batch normalisation (:func:`~nemo_rs_plugin.core.correction.statistics.batch_normalize_weights`).
    The metrics are in ``result.metrics`` (``result.metrics.finalize(groups)`` reads them).

    Token masks are 0/1 floats throughout: on CPU, float arithmetic is several times cheaper
    than boolean ops, and none of it syncs with the host.
    """
    if metrics is None:
        metrics = MetricSet(declared_specs(cfg), counts=counts, form=EvaluationForm.for_device(d.device))
    plan = plan_correction(cfg, d, masks, log_probs=log_probs, advantages=advantages, stages=stages)
    return apply_correction(cfg, plan, plan.reduce(groups), metrics, groups, batch_norm_factor)
