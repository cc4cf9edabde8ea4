"""IS weights at the chosen level, NeMo-RL's truncation, and the weight metrics.

IS weight per level: :data:`~nemo_rs_plugin.core.registries.is_levels.IS_LEVELS` (its formulas, and the
log-weight of a sequence from its reduced statistics). See: docs/guide.md#is-correction-level.

References:
    - ``is_correction_level``: NeMo-RL PR #2269, https://github.com/NVIDIA-NeMo/RL/pull/2269
    - the truncation types (``tis``, ``icepop``, ``seq-mask-tis``): their papers and PRs are cited
      once, in :mod:`nemo_rs_plugin.core.registries.truncation`, the registry that defines them.
"""

from __future__ import annotations

from typing import Optional

import torch

from nemo_rs_plugin.core.correction.statistics import SequenceStatistics
from nemo_rs_plugin.core.masking import EPS, TokenMasks, extrema_penalty, finite_exp, masked_sum
from nemo_rs_plugin.core.registries.is_levels import is_level
from nemo_rs_plugin.core.registries.truncation import truncation
from nemo_rs_plugin.core.reporting.metric_catalog import WEIGHT_TAIL
from nemo_rs_plugin.core.reporting.metric_kernels import EffectiveSampleSize
from nemo_rs_plugin.core.reporting.metrics import MetricSet
from nemo_rs_plugin.core.settings.config import RSClippedPGLossConfig

#: ``is_ess = (sum w)^2 / (n sum w^2)`` from the two weight sums and the units, each divided by the same count.
_EFFECTIVE_SAMPLE_SIZE = EffectiveSampleSize("is_weight_mean", "is_weight_sq_mean", "_ess_units")

__all__ = [
    "WEIGHT_TAIL",
    "apply_truncation",
    "is_weights",
    "record_sequence_weight_metrics",
    "record_token_weight_metrics",
    "truncate_weights",
]


def is_weights(
    level: str,
    d: torch.Tensor,  # [B, T]
    d_finite: Optional[torch.Tensor],  # [B, T] float 0/1 (None: every entry finite)
    stats: Optional[SequenceStatistics],  # reduced over ranks; a per-sequence level reads it
) -> torch.Tensor:
    """Untruncated IS weight of ``level`` (:data:`~nemo_rs_plugin.core.registries.is_levels.IS_LEVELS`).

    ``[B, T]`` for a per-token level, ``[B, 1]`` for a per-sequence one (``exp`` of the entry's
    ``sequence_log_weight`` of ``(stats.d_sum, stats.valid)``). A non-finite log-ratio gives
    weight 0 (its token, or its sequence). An unknown level is a ``ValueError``; so is a
    per-sequence level without ``stats``.
    """
    entry = is_level(level)
    if entry.sequence_log_weight is None:  # per token
        weight = finite_exp(d)
        return weight if d_finite is None else weight * d_finite  # d is 0 where it was not finite: weight 0 there
    if stats is None:
        raise ValueError(
            f"is_correction_level {level!r}: a per-sequence weight needs the reduced per-sequence statistics"
        )
    seq_log_w = entry.sequence_log_weight(stats.d_sum, stats.valid)
    return finite_exp(seq_log_w).masked_fill(stats.nonfinite > 0, 0.0).unsqueeze(-1)


def truncate_weights(
    raw_weight: torch.Tensor,  # [B, T] or [B, 1]
    kind: Optional[str],
    lower: Optional[float],
    upper: Optional[float],
    seq_mean_log_ratio: Optional[torch.Tensor] = None,  # [B] sum_t token_mask d / n (per-sequence types)
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """NeMo-RL's truncation ``kind`` on the chosen level: ``(weight, out_of_bounds)``.

    The entry of :data:`~nemo_rs_plugin.core.registries.truncation.TRUNCATIONS` (``tis``:
    ``clamp(w, lower or 0, upper)``; ``icepop``: ``w`` inside ``[lower, upper]``, else 0;
    ``seq-mask-tis``: sequences whose geometric mean ``exp(seq_mean_log_ratio)`` is outside
    ``[lower, upper]`` get 0, the others keep the untruncated weight, NeMo-RL's rule: the mean
    runs over ``token_mask``, non-finite log-ratios counted as 0). ``out_of_bounds`` is the
    float 0/1 mask of the units whose raw weight (or geometric mean) lies outside: ``w``'s shape
    per unit, ``[B]`` per sequence, ``None`` without truncation. A ``None`` bound is open (the
    configuration sets ``upper`` with a kind). An unknown kind is a ``ValueError``.
    """
    if kind is None:
        return raw_weight, None
    return truncation(kind).truncate(raw_weight, lower, upper, seq_mean_log_ratio)


def apply_truncation(
    cfg: RSClippedPGLossConfig,
    raw_weight: torch.Tensor,  # [B, T] or [B, 1]
    stats: Optional[SequenceStatistics],  # reduced (None without statistics); seq-mask-tis reads it
    masks: TokenMasks,
    metrics: MetricSet,
) -> torch.Tensor:
    """:func:`truncate_weights` as ``cfg`` asks, and its ``is_oob_ratio`` metric."""
    kind, entry = cfg.truncated_importance_sampling_type, cfg.truncation_entry
    per_sequence = entry is not None and entry.per_sequence
    seq_mean_log_ratio = None
    if per_sequence and stats is not None:  # needs_sequence_statistics holds for a per-sequence type
        seq_mean_log_ratio = stats.d_sum / (stats.token_mask + EPS)
    weight, oob = truncate_weights(
        raw_weight,
        kind,
        cfg.truncated_importance_sampling_ratio_min,
        cfg.truncated_importance_sampling_ratio,
        seq_mean_log_ratio,
    )
    if oob is None:
        return weight
    # the units the truncation decides on: sequences (the catalog's normalization follows them)
    metrics.add_masked_total("is_oob_ratio", oob, masks.sample_mask if per_sequence else masks.valid)
    return weight


def record_token_weight_metrics(
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
    metrics.add_masked_total("is_weight_raw_mean", raw_weight, masks.valid)
    applied = weight * loss_tokens  # [B, T] the weights as the loss applies them
    metrics.add_total("is_weight_mean", applied.sum())
    metrics.add_total("is_weight_sq_mean", masked_sum(weight, applied))  # sum_t w_t^2 m_t
    metrics.add_total("_ess_units", masks.valid_total)
    _record_tails(metrics, raw_weight, masks.usable_penalty)
    metrics.add_masked_extrema("is_weight_raw_min", "is_weight_raw_max", raw_weight, masks.usable_penalty)
    applied_penalty = extrema_penalty(applied.sign_())  # kept tokens with a weight (applied is read: reused)
    metrics.add_masked_extrema("is_weight_min", "is_weight_max", weight, applied_penalty)
    metrics.derive("is_ess", _EFFECTIVE_SAMPLE_SIZE)


def record_sequence_weight_metrics(
    metrics: MetricSet,
    raw_weight: torch.Tensor,  # [B, 1]
    weight: torch.Tensor,  # [B, 1] truncated (and normalised)
    units: torch.Tensor,  # [B] sample_mask of sequences with a valid token
    seq_in_loss: Optional[torch.Tensor],  # [B] 0/1 not dropped by a sequence filter (None: no filter ran)
) -> None:
    """Per-sequence IS weight statistics: sums over sequences / ``global_valid_seqs``, identical on CP ranks.

    As :func:`record_token_weight_metrics`, with a sequence (that has a valid token) as the unit.
    """
    raw, applied = raw_weight.squeeze(-1), weight.squeeze(-1)
    kept_units = units if seq_in_loss is None else units * seq_in_loss
    metrics.add_masked_total("is_weight_raw_mean", raw, units)
    metrics.add_masked_totals(["is_weight_mean", "is_weight_sq_mean"], [applied, applied * applied], kept_units)
    metrics.add_total("_ess_units", units.sum())
    unit_penalty = extrema_penalty(torch.sign(units))
    _record_tails(metrics, raw, unit_penalty)
    metrics.add_masked_extrema("is_weight_raw_min", "is_weight_raw_max", raw, unit_penalty)
    metrics.add_masked_extrema(
        "is_weight_min", "is_weight_max", applied, extrema_penalty(torch.sign(applied * kept_units))
    )
    metrics.derive("is_ess", _EFFECTIVE_SAMPLE_SIZE)


def _record_tails(metrics: MetricSet, raw_weight: torch.Tensor, penalty: torch.Tensor) -> None:
    """``is_weight_raw_{low,high}_frac``: shares of the units whose raw weight is below ``1/C``, above ``C``.

    ``C`` = :data:`WEIGHT_TAIL`; the units are those of ``is_weight_raw_min``/``_max`` (``penalty``:
    :func:`~nemo_rs_plugin.core.masking.extrema_penalty` of their mask), counted with the same
    penalised values, so that a compiled core counts them in the loop that finds the extremes
    (a separate masked sum costs a kernel of its own). Sums over units divided by the global
    count: they add up over calls, microbatches and ranks.
    """
    # count_nonzero, not sum(dtype=...): a float sum of a bool tensor casts it into a [B, T] temporary.
    # Integer counts: the CPU form's MetricSet.stack casts them to the metrics' float dtype (the GPU
    # form's cat promotes them).
    low = torch.count_nonzero((raw_weight + penalty) < 1.0 / WEIGHT_TAIL)
    high = torch.count_nonzero((raw_weight - penalty) > WEIGHT_TAIL)
    metrics.add_total("is_weight_raw_low_frac", low)
    metrics.add_total("is_weight_raw_high_frac", high)
