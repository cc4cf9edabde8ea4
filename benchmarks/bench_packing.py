"""Time the plugin's loss against NeMo-RL's on the calls NeMo-RL makes under sequence packing.

Under sequence packing without ``fuse_loss`` (Megatron's default, the DTensor worker,
automodel) NeMo-RL's ``SequencePackingLossWrapper`` calls the loss once per packed sequence,
``B = 1`` and a few hundred tokens: there a loss's fixed per-call cost, not its arithmetic,
sets the time (the plugin gathers those calls into one per microbatch with log-probs as
input: nemo_rs_plugin/nemo_rl/packing.py). Measured here, forward + backward, in one process,
for each configuration:

  B = 1           one lone loss call on one 512-token sequence (NeMo-RL with micro-batch size 1
                  and packing off), next-token log-probs given directly: plugin / NeMo-RL;
  packed          NeMo-RL's real ``SequencePackingLossWrapper`` with its ``prepare_loss_input``
                  (from the NeMo-RL checkout on PYTHONPATH) over 32 packed sequences of lengths
                  drawn uniformly from 64-512 tokens (seed 0), vocabulary V = 64 so that the
                  log-softmax does not dominate: plugin wrapper time / NeMo-RL wrapper time, and
                  the plugin's extra time per sequence;
  8 x 32k         (``--large``, off by default: slow) one call on 8 x 32768 log-probs, to show
                  that the large-call ratio (bench_loss.py) still holds next to these.

Configurations: NeMo-RL's own (bench_loss.NEMO_RL_CONFIGS: plain, IS + token TIS, IS +
ICE-POP, IS + seq-mask-tis, GSPO), each built as NeMo-RL's ``ClippedPGLossFn`` and as the
plugin's ``rs_clipped_pg`` from the same fields (the way GRPO builds them:
tests/support/packing_host.py); then the ``loss_fn`` sections of the shipped recipes
(recipes/*.yaml), plugin only: NeMo-RL has nothing equivalent to their plugin fields, so each
is printed with its absolute time and its ratio to NeMo-RL's *plain* configuration, timed
alongside it. A recipe with ``sharded_logits_input`` takes logits, not log-probs: its B = 1
and 8 x 32k calls (and NeMo-RL's plain beside them) then go through ``prepare_loss_input``
from ``[B, T, V]`` logits, and its packed sequences are padded to even lengths (its layout).

Timing: thread CPU time (``time.thread_time``, so other processes on a shared machine do not
count) of each call, one intra-op thread (``torch.set_num_threads``; on the CPU autograd runs
the backward on the calling thread), the minimum over the timed calls. The candidates of a
row take turns by rounds; within a round each is called ``block`` times and the first call is
not timed (it settles the allocator after the other candidate: bench_loss.time_losses). Every
call gets a fresh leaf and a fresh ``BatchedDataDict`` (the plugin caches the per-sequence
wrapper's microbatch totals per data dict: a new microbatch per call, as in training).

``--device cuda`` runs the same tables on a GPU, every input on the device (the wrapper's
``cu_seqlens`` too, as NeMo-RL's Megatron worker holds them), and reports four measures per
call: **host** (median), wall time from the call until it returns (its Python, dispatch and
launches, and its waits: the plugin's one metric transfer, NeMo-RL's ``.item()`` calls, the
wrapper's per-sequence ``.item()``); **GPU span** (median), CUDA events recorded on the idle
stream before the call and after it, so from the call's start on the host to its last GPU work
finished (what the step waits for); **kernel time**, the kernels' own durations summed over one
profiled call (torch.profiler), the GPU's actual work; and **kernels**, how many that call launches.

``--compiled`` adds two tables: the B = 1 call of each NeMo-RL configuration with ``compile: true``
(the compiled core, nemo_rs_plugin/core/compiled.py; its compilation, the first call, untimed)
against NeMo-RL's, the same timing, and of each shipped recipe's loss section against NeMo-RL's
plain one (a recipe with ``sharded_logits_input`` stays eager: left out), each table followed
by how many graphs dynamo made of each configuration and its graph breaks (one and none is the
design; torch 2.11 broke the filters' core into 15 graphs on a ``bool`` of a tuple).

``--profile [CONFIG]`` profiles the plugin's B = 1 call of one configuration (a label or a
unique part of one; default "IS + token TIS") instead of the tables, to attribute the fixed
per-call cost: the unprofiled time split into forward and backward (plugin and NeMo-RL);
cProfile's top functions by self time, the plugin's functions by cumulative time (its
phases) and the self time per source file (Python vs the torch calls it makes); torch.profiler's
top operators by self CPU time, and the aten calls per call (compute vs views/aliases) and
their time against NeMo-RL's loss on the same configuration (NeMo-RL's plain for a recipe).

Usage: PYTHONPATH=<NeMo-RL checkout> python benchmarks/bench_packing.py [--large] [--only plain] [--device cuda]
       PYTHONPATH=<NeMo-RL checkout> python benchmarks/bench_packing.py --profile "IS + token TIS" [--top 25]
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import io
import os
import pstats
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

# Before the first NeMo-RL import: the CPU shims (Python 3.11, CPU-only torch, no Megatron-Bridge).
from tests.support import nemo_rl_shims  # noqa: E402

# megatron-core (imported by the shims and NeMo-RL) warns on import that Transformer Engine and Apex are absent
warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
nemo_rl_shims.install()

import torch  # noqa: E402
import yaml  # noqa: E402
from bench_loss import NEMO_RL_CONFIGS, make_batch, print_header  # noqa: E402

#: A prepared call: builds its inputs (untimed) and returns the timed forward + backward.
Setup = Callable[[], Callable[[], None]]

PLAIN = "plain"
DEFAULT_PROFILE = "IS + token TIS"
LOGITS_MARK = " (*)"
#: aten operators that compute nothing themselves (views, aliases, detach; a copy they make is an op of its
#: own): counted apart by --profile.
VIEW_OPS = frozenset(
    "view reshape _reshape_alias as_strided slice select expand unsqueeze squeeze detach alias t transpose "
    "permute unbind narrow split view_as expand_as lift_fresh _unsafe_view unflatten flatten contiguous "
    "numpy_T diagonal".split()
)


# ----------------------------------------------------------------------------- NeMo-RL and the losses
@functools.lru_cache(maxsize=None)
def host():
    """NeMo-RL's loss module, ``BatchedDataDict`` and a one-line description; exits when not importable."""
    try:
        import nemo_rl
        from nemo_rl.algorithms import loss as host_loss
        from nemo_rl.distributed.batched_data_dict import BatchedDataDict

        from nemo_rs_plugin.nemo_rl.host import host_api
    except Exception as exc:  # noqa: BLE001 - reported, then exit
        sys.exit(
            f"NeMo-RL is not importable ({type(exc).__name__}: {exc}). This benchmark times NeMo-RL's "
            "packing wrapper: PYTHONPATH=<NeMo-RL checkout> python benchmarks/bench_packing.py"
        )
    checkout = Path(nemo_rl.__file__).resolve().parents[1]
    about = f"NeMo-RL {getattr(nemo_rl, '__version__', '?')} ({host_api()} config) from {checkout}"
    return host_loss, BatchedDataDict, about


def build(section: dict, plugin: bool):
    """The loss GRPO builds for ``section``: the plugin's ``rs_clipped_pg`` or NeMo-RL's ``clipped_pg``.

    The class the registry gives for the name, from NeMo-RL's config class (the selector that
    stands in for ``ClippedPGLossFn`` in GRPO's module does the same; importing GRPO itself
    needs Ray and more, which a GPU image may lack). NeMo-RL's own loss gets its defaults.
    """
    from nemo_rl.algorithms import loss as host_loss

    from nemo_rs_plugin.core.settings.config import NeMoRLLossFields
    from nemo_rs_plugin.nemo_rl.registry import get_loss_class

    cfg_cls = host_loss.ClippedPGLossConfig
    pydantic_cfg = hasattr(cfg_cls, "model_validate")
    if plugin:
        section = {**section, "name": "rs_clipped_pg"}
        return get_loss_class("rs_clipped_pg")(cfg_cls(**section) if pydantic_cfg else section)
    defaults = {k: v for k, v in NeMoRLLossFields().model_dump().items() if k != "name"}
    full = {**defaults, **section}
    return host_loss.ClippedPGLossFn(cfg_cls(**full) if pydantic_cfg else full)


def takes_logits(loss_fn) -> bool:
    from nemo_rl.algorithms.loss.interfaces import LossInputType

    return loss_fn.input_type == LossInputType.LOGIT


def recipe_sections() -> dict[str, dict]:
    """``{label: loss_fn section}`` of every shipped recipe (recipes/*.yaml)."""
    out = {}
    for path in sorted((ROOT / "recipes").glob("*.yaml")):
        section = yaml.safe_load(path.read_text()).get("loss_fn")
        if isinstance(section, dict):
            out[f"recipe {path.stem.removeprefix('grpo-')}"] = {k: v for k, v in section.items() if k != "name"}
    return out


# ----------------------------------------------------------------------------- inputs
def packed_microbatch(n_seqs: int, lo: int, hi: int, V: int, seed: int) -> dict:
    """One microbatch of ``n_seqs`` sequences (lengths uniform in ``[lo, hi]``), NeMo-RL's layout.

    ``data`` holds the unpacked ``[B, S]`` tensors (rows padded to an even ``S``), ``logits``
    the ``[B, S, V]`` logits the packed ones are cut from; log-probs are float32 and the
    sampler's and reference's differ from the trainer's by a little noise (a ~1-5% mismatch).
    """
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi + 1, (n_seqs,), generator=g).tolist()
    B, S = n_seqs, -(-max(lengths) // 2) * 2
    logits = torch.randn(B, S, V, generator=g)
    input_ids = torch.randint(0, V, (B, S), generator=g)
    token_mask = torch.zeros(B, S, dtype=torch.long)
    for i, n in enumerate(lengths):
        token_mask[i, max(1, n // 8) : n] = 1  # the prompt (first eighth) is not trained on
    lp = torch.log_softmax(logits, -1).gather(-1, input_ids.unsqueeze(-1)).squeeze(-1)
    # position t holds log p(token t | tokens < t), as NeMo-RL's data dict does
    curr = torch.cat([torch.zeros(B, 1), lp[:, :-1]], 1) * token_mask
    prev = (curr + 0.01 * torch.randn(B, S, generator=g)).clamp_max(0.0) * token_mask
    gen = (prev + 0.02 * torch.randn(B, S, generator=g)).clamp_max(0.0) * token_mask
    ref = (prev + 0.05 * torch.randn(B, S, generator=g)).clamp_max(0.0) * token_mask
    advantages = torch.randn(B, 1, generator=g).expand(B, S).clone()
    data = {
        "input_ids": input_ids,
        "input_lengths": torch.tensor(lengths),
        "advantages": advantages,
        "prev_logprobs": prev,
        "generation_logprobs": gen,
        "reference_policy_logprobs": ref,
        "token_mask": token_mask,
        "sample_mask": torch.ones(B),
        "rewards": (advantages[:, 0] > 0).float(),
    }
    gvs = torch.tensor(float(B))
    gvt = token_mask[:, 1:].sum().float()
    return {"lengths": lengths, "logits": logits, "data": data, "gvs": gvs, "gvt": gvt}


def packed_logits(mb: dict, pad_multiple: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``([1, sum(padded), V] logits, cu_seqlens, cu_seqlens_padded)``, the sequences back to back."""
    lengths, logits = mb["lengths"], mb["logits"]
    padded = [-(-n // pad_multiple) * pad_multiple for n in lengths]
    V = logits.shape[-1]
    parts = []
    for i, (n, p) in enumerate(zip(lengths, padded)):
        parts += [logits[i, :n], torch.zeros(p - n, V, device=logits.device)]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=logits.device)
    cu_padded = torch.tensor([0, *torch.tensor(padded).cumsum(0).tolist()], dtype=torch.int32, device=logits.device)
    return torch.cat(parts).unsqueeze(0).contiguous(), cu, cu_padded


def single_call(loss_fn, batch, logits_in: bool, V: int, backward: bool = True) -> Setup:
    """One loss call as the per-sequence wrapper makes it (``bench_loss.make_batch`` inputs).

    ``logits_in``: through ``prepare_loss_input`` from ``[B, S, V]`` logits (for a comparison that
    holds a LOGIT-input loss, both candidates), else the log-probs straight to the loss.
    ``backward=False``: the forward alone (``--profile`` splits the time).
    """
    host_loss, BatchedDataDict, _ = host()
    lp0, data, gvs, gvt = batch
    logits0 = None
    if logits_in:
        B, S = data["input_ids"].shape
        logits0 = torch.randn(B, S, V, generator=torch.Generator().manual_seed(1)).to(lp0.device)

    def setup():
        batch_dict = BatchedDataDict(dict(data))
        if logits_in:
            leaf = logits0.clone().requires_grad_(True)

            def run():
                loss, _ = host_loss.wrap_loss_fn_with_input_preparation(
                    leaf, batch_dict, gvs, gvt, loss_fn, host_loss.prepare_loss_input
                )
                if backward:
                    loss.backward()

            return run
        leaf = lp0.clone().requires_grad_(True)

        def run():
            loss, _ = loss_fn(next_token_logprobs=leaf, data=batch_dict, global_valid_seqs=gvs, global_valid_toks=gvt)
            if backward:
                loss.backward()

        return run

    return setup


def packed_call(loss_fn, mb: dict, pad_multiple: int) -> Setup:
    """NeMo-RL's ``SequencePackingLossWrapper`` over the packed microbatch, as its workers call it."""
    host_loss, BatchedDataDict, _ = host()
    packed, cu, cu_padded = packed_logits(mb, pad_multiple)
    wrapper = host_loss.SequencePackingLossWrapper(
        loss_fn=loss_fn,
        prepare_fn=host_loss.prepare_loss_input,
        cu_seqlens_q=cu,
        cu_seqlens_q_padded=cu_padded if pad_multiple > 1 else None,
    )

    def setup():
        batch_dict = BatchedDataDict(dict(mb["data"]))  # a new microbatch: no totals cached from the last
        leaf = packed.clone().requires_grad_(True)

        def run():
            loss, _ = wrapper(leaf, batch_dict, mb["gvs"], mb["gvt"])
            loss.backward()

        return run

    return setup


def to_device(tree, device: torch.device):
    """``tree`` (tensors in dicts, lists and tuples) with every tensor on ``device``."""
    if isinstance(tree, torch.Tensor):
        return tree.to(device)
    if isinstance(tree, dict):
        return {k: to_device(v, device) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(to_device(v, device) for v in tree)
    return tree


# ----------------------------------------------------------------------------- timing
def time_calls(candidates: dict[str, Setup], rounds: int, block: int) -> dict[str, float]:
    """Minimum thread CPU time (s) of one call per candidate, over ``rounds`` x (``block`` - 1) calls.

    Candidates take turns by rounds; the first call of each block is not timed (bench_loss.time_losses).
    """
    samples: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(rounds):
        for name, setup in candidates.items():
            for call in range(max(block, 2)):
                run = setup()
                t0 = time.thread_time()
                run()
                dt = time.thread_time() - t0
                if call:
                    samples[name].append(dt)
    return {name: min(v) for name, v in samples.items()}


#: What ``--device cuda`` reports per call: (label, unit, scale from seconds or a count).
CUDA_MEASURES = (
    ("host", "ms", 1e3),
    ("GPU span", "ms", 1e3),
    ("kernel time", "ms", 1e3),
    ("kernels", "", 1.0),
)


def time_calls_cuda(candidates: dict[str, Setup], rounds: int, block: int) -> dict[str, dict[str, float]]:
    """Per candidate, the median host time and GPU span (s) of one call, and one call's kernels.

    Host: wall time from the call until it returns (the stream idle before it starts). GPU span:
    CUDA events recorded on the idle stream before and after the call, so from the call's start
    on the host to its last GPU work finished. Rounds and blocks as :func:`time_calls`. Kernel
    time and count: one more call under torch.profiler (its kernel events; memcpy / memset left out).
    """
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    host: dict[str, list[float]] = {name: [] for name in candidates}
    span: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(rounds):
        for name, setup in candidates.items():
            for call in range(max(block, 2)):
                run = setup()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                start.record()
                run()
                end.record()
                dt = time.perf_counter() - t0
                torch.cuda.synchronize()
                if call:
                    host[name].append(dt)
                    span[name].append(start.elapsed_time(end) / 1e3)
    out = {}
    for name, setup in candidates.items():
        run = setup()
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            run()
            torch.cuda.synchronize()
        kernels = [
            e
            for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA
            and "memcpy" not in e.name.lower()
            and "memset" not in e.name.lower()
        ]
        out[name] = {
            "host": statistics.median(host[name]),
            "GPU span": statistics.median(span[name]),
            "kernel time": sum(e.device_time_total for e in kernels) / 1e6,  # us -> s
            "kernels": float(len(kernels)),
        }
    return out


# ----------------------------------------------------------------------------- the tables
def compare(plugin, nemo_rl, args, mb: dict, large) -> dict[str, dict[str, tuple[float, float]]]:
    """``{measure: {case: (plugin, NeMo-RL)}}`` for the B = 1, packed and (``--large``) 8 x 32k calls.

    The measure is thread CPU time (s) on the CPU, :data:`CUDA_MEASURES` on a GPU.
    """
    logits_in = takes_logits(plugin)
    pad_multiple = 2 if logits_in else 1  # sharded_logits_input: sequences of even length (2 * cp)
    out: dict[str, dict[str, tuple[float, float]]] = {}
    single = to_device(make_batch(1, args.length), args.device)
    cases = {
        "B=1": ([single_call(fn, single, logits_in, args.vocab) for fn in (plugin, nemo_rl)], args.rounds, args.block),
        "packed": ([packed_call(fn, mb, pad_multiple) for fn in (plugin, nemo_rl)], args.packed_rounds, args.block),
    }
    if large is not None:
        cases["8x32k"] = (
            [single_call(fn, large, logits_in, args.vocab) for fn in (plugin, nemo_rl)],
            args.packed_rounds,
            args.block,
        )
    for case, ((p, h), rounds, block) in cases.items():
        if args.device.type == "cuda":
            measured = time_calls_cuda({"plugin": p, "NeMo-RL": h}, rounds, block)
            for measure, _unit, _scale in CUDA_MEASURES:
                out.setdefault(measure, {})[case] = (measured["plugin"][measure], measured["NeMo-RL"][measure])
        else:
            times = time_calls({"plugin": p, "NeMo-RL": h}, rounds, block)
            out.setdefault("thread CPU time", {})[case] = (times["plugin"], times["NeMo-RL"])
    return out


def _label(name: str, plugin) -> str:
    return name + LOGITS_MARK if takes_logits(plugin) else name


def print_tables(title: str, reference: str, rows: dict[str, dict], n_seqs: int) -> None:
    """One table per measure; ``rows`` is ``{configuration: compare(...)}``."""
    units = {measure: (unit, scale) for measure, unit, scale in CUDA_MEASURES}
    for measure in next(iter(rows.values())):
        unit, scale = units.get(measure, ("ms", 1e3))
        ref = f"{reference} {unit}".strip() if unit else reference.removesuffix(" ms")
        suffix = f"+{unit}/seq" if unit else "+/seq"
        width = max([len(title), *map(len, rows)])
        cases = list(next(iter(rows.values()))[measure])
        print(f"{measure}:")
        head = f"{title:<{width}}"
        for case in cases:
            head += f" | {case + ' plugin':>14} | {ref:>{max(len(ref), 10)}} | {'ratio':>5}"
            if case == "packed":
                head += f" | {suffix:>7}"
        print_header(head)
        for name, measures in rows.items():
            line = f"{name:<{width}}"
            for case in cases:
                p, h = measures[measure][case]
                line += f" | {p * scale:14.3f} | {h * scale:{max(len(ref), 10)}.3f} | {p / max(h, 1e-12):4.2f}x"
                if case == "packed":
                    line += f" | {(p - h) * scale / n_seqs:7.3f}"
            print(line)
        print()


def chosen(label: str, only: str) -> bool:
    """Whether ``--only`` picks ``label``: it contains one of the comma-separated parts (case-insensitive)."""
    return any(part.strip().lower() in label.lower() for part in only.split(","))


def run_tables(args) -> None:
    _, _, about = host()
    configs = {name: cfg for name, cfg in NEMO_RL_CONFIGS.items() if chosen(name, args.only)}
    recipes = {name: cfg for name, cfg in recipe_sections().items() if chosen(name, args.only)}
    mb = to_device(packed_microbatch(args.sequences, args.min_len, args.max_len, args.vocab, args.seed), args.device)
    large = to_device(make_batch(8, 32768), args.device) if args.large else None
    timed = args.rounds * (max(args.block, 2) - 1)
    packed_timed = args.packed_rounds * (max(args.block, 2) - 1)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s); {about}")
    if args.device.type == "cuda":
        print(f"device {torch.cuda.get_device_name(args.device)}: host time and GPU span are medians, kernels one call")
    print(
        f"forward + backward, {'median' if args.device.type == 'cuda' else 'thread CPU time, minimum'} of "
        f"{timed} calls (B=1) / {packed_timed} calls "
        f"(packed{', 8x32k' if large is not None else ''}), first call of each block of {max(args.block, 2)} untimed"
    )
    print(
        f"B=1: one {args.length}-token sequence ({args.length - 1} next-token log-probs); packed: "
        f"SequencePackingLossWrapper + prepare_loss_input over {len(mb['lengths'])} sequences of "
        f"{args.min_len}-{args.max_len} tokens (seed {args.seed}, {sum(mb['lengths'])} tokens), V = {args.vocab}; "
        "+ms/seq = (plugin - NeMo-RL) / sequences"
    )
    print()
    start = time.perf_counter()
    if configs:
        rows = {}
        for name, cfg in configs.items():
            plugin = build(cfg, True)
            rows[_label(name, plugin)] = compare(plugin, build(cfg, False), args, mb, large)
        print_tables("NeMo-RL configuration", "NeMo-RL", rows, len(mb["lengths"]))
    if recipes:
        rows = {}
        for name, cfg in recipes.items():
            plugin = build(cfg, True)
            rows[_label(name, plugin)] = compare(plugin, build(NEMO_RL_CONFIGS[PLAIN], False), args, mb, large)
        print("Shipped recipes, plugin only (NeMo-RL has no equivalent): ratio to NeMo-RL's plain configuration")
        print_tables("recipe loss_fn (plugin only)", "plain", rows, len(mb["lengths"]))
        if any(name.endswith(LOGITS_MARK) for name in rows):
            print(
                f"{LOGITS_MARK.strip()}: sharded_logits_input, a LOGIT-input loss: its B=1 and 8x32k calls and "
                f"NeMo-RL's plain beside them go through prepare_loss_input from [B, T, {args.vocab}] logits; packed "
                "sequences padded to even lengths"
            )
            print()
    if args.compiled:
        compiled_tables(args, configs, recipes)
    print(f"({time.perf_counter() - start:.0f} s; on a busy machine rerun and compare: ratios move by ~10%)")


def compiled_tables(args, configs: dict[str, dict], recipes: dict[str, dict]) -> None:
    """``--compiled``: the lone B = 1 call with ``compile: true``, NeMo-RL's configurations and the recipes'.

    Each against NeMo-RL's same configuration (a recipe: NeMo-RL's plain, as in the eager
    table). A recipe with ``sharded_logits_input`` is left out: its core stays eager
    (nemo_rs_plugin/core/compiled.py). The compilation, the first call, is not timed.
    """
    from torch._dynamo.utils import counters

    plain = NEMO_RL_CONFIGS[PLAIN]
    jobs = [
        ("NeMo-RL configuration, compiled", "NeMo-RL", {n: (c, c) for n, c in configs.items()}),
        (
            "recipe loss_fn, compiled (plugin only)",
            "plain",
            {n: (c, plain) for n, c in recipes.items() if not c.get("sharded_logits_input")},
        ),
    ]
    for title, reference, entries in jobs:
        if not entries:  # --only picked none of these
            continue
        print(f"compile: true, one lone B=1 call (the compiled core; compilation in the first, untimed call): {title}")
        rows = {}
        graphs = {}
        for name, (cfg, host_cfg) in entries.items():
            # One configuration at a time: each is a graph of its own (its floats are constants), and
            # dynamo falls back to eager past 8 graphs of one function in a process.
            torch._dynamo.reset()
            counters.clear()
            compiled = build({**cfg, "compile": True}, True)
            single = to_device(make_batch(1, args.length), args.device)
            setups = [single_call(fn, single, False, args.vocab) for fn in (compiled, build(host_cfg, False))]
            setups[0]()()  # compiles, untimed
            if args.device.type == "cuda":
                measured = time_calls_cuda({"plugin": setups[0], "NeMo-RL": setups[1]}, args.rounds, args.block)
                rows[name] = {
                    m: {"B=1": (measured["plugin"][m], measured["NeMo-RL"][m])} for m, _unit, _scale in CUDA_MEASURES
                }
            else:
                times = time_calls({"plugin": setups[0], "NeMo-RL": setups[1]}, args.rounds, args.block)
                rows[name] = {"thread CPU time": {"B=1": (times["plugin"], times["NeMo-RL"])}}
            graphs[name] = (counters["stats"]["unique_graphs"], sum(counters["graph_break"].values()))
        print_tables(title, reference, rows, args.sequences)
        # One graph and no break is what the compiled core is built for; more means part of it runs
        # eagerly between graphs (a dynamo version that cannot trace a construct), which the times show.
        for name, (n_graphs, n_breaks) in graphs.items():
            print(f"dynamo: {name}: {n_graphs} graph(s), {n_breaks} graph break(s)")
        print()


# ----------------------------------------------------------------------------- --profile
def choose(label: str) -> tuple[str, dict]:
    """The configuration whose label is ``label`` or the only one containing it (case-insensitive)."""
    every = {**NEMO_RL_CONFIGS, **recipe_sections()}
    exact = [n for n in every if n.lower() == label.lower()]
    found = exact or [n for n in every if label.lower() in n.lower()]
    if len(found) != 1:
        sys.exit(f"--profile {label!r} matches {found or 'nothing'}; choose one of: {', '.join(every)}")
    return found[0], every[found[0]]


def profile(args) -> None:
    _, _, about = host()
    name, cfg = choose(args.profile)
    plugin = build(cfg, True)
    reference = "NeMo-RL" if name in NEMO_RL_CONFIGS else "NeMo-RL plain"
    nemo_rl = build(cfg if name in NEMO_RL_CONFIGS else NEMO_RL_CONFIGS[PLAIN], False)
    logits_in = takes_logits(plugin)
    batch = make_batch(1, args.length)
    losses = {"plugin": plugin, reference: nemo_rl}
    setups = {who: single_call(fn, batch, logits_in, args.vocab) for who, fn in losses.items()}
    forward = {who: single_call(fn, batch, logits_in, args.vocab, backward=False) for who, fn in losses.items()}
    n = args.profile_calls
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s); {about}")
    print(f"profile: {name!r}, B = 1, {args.length} tokens{' (logits in)' if logits_in else ''}, {n} calls")
    times = time_calls(setups, args.rounds, args.block)  # also the warm-up
    fwd = time_calls(forward, args.rounds, args.block)
    print("unprofiled, thread CPU time per call (minimum), forward + backward = forward + the rest:")
    for who in setups:
        t, f = times[who], fwd[who]
        print(f"  {who:<14} {t * 1e3:.3f} ms = {f * 1e3:.3f} ms + {(t - f) * 1e3:.3f} ms")
    stats = _cprofile(setups["plugin"], n)
    _print_cprofile(stats, n, args.top)
    _print_operators(setups, n, args.top)


def _cprofile(setup: Setup, n: int) -> pstats.Stats:
    """cProfile over ``n`` calls (forward + backward), the inputs' setup left out."""
    prof = cProfile.Profile()
    for _ in range(n):
        run = setup()
        prof.enable()
        run()
        prof.disable()
    return pstats.Stats(prof, stream=io.StringIO())


def _print_cprofile(stats: pstats.Stats, n: int, top: int) -> None:
    total = stats.total_tt / n
    rows = stats.stats.items()

    def where(path: str, line: int, func: str) -> str:
        return f"{_short(path)}:{line}({func})" if path != "~" else func

    print()
    print_header(f"cProfile, plugin: top {top} functions by self time (per call; total {total * 1e3:.3f} ms profiled)")
    print(f"{'self ms':>8} | {'cum ms':>8} | {'calls':>6} | function")
    for (path, line, func), (_cc, nc, tt, ct, _callers) in sorted(rows, key=lambda kv: kv[1][2], reverse=True)[:top]:
        print(f"{tt / n * 1e3:8.4f} | {ct / n * 1e3:8.4f} | {nc / n:6.1f} | {where(path, line, func)}")
    print()
    print_header(
        f"cProfile, plugin: the plugin's functions by cumulative time (the phases; per call, of {total * 1e3:.3f} ms)"
    )
    print(f"{'cum ms':>8} | {'self ms':>8} | {'calls':>6} | function")
    own = [kv for kv in rows if "nemo_rs_plugin" in kv[0][0]]
    for (path, line, func), (_cc, nc, tt, ct, _callers) in sorted(own, key=lambda kv: kv[1][3], reverse=True)[:top]:
        print(f"{ct / n * 1e3:8.4f} | {tt / n * 1e3:8.4f} | {nc / n:6.1f} | {where(path, line, func)}")
    by_file: dict[str, float] = {}
    for (path, _line, _func), (_cc, _nc, tt, _ct, _callers) in rows:
        key = _short(path) if path != "~" else "built-ins (torch operators called from Python, C functions)"
        by_file[key] = by_file.get(key, 0.0) + tt
    print()
    print_header(f"cProfile, plugin: self time by source file (per call, of {total * 1e3:.3f} ms)")
    for key, tt in sorted(by_file.items(), key=lambda kv: kv[1], reverse=True)[:top]:
        print(f"{tt / n * 1e3:8.4f} ms {tt / stats.total_tt:6.1%}  {key}")


def _print_operators(setups: dict[str, Setup], n: int, top: int) -> None:
    """torch.profiler's operators of ``n`` calls of each candidate (inputs built before the profiler starts)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    counts = {}
    for who, setup in setups.items():
        runs = [setup() for _ in range(n)]
        with torch_profile(activities=[ProfilerActivity.CPU]) as tprof:
            for run in runs:
                run()
        averages = tprof.key_averages()
        events = [e for e in averages if e.key.startswith("aten::")]
        views = [e for e in events if e.key.removeprefix("aten::") in VIEW_OPS]
        counts[who] = (
            sum(e.count for e in events) / n,
            sum(e.count for e in views) / n,
            sum(e.self_cpu_time_total for e in events) / n / 1e3,
            sum(e.self_cpu_time_total for e in views) / n / 1e3,
        )
        if who == "plugin":
            print()
            print_header(f"torch.profiler, plugin: top {top} operators by self CPU time (all {n} calls)")
            print(averages.table(sort_by="self_cpu_time_total", row_limit=top))
    print_header("aten operators per call, forward + backward (torch.profiler; its own overhead included)")
    for who, (ops, nviews, ms, views_ms) in counts.items():
        print(
            f"{who:<14} {ops:5.0f} calls ({ops - nviews:.0f} compute + {nviews:.0f} views/aliases), "
            f"{ms:.3f} ms operator self time ({views_ms:.3f} ms of it views/aliases)"
        )
    print(
        "Against the unprofiled time per call above, the rest is Python (cProfile's self times), "
        "autograd bookkeeping and dispatch."
    )


def _short(path: str) -> str:
    """A source path relative to the repository, the NeMo-RL checkout or site-packages."""
    for marker in ("site-packages" + os.sep, str(ROOT) + os.sep):
        if marker in path:
            return path.split(marker, 1)[1]
    parts = Path(path).parts
    return str(Path(*parts[parts.index("nemo_rl") :])) if "nemo_rl" in parts else path


# ----------------------------------------------------------------------------- main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=50, help="rounds of the B = 1 calls (and of --profile's timing)")
    ap.add_argument("--packed-rounds", type=int, default=8, help="rounds of the packed and 8 x 32k calls")
    ap.add_argument("--block", type=int, default=3, help="calls per candidate in a round (the first untimed)")
    ap.add_argument("--length", type=int, default=512, help="tokens of the B = 1 sequence")
    ap.add_argument("--sequences", type=int, default=32, help="sequences in the packed microbatch")
    ap.add_argument("--min-len", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=64, help="vocabulary of the packed (and logits-in) calls")
    ap.add_argument("--seed", type=int, default=0, help="seed of the packed microbatch")
    ap.add_argument("--large", action="store_true", help="also one call at 8 x 32k (slow)")
    ap.add_argument("--compiled", action="store_true", help="also the B = 1 call with compile: true (slow: compiles)")
    ap.add_argument(
        "--only",
        default="",
        help="only the configurations whose label contains this (or one of several, comma-separated)",
    )
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads")
    ap.add_argument("--device", type=torch.device, default=torch.device("cpu"), help="cpu, or cuda: see above")
    ap.add_argument(
        "--profile",
        nargs="?",
        const=DEFAULT_PROFILE,
        metavar="CONFIG",
        help=f"profile the plugin's B = 1 call of CONFIG (default {DEFAULT_PROFILE!r}) instead of the tables",
    )
    ap.add_argument("--profile-calls", type=int, default=200, help="calls profiled")
    ap.add_argument("--top", type=int, default=20, help="entries printed per profile table")
    args = ap.parse_args()
    torch.set_num_threads(max(1, args.threads))
    host()
    if args.device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_packing: --device cuda, but torch sees no CUDA device")
    if args.profile and args.device.type != "cpu":
        sys.exit("bench_packing: --profile runs on the CPU")
    if args.profile:
        profile(args)
    else:
        run_tables(args)


if __name__ == "__main__":
    main()
