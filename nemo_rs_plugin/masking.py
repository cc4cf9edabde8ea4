"""Masked reductions shared by the loss and its metrics (pure torch, no host sync).

NeMo-RL divides every masked sum by ``denominator + 1e-8``; the same epsilon is kept here so
that results match NeMo-RL's loss to float precision.
"""

from __future__ import annotations

import torch

__all__ = ["EPS", "masked_extreme", "sanitize"]

EPS = 1e-8


def masked_extreme(values: torch.Tensor, mask: torch.Tensor, largest: bool) -> torch.Tensor:
    """Max (``largest``) or min of ``values`` where ``mask`` is nonzero; ``-inf``/``inf`` if none.

    ``torch.where`` keeps this free of the host sync that boolean indexing would cost.
    """
    fill = float("-inf") if largest else float("inf")
    filled = torch.where(mask != 0, values, torch.full_like(values, fill))
    if filled.numel() == 0:
        return torch.full((), fill, dtype=values.dtype, device=values.device)
    return filled.amax() if largest else filled.amin()


def sanitize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(x with non-finite entries replaced by 0, finite mask)``.

    Replacing *before* any arithmetic matters for gradients: masking a NaN after ``exp`` still
    back-propagates ``0 * NaN = NaN``; a value replaced up front receives an exact zero.
    """
    finite = torch.isfinite(x)
    return torch.where(finite, x, torch.zeros_like(x)), finite
