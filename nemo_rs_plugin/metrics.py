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

from typing import Literal

import torch

from nemo_rs_plugin.distributed import NO_GROUPS, SequenceGroups, all_reduce_metrics

__all__ = ["MetricSet", "Normalization", "Reduction"]

Normalization = Literal["tokens", "sequences", "none"]
Reduction = Literal["sum", "replicated", "max", "min"]


class MetricSet:
    """Ordered metric tensors with their normalization and cross-rank reduction."""

    def __init__(self) -> None:
        self._entries: dict[str, tuple[torch.Tensor, str, str]] = {}

    def add(self, name: str, value: torch.Tensor, normalization: str, reduction: str) -> None:
        """Record a 0-dim tensor (detached; never synced here)."""
        self._entries[name] = (value.detach().reshape(()), normalization, reduction)

    def update(self, entries: dict) -> None:
        """Add entries given as ``name -> (tensor, normalization, reduction)``."""
        for name, (value, normalization, reduction) in entries.items():
            self.add(name, value, normalization, reduction)

    @property
    def normalizations(self) -> dict[str, str]:
        """Public metric name -> normalization (internal ``_`` entries excluded)."""
        return {k: v[1] for k, v in self._entries.items() if not k.startswith("_")}

    def finalize(self, groups: SequenceGroups = NO_GROUPS) -> dict[str, float]:
        """Reduce over ``groups``, derive the effective sample size, transfer once."""
        names = list(self._entries)
        if not names:
            return {}
        values = torch.stack([self._entries[n][0].float() for n in names])  # [M]
        if groups.active:
            reductions = [self._entries[n][2] for n in names]
            is_sum = torch.tensor([r == "sum" for r in reductions], device=values.device)
            is_max = torch.tensor([r == "max" for r in reductions], device=values.device)
            is_min = torch.tensor([r == "min" for r in reductions], device=values.device)
            summed = torch.where(is_sum, values, torch.zeros_like(values))
            # Extrema in one MAX collective: minima negated; other entries are neutral.
            maxed = torch.where(is_max, values, torch.where(is_min, -values, torch.full_like(values, -float("inf"))))
            summed, maxed = all_reduce_metrics(summed.unsqueeze(0), maxed.unsqueeze(0), groups)
            summed, maxed = summed[0], maxed[0]
            values = torch.where(is_sum, summed, values)
            values = torch.where(is_max, maxed, values)
            values = torch.where(is_min, -maxed, values)
        index = {n: i for i, n in enumerate(names)}
        derived_names = []
        derived = []
        if "_ess_sum_w" in index:
            sw, sw2, n = (values[index[k]] for k in ("_ess_sum_w", "_ess_sum_w2", "_ess_n"))
            ess = torch.where(sw2 > 0, sw.square() / (n * sw2).clamp_min(1e-30), torch.zeros_like(sw))
            derived_names.append("is_ess")
            derived.append(ess)
        if derived:
            values = torch.cat([values, torch.stack(derived)])
            names = names + derived_names
        host = values.tolist()  # the one host transfer of the loss call
        return {n: v for n, v in zip(names, host) if not n.startswith("_")}
