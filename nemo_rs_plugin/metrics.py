"""Metric collection with one host transfer per loss call.

NeMo-RL's loss calls ``.item()`` about fifteen times per call, each a host-device sync on
GPU. Here every metric stays a 0-dim tensor until :meth:`MetricSet.finalize`, which reduces
them over the sequence groups (so every rank reports identical values) and moves them to the
host in a single ``tolist()``.

Each metric carries:

* a **normalization** (``tokens``, ``sequences`` or ``none``): the global denominator its
  per-microbatch value was divided by, so that summing over microbatches (as NeMo-RL's
  drivers do) gives the global value; ``none`` marks raw counts and extrema;
* a **reduction** over ranks that split a sequence: ``sum`` (partial sums of local tokens),
  ``replicated`` (already identical on every rank), ``max`` or ``min``.
"""

from __future__ import annotations

from typing import Callable, Literal

import torch

from nemo_rs_plugin.distributed import NO_GROUPS, SequenceGroups, reduce_sequence_statistics

__all__ = ["MetricSet", "Normalization", "Reduction"]

Normalization = Literal["tokens", "sequences", "none"]
Reduction = Literal["sum", "replicated", "max", "min"]


class MetricSet:
    """Ordered metric tensors with their normalization and cross-rank reduction."""

    def __init__(self) -> None:
        self._entries: dict[str, tuple[torch.Tensor, str, str]] = {}
        self._checks: list[tuple[str, Callable[[dict[str, float]], Exception]]] = []

    def add(self, name: str, value: torch.Tensor, normalization: str, reduction: str) -> None:
        """Record a 0-dim tensor (never synced here).

        ``min``/``max`` entries may hold ``+-finfo.max`` for "no unit" (see
        :func:`~nemo_rs_plugin.masking.masked_extrema`); :meth:`finalize` reports them as
        ``+-inf``, as NeMo-RL does.
        """
        if value.requires_grad:
            value = value.detach()
        if value.dim():
            value = value.reshape(())
        self._entries[name] = (value, normalization, reduction)

    # Metrics :meth:`finalize` derives on the host: name -> (hidden entry it needs, normalization).
    DERIVED = {"is_ess": ("_ess_sum_w", "none")}

    def normalizations(self) -> dict[str, str]:
        """Public metric name -> the normalization declared with it.

        What NeMo-RL's ``MetricNormalizer`` reads; the names are those :meth:`finalize` returns.
        """
        out = {name: norm for name, (_, norm, _) in self._entries.items() if not name.startswith("_")}
        for name, (source, norm) in self.DERIVED.items():
            if source in self._entries:
                out[name] = norm
        return out

    def check(self, name: str, bad: torch.Tensor, error: Callable[[dict[str, float]], Exception]) -> None:
        """Raise ``error(values)`` from :meth:`finalize` when the 0-dim ``bad`` is > 0 on any rank.

        Input checks that depend on tensor values ride on the one host transfer instead of
        syncing on their own. ``bad`` is recorded as the hidden metric ``name`` (a ``_``
        prefix, MAX over the groups, so every rank of a group raises together); ``error``
        receives every value, hidden ones included, after the reduction.
        """
        self.add(name, bad, "none", "max")
        self._checks.append((name, error))

    def update(self, entries: dict) -> None:
        """Add entries given as ``name -> (tensor, normalization, reduction)``."""
        for name, (value, normalization, reduction) in entries.items():
            self.add(name, value, normalization, reduction)

    def finalize(self, groups: SequenceGroups = NO_GROUPS) -> dict[str, float]:
        """Reduce over ``groups``, transfer once, derive the effective sample size on the host."""
        names = list(self._entries)
        if not names:
            return {}
        tensors = [self._entries[n][0] for n in names]
        dtype = torch.promote_types(tensors[0].dtype, torch.float32)
        values = torch.stack([t if t.dtype == dtype else t.to(dtype) for t in tensors])  # [M]
        reductions = [self._entries[n][2] for n in names]
        if groups.active:
            is_sum = torch.tensor([r == "sum" for r in reductions], device=values.device)
            is_max = torch.tensor([r == "max" for r in reductions], device=values.device)
            is_min = torch.tensor([r == "min" for r in reductions], device=values.device)
            summed = torch.where(is_sum, values, torch.zeros_like(values))
            # Extrema in one MAX collective: minima negated; other entries are neutral.
            neutral = torch.full_like(values, -float("inf"))
            maxed = torch.where(is_max, values, torch.where(is_min, -values, neutral))
            summed, maxed = reduce_sequence_statistics(summed.unsqueeze(0), maxed.unsqueeze(0), groups)
            summed, maxed = summed[0], maxed[0]
            values = torch.where(is_sum, summed, values)
            values = torch.where(is_max, maxed, values)
            values = torch.where(is_min, -maxed, values)
        host = values.tolist()  # the one host transfer of the loss call
        out = dict(zip(names, host))
        for name, error in self._checks:
            if out[name] > 0:
                raise error(out)
        half = torch.finfo(dtype).max / 2
        for name, red in zip(names, reductions):
            if red == "min" and out[name] >= half:
                out[name] = float("inf")  # no unit: NeMo-RL's sentinel
            elif red == "max" and out[name] <= -half:
                out[name] = float("-inf")
        if "_ess_sum_w" in out:
            sw, sw2, n = out["_ess_sum_w"], out["_ess_sum_w2"], out["_ess_n"]
            out["is_ess"] = sw * sw / (n * sw2) if sw2 > 0 and n > 0 else 0.0
        return {k: v for k, v in out.items() if not k.startswith("_")}
