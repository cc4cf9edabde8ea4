"""Rank functions for ``tests/parallel/test_chunked_logprobs.py``: TP on gloo, CPU.

Every rank builds the same full logits ``[B, T, V]`` (seeded), keeps its vocabulary shard and
compares the plugin's chunked ``target_logprobs`` with references that see the whole vocabulary
(float64 log-softmax), the plugin's previous unchunked path (tests/support/unchunked_logprobs.py)
and, given a NeMo-RL checkout, NeMo-RL's own ``DistributedLogprob`` and ``ChunkedDistributedLogprob``
run on the same shard and group.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from nemo_rs_plugin.parallel.vocab_parallel import target_logprobs
from tests.support.unchunked_logprobs import unchunked_target_logprobs

B, T, V = 3, 37, 24  # T is not a multiple of the chunk sizes below: the last chunk is short
CHUNKS = (1, 5, 16, None)  # None: the default (one chunk here)
DTYPES = (torch.float32, torch.bfloat16)


def make_inputs(dtype: torch.dtype, world_size: int, rank: int):
    """The full logits (float32, for the references), this rank's shard in ``dtype``, targets, upstream grad."""
    gen = torch.Generator().manual_seed(11)
    full = torch.randn(B, T, V, generator=gen) * 3
    full[0, 4, :] = -1e4  # a row far below the others, and one token far above its row
    full[1, 7, 3] = 40.0
    target = torch.randint(0, V, (B, T), generator=gen)
    grad_out = torch.randn(B, T, generator=gen)
    full = full.to(dtype).float()  # the values the shard holds, exactly
    v_local = V // world_size
    shard = full[..., rank * v_local : (rank + 1) * v_local].to(dtype).contiguous()
    return full, shard, target, grad_out, v_local


def logprobs_and_grad(fn, shard, grad_out):
    z = shard.clone().requires_grad_(True)
    lp = fn(z)
    lp.backward(grad_out)
    return lp.detach(), z.grad


def close(got, want, tol):
    """Within ``tol`` relative to ``1 + |want|`` elementwise (a log-prob of -1e4 is exact to ~1e-3)."""
    got, want = got.detach().double(), want.detach().double()
    diff = float(((got - want).abs() / (1 + want.abs())).max())
    return diff <= tol, diff


def check_chunked_equals_references(rank, world_size):
    """Log-probs and logits gradients: chunked == float64 full-vocabulary reference == the previous path."""
    return reference_failures(rank, world_size, dist.new_group(list(range(world_size))))


def reference_failures(rank, world_size, group):
    """:func:`check_chunked_equals_references` on ``group`` (a gloo group, or a thread group in-process)."""
    failures = []
    for dtype in DTYPES:
        full, shard, target, grad_out, v_local = make_inputs(dtype, world_size, rank)
        f64 = full.double().requires_grad_(True)
        ref = torch.log_softmax(f64, -1).gather(-1, target.unsqueeze(-1)).squeeze(-1)
        ref.backward(grad_out.double())
        ref_grad = f64.grad[..., rank * v_local : (rank + 1) * v_local]
        # float32 arithmetic on both paths; a bf16 gradient is rounded to 8 bits of mantissa
        grad_tol = 1e-6 if dtype == torch.float32 else 1e-2
        old_lp, old_grad = logprobs_and_grad(lambda z: unchunked_target_logprobs(z, target, group), shard, grad_out)
        for chunk in CHUNKS:
            label = f"{str(dtype)[6:]}/chunk {chunk}"
            lp, grad = logprobs_and_grad(lambda z: target_logprobs(z, target, group, chunk), shard, grad_out)
            if lp.dtype != torch.float32 or grad.dtype != dtype:
                failures.append(f"{label}: dtypes {lp.dtype}, {grad.dtype}")
            for name, got, want, tol in (
                ("log-probs vs float64", lp, ref, 2e-5),
                ("log-probs vs the previous path", lp, old_lp, 2e-5),
                ("logits grad vs float64", grad, ref_grad, grad_tol),
                ("logits grad vs the previous path", grad, old_grad, grad_tol),
            ):
                ok, diff = close(got, want, tol)
                if not ok:
                    failures.append(f"{label}: {name} max diff {diff:.3g}")
            if chunk is not None:  # chunking changes the memory, not one bit of the result
                lp_one, grad_one = logprobs_and_grad(lambda z: target_logprobs(z, target, group, T), shard, grad_out)
                if not (torch.equal(lp, lp_one) and torch.equal(grad, grad_one)):
                    failures.append(f"{label}: differs from one chunk")
    return failures


def check_collectives(rank, world_size):
    """One all-gather per call in the forward, whatever the number of chunks; none in the backward."""
    group = dist.new_group(list(range(world_size)))
    _, shard, target, grad_out, _ = make_inputs(torch.float32, world_size, rank)
    calls = []
    names = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "broadcast")
    saved = {name: getattr(dist, name) for name in names}

    def counting(name):
        def call(*args, **kwargs):
            calls.append(name)
            return saved[name](*args, **kwargs)

        return call

    failures = []
    try:
        for name in names:
            setattr(dist, name, counting(name))
        z = shard.clone().requires_grad_(True)
        lp = target_logprobs(z, target, group, chunk_size=5)  # 8 chunks
        forward, calls[:] = list(calls), []
        lp.backward(grad_out)
        backward = list(calls)
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
    if forward != ["all_gather"]:
        failures.append(f"forward collectives {forward}, expected one all_gather")
    if backward:
        failures.append(f"backward collectives {backward}, expected none")
    return failures


def check_equals_nemo_rl(rank, world_size, host):
    """The plugin's log-probs and logits gradients equal NeMo-RL's own on the same shard and group."""
    if host:
        sys.path.insert(0, host)
    from tests.support import nemo_rl_shims

    nemo_rl_shims.install()
    from nemo_rl.distributed.model_utils import ChunkedDistributedLogprob, DistributedLogprob

    group = dist.new_group(list(range(world_size)))
    failures = []
    for dtype in DTYPES:
        _, shard, target, grad_out, v_local = make_inputs(dtype, world_size, rank)
        # padding ids outside the vocabulary: log-prob 0 in both (NeMo-RL's vocab-range mask); the
        # loss masks them, so their upstream gradient is 0 (NeMo-RL would pass -softmax * g there)
        target, grad_out = target.clone(), grad_out.clone()
        target[0, :3], target[2, -2:] = -1, V + 5
        grad_out[0, :3], grad_out[2, -2:] = 0.0, 0.0
        start, end = rank * v_local, (rank + 1) * v_local
        # NeMo-RL's backward returns float32 for bf16 logits (autograd casts it): compare in float32
        grad_tol = 1e-6 if dtype == torch.float32 else 1e-2
        nemo = {
            "DistributedLogprob": logprobs_and_grad(
                lambda z: DistributedLogprob.apply(z, target, start, end, group, False), shard, grad_out
            ),
            "ChunkedDistributedLogprob(5)": logprobs_and_grad(
                lambda z: ChunkedDistributedLogprob.apply(z, target, start, end, 5, group, False), shard, grad_out
            ),
        }
        for chunk in (5, None):
            lp, grad = logprobs_and_grad(lambda z: target_logprobs(z, target, group, chunk), shard, grad_out)
            for name, (want_lp, want_grad) in nemo.items():
                label = f"{str(dtype)[6:]}/chunk {chunk} vs NeMo-RL's {name}"
                ok, diff = close(lp, want_lp, 2e-5)
                if not ok:
                    failures.append(f"{label}: log-probs max diff {diff:.3g}")
                ok, diff = close(grad, want_grad, grad_tol)
                if not ok:
                    failures.append(f"{label}: logits grad max diff {diff:.3g}")
    return failures
