"""Guards ``core/correction/filters.py`` on its own: the filters' bounds, token decisions and sequence decisions.

Each test calls the module's functions on a few hand-built log-ratios and compares them with the
rule its docstrings state: a ratio's bounds live in log space, a unit is kept iff
``lower <= statistic <= upper`` (inclusive; a non-finite log-ratio is outside), a sign-conditioned
filter only rejects tokens of its sign, a sequence filter aggregates over the tokens the token
filters before it kept and never rejects a row with no such token, and ``apply_filters`` counts
what it dropped for the run-time warning (``Diagnostics.dropped_sequences``, ``valid_sequences``).
"""

import math

import pytest
import torch

from nemo_rs_plugin.core.correction.filters import (
    PolicyLogProbs,
    apply_filters,
    filter_log_ratio,
    plan_filters,
    plan_token_filter,
    sequence_filter_statistic,
    token_filter_statistic,
)
from nemo_rs_plugin.core.correction.statistics import SequenceStatistics
from nemo_rs_plugin.core.masking import TokenMasks, row_dot
from nemo_rs_plugin.core.registries.filter_options import LOG_RATIOS
from nemo_rs_plugin.core.reporting.metric_catalog import declared_specs
from nemo_rs_plugin.core.reporting.metrics import GlobalCounts, MetricSet
from nemo_rs_plugin.core.settings.config import RejectionFilter, RSClippedPGLossConfig

F64 = torch.float64
log = math.log
TOKEN_BAND = RejectionFilter(level="token", lower=0.5, upper=2.0)
GEO_MEAN = RejectionFilter(level="sequence", lower=0.8, upper=1.25)  # agg: mean, Geo-RS


def _masks(valid: torch.Tensor, d_finite=None) -> TokenMasks:
    d_finite = torch.ones_like(valid) if d_finite is None else d_finite
    return TokenMasks.build(valid, torch.ones(valid.shape[0], dtype=F64), d_finite, d_finite)


def _decide(filters, d, valid, d_finite=None):
    """Plan the filters, build the (unsharded, so already reduced) statistics, decide: ``(outcome, metrics)``."""
    masks = _masks(valid, d_finite)
    stages, alive, _ = plan_filters(filters, d, masks, None, None)
    stats = SequenceStatistics(
        d_sum=row_dot(d, masks.valid),
        valid=masks.valid.sum(-1),
        token_mask=valid.sum(-1),
        nonfinite=masks.nonfinite_d_per_sequence(),
        kept=row_dot(alive, masks.valid),
        stages=stages,
    )
    counts = GlobalCounts(tokens=valid.sum(), sequences=torch.tensor(float(valid.shape[0]), dtype=F64))
    metrics = MetricSet(declared_specs(RSClippedPGLossConfig(rejection_sampling=list(filters))), counts=counts)
    return apply_filters(filters, stats, masks.sample_mask, metrics), metrics


def test_ratio_bounds_are_logs_and_a_zero_lower_bound_is_minus_infinity():
    assert TOKEN_BAND.bounds == (log(0.5), log(2.0))
    assert RejectionFilter(level="token", lower=0.0, upper=3.0).bounds == (-math.inf, log(3.0))
    assert RejectionFilter(level="token", statistic="kl_k3", upper=0.5).bounds == (None, 0.5)  # not a ratio


def test_a_token_ratio_filter_keeps_tokens_on_its_bounds_and_rejects_those_beyond():
    d = torch.tensor([[log(0.5), log(2.0), 0.0, log(0.49), log(2.01)], [log(3.0), 0.0, 0.0, 0.0, log(0.1)]], dtype=F64)
    alive = torch.tensor([[1.0, 1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0, 0.0]], dtype=F64)  # last: not valid
    stat = token_filter_statistic(d, "ratio")
    assert stat is d  # compared in log space: d itself
    stage, kept = plan_token_filter(TOKEN_BAND, stat, torch.ones_like(d), alive, None)
    assert kept.tolist() == [[1.0, 1.0, 1.0, 0.0, 0.0], [0.0, 1.0, 1.0, 1.0, 0.0]]
    assert stage.rejected.tolist() == [2.0, 1.0] and stage.rejected_negative is None


def test_a_token_whose_log_ratio_was_not_finite_is_rejected_though_its_statistic_is_in_band():
    d = torch.zeros(1, 3, dtype=F64)  # non-finite entries arrive as 0
    f_finite = torch.tensor([[1.0, 0.0, 1.0]], dtype=F64)
    _, kept = plan_token_filter(TOKEN_BAND, d, f_finite, torch.ones_like(d), None)
    assert kept.tolist() == [[1.0, 0.0, 1.0]]


def test_a_sign_conditioned_token_filter_rejects_only_tokens_with_that_advantage_sign():
    d = torch.tensor([[log(5.0), log(5.0), log(5.0), 0.0]], dtype=F64)  # three tokens out of band
    negative = torch.tensor([[1.0, 0.0, 0.0, 1.0]], dtype=F64)  # A < 0, A > 0, A = 0, A < 0 in band
    positive = torch.tensor([[0.0, 1.0, 0.0, 0.0]], dtype=F64)
    alive = torch.ones_like(d)
    f = RejectionFilter(level="token", lower=0.5, upper=2.0, advantage_sign="negative")
    stage, kept = plan_token_filter(f, d, alive, alive, negative, positive)
    assert kept.tolist() == [[0.0, 1.0, 1.0, 1.0]]
    assert stage.rejected.tolist() == [1.0] and stage.rejected_negative.tolist() == [1.0]
    f = RejectionFilter(level="token", lower=0.5, upper=2.0, advantage_sign="positive")
    _, kept = plan_token_filter(f, d, alive, alive, negative, positive)
    assert kept.tolist() == [[1.0, 0.0, 1.0, 1.0]]  # A = 0 is neither sign: never rejected


def test_filter_log_ratio_reads_the_two_policies_its_log_ratio_names():
    d, d_finite = torch.tensor([[0.1, 0.2]], dtype=F64), torch.ones(1, 2, dtype=F64)
    curr = torch.tensor([[-1.0, -math.inf]], dtype=F64)
    prev = torch.tensor([[-1.5, -0.5]], dtype=F64)
    gen = torch.tensor([[-1.25, -2.0]], dtype=F64)
    log_probs = PolicyLogProbs(curr=curr, prev=prev, gen=gen)
    fd, fd_finite, target, behaviour = filter_log_ratio(LOG_RATIOS["curr-gen"], d, d_finite, log_probs, False)
    assert fd.tolist() == [[0.25, 0.0]] and fd_finite.tolist() == [[1.0, 0.0]]  # -inf - (-2): not finite
    assert target.tolist() == [[-1.0, 0.0]] and behaviour.tolist() == gen.tolist()  # sanitised log-probs
    same = filter_log_ratio(LOG_RATIOS["prev-gen"], d, d_finite, None, False)
    assert same[0] is d and same[1] is d_finite and same[2:] == (None, None)  # the loss's own d
    with pytest.raises(ValueError, match="log-probs"):
        filter_log_ratio(LOG_RATIOS["gen-prev"], d, d_finite, None, False)


def test_a_sequence_mean_ratio_filter_keeps_the_rows_whose_geometric_mean_is_in_band():
    # mean log-ratios 0.1 (inside [log 0.8, log 1.25]), 0.3 (above), -0.3 (below); row 2 has a masked token
    d = torch.tensor([[0.0, 0.1, 0.2], [0.3, 0.3, 0.3], [-0.3, -0.3, 5.0]], dtype=F64)
    valid = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=F64)
    outcome, _ = _decide((GEO_MEAN,), d, valid)
    assert outcome.sequence_kept.tolist() == [1.0, 0.0, 0.0]
    assert outcome.kept_tokens.tolist() == [3.0, 0.0, 0.0]


def test_a_row_with_a_nonfinite_log_ratio_is_rejected_and_a_row_with_no_token_is_not():
    d = torch.zeros(3, 2, dtype=F64)  # every mean is 0: ratio 1, outside [1.1, 2]
    valid = torch.tensor([[1.0, 1.0], [1.0, 1.0], [0.0, 0.0]], dtype=F64)
    d_finite = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0]], dtype=F64)
    inside = RejectionFilter(level="sequence", lower=0.5, upper=2.0)
    assert _decide((inside,), d, valid, d_finite)[0].sequence_kept.tolist() == [1.0, 0.0, 1.0]
    above = RejectionFilter(level="sequence", lower=1.1, upper=2.0)
    assert _decide((above,), d, valid, d_finite)[0].sequence_kept.tolist() == [0.0, 0.0, 1.0]


def test_a_sequence_filter_aggregates_only_the_tokens_the_token_filters_before_it_kept():
    # one outlier token (ratio 3): with it the row's mean log-ratio is log(3)/3 > log(1.25); without it, 0
    d = torch.tensor([[0.0, 0.0, log(3.0)]], dtype=F64)
    valid = torch.ones(1, 3, dtype=F64)
    outcome, _ = _decide((TOKEN_BAND, GEO_MEAN), d, valid)
    assert outcome.sequence_kept.tolist() == [1.0] and outcome.kept_tokens.tolist() == [2.0]
    outcome, _ = _decide((GEO_MEAN, TOKEN_BAND), d, valid)
    assert outcome.sequence_kept.tolist() == [0.0] and outcome.kept_tokens.tolist() == [0.0]


def test_the_any_aggregation_compares_the_rows_smallest_with_lower_and_largest_with_upper():
    d = torch.tensor([[0.0, log(0.4), 0.1], [log(2.5), 0.0, 0.1], [log(0.5), log(2.0), 0.0]], dtype=F64)
    valid = torch.ones(3, 3, dtype=F64)
    veto = RejectionFilter(level="sequence", agg="any", lower=0.5, upper=2.0)
    masks = _masks(valid)
    (stage,), _, _ = plan_filters((veto,), d, masks, None, None)
    low, high = sequence_filter_statistic(veto, stage)
    assert low.tolist() == pytest.approx([log(0.4), 0.0, log(0.5)])
    assert high.tolist() == pytest.approx([0.1, log(2.5), log(2.0)])
    # row 2's tokens sit on the bounds: kept
    assert _decide((veto,), d, valid)[0].sequence_kept.tolist() == [0.0, 0.0, 1.0]


def test_apply_filters_counts_the_dropped_and_valid_sequences_for_the_run_time_warning():
    d = torch.tensor([[0.3, 0.3], [0.0, 0.0], [0.0, 0.0]], dtype=F64)
    valid = torch.tensor([[1.0, 1.0], [1.0, 1.0], [0.0, 0.0]], dtype=F64)
    _, metrics = _decide((GEO_MEAN,), d, valid)
    out = metrics.finalize()
    found = metrics.diagnostics
    assert (found.dropped_sequences, found.valid_sequences) == (1.0, 2.0)  # row 0 dropped of the two with a valid token
    assert out["rs_seq_rejected_frac"] == pytest.approx(1.0 / 3.0)  # over NeMo-RL's global sequences
    assert out["rs_token_rejected_frac"] == pytest.approx(2.0 / 4.0)
