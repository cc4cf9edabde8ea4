"""Memory and time of target log-probs from logits: the plugin's chunked path against NeMo-RL's two.

With ``sharded_logits_input`` (the 64k recipe) NeMo-RL hands the loss each rank's logits shard
``[B, T/cp, V/tp]`` and the plugin computes the target log-probs itself
(nemo_rs_plugin/parallel/vocab_parallel.py). This measures that step, forward + backward,
against what NeMo-RL runs for its own loss on the same shard (nemo_rl/distributed/model_utils.py
of the checkout given):

  plugin                the plugin's ``target_logprobs`` at ``--chunk`` positions per chunk;
  nemo-rl-chunked       NeMo-RL's ``ChunkedDistributedLogprob`` at the same chunk size (what
                        ``policy.logprob_chunk_size`` selects);
  nemo-rl               NeMo-RL's ``DistributedLogprob`` (``policy.logprob_chunk_size`` unset);
  plugin-unchunked      (``--variants``, off by default) the plugin's path before it was
                        chunked (tests/support/unchunked_logprobs.py).

Each variant runs in fresh processes (one per TP rank, gloo on the CPU, NCCL on a GPU), so no
allocator cache carries memory from one to another. On rank 0: the inputs (the logits shard in
``--dtype``, the target ids, the upstream gradient) are made first; then, on the CPU, the
resident set's peak is reset (``/proc/self/clear_refs``) and one forward + backward runs,
keeping the logits' gradient: **peak** is the peak resident set above the resident set once the
inputs existed (on a GPU: ``torch.cuda.max_memory_allocated`` above ``memory_allocated``). The
gradient of the logits, in their dtype, is the floor every variant pays (``x logits`` 1.0).
**time**: the median of ``--repeats`` further forward + backward calls (wall time, one intra-op
thread per rank on the CPU). Ratios are against NeMo-RL's chunked path (memory) and its
unchunked path (time) of the same row. ``lp`` prints the sum of the log-probs: the variants of a
row must agree (the tests hold them equal: tests/parallel/test_chunked_logprobs.py).

``--sweep`` runs the plugin alone over several chunk sizes at the first shape: what the default
chunk size (``DEFAULT_LOGPROB_CHUNK_SIZE``) rests on.

Usage (NeMo-RL's checkout on ``--nemo-rl``, or ``$NEMO_RS_NEMO_RL_CHECKOUTS``' last entry):
  python benchmarks/bench_logprob_memory.py --nemo-rl ~/RL
  python benchmarks/bench_logprob_memory.py --nemo-rl ~/RL --tp 2 --dtype bf16 --shapes 16384x16384
  python benchmarks/bench_logprob_memory.py --nemo-rl ~/RL --sweep 256,512,1024,2048,4096
  python benchmarks/bench_logprob_memory.py --nemo-rl ~/RL --device cuda --shapes 16384x37984
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("plugin", "nemo-rl-chunked", "nemo-rl", "plugin-unchunked")
DTYPES = {"bf16": "bfloat16", "fp32": "float32"}
MIB = 2**20


# ----------------------------------------------------------------------------- one rank
def _status_kib(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _logprob_function(variant: str, nemo_rl_path: str, chunk: int):
    """``f(logits, target, group, v_start, v_end) -> [B, T] log-probs`` of one variant."""
    if variant == "plugin":
        from nemo_rs_plugin.parallel.vocab_parallel import target_logprobs

        return lambda z, y, g, s, e: target_logprobs(z, y, g, chunk)
    if variant == "plugin-unchunked":
        sys.path.insert(0, str(ROOT))
        from tests.support.unchunked_logprobs import unchunked_target_logprobs

        return lambda z, y, g, s, e: unchunked_target_logprobs(z, y, g)
    sys.path.insert(0, nemo_rl_path)
    sys.path.insert(0, str(ROOT))
    from tests.support import nemo_rl_shims

    nemo_rl_shims.install()
    from nemo_rl.distributed.model_utils import ChunkedDistributedLogprob, DistributedLogprob

    if variant == "nemo-rl-chunked":
        return lambda z, y, g, s, e: ChunkedDistributedLogprob.apply(z, y, s, e, chunk, g, False)
    return lambda z, y, g, s, e: DistributedLogprob.apply(z, y, s, e, g, False)


def worker(args: argparse.Namespace) -> None:
    """One rank: the inputs, one measured forward + backward, then the timed repeats."""
    import torch
    import torch.distributed as dist

    rank, tp = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cuda = args.device == "cuda"
    dist.init_process_group(
        "nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank, world_size=tp
    )
    group = dist.new_group(list(range(tp)))
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    fn = _logprob_function(args.variant, args.nemo_rl, args.chunk)
    dtype = getattr(torch, DTYPES[args.dtype])
    T, V = args.T, args.V
    shared = torch.Generator().manual_seed(0)
    target = torch.randint(0, V * tp, (1, T), generator=shared).to(device)
    grad_out = torch.randn(1, T, generator=shared).to(device)
    own = torch.Generator().manual_seed(1 + rank)
    logits = torch.empty(1, T, V, dtype=dtype, device=device)
    for s in range(0, T, 1024):  # filled in slices: no float32 copy of the whole shard
        logits[:, s : s + 1024] = (torch.randn(1, min(1024, T - s), V, generator=own) * 2).to(dtype)
    logits.requires_grad_(True)
    v_start, v_end = rank * V, (rank + 1) * V
    dist.barrier(group)
    gc.collect()
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        base = _status_kib("VmRSS") * 1024
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")  # reset the peak resident set (VmHWM) to the current one
    start = time.perf_counter()
    lp = fn(logits, target, group, v_start, v_end)
    lp.backward(grad_out)
    if cuda:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = _status_kib("VmHWM") * 1024 - base
    first = time.perf_counter() - start
    lp_sum, grad_norm = float(lp.sum()), float(logits.grad.float().norm())
    times = []
    for _ in range(args.repeats):
        logits.grad = None
        del lp
        gc.collect()
        dist.barrier(group)
        start = time.perf_counter()
        lp = fn(logits, target, group, v_start, v_end)
        lp.backward(grad_out)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    if rank == 0:
        logits_bytes = logits.numel() * logits.element_size()
        print(
            "RESULT "
            + json.dumps(
                {
                    "peak": peak,
                    "logits_bytes": logits_bytes,
                    "time": statistics.median(times) if times else first,
                    "first": first,
                    "lp_sum": lp_sum,
                    "grad_norm": grad_norm,
                }
            ),
            flush=True,
        )
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- the driver
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(script: str, arguments: list[str], world: int, timeout: float, label: str) -> dict:
    """``script --worker --port P arguments`` in ``world`` fresh processes (RANK, WORLD_SIZE set); rank 0's RESULT."""
    command = [sys.executable, script, "--worker", "--port", str(_free_port()), *arguments]
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, WORLD_SIZE=str(world), PYTHONPATH=path)
    procs = [
        subprocess.Popen(command, env=dict(env, RANK=str(r)), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for r in range(world)
    ]
    outputs = [p.communicate(timeout=timeout) for p in procs]
    for p, (_, err) in zip(procs, outputs):
        if p.returncode != 0:
            raise RuntimeError(f"{label}: exit {p.returncode}\n{err[-3000:]}")
    line = next(line for line in outputs[0][0].splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def run_variant(args: argparse.Namespace, variant: str, tp: int, dtype: str, T: int, V: int, chunk: int) -> dict:
    """One variant in ``tp`` fresh processes; rank 0's measures."""
    arguments = ["--variant", variant, "--dtype", dtype, "--T", str(T), "--V", str(V), "--chunk", str(chunk)]
    arguments += ["--repeats", str(args.repeats), "--device", args.device, "--nemo-rl", args.nemo_rl]
    return run_ranks(__file__, arguments, tp, args.timeout, f"{variant} tp={tp} {dtype} T={T} V={V}")


def _shapes(text: str) -> list[tuple[int, int]]:
    return [tuple(int(n) for n in s.split("x")) for s in text.split(",")]  # type: ignore[misc]


def print_table(args: argparse.Namespace) -> None:
    variants = args.variants.split(",")
    for tp in (int(t) for t in args.tp.split(",")):
        for dtype in args.dtype.split(","):
            for T, V in _shapes(args.shapes):
                rows = {v: run_variant(args, v, tp, dtype, T, V, args.chunk) for v in variants}
                logits_mib = rows[variants[0]]["logits_bytes"] / MIB
                print(
                    f"\nTP {tp}, {dtype} logits [1, {T}, {V}] per rank ({logits_mib:.0f} MiB), chunk {args.chunk}, "
                    f"{args.device}"
                )
                print(
                    f"  {'variant':<18} {'peak MiB':>9} {'x logits':>9} {'vs chunked':>11} "
                    f"{'time s':>8} {'vs unchunked':>13} {'lp sum':>14}"
                )
                for v, r in rows.items():
                    mem = r["peak"] / rows["nemo-rl-chunked"]["peak"] if "nemo-rl-chunked" in rows else float("nan")
                    tim = r["time"] / rows["nemo-rl"]["time"] if "nemo-rl" in rows else float("nan")
                    print(
                        f"  {v:<18} {r['peak'] / MIB:>9.0f} {r['peak'] / r['logits_bytes']:>9.2f} {mem:>10.2f}x "
                        f"{r['time']:>8.3f} {tim:>12.2f}x {r['lp_sum']:>14.6g}",
                        flush=True,
                    )


def print_sweep(args: argparse.Namespace) -> None:
    T, V = _shapes(args.shapes)[0]
    for tp in (int(t) for t in args.tp.split(",")):
        for dtype in args.dtype.split(","):
            print(f"\nplugin chunk sweep: TP {tp}, {dtype} logits [1, {T}, {V}] per rank, {args.device}")
            print(f"  {'chunk':>7} {'peak MiB':>9} {'x logits':>9} {'time s':>8}")
            for chunk in (int(c) for c in args.sweep.split(",")):
                r = run_variant(args, "plugin", tp, dtype, T, V, chunk)
                print(
                    f"  {chunk:>7} {r['peak'] / MIB:>9.0f} {r['peak'] / r['logits_bytes']:>9.2f} {r['time']:>8.3f}",
                    flush=True,
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    checkouts = [p for p in os.environ.get("NEMO_RS_NEMO_RL_CHECKOUTS", "").split(os.pathsep) if p]
    parser.add_argument("--nemo-rl", default=checkouts[-1] if checkouts else "", help="NeMo-RL checkout")
    parser.add_argument("--tp", default="1,2", help="TP sizes (processes per variant), comma-separated")
    parser.add_argument("--dtype", default="bf16,fp32", help="logits dtypes: bf16, fp32")
    parser.add_argument("--shapes", default="4096x16384,16384x16384,8192x32768", help="T x V_local per rank")
    parser.add_argument("--chunk", type=int, default=1024, help="positions per chunk (both chunked paths)")
    parser.add_argument("--variants", default="plugin,nemo-rl-chunked,nemo-rl", help=f"from {', '.join(VARIANTS)}")
    parser.add_argument("--repeats", type=int, default=2, help="timed calls after the measured one")
    parser.add_argument("--sweep", default="", help="chunk sizes: the plugin alone at the first shape")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per variant")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--T", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--V", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    unknown = sorted(set(args.variants.split(",")) - set(VARIANTS))
    if unknown:
        parser.error(f"--variants: unknown {unknown}; allowed: {', '.join(VARIANTS)}")
    needs_host = args.sweep == "" and any(v.startswith("nemo-rl") for v in args.variants.split(","))
    if needs_host and not (Path(args.nemo_rl) / "nemo_rl").is_dir():
        parser.error(f"--nemo-rl: {args.nemo_rl!r} is not a NeMo-RL checkout (it has no nemo_rl/ folder)")
    import torch

    print(f"torch {torch.__version__}, NeMo-RL {args.nemo_rl or '(not used)'}, {os.cpu_count()} CPUs")
    if args.sweep:
        print_sweep(args)
    else:
        print_table(args)


if __name__ == "__main__":
    main()
