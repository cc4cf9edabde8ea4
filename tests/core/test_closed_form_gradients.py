"""The objective's and the KL penalty's closed-form gradients equal autograd's, ties included.

``clipped_objective`` and ``kl_penalty_per_token`` attach their derivative with
``policy_loss.with_slope`` instead of letting autograd replay ``max``, ``min`` and each
``clamp``. The reference here is the plain autograd formulation of the same rule (NeMo-RL's
way of writing it); the inputs sit on every place where the two could part: tokens inside and
outside the clip range and exactly on its bounds, ``A = 0``, the dual-clip bound reached
exactly, the KL input clamp reached exactly and exceeded, the output clamp reached exactly.
float64, so agreement is to rounding. Where autograd's formulation overflows (``0 * inf``)
the closed form gives 0, checked on its own.
"""

import itertools

import pytest
import torch

from nemo_rs_plugin.core.masking import finite_exp
from nemo_rs_plugin.core.policy_loss import KLOptions, clipped_objective, kl_estimate, kl_penalty_per_token

CLIP_LO, CLIP_HI = 0.2, 0.2
# Ratios: inside, on both clip bounds (exactly: the clamp's bounds are these doubles), outside,
# and 3.0, where -A r meets the dual-clip bound -c A for A = -1, c = 3.
RATIOS = [0.5, 1.0 - CLIP_LO, 0.9, 1.0, 1.1, 1.0 + CLIP_HI, 1.5, 3.0]
ADVANTAGES = [-2.0, -1.0, 0.0, 0.5, 1.0]


def _grid():
    pairs = list(itertools.product(ADVANTAGES, RATIOS))
    advantages = torch.tensor([a for a, _ in pairs], dtype=torch.float64).reshape(1, -1)
    ratios = torch.tensor([r for _, r in pairs], dtype=torch.float64).reshape(1, -1)
    return advantages, ratios


def _autograd_objective(advantages, ratios, curr, use_cispo, dual_clip_c):
    ratios_clamped = ratios.clamp(1.0 - CLIP_LO, 1.0 + CLIP_HI)
    if use_cispo:
        loss = -advantages * ratios_clamped.detach() * curr
    else:
        loss = torch.max(-advantages * ratios, -advantages * ratios_clamped)
    if dual_clip_c is not None:
        loss = torch.where(advantages < 0, torch.min(loss, -advantages * dual_clip_c), loss)
    return loss


@pytest.mark.parametrize("use_cispo", [False, True], ids=["ppo", "cispo"])
@pytest.mark.parametrize("dual_clip_c", [None, 3.0], ids=["no-dual", "dual-3"])
def test_objective_gradient_equals_autograd(use_cispo, dual_clip_c):
    advantages, ratios0 = _grid()
    curr0 = ratios0.log() - 0.5  # any log pi; CISPO differentiates this one

    ratios = ratios0.clone().requires_grad_(True)
    curr = curr0.clone().requires_grad_(True)
    clamped = ratios.detach().clamp(1.0 - CLIP_LO, 1.0 + CLIP_HI)
    ours = clipped_objective(advantages, ratios, clamped, curr, use_cispo=use_cispo, dual_clip_c=dual_clip_c)
    ours.sum().backward()

    ref_ratios = ratios0.clone().requires_grad_(True)
    ref_curr = curr0.clone().requires_grad_(True)
    ref = _autograd_objective(advantages, ref_ratios, ref_curr, use_cispo, dual_clip_c)
    ref.sum().backward()

    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-15)
    target, ref_target = (curr, ref_curr) if use_cispo else (ratios, ref_ratios)
    torch.testing.assert_close(target.grad, ref_target.grad, rtol=1e-15, atol=1e-15)
    if dual_clip_c is not None and not use_cispo:
        # the grid holds the tie -A r = -c A (A = -1, r = 3): autograd's min halves it there
        tie = (advantages == -1.0) & (ratios0 == 3.0)
        assert ratios.grad[tie].item() == pytest.approx(0.5)


def _autograd_kl(curr, reference, generation, options):
    # NeMo-RL's formulation: weight with a gradient, detached where the input clamp is active.
    if options.on_policy_approximation:
        weights = finite_exp(curr - generation)
    else:
        weights = finite_exp(curr - curr.detach())
    log_ratio = reference - curr
    if options.input_clamp is not None:
        clamped = log_ratio.clamp(-options.input_clamp, options.input_clamp)
        weights = torch.where((log_ratio != clamped).detach(), weights.detach(), weights)
        log_ratio = clamped
    kl = weights * kl_estimate(log_ratio, options.kl_type)
    if options.output_clamp is not None:
        kl = kl.clamp(-options.output_clamp, options.output_clamp)
    return kl


# x = ref - curr: small, moderate, exactly on the input clamp (+-1, inside: the clamp passes
# the gradient on its closed interval) and beyond it; k1 = -x reaches the output clamp 0.5
# exactly at x = -0.5.
LOG_RATIOS = [-3.0, -1.0, -0.5, -0.1, 0.0, 0.03, 0.5, 0.9, 1.0, 2.5]


@pytest.mark.parametrize("kl_type", ["k1", "k2", "k3"])
@pytest.mark.parametrize("on_policy", [False, True], ids=["score", "on-policy"])
@pytest.mark.parametrize("input_clamp", [None, 1.0], ids=["no-in", "in-1"])
@pytest.mark.parametrize("output_clamp", [None, 0.5], ids=["no-out", "out-0.5"])
def test_kl_penalty_gradient_equals_autograd(kl_type, on_policy, input_clamp, output_clamp):
    options = KLOptions(kl_type, input_clamp, output_clamp, on_policy)
    curr0 = torch.linspace(-4.0, -0.1, len(LOG_RATIOS), dtype=torch.float64).reshape(1, -1)
    reference = curr0 + torch.tensor(LOG_RATIOS, dtype=torch.float64)
    generation = curr0 - torch.linspace(-0.4, 0.4, len(LOG_RATIOS), dtype=torch.float64)

    curr = curr0.clone().requires_grad_(True)
    ours = kl_penalty_per_token(curr, reference, generation, options)
    ours.sum().backward()
    ref_curr = curr0.clone().requires_grad_(True)
    ref = _autograd_kl(ref_curr, reference, generation, options)
    ref.sum().backward()

    torch.testing.assert_close(ours, ref, rtol=1e-14, atol=1e-15)
    torch.testing.assert_close(curr.grad, ref_curr.grad, rtol=1e-12, atol=1e-14)
    if input_clamp is not None:  # the test reaches the clamp: some token gets no gradient
        assert (curr.grad == 0).any() and (ref_curr.grad == 0).any()


@pytest.mark.parametrize("kl_type", ["k1", "k2", "k3"])
def test_a_binding_clamp_stops_an_overflowing_kl_gradient_with_zero_not_nan(kl_type):
    # On-policy weight w = exp(curr - gen) = exp(88.6) ~ 3e38 is finite in float32, w (k - k')
    # is not; the output clamp 10 binds (k2 there: 3e38 * 0.5), so the gradient is 0 (the old
    # autograd formulation, too: the clamp stopped it before the overflowing product).
    options = KLOptions(kl_type, 20.0, 10.0, True)
    curr = torch.tensor([[-11.0, -2.0]], requires_grad=True)
    reference = torch.tensor([[-12.0, -2.5]])
    generation = torch.tensor([[-99.6, -2.1]])
    kl = kl_penalty_per_token(curr, reference, generation, options)
    kl.sum().backward()
    assert kl[0, 0].item() == 10.0 and curr.grad[0, 0].item() == 0.0
    assert torch.isfinite(curr.grad).all() and curr.grad[0, 1] != 0


def test_an_overflowing_masked_token_leaves_the_whole_loss_gradient_finite():
    # A masked position may hold any finite log-prob: there curr - gen = 88.6 (the KL's
    # on-policy weight is finite, its slope is not before the output clamp stops it).
    from benchmarks.bench_ops import make_inputs
    from nemo_rs_plugin import CorrectedPGLoss

    curr, data, gvs, gvt = make_inputs(2, 8)
    data["token_mask"][0, 1] = 0  # next-token position 0 of row 0 is masked
    data["generation_logprobs"][0, 1] = -99.6
    data["reference_policy_logprobs"][0, 1] = -12.0
    curr[0, 0] = -11.0
    lp = curr.clone().requires_grad_(True)
    loss, _ = CorrectedPGLoss({"use_on_policy_kl_approximation": True, "reference_policy_kl_type": "k2"})(
        lp, data, gvs, gvt
    )
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(lp.grad).all(), lp.grad
    assert lp.grad[0, 0] == 0 and lp.grad.abs().sum() > 0


def test_k3_gradient_keeps_its_digits_where_the_terms_would_cancel():
    # d/dcurr [w k3(x)] = w (k3(x) - k3'(x)) = -w x: at x = 20 in float32 the two terms are
    # ~4.85e8 each and their computed difference loses all of -20.
    options = KLOptions("k3", None, None, False)
    curr = torch.tensor([[-25.0]], requires_grad=True)
    kl_penalty_per_token(curr, curr.detach() + 20.0, curr.detach(), options).sum().backward()
    assert curr.grad.item() == pytest.approx(-20.0, rel=1e-6)


_COMPARISONS = {
    "where",
    "ge",
    "le",
    "gt",
    "lt",
    "eq",
    "ne",
    "masked_fill",
    "masked_fill_",
    "logical_and",
    "logical_and_",
}


@pytest.mark.parametrize(
    "cfg",
    [
        {},
        {
            "use_importance_sampling_correction": True,
            "truncated_importance_sampling_type": "tis",
            "truncated_importance_sampling_ratio": 2.0,
        },
        {"use_on_policy_kl_approximation": True, "reference_policy_kl_type": "k2", "ratio_clip_c": 3.0},
        {
            "use_importance_sampling_correction": True,
            "sequence_level_importance_ratios": True,
            "token_level_loss": False,
        },
    ],
    ids=["plain", "token-tis", "on-policy-k2-dual-clip", "gspo"],
)
def test_the_backward_replays_no_clamp_or_max(cfg):
    """The whole loss's backward is a few products and sums: no mask of a clamp, max or min is rebuilt."""
    from benchmarks.bench_ops import OpCounter, make_inputs
    from nemo_rs_plugin import CorrectedPGLoss

    curr, data, gvs, gvt = make_inputs(2, 16)
    lp = curr.clone().requires_grad_(True)
    loss, _ = CorrectedPGLoss(cfg)(lp, data, gvs, gvt)
    with OpCounter() as counter:
        loss.backward()
    assert counter.counts and not _COMPARISONS & set(counter.counts), counter.counts
    assert sum(counter.counts.values()) <= (20 if cfg.get("sequence_level_importance_ratios") else 12), counter.counts
    assert lp.grad.abs().sum() > 0
