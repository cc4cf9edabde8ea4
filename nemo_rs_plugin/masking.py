"""Masked reductions shared by the loss and its metrics (pure torch, no host sync).

NeMo-RL divides every masked sum by ``denominator + 1e-8``; the same epsilon is kept here so
that results match NeMo-RL's loss to float precision.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

__all__ = ["EPS", "masked_sum", "masked_mean", "masked_extreme", "sanitize"]

EPS = 1e-8

Number = Union[float, torch.Tensor]


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """``sum(values * mask)`` over ``dim`` (all elements when ``None``)."""
    prod = values * mask
    return prod.sum() if dim is None else prod.sum(dim=dim)


def masked_mean(
    values: torch.Tensor,
    mask: torch.Tensor,
    dim: Optional[int] = None,
    denominator: Optional[Number] = None,
) -> torch.Tensor:
    """``sum(values * mask) / (denominator + 1e-8)``; the denominator defaults to ``sum(mask)``.

    Passing NeMo-RL's ``global_valid_toks`` / ``global_valid_seqs`` as ``denominator`` makes
    per-microbatch values sum to the global mean over all microbatches.
    """
    if denominator is None:
        denominator = mask.sum() if dim is None else mask.sum(dim=dim)
    return masked_sum(values, mask, dim) / (denominator + EPS)


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
