"""Masked reductions shared by the loss and its metrics (pure torch, no host sync).

NeMo-RL divides every masked sum by ``denominator + 1e-8``; the same epsilon is kept here so
that results match NeMo-RL's loss to float precision.
"""

from __future__ import annotations

import torch

__all__ = ["EPS", "masked_extreme", "nonfinite", "outside", "sanitize"]

EPS = 1e-8


def masked_extreme(values: torch.Tensor, mask: torch.Tensor, largest: bool) -> torch.Tensor:
    """Max (``largest``) or min of finite ``values`` where the 0/1 float ``mask`` is 1;
    ``-inf``/``inf`` when the mask is empty.

    Masked entries are pushed to the float limit with arithmetic instead of ``torch.where``
    or boolean indexing: no host sync, and on CPU float arithmetic is several times faster
    than ops on boolean tensors.
    """
    fill = float("-inf") if largest else float("inf")
    if values.numel() == 0:
        return torch.full((), fill, dtype=values.dtype, device=values.device)
    big = torch.finfo(values.dtype).max
    if largest:
        out = (values * mask - (1.0 - mask) * big).amax()
        return torch.where(out <= -big, torch.full_like(out, fill), out)
    out = (values * mask + (1.0 - mask) * big).amin()
    return torch.where(out >= big, torch.full_like(out, fill), out)


def nonfinite(x: torch.Tensor) -> torch.Tensor:
    """0/1 float mask of NaN and +-inf entries (``x - x`` is 0 exactly where ``x`` is finite)."""
    return torch.nan_to_num((x - x).detach(), nan=1.0, posinf=1.0, neginf=1.0)


def outside(x: torch.Tensor, lower: float, upper: float) -> torch.Tensor:
    """0/1 float mask of ``x`` outside ``[lower, upper]`` (finite ``x``), without bool ops."""
    return torch.sign((x - x.clamp(lower, upper)).abs())


def sanitize(x: torch.Tensor) -> torch.Tensor:
    """``x`` with NaN and +-inf replaced by 0, in one pass (gradient 1 where finite, else 0).

    Replacing *before* any arithmetic matters for gradients: masking a NaN after ``exp`` still
    back-propagates ``0 * NaN = NaN``; a value replaced up front receives an exact zero.
    """
    return torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)
