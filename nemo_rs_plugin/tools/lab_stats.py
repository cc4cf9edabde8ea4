"""Do the seeds separate two arms? The small tests the lab's pages rest on.

Unpaired (the single-lag run, docs/lab.md's published tables):

* :func:`fisher_exact`: counts of seeds with an outcome (a spike, a collapse, ending at
  chance) in two arms; two-sided exact p-value of Fisher's test (the hypergeometric
  probabilities no larger than the observed table's, summed).
* :func:`permutation_p`: a per-seed number (final evaluation reward) in two arms; two-sided
  p-value of the difference of means under random relabelling, from ``draws`` seeded
  permutations (deterministic), ``(1 + hits) / (1 + draws)``.

Both are conservative for the sample sizes of the lab (8 to 16 seeds an arm): with 12 seeds
each, Fisher's test needs about 0/12 against 5/12 to reach p < 0.05.

Paired (the dose-response run: every arm runs the same seeds, so seed ``i`` of arm ``a`` and of
arm ``b`` share the initial weights and the prompts):

* :func:`sign_flip_p`: per-seed differences ``a_i - b_i``; two-sided p-value of their mean
  under random sign flips (exact enumeration of the ``2^n`` flips up to ``exact_up_to`` seeds,
  else seeded draws, ``(1 + hits) / (1 + draws)``).
* :func:`bootstrap_ci`: a percentile bootstrap interval of the mean difference (seeded).
* :func:`mcnemar_exact`: a yes/no outcome per seed in both arms; two-sided exact McNemar test
  (a binomial test with p = 1/2 on the seeds where only one arm has the outcome).
* :func:`holm`: Holm-Bonferroni adjusted p-values over a family of tests.

Every function is pure and deterministic (seeded draws only).
"""

from __future__ import annotations

import math
from math import comb
from typing import Sequence

import torch

__all__ = [
    "SIGNIFICANCE",
    "bootstrap_ci",
    "fisher_exact",
    "holm",
    "mcnemar_exact",
    "permutation_p",
    "sign_flip_p",
]

#: The level at which the page says "the seeds separate them".
SIGNIFICANCE = 0.05


def fisher_exact(hits_a: int, n_a: int, hits_b: int, n_b: int) -> float:
    """Two-sided p-value of Fisher's exact test on ``hits_a / n_a`` against ``hits_b / n_b``."""
    if not (0 <= hits_a <= n_a and 0 <= hits_b <= n_b):
        raise ValueError(f"counts out of range: {hits_a}/{n_a}, {hits_b}/{n_b}")
    hits, total = hits_a + hits_b, n_a + n_b

    def probability(k: int) -> float:  # P(hits_a = k) given the margins
        return comb(n_a, k) * comb(n_b, hits - k) / comb(total, hits)

    observed = probability(hits_a)
    ks = range(max(0, hits - n_b), min(hits, n_a) + 1)
    return min(1.0, sum(p for p in map(probability, ks) if p <= observed * (1 + 1e-9)))


def permutation_p(a: list[float], b: list[float], draws: int = 20000, seed: int = 0) -> float:
    """Two-sided permutation p-value of ``mean(a) - mean(b)`` (seeded, so deterministic)."""
    if not a or not b:
        raise ValueError("each group needs at least one value")
    values = torch.tensor([*a, *b], dtype=torch.float64)
    n_a = len(a)
    observed = abs(values[:n_a].mean() - values[n_a:].mean())
    g = torch.Generator().manual_seed(seed)
    perms = torch.argsort(torch.rand(draws, len(values), generator=g), dim=1)
    shuffled = values[perms]
    diffs = (shuffled[:, :n_a].mean(1) - shuffled[:, n_a:].mean(1)).abs()
    hits = int((diffs >= observed - 1e-12).sum())
    return (1 + hits) / (1 + draws)


# ---------------------------------------------------------------------------- paired tests
def sign_flip_p(diffs: Sequence[float], draws: int = 20000, seed: int = 0, exact_up_to: int = 16) -> float:
    """Two-sided paired sign-flip permutation p-value of ``mean(diffs) = 0``.

    Under the null each seed's difference is as likely ``+d`` as ``-d``. With ``n <=
    exact_up_to`` all ``2^n`` sign patterns are enumerated: ``p`` is the share whose
    ``|sum|`` reaches the observed one (the observed pattern included, so ``p >= 2 / 2^n``
    unless every difference is 0, where ``p = 1``). Above it, ``draws`` seeded patterns:
    ``(1 + hits) / (1 + draws)``.
    """
    n = len(diffs)
    if n == 0:
        raise ValueError("sign_flip_p needs at least one difference")
    d = torch.tensor(list(diffs), dtype=torch.float64)
    if not bool(torch.isfinite(d).all()):
        raise ValueError(f"sign_flip_p: non-finite difference in {list(diffs)}")
    observed = float(d.sum().abs())
    tolerance = 1e-9 * max(1.0, float(d.abs().sum()))  # ties up to rounding count as reached
    if n <= exact_up_to:
        sums = torch.zeros(1, dtype=torch.float64)
        for x in d:  # the signed sums of every pattern, one difference at a time
            sums = torch.cat([sums + x, sums - x])
        return float((sums.abs() >= observed - tolerance).sum()) / 2**n
    g = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (draws, n), generator=g).to(torch.float64) * 2 - 1
    hits = int(((signs * d).sum(1).abs() >= observed - tolerance).sum())
    return (1 + hits) / (1 + draws)


def bootstrap_ci(diffs: Sequence[float], level: float = 0.95, draws: int = 10000, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of ``mean(diffs)`` at ``level`` (seeded, so deterministic).

    ``draws`` resamples of the seeds with replacement; the interval is the ``(1 - level) / 2``
    and ``(1 + level) / 2`` quantiles of their means (linear interpolation).
    """
    n = len(diffs)
    if n == 0:
        raise ValueError("bootstrap_ci needs at least one difference")
    if not 0.0 < level < 1.0:
        raise ValueError(f"bootstrap_ci: level must be in (0, 1), got {level}")
    d = torch.tensor(list(diffs), dtype=torch.float64)
    g = torch.Generator().manual_seed(seed)
    means = d[torch.randint(0, n, (draws, n), generator=g)].mean(1)
    lo, hi = torch.quantile(means, torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=torch.float64))
    return float(lo), float(hi)


def mcnemar_exact(only_a: int, only_b: int) -> float:
    """Two-sided exact McNemar p-value from the discordant seeds.

    ``only_a``: seeds where arm ``a`` has the outcome and ``b`` does not; ``only_b`` the
    reverse. Under the null each discordant seed is either way with probability 1/2:
    ``p = min(1, 2 P(X <= min(only_a, only_b)))``, ``X ~ Binomial(only_a + only_b, 1/2)``;
    1 without discordant seeds.
    """
    if only_a < 0 or only_b < 0:
        raise ValueError(f"mcnemar_exact: counts must be >= 0, got {only_a}, {only_b}")
    n = only_a + only_b
    if n == 0:
        return 1.0
    tail = sum(comb(n, k) for k in range(min(only_a, only_b) + 1))
    return min(1.0, 2 * tail / 2**n)


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm-Bonferroni adjusted p-values, in the order given.

    Sorted ascending, the ``j``-th (from 0) of ``m`` is multiplied by ``m - j``; the adjusted
    values are made non-decreasing along that order and capped at 1. NaN (a test not run)
    stays NaN and does not count in ``m``.
    """
    order = sorted((p, i) for i, p in enumerate(pvalues) if not math.isnan(p))
    m = len(order)
    adjusted = [math.nan] * len(pvalues)
    running = 0.0
    for j, (p, i) in enumerate(order):
        running = max(running, min(1.0, (m - j) * p))
        adjusted[i] = running
    return adjusted
