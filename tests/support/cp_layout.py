"""The inverse of Megatron's context-parallel layout, for tests and benchmarks.

The product only shards (:func:`nemo_rs_plugin.parallel.layout.cp_shard`); the tests and
``benchmarks/bench_cp_reduction.py`` reassemble full sequences from every rank's shard.
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["cp_unshard"]


def cp_unshard(shards: Sequence[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """Inverse of :func:`~nemo_rs_plugin.parallel.layout.cp_shard`, from every rank's shard in rank order."""
    cp_size = len(shards)
    if cp_size == 1:
        return shards[0]
    chunks: list = [None] * (2 * cp_size)
    for r, s in enumerate(shards):
        half = s.shape[dim] // 2
        chunks[r] = s.narrow(dim, 0, half)
        chunks[2 * cp_size - 1 - r] = s.narrow(dim, half, half)
    return torch.cat(chunks, dim=dim)
