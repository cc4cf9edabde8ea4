"""Guards ``core/policy_loss.py`` on its own: the ratios, the clipped objective, the KL and NLL terms.

Each test calls one function on a few hand-picked tokens (float64) and compares its value with
the closed form of the module's docstring, and its gradient with torch.autograd on the same
expression written plainly. The ties on the clip bounds and the overflows are
``test_closed_form_gradients.py``'s; the inputs here stay clear of them.
"""

import math

import pytest
import torch

from nemo_rs_plugin.core.masking import EPS
from nemo_rs_plugin.core.policy_loss import (
    LOG_RATIO_CLAMP,
    KLOptions,
    RatioOptions,
    clipped_objective,
    kl_estimate,
    kl_penalty_per_token,
    policy_ratios,
    positive_example_nll,
    with_slope,
)

F64 = torch.float64
CLIP = 0.2
PPO = RatioOptions(force_on_policy=False, disable_ppo_ratio=False, sequence_level=False, clip_min=CLIP, clip_max=CLIP)
# Advantages and ratios off the clip bounds: each token picks one branch of the max.
ADVANTAGES = torch.tensor([[1.0, 1.0, 1.0, -1.0, -1.0, -2.0]], dtype=F64)
RATIOS = torch.tensor([[0.5, 1.1, 1.5, 0.5, 1.1, 1.5]], dtype=F64)


def _leaf(values, **kw) -> torch.Tensor:
    return torch.tensor(values, dtype=F64, **kw).requires_grad_(True)


def test_with_slope_returns_the_value_and_back_propagates_grad_times_slope():
    x = _leaf([[-1.5, 0.3, 2.0]])
    out = with_slope(x, x.detach() ** 3, 3 * x.detach() ** 2)
    (out * torch.tensor([[1.0, 2.0, -1.0]], dtype=F64)).sum().backward()
    y = x.detach().clone().requires_grad_(True)
    (y**3 * torch.tensor([[1.0, 2.0, -1.0]], dtype=F64)).sum().backward()
    assert out.tolist() == (x.detach() ** 3).tolist()
    torch.testing.assert_close(x.grad, y.grad)


def test_with_slope_is_differentiable_once_only():
    x = _leaf([1.0, 2.0])
    out = with_slope(x, x.detach() ** 2, 2 * x.detach())
    # (out^2)' = 2 out slope depends on x through out: a second derivative would follow it
    (grad,) = torch.autograd.grad((out * out).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="twice"):
        grad.sum().backward()


def test_ppo_objective_is_the_max_of_the_unclipped_and_clipped_terms_with_autograds_gradient():
    ratios = RATIOS.clone().requires_grad_(True)
    loss = clipped_objective(
        ADVANTAGES,
        ratios,
        RATIOS.clamp(1 - CLIP, 1 + CLIP),
        torch.zeros_like(RATIOS),
        use_cispo=False,
        dual_clip_c=None,
    )
    # max(-A r, -A clip(r)): A > 0 keeps the smaller ratio, A < 0 the larger one
    assert loss.tolist() == [[-0.5, -1.1, -1.2, 0.8, 1.1, 3.0]]
    loss.sum().backward()
    plain = RATIOS.clone().requires_grad_(True)
    torch.max(-ADVANTAGES * plain, -ADVANTAGES * plain.clamp(1 - CLIP, 1 + CLIP)).sum().backward()
    torch.testing.assert_close(ratios.grad, plain.grad)
    assert ratios.grad.tolist() == [[-1.0, -1.0, 0.0, 0.0, 1.0, 2.0]]  # -A on the chosen unclipped branch, else 0


def test_cispo_objective_is_minus_a_times_the_detached_clipped_ratio_times_log_pi():
    curr = _leaf([[-0.7, -1.2, -0.1, -2.0, -0.4, -0.9]])
    clamped = RATIOS.clamp(1 - CLIP, 1 + CLIP)
    loss = clipped_objective(ADVANTAGES, RATIOS, clamped, curr, use_cispo=True, dual_clip_c=None)
    torch.testing.assert_close(loss, -ADVANTAGES * clamped * curr.detach())
    loss.sum().backward()
    torch.testing.assert_close(curr.grad, -ADVANTAGES * clamped)


def test_dual_clip_bounds_a_negative_advantages_loss_by_minus_c_a():
    advantages = torch.tensor([[-1.0, -1.0, 1.0]], dtype=F64)
    ratios = _leaf([[5.0, 2.0, 5.0]])
    loss = clipped_objective(
        advantages, ratios, ratios.detach().clamp(1 - CLIP, 1 + CLIP), ratios.detach(), use_cispo=False, dual_clip_c=3.0
    )
    # -A r = 5 > -c A = 3: bounded (and no gradient); 2 < 3 untouched; A > 0 never bounded
    assert loss.tolist() == [[3.0, 2.0, -1.2]]
    loss.sum().backward()
    assert ratios.grad.tolist() == [[0.0, 1.0, 0.0]]


def test_ppo_ratio_is_exp_of_the_token_log_ratio_clamped_at_20_straight_through():
    curr = _leaf([[-1.0, -0.5, 25.0]])
    prev = torch.tensor([[-1.5, -0.2, 0.0]], dtype=F64)
    ratios, clamped = policy_ratios(curr, prev, torch.ones(1, 3), PPO)
    expected = [math.exp(0.5), math.exp(-0.3), math.exp(LOG_RATIO_CLAMP)]
    torch.testing.assert_close(ratios, torch.tensor([expected], dtype=F64))
    torch.testing.assert_close(clamped, torch.tensor([expected], dtype=F64).clamp(1 - CLIP, 1 + CLIP))
    assert not clamped.requires_grad
    ratios.sum().backward()
    torch.testing.assert_close(curr.grad, torch.tensor([expected], dtype=F64))  # the clamp passes the gradient


def test_gspo_ratio_is_exp_of_the_masked_mean_log_ratio_of_each_sequence():
    curr = _leaf([[-1.0, -2.0, -3.0], [-0.5, -0.5, -9.0]])
    prev = torch.tensor([[-1.2, -2.3, -3.4], [-0.4, -0.9, 0.0]], dtype=F64)
    token_mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=F64)
    gspo = RatioOptions(False, False, True, CLIP, CLIP)
    ratios, _ = policy_ratios(curr, prev, token_mask, gspo)
    row = [math.exp((0.2 + 0.3 + 0.4) / (3 + EPS)), math.exp((-0.1 + 0.4) / (2 + EPS))]
    torch.testing.assert_close(ratios, torch.tensor([[row[0]] * 3, [row[1]] * 3], dtype=F64))


def test_forced_on_policy_ratio_is_one_with_unit_gradient_and_reinforce_uses_log_pi():
    curr = _leaf([[-1.0, -3.0]])
    prev = torch.tensor([[-2.0, -1.0]], dtype=F64)
    forced, _ = policy_ratios(curr, prev, torch.ones(1, 2), RatioOptions(True, False, False, CLIP, CLIP))
    assert forced.tolist() == [[1.0, 1.0]]
    forced.sum().backward()
    assert curr.grad.tolist() == [[1.0, 1.0]]
    reinforce, reported = policy_ratios(curr, prev, torch.ones(1, 2), RatioOptions(False, True, False, CLIP, CLIP))
    assert reinforce is curr and reported.tolist() == [[-1.0, -3.0]]


def test_kl_estimators_are_schulmans_k1_k2_k3():
    x = torch.tensor([-1.0, 0.0, 0.5], dtype=F64)
    torch.testing.assert_close(kl_estimate(x, "k1"), -x)
    torch.testing.assert_close(kl_estimate(x, "k2"), x**2 / 2)
    torch.testing.assert_close(kl_estimate(x, "k3"), torch.exp(x) - 1 - x)
    with pytest.raises(ValueError, match="k4"):
        kl_estimate(x, "k4")


@pytest.mark.parametrize("kl_type", ["k1", "k2", "k3"])
def test_kl_penalty_is_the_weighted_clamped_estimate_with_autograds_gradient(kl_type):
    # x = ref - curr: inside the input clamp, beyond it (3.0 > 2; its weighted k stays under the output
    # clamp, so only the input clamp stops its gradient), and a weighted k beyond the output clamp (w = e^2).
    curr = _leaf([[-1.0, -2.0, -0.5, -4.0]])
    ref = torch.tensor([[-1.3, 1.0, -0.2, -2.5]], dtype=F64)
    gen = torch.tensor([[-1.1, -1.5, -0.6, -6.0]], dtype=F64)
    options = KLOptions(kl_type, input_clamp=2.0, output_clamp=3.0, on_policy_approximation=True)
    out = kl_penalty_per_token(curr, ref, gen, options)
    out.sum().backward()
    plain = curr.detach().clone().requires_grad_(True)
    weight = torch.exp(plain - gen)
    x = ref - plain
    x = torch.where(x.abs() <= 2.0, x, x.clamp(-2.0, 2.0).detach())  # NeMo-RL: the clamped input is a constant
    weight = torch.where((ref - plain).abs() <= 2.0, weight, weight.detach())
    expected = (weight * kl_estimate(x, kl_type)).clamp(-3.0, 3.0)
    expected.sum().backward()
    torch.testing.assert_close(out, expected.detach())
    torch.testing.assert_close(curr.grad, plain.grad)


def test_positive_example_nll_is_the_masked_mean_over_correct_samples_and_zero_without_one():
    curr = _leaf([[-1.0, -2.0, -3.0], [-4.0, -5.0, -6.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]], dtype=F64)
    correct = torch.tensor([1.0, 0.0], dtype=F64)
    nll = positive_example_nll(curr, mask, correct, torch.tensor(2.0, dtype=F64))
    assert nll.item() == pytest.approx(3.0 / 2.0)  # (1 + 2) / 2 tokens of the correct sample
    nll.backward()
    torch.testing.assert_close(curr.grad, torch.tensor([[-0.5, -0.5, 0.0], [0.0, 0.0, 0.0]], dtype=F64))
    # the count decides: a count of 0 gives 0, not the numerator / 1e-8
    none = positive_example_nll(curr, mask, correct, torch.tensor(0.0, dtype=F64))
    assert none.item() == 0.0
