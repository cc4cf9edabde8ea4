"""The 64k recipe's two input paths at scaled shapes: the logits shard vs NeMo-RL's gathered log-probs.

The recipe (recipes/grpo-qwen3-30ba3b-8n8g-megatron-cp4-64k-rs.yaml) can take either path for its
loss section, run here on every rank of a TP x CP world (gloo, CPU; one process per rank):

  sharded          ``sharded_logits_input: true``: the plugin's chunked log-probs on the rank's
                   logits shard ``[1, T/cp, V/tp]``, the loss on the CP-local tokens, its
                   per-sequence statistics all-reduced over CP (nemo_rs_plugin/parallel/sharded.py);
  logprobs         log-prob input, as NeMo-RL's Megatron worker prepares it for a LOGPROB loss:
                   ``from_parallel_logits_to_logprobs`` (its ``ChunkedDistributedLogprob`` at
                   ``--chunk``, then the CP all-gather of the log-probs, ``AllGatherCPTensor``), and
                   the loss on the whole sequence on every CP rank;
  logprobs-unchunked  the same with ``policy.logprob_chunk_size`` unset (``DistributedLogprob``).

Both divide the loss by ``cp`` as NeMo-RL's ``LossPostProcessor`` does. Per variant, fresh
processes; on rank 0: **peak**, the peak resident set above the resident set once the inputs
existed (forward + backward, the logits' gradient kept); **time**, the median wall time of
``--repeats`` further calls (one thread per rank: with more ranks than cores the time is shared);
**sent**, the payload each rank hands to collectives in one forward + backward (the tensor of an
all-reduce, the input of an all-gather), and how many collectives; **|grad|**, the norm of rank
0's logits gradient (the paths compute the same gradient: tests/parallel/test_real_megatron.py).
NeMo-RL's ``use_fused_linear_logprobs`` computes log-probs from the hidden states in a fused GPU
kernel (Megatron's linear cross-entropy); it does not run on the CPU and is not measured here.

Usage: python benchmarks/bench_64k_paths.py --nemo-rl ~/RL [--tp 2 --cp 2 --T 16384 --V 16384]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "grpo-qwen3-30ba3b-8n8g-megatron-cp4-64k-rs.yaml"
VARIANTS = ("sharded", "logprobs", "logprobs-unchunked")
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast")
MIB = 2**20
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_logprob_memory import _status_kib, run_ranks  # noqa: E402


def loss_section() -> dict:
    """The 64k recipe's ``loss_fn`` as the core loss takes it (no name, no input-path switch)."""
    with open(RECIPE) as fh:
        section = dict(yaml.safe_load(fh)["loss_fn"])
    for key in ("name", "sharded_logits_input"):
        section.pop(key, None)
    return section


def _make_data(T: int, vocab: int):
    """One sequence of ``T`` tokens (a 1/32 prompt), identical on every rank."""
    import torch

    g = torch.Generator().manual_seed(0)
    token_mask = torch.ones(1, T, dtype=torch.long)
    token_mask[:, : T // 32] = 0
    prev = -torch.rand(1, T, generator=g) * 3
    data = {
        "input_ids": torch.randint(0, vocab, (1, T), generator=g),
        "advantages": torch.full((1, T), 0.7),
        "prev_logprobs": prev * token_mask,
        "generation_logprobs": (prev + 0.01 * torch.randn(1, T, generator=g)) * token_mask,
        "reference_policy_logprobs": prev * token_mask,
        "token_mask": token_mask,
        "sample_mask": torch.ones(1),
    }
    return data, torch.tensor(1.0), token_mask[:, 1:].sum().float()


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    tp, cp = args.tp, args.cp
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    # Megatron's order: TP fastest. Every rank creates every group, in the same order.
    tp_groups = [dist.new_group(list(range(c * tp, (c + 1) * tp))) for c in range(cp)]
    cp_groups = [dist.new_group(list(range(t, world, tp))) for t in range(tp)]
    tp_rank, cp_rank = rank % tp, rank // tp
    tp_group, cp_group = tp_groups[cp_rank], cp_groups[tp_rank]

    from nemo_rs_plugin import CorrectedPGLoss
    from nemo_rs_plugin.parallel.sharded import sharded_loss

    sys.path.insert(0, args.nemo_rl)
    sys.path.insert(0, str(ROOT))
    from tests.support import nemo_rl_shims

    nemo_rl_shims.install()
    from nemo_rl.distributed.model_utils import from_parallel_logits_to_logprobs

    T, V = args.T, args.V
    data, gvs, gvt = _make_data(T, V * tp)
    loss_fn = CorrectedPGLoss(loss_section())
    own = torch.Generator().manual_seed(1 + rank)
    logits = torch.empty(1, T // cp, V, dtype=torch.bfloat16)
    for s in range(0, T // cp, 1024):
        logits[:, s : s + 1024] = torch.randn(1, min(1024, T // cp - s), V, generator=own) * 2
    logits.requires_grad_(True)

    def step():
        if args.variant == "sharded":
            loss, _ = sharded_loss(
                loss_fn, logits, data, gvs, gvt, cp_group=cp_group, tp_group=tp_group, chunk_size=args.chunk
            )
        else:
            chunk = args.chunk if args.variant == "logprobs" else None
            lp = from_parallel_logits_to_logprobs(
                logits, data["input_ids"], tp_rank * V, (tp_rank + 1) * V, tp_group, False, cp_group, chunk
            )
            loss, _ = loss_fn(lp, data, gvs, gvt)
        (loss / cp).backward()

    sent = []
    saved = {name: getattr(dist, name) for name in COLLECTIVES}

    def counting(name):
        def call(*args, **kwargs):
            if name.startswith("all_gather"):  # (outputs, input): the input is what this rank sends
                payload = args[1] if len(args) > 1 else kwargs.get("tensor", kwargs.get("input_tensor"))
            else:
                payload = args[0] if args else kwargs["tensor"]
            sent.append((name, payload.numel() * payload.element_size()))
            return saved[name](*args, **kwargs)

        return call

    dist.barrier()
    gc.collect()
    base = _status_kib("VmRSS") * 1024
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")
    for name in COLLECTIVES:
        setattr(dist, name, counting(name))
    start = time.perf_counter()
    step()
    first = time.perf_counter() - start
    for name, fn in saved.items():
        setattr(dist, name, fn)
    peak = _status_kib("VmHWM") * 1024 - base
    grad_norm = float(logits.grad.float().norm())
    times = []
    for _ in range(args.repeats):
        logits.grad = None
        gc.collect()
        dist.barrier()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    if rank == 0:
        result = {
            "peak": peak,
            "logits_bytes": logits.numel() * logits.element_size(),
            "time": statistics.median(times) if times else first,
            "sent": sum(n for _, n in sent),
            "collectives": len(sent),
            "grad_norm": grad_norm,
        }
        print("RESULT " + json.dumps(result), flush=True)
    dist.destroy_process_group()


def run_variant(args: argparse.Namespace, variant: str) -> dict:
    """One variant in ``tp * cp`` fresh processes; rank 0's measures."""
    arguments = ["--variant", variant, "--tp", str(args.tp), "--cp", str(args.cp), "--T", str(args.T)]
    arguments += [
        "--V",
        str(args.V),
        "--chunk",
        str(args.chunk),
        "--repeats",
        str(args.repeats),
        "--nemo-rl",
        args.nemo_rl,
    ]
    return run_ranks(__file__, arguments, args.tp * args.cp, args.timeout, variant)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    checkouts = [p for p in os.environ.get("NEMO_RS_NEMO_RL_CHECKOUTS", "").split(os.pathsep) if p]
    parser.add_argument("--nemo-rl", default=checkouts[-1] if checkouts else "", help="NeMo-RL checkout")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--T", type=int, default=16384, help="tokens of the sequence (T/cp per rank)")
    parser.add_argument("--V", type=int, default=16384, help="vocabulary per TP rank")
    parser.add_argument("--chunk", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if not (Path(args.nemo_rl) / "nemo_rl").is_dir():
        parser.error(f"--nemo-rl: {args.nemo_rl!r} is not a NeMo-RL checkout (it has no nemo_rl/ folder)")
    unknown = sorted(set(args.variants.split(",")) - set(VARIANTS))
    if unknown:
        parser.error(f"--variants: unknown {unknown}; allowed: {', '.join(VARIANTS)}")
    import torch

    print(
        f"torch {torch.__version__}, NeMo-RL {args.nemo_rl}, {os.cpu_count()} CPUs; TP {args.tp} x CP {args.cp}, "
        f"one sequence of {args.T} tokens, bf16 logits [1, {args.T // args.cp}, {args.V}] per rank, chunk {args.chunk}"
    )
    print(
        f"  {'variant':<20} {'peak MiB':>9} {'x logits':>9} {'time s':>8} {'sent KiB':>9} {'collectives':>12} "
        f"{'|grad| rank 0':>14}"
    )
    for variant in args.variants.split(","):
        r = run_variant(args, variant)
        print(
            f"  {variant:<20} {r['peak'] / MIB:>9.0f} {r['peak'] / r['logits_bytes']:>9.2f} {r['time']:>8.3f} "
            f"{r['sent'] / 1024:>9.1f} {r['collectives']:>12} {r['grad_norm']:>14.6g}",
            flush=True,
        )


if __name__ == "__main__":
    main()
