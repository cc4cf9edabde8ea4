"""The plugin's log-probs from logits before they were chunked (kept as a reference, test-only).

The whole ``[B, T, V_local]`` shard in float32, a MAX and a SUM all-reduce over the TP group, and
the float32 softmax of the whole shard saved for backward: ``tests/parallel/test_chunked_logprobs.py``
holds the chunked implementation equal to it, and ``benchmarks/bench_logprob_memory.py`` measures
what it cost (its ``plugin-unchunked`` row).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist


class _UnchunkedVocabParallelTargetLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, group: Any) -> torch.Tensor:
        v_local = logits.shape[-1]
        start = dist.get_rank(group) * v_local
        z = logits.float()
        z_max = z.amax(-1)
        dist.all_reduce(z_max, op=dist.ReduceOp.MAX, group=group)
        shifted = z - z_max.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = exp.sum(-1)
        in_range = (target >= start) & (target < start + v_local)
        local_idx = torch.where(in_range, target - start, torch.zeros_like(target)).unsqueeze(-1)
        target_logit = shifted.gather(-1, local_idx).squeeze(-1) * in_range
        packed = torch.stack([sum_exp, target_logit])
        dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
        sum_exp, target_logit = packed[0], packed[1]
        ctx.save_for_backward(exp / sum_exp.unsqueeze(-1), in_range, local_idx)
        ctx.logits_dtype = logits.dtype
        return target_logit - sum_exp.log()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        softmax, in_range, local_idx = ctx.saved_tensors
        grad_logits = -softmax * grad.unsqueeze(-1)
        grad_logits.scatter_add_(-1, local_idx, (grad * in_range).unsqueeze(-1))
        return grad_logits.to(ctx.logits_dtype), None, None


def unchunked_target_logprobs(logits: torch.Tensor, target: torch.Tensor, tp_group: Optional[Any] = None):
    """``log softmax(logits)[target]``, ``[B, T]`` float32, as the plugin computed it before chunking."""
    if tp_group is None or dist.get_world_size(tp_group) == 1:
        return torch.log_softmax(logits.float(), dim=-1).gather(-1, target.unsqueeze(-1)).squeeze(-1)
    return _UnchunkedVocabParallelTargetLogprob.apply(logits, target, tp_group)
