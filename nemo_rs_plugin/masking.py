"""Masked reductions shared by the loss and its metrics (pure torch, no host sync).

NeMo-RL divides every masked sum by ``denominator + 1e-8``; the same epsilon is kept here so
that results match NeMo-RL's loss to float precision.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = [
    "EPS",
    "extrema_penalty",
    "finite_exp",
    "log_ratio",
    "masked_extrema",
    "masked_sum",
    "nonfinite",
    "outside",
    "sanitize",
]

EPS = 1e-8


def masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``sum(values * mask)``, as one dot product when the shapes match.

    No ``[B, T]`` temporary is allocated; differentiable in ``values``.
    """
    if values.shape == mask.shape and values.dtype == mask.dtype:
        return torch.dot(values.reshape(-1), mask.reshape(-1))
    return (values * mask).sum()


def extrema_penalty(mask: torch.Tensor) -> torch.Tensor:
    """The additive penalty that :func:`masked_extrema` uses for a 0/1 ``mask`` (reusable)."""
    return (1.0 - mask) * torch.finfo(mask.dtype).max


def masked_extrema(
    values: torch.Tensor, mask: torch.Tensor, penalty: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(min, max)`` of finite ``values`` where the 0/1 float ``mask`` is 1.

    With an empty mask the result is ``(finfo.max, -finfo.max)`` or beyond: a sentinel that
    :class:`~nemo_rs_plugin.metrics.MetricSet` reports as ``(inf, -inf)``. ``penalty``
    (:func:`extrema_penalty` of the mask) can be passed to share it between calls.

    Masked entries are pushed past half the float range by adding the penalty, instead of
    ``torch.where`` or boolean indexing: no host sync, and on CPU float arithmetic is several
    times faster than ops on boolean tensors.
    """
    big = torch.finfo(values.dtype).max
    if values.numel() == 0:
        return values.new_full((), big), values.new_full((), -big)
    if penalty is None:
        penalty = extrema_penalty(mask.to(values.dtype))
    return (values + penalty).amin(), (values - penalty).amax()


def nonfinite(x: torch.Tensor) -> torch.Tensor:
    """0/1 float mask of NaN and +-inf entries (``x - x`` is 0 exactly where ``x`` is finite)."""
    return torch.nan_to_num((x - x).detach(), nan=1.0, posinf=1.0, neginf=1.0)


def outside(x: torch.Tensor, lower: Optional[float], upper: Optional[float]) -> torch.Tensor:
    """0/1 float mask of ``x`` outside ``[lower, upper]`` (finite ``x``), without bool ops."""
    return torch.sign((x - x.clamp(lower, upper)).abs())


def finite_exp(x: torch.Tensor) -> torch.Tensor:
    """``exp(x)`` with non-finite results set to 0, as NeMo-RL's ``nan_to_num`` does.

    A weight that overflows float32 (``exp(x) = inf``) or comes from a NaN log-ratio gets
    weight 0: such a unit cannot be corrected, only rejected.
    """
    return torch.nan_to_num(torch.exp(x), nan=0.0, posinf=0.0, neginf=0.0)


def log_ratio(prev: torch.Tensor, gen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(d_raw, d, d_finite)`` for ``d = prev - gen``, detached.

    ``d`` has non-finite entries replaced by 0 and ``d_finite`` is the 0/1 float mask of the
    entries that were finite; ``d_raw`` is kept for finiteness checks of other inputs.
    """
    d_raw = (prev - gen).detach()
    return d_raw, sanitize(d_raw), 1.0 - nonfinite(d_raw)


def sanitize(x: torch.Tensor) -> torch.Tensor:
    """``x`` with NaN and +-inf replaced by 0, in one pass (gradient 1 where finite, else 0).

    Replacing *before* any arithmetic matters for gradients: masking a NaN after ``exp`` still
    back-propagates ``0 * NaN = NaN``; a value replaced up front receives an exact zero.
    """
    return torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)
