"""Do the seeds separate two arms? Two small tests the lab's page rests on.

* :func:`fisher_exact`: counts of seeds with an outcome (a spike, a collapse, ending at
  chance) in two arms; two-sided exact p-value of Fisher's test (the hypergeometric
  probabilities no larger than the observed table's, summed).
* :func:`permutation_p`: a per-seed number (final evaluation reward) in two arms; two-sided
  p-value of the difference of means under random relabelling, from ``draws`` seeded
  permutations (deterministic), ``(1 + hits) / (1 + draws)``.

Both are conservative for the sample sizes of the lab (8 to 16 seeds an arm): with 12 seeds
each, Fisher's test needs about 0/12 against 5/12 to reach p < 0.05.
"""

from __future__ import annotations

from math import comb

import torch

__all__ = ["SIGNIFICANCE", "fisher_exact", "permutation_p"]

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
