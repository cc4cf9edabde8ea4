"""Guards core/correction/calibration.py: bounds from measured log-probs for a target rejection rate.

Constructed inputs whose quantiles are known: the calibrated band must reject the target share
(never more), contain ratio 1, follow the template's sides, use the loss's own statistic (a
later stage sees the tokens earlier token stages kept) and agree with the loss itself.
"""

from __future__ import annotations

import math

import pytest
import torch

from nemo_rs_plugin.core.correction.calibration import band_for_rejection, calibrate_filters, rejected_fractions
from nemo_rs_plugin.core.loss import CorrectedPGLoss
from nemo_rs_plugin.core.settings import presets
from nemo_rs_plugin.core.settings.config import RejectionFilter
from tests.support.logprobs import at_most_zero


def _sequences_with_mean_log_ratio(means: list[float], tokens: int = 8):
    """``prev - gen`` constant per sequence: sequence i's Geo-RS statistic is exp(means[i])."""
    B = len(means)
    gen = torch.full((B, tokens), -1.0, dtype=torch.float64)
    prev = gen + torch.tensor(means, dtype=torch.float64)[:, None]
    return prev, gen, torch.ones(B, tokens)


def test_geo_rs_band_rejects_the_target_share_on_each_side():
    means = [(i - 49.5) / 1000 for i in range(100)]  # log geo-mean ratios -0.0495 .. 0.0495
    prev, gen, mask = _sequences_with_mean_log_ratio(means)
    (stage,) = calibrate_filters([RejectionFilter(**presets.GEO_RS)], prev, gen, mask, 0.1)
    assert stage.units == 100
    # 5 sequences below the lower bound, 5 above the upper: lower = exp(-0.0445), upper = exp(0.0445)
    assert stage.filter.lower == pytest.approx(math.exp(-0.0445), rel=1e-5)
    assert stage.filter.upper == pytest.approx(math.exp(0.0445), rel=1e-5)
    assert stage.rejected_frac == pytest.approx(0.10)
    assert rejected_fractions([stage.filter], prev, gen, mask) == [pytest.approx(0.10)]
    # The fixed band as written rejects almost everything here.
    assert rejected_fractions([RejectionFilter(**presets.GEO_RS)], prev, gen, mask)[0] == pytest.approx(0.80)


def test_band_never_rejects_more_than_the_target_and_contains_one():
    torch.manual_seed(0)
    for target in (0.0, 0.01, 0.05, 0.3):
        means = (torch.randn(257) * 0.2 + 0.5).tolist()  # all ratios above 1: the band must still hold 1
        prev, gen, mask = _sequences_with_mean_log_ratio(means)
        (stage,) = calibrate_filters([RejectionFilter(**presets.GEO_RS)], prev, gen, mask, target)
        assert stage.rejected_frac <= target + 1e-12
        assert stage.filter.lower <= 1.0 <= stage.filter.upper


def test_one_sided_template_is_calibrated_on_its_side_only():
    means = [i / 100 for i in range(100)]
    prev, gen, mask = _sequences_with_mean_log_ratio(means)
    upper_only = RejectionFilter(level="sequence", statistic="ratio", agg="mean", upper=1.01)
    (stage,) = calibrate_filters([upper_only], prev, gen, mask, 0.1)
    assert stage.filter.lower is None
    assert stage.filter.upper == pytest.approx(math.exp(0.89), rel=1e-5)  # the whole 10% above
    divergence = RejectionFilter(level="sequence", statistic="kl_k3", agg="mean", lower=0.0, upper=1e-3)
    (stage,) = calibrate_filters([divergence], prev, gen, mask, 0.1)
    assert stage.filter.lower == 0.0  # a divergence keeps its lower bound as written
    assert stage.rejected_frac == pytest.approx(0.10)


def test_any_aggregation_ranges_over_row_extremes():
    B, T = 100, 4
    gen = torch.full((B, T), -1.0, dtype=torch.float64)
    prev = gen.clone()
    prev[:, 0] += torch.linspace(-1, 0, B, dtype=torch.float64)  # row minimum
    prev[:, 1] += torch.linspace(0, 1, B, dtype=torch.float64)  # row maximum
    veto = RejectionFilter(**presets.OUTLIER_VETO)  # [1e-4, 1e4]: far outside; allow the quantile band
    (stage,) = calibrate_filters([veto], prev, gen, torch.ones(B, T), 0.2, widen_only=False)
    assert stage.rejected_frac == pytest.approx(0.20, abs=0.011)
    assert stage.filter.lower < 1.0 < stage.filter.upper


def test_a_later_stage_sees_only_tokens_the_calibrated_token_stage_kept():
    torch.manual_seed(1)
    B, T = 64, 32
    gen = -torch.rand(B, T, dtype=torch.float64) * 2
    prev = gen + torch.randn(B, T, dtype=torch.float64) * 0.3
    stages = calibrate_filters(
        [RejectionFilter(**presets.TOKEN_MIS), RejectionFilter(**presets.GEO_RS)], prev, gen, torch.ones(B, T), 0.1
    )
    lo, hi = math.log(stages[0].filter.lower), math.log(stages[0].filter.upper)
    d = prev - gen
    kept = (d >= lo) & (d <= hi)
    seq_mean = (d * kept).sum(-1) / kept.sum(-1)
    expected = torch.quantile(seq_mean, 0.95, interpolation="higher")
    assert math.log(stages[1].filter.upper) == pytest.approx(float(expected), abs=2e-6)


def test_calibrated_band_rejects_what_the_loss_rejects():
    torch.manual_seed(2)
    B, T = 40, 16
    gen = -torch.rand(B, T) * 2
    prev = gen + torch.randn(B, 1) * 0.05 + torch.randn(B, T) * 0.1
    gen, prev = at_most_zero(gen, prev)  # log-probs <= 0, the log-ratios unchanged
    mask = torch.ones(B, T)
    (stage,) = calibrate_filters([RejectionFilter(**presets.GEO_RS)], prev, gen, mask, 0.2)
    loss_fn = CorrectedPGLoss(
        {"rejection_sampling": [stage.filter.model_dump(exclude_none=True)], "reference_policy_kl_penalty": 0.0}
    )
    pad = torch.zeros(B, 1)
    data = {
        "advantages": torch.ones(B, T + 1),
        "prev_logprobs": torch.cat([pad, prev], 1),
        "generation_logprobs": torch.cat([pad, gen], 1),
        "token_mask": torch.ones(B, T + 1),
        "sample_mask": torch.ones(B),
        "input_ids": torch.zeros(B, T + 1, dtype=torch.long),
    }
    _, metrics = loss_fn(prev.clone(), data, torch.tensor(float(B)), torch.tensor(float(B * T)))
    assert metrics["rs_seq_rejected_frac"] == pytest.approx(stage.rejected_frac, abs=1e-6)


def test_refusals():
    prev, gen, mask = _sequences_with_mean_log_ratio([0.0, 0.1])
    with pytest.raises(ValueError, match="target rejection"):
        band_for_rejection(torch.zeros(2), torch.zeros(2), 1.0, (True, True), True)
    opsm = RejectionFilter(level="sequence", statistic="ratio", upper=2.0, log_ratio="curr-prev")
    with pytest.raises(ValueError, match="current policy"):
        calibrate_filters([opsm], prev, gen, mask, 0.05)
    with pytest.raises(ValueError, match="no unit"):
        calibrate_filters([RejectionFilter(**presets.GEO_RS)], prev, gen, torch.zeros_like(mask), 0.05)


def test_calibration_only_widens_the_template_unless_asked():
    """On a mismatch far below the template's band, the band stays as written (never tighter)."""
    means = [(i - 49.5) / 1e5 for i in range(100)]  # |log ratio| < 5e-4: well inside [0.99, 1.01]
    prev, gen, mask = _sequences_with_mean_log_ratio(means)
    geo = RejectionFilter(**presets.GEO_RS)
    (stage,) = calibrate_filters([geo], prev, gen, mask, 0.1)
    assert (stage.filter.lower, stage.filter.upper) == (0.99, 1.01)
    assert stage.rejected_frac == 0.0
    (tight,) = calibrate_filters([geo], prev, gen, mask, 0.1, widen_only=False)
    assert 0.999 < tight.filter.lower < 1.0 < tight.filter.upper < 1.001
    assert tight.rejected_frac == pytest.approx(0.10)


@pytest.mark.parametrize("shift", [0.5, -0.5], ids=["every-ratio-above-1", "every-ratio-below-1"])
def test_without_widening_the_calibrated_band_still_contains_1(shift):
    """``widen_only=False``: on data whose every ratio lies on one side of 1, the quantile bound on
    that side would exclude 1 (reject on-policy units); it is moved to 1."""
    means = [shift + i / 1000 for i in range(100)]  # log geo-mean ratios all > 0 (or all < 0)
    prev, gen, mask = _sequences_with_mean_log_ratio(means)
    (stage,) = calibrate_filters([RejectionFilter(**presets.GEO_RS)], prev, gen, mask, 0.1, widen_only=False)
    assert stage.filter.lower <= 1.0 <= stage.filter.upper
    inner = stage.filter.lower if shift > 0 else stage.filter.upper
    assert inner == 1.0  # the quantile (about exp(+-0.5)) moved to 1, not left beyond it
