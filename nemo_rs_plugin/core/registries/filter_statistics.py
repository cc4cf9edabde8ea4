"""The rejection filters' statistics: one entry per statistic (``RejectionFilter.statistic``), read by everything else.

An entry holds the per-token function (from the filter's log-ratio ``d = log pi_a - log pi_b``
and, for the probability-space statistics, both log-probs), the aggregations a sequence filter
may use, where its value can lie, how ``nemo-rs check`` words it and whether its bounds are
ratios (compared in log space). The filter's config validation and its range checks
(``config_problems``), the tensor side (``correction.filters``), calibration, ``nemo-rs check``'s
sentences and the configuration reference all read :data:`FILTER_STATISTICS`; nothing else
compares a statistic's name. A new statistic is one entry here (and its name in
``rejection_filter.FilterStatisticName``, which a test holds equal to the keys), plus a reference
formula in ``tests/support/naive_reference.py``.

References:
    - ``kl_k1`` / ``kl_k2`` / ``kl_k3``: Schulman, "Approximating KL Divergence",
      http://joschu.net/blog/kl-approx.html; as rejection statistics, AReaL PR #1088,
      https://github.com/inclusionAI/AReaL/pull/1088, and VERL's rollout correction,
      https://verl.readthedocs.io/en/latest/algo/rollout_corr.html
    - ``ratio`` with ``agg: mean`` (Geo-RS): Liu, Li et al., "When Speed Kills Stability: Demystifying RL
      Collapse from the Training-Inference Mismatch", https://yingru.notion.site/When-Speed-Kills-Stability-Demystifying-RL-Collapse-from-the-Training-Inference-Mismatch-271211a558b7808d8b12d403fd15edda
    - ``prob_diff`` (DPPO, IPO): Qi et al., "Rethinking the Trust Region in LLM Reinforcement Learning",
      https://arxiv.org/abs/2602.04879; prime-rl's losses, https://docs.primeintellect.ai/prime-rl/algorithms
      and https://docs.primeintellect.ai/prime-rl/ipo.md
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional

import torch

from nemo_rs_plugin.core.policy_loss import kl_estimate
from nemo_rs_plugin.core.registries.aggregations import SEQUENCE_AGGREGATIONS, sequence_aggregation

__all__ = [
    "FILTER_STATISTICS",
    "FilterStatistic",
    "PROBABILITY_CLAMP",
    "aggregated_text",
    "filter_statistic_entry",
    "filter_statistics_text",
]

#: Probability-space statistics clamp the sampled token's probabilities to [1e-6, 1 - 1e-6]
#: (OpenRLHF's clamp), which keeps both logs of the binary KL finite.
PROBABILITY_CLAMP = 1e-6

#: ``(d, target, behaviour) -> [B, T]``: ``d = target - behaviour`` (log-probs, finite);
#: ``target`` and ``behaviour`` are given only to statistics with ``needs_probabilities``.
TokenFunction = Callable[[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]], torch.Tensor]

#: Aggregations of a statistic that averages arithmetically over a sequence's tokens.
ARITHMETIC_AGGREGATIONS = tuple(name for name, a in SEQUENCE_AGGREGATIONS.items() if a.arithmetic)
#: Aggregations of a statistic compared in log space (the ratio): every one.
LOG_SPACE_AGGREGATIONS = tuple(SEQUENCE_AGGREGATIONS)


@dataclass(frozen=True)
class FilterStatistic:
    """One filter statistic.

    Attributes:
        name: the ``statistic`` value of a filter.
        formula: the per-token statistic as the docs state it (``r = exp(d)``, ``p = exp(log pi)``).
        meaning: what it is and where it comes from, for the guide's table.
        token_value: the per-token statistic (``ratio``: ``d`` itself, its log).
        aggregations: what ``agg`` a sequence filter may use with it.
        value_range: ``(lowest, highest)`` value of one token's statistic, and so of its mean, max
            and min over a sequence (a ratio's: of the ratio, not its log).
        reaches: whether a token's statistic can equal the lowest / highest value (the clamp keeps
            the total variation below 1; ``prob_diff``, unclamped, reaches -1 and 1 where ``exp``
            rounds a probability to 0 or 1). Bounds are inclusive: an upper bound at an unreached
            lowest value rejects every unit.
        token_words: a token's statistic in ``nemo-rs check``'s sentence; ``{a}`` / ``{b}``: the
            filter's two log-prob sources (a wording without them gets ", with d = a - b").
        sequence_words: per aggregation, a sequence's statistic in words where the default ("the
            {agg} over its tokens of" + ``token_words``) does not fit.
        needs_probabilities: reads the two log-probs themselves, not only ``d``.
        clamped: the probabilities are clamped (the upper-bound warning says so).
        log_space: a ratio: bounds are compared as logs, sequences aggregate in log space, and the
            statistic needs no overflow guard (``d`` is finite).
    """

    name: str
    formula: str
    meaning: str
    token_value: TokenFunction
    aggregations: tuple[str, ...]
    value_range: tuple[float, float]
    token_words: str
    reaches: tuple[bool, bool] = (True, True)
    sequence_words: Mapping[str, str] = field(default_factory=dict)
    needs_probabilities: bool = False
    clamped: bool = False
    log_space: bool = False

    def _words(self, aggregation: Optional[str]) -> str:
        if aggregation is None:
            return self.token_words
        statistic = self.token_words.replace("its ", "the ", 1)
        return self.sequence_words.get(aggregation) or sequence_aggregation(aggregation).words.replace(
            "{statistic}", statistic
        )

    def describe(self, aggregation: Optional[str], a: str, b: str) -> str:
        """The statistic of a token (``aggregation`` None) or a sequence, in words."""
        return self._words(aggregation).format(a=a, b=b, agg=aggregation)

    def names_its_sources(self, aggregation: Optional[str]) -> bool:
        """Whether :meth:`describe` names the two log-prob sources itself."""
        return "{a}" in self._words(aggregation)


def _clamped_probabilities(target: torch.Tensor, behaviour: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    p_a = target.exp().clamp(PROBABILITY_CLAMP, 1.0 - PROBABILITY_CLAMP)
    p_b = behaviour.exp().clamp(PROBABILITY_CLAMP, 1.0 - PROBABILITY_CLAMP)
    return p_a, p_b


def _binary_kl(d: torch.Tensor, target: Optional[torch.Tensor], behaviour: Optional[torch.Tensor]) -> torch.Tensor:
    p_a, p_b = _clamped_probabilities(_given(target), _given(behaviour))
    return p_b * (p_b / p_a).log() + (1.0 - p_b) * ((1.0 - p_b) / (1.0 - p_a)).log()


def _total_variation(
    d: torch.Tensor, target: Optional[torch.Tensor], behaviour: Optional[torch.Tensor]
) -> torch.Tensor:
    p_a, p_b = _clamped_probabilities(_given(target), _given(behaviour))
    return (p_b - p_a).abs()


def _prob_diff(d: torch.Tensor, target: Optional[torch.Tensor], behaviour: Optional[torch.Tensor]) -> torch.Tensor:
    return _given(target).exp() - _given(behaviour).exp()  # unclamped: prime-rl's statistic


def _given(log_probs: Optional[torch.Tensor]) -> torch.Tensor:
    if log_probs is None:
        raise ValueError("this filter statistic needs the target and behaviour log-probs")
    return log_probs


_RATIO_SEQUENCE_WORDS = {
    "mean": "the geometric mean of its token ratios (Geo-RS)",
    "sum": "the product of its token ratios",
    "max": "its largest token ratio",
    "min": "its smallest token ratio",
    "any": "every one of its token ratios (outlier-token veto)",
}
_SAMPLED = "(probabilities of the sampled token)"

FILTER_STATISTICS: dict[str, FilterStatistic] = {
    s.name: s
    for s in (
        FilterStatistic(
            "ratio",
            "r = exp(d)",
            "the importance ratio; a sequence's mean is the geometric mean exp(sum_t m d / n), its sum the product",
            lambda d, target, behaviour: d,  # the log: bounds are compared as logs
            LOG_SPACE_AGGREGATIONS,
            (0.0, math.inf),
            "its ratio pi_{a}/pi_{b}",
            sequence_words=_RATIO_SEQUENCE_WORDS,
            log_space=True,
        ),
        FilterStatistic(
            "kl_k1",
            "-d",
            "Schulman's k1 estimator of KL(pi_b || pi_a)",
            lambda d, target, behaviour: kl_estimate(d, "k1"),
            ARITHMETIC_AGGREGATIONS,
            (-math.inf, math.inf),
            "its KL estimate k1 = -d",
        ),
        FilterStatistic(
            "kl_k2",
            "d^2/2",
            "Schulman's k2 estimator of KL(pi_b || pi_a)",
            lambda d, target, behaviour: kl_estimate(d, "k2"),
            ARITHMETIC_AGGREGATIONS,
            (0.0, math.inf),
            "its KL estimate k2 = d^2/2",
        ),
        FilterStatistic(
            "kl_k3",
            "exp(d) - 1 - d",
            "Schulman's k3 estimator of KL(pi_b || pi_a), >= 0 per token",
            lambda d, target, behaviour: kl_estimate(d, "k3"),
            ARITHMETIC_AGGREGATIONS,
            (0.0, math.inf),
            "its KL estimate k3 = exp(d)-1-d",
        ),
        FilterStatistic(
            "mult_prob_error",
            "exp(|d|) = max(r, 1/r)",
            "NeMo-RL's token_mult_prob_error; agg mean is its grpo.seq_logprob_error_threshold statistic",
            lambda d, target, behaviour: torch.exp(d.abs()),
            ARITHMETIC_AGGREGATIONS,
            (1.0, math.inf),
            "its multiplicative probability error exp(|d|)",
        ),
        FilterStatistic(
            "chi2",
            "(r - 1)^2",
            "its mean over pi_b's samples estimates the chi-squared divergence of pi_a from pi_b (VERL and "
            "ms-swift log it as chi2_token / chi2_seq)",
            lambda d, target, behaviour: torch.expm1(d).square(),
            ARITHMETIC_AGGREGATIONS,
            (0.0, math.inf),
            "its chi-squared term (exp(d)-1)^2",
        ),
        FilterStatistic(
            "binary_kl",
            "p_b log(p_b/p_a) + (1-p_b) log((1-p_b)/(1-p_a))",
            "the sampled token's probabilities as a Bernoulli pair, clamped to [1e-6, 1 - 1e-6] "
            "(OpenRLHF's binary_kl gating)",
            _binary_kl,
            ARITHMETIC_AGGREGATIONS,
            (0.0, math.inf),
            "the binary KL of its sampled-token probabilities",
            needs_probabilities=True,
            clamped=True,
        ),
        FilterStatistic(
            "total_variation",
            "|p_b - p_a|",
            "the sampled token's probabilities, clamped to [1e-6, 1 - 1e-6] (OpenRLHF's tv gating)",
            _total_variation,
            ARITHMETIC_AGGREGATIONS,
            (0.0, 1.0),
            "the total variation |p_b - p_a| of its sampled-token probabilities",
            reaches=(True, False),
            needs_probabilities=True,
            clamped=True,
        ),
        FilterStatistic(
            "prob_diff",
            "p_a - p_b",
            "signed, unclamped: with log_ratio curr-gen prime-rl's DPPO / IPO trust-region statistic",
            _prob_diff,
            ARITHMETIC_AGGREGATIONS,
            (-1.0, 1.0),
            "its probability difference p_{a} - p_{b} " + _SAMPLED,
            sequence_words={
                agg: "the {agg} over its tokens of p_{a} - p_{b} " + _SAMPLED for agg in ARITHMETIC_AGGREGATIONS
            },
            needs_probabilities=True,
        ),
    )
}


def filter_statistic_entry(name: str) -> FilterStatistic:
    """The entry of ``name``; an unknown name is an error, never a default."""
    try:
        return FILTER_STATISTICS[name]
    except KeyError:
        raise ValueError(f"statistic: got {name!r}; allowed: {', '.join(FILTER_STATISTICS)}") from None


def filter_statistics_text() -> str:
    """Every statistic and its per-token formula, as the filter's ``statistic`` field states them."""
    return "; ".join(f"``{s.name}``: ``{s.formula}``" for s in FILTER_STATISTICS.values())


def aggregated_text(statistic: FilterStatistic) -> str:
    """How a sequence filter aggregates ``statistic`` over its tokens, in words."""
    aggs = ", ".join(f"`{a}`" for a in statistic.aggregations)
    if statistic.log_space:
        return f"in log space: {aggs} (`mean` the geometric mean, `sum` the product, `any` every token in band)"
    return f"arithmetically: {aggs}"
