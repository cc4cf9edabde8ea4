"""Rejection bounds set from the mismatch a run measures, for a target rejection rate.

A fixed band is a guess about the mismatch. Geo-RS ``[0.99, 1.01]`` fits precision
mismatch (about 1e-3 nats per token, NeMo-RL PR #2269); under staleness the same band rejects
most of the batch (docs/lab.md#dose-response). :func:`calibrate_filters` reads per-token
log-probs of the user's own run (``prev`` from the trainer, ``gen`` from the sampler),
computes each filter's statistic exactly as the loss does (same functions, same stage
order: a filter sees the tokens the token filters listed before it kept), and returns the
bounds under which each stage rejects ``target`` of its units (sequences or valid tokens)
on that data, never narrower than the template's own bounds (``widen_only``):

* ``ratio`` (log space, ``x = log r`` or the aggregated log statistic), both sides:
  ``lower = exp(Q_low(target / 2))``, ``upper = exp(Q_high(1 - target / 2))``, then widened to
  contain 1 (an on-policy unit is never rejected). ``agg: any`` ranges ``Q_low`` over each
  row's minimum and ``Q_high`` over its maximum.
* every other statistic (a divergence: large is off-policy): ``upper = Q(1 - target)``.

The template's bounds say which sides exist: a ratio filter with one bound is calibrated on
that side alone (with the whole ``target``); a divergence keeps its lower bound as written.
``Q`` is the empirical quantile that leaves exactly ``floor(target * n)`` units beyond the bound (per side; fewer
when values tie at the bound, never more).

Bias and variance: a rejected unit leaves the loss, so rejection buys lower gradient
variance (the units with the largest weights go) with bias (the kept batch is no longer the
sampler's distribution) and a smaller effective batch. A band calibrated to a few percent
bounds that cost by construction; a fixed band copied from a smaller mismatch does not. The
band is frozen after calibration: if the mismatch grows later, the rejection rate grows
with it and shows in ``rs_seq_rejected_frac`` (and the run-time warning of
:mod:`nemo_rs_plugin.core.reporting.health`), instead of being absorbed silently.

Pure torch on ``[B, T]`` tensors; no NeMo-RL, no collective (calibration reads a whole
dump on one process).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from nemo_rs_plugin.core.correction.filters import (
    PolicyLogProbs,
    filter_statistic,
    plan_sequence_filter,
    plan_token_filter,
    sequence_filter_statistic,
)
from nemo_rs_plugin.core.masking import TokenMasks, log_ratio, out_of_bounds
from nemo_rs_plugin.core.registries.filter_options import LOG_RATIOS
from nemo_rs_plugin.core.registries.filter_statistics import filter_statistic_entry
from nemo_rs_plugin.core.settings.config import RejectionFilter

__all__ = [
    "CALIBRATABLE_LOG_RATIOS",
    "CalibratedStage",
    "band_for_rejection",
    "calibrate_filters",
    "rejected_fractions",
]

# Bounds move outward by this much (in the statistic's space) so that the unit at the quantile
# stays kept after the round trip through exp/log and the loss's float32 arithmetic.
_MARGIN = 1e-6

#: The log-ratios a dump of ``prev`` and ``gen`` determines (``curr`` exists only in training).
CALIBRATABLE_LOG_RATIOS = tuple(name for name, r in LOG_RATIOS.items() if not r.reads_current_policy)


@dataclass(frozen=True)
class CalibratedStage:
    """One stage after calibration: the filter with its new bounds, and what it does on the data."""

    filter: RejectionFilter
    units: int
    """Units the stage decided on (sequences with a token at the stage, or valid tokens)."""
    rejected_frac: float
    """Fraction of those units the calibrated bounds reject on the calibration data."""
    quantiles: dict[str, float]
    """The statistic's distribution on the data (in the bounds' space): p1, p50, p99."""


def band_for_rejection(
    low_values: torch.Tensor,
    high_values: torch.Tensor,
    target: float,
    sides: tuple[bool, bool],
    log_space: bool,
) -> tuple[Optional[float], Optional[float]]:
    """``(lower, upper)`` rejecting about ``target`` of the units (``None``: side not calibrated).

    ``low_values`` are compared with the lower bound and ``high_values`` with the upper (the
    same tensor except for ``agg: any``); ``sides`` says which bounds to set; the target is
    split evenly between two sides. In log space the bounds are returned as ratios,
    widened to contain 1.
    """
    if not 0.0 <= target < 1.0:
        raise ValueError(f"target rejection: got {target}; allowed: 0 <= target < 1")
    if low_values.numel() == 0:
        raise ValueError("no unit to calibrate on (every sequence empty or masked)")
    per_side = target / (int(sides[0]) + int(sides[1]))
    lower = upper = None
    # k units strictly beyond each calibrated bound: the bound is the (k+1)-th most extreme value.
    k = math.floor(per_side * low_values.numel() + 1e-9)
    if sides[0]:
        q = float(low_values.double().sort().values[k]) - _MARGIN
        lower = min(math.exp(q), 1.0) if log_space else q
    if sides[1]:
        q = float(high_values.double().sort(descending=True).values[k]) + _MARGIN
        upper = max(math.exp(q), 1.0) if log_space else q
    return lower, upper


def _sides(f: RejectionFilter) -> tuple[bool, bool]:
    """Which bounds to calibrate: a ratio's set bounds; a divergence's upper (else its lower)."""
    if filter_statistic_entry(f.statistic).log_space:
        return f.lower is not None, f.upper is not None
    return f.upper is None, f.upper is not None


def _quantiles(values: torch.Tensor, log_space: bool) -> dict[str, float]:
    q = torch.quantile(values.double(), torch.tensor([0.01, 0.5, 0.99], dtype=torch.float64)).tolist()
    if log_space:
        q = [math.exp(v) for v in q]
    return dict(zip(("p1", "p50", "p99"), q))


def calibrate_filters(
    filters: Sequence[RejectionFilter],
    prev: torch.Tensor,
    gen: torch.Tensor,
    mask: torch.Tensor,
    target: float,
    widen_only: bool = True,
) -> list[CalibratedStage]:
    """Each stage's bounds for ``target`` rejection of its units on ``[B, T]`` log-probs.

    Args:
        filters: the stages, in order (their bounds are templates: which sides to set).
        prev: the trainer's log-probs of the sampled tokens (``prev_logprobs``).
        gen: the sampler's (``generation_logprobs``).
        mask: ``[B, T]`` valid response tokens (``token_mask * sample_mask``).
        target: the fraction of each stage's units to reject on this data, ``[0, 1)``.
        widen_only: keep the template's bounds as the innermost band: calibration only
            widens a band that rejects more than ``target`` (the default). Without it the
            band is the quantile band, however narrow: on a near-zero mismatch it is then
            narrower than any mismatch that matters, and rejects ``target`` of data that
            needs no correction (docs/guide.md#calibrate-from-your-run: what the lab measured).

    A later stage is calibrated on the tokens the calibrated earlier token stages keep, as
    the loss evaluates it.
    """

    def calibrate(f: RejectionFilter, low: torch.Tensor, high: torch.Tensor) -> RejectionFilter:
        lower, upper = band_for_rejection(low, high, target, _sides(f), filter_statistic_entry(f.statistic).log_space)
        if widen_only:
            lower = lower if lower is None or f.lower is None else min(lower, f.lower)
            upper = upper if upper is None or f.upper is None else max(upper, f.upper)
        update = {"lower": f.lower if lower is None else lower, "upper": f.upper if upper is None else upper}
        return RejectionFilter.model_validate({**f.model_dump(exclude_none=True), **update})

    return _stages(filters, prev, gen, mask, calibrate)


def rejected_fractions(
    filters: Sequence[RejectionFilter], prev: torch.Tensor, gen: torch.Tensor, mask: torch.Tensor
) -> list[float]:
    """What each stage's bounds as written reject of its units on the data (stage order as the loss)."""
    return [st.rejected_frac for st in _stages(filters, prev, gen, mask, lambda f, low, high: f)]


def _stages(filters, prev, gen, mask, choose) -> list[CalibratedStage]:
    """Walk the stages as the loss does; ``choose(template, low, high)`` gives each stage's filter."""
    bad = [f.label for f in filters if f.log_ratio_entry.reads_current_policy]
    if bad:
        raise ValueError(
            f"filters {', '.join(bad)}: log_ratio reads the current policy, which a dump of prev and "
            f"gen does not have; allowed: {', '.join(CALIBRATABLE_LOG_RATIOS)}"
        )
    prev, gen = prev.detach().double(), gen.detach().double()
    d, d_finite = log_ratio(prev, gen)
    valid = mask.to(d.dtype)
    masks = TokenMasks.build(valid, torch.ones(valid.shape[0], dtype=d.dtype), d_finite, d_finite, valid=valid)
    log_probs = PolicyLogProbs(curr=prev, prev=prev, gen=gen)
    big = torch.finfo(d.dtype).max
    alive = masks.valid_bin
    out: list[CalibratedStage] = []
    for template in filters:
        stat, f_finite = filter_statistic(template, d, masks, log_probs)
        if not template.level_entry.whole_sequences:
            units = (alive * f_finite) > 0
            low = high = stat[units]
        else:
            s = plan_sequence_filter(template, stat, f_finite, alive, None, big)
            low, high = sequence_filter_statistic(template, s)
            units = (s.count > 0) & (s.nonfinite == 0)
            low, high = low[units], high[units]
        if low.numel() == 0:
            raise ValueError(f"stage {template.label}: no unit to calibrate on (every sequence empty or masked)")
        f = choose(template, low, high)
        if not f.level_entry.whole_sequences:
            stage, kept = plan_token_filter(f, stat, f_finite, alive, None)
            # A policy-gradient-only filter leaves the later stages' tokens alone, so each such
            # stage is calibrated on every token still in the loss; the loss's own per-stage
            # metric counts a token only in the first of them that removes its term (two
            # overlapping ones: the second reports less than its calibrated share).
            if f.scope_entry.leaves_loss:
                alive = kept
            rejected = float(stage.rejected.sum()) / low.numel()
        else:
            rejected = _sequence_rejected_frac(f, low, high)
        values = low if low is high else torch.cat([low, high])
        out.append(
            CalibratedStage(
                f, int(low.numel()), rejected, _quantiles(values, filter_statistic_entry(f.statistic).log_space)
            )
        )
    return out


def _sequence_rejected_frac(f: RejectionFilter, low: torch.Tensor, high: torch.Tensor) -> float:
    """Fraction of rows the filter's bounds reject (the loss's bound rule, the filter's ``bounds``)."""
    lo, hi = f.bounds
    rejected = out_of_bounds(low, lo, None) | out_of_bounds(high, None, hi)
    return float(rejected.double().mean()) if rejected.numel() else 0.0
