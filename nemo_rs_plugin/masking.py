"""Masked reductions shared by the loss and its metrics (pure torch, no host sync).

NeMo-RL divides every masked sum by ``denominator + 1e-8``; the same epsilon is kept here so
that results match NeMo-RL's loss to float precision.
"""

from __future__ import annotations

import torch

__all__ = ["EPS", "all_finite", "masked_extreme", "sanitize"]

EPS = 1e-8


def masked_extreme(values: torch.Tensor, mask: torch.Tensor, largest: bool) -> torch.Tensor:
    """Max (``largest``) or min of ``values`` where ``mask`` is true; ``-inf``/``inf`` if none.

    ``mask`` is boolean (pass it precomputed: this is called for several metrics per call).
    ``torch.where`` with a scalar keeps this to one pass and free of the host sync that
    boolean indexing would cost.
    """
    fill = float("-inf") if largest else float("inf")
    if values.numel() == 0:
        return torch.full((), fill, dtype=values.dtype, device=values.device)
    filled = torch.where(mask, values, fill)
    return filled.amax() if largest else filled.amin()


def sanitize(x: torch.Tensor) -> torch.Tensor:
    """``x`` with NaN and +-inf replaced by 0, in one pass (gradient 1 where finite, else 0).

    Replacing *before* any arithmetic matters for gradients: masking a NaN after ``exp`` still
    back-propagates ``0 * NaN = NaN``; a value replaced up front receives an exact zero.
    """
    return torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)


def all_finite(*tensors: torch.Tensor) -> torch.Tensor:
    """Boolean mask of positions where every tensor is finite.

    One ``isfinite`` of the sum instead of one per tensor: a NaN or an infinity in any
    summand makes the sum non-finite (``inf - inf`` is NaN). Log-probabilities are bounded
    far below the float range, so a finite sum of finite log-probs cannot overflow.
    """
    total = tensors[0].detach()
    for t in tensors[1:]:
        total = total + t.detach()
    return torch.isfinite(total)
