"""The clipped policy-gradient objective and its KL / NLL terms, as small pure functions.

Every mode of NeMo-RL's ``ClippedPGLossFn`` is one function or one argument here:

* policy ratio (:func:`policy_ratios`): PPO/GRPO token ratio ``exp(curr - prev)``, GSPO
  sequence ratio ``exp(mean_t(curr - prev))``, REINFORCE (``disable_ppo_ratio``: the "ratio"
  is ``log pi`` itself), forced on-policy ratio ``exp(curr - sg(curr)) = 1``;
* objective (:func:`clipped_objective`): ``max(-A r, -A clip(r, 1-eps_lo, 1+eps_hi))``,
  CISPO ``-A sg(clip(r)) log pi``, dual clip ``min(., -c A)`` where ``A < 0``;
* KL penalty (:func:`kl_penalty_per_token`): Schulman's k1/k2/k3 with input and output
  clamps, optionally weighted by ``pi_curr / pi_gen`` (on-policy KL approximation);
* VAPO positive-example NLL (:func:`positive_example_nll`).

No function here imports NeMo-RL, reads a config object or calls ``.item()``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from nemo_rs_plugin.core.distributed import NO_GROUPS, SequenceGroups, all_reduce_sum_with_grad
from nemo_rs_plugin.core.masking import EPS, finite_exp

__all__ = [
    "LOG_RATIO_CLAMP",
    "KLOptions",
    "RatioOptions",
    "policy_ratios",
    "clipped_objective",
    "kl_estimate",
    "kl_penalty_per_token",
    "positive_example_nll",
]


# Policy log-ratios are clamped to +-20 before exp (exp(20) ~ 4.9e8, VERL's SAFETY_BOUND):
# beyond that the ratio is meaningless, and an overflowed exp would turn the masked
# multiplications of the loss (inf * 0) and their gradients into NaN. The clamp is applied
# straight-through (value clamped, gradient passed), which keeps the backward free of the
# boolean masks a differentiable clamp needs; it changes nothing inside +-20.
LOG_RATIO_CLAMP = 20.0


@dataclass(frozen=True)
class RatioOptions:
    """How :func:`policy_ratios` forms the ratio: NeMo-RL's options, its field names in brackets."""

    force_on_policy: bool  # (force_on_policy_ratio) exp(curr - sg(curr)) = 1
    disable_ppo_ratio: bool  # (disable_ppo_ratio) REINFORCE: log pi itself
    sequence_level: bool  # (sequence_level_importance_ratios) GSPO
    clip_min: float  # (ratio_clip_min) clamp at 1 - clip_min
    clip_max: float  # (ratio_clip_max) clamp at 1 + clip_max


@dataclass(frozen=True)
class KLOptions:
    """How :func:`kl_penalty_per_token` estimates the KL: NeMo-RL's options, its field names in brackets."""

    kl_type: str  # (reference_policy_kl_type) k1, k2 or k3
    input_clamp: Optional[float]  # (kl_input_clamp_value) None: no clamp
    output_clamp: Optional[float]  # (kl_output_clamp_value) None: no clamp
    on_policy_approximation: bool  # (use_on_policy_kl_approximation) weight pi_curr / pi_gen


def _clamp_value(x: torch.Tensor, bound: float) -> torch.Tensor:
    # (x - sg(x)) is exactly 0 in value, so the result is exactly the clamped value in any
    # dtype. The form x + (clamp(x) - x) cancels instead once |x| outgrows the mantissa
    # (|x| > ~1e8 in float32, ~1e3 in bf16): the ratio read 1 there and passed a full
    # gradient.
    return (x - x.detach()) + x.detach().clamp(-bound, bound)


def policy_ratios(
    curr: torch.Tensor,  # [B, T]
    prev: torch.Tensor,  # [B, T]
    token_mask: torch.Tensor,  # [B, T]
    options: RatioOptions,
    *,
    groups: SequenceGroups = NO_GROUPS,
    row_count: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Policy ratio ``r`` and its clamp ``clip(r, 1 - clip_min, 1 + clip_max)``, both ``[B, T]``.

    ``options`` (:class:`RatioOptions`) picks the ratio: PPO/GRPO, GSPO, REINFORCE or forced
    on-policy.

    GSPO: ``r_i = exp(sum_t m_t (curr_t - prev_t) / (sum_t m_t + 1e-8))`` with ``m`` the token
    mask; the numerator is all-reduced over ``groups`` differentiably, and ``row_count``
    (``[B]``, already reduced with the other statistics) saves a second collective; without
    it the count is computed and reduced here. A CP-sharded sequence gets the ratio of the
    whole sequence.
    """
    if options.force_on_policy:
        # exp(x - sg(x)) is 1 in value but keeps d/dx = 1: a truly on-policy gradient.
        ratios = torch.exp(curr - curr.detach())
        return ratios, ratios
    if options.disable_ppo_ratio:
        # REINFORCE: -A * log pi; NeMo-RL reports log pi under the ratio metric names.
        return curr, curr
    log_ratios = curr - prev
    if options.sequence_level:
        row_sum = all_reduce_sum_with_grad((log_ratios * token_mask).sum(dim=-1), groups)  # [B]
        if row_count is None:
            row_count = all_reduce_sum_with_grad(token_mask.sum(dim=-1).to(curr.dtype), groups)
        seq_log_ratio = _clamp_value(row_sum / (row_count + EPS), LOG_RATIO_CLAMP)
        ratios = torch.exp(seq_log_ratio).unsqueeze(-1).expand_as(curr)  # [B, T]
    else:
        ratios = torch.exp(_clamp_value(log_ratios, LOG_RATIO_CLAMP))
    return ratios, ratios.clamp(1.0 - options.clip_min, 1.0 + options.clip_max)


def clipped_objective(
    advantages: torch.Tensor,  # [B, T]
    ratios: torch.Tensor,  # [B, T]
    ratios_clamped: torch.Tensor,  # [B, T]
    curr: torch.Tensor,  # [B, T]
    *,
    use_cispo: bool,
    dual_clip_c: Optional[float],
) -> torch.Tensor:
    """Per-token policy-gradient loss ``[B, T]`` (to be weighted and averaged).

    PPO: ``max(-A r, -A clip(r))``. CISPO: ``-A sg(clip(r)) log pi``. Dual clip (``c > 1``):
    where ``A < 0`` the loss is further bounded by ``-c A``.
    """
    neg_adv = -advantages
    if use_cispo:
        loss = neg_adv * ratios_clamped.detach() * curr
    else:
        loss = torch.max(neg_adv * ratios, neg_adv * ratios_clamped)
    if dual_clip_c is not None:
        loss = torch.where(advantages < 0, torch.min(loss, neg_adv * dual_clip_c), loss)
    return loss


def kl_estimate(log_ratio: torch.Tensor, kl_type: str) -> torch.Tensor:
    """Schulman's estimators of ``KL(p || q)`` from ``log_ratio = log q - log p`` on samples of p.

    ``k1 = -log_ratio``, ``k2 = log_ratio^2 / 2``, ``k3 = exp(log_ratio) - 1 - log_ratio``.
    The one implementation of the estimators: the KL penalty, the KL-error metrics and the
    rejection filters' ``kl_k*`` statistics all call it.
    """
    if kl_type == "k1":
        return -log_ratio
    if kl_type == "k2":
        return log_ratio.square() / 2
    if kl_type == "k3":
        # expm1: exp(x) - 1 in float32 loses every digit of k3 ~ x^2/2 for |x| < 1e-3.
        return torch.expm1(log_ratio) - log_ratio
    raise ValueError(f"kl type: got {kl_type!r}; allowed: k1, k2, k3")


def kl_penalty_per_token(
    curr: torch.Tensor,  # [B, T] current log-probs (unfiltered by top-k/top-p)
    reference: torch.Tensor,  # [B, T]
    generation: torch.Tensor,  # [B, T]
    options: KLOptions,
) -> torch.Tensor:
    """Per-token ``KL(pi_curr || pi_ref)`` estimate times its sampling weight, ``[B, T]``.

    The weight is ``exp(curr - gen)`` with the on-policy approximation (samples come from
    ``pi_gen``), else ``exp(curr - sg(curr)) = 1``, which keeps the score-function gradient.
    Where the input clamp is active the weight is detached, so the clamp stops both gradients.
    The estimator and the clamps are ``options`` (:class:`KLOptions`).
    """
    input_clamp, output_clamp = options.input_clamp, options.output_clamp
    if options.on_policy_approximation:
        weights = finite_exp(curr - generation)
    else:
        weights = finite_exp(curr - curr.detach())
    log_ratio = reference - curr
    if input_clamp is not None:
        clamped = log_ratio.clamp(-input_clamp, input_clamp)
        # Detach the weight where the clamp is active: outside the bounds, where a value
        # differs from its clamp (masking.out_of_bounds's test, on the clamp computed anyway).
        weights = torch.where((log_ratio != clamped).detach(), weights.detach(), weights)
        log_ratio = clamped
    kl = weights * kl_estimate(log_ratio, options.kl_type)
    if output_clamp is not None:
        kl = kl.clamp(-output_clamp, output_clamp)
    return kl


def positive_example_nll(
    curr: torch.Tensor,  # [B, T]
    mask: torch.Tensor,  # [B, T] valid (and kept) tokens
    correct: torch.Tensor,  # [B] 1.0 where reward > 0
    correct_token_count: torch.Tensor,  # [] tokens of correct samples (over all CP ranks)
) -> torch.Tensor:
    """VAPO NLL on correct samples: ``sum(-curr * m * correct) / (count + 1e-8)``, 0 if none."""
    numerator = (-curr * mask * correct.unsqueeze(-1)).sum()
    nll = numerator / (correct_token_count + EPS)
    return torch.where(correct_token_count > 0, nll, torch.zeros_like(nll))
