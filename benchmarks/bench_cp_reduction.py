"""Context parallelism on gloo: statistic reduction vs all-gather of log-probs, and the loss.

For B x S = 8 x 32k (override with --batch/--seq) and cp = 2 and 4 it prints, in one run:
  * bytes moved per rank and wall time of the plugin's per-sequence statistic reduction
    (the SUM + MAX all-reduces of one loss call) versus an all-gather of the log-probs
    (what NeMo-RL does before its loss), and their ratio;
  * the loss time (forward + backward) of the sharded path versus the gathered path
    (all-gather the log-probs, then the loss on the full [B, S]), as a ratio.
Target: the reduction moves at most 1/100 of the all-gather's bytes at S = 32k.

Usage: python benchmarks/bench_cp_reduction.py [--cp 2,4] [--batch 8] [--seq 32768]
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

# The gathered path reassembles shards with tests/support/cp_layout.py: the repository root on the path.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CONFIG = {
    "use_importance_sampling_correction": True,
    "is_correction_level": "sequence_mean",
    "rejection_sampling": [
        {"level": "sequence", "agg": "mean", "lower": 0.99, "upper": 1.01},
        {"level": "sequence", "agg": "any", "lower": 1e-4, "upper": 100},
        {"level": "token", "statistic": "kl_k3", "upper": 0.5},
    ],
}


class _CountingCollectives:
    """Wraps all_reduce/all_gather to count bytes this rank sends into collectives."""

    def __init__(self):
        self.bytes = 0
        self._orig = {}

    def __enter__(self):
        for name in ("all_reduce", "all_gather_into_tensor", "all_gather"):
            orig = getattr(dist, name)
            self._orig[name] = orig

            def wrapped(tensor, *args, _orig=orig, _name=name, **kwargs):
                t = tensor if _name == "all_reduce" else args[0]
                if isinstance(t, torch.Tensor):
                    self.bytes += t.numel() * t.element_size()
                return _orig(tensor, *args, **kwargs)

            setattr(dist, name, wrapped)
        return self

    def __exit__(self, *exc):
        for name, orig in self._orig.items():
            setattr(dist, name, orig)


def _rank_main(rank, world, rdzv, B, S, repeats, out_q):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rdzv}", rank=rank, world_size=world)
    from nemo_rs_plugin import CorrectedPGLoss, SequenceGroups
    from nemo_rs_plugin.core.loss import LossInputs
    from nemo_rs_plugin.parallel.layout import cp_shard

    g = torch.Generator().manual_seed(0)
    prev = -torch.rand(B, S, generator=g)
    gen = prev + 0.01 * torch.randn(B, S, generator=g)
    curr = prev + 0.01 * torch.randn(B, S, generator=g)
    mask = torch.ones(B, S)
    mask[:, -1] = 0
    adv = torch.randn(B, 1, generator=g).expand(B, S).contiguous()
    loss_fn = CorrectedPGLoss(CONFIG)
    groups = SequenceGroups.of(dist.group.WORLD)
    gvs, gvt = torch.tensor(float(B)), mask.sum()

    def local(x):
        return cp_shard(x, world, rank)

    def sharded_call():
        lp = local(curr).clone().requires_grad_(True)
        x = LossInputs(
            curr=lp,
            prev=local(prev),
            generation=local(gen),
            reference=local(prev),
            advantages=local(adv),
            token_mask=local(mask),
            sample_mask=torch.ones(B),
        )
        loss, _ = loss_fn.compute(x, gvs, gvt, groups)
        loss.backward()

    def gathered_call():
        lp = local(curr).clone().requires_grad_(True)
        parts = [torch.empty_like(lp) for _ in range(world)]
        dist.all_gather(parts, lp.detach())
        parts[rank] = lp  # own chunk keeps its graph, as NeMo-RL's gather does
        from tests.support.cp_layout import cp_unshard

        full = cp_unshard(parts)
        x = LossInputs(
            curr=full,
            prev=prev,
            generation=gen,
            reference=prev,
            advantages=adv,
            token_mask=mask,
            sample_mask=torch.ones(B),
        )
        loss, _ = loss_fn.compute(x, gvs, gvt)
        (loss / world).backward()

    def timed(fn):
        fn()
        samples = []
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
        return statistics.median(samples)

    # Bytes of one call's statistic reduction (the loss's own collectives, metrics excluded).
    from nemo_rs_plugin.core.correction import statistics as correction_mod

    with _CountingCollectives() as counter:
        orig = correction_mod.reduce_sequence_statistics
        reduction_bytes = {}

        def spy(sums, maxima, grp):
            before = counter.bytes
            out = orig(sums, maxima, grp)
            reduction_bytes["v"] = counter.bytes - before
            return out

        correction_mod.reduce_sequence_statistics = spy
        sharded_call()
        correction_mod.reduce_sequence_statistics = orig
    gather_bytes = local(curr).numel() * 4 * (world - 1)  # bytes received per rank by all-gather

    sums = torch.zeros(8, B)
    maxima = torch.zeros(4, B)
    t_reduce = timed(lambda: correction_mod.reduce_sequence_statistics(sums, maxima, groups))
    lp_local = local(curr).contiguous()
    parts = [torch.empty_like(lp_local) for _ in range(world)]
    t_gather = timed(lambda: dist.all_gather(parts, lp_local))
    t_sharded = timed(sharded_call)
    t_gathered = timed(gathered_call)
    if rank == 0:
        out_q.put((reduction_bytes["v"], gather_bytes, t_reduce, t_gather, t_sharded, t_gathered))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cp", default="2,4")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    print(f"B x S = {args.batch} x {args.seq}, gloo on CPU, median of {args.repeats}")
    header = f"{'cp':>3} | {'reduce bytes':>12} | {'gather bytes':>12} | bytes ratio"
    print(f"{header} | reduce/gather time | sharded/gathered loss time")
    for cp in (int(c) for c in args.cp.split(",")):
        q = ctx.Queue()
        with tempfile.TemporaryDirectory() as tmp:
            procs = [
                ctx.Process(
                    target=_rank_main, args=(r, cp, os.path.join(tmp, "rdzv"), args.batch, args.seq, args.repeats, q)
                )
                for r in range(cp)
            ]
            for p in procs:
                p.start()
            rb, gb, tr, tg, ts, tgl = q.get(timeout=600)
            for p in procs:
                p.join(timeout=60)
        print(f"{cp:>3} | {rb:>12,} | {gb:>12,} | {rb / gb:11.5f} | {tr / tg:18.3f} | {ts / tgl:.3f}")


if __name__ == "__main__":
    main()
