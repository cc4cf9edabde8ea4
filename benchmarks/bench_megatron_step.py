"""Memory and time of NeMo-RL's Megatron training step: the plugin against NeMo-RL's own loss.

The step is the one ``tests/nemo_rl/test_megatron_training_step.py`` runs (NeMo-RL's ``Policy.train``
-> ``MegatronPolicyWorkerImpl.train`` -> ``megatron_forward_backward`` with a real megatron-core MoE
``GPTModel``; the stand-ins are listed in ``tests/support/megatron_step_host.py``), on 2 gloo CPU
processes, TP 2 + EP 2 (sequence parallel), scaled so the logits dominate the step's memory:
vocabulary ``--vocab`` (default 16384), 8 sequences of ``--seq`` tokens (default 256), microbatches
of 4 (or sequence packing at 2 x ``--seq`` tokens with ``--packing``).

Variants, in one world, each run ``--repeats`` times in rotation (so no variant always runs first):

* ``nemo_rl``: NeMo-RL's ``ClippedPGLossFn`` on its gathered log-prob path (the baseline);
* ``nemo_rl+chunk``: the same with ``policy.logprob_chunk_size: --chunk`` (NeMo-RL's chunked
  gathered path, v0.7.0 on);
* ``plugin``: ``rs_clipped_pg`` with NeMo-RL's fields only;
* ``plugin+corrections``: ``sequence_mean`` IS with a Geo-RS band and an ``agg: max`` veto;
* ``plugin+sharded+chunk``: the 64k recipe's ``sharded_logits_input: true`` with
  ``logprob_chunk_size: --chunk``.

Per variant and rank: the median wall time of ``Policy.train`` and the step's peak resident memory
above the resident memory at its start (a sampling thread reads ``/proc/self/statm`` every 0.5 ms;
glibc's free memory is returned with ``malloc_trim`` before each step, so one variant's freed pages
are not counted to the next). Printed as ratios to ``nemo_rl`` on the same rank.

    python benchmarks/bench_megatron_step.py --host /path/to/nemo-rl-v0.7.0
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _PeakRss:
    def __enter__(self):
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except OSError:
            pass
        self.start = self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss())
            time.sleep(0.0005)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())


def make_data(vocab: int, seq: int):
    import torch

    from tests.support.training_step_cases import GBS, NUM_GLOBAL_BATCHES_MAX

    B = GBS * NUM_GLOBAL_BATCHES_MAX
    g = torch.Generator().manual_seed(7)
    lengths = torch.randint(seq // 2, seq + 1, (B,), generator=g)
    ids = torch.randint(1, vocab, (B, seq), generator=g)
    inside = torch.arange(seq)[None] < lengths[:, None]
    ids = ids * inside
    token_mask = inside.long()
    token_mask[:, :8] = 0  # an 8-token prompt
    prev = (-torch.log(torch.tensor(float(vocab))) + 0.1 * torch.randn(B, seq, generator=g)) * token_mask
    gen = prev + 0.05 * torch.randn(B, seq, generator=g) * token_mask
    ref = prev + 0.02 * torch.randn(B, seq, generator=g) * token_mask
    return {
        "input_ids": ids,
        "input_lengths": lengths,
        "advantages": torch.randn(B, 1, generator=g).expand(B, seq).contiguous(),
        "prev_logprobs": prev.float(),
        "generation_logprobs": gen.float(),
        "reference_policy_logprobs": ref.float(),
        "token_mask": token_mask,
        "sample_mask": torch.ones(B),
    }


def variants(chunk: int) -> dict:
    from tests.support.training_step_cases import CORRECTED

    return {
        "nemo_rl": ("nemo_rl", {}, None),
        "nemo_rl+chunk": ("nemo_rl", {}, chunk),
        "plugin": ("plugin", {}, None),
        "plugin+corrections": ("plugin", CORRECTED["rs/sequence_mean+filters"], None),
        "plugin+sharded+chunk": ("plugin", {"sharded_logits_input": True}, chunk),
    }


def rank_fn(rank, world_size, host, args):
    import torch

    from tests.support import megatron_step_host as H

    ctx, _ = H.make_context(host)
    ctx["data"] = make_data(args.vocab, args.seq)
    split = {"dp": 1, "ngb": 1, "mbs": 4, "packing": 2 * args.seq if args.packing else None}
    times: dict = {}
    peaks: dict = {}
    names = list(variants(args.chunk))
    for repeat in range(args.repeats + 1):  # the first round warms up
        order = names[repeat % len(names) :] + names[: repeat % len(names)]
        for name in order:
            kind, section, chunk = variants(args.chunk)[name]
            case = {"kind": kind, "section": section, "tp": 2, "ep": 2, "split": split, "chunk": chunk}
            case.update(vocab=args.vocab, record=False)
            torch.distributed.barrier()
            with _PeakRss() as rss:
                t0 = time.perf_counter()
                out = H.run_case(ctx, case)
                elapsed = time.perf_counter() - t0
            if repeat:
                times.setdefault(name, []).append(elapsed)
                peaks.setdefault(name, []).append(rss.peak - rss.start)
            assert out["policy_loss"], name
    base_t, base_m = statistics.median(times["nemo_rl"]), max(peaks["nemo_rl"])
    lines = [f"rank {rank}: vocab {args.vocab}, {args.seq} tokens, packing {bool(args.packing)}, chunk {args.chunk}"]
    for name in names:
        t, m = statistics.median(times[name]), max(peaks[name])
        lines.append(
            f"  {name:22s} time {t * 1e3:8.1f} ms ({t / base_t:5.2f}x)   "
            f"step peak above start {m / 2**20:7.1f} MiB ({m / max(base_m, 1):5.2f}x)"
        )
    print("\n".join(lines), flush=True)
    return []


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default=os.environ.get("NEMO_RS_NEMO_RL_CHECKOUTS", "").split(os.pathsep)[0])
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--chunk", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--packing", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from tests.support.distributed_harness import run_world

    run_world(2, rank_fn, args.host, args, timeout=1800)


if __name__ == "__main__":
    main()
