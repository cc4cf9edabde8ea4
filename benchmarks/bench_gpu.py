"""Time and peak memory of the loss on a GPU (CUDA events), eager and compiled, vs NeMo-RL's loss.

Candidates, each forward + backward + the metrics' host transfer, on the inputs of
``bench_loss.py`` (ragged responses, 2% log-prob mismatch):

  upstream-equivalent           NeMo-RL's defaults + IS correction + token TIS (no plugin field)
  upstream-equivalent compiled  the same with compile: true (dynamic shapes: one graph
                                for every size)
  rs-pipeline-3 [compiled]      Geo-RS + outlier veto + token kl_k3 filter, sequence_mean weights
  NeMo-RL ClippedPGLossFn       NeMo-RL's own loss on the upstream-equivalent config, when a
                                checkout is given (--nemo-rl) and importable; else one line says why

Every row prints the median time over --repeats calls, measured round-robin (CUDA events on a
GPU, wall clock on CPU), the peak memory one call allocates beyond its inputs
(``torch.cuda.max_memory_allocated``; "n/a" on CPU), and both as ratios to the eager
upstream-equivalent row of the same size, and the GPU kernels one call launches (the
profiler's kernel events; "n/a" on CPU). The compile time of each compiled configuration (its
first call) is printed once.

Usage:
  python benchmarks/bench_gpu.py [--device cuda] [--sizes 8x32768,4x65536] [--repeats 20]
                                 [--nemo-rl .nemo-rl/nemo-rl-main] [--no-compile] [--compile-backend B] [--json PATH]
  python benchmarks/bench_gpu.py --device cpu --sizes 2x1024 --repeats 2   # dry run, any machine
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_loss import CONFIGS, UPSTREAM, make_batch  # noqa: E402

from nemo_rs_plugin import CorrectedPGLoss  # noqa: E402

BASE = "upstream-equivalent"
HOST = "NeMo-RL ClippedPGLossFn"
DEFAULT_NEMO_RL = ROOT / ".nemo-rl" / "nemo-rl-main"


def nemo_rl_loss(checkout: Path | None):
    """NeMo-RL's ``ClippedPGLossFn`` on UPSTREAM as ``fn(lp, data, gvs, gvt)``, or None and why.

    From ``checkout``, or else a ``nemo_rl`` already importable (NeMo-RL's own environment).
    """
    if checkout is not None and (checkout / "nemo_rl").is_dir():
        sys.path.insert(0, str(checkout))
    elif importlib.util.find_spec("nemo_rl") is None:
        return None, f"no NeMo-RL checkout at {checkout} (extract one: see docs/performance.md#on-a-gpu)"
    try:
        from tests.support import nemo_rl_shims

        nemo_rl_shims.install()
        from nemo_rl.algorithms.loss import ClippedPGLossConfig, ClippedPGLossFn
        from nemo_rl.distributed.batched_data_dict import BatchedDataDict
    except Exception as exc:  # NeMo-RL imports many packages; the comparison is optional
        return None, f"NeMo-RL at {checkout} not importable ({type(exc).__name__}: {exc})"
    fn = ClippedPGLossFn(ClippedPGLossConfig(**UPSTREAM))

    def call(lp, data, gvs, gvt):
        return fn(lp, BatchedDataDict(data), gvs, gvt)

    return call, None


def to_device(batch, device, dtype):
    lp, data, gvs, gvt = batch
    data = {k: v.to(device) for k, v in data.items()}
    for k in ("prev_logprobs", "generation_logprobs", "reference_policy_logprobs"):
        data[k] = data[k].to(dtype)
    return lp.to(device, dtype), data, gvs.to(device), gvt.to(device)


def one_call(fn, batch, device):
    """Forward + backward + metrics transfer; (seconds, peak bytes beyond the inputs or None)."""
    lp0, data, gvs, gvt = batch
    lp = lp0.clone().requires_grad_(True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        loss, _ = fn(lp, data, gvs, gvt)  # the metrics' tolist() syncs once
        loss.backward()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / 1e3, torch.cuda.max_memory_allocated(device) - base
    t0 = time.perf_counter()
    loss, _ = fn(lp, data, gvs, gvt)
    loss.backward()
    return time.perf_counter() - t0, None


def kernels_launched(fn, batch, device) -> int | None:
    """GPU kernels one call launches (forward + backward + metrics transfer), from the profiler.

    Counted as the profiler's kernel events on the device (memcpy/memset activities are not
    kernels and are left out); ``None`` on CPU.
    """
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    one_call(fn, batch, device)  # warm: no lazy initialisation in the count
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        one_call(fn, batch, device)
    gpu = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sum(1 for e in gpu if "memcpy" not in e.name.lower() and "memset" not in e.name.lower())


def measure(candidates: dict, batch, device, repeats: int) -> dict:
    """Median time and max peak memory per candidate, round-robin after two warm-up rounds."""
    times: dict = {name: [] for name in candidates}
    peaks: dict = {name: [] for name in candidates}
    for i in range(repeats + 2):
        for name, fn in candidates.items():
            dt, peak = one_call(fn, batch, device)
            if i >= 2:
                times[name].append(dt)
                if peak is not None:
                    peaks[name].append(peak)
    return {name: (statistics.median(times[name]), max(peaks[name]) if peaks[name] else None) for name in candidates}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--sizes", default="8x32768,4x65536")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="dtype of the log-prob inputs (the loss computes in float32 either way)",
    )
    ap.add_argument("--nemo-rl", type=Path, default=DEFAULT_NEMO_RL, help="NeMo-RL checkout (holds nemo_rl/)")
    ap.add_argument("--no-compile", action="store_true", help="eager rows only")
    ap.add_argument(
        "--compile-backend",
        default="inductor",
        help="torch.compile backend of the compiled rows (eager, aot_eager: the same trace, no kernels; dry runs)",
    )
    ap.add_argument("--json", type=Path, help="also write the rows here")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench_gpu: no CUDA device; run with --device cpu for a dry run", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype)

    if not args.no_compile:
        # Compile from scratch: an honest compile time and kernel count, not a disk-cache hit.
        torch.compiler.config.force_disable_caches = True
    candidates = {}
    compile_s = {}
    for name in (BASE, "rs-pipeline-3"):
        candidates[name] = CorrectedPGLoss(CONFIGS[name])
        if not args.no_compile:
            candidates[f"{name} compiled"] = CorrectedPGLoss(
                {**CONFIGS[name], "compile": True}, compile_backend=args.compile_backend
            )
    host, why = nemo_rl_loss(args.nemo_rl)
    if host is not None:
        candidates[HOST] = host
    else:
        print(f"NeMo-RL comparison skipped: {why}")

    name_dev = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(
        f"torch {torch.__version__}, device {name_dev}, log-probs {args.dtype}, "
        f"median of {args.repeats}, forward + backward + metrics transfer"
    )
    rows = []
    for size in args.sizes.split(","):
        B, S = (int(v) for v in size.lower().split("x"))
        batch = to_device(make_batch(B, S), device, dtype)
        for name, fn in candidates.items():  # first calls: compilation, timed once
            if name.endswith("compiled") and name not in compile_s:
                from torch._inductor import metrics as inductor_metrics

                kernels = inductor_metrics.generated_kernel_count
                t0 = time.perf_counter()
                one_call(fn, batch, device)
                compile_s[name] = time.perf_counter() - t0
                kernels = inductor_metrics.generated_kernel_count - kernels
                print(
                    f"compile {name}: {compile_s[name]:.1f} s (first call, {size}, {args.compile_backend}), "
                    f"{kernels} generated kernels forward + backward"
                )
        results = measure(candidates, batch, device, args.repeats)
        launched = {name: kernels_launched(fn, batch, device) for name, fn in candidates.items()}
        base_t, base_m = results[BASE]
        header = (
            f"{'B x S':>9} | {'candidate':<28} | {'ms':>8} | {'time/base':>9} | {'peak MiB':>9} | mem/base | kernels"
        )
        print(header)
        print("-" * len(header))
        for name, (t, m) in results.items():
            mem = f"{m / 2**20:9.1f}" if m is not None else f"{'n/a':>9}"
            mem_ratio = f"{m / base_m:7.2f}x" if m is not None and base_m else "    n/a"
            k = launched[name] if launched[name] is not None else "n/a"
            print(f"{size:>9} | {name:<28} | {t * 1e3:8.2f} | {t / base_t:8.2f}x | {mem} | {mem_ratio} | {k:>7}")
            rows.append(
                {
                    "size": size,
                    "candidate": name,
                    "ms": t * 1e3,
                    "time_ratio": t / base_t,
                    "peak_bytes": m,
                    "mem_ratio": (m / base_m) if m is not None and base_m else None,
                    "kernels_launched": launched[name],
                }
            )
        if HOST in results:
            host_t, host_m = results[HOST]
            line = f"{size:>9} | upstream-equivalent / NeMo-RL: time {base_t / host_t:.2f}x"
            if host_m:
                line += f", peak memory {base_m / host_m:.2f}x"
            if f"{BASE} compiled" in results:
                line += f"; compiled / NeMo-RL: time {results[f'{BASE} compiled'][0] / host_t:.2f}x"
                comp_m = results[f"{BASE} compiled"][1]
                if host_m and comp_m is not None:
                    line += f", peak memory {comp_m / host_m:.2f}x"
            print(line)
    if compile_s:
        from torch._dynamo.utils import counters

        stats = counters["stats"]
        print(
            f"dynamo: {stats['unique_graphs']} graphs for {len(compile_s)} compiled configurations "
            f"over {len(args.sizes.split(','))} sizes (more means a recompile), "
            f"{sum(counters['graph_break'].values())} graph breaks"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {
                    "device": name_dev,
                    "torch": torch.__version__,
                    "dtype": args.dtype,
                    "compile_s": compile_s,
                    "rows": rows,
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
