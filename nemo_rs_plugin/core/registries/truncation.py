"""NeMo-RL's IS truncation types: one entry per ``truncated_importance_sampling_type``.

An entry says what the type does to a weight (its formula, as the docs state it, with ``w``
the untruncated weight at the chosen IS level and ``g = exp(sum_t m_t d_t / n)`` a sequence's
geometric-mean ratio), whether it zeroes units (a rejection in all but name) or clamps them,
whether it decides per sequence from the reduced statistics, whether it needs a lower bound,
and how ``nemo-rs check`` words it. The weights (:func:`truncate_weights`), the statistics
plan, the configuration's checks and warnings, ``nemo-rs check``, ``simulate`` and the lab read
:data:`TRUNCATIONS`; nothing else compares a type's name. A new type is one entry here (and its
name in ``config.TruncationType``, which a test holds equal to the keys).

References:
    - ``tis``: TIS, Yao, Liu et al., "Your Efficient RL Framework Secretly Brings You Off-Policy RL
      Training", https://fengyao.notion.site/off-policy-rl
    - ``icepop``: IcePop (Ant Group's Ling team), https://ringtech.notion.site/icepop; the Ring-1T report,
      https://arxiv.org/abs/2510.18855
    - ``seq-mask-tis``: NeMo-RL PR #1899, https://github.com/NVIDIA-NeMo/RL/pull/1899, after Liu, Li et
      al., "When Speed Kills Stability: Demystifying RL Collapse from the Training-Inference Mismatch",
      https://yingru.notion.site/When-Speed-Kills-Stability-Demystifying-RL-Collapse-from-the-Training-Inference-Mismatch-271211a558b7808d8b12d403fd15edda
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from nemo_rs_plugin.core.masking import out_of_bounds

__all__ = ["TRUNCATIONS", "Truncation", "truncation", "truncations_text"]

#: ``(raw weight [B, T] or [B, 1], lower, upper, a sequence's mean log-ratio [B] or None)``
#: ``-> (weight, out-of-bounds mask as the weight's dtype)``.
Truncate = Callable[
    [torch.Tensor, Optional[float], Optional[float], Optional[torch.Tensor]], tuple[torch.Tensor, torch.Tensor]
]


@dataclass(frozen=True)
class Truncation:
    """One truncation type.

    Attributes:
        name: the ``truncated_importance_sampling_type`` value.
        formula: the truncated weight, as the docs state it.
        summary: what it does, in words (the config's field description, after the name).
        label: how ``nemo-rs check`` names it after the bounds.
        truncate: the weight and its out-of-bounds mask (:data:`Truncate`).
        zeroes_units: weights outside the band become 0 (the unit leaves the gradient, as a
            rejection does), rather than being clamped to the band.
        per_sequence: the decision is per sequence, from its geometric-mean ratio: it reads the
            per-sequence statistics reduced over the ranks that split a sequence, its metric
            ``is_oob_ratio`` counts sequences, and ``check`` reports it beside the sequence filters.
        requires_lower: ``truncated_importance_sampling_ratio_min`` must be set.
        reference_lower: the lower bound the error message suggests (``None``: not required).
    """

    name: str
    formula: str
    summary: str
    label: str
    truncate: Truncate
    zeroes_units: bool
    per_sequence: bool = False
    requires_lower: bool = False
    reference_lower: Optional[float] = None

    def describe(self, lower: Optional[float], upper: Optional[float]) -> str:
        """``nemo-rs check``'s line: what the type does with these bounds."""
        if not self.zeroes_units:
            return f"truncation: clamp the weight to [{lower or 0.0:g}, {upper:g}] ({self.label})"
        if self.per_sequence:
            return (
                "truncation: weight 0 for sequences whose geometric-mean ratio is outside "
                f"[{lower:g}, {upper:g}], others untruncated ({self.label})"
            )
        return f"truncation: weight 0 outside [{lower:g}, {upper:g}] ({self.label})"


def _clamp(w: torch.Tensor, lower: Optional[float], upper: Optional[float], _: Optional[torch.Tensor]):
    lower = 0.0 if lower is None else lower
    clamped = w.clamp(lower, upper)
    return clamped, out_of_bounds(w, lower, upper, clamped).to(w.dtype)


def _zero_outside(w: torch.Tensor, lower: Optional[float], upper: Optional[float], _: Optional[torch.Tensor]):
    oob = out_of_bounds(w, lower, upper)
    return w.masked_fill(oob, 0.0), oob.to(w.dtype)


def _zero_sequences_outside(
    w: torch.Tensor, lower: Optional[float], upper: Optional[float], seq_mean_log_ratio: Optional[torch.Tensor]
):
    if seq_mean_log_ratio is None:
        raise ValueError("truncated_importance_sampling_type 'seq-mask-tis' needs seq_mean_log_ratio")
    oob = out_of_bounds(torch.exp(seq_mean_log_ratio), lower, upper)  # [B]
    return w.masked_fill(oob.unsqueeze(-1), 0.0), oob.to(w.dtype)


TRUNCATIONS: dict[str, Truncation] = {
    t.name: t
    for t in (
        Truncation("tis", "w' = clamp(w, min or 0, max)", "clamps every weight into the band", "TIS", _clamp, False),
        Truncation(
            "icepop",
            "w' = w if min <= w <= max, else 0",
            "zeroes the weights outside the band",
            "icepop / MIS",
            _zero_outside,
            True,
            requires_lower=True,
            reference_lower=0.5,
        ),
        Truncation(
            "seq-mask-tis",
            "w' = w if min <= g <= max, else 0",
            "zeroes the sequences whose geometric-mean ratio is outside the band, keeps the others' weights "
            "untruncated",
            "seq-mask-tis",
            _zero_sequences_outside,
            True,
            per_sequence=True,
            requires_lower=True,
            reference_lower=0.999,
        ),
    )
}


def truncation(name: str) -> Truncation:
    """The entry of ``name``; an unknown name is an error, never a default."""
    try:
        return TRUNCATIONS[name]
    except KeyError:
        allowed = ", ".join(map(repr, TRUNCATIONS))
        raise ValueError(f"truncated_importance_sampling_type: got {name!r}; allowed: {allowed}") from None


def truncations_text() -> str:
    """Every type and its formula, as the config's field description states them."""
    return "; ".join(f"``{t.name}`` {t.summary}: ``{t.formula}``" for t in TRUNCATIONS.values())
