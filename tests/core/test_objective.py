"""Clamps of the objective, checked on their value *and* their gradient.

Hand-computed, float64, one or two tokens, KL off unless it is the subject (tolerance 1e-7:
NeMo-RL's "+ 1e-8" in every denominator):
* the policy log-ratio is clamped to +-20 straight-through (policy_loss.LOG_RATIO_CLAMP): the
  value is exp(20), the gradient is passed through as if unclamped at that value;
* where the KL penalty's input clamp is active, NeMo-RL detaches the sampling weight, so the
  clamped token gets no gradient at all.
"""

import math

import pytest
import torch

from nemo_rs_plugin import CorrectedPGLoss
from tests.conftest import make_batch


def run(cfg, curr, prev, gen=None, advantages=None, ref=None, token_mask=None):
    curr = torch.tensor(curr, dtype=torch.float64)
    prev = torch.tensor(prev, dtype=torch.float64)
    gen = prev if gen is None else torch.tensor(gen, dtype=torch.float64)
    lp, data, gvs, gvt = make_batch(
        curr,
        prev,
        gen,
        advantages=advantages,
        token_mask=token_mask,
        ref=None if ref is None else torch.tensor(ref, dtype=torch.float64),
    )
    data = {k: v.double() if v.is_floating_point() else v for k, v in data.items()}
    lp = curr.clone().requires_grad_(True)
    loss, metrics = CorrectedPGLoss(cfg)(lp, data, gvs.double(), gvt.double())
    loss.backward()
    return loss.item(), lp.grad, metrics


E20 = math.exp(20.0)


def test_token_log_ratio_is_clamped_straight_through():
    # curr - prev = 25, A = -1: the unclipped branch -A r is the max; r = exp(clamp(25)) = e^20,
    # and d loss / d curr = r (the clamp passes the gradient; a hard clamp would give 0).
    # (prev = -26, so that curr = -1 is a log-prob: a value above 0 draws an InputWarning.)
    loss, grad, _ = run({"reference_policy_kl_penalty": 0.0}, [[-26.0 + 25.0]], [[-26.0]], advantages=[[-1.0]])
    assert loss == pytest.approx(E20, rel=1e-7)
    assert grad.item() == pytest.approx(E20, rel=1e-7)


def test_gspo_log_ratio_is_clamped_straight_through():
    # Both tokens at curr - prev = 25: the sequence ratio is exp(clamp(25)) = e^20; the
    # sequence-level loss is mean_t(-A r) = e^20, and d loss / d curr_t = r / 2 per token.
    cfg = {"reference_policy_kl_penalty": 0.0, "sequence_level_importance_ratios": True, "token_level_loss": False}
    loss, grad, _ = run(cfg, [[-1.0, -1.0]], [[-26.0, -26.0]], advantages=[[-1.0, -1.0]])
    assert loss == pytest.approx(E20, rel=1e-7)
    torch.testing.assert_close(grad, torch.full((1, 2), E20 / 2, dtype=torch.float64), rtol=1e-7, atol=0)


def test_kl_input_clamp_stops_the_sampling_weight_gradient_too():
    # k3 with beta = 1, no output clamp, A = 0 (no policy term); x = ref - curr.
    # token 0: x = -30, clamped to -20: value k3(-20) = e^-20 + 19, gradient 0 (weight detached)
    # token 1: x = -1: value k3(-1) = e^-1, gradient k3(x) - k3'(x) = e^-1 - (e^-1 - 1) = 1.
    cfg = {"reference_policy_kl_penalty": 1.0, "reference_policy_kl_type": "k3", "kl_output_clamp_value": None}
    curr = [[-1.0, -1.0]]
    loss, grad, metrics = run(cfg, curr, curr, advantages=[[0.0, 0.0]], ref=[[-31.0, -2.0]])
    k3_clamped, k3_free = math.exp(-20.0) + 19.0, math.exp(-1.0)
    assert loss == pytest.approx((k3_clamped + k3_free) / 2, rel=1e-7)
    torch.testing.assert_close(grad, torch.tensor([[0.0, 0.5]], dtype=torch.float64), rtol=1e-7, atol=1e-15)


def test_rejected_token_gets_no_gradient_under_gspo():
    # Token 2 has d = 2 (ratio e^2 > 2): the token filter rejects it; the row is kept.
    cfg = {
        "sequence_level_importance_ratios": True,
        "token_level_loss": False,
        "reference_policy_kl_penalty": 0.0,
        "rejection_sampling": [{"level": "token", "upper": 2.0}],
    }
    prev = [[-1.0, -1.0, -1.0, -1.0]]
    gen = [[-1.0, -1.0, -3.0, -1.0]]
    curr = [[-0.99, -0.98, -0.97, -0.96]]
    _, grad, metrics = run(cfg, curr, prev, gen=gen, advantages=[[1.0] * 4])
    assert metrics["rs/token_ratio/token_rejected_frac"] == pytest.approx(0.25)
    assert grad[0, 2] == 0
