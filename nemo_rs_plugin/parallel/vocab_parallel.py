"""Log-probability of target tokens from vocabulary-parallel logits (tensor parallelism).

With TP the logits are split over the vocabulary: rank ``k`` holds columns
``[k * V_local, (k + 1) * V_local)``. The token log-prob is

    log p(y) = z_y - max_v z_v - log sum_v exp(z_v - max_v z_v)

which needs the global max (MAX all-reduce), the global sum of exponentials and the target
logit, held by one rank (SUM all-reduces). Computed in float32; the backward is the usual
``onehot(y) - softmax(z)`` restricted to the local columns, so no all-gather of the logits
or log-probs is ever made.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from nemo_rs_plugin.core.distributed import group_is_active

__all__ = ["target_logprobs"]


class _VocabParallelTargetLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, group: Any) -> torch.Tensor:  # noqa: D102
        v_local = logits.shape[-1]
        rank = dist.get_rank(group)
        start = rank * v_local
        z = logits.float()
        z_max = z.amax(-1)
        dist.all_reduce(z_max, op=dist.ReduceOp.MAX, group=group)
        shifted = z - z_max.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = exp.sum(-1)
        in_range = (target >= start) & (target < start + v_local)
        local_idx = torch.where(in_range, target - start, torch.zeros_like(target)).unsqueeze(-1)
        target_logit = shifted.gather(-1, local_idx).squeeze(-1) * in_range
        # One SUM collective for both the partition function and the target logit.
        packed = torch.stack([sum_exp, target_logit])
        dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
        sum_exp, target_logit = packed[0], packed[1]
        ctx.save_for_backward(exp / sum_exp.unsqueeze(-1), in_range, local_idx)
        ctx.logits_dtype = logits.dtype
        return target_logit - sum_exp.log()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):  # noqa: D102
        softmax, in_range, local_idx = ctx.saved_tensors
        grad_logits = -softmax * grad.unsqueeze(-1)
        grad_logits.scatter_add_(-1, local_idx, (grad * in_range).unsqueeze(-1))
        return grad_logits.to(ctx.logits_dtype), None, None


def target_logprobs(
    logits: torch.Tensor,  # [B, T, V_local]
    target: torch.Tensor,  # [B, T] token ids of the next token
    tp_group: Optional[Any] = None,
) -> torch.Tensor:
    """``log softmax(logits)[target]`` over the full vocabulary, ``[B, T]`` float32.

    Args:
        logits: local logits; the vocabulary is split over ``tp_group`` when it has > 1 rank.
        target: next-token ids (global vocabulary indices).
        tp_group: the tensor-parallel group; ``None`` or one rank means full-vocab logits.
    """
    if logits.shape[:-1] != target.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and target ids {tuple(target.shape)} disagree on [B, T]")
    tp = dist.get_world_size(tp_group) if group_is_active(tp_group) else 1
    if tp == 1:
        return torch.log_softmax(logits.float(), dim=-1).gather(-1, target.unsqueeze(-1)).squeeze(-1)
    return _VocabParallelTargetLogprob.apply(logits, target, tp_group)
