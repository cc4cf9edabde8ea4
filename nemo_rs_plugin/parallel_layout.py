"""Megatron's load-balanced context-parallel (CP) layout, for unpacked and packed batches.

Each sequence, padded to a multiple of ``2 * cp``, is cut into ``2 * cp`` equal chunks; CP
rank ``r`` holds chunks ``r`` and ``2 * cp - 1 - r`` (so causal attention work is balanced).
For packed sequences the same cut is applied to every sequence's padded segment of the
packed stream (``cu_seqlens_padded``), and a rank's shard is the concatenation of its
chunks of every sequence.

Entry points: :func:`cp_shard` / :func:`cp_unshard` for ``[B, S]`` tensors,
:func:`packed_cp_positions` for the positions a rank holds in a packed stream, and
:func:`shift_left` for next-token alignment done before sharding.
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["cp_chunk_ranges", "cp_shard", "cp_unshard", "packed_cp_positions", "shift_left"]


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


def cp_unshard(shards: Sequence[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """Inverse of :func:`cp_shard`, from every rank's shard in rank order (for tests/tools)."""
    cp_size = len(shards)
    if cp_size == 1:
        return shards[0]
    chunks: list = [None] * (2 * cp_size)
    for r, s in enumerate(shards):
        half = s.shape[dim] // 2
        chunks[r] = s.narrow(dim, 0, half)
        chunks[2 * cp_size - 1 - r] = s.narrow(dim, half, half)
    return torch.cat(chunks, dim=dim)


def packed_cp_positions(
    cu_seqlens_padded: Sequence[int], cp_size: int, cp_rank: int
) -> list[torch.Tensor]:
    """For each packed sequence, the in-sequence positions rank ``cp_rank`` holds.

    Args:
        cu_seqlens_padded: cumulative padded lengths ``[0, L0, L0 + L1, ...]`` (host ints:
            layout metadata, read once per microbatch).
        cp_size: ranks in the context-parallel group.
        cp_rank: this rank's index in it.

    Returns:
        One 1-D index tensor per sequence; the rank's packed shard is the concatenation of
        each sequence's values at these positions, in sequence order.
    """
    out = []
    bounds = [int(v) for v in cu_seqlens_padded]
    for start, end in zip(bounds[:-1], bounds[1:]):
        ranges = cp_chunk_ranges(end - start, cp_size, cp_rank)
        out.append(torch.cat([torch.arange(a, b) for a, b in ranges]))
    return out


def shift_left(x: torch.Tensor, fill: float = 0) -> torch.Tensor:
    """``y[:, t] = x[:, t + 1]`` and ``y[:, -1] = fill``.

    Aligns per-token data with the position that predicts it, before sharding (the next
    token may live on another rank).
    """
    pad = torch.full_like(x[:, :1], fill)
    return torch.cat([x[:, 1:], pad], dim=1)
