"""Peak memory one loss call allocates beyond its inputs (forward + backward), against NeMo-RL's loss.

Issue 52 asks the loss, in the form that runs on a GPU (metrics and input checks stacked:
``CorrectedPGLoss(batched_metrics=True)``), to peak at no more than NeMo-RL's ``ClippedPGLossFn``
on the same inputs. On the CPU the peak is read from torch's own allocator events
(``torch.profiler`` with ``profile_memory=True``: every tensor created and freed during the call,
in order), so it is exact and the same on every run and machine, unlike a resident-set reading;
on a GPU (``--device cuda``) it is ``torch.cuda.max_memory_allocated`` above the memory allocated
before the call. The inputs are not counted; the saved activations, every temporary, the
log-probs' gradient and the returned values are (the peak falls in the forward, where the metric
rows are evaluated).

Candidates, on the inputs of ``bench_loss.py`` (ragged responses, 2% log-prob mismatch):
NeMo-RL's loss on its token-TIS configuration (when a checkout is importable), and the plugin on
each configuration of ``bench_loss.CONFIGS`` in the GPU form and the CPU form
(``batched_metrics=False``: each metric row reduced where it is declared). Peaks are printed in
MiB and in units of one ``[B, T]`` float32 tensor (size-independent: the loss's temporaries are
``[B, T]``), with the ratio to NeMo-RL's.

Usage:
  python benchmarks/bench_memory.py [--nemo-rl ~/RL] [--size 8x32768] [--json PATH]
  python benchmarks/bench_memory.py --device cuda --nemo-rl .nemo-rl/nemo-rl-main
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_gpu import DEFAULT_NEMO_RL, HOST, nemo_rl_loss, to_device  # noqa: E402
from bench_loss import CONFIGS, make_batch  # noqa: E402

from nemo_rs_plugin import CorrectedPGLoss  # noqa: E402

FORMS = {"GPU form": True, "CPU form": False}


def _one_call(fn: Callable, batch) -> Callable[[], None]:
    lp0, data, gvs, gvt = batch
    lp = lp0.clone().requires_grad_(True)

    def call() -> None:
        loss, _ = fn(lp, data, gvs, gvt)
        loss.backward()
        lp.grad = None

    return call


def peak_bytes_cpu(call: Callable[[], None]) -> int:
    """The highest running total of the bytes ``call`` allocates and frees, from the allocator's own events.

    Every allocation and free the profiler records during ``call`` (``+size`` and ``-size``), in
    order: memory allocated before ``call`` and freed during it counts below 0, as it should not
    raise the peak.
    """
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        call()
    events = sorted(
        (event.start_time_ns, event.typed[1].alloc_size)
        for event in prof._memory_profile()._op_tree.dfs()
        if event.typed[0] == _EventType.Allocation
    )
    current = peak = 0
    for _, size in events:
        current += size
        peak = max(peak, current)
    return peak


def peak_bytes_cuda(call: Callable[[], None], device: torch.device) -> int:
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    call()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base


def measure(size: str, device: torch.device, nemo_rl: Path | None) -> list[dict]:
    """One row per candidate: its peak bytes, in ``[B, T]`` float32 units, and against NeMo-RL's.

    ``nemo_rl``: NeMo-RL's checkout (else an importable ``nemo_rl``: ``bench_gpu.nemo_rl_loss``);
    ``None``: the plugin's rows alone.
    """
    B, S = (int(v) for v in size.lower().split("x"))
    batch = to_device(make_batch(B, S), device, torch.float32)
    candidates: dict[str, Callable] = {}
    host, why = nemo_rl_loss(nemo_rl) if nemo_rl is not None else (None, "no checkout asked for")
    if host is not None:
        candidates[HOST] = host
    else:
        print(f"NeMo-RL comparison skipped: {why}")
    for name, cfg in CONFIGS.items():
        for form, batched in FORMS.items():
            candidates[f"{name}, {form}"] = CorrectedPGLoss(cfg, batched_metrics=batched)
    unit = B * S * 4
    rows = []
    for name, fn in candidates.items():
        call = _one_call(fn, batch)
        call()  # warm: lazy initialisation is not the loss's memory
        peak = peak_bytes_cuda(call, device) if device.type == "cuda" else peak_bytes_cpu(call)
        rows.append({"candidate": name, "size": size, "peak_bytes": peak, "units": peak / unit})
    base = next((r["peak_bytes"] for r in rows if r["candidate"] == HOST), None)
    for row in rows:
        row["vs_nemo_rl"] = row["peak_bytes"] / base if base else None
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--size", default="8x32768")
    ap.add_argument("--nemo-rl", type=Path, default=DEFAULT_NEMO_RL, help="NeMo-RL checkout (holds nemo_rl/)")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    torch.set_num_threads(1)
    rows = measure(args.size, device, args.nemo_rl)
    print(f"torch {torch.__version__}, {device}, {args.size}, float32 log-probs, forward + backward, one call")
    print(f"{'candidate':<44} | {'peak MiB':>9} | {'[B,T] fp32':>10} | / NeMo-RL")
    for r in rows:
        ratio = f"{r['vs_nemo_rl']:.2f}x" if r["vs_nemo_rl"] is not None else "n/a"
        print(f"{r['candidate']:<44} | {r['peak_bytes'] / 2**20:9.1f} | {r['units']:10.2f} | {ratio}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
