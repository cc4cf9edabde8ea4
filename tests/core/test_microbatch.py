"""Calls on one sequence at a time, given the microbatch's totals, add up to the call on the microbatch.

What NeMo-RL's per-sequence packing wrapper does, without NeMo-RL (the real wrappers:
tests/nemo_rl/test_packing.py): split a microbatch into ``B = 1`` calls, sum their losses,
gradients and the metrics the NeMo-RL loss returns. With
:meth:`CorrectedPGLoss.microbatch_totals` passed to each call the sums equal the one call on
the microbatch; without them the settings that read the whole microbatch change (the premise:
this test could fail).
"""

import pytest
import torch

from nemo_rs_plugin import CorrectedPGLoss
from nemo_rs_plugin.core.batch.inputs import LossInputs
from nemo_rs_plugin.core.batch.microbatch import current_policy_problems, needs_microbatch_totals
from nemo_rs_plugin.core.settings.config import RSClippedPGLossConfig
from tests.conftest import make_batch

VETO = {"level": "sequence", "statistic": "ratio", "agg": "any", "lower": 0.8, "upper": 1.25}
TOKEN_MIS = {"level": "token", "statistic": "ratio", "lower": 0.9, "upper": 1.1}
CONFIGS = {
    "batch_norm/sequence_mean": {
        "use_importance_sampling_correction": True,
        "is_correction_level": "sequence_mean",
        "is_batch_normalization": "microbatch",
    },
    "batch_norm/token_tis": {
        "use_importance_sampling_correction": True,
        "is_correction_level": "token",
        "truncated_importance_sampling_type": "tis",
        "truncated_importance_sampling_ratio": 1.05,
        "is_batch_normalization": "microbatch",
    },
    "kept/token_level": {"rejection_sampling": [VETO, TOKEN_MIS], "rejection_denominator": "kept"},
    "kept/sequence_level": {
        "rejection_sampling": [VETO, TOKEN_MIS],
        "rejection_denominator": "kept",
        "token_level_loss": False,
    },
    "nll": {"positive_example_nll_weight": 0.5},
}
# NeMo-RL's own extremes, which its wrapper combines by min and max (every other metric: a sum)
EXTREMES = {
    "probs_ratio_min": min,
    "probs_ratio_clamped_min": min,
    "probs_ratio_max": max,
    "probs_ratio_clamped_max": max,
}


def microbatch(B=5, T=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    prev = -torch.rand(B, T, generator=g) - 0.05
    token_mask = torch.ones(B, T)
    token_mask[1, 7:] = 0  # uneven lengths
    token_mask[3, 4:] = 0
    return make_batch(
        prev + 0.05 * torch.randn(B, T, generator=g),
        prev,
        (prev + 0.1 * torch.randn(B, T, generator=g)).clamp_max(0.0),
        advantages=torch.randn(B, 1, generator=g).expand(B, T).clone(),
        rewards=torch.tensor([1.0, -1.0, 0.5, 0.0, 2.0])[:B],
        token_mask=token_mask,
    )


def _rows(data, i):
    return {k: (v[i : i + 1] if isinstance(v, torch.Tensor) and v.dim() > 0 else v) for k, v in data.items()}


def per_sequence(loss, lp, data, gvs, gvt, with_totals=True):
    """The wrapper's calls: ``(summed loss, gradient of lp, combined metrics)``."""
    totals = None
    if with_totals:
        x = LossInputs.from_nemo_rl(lp.detach(), data, need_prev=True, need_reference=False)
        totals = loss.microbatch_totals(x)
    leaf = lp.detach().clone().requires_grad_(True)
    total, metrics = 0.0, {}
    for i in range(lp.shape[0]):
        value, m = loss(leaf[i : i + 1], _rows(data, i), gvs, gvt, microbatch=totals)
        total = total + value
        for k, v in m.items():
            metrics[k] = EXTREMES[k](metrics[k], v) if k in metrics and k in EXTREMES else metrics.get(k, 0.0) + v
    total.backward()
    return total.detach(), leaf.grad, metrics


def whole(loss, lp, data, gvs, gvt):
    leaf = lp.detach().clone().requires_grad_(True)
    value, metrics = loss(leaf, data, gvs, gvt)
    value.backward()
    return value.detach(), leaf.grad, metrics


@pytest.mark.parametrize("name", CONFIGS)
def test_per_sequence_calls_with_the_totals_add_up_to_the_microbatch_call(name):
    lp, data, gvs, gvt = microbatch()
    loss = CorrectedPGLoss(CONFIGS[name], per_call_metrics=False)  # what the NeMo-RL loss returns
    want_loss, want_grad, want_metrics = whole(loss, lp, data, gvs, gvt)
    got_loss, got_grad, got_metrics = per_sequence(loss, lp, data, gvs, gvt)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-5, atol=1e-7)
    assert got_metrics.keys() == want_metrics.keys()
    for k, v in want_metrics.items():
        assert got_metrics[k] == pytest.approx(v, rel=1e-5, abs=1e-6), k


@pytest.mark.parametrize("name", CONFIGS)
def test_without_the_totals_each_sequence_is_its_own_microbatch(name):
    """The premise: these settings read more than one sequence, so the per-sequence calls differ."""
    lp, data, gvs, gvt = microbatch()
    loss = CorrectedPGLoss(CONFIGS[name], per_call_metrics=False)
    want_loss, want_grad, _ = whole(loss, lp, data, gvs, gvt)
    got_loss, got_grad, _ = per_sequence(loss, lp, data, gvs, gvt, with_totals=False)
    assert not torch.allclose(got_grad, want_grad, rtol=1e-3, atol=1e-6)
    assert needs_microbatch_totals(RSClippedPGLossConfig.from_any(CONFIGS[name]))


def test_per_call_metrics_are_declared_and_left_out_only_where_asked():
    lp, data, gvs, gvt = microbatch()
    cfg = CONFIGS["batch_norm/sequence_mean"]
    everything = CorrectedPGLoss(cfg)(lp, data, gvs, gvt)[1]
    summable = CorrectedPGLoss(cfg, per_call_metrics=False)(lp, data, gvs, gvt)[1]
    per_call = set(CorrectedPGLoss(cfg).per_call_metric_names())
    assert per_call == {
        "is_weight_raw_min",
        "is_weight_raw_max",
        "is_weight_min",
        "is_weight_max",
        "is_ess",
        "is_batch_norm_factor",
    }
    assert set(everything) - set(summable) == per_call
    assert {"probs_ratio_min", "probs_ratio_max", "is_weight_raw_low_frac"} <= set(summable)
    assert set(CorrectedPGLoss(cfg, per_call_metrics=False).metric_normalizations()) == set(summable)


@pytest.mark.parametrize(
    "cfg, field",
    [
        ({**CONFIGS["batch_norm/token_tis"], "force_on_policy_ratio": True}, "is_batch_normalization"),
        ({"rejection_sampling": [{**TOKEN_MIS, "log_ratio": "curr-gen"}], "rejection_denominator": "kept"}, "kept"),
        ({"rejection_sampling": [{**VETO, "log_ratio": "curr-prev"}], "rejection_denominator": "kept"}, "kept"),
        ({"rejection_sampling": [VETO], "rejection_denominator": "kept", "force_on_policy_ratio": True}, "kept"),
    ],
)
def test_totals_that_need_the_current_policy_are_named(cfg, field):
    [problem] = current_policy_problems(RSClippedPGLossConfig.from_any(cfg))
    assert field in problem and "current policy" in problem


@pytest.mark.parametrize("name", CONFIGS)
def test_totals_from_the_inputs_before_the_forward_pass_are_allowed(name):
    assert current_policy_problems(RSClippedPGLossConfig.from_any(CONFIGS[name])) == []


def test_partial_totals_are_an_error_naming_the_missing_total():
    lp, data, gvs, gvt = microbatch()
    loss = CorrectedPGLoss(CONFIGS["kept/token_level"])
    x = LossInputs.from_nemo_rl(lp.detach(), data, need_prev=True, need_reference=False)
    partial = loss.microbatch_totals(x)._replace(kept_sequence_fraction=None)
    with pytest.raises(ValueError, match="microbatch: kept_sequence_fraction is None"):
        loss(lp, data, gvs, gvt, microbatch=partial)
