"""A rejection filter's options and the loss's rejection denominator: one entry per value.

``applies_to`` (:data:`SCOPES`), ``log_ratio`` (:data:`LOG_RATIOS`), ``advantage_sign``
(:data:`ADVANTAGE_SIGNS`) and ``rejection_denominator`` (:data:`DENOMINATORS`): each entry says
what its value does, and the filters' plan, the objective, the microbatch totals, the config's
checks and the description read these properties instead of comparing the value's name. A new
value is one entry here (and its name in the field's ``Literal``, which a test holds equal to the
keys). The filter's level has its own registry (``filter_levels``), as do the sequence
aggregations (``aggregations``).

References:
    - A policy-gradient-only scope and a positive-advantage condition on token filters: prime-rl's
      DPPO / IPO mask, https://docs.primeintellect.ai/prime-rl/algorithms
    - Negative-advantage-only sequence masking (OPSM): DeepSeek-AI, "DeepSeek-V3.2", 2025.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "ADVANTAGE_SIGNS",
    "DENOMINATORS",
    "LOG_RATIOS",
    "SCOPES",
    "AdvantageSign",
    "Denominator",
    "LogRatio",
    "Scope",
]


@dataclass(frozen=True)
class Scope:
    """One ``applies_to`` value: what a rejected token loses.

    Attributes:
        name: the value.
        leaves_loss: the token leaves the loss and its counts (``loss``); otherwise only its
            policy-gradient term is dropped and the penalty terms still train on it
            (``policy_gradient``).
        label_part: the part of the filter's label it adds (``""``: none, the default).
    """

    name: str
    leaves_loss: bool
    label_part: str


@dataclass(frozen=True)
class LogRatio:
    """One ``log_ratio`` value ``a-b``: the per-token ``d = log pi_a - log pi_b`` a filter compares.

    Attributes:
        name: the value.
        target, behaviour: the policies ``a`` and ``b`` (fields of ``PolicyLogProbs``).
        is_loss_log_ratio: ``prev - gen``, the loss's own ``d``, reused as computed (no other read).
        reads_current_policy: ``d`` reads the current policy's log-probs, which exist only in the
            training step's own call (not in recorded log-probs, not before the forward pass).
        zero_on_policy: ``d`` is 0 everywhere when ``force_on_policy_ratio`` sets ``prev`` to ``curr``.
        label_part: the part of the filter's label it adds (``""``: none, the default).
    """

    name: str
    target: str
    behaviour: str
    is_loss_log_ratio: bool
    reads_current_policy: bool
    zero_on_policy: bool
    label_part: str


@dataclass(frozen=True)
class AdvantageSign:
    """One ``advantage_sign`` value: the filter rejects only tokens (sequences) of this sign.

    Attributes:
        name: the value.
        sign: +1 or -1.
    """

    name: str
    sign: float


@dataclass(frozen=True)
class Denominator:
    """One ``rejection_denominator`` value: what the loss divides by after rejection.

    Attributes:
        name: the value.
        counts_kept: the loss's global counts are those of the kept tokens and sequences
            (``kept``), not NeMo-RL's counts of the valid ones (``original``).
    """

    name: str
    counts_kept: bool


SCOPES: dict[str, Scope] = {
    s.name: s for s in (Scope("loss", True, ""), Scope("policy_gradient", False, "policy_gradient"))
}

LOG_RATIOS: dict[str, LogRatio] = {
    r.name: r
    for r in (
        LogRatio("prev-gen", "prev", "gen", True, False, False, ""),
        LogRatio("gen-prev", "gen", "prev", False, False, False, "gen-prev"),
        LogRatio("curr-gen", "curr", "gen", False, True, False, "curr-gen"),
        LogRatio("curr-prev", "curr", "prev", False, True, True, "curr-prev"),
    )
}

ADVANTAGE_SIGNS: dict[str, AdvantageSign] = {
    s.name: s for s in (AdvantageSign("positive", 1.0), AdvantageSign("negative", -1.0))
}

DENOMINATORS: dict[str, Denominator] = {d.name: d for d in (Denominator("original", False), Denominator("kept", True))}
