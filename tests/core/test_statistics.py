"""Guards ``core/correction/statistics.py`` on its own: the one reduction of the statistics, batch normalisation.

``SequenceStatistics.reduce`` must pass every row through one call of the collective (SUM rows
summed, MAX rows maxed, each put back in its own field) and, with no groups, none at all;
``batch_normalize_weights`` divides by ``sum_u m_u w_u / sum_u m_u`` over the level's units,
leaves the weights alone at or below ``BATCH_MEAN_FLOOR``, and reduces its two totals over
the groups its level and scope name. The collectives are replaced by stand-ins that play a
second rank (the real ones are ``tests/parallel``'s).
"""

import pytest
import torch

from nemo_rs_plugin.core.correction import statistics
from nemo_rs_plugin.core.correction.statistics import (
    BATCH_MEAN_FLOOR,
    MaximumStageStatistics,
    RangeStageStatistics,
    SequenceStatistics,
    TokenStageStatistics,
    TotalStageStatistics,
    batch_normalize_weights,
)
from nemo_rs_plugin.core.distributed import NO_GROUPS, SequenceGroups

F64 = torch.float64
GROUPS = SequenceGroups(groups=("context-parallel group",))  # active; the stand-in collective never reads it


def _rows(*values, grad=False):
    return torch.tensor(values, dtype=F64, requires_grad=grad)


def _rank_statistics(offset: float, grad=False) -> SequenceStatistics:
    """One rank's partial rows, ``[B = 2]`` each, every row distinct (so a row put back in the wrong field shows)."""

    def r(a, b):
        return _rows(a + offset, b + offset, grad=grad)

    return SequenceStatistics(
        d_sum=r(0.5, -0.25),
        valid=r(3.0, 2.0),
        token_mask=r(4.0, 2.5),
        nonfinite=r(0.0, 1.0),
        kept=r(2.0, 1.5),
        stages=(
            TokenStageStatistics(rejected=r(1.0, 0.5), rejected_negative=r(0.25, 0.125)),
            RangeStageStatistics(
                count=r(2.0, 1.0),
                nonfinite=r(0.0, 0.0),
                negative=None,
                maximum=r(0.7, -0.3),
                negated_minimum=r(0.1, 0.9),
            ),
            MaximumStageStatistics(count=r(1.0, 1.0), nonfinite=r(1.0, 0.0), negative=None, maximum=r(-0.6, 0.8)),
        ),
        kept_negative=r(1.0, 0.0),
        ratio_tokens=None,
    )


def _tensor_rows(part) -> dict:
    return {k: v for k, v in vars(part).items() if isinstance(v, torch.Tensor)}


def test_reduce_without_groups_issues_no_collective_and_returns_the_rows_detached(monkeypatch):
    def no_collective(*_):
        raise AssertionError("no collective without groups")

    monkeypatch.setattr(statistics, "reduce_sequence_statistics", no_collective)
    local = _rank_statistics(0.0, grad=True)
    reduced = local.reduce(NO_GROUPS)
    for before, after in zip((*local.stages, local), (*reduced.stages, reduced)):
        assert type(after) is type(before)
        assert _tensor_rows(after).keys() == _tensor_rows(before).keys()  # None fields stay None
        for name, row in _tensor_rows(after).items():
            assert not row.requires_grad, name
            assert row.tolist() == getattr(before, name).tolist(), name


def test_reduce_over_groups_sums_sum_rows_and_maxes_max_rows_in_one_call(monkeypatch):
    calls = []

    def capture(sums, maxima, groups):
        calls.append((sums, maxima, groups))
        return sums, maxima

    monkeypatch.setattr(statistics, "reduce_sequence_statistics", capture)
    other = _rank_statistics(10.0)
    other.reduce(GROUPS)  # the other rank's stacked rows, in the order the call stacks them
    (other_sums, other_maxima, _), calls[:] = calls[0], []

    def second_rank(sums, maxima, groups):  # SUM and MAX with the other rank
        calls.append(groups)
        return sums + other_sums, torch.maximum(maxima, other_maxima)

    monkeypatch.setattr(statistics, "reduce_sequence_statistics", second_rank)
    mine = _rank_statistics(0.0)
    reduced = mine.reduce(GROUPS)
    assert calls == [GROUPS]
    max_rows = {"maximum", "negated_minimum"}
    for a, b, out in zip((*mine.stages, mine), (*other.stages, other), (*reduced.stages, reduced)):
        for name, row in _tensor_rows(out).items():
            x, y = getattr(a, name), getattr(b, name)
            expected = torch.maximum(x, y) if name in max_rows else x + y
            assert row.tolist() == expected.tolist(), f"{type(out).__name__}.{name}"
    assert reduced.ratio_tokens is None and reduced.stages[1].negative is None


def test_statistics_without_a_max_row_pass_an_empty_max_block(monkeypatch):
    seen = []

    def capture(sums, maxima, groups):
        seen.append((tuple(sums.shape), tuple(maxima.shape)))
        return sums, maxima

    monkeypatch.setattr(statistics, "reduce_sequence_statistics", capture)
    r = _rows(1.0, 2.0)
    stage = TotalStageStatistics(count=r, nonfinite=r, negative=None, total=r)
    SequenceStatistics(d_sum=r, valid=r, token_mask=r, nonfinite=r, kept=r, stages=(stage,)).reduce(GROUPS)
    assert seen == [((8, 2), (0, 2))]  # 5 own rows and the stage's 3 summed; nothing maxed


def test_token_level_batch_normalisation_divides_by_the_mean_over_valid_tokens():
    weight = _rows([0.5, 2.0, 9.0], [1.0, 1.5, 4.0])
    units = _rows([1.0, 1.0, 0.0], [1.0, 1.0, 1.0])
    normalised, factor = batch_normalize_weights(weight, units, "token", "microbatch")
    mean = (0.5 + 2.0 + 1.0 + 1.5 + 4.0) / 5
    assert factor.item() == pytest.approx(mean)
    torch.testing.assert_close(normalised, weight / mean)


@pytest.mark.parametrize("level", ["sequence", "sequence_mean"])
def test_sequence_level_batch_normalisation_averages_over_sequences_with_a_valid_token(level):
    weight = _rows([0.5], [2.5], [100.0])  # [B, 1]
    units = _rows(1.0, 1.0, 0.0)  # the last sequence has no valid token
    normalised, factor = batch_normalize_weights(weight, units, level, "microbatch")
    assert factor.item() == pytest.approx(1.5)
    torch.testing.assert_close(normalised, weight / 1.5)


def test_a_batch_mean_at_or_below_the_floor_leaves_the_weights_unnormalised():
    units = _rows([1.0, 1.0])
    for w in (BATCH_MEAN_FLOOR, 0.0):
        weight = _rows([w, w])
        normalised, factor = batch_normalize_weights(weight, units, "token", "microbatch")
        assert factor.item() == 1.0 and normalised.tolist() == weight.tolist()
    _, factor = batch_normalize_weights(
        _rows([2 * BATCH_MEAN_FLOOR, 2 * BATCH_MEAN_FLOOR]), units, "token", "microbatch"
    )
    assert factor.item() == pytest.approx(2 * BATCH_MEAN_FLOOR)


@pytest.mark.parametrize(
    ("level", "scope", "tokens_split", "across_data_parallel"),
    [
        ("token", "microbatch", True, False),
        ("token", "data_parallel", True, True),
        ("sequence_mean", "microbatch", False, False),
        ("sequence", "data_parallel", False, True),
    ],
)
def test_the_two_batch_totals_are_reduced_over_the_groups_the_level_and_scope_name(
    monkeypatch, level, scope, tokens_split, across_data_parallel
):
    seen = []

    def other_ranks(totals, groups, *, tokens_split, across_data_parallel):
        seen.append((totals.tolist(), groups, tokens_split, across_data_parallel))
        return totals + torch.tensor([7.0, 3.0], dtype=F64)  # the other ranks' weight sum and units

    monkeypatch.setattr(statistics, "reduce_batch_totals", other_ranks)
    weight, units = (
        (_rows([1.0, 2.0]), _rows([1.0, 1.0])) if level == "token" else (_rows([1.0], [2.0]), _rows(1.0, 1.0))
    )
    _, factor = batch_normalize_weights(weight, units, level, scope, GROUPS)
    assert seen == [([3.0, 2.0], GROUPS, tokens_split, across_data_parallel)]
    assert factor.item() == pytest.approx(10.0 / 5.0)  # the mean of the reduced totals
