"""Guards ``core/correction/weights.py`` on its own: IS weights per level, their truncation and metrics.

Each test calls one public function on hand-built tensors (and hand-built, already reduced
``SequenceStatistics``) and compares the result with the docstrings' formulas written out here:
``exp(d_t)`` per token, ``exp(sum_t m d)`` and ``exp(sum_t m d / n)`` per sequence, weight 0
for a non-finite log-ratio, the truncation's out-of-bounds share, and the weight metrics (masked
means over the global count, the tails beyond ``WEIGHT_TAIL``, the effective sample size).
"""

import math

import pytest
import torch

from nemo_rs_plugin.core.correction.statistics import SequenceStatistics
from nemo_rs_plugin.core.correction.weights import (
    WEIGHT_TAIL,
    apply_truncation,
    is_weights,
    record_sequence_weight_metrics,
    record_token_weight_metrics,
    truncate_weights,
)
from nemo_rs_plugin.core.masking import EPS, TokenMasks
from nemo_rs_plugin.core.reporting.metric_catalog import declared_specs
from nemo_rs_plugin.core.reporting.metrics import GlobalCounts, MetricSet
from nemo_rs_plugin.core.settings.config import RSClippedPGLossConfig

F64 = torch.float64
D = torch.tensor([[0.1, -0.2, 0.4], [0.3, 0.0, -0.5]], dtype=F64)
VALID = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=F64)


def _stats(d_sum, valid, token_mask=None, nonfinite=None) -> SequenceStatistics:
    d_sum, valid = torch.tensor(d_sum, dtype=F64), torch.tensor(valid, dtype=F64)
    return SequenceStatistics(
        d_sum=d_sum,
        valid=valid,
        token_mask=valid if token_mask is None else torch.tensor(token_mask, dtype=F64),
        nonfinite=torch.zeros_like(valid) if nonfinite is None else torch.tensor(nonfinite, dtype=F64),
        kept=valid,
    )


def _masks(valid=VALID) -> TokenMasks:
    ones = torch.ones_like(valid)
    return TokenMasks.build(valid, torch.ones(valid.shape[0], dtype=F64), ones, ones)


def _metrics(tokens: float, sequences: float, cfg: RSClippedPGLossConfig) -> MetricSet:
    """A metric set with these global counts, declaring what ``cfg`` declares (the catalog's specs)."""
    counts = GlobalCounts(tokens=torch.tensor(tokens, dtype=F64), sequences=torch.tensor(sequences, dtype=F64))
    return MetricSet(declared_specs(cfg), counts=counts)


def test_token_level_weight_is_exp_of_d_and_zero_where_d_was_not_finite():
    d_finite = torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 1.0]], dtype=F64)
    expected = D.exp() * d_finite
    torch.testing.assert_close(is_weights("token", D, d_finite, None), expected, rtol=0, atol=0)
    torch.testing.assert_close(is_weights("token", D, None, None), D.exp(), rtol=0, atol=0)


def test_sequence_level_weight_is_exp_of_the_masked_log_ratio_sum():
    stats = _stats([0.3, 0.3], [3.0, 2.0])  # sum_t m d of D's rows
    w = is_weights("sequence", D, None, stats)
    assert w.shape == (2, 1)
    torch.testing.assert_close(w, torch.tensor([[math.exp(0.3)], [math.exp(0.3)]], dtype=F64))


def test_sequence_mean_weight_is_exp_of_the_masked_mean_log_ratio():
    w = is_weights("sequence_mean", D, None, _stats([0.3, 0.3], [3.0, 2.0]))
    expected = [[math.exp(0.3 / (3 + EPS))], [math.exp(0.3 / (2 + EPS))]]
    torch.testing.assert_close(w, torch.tensor(expected, dtype=F64))


@pytest.mark.parametrize("level", ["sequence", "sequence_mean"])
def test_a_sequence_with_a_nonfinite_log_ratio_gets_weight_zero(level):
    w = is_weights(level, D, None, _stats([0.3, 0.3], [3.0, 2.0], nonfinite=[0.0, 1.0]))
    assert w[1, 0].item() == 0.0 and w[0, 0].item() > 0.0


def test_a_per_sequence_level_needs_statistics_and_an_unknown_level_is_an_error():
    with pytest.raises(ValueError, match="per-sequence statistics"):
        is_weights("sequence_mean", D, None, None)
    with pytest.raises(ValueError, match="is_correction_level"):
        is_weights("tokens", D, None, None)


def test_without_a_truncation_kind_the_weight_is_untouched_and_no_unit_is_out_of_bounds():
    raw = D.exp()
    weight, oob = truncate_weights(raw, None, 0.5, 1.2)
    assert weight is raw and oob is None


def test_tis_clamps_inclusively_and_reports_the_out_of_bound_share_of_valid_tokens():
    cfg = RSClippedPGLossConfig(
        use_importance_sampling_correction=True,
        truncated_importance_sampling_type="tis",
        truncated_importance_sampling_ratio=2.0,
    )
    raw = torch.tensor([[0.5, 2.0, 3.0], [2.5, 1.0, 9.0]], dtype=F64)  # 2.0 is on the bound: inside
    metrics = _metrics(tokens=5.0, sequences=2.0, cfg=cfg)
    weight = apply_truncation(cfg, raw, None, _masks(), metrics)
    torch.testing.assert_close(weight, raw.clamp(0.0, 2.0), rtol=0, atol=0)
    # 3.0 and 2.5 are valid and above; 9.0 is above but not valid
    assert metrics.finalize()["is_oob_ratio"] == pytest.approx(2.0 / (5.0 + EPS))


def test_seq_mask_tis_takes_the_geometric_mean_over_token_mask_tokens():
    cfg = RSClippedPGLossConfig(
        use_importance_sampling_correction=True,
        truncated_importance_sampling_type="seq-mask-tis",
        truncated_importance_sampling_ratio_min=0.9,
        truncated_importance_sampling_ratio=1.2,
    )
    # d_sum 0.3 over 3 token_mask tokens: g = exp(0.1), inside; over 1: g = exp(0.3) > 1.2, zeroed.
    # (Divided by valid instead, the two rows would swap.)
    stats = _stats([0.3, 0.3], valid=[1.0, 3.0], token_mask=[3.0, 1.0])
    raw = torch.tensor([[1.5], [0.7]], dtype=F64)
    metrics = _metrics(tokens=5.0, sequences=2.0, cfg=cfg)
    weight = apply_truncation(cfg, raw, stats, _masks(), metrics)
    assert weight.tolist() == [[1.5], [0.0]]  # the kept row keeps its untruncated weight
    assert metrics.finalize()["is_oob_ratio"] == pytest.approx(1.0 / (2.0 + EPS))


def test_token_weight_metrics_are_masked_means_tails_extremes_and_the_effective_sample_size():
    raw = torch.tensor([[0.4, 1.0, 3.0], [0.2, 1.5, 0.1]], dtype=F64)  # 0.1 is not valid
    weight = raw.clamp(0.0, 2.0)
    loss_tokens = VALID * torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 1.0]], dtype=F64)  # 0.2 rejected
    metrics = _metrics(tokens=5.0, sequences=2.0, cfg=RSClippedPGLossConfig(use_importance_sampling_correction=True))
    record_token_weight_metrics(metrics, raw, weight, _masks(), loss_tokens)
    out = metrics.finalize()
    n = 5.0 + EPS
    applied = [0.4, 1.0, 2.0, 1.5]  # the weights of the tokens in the loss
    assert out["is_weight_raw_mean"] == pytest.approx((0.4 + 1.0 + 3.0 + 0.2 + 1.5) / n)
    assert out["is_weight_mean"] == pytest.approx(sum(applied) / n)
    assert out["is_weight_sq_mean"] == pytest.approx(sum(w * w for w in applied) / n)
    assert out["is_ess"] == pytest.approx(sum(applied) ** 2 / (5 * sum(w * w for w in applied)))
    # tails of the raw weights over valid tokens: below 1/C (0.4, 0.2; not 0.1), above C (3.0)
    assert WEIGHT_TAIL == 2.0
    assert out["is_weight_raw_low_frac"] == pytest.approx(2.0 / n)
    assert out["is_weight_raw_high_frac"] == pytest.approx(1.0 / n)
    assert (out["is_weight_raw_min"], out["is_weight_raw_max"]) == (0.2, 3.0)
    assert (out["is_weight_min"], out["is_weight_max"]) == (0.4, 2.0)


def test_sequence_weight_metrics_count_sequences_and_the_applied_weights_of_kept_ones_only():
    raw = torch.tensor([[0.3], [6.0], [4.0], [7.0]], dtype=F64)
    weight = raw.clamp(0.0, 5.0)
    units = torch.tensor([1.0, 1.0, 1.0, 0.0], dtype=F64)  # the last row has no valid token
    seq_in_loss = torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=F64)  # row 1 dropped by a filter
    level = RSClippedPGLossConfig(use_importance_sampling_correction=True, is_correction_level="sequence")
    metrics = _metrics(tokens=9.0, sequences=3.0, cfg=level)
    record_sequence_weight_metrics(metrics, raw, weight, units, seq_in_loss)
    out = metrics.finalize()
    n = 3.0 + EPS
    assert out["is_weight_raw_mean"] == pytest.approx((0.3 + 6.0 + 4.0) / n)
    assert out["is_weight_mean"] == pytest.approx((0.3 + 4.0) / n)
    assert out["is_weight_sq_mean"] == pytest.approx((0.09 + 16.0) / n)
    assert out["is_ess"] == pytest.approx(4.3**2 / (3 * 16.09))
    assert out["is_weight_raw_low_frac"] == pytest.approx(1.0 / n)  # 0.3 < 1/2
    assert out["is_weight_raw_high_frac"] == pytest.approx(2.0 / n)  # 6.0 and 4.0 > 2 (7.0 is no unit)
    assert (out["is_weight_raw_min"], out["is_weight_raw_max"]) == (0.3, 6.0)
    assert (out["is_weight_min"], out["is_weight_max"]) == (0.3, 4.0)  # not the dropped row's 5.0
