"""Megatron's load-balanced context-parallel (CP) layout.

Each sequence, padded to a multiple of ``2 * cp``, is cut into ``2 * cp`` equal chunks; CP
rank ``r`` holds chunks ``r`` and ``2 * cp - 1 - r`` (so causal attention work is balanced).
With sequence packing NeMo-RL cuts every padded sequence the same way and hands a LOGIT-input
loss one sequence at a time (``SequencePackingLossWrapper``), so the same functions serve.

Entry points: :func:`cp_shard` for ``[B, S]`` tensors (its inverse, for tests and
benchmarks, is ``tests/support/cp_layout.py``) and :func:`shift_left` for next-token
alignment done before sharding.
"""

from __future__ import annotations

import torch

__all__ = ["cp_chunk_ranges", "cp_shard", "shift_left"]


def cp_chunk_ranges(length: int, cp_size: int, cp_rank: int) -> list[tuple[int, int]]:
    """``[(start, end), (start, end)]`` of the two chunks rank ``cp_rank`` holds.

    Raises:
        ValueError: ``length`` is not a multiple of ``2 * cp_size``.
    """
    if length % (2 * cp_size) != 0:
        raise ValueError(
            f"sequence length {length} is not divisible by 2 * cp = {2 * cp_size}; pad each "
            f"sequence to a multiple of {2 * cp_size} (Megatron's CP layout)"
        )
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank: got {cp_rank}; allowed: 0..{cp_size - 1}")
    chunk = length // (2 * cp_size)
    first, second = cp_rank, 2 * cp_size - 1 - cp_rank
    return [(first * chunk, (first + 1) * chunk), (second * chunk, (second + 1) * chunk)]


def cp_shard(x: torch.Tensor, cp_size: int, cp_rank: int, dim: int = 1) -> torch.Tensor:
    """Rank ``cp_rank``'s shard of ``x`` along the sequence dimension ``dim``."""
    if cp_size == 1:
        return x
    (a0, a1), (b0, b1) = cp_chunk_ranges(x.shape[dim], cp_size, cp_rank)
    return torch.cat([x.narrow(dim, a0, a1 - a0), x.narrow(dim, b0, b1 - b0)], dim=dim)


def shift_left(x: torch.Tensor, fill: float = 0) -> torch.Tensor:
    """``y[:, t] = x[:, t + 1]`` and ``y[:, -1] = fill``.

    Aligns per-token data with the position that predicts it, before sharding (the next
    token may live on another rank).
    """
    if x.shape[1] == 0:
        return x.clone()  # no position, so no last one to fill
    # One operator (NeMo-RL's packing wrapper calls this per field of every sequence), not a fill
    # and a cat; F.pad's widths run from the last dimension back: dimension 1 only.
    return torch.nn.functional.pad(x[:, 1:], (0, 0) * (x.dim() - 2) + (0, 1), value=fill)
