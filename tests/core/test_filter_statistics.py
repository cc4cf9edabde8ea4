"""Guards ``core/registries/filter_statistics.py``: each statistic's per-token value is its stated formula.

The registry holds, per statistic, the formula the docs print (``formula``), the function the
loss evaluates (``token_value``), the range a token's value lies in and whether it reaches its
ends. Here each function is compared with the formula written out independently (float64, from
the two log-probs), and with the range, on log-ratios from nearly equal to far apart; a
statistic added to the registry without a formula here fails the first test.
"""

import math

import pytest
import torch

from nemo_rs_plugin.core.registries.aggregations import SEQUENCE_AGGREGATIONS
from nemo_rs_plugin.core.registries.filter_statistics import (
    ARITHMETIC_AGGREGATIONS,
    FILTER_STATISTICS,
    PROBABILITY_CLAMP,
    filter_statistic_entry,
)


def _clamp(p):
    return p.clamp(PROBABILITY_CLAMP, 1.0 - PROBABILITY_CLAMP)


#: Each statistic from the target's and the behaviour's log-probs ``a``, ``b`` (``d = a - b``), by
#: its docs formula. ``ratio`` is compared as its log: the loss compares bounds in log space.
BY_FORMULA = {
    "ratio": lambda a, b: a - b,
    "kl_k1": lambda a, b: -(a - b),
    "kl_k2": lambda a, b: (a - b) ** 2 / 2,
    "kl_k3": lambda a, b: torch.exp(a - b) - 1 - (a - b),
    "mult_prob_error": lambda a, b: torch.exp((a - b).abs()),
    "chi2": lambda a, b: (torch.exp(a - b) - 1) ** 2,
    "binary_kl": lambda a, b: (
        _clamp(b.exp()) * (_clamp(b.exp()) / _clamp(a.exp())).log()
        + (1 - _clamp(b.exp())) * ((1 - _clamp(b.exp())) / (1 - _clamp(a.exp()))).log()
    ),
    "total_variation": lambda a, b: (_clamp(b.exp()) - _clamp(a.exp())).abs(),
    "prob_diff": lambda a, b: a.exp() - b.exp(),
}


def _log_probs():
    gen = torch.Generator().manual_seed(0)
    b = -torch.rand(4000, generator=gen, dtype=torch.float64) * 6  # probabilities from 1 down to e^-6
    d = torch.randn(4000, generator=gen, dtype=torch.float64) * torch.tensor([0.01, 0.3, 2.0]).repeat(1334)[:4000]
    a = (b + d).clamp(max=0.0)  # a log-prob is at most 0
    return a, b


def test_every_statistic_has_its_formula_here_and_nothing_else_does():
    assert set(BY_FORMULA) == set(FILTER_STATISTICS)


@pytest.mark.parametrize("name", list(FILTER_STATISTICS))
def test_the_per_token_value_is_the_docs_formula_and_stays_in_its_range(name):
    entry = FILTER_STATISTICS[name]
    a, b = _log_probs()
    got = entry.token_value(a - b, a, b)
    torch.testing.assert_close(got, BY_FORMULA[name](a, b), rtol=1e-9, atol=1e-12)
    value = got.exp() if entry.log_space else got  # the range is the ratio's, not its log's
    low, high = entry.value_range
    assert bool((value >= low).all()) and bool((value <= high).all()), (name, value.min(), value.max())
    if not entry.reaches[1] and math.isfinite(high):
        assert bool((value < high).all())


def test_what_reads_probabilities_says_so_and_refuses_without_them():
    d = torch.zeros(3)
    for entry in FILTER_STATISTICS.values():
        if entry.needs_probabilities:
            with pytest.raises(ValueError, match="needs the target and behaviour log-probs"):
                entry.token_value(d, None, None)
        else:
            entry.token_value(d, None, None)  # d alone is enough


def test_aggregations_ratios_in_log_space_the_rest_arithmetically():
    for entry in FILTER_STATISTICS.values():
        assert set(entry.aggregations) <= set(SEQUENCE_AGGREGATIONS)
        expected = tuple(SEQUENCE_AGGREGATIONS) if entry.log_space else ARITHMETIC_AGGREGATIONS
        assert entry.aggregations == expected, entry.name
    assert [e.name for e in FILTER_STATISTICS.values() if e.log_space] == ["ratio"]


def test_an_unknown_statistic_is_an_error_naming_the_allowed_ones():
    with pytest.raises(ValueError, match="statistic: got 'kl'; allowed: ratio, kl_k1"):
        filter_statistic_entry("kl")
