"""The IS correction levels: one entry per level (``is_correction_level``), read by everything else.

An entry says whether the level weighs each token or each sequence, its formula as text
(``d = prev - gen`` per token, ``m`` the valid tokens of a sequence, ``n = sum_t m_t``), the
log-weight of a sequence from its reduced statistics, and how a unit is worded. The loss
(:func:`~nemo_rs_plugin.core.correction.weights.is_weights`), the metrics, batch
normalisation, ``nemo-rs check``'s description, the configuration reference and the guide's
table all read :data:`IS_LEVELS`; nothing else compares a level's name. A new level is one
entry here (and its name in ``config.ISCorrectionLevel``, which a test holds equal to the keys).

References:
    - The levels, ``sequence_mean`` among them: NeMo-RL PR #2269, "decouple IS correction level from
      GSPO policy ratio", https://github.com/NVIDIA-NeMo/RL/pull/2269
    - The length normalisation ``sequence_mean`` takes from GSPO: Zheng et al., "Group Sequence Policy
      Optimization", https://arxiv.org/abs/2507.18071
    - ``token`` / ``sequence`` TIS ratio types: SkyRL PR #849, https://github.com/NovaSky-AI/SkyRL/pull/849
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from nemo_rs_plugin.core.masking import EPS

__all__ = ["IS_LEVELS", "ISLevel", "is_level", "is_levels_text"]


@dataclass(frozen=True)
class ISLevel:
    """One IS correction level.

    Attributes:
        name: the ``is_correction_level`` value.
        formula: the weight, as the docs state it.
        unit: how ``nemo-rs check`` words the unit a weight belongs to.
        sequence_log_weight: per-sequence levels: ``(sum_t m_t d_t, n) -> log w`` (``[B]``),
            from the statistics reduced over the ranks that split a sequence; ``None`` for a
            per-token level (its weight is ``exp(d_t)`` itself).
        grows_with_length: the log-weight is a sum over the response's tokens, so its spread
            grows like ``sqrt(length)`` (``nemo-rs check`` warns on long responses).
    """

    name: str
    formula: str
    unit: str
    sequence_log_weight: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = None
    grows_with_length: bool = False
    #: A weight per valid token (``[B, T]``), else one per sequence (``[B, 1]``): no
    #: ``sequence_log_weight``. A field, not a property: the loss reads it several times per call.
    per_token: bool = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "per_token", self.sequence_log_weight is None)


IS_LEVELS: dict[str, ISLevel] = {
    level.name: level
    for level in (
        ISLevel("token", "w_t = exp(d_t)", "per token"),
        ISLevel(
            "sequence",
            "w = exp(sum_t m_t d_t)",
            "per sequence (product)",
            sequence_log_weight=lambda d_sum, n: d_sum,  # noqa: ARG005 - the product ignores n
            grows_with_length=True,
        ),
        ISLevel(
            "sequence_mean",
            "w = exp(sum_t m_t d_t / n)",
            "per sequence (geometric mean)",
            sequence_log_weight=lambda d_sum, n: d_sum / (n + EPS),
        ),
    )
}


def is_level(name: str) -> ISLevel:
    """The entry of ``name``; an unknown name is an error, never a default."""
    try:
        return IS_LEVELS[name]
    except KeyError:
        raise ValueError(f"is_correction_level: got {name!r}; allowed: {', '.join(map(repr, IS_LEVELS))}") from None


def is_levels_text() -> str:
    """Every level and its formula, as the config's field description and docstrings state them."""
    return "; ".join(f"``{lvl.name}``: ``{lvl.formula}``" for lvl in IS_LEVELS.values())
