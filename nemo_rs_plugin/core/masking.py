"""Masked reductions shared by the loss and its metrics (pure torch, no host sync).

NeMo-RL divides every masked sum by ``denominator + 1e-8``; the same epsilon is kept here so
that results match NeMo-RL's loss to float precision.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

__all__ = [
    "EPS",
    "TokenMasks",
    "extrema_penalty",
    "finite_exp",
    "log_ratio",
    "masked_sum",
    "nonfinite",
    "out_of_bounds",
    "sanitize",
]

EPS = 1e-8


def row_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``(a * b).sum(-1)`` of two ``[B, T]`` tensors of one dtype: ``[B]``, as one batched matrix product.

    One kernel and no ``[B, T]`` temporary, where the product and the sum are two of each (the
    per-sequence statistics take several of these on every call).
    """
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(-1)).reshape(a.shape[0])  # [B, 1, 1] -> [B], a view


def masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``sum(values * mask)``, as one dot product when the shapes match.

    No ``[B, T]`` temporary is allocated; differentiable in ``values``.
    """
    if values.shape == mask.shape and values.dtype == mask.dtype:
        return torch.dot(values.reshape(-1), mask.reshape(-1))
    return (values * mask).sum()


def extrema_penalty(mask: torch.Tensor) -> torch.Tensor:
    """Additive penalty for masked extrema: 0 where the 0/1 ``mask`` is 1, ``finfo.max`` elsewhere.

    ``(x + penalty).amin()`` and ``(x - penalty).amax()`` are the extremes of finite ``x`` over
    the mask (an empty mask gives the ``+-finfo.max`` sentinels): no ``torch.where``, no
    boolean indexing, no host sync. See :meth:`~nemo_rs_plugin.core.reporting.metrics.MetricSet.add_masked_extrema`.
    """
    big = torch.finfo(mask.dtype).max
    return torch.rsub(mask, big, alpha=big)  # big - big * m = (1 - m) * big for a 0/1 mask, exactly: one operator


def nonfinite(x: torch.Tensor) -> torch.Tensor:
    """0/1 float mask of NaN and +-inf entries (``x - x`` is 0 exactly where ``x`` is finite)."""
    x = x.detach()
    return (x - x).nan_to_num_(nan=1.0, posinf=1.0, neginf=1.0)  # one [B, T] allocation


def out_of_bounds(
    x: torch.Tensor, lower: Optional[float], upper: Optional[float], clamped: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Boolean: ``x`` outside the inclusive ``[lower, upper]`` (a ``None`` bound is open); NaN is outside.

    The one bound check of the package (filters, truncation, sequence decisions): ``x`` differs
    from its clamp exactly when it lies outside, and ``NaN != NaN``. Two kernels, no host sync;
    one where the caller has ``clamped``, ``x.clamp(lower, upper)`` (token TIS keeps it as the weight).
    """
    if lower is None and upper is None:
        return x != x
    return x != (x.clamp(lower, upper) if clamped is None else clamped)


def finite_exp(x: torch.Tensor) -> torch.Tensor:
    """``exp(x)`` with non-finite results set to 0, as NeMo-RL's ``nan_to_num`` does.

    A weight that overflows float32 (``exp(x) = inf``) or comes from a NaN log-ratio gets
    weight 0: such a unit cannot be corrected, only rejected.
    """
    return torch.nan_to_num(torch.exp(x), nan=0.0, posinf=0.0, neginf=0.0)


def log_ratio(prev: torch.Tensor, gen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d, d_finite)`` for ``d = prev - gen``, detached.

    ``d`` has non-finite entries replaced by 0 and ``d_finite`` is the 0/1 float mask of the
    entries that were finite.
    """
    d_raw = (prev - gen).detach()
    return sanitize(d_raw), 1.0 - nonfinite(d_raw)


def sanitize(x: torch.Tensor) -> torch.Tensor:
    """``x`` with NaN and +-inf replaced by 0, in one pass (gradient 1 where finite, else 0).

    Replacing *before* any arithmetic matters for gradients: masking a NaN after ``exp`` still
    back-propagates ``0 * NaN = NaN``; a value replaced up front receives an exact zero.
    """
    return torch.nan_to_num(x, nan=_REPLACED, posinf=_REPLACED, neginf=_REPLACED)


def sanitize_(x: torch.Tensor) -> torch.Tensor:
    """:func:`sanitize` in place, for a tensor the caller owns and reads no more as it was (no gradient)."""
    return x.nan_to_num_(nan=_REPLACED, posinf=_REPLACED, neginf=_REPLACED)


#: What :func:`sanitize` and :func:`sanitize_` put in place of NaN and +-inf.
_REPLACED = 0.0


@dataclass(frozen=True)
class TokenMasks:
    """The masks of one microbatch, built once and shared by the correction, the loss and the metrics.

    ``[B, T]`` float 0/1 unless noted:

    * ``token_mask``: as the caller gave it (integer, bool or float);
    * ``sample_mask``: ``[B]`` float;
    * ``valid``: ``token_mask * sample_mask`` (fractional with weighted samples);
    * ``valid_bin``: 1 where ``valid`` is non-zero;
    * ``d_finite``: ``prev - gen`` was finite;
    * ``inputs_finite``: every log-prob input (``curr``, ``prev - gen``, the reference) was finite;
    * ``usable_bin``: ``valid_bin * inputs_finite``, the tokens per-token extremes range over,
      and ``usable_penalty`` its :func:`extrema_penalty`;
    * ``valid_total``, ``sample_total``: ``[]`` sums of ``valid`` and ``sample_mask``, this
      microbatch's own counts, summed once for every reader (the input checks, the ESS's units,
      ``num_valid_samples``);
    * ``all_finite``: every input is known finite (read on the host, eager CPU only): the
      two finite masks are one read-only ``[B, T]`` view of a single 1 and ``usable_bin`` is
      ``valid_bin``.
    """

    token_mask: torch.Tensor
    sample_mask: torch.Tensor
    valid: torch.Tensor
    valid_bin: torch.Tensor
    d_finite: torch.Tensor
    inputs_finite: torch.Tensor
    usable_bin: torch.Tensor
    usable_penalty: torch.Tensor
    valid_total: torch.Tensor
    sample_total: torch.Tensor
    all_finite: bool = False

    @classmethod
    def build(
        cls,
        token_mask: torch.Tensor,
        sample_mask: torch.Tensor,
        d_finite: torch.Tensor,
        inputs_finite: torch.Tensor,
        valid: Optional[torch.Tensor] = None,
    ) -> "TokenMasks":
        """The masks from the caller's two and the finite masks (``valid``: their product, when the caller has it).

        The masks are in ``d_finite``'s dtype.
        """
        sample_mask, valid, valid_bin = _valid_masks(token_mask, sample_mask, valid, d_finite.dtype)
        return cls._with(token_mask, sample_mask, valid, valid_bin, d_finite, inputs_finite, valid_bin * inputs_finite)

    @classmethod
    def build_all_finite(
        cls,
        token_mask: torch.Tensor,
        sample_mask: torch.Tensor,
        dtype: torch.dtype,
        valid: Optional[torch.Tensor] = None,
    ) -> "TokenMasks":
        """The masks when every input is known finite (read on the host): in ``dtype``, ``usable_bin = valid_bin``.

        The two finite masks are a broadcast view of a single 1: nothing allocated, and no
        in-place write can hit it.
        """
        sample_mask, valid, valid_bin = _valid_masks(token_mask, sample_mask, valid, dtype)
        ones = valid_bin.new_ones(()).expand(valid_bin.shape)
        return cls._with(token_mask, sample_mask, valid, valid_bin, ones, ones, valid_bin, all_finite=True)

    @classmethod
    def _with(
        cls,
        token_mask: torch.Tensor,
        sample_mask: torch.Tensor,
        valid: torch.Tensor,
        valid_bin: torch.Tensor,
        d_finite: torch.Tensor,
        inputs_finite: torch.Tensor,
        usable_bin: torch.Tensor,
        all_finite: bool = False,
    ) -> "TokenMasks":
        return cls(
            token_mask=token_mask,
            sample_mask=sample_mask,
            valid=valid,
            valid_bin=valid_bin,
            d_finite=d_finite,
            inputs_finite=inputs_finite,
            usable_bin=usable_bin,
            usable_penalty=extrema_penalty(usable_bin),
            valid_total=valid.sum(),
            sample_total=sample_mask.sum(),
            all_finite=all_finite,
        )

    def where_inputs_finite(self, x: torch.Tensor) -> torch.Tensor:
        """``x * inputs_finite``: 0 where an input was not finite (``x`` itself when every input is)."""
        return x if self.all_finite else x * self.inputs_finite

    def nonfinite_d_per_sequence(self) -> torch.Tensor:
        """``[B]``: per sequence, the valid tokens whose ``prev - gen`` was not finite."""
        if self.all_finite:
            return torch.zeros_like(self.sample_mask)
        return row_dot(self.valid_bin, 1.0 - self.d_finite)


def _valid_masks(
    token_mask: torch.Tensor, sample_mask: torch.Tensor, valid: Optional[torch.Tensor], dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``sample_mask``, ``valid = token_mask * sample_mask`` (unless given) and ``valid_bin``, in ``dtype``."""
    sample_mask = sample_mask.to(dtype)
    if valid is None:
        valid = token_mask * sample_mask.unsqueeze(-1)
    if valid.dtype != dtype:
        valid = valid.to(dtype)
    return sample_mask, valid, torch.sign(valid)
