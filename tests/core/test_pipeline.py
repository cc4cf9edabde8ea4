"""Guards ``core/correction/pipeline.py`` on its own: plan, reduce, apply, and the order of the stages.

Each test runs the pipeline's public functions on a few hand-built rows and compares the result
with its docstrings' rules, written out here: which configurations read a per-sequence
statistic at all, the per-sequence sums the plan hands to the reduction, the stage order (a
token filter after a sequence filter only counts rows that survived it), the combined keep mask,
the advantage-conditioned rows, and the weight (the level's, truncated, over its batch mean).
"""

import math

import pytest
import torch

from nemo_rs_plugin.core.correction.pipeline import (
    apply_correction,
    compute_correction,
    needs_sequence_statistics,
    plan_correction,
)
from nemo_rs_plugin.core.masking import EPS, TokenMasks, log_ratio
from nemo_rs_plugin.core.reporting.metric_catalog import declared_specs
from nemo_rs_plugin.core.reporting.metrics import GlobalCounts, MetricSet
from nemo_rs_plugin.core.settings.config import RSClippedPGLossConfig

F64 = torch.float64
log = math.log
IS = {"use_importance_sampling_correction": True}
GEO_MEAN = {"level": "sequence", "lower": 0.8, "upper": 1.25}
TOKEN_BAND = {"level": "token", "lower": 0.5, "upper": 2.0}


def _cfg(**fields) -> RSClippedPGLossConfig:
    return RSClippedPGLossConfig.from_any(fields)


def _masks(token_mask, sample_mask=None, d_finite=None, inputs_finite=None) -> TokenMasks:
    token_mask = torch.as_tensor(token_mask, dtype=F64)
    ones = torch.ones_like(token_mask)
    sample_mask = (
        torch.ones(token_mask.shape[0], dtype=F64) if sample_mask is None else torch.tensor(sample_mask, dtype=F64)
    )
    return TokenMasks.build(
        token_mask,
        sample_mask,
        ones if d_finite is None else d_finite,
        ones if inputs_finite is None else inputs_finite,
    )


def _run(cfg, d, masks, **kw):
    counts = GlobalCounts(tokens=masks.valid.sum(), sequences=masks.sample_mask.sum())
    return compute_correction(cfg, d, masks, counts=counts, **kw)


@pytest.mark.parametrize(
    ("fields", "needed"),
    [
        ({}, False),  # NeMo-RL's default
        ({**IS, "truncated_importance_sampling_type": "tis", "truncated_importance_sampling_ratio": 2.0}, False),
        ({**IS, "is_correction_level": "sequence_mean"}, True),
        ({"sequence_level_importance_ratios": True, "token_level_loss": False}, True),
        (
            {
                **IS,
                "truncated_importance_sampling_type": "seq-mask-tis",
                "truncated_importance_sampling_ratio_min": 0.999,
                "truncated_importance_sampling_ratio": 1.001,
            },
            True,
        ),
        ({"rejection_sampling": [TOKEN_BAND]}, True),
        ({"token_level_loss": False}, True),
        ({"positive_example_nll_weight": 0.1}, True),
        (
            {
                **IS,
                "truncated_importance_sampling_type": "icepop",
                "truncated_importance_sampling_ratio_min": 0.5,
                "truncated_importance_sampling_ratio": 2.0,
                "rejection_denominator": "kept",
            },
            True,
        ),
    ],
)
def test_only_a_configuration_that_reads_a_sequence_needs_sequence_statistics(fields, needed):
    assert needs_sequence_statistics(_cfg(**fields)) is needed


def test_without_sequence_statistics_nothing_per_sequence_is_planned_and_the_valid_finite_tokens_reach_the_loss():
    d = torch.tensor([[0.1, -0.2, 0.0], [0.3, 0.0, 0.5]], dtype=F64)
    inputs_finite = torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 1.0]], dtype=F64)
    masks = _masks([[1, 1, 0], [1, 1, 1]], inputs_finite=inputs_finite)
    cfg = _cfg(**IS)
    plan = plan_correction(cfg, d, masks)
    assert plan.statistics is None and plan.alive is None and plan.reduce() is None
    out = _run(cfg, d, masks)
    assert out.sequences is None and out.ratio is None
    torch.testing.assert_close(out.keep, inputs_finite, rtol=0, atol=0)
    torch.testing.assert_close(out.loss_tokens, masks.valid * inputs_finite, rtol=0, atol=0)
    torch.testing.assert_close(out.is_weight, d.exp(), rtol=0, atol=0)


def test_the_plan_holds_each_sequences_masked_sums():
    prev = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -math.inf, -3.0]], dtype=F64)
    gen = torch.tensor([[-1.5, -1.5, -9.0], [-0.5, -1.0, -2.0]], dtype=F64)
    d, d_finite = log_ratio(prev, gen)  # row 1's second token is not finite (d = 0 there)
    masks = _masks([[1, 1, 0], [1, 1, 1]], sample_mask=[1.0, 0.5], d_finite=d_finite)
    stats = plan_correction(_cfg(**IS, is_correction_level="sequence_mean"), d, masks).statistics
    assert stats.d_sum.tolist() == pytest.approx([0.5 - 0.5, 0.5 * (-0.5 + 0.0 - 1.0)])  # sum_t m d, m = valid
    assert stats.valid.tolist() == [2.0, 1.5]  # n = sum_t m, the sample mask included
    assert stats.token_mask.tolist() == [2.0, 3.0]  # the token_mask alone
    assert stats.nonfinite.tolist() == [0.0, 1.0]
    assert stats.kept.tolist() == [2.0, 1.5]  # no token filter: every valid token
    assert stats.stages == () and stats.kept_negative is None and stats.ratio_tokens is None


# Row 0: geometric mean far above the band (dropped by the sequence filter) and one token above 2;
# row 1: geometric mean inside the band (log(2.5) / 5 < log 1.25), its last token above 2.
STAGE_D = torch.tensor([[0.4, 0.4, 0.4, 0.4, log(3.0)], [0.0, 0.0, 0.0, 0.0, log(2.5)]], dtype=F64)


def test_a_token_filter_after_a_sequence_filter_sees_only_the_rows_that_survived_it():
    masks = _masks(torch.ones(2, 5))
    out = _run(_cfg(rejection_sampling=[GEO_MEAN, {**TOKEN_BAND, "name": "band"}]), STAGE_D, masks)
    metrics = out.metrics.finalize()
    assert out.keep.tolist() == [[0.0] * 5, [1.0, 1.0, 1.0, 1.0, 0.0]]
    assert metrics["rs/band/token_rejected_frac"] == pytest.approx(1 / (10 + EPS))  # row 1's token only
    assert metrics["rs_token_rejected_frac"] == pytest.approx(6 / (10 + EPS))
    # listed first, the token filter also counts row 0's outlier (the row is dropped after it)
    metrics = _run(
        _cfg(rejection_sampling=[{**TOKEN_BAND, "name": "band"}, GEO_MEAN]), STAGE_D, masks
    ).metrics.finalize()
    assert metrics["rs/band/token_rejected_frac"] == pytest.approx(2 / (10 + EPS))


def test_keep_is_the_token_decisions_times_the_sequence_decisions_times_the_finite_inputs():
    inputs_finite = torch.ones(2, 5, dtype=F64)
    inputs_finite[1, 1] = 0.0  # e.g. curr was not finite there
    masks = _masks(torch.ones(2, 5), inputs_finite=inputs_finite)
    cfg = _cfg(rejection_sampling=[TOKEN_BAND, GEO_MEAN])
    plan = plan_correction(cfg, STAGE_D, masks)
    assert plan.alive.tolist() == [[1.0, 1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0, 0.0]]
    out = apply_correction(cfg, plan, plan.reduce(), MetricSet(declared_specs(cfg)))
    sequence_kept = torch.tensor([[0.0], [1.0]], dtype=F64)  # row 0's kept tokens still average 0.4 > log 1.25
    torch.testing.assert_close(out.keep, plan.alive * sequence_kept * inputs_finite, rtol=0, atol=0)
    torch.testing.assert_close(out.loss_tokens, masks.valid * out.keep, rtol=0, atol=0)


def test_a_row_an_advantage_conditioned_filter_rejects_loses_only_its_negative_advantage_tokens():
    d = torch.tensor([[0.4, 0.4, 0.4], [0.4, 0.4, 0.4], [0.0, 0.0, 0.0]], dtype=F64)  # rows 0, 1 outside
    advantages = torch.tensor([[-1.0, 2.0, -1.0], [1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]], dtype=F64)
    cfg = _cfg(rejection_sampling=[{**GEO_MEAN, "advantage_sign": "negative"}])
    with pytest.raises(ValueError, match="advantages"):
        plan_correction(cfg, d, _masks(torch.ones(3, 3)))
    out = _run(cfg, d, _masks(torch.ones(3, 3)), advantages=advantages)
    assert out.keep.tolist() == [[0.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0]]


def test_the_weight_is_the_levels_weight_truncated_then_divided_by_its_mean_over_sequences_with_a_token():
    d = torch.tensor([[0.2, 0.4], [0.0, -0.2], [3.0, 3.0]], dtype=F64)
    masks = _masks([[1, 1], [1, 1], [0, 0]])  # row 2 has no valid token: not a unit of the mean
    cfg = _cfg(
        **IS,
        is_correction_level="sequence_mean",
        truncated_importance_sampling_type="tis",
        truncated_importance_sampling_ratio=1.2,
        is_batch_normalization="microbatch",
    )
    out = _run(cfg, d, masks)
    truncated = [min(math.exp(0.6 / (2 + EPS)), 1.2), math.exp(-0.2 / (2 + EPS)), min(math.exp(0.0), 1.2)]
    mean = (truncated[0] + truncated[1]) / 2
    assert out.batch_norm_factor.item() == pytest.approx(mean)
    torch.testing.assert_close(out.is_weight, torch.tensor(truncated, dtype=F64).unsqueeze(-1) / mean)


def test_compute_correction_is_the_plan_its_reduction_and_apply_chained():
    masks = _masks(torch.ones(2, 5))
    cfg = _cfg(**IS, is_correction_level="sequence", rejection_sampling=[TOKEN_BAND, GEO_MEAN])
    whole = _run(cfg, STAGE_D, masks)
    plan = plan_correction(cfg, STAGE_D, masks)
    counts = GlobalCounts(tokens=masks.valid.sum(), sequences=masks.sample_mask.sum())
    steps = apply_correction(cfg, plan, plan.reduce(), MetricSet(declared_specs(cfg), counts=counts))
    for name in ("is_weight", "keep", "loss_tokens"):
        torch.testing.assert_close(getattr(whole, name), getattr(steps, name), rtol=0, atol=0, msg=name)
    assert whole.metrics.finalize() == steps.metrics.finalize()
