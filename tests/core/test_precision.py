"""bf16, fp16 and mixed-dtype inputs: the loss runs in float32 whatever the input dtype.

The sharp check compares a half-precision call with a float32 call on the *same* (rounded)
values: both compute in float32, so loss and metrics agree to float32 precision and the
gradient is the float32 gradient cast to the caller's dtype. A second check compares with
float32 on the unrounded inputs, at bf16 tolerance: what rounding the inputs costs.
"""

import math

import pytest
import torch

from nemo_rs_plugin import CorrectedPGLoss
from tests.conftest import random_batch

CONFIGS = {
    "default": {},
    "filters": {
        "use_importance_sampling_correction": True,
        "is_correction_level": "sequence_mean",
        "truncated_importance_sampling_type": "tis",
        "truncated_importance_sampling_ratio": 1.5,
        "positive_example_nll_weight": 0.1,
        "rejection_sampling": [
            {"level": "sequence", "agg": "mean", "lower": 0.5, "upper": 2.0},
            {"level": "sequence", "agg": "any", "lower": 1e-4, "upper": 100},
            {"level": "token", "statistic": "kl_k3", "upper": 0.5},
        ],
    },
    "gspo-kl": {
        "sequence_level_importance_ratios": True,
        "token_level_loss": False,
        "use_importance_sampling_correction": True,
        "reference_policy_kl_penalty": 0.05,
        "use_on_policy_kl_approximation": True,
    },
}
HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}
# The huge log-ratio is put on the current log-prob (curr = prev + 30 or + 1e4, above 0): the
# positive-log-prob InputWarning is a side effect of that extreme input, not the subject.
POSITIVE_CURR = pytest.mark.filterwarnings(
    "ignore:next_token_logprobs. log-probs above 0:nemo_rs_plugin.core.batch.input_checks.InputWarning"
)


def batch(B=3, T=101):
    # 303 valid tokens: not representable in bf16 (8 significant bits), so a global count
    # held in bf16 would scale the loss by 304/303.
    return random_batch(B, T, spread=3.0, gen_noise=0.05, ref_noise=0.1, rewards=torch.tensor([1.0, -1.0, 0.5])[:B])


def cast(lp, data, lp_dtype, data_dtype):
    data = {
        k: v.to(data_dtype) if v.is_floating_point() and k not in ("sample_mask", "rewards") else v.clone()
        for k, v in data.items()
    }
    return lp.detach().to(lp_dtype).requires_grad_(True), data


def run(cfg, lp, data, gvs, gvt):
    loss, metrics = CorrectedPGLoss(cfg)(lp, data, gvs, gvt)
    loss.backward()
    return loss.detach(), metrics, lp.grad


def assert_metrics_close(got, want, rel, abs_):
    assert set(got) == set(want)
    for key, value in want.items():
        if math.isinf(value):
            assert got[key] == value, key
        else:
            assert got[key] == pytest.approx(value, rel=rel, abs=abs_), key


@pytest.mark.parametrize("mixed", [False, True], ids=["all-half", "half-logprobs-fp32-data"])
@pytest.mark.parametrize("half", HALF, ids=list(HALF))
@pytest.mark.parametrize("cfg", CONFIGS, ids=list(CONFIGS))
def test_half_inputs_compute_in_float32(cfg, half, mixed):
    dtype = HALF[half]
    lp, data, gvs, gvt = batch()
    lp_h, data_h = cast(lp, data, dtype, torch.float32 if mixed else dtype)
    lp_r, data_r = cast(lp_h, data_h, torch.float32, torch.float32)  # the same values in fp32
    loss_h, m_h, g_h = run(CONFIGS[cfg], lp_h, data_h, gvs, gvt)
    loss_r, m_r, g_r = run(CONFIGS[cfg], lp_r, data_r, gvs, gvt)
    assert loss_h.dtype == torch.float32 and g_h.dtype == dtype
    torch.testing.assert_close(loss_h, loss_r)
    torch.testing.assert_close(g_h, g_r.to(dtype))
    assert_metrics_close(m_h, m_r, rel=1e-6, abs_=1e-7)

    # Against float32 on the unrounded inputs: only the input rounding differs.
    loss_32, m_32, g_32 = run(CONFIGS[cfg], lp.detach().clone().requires_grad_(True), data, gvs, gvt)
    # Rounding a log-prob to bf16 moves it by up to 0.4%; the `sequence` IS weight (GSPO) is
    # exp of a sum over 101 such log-ratios, hence 5% on its metrics.
    torch.testing.assert_close(loss_h, loss_32, rtol=1.6e-2, atol=1e-3)
    cos = torch.nn.functional.cosine_similarity(g_h.double().flatten(), g_32.double().flatten(), dim=0)
    assert cos > 0.999, cos
    assert g_h.double().norm() / g_32.double().norm() == pytest.approx(1.0, rel=1e-2)
    assert_metrics_close(m_h, m_32, rel=5e-2, abs_=1e-3)


@POSITIVE_CURR
@pytest.mark.parametrize("half, log_ratio", [("bf16", 1e4), ("fp16", 30.0), ("fp16", 1e4)])
def test_large_policy_log_ratio_in_half_precision(half, log_ratio):
    # One token with curr - prev = log_ratio and A > 0: its ratio is clamped to exp(20) and,
    # being above 1 + eps, clipped, so it reports exp(20) and receives no gradient. bf16 used
    # to cancel the straight-through clamp (ratio 1, full gradient); fp16 overflowed exp
    # (NaN gradient).
    dtype = HALF[half]
    lp, data, gvs, gvt = batch()
    lp = lp.detach().clone()
    lp[0, 5] = data["prev_logprobs"][0, 6] + log_ratio
    data["advantages"][0, 6] = 1.0
    lp_h, data_h = cast(lp, data, dtype, dtype)
    lp_r, data_r = cast(lp_h, data_h, torch.float32, torch.float32)
    loss_h, m_h, g_h = run({}, lp_h, data_h, gvs, gvt)
    loss_r, m_r, g_r = run({}, lp_r, data_r, gvs, gvt)
    assert m_h["probs_ratio_max"] == pytest.approx(math.exp(20), rel=1e-6)
    assert g_h[0, 5] == 0
    assert torch.isfinite(g_h).all()
    torch.testing.assert_close(loss_h, loss_r)
    torch.testing.assert_close(g_h, g_r.to(dtype))
    assert_metrics_close(m_h, m_r, rel=1e-6, abs_=1e-7)


@POSITIVE_CURR
def test_negative_advantage_on_a_huge_ratio_saturates_fp16_but_never_nans():
    # A < 0 takes the unclipped side: d loss / d curr = -A exp(20) / N, about 1.6e6 here,
    # beyond fp16's 65504. The fp16 gradient saturates to inf (the cast); it is never NaN.
    lp, data, gvs, gvt = batch()
    lp = lp.detach().clone()
    lp[0, 5] = data["prev_logprobs"][0, 6] + 30.0
    data["advantages"][0, 6] = -1.0
    lp_h, data_h = cast(lp, data, torch.float16, torch.float16)
    _, _, g_h = run({}, lp_h, data_h, gvs, gvt)
    assert not torch.isnan(g_h).any()
    assert g_h[0, 5] == float("inf")
    assert torch.isfinite(g_h[1:]).all()


@pytest.mark.parametrize("gspo", [False, True], ids=["token-ratio", "gspo-ratio"])
def test_straight_through_clamp_is_exact_for_huge_log_ratios_in_float32(gspo):
    # prev = -1e9 (a log-prob filled with a large negative number): curr - prev = 1e9, where
    # x + (clamp(x) - x) cancels to 0 in float32 and the ratio read 1.
    lp, data, gvs, gvt = batch(B=2, T=4)
    data["prev_logprobs"][0, 1:] = -1e9
    data["advantages"][0, 1:] = 1.0
    cfg = {"reference_policy_kl_penalty": 0.0}
    if gspo:
        cfg.update(sequence_level_importance_ratios=True, token_level_loss=False)
    _, m, g = run(cfg, lp, data, gvs, gvt)
    assert m["probs_ratio_max"] == pytest.approx(math.exp(20), rel=1e-6)
    assert torch.all(g[0] == 0)  # clipped: A > 0 and r = exp(20) > 1 + eps


def test_float64_inputs_stay_float64():
    lp, data, gvs, gvt = batch()
    lp64, data64 = cast(lp, data, torch.float64, torch.float64)
    loss, _, g = run(CONFIGS["filters"], lp64, data64, gvs, gvt)
    assert loss.dtype == torch.float64 and g.dtype == torch.float64
