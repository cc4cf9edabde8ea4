"""NeMo-RL's own metrics (``ClippedPGLossFn``'s), same names and meanings, from the loss's terms.

Token means are masked totals over the tokens that reach the loss with finite inputs, declared
with the metric set (one evaluation, one host transfer with the others); the clamped ratio's
extremes are derived on the host from the reduced extremes of the ratio.
"""

from __future__ import annotations

import math
from typing import Iterator

import torch

from nemo_rs_plugin.core.batch.sanitizing import SanitizedInputs
from nemo_rs_plugin.core.correction import CorrectionResult
from nemo_rs_plugin.core.loss_terms.objective import LossTerms, Objective
from nemo_rs_plugin.core.policy_loss import kl_estimate
from nemo_rs_plugin.core.reporting.metric_kernels import ClippedExtreme
from nemo_rs_plugin.core.reporting.metrics import MetricSet
from nemo_rs_plugin.core.settings.config import RSClippedPGLossConfig

__all__ = ["record_nemo_rl_metrics"]


def record_nemo_rl_metrics(
    objective: Objective,
    metrics: MetricSet,
    terms: LossTerms,
    clean: SanitizedInputs,
    usable: torch.Tensor,  # [B, T] valid tokens with finite inputs (that reach the loss)
    corr: CorrectionResult,
) -> None:
    """Every metric NeMo-RL's ``ClippedPGLossFn`` returns, same names and meanings.

    Token means are masked totals over ``usable`` (:class:`MetricSet` evaluates them).
    """
    cfg = objective.cfg
    d = clean.d
    with torch.no_grad():
        kl, nll = terms.kl, terms.nll
        metrics.add("loss", terms.total)
        r, rc = terms.ratios.detach(), terms.ratios_clamped.detach()
        kl_type = cfg.reference_policy_kl_type
        # A masked position may hold any finite log-prob; exp of its log-ratio can overflow,
        # and inf * 0 in the masked sums below is NaN: no masked token reaches an exp.
        d = d * usable

        # Rows alive anyway (the ratios, the weight) wait for the metric set's one product per
        # mask in the GPU form; rows built for their metric alone are each reduced as they are
        # built, in both forms (one [B, T] alive; held for that product they were the GPU form's
        # peak memory).
        metrics.add_masked_total("probs_ratio", r, usable)
        metrics.add_masked_total("probs_ratio_clamped", rc, usable)
        metrics.add_masked_totals(list(_MISMATCH_ROWS), _mismatch_rows(d, clean, usable, kl_type), usable)
        if cfg.is_level_entry.per_token:
            metrics.add_masked_total("sampling_importance_ratio", corr.is_weight, usable)
        # NeMo-RL's own extremes: its wrappers and driver combine them by min and max
        metrics.add_masked_extrema("probs_ratio_min", "probs_ratio_max", r, clean.masks.usable_penalty)
        _clamped_extremes(cfg, metrics)
        if kl is not None:
            metrics.add("kl_penalty", kl / objective.kl_coef)
        else:
            metrics.add_zero("kl_penalty")
        if not cfg.is_level_entry.per_token:
            _sequence_sampling_importance_ratio(metrics, corr.is_weight, clean.masks.sample_mask)
        metrics.add("num_valid_samples", clean.masks.sample_total)
        if terms.sampler_kl is not None:
            metrics.add("sampler_kl_penalty", terms.sampler_kl)
        if nll is not None:
            metrics.add("positive_nll_loss", nll)
        else:
            metrics.add_zero("positive_nll_loss")


#: NeMo-RL's per-token mismatch metrics, in its order: the rows :func:`_mismatch_rows` yields.
_MISMATCH_ROWS = (
    "token_mult_prob_error",
    "gen_kl_error",
    "policy_kl_error",
    "js_divergence_error",
    "approx_entropy",
)


def _mismatch_rows(
    d: torch.Tensor, clean: SanitizedInputs, usable: torch.Tensor, kl_type: str
) -> Iterator[torch.Tensor]:
    """The ``[B, T]`` rows of :data:`_MISMATCH_ROWS`, built one at a time; ``d = prev - gen`` masked to ``usable``."""
    yield torch.exp(d.abs())  # token_mult_prob_error: exp|log p_train - log p_gen|
    yield kl_estimate(d, kl_type)  # gen_kl_error
    yield kl_estimate(d.neg(), kl_type)  # policy_kl_error
    # NeMo-RL's per-token JS estimate with M = (P_train + P_gen) / 2,
    #   0.5 [k3(log M/P_train) + k3(log M/P_gen)],  k3(x) = exp(x) - 1 - x,
    # simplifies exactly to log cosh(d / 2) = softplus(-d) + d / 2 - log 2, which is
    # stable for any d and costs one transcendental instead of five.
    yield torch.nn.functional.softplus(-d).add_(d, alpha=0.5).sub_(math.log(2.0))
    # approx_entropy: E_gen[-(pi/pi_gen) log pi]
    yield (clean.curr - clean.gen).mul_(usable).exp_().mul_(clean.curr).neg_()


def _clamped_extremes(cfg: RSClippedPGLossConfig, metrics: MetricSet) -> None:
    """Declare ``probs_ratio_clamped_{min,max}``, derived on the host after the reduction.

    The clamp is monotonic, so the extremes of clip(r) are clip(extremes of r); the
    "no token" sentinels (+-inf) stay as they are.
    """
    unclamped = cfg.force_on_policy_ratio or cfg.disable_ppo_ratio  # no clamp in these modes
    lo, hi = (-math.inf, math.inf) if unclamped else (1.0 - cfg.ratio_clip_min, 1.0 + cfg.ratio_clip_max)
    metrics.derive("probs_ratio_clamped_min", ClippedExtreme("probs_ratio_min", lo, hi))
    metrics.derive("probs_ratio_clamped_max", ClippedExtreme("probs_ratio_max", lo, hi))


def _sequence_sampling_importance_ratio(metrics: MetricSet, is_weight: torch.Tensor, sample_mask: torch.Tensor) -> None:
    """``sampling_importance_ratio`` with a per-sequence weight: ``sum_i s_i w_i / N_seq``.

    (Per-token weights are averaged over tokens with the other token means.) The mean over
    valid sequences, in NeMo-RL's own GSPO mode too, where NeMo-RL's unpacked call logs
    ``sum_i w_i * sum_j s_j / N_seq`` instead: its ``[B, 1]`` weight broadcasts against the
    ``[B]`` sample mask (NeMo-RL #3753), so its number grows with the sequences per call and
    changes with packing (its per-sequence packing wrapper, one sequence per call, logs
    this mean). This one is the same whatever the call shape (docs/guide.md).
    """
    w_seq = is_weight.squeeze(-1)  # [B]
    metrics.add_masked_total("sampling_importance_ratio", w_seq, sample_mask)
