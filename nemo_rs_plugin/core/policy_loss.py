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

The objective and the KL penalty carry their derivative in closed form (:func:`with_slope`):
their backward is one multiply each, where autograd would replay every ``max``, ``min`` and
``clamp`` over ``[B, T]``; ``tests/core/test_closed_form_gradients.py`` holds them to
autograd's gradients (to rounding, ties on the clip bounds included; 0 where autograd's
``0 * inf`` is NaN). They are differentiable once: a second derivative raises.

No function here imports NeMo-RL, reads a config object or calls ``.item()``.

References:
    - GSPO sequence ratio: Zheng et al., "Group Sequence Policy Optimization", https://arxiv.org/abs/2507.18071
    - CISPO: MiniMax, "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning Attention",
      https://arxiv.org/abs/2506.13585
    - KL penalty k1/k2/k3: Schulman, "Approximating KL Divergence", http://joschu.net/blog/kl-approx.html
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch.autograd.function import once_differentiable

from nemo_rs_plugin.core.distributed import NO_GROUPS, SequenceGroups, all_reduce_sum_with_grad
from nemo_rs_plugin.core.masking import EPS, finite_exp

__all__ = [
    "LOG_RATIO_CLAMP",
    "KLOptions",
    "RatioOptions",
    "policy_ratios",
    "clipped_objective",
    "with_slope",
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


class _KnownSlope(torch.autograd.Function):
    """Forward: ``value``. Backward: ``grad * slope`` into ``target``."""

    @staticmethod
    def forward(ctx: Any, target: torch.Tensor, value: torch.Tensor, slope: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(slope)
        return value

    @staticmethod
    @once_differentiable  # slope is a constant: a second derivative through it would be wrong, not 0
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (slope,) = ctx.saved_tensors
        return grad * slope, None, None


def with_slope(target: torch.Tensor, value: torch.Tensor, slope: torch.Tensor) -> torch.Tensor:
    """``value = f(target)`` elementwise, differentiable with ``d value / d target = slope``.

    The loss terms know their derivative in closed form. Left to autograd, the chain rule
    through a ``max`` and each ``clamp`` costs four to ten ``[B, T]`` kernels of the backward
    and keeps every intermediate alive; here the backward is one multiply. ``value`` and
    ``slope`` are taken as constants (computed without gradient).
    """
    return _KnownSlope.apply(target, value.detach(), slope.detach())


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

    Only ``r`` carries a gradient: :func:`clipped_objective` differentiates the clamp itself.

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
        return ratios, ratios.detach()
    if options.disable_ppo_ratio:
        # REINFORCE: -A * log pi; NeMo-RL reports log pi under the ratio metric names.
        return curr, curr.detach()
    log_ratios = curr - prev
    if options.sequence_level:
        row_sum = all_reduce_sum_with_grad((log_ratios * token_mask).sum(dim=-1), groups)  # [B]
        if row_count is None:
            row_count = all_reduce_sum_with_grad(token_mask.sum(dim=-1).to(curr.dtype), groups)
        seq_log_ratio = _clamp_value(row_sum / (row_count + EPS), LOG_RATIO_CLAMP)
        ratios = torch.exp(seq_log_ratio).unsqueeze(-1).expand_as(curr)  # [B, T]
    else:
        ratios = torch.exp(_clamp_value(log_ratios, LOG_RATIO_CLAMP))
    return ratios, ratios.detach().clamp(1.0 - options.clip_min, 1.0 + options.clip_max)


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

    The gradient is the closed form, attached by :func:`with_slope` (to ``r``; CISPO to
    ``log pi``)::

        PPO     d/dr = -A  where -A r >= -A clip(r), else 0
        CISPO   d/dlog pi = -A clip(r)
        dual    times 0 where -c A binds (A < 0, loss > -c A), 1/2 where it ties

    It equals what autograd gives through ``torch.max``/``torch.min`` and the clamp, ties
    included: a max halves the gradient of two equal branches, and the two halves add up to
    ``-A`` inside the clip range (where ``clip(r) = r``); outside it the branches tie only
    where ``A = 0`` (or where both overflow to inf, a loss that is inf anyway). Only ``r``
    (CISPO: ``curr``) gets a gradient: the advantages are data.
    """
    neg_adv = -advantages
    with torch.no_grad():
        if use_cispo:
            target = curr
            slope = neg_adv * ratios_clamped
            value = slope * curr
        else:
            target = ratios
            unclipped, clipped = neg_adv * ratios, neg_adv * ratios_clamped
            value = torch.maximum(unclipped, clipped)
            # The 0/1 mask cast first and multiplied in place: a float times a bool tensor casts the
            # bool operand into a [B, T] temporary of its own.
            slope = (unclipped >= clipped).to(neg_adv.dtype).mul_(neg_adv)
        if dual_clip_c is not None:
            bound = neg_adv * dual_clip_c
            binding = (value > bound).to(slope.dtype) + 0.5 * (value == bound)
            slope = torch.where(advantages < 0, slope * (1 - binding), slope)
            value = torch.where(advantages < 0, torch.minimum(value, bound), value)
    return with_slope(target, value, slope)


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
        k3 = torch.expm1(log_ratio)
        if log_ratio.requires_grad and torch.is_grad_enabled():
            return k3 - log_ratio  # expm1's backward reads its output: not overwritten
        return k3.sub_(log_ratio)  # a metric's row: no second [B, T] temporary
    raise ValueError(f"kl type: got {kl_type!r}; allowed: k1, k2, k3")


def kl_penalty_per_token(
    curr: torch.Tensor,  # [B, T] current log-probs (unfiltered by top-k/top-p)
    reference: torch.Tensor,  # [B, T]
    generation: torch.Tensor,  # [B, T]
    options: KLOptions,
) -> torch.Tensor:
    """Per-token ``KL(pi_curr || pi_ref)`` estimate times its sampling weight, ``[B, T]``.

    The weight is ``w = exp(curr - gen)`` with the on-policy approximation (samples come from
    ``pi_gen``), else ``w = exp(curr - sg(curr)) = 1``, which keeps the score-function gradient.
    With ``x = ref - curr`` (input-clamped) the term is ``w k(x)`` (output-clamped); the
    estimator and the clamps are ``options`` (:class:`KLOptions`).

    Gradient, in closed form (:func:`with_slope`): ``dw/dcurr = w`` and ``dx/dcurr = -1``, so
    ``d/dcurr [w k(x)] = w (k(x) - k'(x))`` (:func:`_kl_slope_over_weight`); 0 where the input
    clamp is active (it stops the weight's gradient too, as NeMo-RL's detach does) and where
    the output clamp binds. Only ``curr`` gets a gradient. It equals autograd's through
    NeMo-RL's formulation up to rounding, except where that one loses digits or overflows:
    k3's ``k - k'`` is exactly ``-x`` (autograd subtracts two ~e^x terms), and a weight that
    overflowed to 0 (:func:`finite_exp`) or a clamp that binds gives 0 where autograd's
    ``0 * inf`` gives NaN.
    """
    input_clamp, output_clamp = options.input_clamp, options.output_clamp
    with torch.no_grad():
        log_ratio = reference - curr
        clamped_away = None
        if input_clamp is not None:
            clamped = log_ratio.clamp(-input_clamp, input_clamp)
            # masking.out_of_bounds's test on the clamp computed anyway: a clamp passes the
            # gradient on its closed interval.
            clamped_away = log_ratio != clamped
            log_ratio = clamped
            del clamped  # one name: the del below frees it
        kl = kl_estimate(log_ratio, options.kl_type)
        slope = _kl_slope_over_weight(log_ratio, options.kl_type)
        del log_ratio  # read no more: one [B, T] less beside the clamps' temporaries (peak memory)
        if options.on_policy_approximation:
            weights = finite_exp(curr - generation)
            kl, slope = kl * weights, slope * weights
        # Selected, not multiplied by the 0/1 masks: w (k - k') overflows to inf before w does
        # (curr - gen > ~85), and a clamp that stops it must give 0 there, not inf * 0 = NaN.
        if clamped_away is not None:  # in place (slope is this function's own): no scalar tensor, no copy
            slope = slope.masked_fill_(clamped_away, 0.0)
        if output_clamp is not None:
            # In place, kl and slope being this function's own: no [B, T] copy of either. Not
            # ``abs() > clamp``: a NaN estimate keeps a slope of 0, as ``where(abs() <= clamp)``.
            slope = slope.masked_fill_((kl.abs() <= output_clamp).logical_not_(), 0.0)
            kl = kl.clamp_(-output_clamp, output_clamp)
    return with_slope(curr, kl, slope)


def _kl_slope_over_weight(log_ratio: torch.Tensor, kl_type: str) -> torch.Tensor:
    """``k(x) - k'(x)`` for :func:`kl_estimate`'s estimators: ``1 - x`` (k1), ``x^2/2 - x`` (k2), ``-x`` (k3).

    Written out per estimator: the difference of the two terms computed apart cancels (k3 at
    ``x = 20``: ``(e^20 - 1 - 20) - (e^20 - 1)`` loses all of ``-20`` in float32).
    """
    if kl_type == "k1":
        return 1 - log_ratio
    if kl_type == "k2":
        return log_ratio * (log_ratio / 2 - 1)
    if kl_type == "k3":
        return -log_ratio
    raise ValueError(f"kl type: got {kl_type!r}; allowed: k1, k2, k3")


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
