"""What the call header costs: the ranks' agreement before the sharded loss's first collective.

``agree_before_collectives`` (nemo_rs_plugin/core/distributed.py) makes the ranks of the loss's
TP and CP groups exchange a fixed-size header (each rank's global rank, its problem if any, the
shapes of the logits shard and the data dict) before the vocabulary all-gather, so that a fault
one rank sees makes every rank raise instead of leaving its peers waiting in a collective. This
script measures that header next to the call it guards, in one gloo world of ``--world`` CPU
processes (CP = world, or TP 2 x CP world/2 with ``--tp 2``):

  call     one ``sharded_loss`` call, forward + backward, on ``[B, S/cp, V/tp]`` logits (the
           header included);
  header   the header's gathers alone, same groups, same shapes;
  ratio    header / call, per rank (the slowest rank printed).

Timing: wall time (the header waits for the peers, so its cost is a wall-clock one), median of
``--repeats`` calls after two untimed ones, one intra-op thread per process. On a GPU with NCCL
the header travels on a side stream (no wait for the compute stream); not measured here.

    python benchmarks/bench_call_header.py                   # CP 2, B 4, S 4096, V 4096
    python benchmarks/bench_call_header.py --world 4 --tp 2  # TP 2 x CP 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def _rank_main(rank: int, args: argparse.Namespace, rdzv: str, queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rdzv}", rank=rank, world_size=args.world)
    from nemo_rs_plugin import CorrectedPGLoss
    from nemo_rs_plugin.core.distributed import agree_before_collectives
    from nemo_rs_plugin.parallel import sharded
    from nemo_rs_plugin.parallel.layout import cp_shard

    tp, cp = args.tp, args.world // args.tp
    # Rank r: TP rank r % tp, CP rank r // tp (Megatron's order: TP fastest).
    tp_groups = [dist.new_group([c * tp + t for t in range(tp)]) for c in range(cp)]
    cp_groups = [dist.new_group([c * tp + t for c in range(cp)]) for t in range(tp)]
    tp_group, cp_group = tp_groups[rank // tp], cp_groups[rank % tp]
    g = torch.Generator().manual_seed(0)
    B, S, V = args.batch, args.seq, args.vocab
    logits = torch.randn(B, S, V, generator=g)
    lengths = torch.randint(S // 2, S + 1, (B,), generator=g)
    token_mask = (torch.arange(S)[None, :] < lengths[:, None]).float()
    prev = -torch.rand(B, S, generator=g)
    data = {
        "input_ids": torch.randint(0, V, (B, S), generator=g),
        "token_mask": token_mask,
        "sample_mask": torch.ones(B),
        "advantages": torch.randn(B, 1, generator=g).expand(B, S).contiguous(),
        "prev_logprobs": prev,
        "generation_logprobs": prev + 0.02 * torch.randn(B, S, generator=g),
        "reference_policy_logprobs": prev + 0.05 * torch.randn(B, S, generator=g),
    }
    v_local = V // tp
    shard = cp_shard(logits, cp, rank // tp)[..., (rank % tp) * v_local : (rank % tp + 1) * v_local].contiguous()
    loss_fn = CorrectedPGLoss({"is_correction_level": "sequence_mean", "use_importance_sampling_correction": True})
    gvs, gvt = torch.tensor(float(B)), token_mask[:, 1:].sum()
    shapes = sharded._call_shapes(shard, data)
    groups = (("tensor-parallel", tp_group), ("context-parallel", cp_group))

    def call() -> None:
        z = shard.clone().requires_grad_(True)
        loss, _ = sharded.sharded_loss(loss_fn, z, data, gvs, gvt, cp_group=cp_group, tp_group=tp_group)
        loss.backward()

    def header() -> None:
        agree_before_collectives(None, shapes, groups, shard.device)

    times = {}
    for name, fn in (("call", call), ("header", header)):
        for _ in range(2):
            fn()
        samples = []
        for _ in range(args.repeats):
            dist.barrier()
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
        times[name] = statistics.median(samples)
    queue.put((rank, times))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    if args.world % args.tp:
        parser.error("--world must be a multiple of --tp")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [
            ctx.Process(target=_rank_main, args=(r, args, os.path.join(tmp, "rdzv"), queue)) for r in range(args.world)
        ]
        for p in procs:
            p.start()
        results = {}
        while len(results) < len(procs):
            try:
                rank, times = queue.get(timeout=5)
                results[rank] = times
            except Exception:  # queue.Empty: stop when a rank died (its traceback is above)
                if any(p.exitcode not in (None, 0) for p in procs):
                    for p in procs:
                        p.kill()
                    raise SystemExit("a rank failed") from None
        for p in procs:
            p.join()
    cp = args.world // args.tp
    print(
        f"TP {args.tp} x CP {cp}, B {args.batch}, S {args.seq} (S/cp {args.seq // cp}), "
        f"V {args.vocab} (V/tp {args.vocab // args.tp})"
    )
    for rank in sorted(results):
        t = results[rank]
        print(
            f"rank {rank}: call {t['call'] * 1e3:8.2f} ms   header {t['header'] * 1e6:8.1f} us   "
            f"ratio {t['header'] / t['call']:.4f}"
        )
    worst = max(results.values(), key=lambda t: t["header"] / t["call"])
    print(f"header / call (slowest rank): {worst['header'] / worst['call']:.4f}")


if __name__ == "__main__":
    main()
