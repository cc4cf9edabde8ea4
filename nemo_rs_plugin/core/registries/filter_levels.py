"""A rejection filter's levels: one entry per ``level`` (``token``, ``sequence``).

An entry says what unit the filter rejects, whether it decides from an aggregate of a
sequence's tokens (and so takes ``agg``, reads the statistics reduced over the ranks that split
a sequence, and counts sequences), and which advantage conditions and scopes it allows. The
filter's checks, the filters' plan, calibration, ``nemo-rs check``, ``calibrate`` and the
description read :data:`FILTER_LEVELS`; nothing else compares a level's name. A new level is one
entry here (and its name in ``rejection_filter.FilterLevel``, which a test holds equal to the keys).

References:
    - Token and sequence levels in one filter list: AReaL PR #1088,
      https://github.com/inclusionAI/AReaL/pull/1088
    - A positive-advantage condition and a policy-gradient-only scope on token filters: prime-rl's
      DPPO / IPO mask, https://docs.primeintellect.ai/prime-rl/algorithms
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["FILTER_LEVELS", "RejectionLevel", "rejection_level"]


@dataclass(frozen=True)
class RejectionLevel:
    """One filter level.

    Attributes:
        name: the ``level`` value.
        unit: what one rejection removes, singular (``a token``, ``a sequence``: ``unit`` with an article).
        units: the plural, as the reports count them.
        whole_sequences: rejects whole sequences from an aggregate (``agg``) of their tokens'
            statistic, decided on the per-sequence statistics reduced over ranks.
        advantage_signs: the ``advantage_sign`` values it allows (``null`` always).
        scopes: the ``applies_to`` values it allows.
    """

    name: str
    unit: str
    units: str
    whole_sequences: bool
    advantage_signs: tuple[str, ...]
    scopes: tuple[str, ...]


FILTER_LEVELS: dict[str, RejectionLevel] = {
    level.name: level
    for level in (
        RejectionLevel("token", "token", "tokens", False, ("negative", "positive"), ("loss", "policy_gradient")),
        # One sequence, one rejection: a sign condition on it is OPSM's (negative advantages);
        # its tokens' policy-gradient terms alone cannot be removed by a sequence decision.
        RejectionLevel("sequence", "sequence", "sequences", True, ("negative",), ("loss",)),
    )
}


def rejection_level(name: str) -> RejectionLevel:
    """The entry of ``name``; an unknown name is an error, never a default."""
    try:
        return FILTER_LEVELS[name]
    except KeyError:
        raise ValueError(f"level: got {name!r}; allowed: {', '.join(map(repr, FILTER_LEVELS))}") from None
