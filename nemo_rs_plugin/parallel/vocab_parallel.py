"""Log-probability of target tokens from (vocabulary-parallel) logits, one chunk of positions at a time.

For position ``t`` with logits ``z_t`` over the vocabulary and target token ``y_t``:

    log p(y_t) = z_{t, y_t} - LSE_t,        LSE_t = log sum_v exp(z_{t, v})

With tensor parallelism rank ``k`` holds columns ``[k * V_local, (k + 1) * V_local)``. Each rank
computes its local log-sum-exp ``lse_{k, t}`` (stable: its own row maximum) and its local target
logit (0 where another rank holds the target), and one all-gather of those ``[B, T]`` rows per
call combines them: ``LSE_t = logsumexp_k lse_{k, t}``, ``z_{t, y_t} = sum_k target_{k, t}``. Each
is kept relative to its shard's row maximum, so that no float32 digit is lost to large logits.
NeMo-RL's ``ChunkedDistributedLogprob`` issues a MAX and two SUM all-reduces per chunk in the
forward and recomputes the MAX and SUM per chunk in the backward; here the forward's one
all-gather is the only collective, whatever the number of chunks, and the backward has none.

The gradient ``d log p(y_t) / d z_{t, v} = 1[v = y_t] - exp(z_{t, v} - LSE_t)`` is recomputed one
chunk at a time from the logits and the saved row maxima and ``LSE`` (float32 ``[B, T]``): nothing of size
``[T, V]`` is saved beyond the logits NeMo-RL already holds. Float32 exists for one chunk
``[B, chunk, V_local]`` at a time, in the forward and in the backward (none at all in the
backward for float32 logits, which are processed in the gradient's own memory), so the peak
above the inputs is the gradient of the logits, in their dtype, plus one float32 chunk.
``benchmarks/bench_logprob_memory.py`` measures it against NeMo-RL's two paths.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from nemo_rs_plugin.core.distributed import group_is_active

__all__ = [
    "DEFAULT_LOGPROB_CHUNK_SIZE",
    "chunk_size_problem",
    "target_logprobs",
    "target_logprobs_and_nonfinite_rows",
]

#: Positions per chunk when NeMo-RL's ``policy.logprob_chunk_size`` is unset: the smallest value
#: NeMo-RL's own recipes set. The float32 chunk of Qwen3's vocabulary over TP 4 (V_local 37,984)
#: is then 148 MiB against 1.16 GiB of bf16 logits per 16k-token CP shard; peak memory was lowest
#: at 512-1024 in the CPU sweep (docs/performance.md#log-probs-from-logits-memory).
DEFAULT_LOGPROB_CHUNK_SIZE = 1024


def chunk_size_problem(value: Any, field: str = "policy.logprob_chunk_size") -> Optional[str]:
    """Why ``value`` cannot be a chunk size (a positive number of positions), or ``None`` (``None`` = default)."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        return None
    return (
        f"{field}: got {value!r}; allowed: a positive integer (positions per chunk of the log-prob "
        f"computation from logits) or null (the plugin's default, {DEFAULT_LOGPROB_CHUNK_SIZE})"
    )


def _joined_chunks(parts: list[torch.Tensor]) -> torch.Tensor:
    """The chunks' ``[B, C]`` rows as one ``[B, T]``: the one chunk itself, else one ``cat``."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def _float32_chunk(chunk: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """A fresh float32 ``chunk - shift``: the one ``[B, C, V_local]`` float32 buffer of a step."""
    if chunk.dtype == torch.float32:
        return chunk - shift
    return chunk.to(torch.float32).sub_(shift)


class _ChunkedTargetLogprob(torch.autograd.Function):
    """``log p(y)`` from logits one chunk of positions at a time; every quantity relative to a row maximum.

    ``z_y - LSE`` of two numbers near -1e4 would keep three digits in float32;
    ``(z_y - m) - (LSE - m)`` keeps them all.
    """

    @staticmethod
    def forward(  # noqa: D102
        ctx: Any, logits: torch.Tensor, target: torch.Tensor, group: Any, chunk_size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        T, v_local = logits.shape[1], logits.shape[2]
        tp = dist.get_world_size(group) if group is not None else 1
        start = dist.get_rank(group) * v_local if tp > 1 else 0
        # NeMo-RL's rule for a target outside the vocabulary (its vocab range mask): log-prob 0;
        # here also no gradient (the output does not depend on the logits there).
        valid = (target >= 0) & (target < tp * v_local)
        # This shard holds the target (without TP the one shard holds every valid one).
        held = (target >= start) & (target < start + v_local) if tp > 1 else valid
        local_idx = torch.where(held, target - start if start else target, 0).unsqueeze(-1)
        # Per position of this shard: the shift m (the row maximum; 0 for a row of -inf, a shard
        # whose columns are all masked, where -inf - -inf would be nan), log sum_v exp(z_v - m)
        # (-inf exactly for such a row), z_y - m, and whether the row's logits hold a NaN or +inf
        # or no finite value (its maximum is NaN, +inf or -inf: amax propagates NaN). Kept per
        # chunk and joined once (one chunk, the common case under packing: nothing joined or copied).
        shift_parts, lse_parts, target_parts, bad_parts = [], [], [], []
        for s in range(0, max(T, 1), chunk_size):  # at least one chunk: no position gives [B, 0] rows
            e = s + chunk_size
            chunk = logits[:, s:e]
            m = chunk.amax(-1, keepdim=True).to(torch.float32)
            bad_parts.append(torch.isfinite(m).logical_not_().squeeze(-1))
            m.masked_fill_(m == float("-inf"), 0.0)
            shift_chunk = m.squeeze(-1)
            shift_parts.append(shift_chunk)
            target_parts.append(chunk.gather(-1, local_idx[:, s:e]).squeeze(-1).to(torch.float32).sub_(shift_chunk))
            z = _float32_chunk(chunk, m)
            lse_parts.append(z.exp_().sum(-1).log_())
            del z
        shift, lse_rel, target_rel, local_bad = map(_joined_chunks, (shift_parts, lse_parts, target_parts, bad_parts))
        del shift_parts, lse_parts, target_parts, bad_parts  # several chunks: not alive beside their join
        if tp == 1:
            logprobs, lse_minus_shift = target_rel - lse_rel, lse_rel
            bad = local_bad
        else:
            # The call's one collective: every rank's rows [true maximum, lse_rel, z_y - m]; a
            # row with a NaN or +inf logit on a rank sends NaN as its maximum there.
            true_max = shift.masked_fill(lse_rel == float("-inf"), float("-inf"))
            true_max.masked_fill_(~(true_max == float("-inf")) & local_bad, float("nan"))
            local = torch.stack([true_max, lse_rel, target_rel.masked_fill(~held, 0.0)])
            parts = [torch.empty_like(local) for _ in range(tp)]
            dist.all_gather(parts, local, group=group)
            ranks = torch.stack(parts)  # [tp, 3, B, T]
            maxima = ranks[:, 0]
            # A NaN or +inf logit on some rank, or -inf on every rank: the same rows on every rank.
            bad = ~(maxima < float("inf")).all(0) | (maxima == float("-inf")).all(0)
            top = maxima.amax(0)  # M, the maximum over the whole vocabulary
            top = top.masked_fill(top == float("-inf"), 0.0)
            # A shard of -inf adds exp(-inf) = 0, whatever the others' scale.
            lse_minus_top = (maxima - top + ranks[:, 1]).exp().sum(0).log()  # LSE - M
            shifts = maxima.masked_fill(maxima == float("-inf"), 0.0)  # each rank's m
            holder = (target // v_local).clamp(0, tp - 1).unsqueeze(0)  # the rank holding y
            logprobs = ranks[:, 2].sum(0) + (shifts.gather(0, holder).squeeze(0) - top) - lse_minus_top
            lse_minus_shift = lse_minus_top + (top - shift)  # LSE - m, for this shard's softmax
        # A row with a NaN or +inf logit (on any rank) has a NaN maximum or log-sum-exp, and a
        # row of -inf only a log-prob of -inf - -inf: its log-prob is NaN already, the loss counts
        # and masks it as any non-finite input, and the backward gives it no gradient. A target
        # outside the vocabulary: 0.
        logprobs = logprobs.masked_fill(~valid, 0.0)
        ctx.save_for_backward(logits, shift, lse_minus_shift, local_idx, valid, held, bad)
        ctx.mark_non_differentiable(bad)
        ctx.chunk_size = chunk_size
        ctx.held_is_valid = tp == 1  # one shard: the target's gradient needs no second mask
        return logprobs, bad

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _bad_grad: Any):  # noqa: D102
        logits, shift, lse_minus_shift, local_idx, valid, held, bad = ctx.saved_tensors
        chunk_size = ctx.chunk_size
        grad = grad.to(torch.float32) * valid  # no gradient where the target is outside the vocabulary
        target_grad = grad if ctx.held_is_valid else grad * held
        grad_logits = torch.empty_like(logits)
        in_place = logits.dtype == torch.float32
        for s in range(0, logits.shape[1], chunk_size):
            e = s + chunk_size
            chunk, out = logits[:, s:e], grad_logits[:, s:e]
            m = shift[:, s:e].unsqueeze(-1)
            if in_place:  # float32 logits: the chunk is computed in the gradient's own memory
                p = torch.sub(chunk, m, out=out)
            else:
                p = _float32_chunk(chunk, m)
            # softmax = exp((z - m) - (LSE - m)); the gradient is -softmax * g, plus g at the target
            p.sub_(lse_minus_shift[:, s:e].unsqueeze(-1)).exp_().mul_(grad[:, s:e].neg().unsqueeze(-1))
            p.scatter_add_(-1, local_idx[:, s:e], target_grad[:, s:e].unsqueeze(-1))
            # A row with a NaN or +inf logit: its softmax is NaN whatever its incoming gradient
            # (0 * NaN); its logits get no gradient, wherever the row is (prompt, masked, last).
            p.masked_fill_(bad[:, s:e].unsqueeze(-1), 0.0)
            if not in_place:
                out.copy_(p)
                del p
        return grad_logits, None, None, None


def target_logprobs(
    logits: torch.Tensor,  # [B, T, V_local]
    target: torch.Tensor,  # [B, T] token ids of the next token
    tp_group: Optional[Any] = None,
    chunk_size: Optional[int] = None,
) -> torch.Tensor:
    """``log softmax(logits)[target]`` over the full vocabulary, ``[B, T]`` float32, in chunks of positions.

    Args:
        logits: local logits; the vocabulary is split over ``tp_group`` when it has > 1 rank.
        target: next-token ids (global vocabulary indices).
        tp_group: the tensor-parallel group; ``None`` or one rank means full-vocab logits.
        chunk_size: positions per chunk (NeMo-RL's ``policy.logprob_chunk_size``); ``None``
            takes :data:`DEFAULT_LOGPROB_CHUNK_SIZE`. It bounds the float32 memory, not the result.

    A target id outside the vocabulary (``< 0`` or ``>= V_local * tp``, padding) gets log-prob 0
    and no gradient, as NeMo-RL's vocab-range mask gives it. A position whose logits hold a NaN
    or ``+inf`` on any rank of ``tp_group``, or are ``-inf`` over the whole vocabulary, gets
    log-prob NaN and no gradient (its logits' gradient is 0, finite):
    :func:`target_logprobs_and_nonfinite_rows` also says where.

    Raises:
        ValueError: shapes that disagree, or a chunk size that is not a positive integer.
    """
    return target_logprobs_and_nonfinite_rows(logits, target, tp_group, chunk_size)[0]


def target_logprobs_and_nonfinite_rows(
    logits: torch.Tensor,
    target: torch.Tensor,
    tp_group: Optional[Any] = None,
    chunk_size: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`target_logprobs` and the ``[B, T]`` bool mask of the positions whose logits hold a NaN or ``+inf``.

    The mask is the same on every rank of ``tp_group`` (it rides on the forward's one all-gather);
    every such position is in it, prompt, masked and last positions included, and so is a position
    whose logits are ``-inf`` over the whole vocabulary (no finite logit). A ``-inf`` entry beside
    finite ones is not: it is a masked vocabulary entry, probability 0.
    """
    if logits.dim() != 3 or logits.shape[:-1] != target.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and target ids {tuple(target.shape)} disagree on [B, T]")
    problem = chunk_size_problem(chunk_size, field="chunk_size")
    if problem is not None:
        raise ValueError(problem)
    group = tp_group if group_is_active(tp_group) and dist.get_world_size(tp_group) > 1 else None
    logprobs, nonfinite_rows = _ChunkedTargetLogprob.apply(
        logits, target, group, chunk_size or DEFAULT_LOGPROB_CHUNK_SIZE
    )
    return logprobs, nonfinite_rows
