"""Guards the lab's statistics (lab/stats.py): SciPy's and statsmodels' tests as the lab calls them.

Each wrapper against a case computed by hand (so a wrong argument to the library, a one-sided
test or another level, fails), and the paired interval against its claim: simulated coverage
at the lab's seed counts. The percentile bootstrap the lab used before fails that check, so
the check can fail.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

pytest.importorskip("scipy")
pytest.importorskip("statsmodels")

from nemo_rs_plugin.lab.stats import (  # noqa: E402
    MIN_SEEDS,
    fisher_exact,
    format_p,
    holm,
    mcnemar_exact,
    needs_seeds,
    permutation_p,
    power_of,
    seeds_for_power,
    sign_flip_p,
    t_interval,
    t_test_p,
)

COVERAGE_FLOOR = 0.93  # a nominal 95% interval must cover at least this often


# ---------------------------------------------------------------------------- hand-computed
def test_sign_flip_p_hand_computed():
    # [1, 2, 3]: the 8 signed sums are ±6, ±4, ±2, 0, 0; |sum| >= 6 in 2 of 8
    assert sign_flip_p([1.0, 2.0, 3.0]) == pytest.approx(0.25)
    # [2, 1, 1, -1]: observed 3; |±2 ±1 ±1 ±1| >= 3 in 8 of 16
    assert sign_flip_p([2.0, 1.0, 1.0, -1.0]) == pytest.approx(0.5)
    assert sign_flip_p([0.5] * 5) == pytest.approx(2 / 32)  # only all + and all -
    assert sign_flip_p([1.0, -1.0]) == pytest.approx(1.0)
    assert sign_flip_p([0.0, 0.0, 0.0]) == 1.0
    assert sign_flip_p([0.1 + 0.01 * i for i in range(12)]) == pytest.approx(2 / 4096)
    with pytest.raises(ValueError):
        sign_flip_p([])
    with pytest.raises(ValueError):
        sign_flip_p([1.0, math.nan])


def test_sign_flip_p_draws_agree_with_the_enumeration_and_are_seeded():
    diffs = (np.random.default_rng(3).standard_normal(10) + 0.4).tolist()
    exact = sign_flip_p(diffs)
    drawn = sign_flip_p(diffs, draws=40000, exact_up_to=0)
    assert drawn == pytest.approx(exact, abs=0.01)
    assert drawn == sign_flip_p(diffs, draws=40000, exact_up_to=0)
    # 20 equal differences: only 2 of 2^20 patterns reach it, so almost no draw does
    assert sign_flip_p([0.2] * 20, draws=5000) <= 2 / 5001


def test_t_interval_and_p_hand_computed():
    # [0.1, 0.2, 0.3, 0.5]: mean 0.275, sd sqrt(0.0875 / 3), t(3, 0.975) = 3.182446 (tables)
    d = [0.1, 0.2, 0.3, 0.5]
    half = 3.182446 * math.sqrt(0.0875 / 3) / 2
    assert t_interval(d) == pytest.approx((0.275 - half, 0.275 + half), abs=1e-6)
    # t(3, 0.95) = 2.353363: the 90% interval
    half90 = 2.353363 * math.sqrt(0.0875 / 3) / 2
    assert t_interval(d, level=0.9) == pytest.approx((0.275 - half90, 0.275 + half90), abs=1e-6)
    # t = 0.275 / (sd / 2) = 3.2205; two-sided p with 3 degrees of freedom: 0.0486 (tables)
    assert t_test_p(d) == pytest.approx(0.04857, abs=1e-4)
    assert t_interval([0.3] * 6) == (0.3, 0.3) and t_test_p([0.0] * 4) == 1.0
    assert all(math.isnan(x) for x in t_interval([0.2])) and math.isnan(t_test_p([0.2]))
    with pytest.raises(ValueError):
        t_interval([0.1, 0.2], level=1.0)
    with pytest.raises(ValueError):
        t_interval([0.1, math.inf])


def test_the_t_interval_excludes_zero_exactly_when_the_t_test_rejects():
    rng = np.random.default_rng(0)
    for _ in range(200):
        d = (rng.standard_normal(int(rng.integers(3, 17))) * 0.2 + rng.uniform(-0.2, 0.2)).tolist()
        lo, hi = t_interval(d)
        assert (t_test_p(d) < 0.05) == (lo > 0 or hi < 0)


def test_mcnemar_exact_hand_computed():
    assert mcnemar_exact(0, 5) == pytest.approx(2 / 32)
    assert mcnemar_exact(0, 6) == pytest.approx(2 / 64)
    assert mcnemar_exact(1, 7) == pytest.approx(2 * (1 + 8) / 256)
    assert mcnemar_exact(7, 1) == mcnemar_exact(1, 7)
    assert mcnemar_exact(3, 3) == 1.0
    assert mcnemar_exact(0, 0) == 1.0
    with pytest.raises(ValueError):
        mcnemar_exact(-1, 2)


def test_holm_hand_computed():
    # sorted 0.005 (x4 = 0.02), 0.01 (x3 = 0.03), 0.03 (x2 = 0.06), 0.04 (x1 = 0.04 -> 0.06: monotone)
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert holm([0.01, 0.011]) == pytest.approx([0.02, 0.02])
    assert holm([0.6, 0.9]) == [1.0, 1.0]  # 0.6 x 2 capped at 1; 0.9 x 1 raised to it
    adjusted = holm([0.01, math.nan, 0.04])  # NaN: not a test, not counted
    assert adjusted[0] == pytest.approx(0.02) and math.isnan(adjusted[1]) and adjusted[2] == pytest.approx(0.04)
    assert holm([]) == []


def test_fisher_exact_hand_computed():
    # 0/12 vs 5/12: P(table) for k = 0..5 hits in a; those no likelier than k = 0 are k = 0 and 5
    both = 2 * math.comb(12, 5) / math.comb(24, 5)
    assert fisher_exact(0, 12, 5, 12) == pytest.approx(both)
    assert fisher_exact(0, 12, 5, 12) < 0.05 < fisher_exact(1, 12, 4, 12)
    assert fisher_exact(3, 8, 3, 8) == 1.0
    with pytest.raises(ValueError):
        fisher_exact(5, 4, 0, 4)


def test_permutation_p_hand_computed():
    # 3 vs 3, fully separated: of the 20 relabellings, 2 (this one and its mirror) reach |diff|
    assert permutation_p([0.1, 0.2, 0.3], [0.5, 0.6, 0.7]) == pytest.approx(0.1)
    assert permutation_p([0.5, 0.1], [0.5, 0.1]) == pytest.approx(1.0)
    assert permutation_p([0.1] * 12, [0.5] * 12) <= 2 / 20001 + 1e-12


def test_power_hand_computed():
    # a paired t-test at 0.05 needs 34 seeds for an effect of half a standard deviation with
    # power 0.8 (Cohen's tables: 33.4 for the one-sample t), and a z-test 32 (a lower bound)
    assert seeds_for_power(sd=0.2, delta=0.1, alpha=0.05, power=0.8) == 34
    assert power_of(0.2, 0.1, 0.05, 34) >= 0.8 > power_of(0.2, 0.1, 0.05, 33)
    assert seeds_for_power(sd=0.2, delta=0.1, alpha=0.05 / 4) > 34  # a stricter level needs more
    with pytest.raises(ValueError):
        seeds_for_power(sd=0.0, delta=0.1, alpha=0.05)


def test_p_values_print_their_digits():
    assert format_p(0.0004) == "4.0e-04" and format_p(0.0171) == "0.017" and format_p(0.05) == "0.050"
    assert format_p(math.nan) == "-" and format_p(1.0) == "1.000"
    assert all(format_p(p) != "0.000" for p in (1e-9, 4e-4, 9.9e-4))


# ---------------------------------------------------------------------------- one seed
def test_one_seed_gives_no_test_instead_of_scipys_error():
    """What needs a spread answers NaN ("no test") at one seed or one difference; SciPy would raise (issue 49)."""
    assert MIN_SEEDS == 2
    assert math.isnan(permutation_p([0.3], [0.1]))  # SciPy: "each sample ... two or more observations"
    assert math.isnan(permutation_p([0.3], [0.1, 0.2])) and math.isnan(permutation_p([0.1, 0.2], [0.3]))
    assert math.isnan(sign_flip_p([0.2])) and math.isnan(sign_flip_p([0.0]))
    assert all(math.isnan(x) for x in t_interval([0.2], level=0.9))
    assert math.isnan(t_test_p([0.0]))
    # Defined at one seed (exact tests of counts): p = 1, nothing separates.
    assert mcnemar_exact(1, 0) == 1.0 and mcnemar_exact(0, 0) == 1.0
    assert fisher_exact(1, 1, 0, 1) == 1.0 and fisher_exact(0, 1, 0, 1) == 1.0
    # Holm leaves a test not run out of the family.
    assert all(math.isnan(p) for p in holm([math.nan, math.nan]))
    adjusted = holm([math.nan, 0.5, 0.01])
    assert math.isnan(adjusted[0]) and adjusted[1:] == pytest.approx([0.5, 0.02])
    # Two is enough: the tests run.
    assert 0 < permutation_p([0.3, 0.35], [0.1, 0.12]) <= 1 and sign_flip_p([0.2, 0.3]) == pytest.approx(0.5)
    with pytest.raises(ValueError):  # none at all stays an error
        permutation_p([], [0.1, 0.2])


def test_needs_seeds_is_one_clause_naming_the_statistic_and_the_count():
    assert needs_seeds("t interval", have=1) == "no t interval: it needs 2 or more paired seeds, this run has 1"
    assert needs_seeds("permutation p", "seeds per arm") == "no permutation p: it needs 2 or more seeds per arm"


# ---------------------------------------------------------------------------- coverage
def _percentile_bootstrap_coverage(samples: np.ndarray, rng: np.random.Generator, draws: int = 2000) -> float:
    """The interval the lab used before (resample the seeds, 2.5% and 97.5% quantiles of the means)."""
    n = samples.shape[1]
    covered = 0
    for row in samples:
        means = row[rng.integers(0, n, (draws, n))].mean(1)
        lo, hi = np.quantile(means, [0.025, 0.975])
        covered += lo <= 0.0 <= hi
    return covered / len(samples)


@pytest.mark.parametrize("seeds", [8, 16])
def test_the_paired_interval_covers_what_it_claims(seeds):
    """4000 draws of ``seeds`` normal differences with mean 0: the 95% t interval covers 0 in at least 93%.

    (The binomial sd of a 95% coverage over 4000 draws is 0.0034: 93% is six of them below.)
    """
    rng = np.random.default_rng(seeds)
    samples = rng.standard_normal((4000, seeds)) * 0.25
    covered = sum(lo <= 0.0 <= hi for lo, hi in map(t_interval, samples))
    assert covered / len(samples) >= COVERAGE_FLOOR


def test_the_coverage_check_fails_the_percentile_bootstrap():
    """The check has teeth: the percentile bootstrap the lab used before covers less than 93% at 8 seeds."""
    rng = np.random.default_rng(8)
    samples = rng.standard_normal((2000, 8)) * 0.25
    assert _percentile_bootstrap_coverage(samples, rng) < COVERAGE_FLOOR
