"""Guards ``core/registries/aggregations.py``: a sequence filter's aggregations stated once, read by all.

The registry's keys are the filter's ``FilterAgg``; each entry's stage statistic, reduced over
ranks that each hold part of a sequence's tokens (SUM, or MAX where the field says so), and
finalised, equals a formula written out here on the whole sequence; its flags are what the
statistics allow, what the checks read and what its value does; and no module compares an
aggregation's name outside the registry.
"""

import ast
import dataclasses
import typing
from pathlib import Path

import pytest
import torch

from nemo_rs_plugin.core.registries.aggregations import (
    DEFAULT_AGGREGATION,
    REDUCED_BY_MAX,
    SEQUENCE_AGGREGATIONS,
    StageInputs,
    sequence_aggregation,
)
from nemo_rs_plugin.core.registries.filter_statistics import FILTER_STATISTICS
from nemo_rs_plugin.core.settings.config import RejectionFilter
from nemo_rs_plugin.core.settings.rejection_filter import NEMO_RL_UNDIVIDED_MARKERS, FilterAgg

REPO = Path(__file__).resolve().parents[2]
BIG = torch.finfo(torch.float64).max
# Two sequences of 6 token statistics; the second has a token outside the stage (alive 0) and
# one whose log-ratio was not finite (finite 0): neither enters any aggregate.
STAT = torch.tensor([[0.3, 0.2, 0.5, 0.1, -0.4, 0.2], [1.5, 0.7, -0.9, 9.0, 0.2, -5.0]], dtype=torch.float64)
ALIVE = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 1, 1]], dtype=torch.float64)
FINITE = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0]], dtype=torch.float64)


def _reference(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Each aggregation on the whole rows, from the finite tokens alive at the stage."""
    rows = [STAT[b][(ALIVE[b] * FINITE[b]) > 0] for b in range(STAT.shape[0])]
    if name == "mean":  # over the tokens alive at the stage (a non-finite one rejects its row anyway)
        v = torch.stack([r.sum() / ALIVE[b].sum() for b, r in enumerate(rows)])
    elif name == "sum":
        v = torch.stack([r.sum() for r in rows])
    elif name == "max":
        v = torch.stack([r.max() for r in rows])
    elif name == "min":
        v = torch.stack([r.min() for r in rows])
    elif name == "any":  # the row's minimum against lower, its maximum against upper
        return torch.stack([r.min() for r in rows]), torch.stack([r.max() for r in rows])
    else:
        raise AssertionError(f"no reference formula for {name!r}: add one with the entry")
    return v, v


def _inputs(columns: slice) -> StageInputs:
    alive, finite, stat = ALIVE[:, columns], (ALIVE * FINITE)[:, columns], STAT[:, columns]
    return StageInputs(
        masked=stat * finite,
        finite=finite,
        count=alive.sum(-1),
        nonfinite=(alive - finite).sum(-1),
        negative=None,
        big=BIG,
    )


def _reduce(parts: list) -> object:
    """The stage over the ranks, as ``SequenceStatistics.reduce`` does: MAX where marked, else SUM."""
    values = {}
    for f in dataclasses.fields(parts[0]):
        rows = [getattr(p, f.name) for p in parts]
        if rows[0] is None:
            values[f.name] = None
        elif f.metadata == REDUCED_BY_MAX:
            values[f.name] = torch.stack(rows).amax(0)
        else:
            values[f.name] = torch.stack(rows).sum(0)
    return type(parts[0])(**values)


def test_the_registry_names_exactly_the_filters_aggregations():
    assert tuple(SEQUENCE_AGGREGATIONS) == typing.get_args(FilterAgg)
    assert DEFAULT_AGGREGATION in SEQUENCE_AGGREGATIONS
    assert RejectionFilter(level="sequence", upper=2.0).aggregation == DEFAULT_AGGREGATION


@pytest.mark.parametrize("ranks", [1, 2, 3])
@pytest.mark.parametrize("name", list(SEQUENCE_AGGREGATIONS))
def test_each_aggregation_over_sharded_tokens_equals_its_reference_formula(name, ranks):
    entry = SEQUENCE_AGGREGATIONS[name]
    bounds = torch.linspace(0, STAT.shape[1], ranks + 1).round().long().tolist()
    parts = [entry.partial(_inputs(slice(a, b))) for a, b in zip(bounds, bounds[1:])]
    assert all(type(p) is entry.stage for p in parts)
    low, high = entry.finalize(_reduce(parts))
    expected_low, expected_high = _reference(name)
    torch.testing.assert_close(low, expected_low)
    torch.testing.assert_close(high, expected_high)
    assert (low is not high) == entry.two_sided


@pytest.mark.parametrize("name", list(SEQUENCE_AGGREGATIONS))
def test_each_entrys_flags_are_what_its_value_and_the_checks_do(name):
    entry = SEQUENCE_AGGREGATIONS[name]
    # arithmetic: allowed for every statistic; else only for the log-space ratio
    for statistic in FILTER_STATISTICS.values():
        assert (name in statistic.aggregations) == (entry.arithmetic or statistic.log_space), (name, statistic.name)
    low, high = entry.finalize(entry.partial(_inputs(slice(None))))
    tokens = [STAT[b][(ALIVE[b] * FINITE[b]) > 0] for b in range(2)]
    inside = all(r.min() <= v <= r.max() for r, v in zip(tokens, low)) and all(
        r.min() <= v <= r.max() for r, v in zip(tokens, high)
    )
    assert inside == entry.keeps_token_range, name
    # sums_tokens: a shift of every token's statistic moves the value by a multiple of the shift
    # that grows with the tokens (the mean by the shift, the sum by n times it); the extremes
    # move by the shift too, so the flag is the stage: a total of the tokens
    shifted = StageInputs(**{**_inputs(slice(None)).__dict__, "masked": (STAT + 1.0) * ALIVE * FINITE})
    moved = entry.finalize(entry.partial(shifted))[0] - low
    assert entry.sums_tokens == (entry.stage.__name__ == "TotalStageStatistics"), name
    if entry.sums_tokens:  # row 0: every token finite
        assert moved[0] >= 1.0 - 1e-6, name
    # the label a default filter name uses: never one NeMo-RL's workers take for an extreme
    assert not any(marker.strip("_") == entry.label for marker in NEMO_RL_UNDIVIDED_MARKERS), name
    if FILTER_STATISTICS["ratio"].aggregations.count(name):
        label = RejectionFilter(level="sequence", agg=name, lower=0.5, upper=2.0).label
        assert label == f"sequence_ratio_{entry.label}"


def test_an_unknown_aggregation_is_an_error_naming_the_allowed_ones():
    with pytest.raises(ValueError, match="agg 'median'; allowed: 'mean', 'sum', 'max', 'min', 'any'"):
        sequence_aggregation("median")


def test_no_module_compares_an_aggregations_name_outside_the_registry():
    """``f.aggregation == "sum"`` or ``agg in ("max", "any")`` anywhere is a second statement of
    what an aggregation does; read the entry's flags (``f.aggregation_entry``) instead."""
    found = []
    for path in sorted((REPO / "nemo_rs_plugin").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Compare):
                continue
            operands = [node.left, *node.comparators]
            names = {n.attr if isinstance(n, ast.Attribute) else getattr(n, "id", None) for n in operands}
            constants = [c.value for o in operands for c in ast.walk(o) if isinstance(c, ast.Constant)]
            if names & {"agg", "aggregation"} and set(constants) & set(SEQUENCE_AGGREGATIONS):
                found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not found, found
