"""Count the aten operators one loss call dispatches (forward + backward), against NeMo-RL's loss.

On a GPU the loss moves little data; its cost is one kernel launch per operator plus its host
syncs. The operator count is measured here on CPU with a ``TorchDispatchMode`` that records
every aten operator that is not a view (views launch no kernel), over forward and backward.
Host transfers (``.item()``, ``.tolist()``, ``bool()``/``float()`` of a tensor) are
counted with a ``TorchFunctionMode``: each is a host-device sync on a GPU. Ratios are against
NeMo-RL's own ``ClippedPGLossFn`` in the same process, on its plain config, so the numbers are
comparable across machines.

Targets (issue "Ready for the GPU"): each upstream-equivalent config dispatches no more ops
than NeMo-RL's loss on the same config; the five-stage pipeline at most 1.5x NeMo-RL's plain.
Issue 43: the three upstream-equivalent configs together at most 0.68x NeMo-RL's (the line
"all three"; ``--json`` writes the numbers for tests/nemo_rl/test_operator_budget.py).

The plugin evaluates its metrics and input checks stacked on accelerators and row by row on
the CPU (``nemo_rs_plugin.core.evaluation.batched_evaluation``); the counts here are those of the GPU
form (``CorrectedPGLoss(batched_metrics=True)``), ``--cpu-form`` counts what a CPU run dispatches.

Usage: PYTHONPATH=<NeMo-RL checkout> python benchmarks/bench_ops.py [--top 8] [--size 4x256]
Without NeMo-RL importable the plugin's counts are printed alone.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nemo_rs_plugin import CorrectedPGLoss  # noqa: E402

TIS = {
    "use_importance_sampling_correction": True,
    "truncated_importance_sampling_type": "tis",
    "truncated_importance_sampling_ratio": 2.0,
}
SEQ_MASK_TIS = {
    "use_importance_sampling_correction": True,
    "truncated_importance_sampling_type": "seq-mask-tis",
    "truncated_importance_sampling_ratio": 1.002,
    "truncated_importance_sampling_ratio_min": 0.999,
}
UPSTREAM_CONFIGS = {"plain": {}, "tis": TIS, "seq-mask-tis": SEQ_MASK_TIS}
PIPELINE = {
    "use_importance_sampling_correction": True,
    "is_correction_level": "sequence_mean",
    "truncated_importance_sampling_type": "tis",
    "truncated_importance_sampling_ratio": 2.0,
    "rejection_sampling": [
        {"level": "sequence", "statistic": "ratio", "agg": "mean", "lower": 0.999, "upper": 1.002},
        {"level": "sequence", "statistic": "ratio", "agg": "any", "lower": 1e-4, "upper": 1e4},
        {"level": "token", "statistic": "ratio", "lower": 0.5, "upper": 2.0},
    ],
}


class OpCounter(TorchDispatchMode):
    """Counts non-view aten operators by name."""

    def __init__(self):
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.counts[str(func.overloadpacket).removeprefix("aten.")] += 1
        return func(*args, **(kwargs or {}))


class HostTransferCounter(TorchFunctionMode):
    """Counts calls that move a tensor's values to the host."""

    TRANSFERS = {
        torch.Tensor.item,
        torch.Tensor.tolist,
        torch.Tensor.__bool__,
        torch.Tensor.__float__,
        torch.Tensor.__int__,
    }

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.TRANSFERS:
            self.count += 1
        return func(*args, **(kwargs or {}))


def make_inputs(B: int, S: int):
    g = torch.Generator().manual_seed(0)
    prev = -torch.rand(B, S, generator=g) * 2
    token_mask = torch.ones(B, S, dtype=torch.long)
    token_mask[:, :2] = 0
    data = {
        "input_ids": torch.zeros(B, S, dtype=torch.long),
        "advantages": torch.randn(B, 1, generator=g).expand(B, S).contiguous(),
        "prev_logprobs": prev * token_mask,
        "generation_logprobs": (prev + 0.01 * torch.randn(B, S, generator=g)).clamp(max=0) * token_mask,
        "reference_policy_logprobs": prev * token_mask,
        "token_mask": token_mask,
        "sample_mask": torch.ones(B),
    }
    curr = (prev[:, 1:] + 0.01 * torch.randn(B, S - 1, generator=g)).clamp(max=0)  # log-probs <= 0
    return curr, data, torch.tensor(float(B)), token_mask[:, 1:].sum().float()


def count(loss_fn, B: int, S: int, wrap=lambda d: d) -> collections.Counter:
    """Operators by name, plus ``<host transfers>`` and ``<saved>``: the bytes autograd keeps
    for the backward (distinct storages, the log-probs' own included) in units of one
    ``[B, T]`` float32 tensor, the part of a call's peak memory that lives until the backward."""
    curr, data, gvs, gvt = make_inputs(B, S)
    loss_fn(curr.clone().requires_grad_(True), wrap(dict(data)), gvs, gvt)[0].backward()  # warm-up
    lp = curr.clone().requires_grad_(True)
    saved: dict = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with HostTransferCounter() as transfers, OpCounter() as counter:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss, _ = loss_fn(lp, wrap(dict(data)), gvs, gvt)
        loss.backward()
    counter.counts["<host transfers>"] = transfers.count
    counter.counts["<saved>"] = sum(saved.values()) / (4 * curr.numel())
    return counter.counts


def nemo_rl_loss(cfg: dict):
    """NeMo-RL's own loss for ``cfg`` (and its data wrapper), or ``None`` without NeMo-RL."""
    try:
        from tests.support import nemo_rl_shims

        nemo_rl_shims.install()
        from nemo_rl.algorithms import loss as host
        from nemo_rl.distributed.batched_data_dict import BatchedDataDict
    except Exception:  # noqa: BLE001 - NeMo-RL not importable: plugin numbers alone
        return None, None
    full = {"reference_policy_kl_penalty": 0.01, **cfg}
    if hasattr(host.ClippedPGLossConfig, "model_fields"):  # v0.7.0 on: pydantic, with NeMo-RL's defaults
        config = host.ClippedPGLossConfig(**full)
    else:  # v0.6.0: a TypedDict without defaults; its recipes set every field, as here
        from tests.support.nemo_rl_live_parity import BASE

        config = {**BASE, **full}
    return host.ClippedPGLossFn(config), BatchedDataDict


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="4x256", help="B x S of the batch (op counts do not depend on it)")
    parser.add_argument("--top", type=int, default=8, help="most frequent operators to list per config")
    parser.add_argument("--cpu-form", action="store_true", help="count the CPU form (metrics row by row)")
    parser.add_argument("--json", metavar="PATH", help="also write the counts as JSON to PATH")
    args = parser.parse_args(argv)
    batched = not args.cpu_form
    B, S = (int(v) for v in args.size.lower().split("x"))

    rows = []
    nemo_plain = None
    for name, cfg in UPSTREAM_CONFIGS.items():
        host, wrap = nemo_rl_loss(cfg)
        nemo = count(host, B, S, wrap) if host is not None else None
        if name == "plain" and nemo is not None:
            nemo_plain = sum(v for k, v in nemo.items() if not k.startswith("<"))
        rows.append(
            (
                f"upstream-equivalent/{name}",
                count(CorrectedPGLoss({"reference_policy_kl_penalty": 0.01, **cfg}, batched_metrics=batched), B, S),  # noqa: E501
                nemo,
            )
        )
    rows.append(
        (
            "sequence_mean+tis+geo-rs+veto+token-mis",
            count(CorrectedPGLoss(PIPELINE, batched_metrics=batched), B, S),
            None,
        )
    )

    form = "CPU form: rows one by one" if args.cpu_form else "GPU form: rows stacked"
    print(f"aten operators per loss call (forward + backward, non-view), B x S = {B} x {S}; {form}")
    print(
        f"{'config':42s} {'plugin':>7s} {'NeMo-RL':>8s} {'ratio':>6s} {'host transfers':>15s} {'vs NeMo-RL plain':>17s}"
        f" {'saved for backward, [B,T] fp32':>31s}"
    )
    summary: dict = {"rows": {}}
    for name, ours, theirs in rows:
        syncs = ours.pop("<host transfers>")
        their_syncs = theirs.pop("<host transfers>") if theirs is not None else None
        kept = f"{ours.pop('<saved>'):.1f}" + (f" vs {theirs.pop('<saved>'):.1f}" if theirs is not None else "")
        total = sum(ours.values())
        ref = sum(theirs.values()) if theirs is not None else None
        ratio = f"{total / ref:6.2f}" if ref else "     -"
        plain = f"{total / nemo_plain:17.2f}" if nemo_plain else "                -"
        transfers = f"{syncs} vs {their_syncs}" if their_syncs is not None else str(syncs)
        ref_text = ref if ref is not None else "-"
        print(f"{name:42s} {total:7d} {ref_text:>8} {ratio} {transfers:>15s} {plain} {kept:>31s}")
        summary["rows"][name] = {"plugin": total, "nemo_rl": ref, "host_transfers": syncs}
    upstream = [r for n, r in summary["rows"].items() if n.startswith("upstream-equivalent/")]
    if all(r["nemo_rl"] for r in upstream):
        ours_all, theirs_all = sum(r["plugin"] for r in upstream), sum(r["nemo_rl"] for r in upstream)
        summary["upstream_ratio"] = ours_all / theirs_all
        print(f"{'upstream-equivalent, all three':42s} {ours_all:7d} {theirs_all:8d} {ours_all / theirs_all:6.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    for name, ours, theirs in rows:
        top = ", ".join(f"{op} {n}" for op, n in ours.most_common(args.top))
        print(f"  {name}: {top}")
        if theirs is not None:
            print(f"  {'NeMo-RL':>{len(name)}}: " + ", ".join(f"{op} {n}" for op, n in theirs.most_common(args.top)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
