"""Time the rs_clipped_pg loss (forward + backward) on CPU and print ratios.

Configurations, each timed at B x S = 8 x 8k, 8 x 32k and 4 x 64k:
  upstream-equivalent   NeMo-RL's defaults with IS correction + token TIS (no plugin field)
  seq_mean+seq-mask-tis is_correction_level: sequence_mean with seq-mask-tis
  rs-pipeline-3         Geo-RS + outlier veto + token kl_k3 filter, sequence_mean weights
and NeMo-RL's own ClippedPGLossFn on the upstream-equivalent config when it is importable
(PYTHONPATH pointing at a NeMo-RL checkout). Every time is reported as a ratio to the
upstream-equivalent configuration measured in the same process. With NeMo-RL importable a
second table times the plugin against NeMo-RL's loss in each of NeMo-RL's own configurations
(plain, IS + token TIS, ICE-POP, seq-mask-tis, GSPO), the two built from the same fields.

Targets: rs-pipeline-3 <= 1.15x upstream-equivalent; plugin <= 0.9x NeMo-RL in NeMo-RL's
configurations (issue 21). On the CPU a fresh [B, T] allocation costs far more than the
operator on reused memory, so ratios move with the machine's allocator state: run it
several times (docs/performance.md).

Usage: python benchmarks/bench_loss.py [--repeats 8] [--block 4] [--sizes 8x8192,8x32768,4x65536] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from nemo_rs_plugin import CorrectedPGLoss

UPSTREAM = {
    "use_importance_sampling_correction": True,
    "truncated_importance_sampling_type": "tis",
    "truncated_importance_sampling_ratio": 2.0,
}
CONFIGS = {
    "upstream-equivalent": UPSTREAM,
    "seq_mean+seq-mask-tis": {
        "use_importance_sampling_correction": True,
        "is_correction_level": "sequence_mean",
        "truncated_importance_sampling_type": "seq-mask-tis",
        "truncated_importance_sampling_ratio": 1.002,
        "truncated_importance_sampling_ratio_min": 0.999,
    },
    "rs-pipeline-3": {
        "use_importance_sampling_correction": True,
        "is_correction_level": "sequence_mean",
        "rejection_sampling": [
            {"level": "sequence", "statistic": "ratio", "agg": "mean", "lower": 0.999, "upper": 1.002},
            {"level": "sequence", "statistic": "ratio", "agg": "any", "lower": 1e-4, "upper": 100},
            {"level": "token", "statistic": "kl_k3", "upper": 0.5},
        ],
    },
}


# NeMo-RL's own modes, each timed as NeMo-RL's loss and as the plugin's, from the same fields.
NEMO_RL_CONFIGS = {
    "plain": {},
    "IS + token TIS": UPSTREAM,
    "IS + ICE-POP": {
        "use_importance_sampling_correction": True,
        "truncated_importance_sampling_type": "icepop",
        "truncated_importance_sampling_ratio": 2.0,
        "truncated_importance_sampling_ratio_min": 0.5,
    },
    "IS + seq-mask-tis": {
        "use_importance_sampling_correction": True,
        "truncated_importance_sampling_type": "seq-mask-tis",
        "truncated_importance_sampling_ratio": 1.002,
        "truncated_importance_sampling_ratio_min": 0.999,
    },
    "GSPO": {
        "use_importance_sampling_correction": True,
        "sequence_level_importance_ratios": True,
        "token_level_loss": False,
    },
}


def make_batch(B: int, S: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    prev = -torch.rand(B, S, generator=g) * 2
    # log-probs stay <= 0 (a positive one would be a caller's mistake the loss warns about)
    gen = (prev + 0.02 * torch.randn(B, S, generator=g)).clamp(max=0)
    curr = (prev + 0.01 * torch.randn(B, S, generator=g)).clamp(max=0)
    token_mask = torch.ones(B, S, dtype=torch.long)
    token_mask[:, : S // 16] = 0  # prompt
    for i in range(B):  # ragged response lengths
        token_mask[i, S - (i * S) // (4 * B) :] = 0
    data = {
        "input_ids": torch.zeros(B, S, dtype=torch.long),
        "advantages": torch.randn(B, 1, generator=g).expand(B, S).contiguous(),
        "prev_logprobs": prev,
        "generation_logprobs": gen * token_mask,
        "reference_policy_logprobs": (prev + 0.05 * torch.randn(B, S, generator=g)).clamp(max=0),
        "token_mask": token_mask,
        "sample_mask": torch.ones(B),
    }
    lp = curr[:, 1:].contiguous()
    valid = token_mask[:, 1:].float()
    return lp, data, torch.tensor(float(B)), valid.sum()


def time_losses(loss_fns: dict, batch, repeats: int, block: int = 4) -> dict:
    """Median forward+backward time per loss, over ``repeats`` rounds of ``block`` calls each.

    The candidates take turns by rounds, so slow drifts of a shared machine (other processes,
    frequency changes) do not bias one against another. Within a round a candidate is called
    ``block`` times in a row and the first call is not timed: a training run calls one loss
    over and over, and on the CPU the allocator's state left by the previous call (which
    pages it kept) moves the time of a ``[B, T]`` allocation by ~10x; strictly alternating
    candidates (``block=1``) times each in the heap the others left behind.
    """
    lp0, data, gvs, gvt = batch
    samples: dict = {name: [] for name in loss_fns}
    for _ in range(repeats):
        for name, fn in loss_fns.items():
            for call in range(max(block, 2)):
                lp = lp0.clone().requires_grad_(True)
                t0 = time.perf_counter()
                loss, _ = fn(lp, data, gvs, gvt)
                loss.backward()
                dt = time.perf_counter() - t0
                if call:  # the first call of a round settles the allocator after the other candidates
                    samples[name].append(dt)
    return {name: statistics.median(v) for name, v in samples.items()}


def nemo_rl_loss(cfg: dict):
    try:
        from nemo_rl.algorithms.loss import ClippedPGLossConfig, ClippedPGLossFn
        from nemo_rl.distributed.batched_data_dict import BatchedDataDict
    except Exception as exc:  # NeMo-RL is optional here
        print(f"NeMo-RL not importable ({type(exc).__name__}: {exc}); skipping its column")
        return None
    fn = ClippedPGLossFn(ClippedPGLossConfig(**cfg))

    def call(lp, data, gvs, gvt):
        return fn(lp, BatchedDataDict(data), gvs, gvt)

    return call


def print_header(header: str) -> None:
    print(header)
    print("-" * len(header))


def batches(sizes: str):
    """``(size, make_batch(B, S))`` for each ``BxS`` of a comma-separated list."""
    for size in sizes.split(","):
        B, S = (int(v) for v in size.lower().split("x"))
        yield size, make_batch(B, S)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=8, help="rounds; each times block - 1 calls per candidate")
    ap.add_argument("--block", type=int, default=4, help="calls per candidate in a round (the first untimed)")
    ap.add_argument("--sizes", default="8x8192,8x32768,4x65536")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads (the speed issue's goal is stated for 1)")
    args = ap.parse_args()
    torch.set_num_threads(max(1, args.threads))
    host = nemo_rl_loss(UPSTREAM)
    losses = {name: CorrectedPGLoss(cfg) for name, cfg in CONFIGS.items()}
    timed = args.repeats * (max(args.block, 2) - 1)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, median of {timed} ({args.repeats} rounds)")
    print_header(f"{'B x S':>10} | {'config':<23} | {'ms':>8} | ratio to upstream-equivalent")
    for size, batch in batches(args.sizes):
        candidates = dict(losses)
        if host is not None:
            candidates["NeMo-RL ClippedPGLossFn"] = host
        times = time_losses(candidates, batch, args.repeats, args.block)
        base = times["upstream-equivalent"]
        for name, t in times.items():
            print(f"{size:>10} | {name:<23} | {t * 1e3:8.1f} | {t / base:5.2f}x")
        if host is not None:
            ratio = base / times["NeMo-RL ClippedPGLossFn"]
            print(f"{size:>10} | upstream-equivalent / NeMo-RL = {ratio:.2f}x")
    if host is not None:
        compare_with_nemo_rl(args)


def compare_with_nemo_rl(args) -> None:
    """Plugin / NeMo-RL in each of NeMo-RL's configurations, timed together in one process."""
    print()
    columns = f"{'plugin ms':>9} | {'NeMo-RL ms':>10} | plugin / NeMo-RL"
    print_header(f"{'B x S':>10} | {'NeMo-RL configuration':<23} | {columns}")
    for size, batch in batches(args.sizes):
        for name, cfg in NEMO_RL_CONFIGS.items():
            times = time_losses(
                {"plugin": CorrectedPGLoss(dict(cfg)), "NeMo-RL": nemo_rl_loss(cfg)}, batch, args.repeats, args.block
            )
            plugin, host = times["plugin"], times["NeMo-RL"]
            print(f"{size:>10} | {name:<23} | {plugin * 1e3:9.1f} | {host * 1e3:10.1f} | {plugin / host:5.2f}x")


if __name__ == "__main__":
    main()
