"""Kernels of the compiled core and aten operators of the eager loss, per configuration, against NeMo-RL.

One loss call (forward + backward + the metrics' host transfer) on the three configurations the
kernel budget is stated for: NeMo-RL's defaults (``plain``), token TIS at 2 (``token-tis``) and
the five-stage pipeline (``sequence_mean`` + TIS + Geo-RS + veto + Token-MIS). Per row:

  compiled kernels   kernels inductor generates for the compiled core (``loss_fn.compile``),
                     forward + backward, from a cold cache (``torch._dynamo.reset()``, caches off)
  graphs / breaks    dynamo graphs and graph breaks of that call (1 / 0: the whole core is one graph)
  recompiles         graphs added by a second call at another batch size and length (0: dynamic
                     shapes hold)
  eager ops          non-view aten operators the eager loss dispatches (its GPU form,
                     ``batched_metrics=True``), and NeMo-RL's own ``ClippedPGLossFn`` on the same
                     configuration where it has one and a checkout is importable

The numbers are counts, not times: they do not depend on the machine, so a change that adds
kernels shows here on any CPU. ``--device cuda`` counts Triton kernels instead of C++ ones.

Usage:
  PYTHONPATH=<NeMo-RL checkout> python benchmarks/bench_kernels.py [--size 4x2048] [--device cpu]
  python benchmarks/bench_kernels.py --backend aot_eager   # graphs and breaks only, seconds
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_ops import PIPELINE, TIS, OpCounter, make_inputs, nemo_rl_loss  # noqa: E402

from nemo_rs_plugin import CorrectedPGLoss  # noqa: E402

KL = {"reference_policy_kl_penalty": 0.01}
CONFIGS = {
    "plain": (KL, True),  # (configuration, NeMo-RL has it)
    "token-tis": ({**KL, **TIS}, True),
    "sequence_mean+tis+geo-rs+veto+token-mis": ({**KL, **PIPELINE}, False),
}


def call(loss_fn, batch, wrap=lambda d: d) -> None:
    curr, data, gvs, gvt = batch
    lp = curr.clone().requires_grad_(True)
    loss, _ = loss_fn(lp, wrap(dict(data)), gvs, gvt)
    loss.backward()


def on(device: torch.device, batch):
    curr, data, gvs, gvt = batch
    return curr.to(device), {k: v.to(device) for k, v in data.items()}, gvs.to(device), gvt.to(device)


def compiled_counts(cfg: dict, batch, other_batch, backend: str) -> dict:
    """Generated kernels, graphs, graph breaks of one compiled call; graphs added by a second size."""
    from torch._dynamo.utils import counters
    from torch._inductor import metrics as inductor_metrics

    torch._dynamo.reset()
    counters.clear()
    inductor_metrics.reset()
    loss_fn = CorrectedPGLoss({**cfg, "compile": True}, compile_backend=backend)
    call(loss_fn, batch)
    kernels = inductor_metrics.generated_kernel_count
    graphs = counters["stats"]["unique_graphs"]
    breaks = sum(counters["graph_break"].values())
    call(loss_fn, other_batch)
    return {
        "compiled_kernels": kernels if backend == "inductor" else None,
        "graphs": graphs,
        "graph_breaks": breaks,
        "recompiles": counters["stats"]["unique_graphs"] - graphs,
    }


def eager_ops(loss_fn, batch, wrap=lambda d: d) -> int:
    call(loss_fn, batch, wrap)  # warm-up: lazy initialisation dispatches once
    with OpCounter() as counter:
        call(loss_fn, batch, wrap)
    return sum(counter.counts.values())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="4x2048", help="B x S of the batch (counts do not depend on it)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--backend", default="inductor", help="inductor (kernels) or aot_eager (graphs only)")
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    B, S = (int(v) for v in args.size.lower().split("x"))
    batch = on(device, make_inputs(B, S))
    other = on(device, make_inputs(B + 3, S // 2 + 5))
    torch.compiler.config.force_disable_caches = True  # honest kernel counts, not a cache hit

    rows = []
    for name, (cfg, upstream) in CONFIGS.items():
        row = {"config": name, **compiled_counts(cfg, batch, other, args.backend)}
        row["eager_ops"] = eager_ops(CorrectedPGLoss(cfg, batched_metrics=True), batch)
        host, wrap = nemo_rl_loss(cfg) if upstream else (None, None)
        row["nemo_rl_eager_ops"] = eager_ops(host, batch, wrap) if host is not None else None
        rows.append(row)

    print(
        f"torch {torch.__version__}, {device}, B x S = {B} x {S}, backend {args.backend}; "
        "one call = forward + backward + metrics transfer"
    )
    header = (
        f"{'config':42s} {'compiled kernels':>16s} {'graphs':>6s} {'breaks':>6s} {'recompiles':>10s} "
        f"{'eager ops':>9s} {'NeMo-RL ops':>11s} {'ratio':>6s}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        kernels = r["compiled_kernels"] if r["compiled_kernels"] is not None else "-"
        theirs = r["nemo_rl_eager_ops"]
        ratio = f"{r['eager_ops'] / theirs:6.2f}" if theirs else "     -"
        print(
            f"{r['config']:42s} {kernels:>16} {r['graphs']:>6} {r['graph_breaks']:>6} {r['recompiles']:>10} "
            f"{r['eager_ops']:>9} {theirs if theirs is not None else '-':>11} {ratio}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "device": str(device), "size": args.size, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
