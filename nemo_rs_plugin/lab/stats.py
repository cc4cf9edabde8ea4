"""Do the seeds separate two arms? The tests the lab's pages rest on, from SciPy and statsmodels.

Every test here is a library's (SciPy's ``stats``, statsmodels' ``multipletests`` and
``TTestPower``), wrapped only to fix the lab's choices (two-sided, the level, seeded draws) and
to refuse inputs the libraries would answer with NaN. Nothing is written by hand.

Paired (every arm runs the same seeds, so seed ``i`` of arm ``a`` and of arm ``b`` share the
initial weights and the prompts; ``d_i = a_i - b_i``):

* :func:`t_interval`: the paired t interval of ``mean(d)``,
  ``mean(d) +- t_{n-1, (1+level)/2} sd(d) / sqrt(n)``. It covers at its level for normal
  differences at any ``n``; the percentile bootstrap it replaces covered 86% at 8 seeds and 93%
  at 16 for a nominal 95% (``tests/lab/test_lab_stats.py`` simulates both).
* :func:`t_test_p`: the paired t-test's two-sided p-value, ``2 P(T_{n-1} >= |mean(d)| sqrt(n) /
  sd(d)|)``; it rejects at ``alpha`` exactly when the ``1 - alpha`` t interval excludes 0, so
  the page's words and intervals cannot disagree.
* :func:`sign_flip_p`: the sign-flip permutation p-value of ``mean(d) = 0`` (each ``d_i`` as
  likely ``+d_i`` as ``-d_i``; every ``2^n`` pattern up to ``exact_up_to`` seeds, else seeded
  draws): a check that needs no normality.
* :func:`mcnemar_exact`: a yes/no outcome per seed in both arms; the exact McNemar test, a
  two-sided binomial test at 1/2 on the discordant seeds.
* :func:`holm`: Holm's adjusted p-values over one family of tests.
* :func:`seeds_for_power`: the seeds a paired t-test needs to detect ``delta`` with the given
  power, from the paired standard deviation; :func:`power_of` the power a number of seeds gives.

Unpaired (the earlier single-lag run, docs/lab.md):

* :func:`fisher_exact`: counts of seeds with an outcome in two arms; Fisher's exact test.
* :func:`permutation_p`: a per-seed number in two arms; the permutation test on the difference
  of means (seeded draws).

A test or interval that needs more seeds than it is given (:data:`MIN_SEEDS`: the t interval and
t-test, the sign-flip and permutation tests, with one seed or one difference) answers NaN, "no
test", never SciPy's error: a one-seed run keeps its outputs and its report says which statistic
it lacks (:func:`needs_seeds`). The exact counts' tests (Fisher, McNemar) and Holm's correction
are defined at any count.

:func:`format_p` prints a p-value with the digits it has (``0.017``, ``4.2e-04``), never
``0.000``.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np

__all__ = [
    "MIN_SEEDS",
    "SIGNIFICANCE",
    "fisher_exact",
    "format_p",
    "holm",
    "mcnemar_exact",
    "needs_seeds",
    "permutation_p",
    "power_of",
    "seeds_for_power",
    "sign_flip_p",
    "t_interval",
    "t_test_p",
]

#: The level at which the page says "the seeds separate them".
SIGNIFICANCE = 0.05

#: The fewest seeds (per arm; paired: differences) a spread, a t interval, a t-test or a permutation
#: test needs. With fewer, those answer NaN and the reports say so (:func:`needs_seeds`).
MIN_SEEDS = 2


def needs_seeds(what: str, per: str = "paired seeds", have: Optional[int] = None) -> str:
    """The words a report prints instead of a statistic the run has too few seeds for.

    ``needs_seeds("t interval", have=1)``: ``"no t interval: it needs 2 or more paired seeds, this run has 1"``.
    """
    return f"no {what}: it needs {MIN_SEEDS} or more {per}" + ("" if have is None else f", this run has {have}")


def _stats():
    """SciPy's ``stats`` (the ``[lab]`` and ``[test]`` extras), with the install line if missing."""
    try:
        from scipy import stats
    except ImportError as exc:  # pragma: no cover - the extras install it
        raise ImportError("the lab's statistics need SciPy: pip install 'nemo-rs-plugin[lab]'") from exc
    return stats


def _no_spread(d: np.ndarray) -> bool:
    """Differences equal up to rounding (identical runs, or rows rounded alike): the t-test has no spread to use."""
    return float(np.ptp(d)) <= 1e-12 * max(1.0, float(np.abs(d).max()))


def _finite(values: Sequence[float], name: str, minimum: int = 1) -> np.ndarray:
    x = np.asarray(list(values), dtype=np.float64)
    if x.size < minimum:
        raise ValueError(f"{name} needs at least {minimum} value(s), got {x.size}")
    if not np.isfinite(x).all():
        raise ValueError(f"{name}: non-finite value in {list(values)}")
    return x


# ---------------------------------------------------------------------------- paired
def t_interval(diffs: Sequence[float], level: float = 0.95) -> tuple[float, float]:
    """The paired t interval of ``mean(diffs)`` at ``level`` (SciPy's ``ttest_1samp``).

    One difference has no spread: ``(nan, nan)``. Equal differences (up to rounding): the point ``(d, d)``.
    """
    if not 0.0 < level < 1.0:
        raise ValueError(f"t_interval: level must be in (0, 1), got {level}")
    d = _finite(diffs, "t_interval")
    if d.size < MIN_SEEDS:
        return math.nan, math.nan
    if _no_spread(d):
        return float(d.mean()), float(d.mean())
    ci = _stats().ttest_1samp(d, 0.0).confidence_interval(confidence_level=level)
    return float(ci.low), float(ci.high)


def t_test_p(diffs: Sequence[float]) -> float:
    """Two-sided p-value of the paired t-test of ``mean(diffs) = 0`` (SciPy's ``ttest_1samp``).

    One difference: NaN (no test). Equal differences (up to rounding): 1 if they are 0, else 0.
    """
    d = _finite(diffs, "t_test_p")
    if d.size < MIN_SEEDS:
        return math.nan
    if _no_spread(d):
        return 1.0 if abs(float(d.mean())) <= 1e-12 else 0.0
    return float(_stats().ttest_1samp(d, 0.0).pvalue)


def sign_flip_p(diffs: Sequence[float], draws: int = 20000, seed: int = 0, exact_up_to: int = 16) -> float:
    """Two-sided sign-flip permutation p-value of ``mean(diffs) = 0`` (SciPy's ``permutation_test``).

    One difference: NaN (no test; SciPy needs two). With ``n <= exact_up_to`` every one of the
    ``2^n`` sign patterns (exact: ``p >= 2 / 2^n`` unless every difference is 0, where ``p = 1``);
    above it ``draws`` seeded patterns: each one-sided p is ``(1 + hits) / (1 + draws)`` and the
    two-sided p twice the smaller, so none below ``2 / (1 + draws)`` (1.0e-04 at 20000 draws).
    """
    d = _finite(diffs, "sign_flip_p")
    if d.size < MIN_SEEDS:
        return math.nan
    if not d.any():
        return 1.0
    n_resamples = 2**d.size if d.size <= exact_up_to else draws
    result = _stats().permutation_test(
        (d,),
        np.mean,
        permutation_type="samples",
        alternative="two-sided",
        n_resamples=n_resamples,
        random_state=np.random.default_rng(seed),
    )
    return float(min(1.0, result.pvalue))


def mcnemar_exact(only_a: int, only_b: int) -> float:
    """Two-sided exact McNemar p-value from the discordant seeds (SciPy's ``binomtest`` at 1/2).

    ``only_a``: seeds where arm ``a`` has the outcome and ``b`` does not; ``only_b`` the
    reverse. 1 without discordant seeds.
    """
    if only_a < 0 or only_b < 0:
        raise ValueError(f"mcnemar_exact: counts must be >= 0, got {only_a}, {only_b}")
    if only_a + only_b == 0:
        return 1.0
    return float(_stats().binomtest(only_a, only_a + only_b, 0.5).pvalue)


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm's adjusted p-values, in the order given (statsmodels' ``multipletests``).

    NaN (a test not run) stays NaN and does not count in the family.
    """
    from statsmodels.stats.multitest import multipletests

    values = list(pvalues)
    kept = [i for i, p in enumerate(values) if not math.isnan(p)]
    adjusted = [math.nan] * len(values)
    if kept:
        corrected = multipletests([values[i] for i in kept], alpha=SIGNIFICANCE, method="holm")[1]
        for i, p in zip(kept, corrected):
            adjusted[i] = float(p)
    return adjusted


def seeds_for_power(sd: float, delta: float, alpha: float, power: float = 0.8) -> int:
    """Paired seeds for a two-sided paired t-test at ``alpha`` to detect ``delta`` with ``power``.

    statsmodels' ``TTestPower`` (the noncentral t) at effect size ``delta / sd``, rounded up;
    at least 2.
    """
    if not (sd > 0 and delta > 0 and 0 < alpha < 1 and 0 < power < 1):
        raise ValueError(
            f"seeds_for_power: need sd > 0, delta > 0, alpha and power in (0, 1); got {sd}, {delta}, {alpha}, {power}"
        )
    from statsmodels.stats.power import TTestPower

    n = TTestPower().solve_power(effect_size=delta / sd, alpha=alpha, power=power, alternative="two-sided")
    return max(2, math.ceil(float(n)))


def power_of(sd: float, delta: float, alpha: float, seeds: int) -> float:
    """The power of a two-sided paired t-test at ``alpha`` with ``seeds`` seeds to detect ``delta`` (statsmodels)."""
    from statsmodels.stats.power import TTestPower

    return float(TTestPower().power(effect_size=delta / sd, nobs=seeds, alpha=alpha, alternative="two-sided"))


# ---------------------------------------------------------------------------- unpaired
def fisher_exact(hits_a: int, n_a: int, hits_b: int, n_b: int) -> float:
    """Two-sided p-value of Fisher's exact test on ``hits_a / n_a`` against ``hits_b / n_b`` (SciPy)."""
    if not (0 <= hits_a <= n_a and 0 <= hits_b <= n_b):
        raise ValueError(f"counts out of range: {hits_a}/{n_a}, {hits_b}/{n_b}")
    table = [[hits_a, n_a - hits_a], [hits_b, n_b - hits_b]]
    return float(min(1.0, _stats().fisher_exact(table, alternative="two-sided").pvalue))


def permutation_p(a: Sequence[float], b: Sequence[float], draws: int = 20000, seed: int = 0) -> float:
    """Two-sided permutation p-value of ``mean(a) - mean(b)`` (SciPy's ``permutation_test``, seeded).

    An arm with one value: NaN (no test; SciPy needs two in each).
    """
    xa, xb = _finite(a, "permutation_p"), _finite(b, "permutation_p")
    if min(xa.size, xb.size) < MIN_SEEDS:
        return math.nan

    def difference(x: np.ndarray, y: np.ndarray, axis: int = -1) -> np.ndarray:
        return np.mean(x, axis=axis) - np.mean(y, axis=axis)

    result = _stats().permutation_test(
        (xa, xb),
        difference,
        permutation_type="independent",
        alternative="two-sided",
        n_resamples=draws,
        vectorized=True,
        random_state=np.random.default_rng(seed),
    )
    return float(min(1.0, result.pvalue))


def format_p(p: float) -> str:
    """A p-value with the digits it has: ``0.017`` from 0.001 up, ``4.2e-04`` below, ``-`` for NaN."""
    if math.isnan(p):
        return "-"
    return f"{p:.3f}" if p >= 0.001 else f"{p:.1e}"
