"""A small GRPO experiment with a real training/inference mismatch: does the correction help?

``python -m nemo_rs_plugin.tools.lab`` (``--quick`` for the < 2 minute smoke run). Every
configuration trains the same tiny mixture-of-experts decoder (transformers' Qwen3-MoE,
random initialisation from a tiny config, nothing downloaded) on the same task with GRPO,
and only the loss's off-policy correction differs. The loss is the plugin's public API,
called as NeMo-RL calls it: ``loss_fn(next_token_logprobs, data, global_valid_seqs,
global_valid_toks)`` with NeMo-RL's data dict, ``prev_logprobs`` recomputed by the trainer
(float32) before the update, ``generation_logprobs`` from the sampler.

The mismatch is real, not injected: the sampler is a copy of the trainer's weights run in
another precision (``--sampler-dtype``, default bfloat16, so MoE routing decisions flip for
real) and, optionally, ``--lag`` optimizer steps behind the trainer (asynchronous GRPO). Per
rollout step the run records the mean and max per-token ``|prev - gen|`` and the fraction of
response tokens whose expert routing (top-k set, in any layer) differs between the sampler's
decode and the trainer's forward.

The task ("count"): the prompt is ``[BOS, s]`` with ``s`` a random token of ``--vocab``; the
response has exactly ``--length`` tokens and should count on, ``s+1, s+2, ...`` mod vocab.
The verifiable reward is the fraction of response tokens equal to their predecessor + 1
(so a random policy scores ``1/vocab``, a perfect one 1.0, at every length).

Outputs under ``--out``: ``lab_steps.csv`` (one row per configuration, seed and step),
``lab_summary.csv`` and ``lab_summary.md`` (the table), ``lab.png`` (learning curves, mean
over seeds with a min-max band). See docs/lab.md for the published run.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from nemo_rs_plugin.core import presets
from nemo_rs_plugin.core.loss import CorrectedPGLoss

__all__ = ["LabSettings", "CONFIGS", "run_one", "run_all", "summarize", "main"]

#: The compared corrections (the loss sections; the common fields are in ``_BASE_LOSS``).
CONFIGS: dict[str, dict] = {
    "none": {},
    "token-tis": presets.tis("token"),
    "sequence": presets.is_level("sequence"),
    "sequence_mean": presets.is_level("sequence_mean"),
    "seqmean+geo-rs+veto": {
        **presets.is_level("sequence_mean"),
        "rejection_sampling": [presets.GEO_RS, presets.OUTLIER_VETO],
    },
    "geo-rs+token-mis": {**presets.is_level("token"), "rejection_sampling": [presets.GEO_RS, presets.TOKEN_MIS]},
}

# GRPO as NeMo-RL's grpo_math_1B: PPO clip 0.2 both sides, token-level loss, no KL penalty.
_BASE_LOSS = {
    "reference_policy_kl_penalty": 0.0,
    "ratio_clip_min": 0.2,
    "ratio_clip_max": 0.2,
    "token_level_loss": True,
}

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass
class LabSettings:
    """Everything a run depends on (the defaults are the published run, docs/lab.md)."""

    length: int = 128
    """Response tokens (fixed length; the task's reward is length-independent)."""
    vocab: int = 16
    prompts: int = 4
    """Prompts per rollout step."""
    group: int = 4
    """Responses per prompt (GRPO group)."""
    steps: int = 40
    """Rollout steps."""
    minibatches: int = 2
    """Optimizer steps per rollout batch."""
    microbatches: int = 2
    """Microbatches per optimizer step (gradient accumulation, global counts)."""
    lr: float = 3e-3
    max_grad_norm: float = 1.0
    sampler_dtype: str = "bf16"
    lag: int = 2
    """The sampler's weights are this many optimizer steps older than the trainer's."""
    hidden: int = 64
    layers: int = 2
    experts: int = 8
    top_k: int = 2
    threshold: float = 0.3
    """Reward for the 'steps to threshold' column."""
    seeds: list = field(default_factory=lambda: [0, 1, 2])
    configs: list = field(default_factory=lambda: list(CONFIGS))


QUICK = dict(
    length=16, prompts=2, group=4, steps=4, hidden=32, experts=4, seeds=[0, 1], configs=["none", "seqmean+geo-rs+veto"]
)


# ---------------------------------------------------------------------------- model and task
def build_model(s: LabSettings, dtype: torch.dtype = torch.float32):
    """A tiny Qwen3-MoE decoder, randomly initialised from the global RNG."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        vocab_size=s.vocab + 1,
        hidden_size=s.hidden,
        intermediate_size=2 * s.hidden,
        moe_intermediate_size=s.hidden,
        num_hidden_layers=s.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=s.hidden // 4,
        num_experts=s.experts,
        num_experts_per_tok=s.top_k,
        decoder_sparse_step=1,
        norm_topk_prob=True,
        max_position_embeddings=s.length + 8,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    return Qwen3MoeForCausalLM(cfg).to(dtype).eval()


class RoutingRecorder:
    """Records each MoE router's top-k expert indices, per call, via forward hooks."""

    def __init__(self, model):
        self.calls: list[list[torch.Tensor]] = []
        self._hooks = []
        routers = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
        if not routers:
            raise RuntimeError("no MoE router found in the model")
        for m in routers:
            self._hooks.append(m.register_forward_hook(self._hook))
        self.n_layers = len(routers)
        self._current: list[torch.Tensor] = []

    def _hook(self, module, args, out):
        self._current.append(out[2].detach().sort(-1).values)
        if len(self._current) == self.n_layers:
            self.calls.append(self._current)
            self._current = []

    def clear(self):
        self.calls, self._current = [], []


def reward_of(responses: torch.Tensor, start: torch.Tensor, vocab: int) -> torch.Tensor:
    """Fraction of response tokens equal to their predecessor + 1 (mod vocab); BOS is wrong."""
    prev = torch.cat([start[:, None], responses[:, :-1]], dim=1)
    ok = (responses == (prev + 1) % vocab) & (responses < vocab) & (prev < vocab)
    return ok.float().mean(-1)


@torch.no_grad()
def sample(model, prompts: torch.Tensor, length: int, gen: torch.Generator):
    """Autoregressive sampling at temperature 1 with a KV cache; the sampler's own log-probs."""
    out = model(input_ids=prompts, use_cache=True)
    tokens, logps = [], []
    for t in range(length):
        logp = torch.log_softmax(out.logits[:, -1].float(), dim=-1)
        tok = torch.multinomial(logp.exp(), 1, generator=gen)
        tokens.append(tok)
        logps.append(logp.gather(-1, tok))
        if t + 1 < length:
            out = model(input_ids=tok, past_key_values=out.past_key_values, use_cache=True)
    return torch.cat(tokens, 1), torch.cat(logps, 1)


def token_logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    """``[B, S-1]`` log-prob of each next token (NeMo-RL's ``next_token_logprobs``)."""
    logits = model(input_ids=ids).logits[:, :-1].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)


# ---------------------------------------------------------------------------- one run
_METRICS = (
    "reward",
    "mismatch_mean",
    "mismatch_max",
    "routing_diff_frac",
    "is_weight_mean",
    "is_ess",
    "seq_rejected_frac",
    "token_rejected_frac",
    "grad_norm",
    "loss",
    "wall_s",
)


def run_one(name: str, seed: int, s: LabSettings, tick: Optional[Callable[[], None]] = None) -> list[dict]:
    """Train one configuration with one seed; one dict of metrics per rollout step.

    Deterministic given (name, seed, settings): one thread, every random draw seeded.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run_one(name, seed, s, tick)
    finally:
        torch.set_num_threads(threads)


def _run_one(name: str, seed: int, s: LabSettings, tick: Optional[Callable[[], None]]) -> list[dict]:
    torch.manual_seed(seed)
    loss_fn = CorrectedPGLoss({**_BASE_LOSS, **CONFIGS[name]})
    applies_is = bool(CONFIGS[name].get("use_importance_sampling_correction", False))
    policy = build_model(s).train()
    sampler = build_model(s, _DTYPES[s.sampler_dtype])
    opt = torch.optim.AdamW(policy.parameters(), lr=s.lr, betas=(0.9, 0.99), weight_decay=0.0)
    history = [{k: v.detach().clone() for k, v in policy.state_dict().items()}]  # versions
    gen = torch.Generator().manual_seed(10_000 + seed)
    rec_sampler, rec_trainer = RoutingRecorder(sampler), RoutingRecorder(policy)
    B, P, L = s.prompts * s.group, 2, s.length
    S = P + L
    rows = []
    t_start = time.perf_counter()
    for step in range(s.steps):
        # --- rollout: the sampler runs the weights of `lag` optimizer steps ago, in its dtype
        sampler.load_state_dict(history[max(0, len(history) - 1 - s.lag)])
        start = torch.randint(0, s.vocab, (s.prompts,), generator=gen).repeat_interleave(s.group)
        prompts = torch.stack([torch.full_like(start, s.vocab), start], dim=1)
        rec_sampler.clear()
        responses, gen_lp = sample(sampler, prompts, L, gen)
        ids = torch.cat([prompts, responses], dim=1)
        rewards = reward_of(responses, start, s.vocab)
        grouped = rewards.view(s.prompts, s.group)
        adv = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-6)).reshape(B)

        # --- the trainer recomputes prev_logprobs (float32) before the update
        rec_trainer.clear()
        with torch.no_grad():
            policy.eval()
            prev = token_logprobs(policy, ids)
            policy.train()
        token_mask = torch.zeros(B, S, dtype=torch.long)
        token_mask[:, P:] = 1
        pad = torch.zeros(B, 1)
        data_all = {
            "input_ids": ids,
            "advantages": adv[:, None].expand(B, S).contiguous(),
            "prev_logprobs": torch.cat([pad, prev], 1) * token_mask,
            "generation_logprobs": torch.cat([torch.zeros(B, P), gen_lp], 1) * token_mask,
            "reference_policy_logprobs": torch.cat([pad, prev], 1) * token_mask,
            "token_mask": token_mask,
            "sample_mask": torch.ones(B),
        }
        d = (prev[:, P - 1 :] - gen_lp).abs()
        routing = _routing_diff(rec_sampler.calls, rec_trainer.calls, B, P, L)

        # --- GRPO update: several optimizer steps per rollout batch, microbatches inside
        summed: list[dict[str, float]] = []
        norms, order = [], torch.randperm(B, generator=gen)
        for mb in order.chunk(s.minibatches):
            data_mb = {k: v[mb] for k, v in data_all.items()}
            gvs = data_mb["sample_mask"].sum()
            gvt = (data_mb["token_mask"][:, 1:] * data_mb["sample_mask"][:, None]).sum()
            opt.zero_grad(set_to_none=True)
            acc: dict[str, float] = {}
            for micro in torch.arange(len(mb)).chunk(s.microbatches):
                data = {k: v[micro] for k, v in data_mb.items()}
                rec_trainer.clear()
                lp = token_logprobs(policy, data["input_ids"])
                loss, metrics = loss_fn(lp, data, gvs, gvt)
                loss.backward()
                for k, v in metrics.items():  # NeMo-RL sums microbatch metrics
                    acc[k] = acc.get(k, 0.0) + float(v)
            norms.append(float(torch.nn.utils.clip_grad_norm_(policy.parameters(), s.max_grad_norm)))
            opt.step()
            history.append({k: v.detach().clone() for k, v in policy.state_dict().items()})
            history = history[-(s.lag + 1) :]
            summed.append(acc)

        def avg(key: str, default: float = 0.0) -> float:
            return sum(a.get(key, default) for a in summed) / len(summed)

        w_mean, w_sq = avg("is_weight_mean"), avg("is_weight_sq_mean")
        rows.append(
            {
                "config": name,
                "seed": seed,
                "step": step + 1,
                "reward": float(rewards.mean()),
                "mismatch_mean": float(d.mean()),
                "mismatch_max": float(d.max()),
                "routing_diff_frac": routing,
                # Without IS correction the loss applies weight 1 (its metric reports the would-be weight).
                "is_weight_mean": w_mean if applies_is else 1.0,
                "is_ess": (w_mean**2 / w_sq if w_sq > 0 else 0.0) if applies_is else 1.0,
                "seq_rejected_frac": avg("rs_seq_rejected_frac"),
                "token_rejected_frac": avg("rs_token_rejected_frac"),
                "grad_norm": sum(norms) / len(norms),
                "loss": avg("loss"),
                "wall_s": time.perf_counter() - t_start,
            }
        )
        if tick is not None:
            tick()
    return rows


def _routing_diff(sampler_calls, trainer_calls, B: int, P: int, L: int) -> float:
    """Fraction of response tokens whose top-k expert set differs (any layer), sampler vs trainer.

    A response token is routed when it is fed back as input: the sampler's decode steps
    1..L-1 route responses 0..L-2, the trainer's forward routes positions P..S-2 (the same
    tokens); the last response token is never an input and is not counted.
    """
    if L < 2 or not trainer_calls or len(sampler_calls) < L:
        return float("nan")
    trainer = trainer_calls[0]
    differs = torch.zeros(B, L - 1, dtype=torch.bool)
    for layer in range(len(trainer)):
        tr = trainer[layer].view(B, P + L, -1)[:, P : P + L - 1]
        sa = torch.stack([sampler_calls[1 + t][layer].view(B, -1) for t in range(L - 1)], dim=1)
        differs |= (tr != sa).any(-1)
    return float(differs.float().mean())


# ---------------------------------------------------------------------------- many runs
def _worker(args):
    name, seed, settings, queue = args
    tick = (lambda: queue.put(1)) if queue is not None else None
    return run_one(name, seed, settings, tick)


def run_all(s: LabSettings, workers: int = 1, progress: Optional[Callable[[int, int], None]] = None) -> list[dict]:
    """Every configuration x seed; rows sorted by (configuration order, seed, step)."""
    jobs = [(c, seed) for c in s.configs for seed in s.seeds]
    total, done = len(jobs) * s.steps, 0
    rows: list[dict] = []
    if workers <= 1:
        for c, seed in jobs:

            def tick():
                nonlocal done
                done += 1
                if progress:
                    progress(done, total)

            rows += run_one(c, seed, s, tick)
    else:
        import multiprocessing as mp
        from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

        ctx = mp.get_context("spawn")
        with ctx.Manager() as manager, ProcessPoolExecutor(workers, mp_context=ctx) as pool:
            queue = manager.Queue()
            pending = {pool.submit(_worker, (c, seed, s, queue)) for c, seed in jobs}
            while pending:
                finished, pending = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
                while not queue.empty():
                    queue.get()
                    done += 1
                    if progress:
                        progress(done, total)
                for f in finished:
                    rows += f.result()
    order = {c: i for i, c in enumerate(s.configs)}
    return sorted(rows, key=lambda r: (order[r["config"]], r["seed"], r["step"]))


# Per-step quantities the table averages over steps (per seed), then over seeds.
_AVERAGED = (
    "mismatch_mean",
    "mismatch_max",
    "routing_diff_frac",
    "is_weight_mean",
    "is_ess",
    "seq_rejected_frac",
    "token_rejected_frac",
    "grad_norm",
)


def summarize(rows: list[dict], s: LabSettings, tail: int = 5) -> list[dict]:
    """The table: per configuration, over seeds (mean and standard deviation)."""
    out = []
    for c in s.configs:
        per_seed = []
        for seed in s.seeds:
            r = [x for x in rows if x["config"] == c and x["seed"] == seed]
            if not r:
                continue
            last = r[-min(tail, len(r)) :]
            reached = next((x["step"] for x in r if x["reward"] >= s.threshold), None)
            per_seed.append(
                {
                    "final_reward": sum(x["reward"] for x in last) / len(last),
                    "reached": reached,
                    "wall_s": r[-1]["wall_s"],
                    **{k: sum(x[k] for x in r) / len(r) for k in _AVERAGED},
                }
            )
        if not per_seed:
            continue
        n = len(per_seed)

        def mean(k):
            return sum(p[k] for p in per_seed) / n

        def std(k):
            m = mean(k)
            return math.sqrt(sum((p[k] - m) ** 2 for p in per_seed) / max(n - 1, 1))

        reached = [p["reached"] for p in per_seed if p["reached"] is not None]
        out.append(
            {
                "config": c,
                "seeds": n,
                "final_reward": mean("final_reward"),
                "final_reward_std": std("final_reward"),
                "steps_to_threshold": (sorted(reached)[len(reached) // 2] if len(reached) * 2 > n else None),
                "seeds_reaching": len(reached),
                "wall_s_per_run": mean("wall_s"),
                **{k: mean(k) for k in _AVERAGED},
            }
        )
    return out


def format_table(summary: list[dict], s: LabSettings) -> str:
    """The summary as a Markdown table."""
    tail = min(5, s.steps)
    head = (
        f"| config | final reward (last {tail} steps, mean ± sd) | steps to reward {s.threshold:g} "
        "(median; seeds reaching) | wall s / run | mean \\|prev-gen\\| | max \\|prev-gen\\| | "
        "routing differs | is_weight_mean | is_ess | seq rejected | token rejected | grad norm |"
    )
    lines = [head, "|" + " --- |" * 12]
    for r in summary:
        reach = "-" if r["steps_to_threshold"] is None else str(r["steps_to_threshold"])
        lines.append(
            f"| `{r['config']}` | {r['final_reward']:.3f} ± {r['final_reward_std']:.3f} | "
            f"{reach} ({r['seeds_reaching']}/{r['seeds']}) | {r['wall_s_per_run']:.0f} | "
            f"{r['mismatch_mean']:.4f} | {r['mismatch_max']:.3f} | {r['routing_diff_frac']:.3f} | "
            f"{r['is_weight_mean']:.3f} | {r['is_ess']:.3f} | {r['seq_rejected_frac']:.3f} | "
            f"{r['token_rejected_frac']:.4f} | {r['grad_norm']:.3f} |"
        )
    return "\n".join(lines)


def write_csv(rows: list[dict], path: str) -> None:
    """One row per configuration, seed and step (floats to 6 significant digits)."""
    fields = ["config", "seed", "step", *_METRICS]
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=fields)
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{r[k]:.6g}" if isinstance(r[k], float) else r[k]) for k in fields})


def write_summary_csv(summary: list[dict], path: str) -> None:
    """The table as CSV."""
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(summary[0]))
        w.writeheader()
        for r in summary:
            w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()})


_PANELS = (
    ("reward", "reward (fraction counted right)"),
    ("mismatch_mean", "mean |prev - gen| per token"),
    ("routing_diff_frac", "tokens with different expert routing"),
    ("is_weight_mean", "is_weight_mean"),
    ("is_ess", "effective sample size"),
    ("seq_rejected_frac", "sequences rejected"),
    ("token_rejected_frac", "tokens rejected"),
    ("grad_norm", "gradient norm (before clip)"),
)


def write_plot(rows: list[dict], s: LabSettings, path: str, title: str = "") -> None:
    """Learning curves: mean over seeds, band = min..max over seeds (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 4, figsize=(17, 7.5), sharex=True)
    colors = plt.get_cmap("tab10")
    for i, c in enumerate(s.configs):
        runs = [[x for x in rows if x["config"] == c and x["seed"] == seed] for seed in s.seeds]
        runs = [r for r in runs if r]
        if not runs:
            continue
        steps = [x["step"] for x in runs[0]]
        for ax, (key, label) in zip(axes.flat, _PANELS):
            vals = torch.tensor([[x[key] for x in r] for r in runs], dtype=torch.float64)
            ax.plot(steps, vals.mean(0).tolist(), color=colors(i), label=c, lw=1.6)
            ax.fill_between(
                steps, vals.min(0).values.tolist(), vals.max(0).values.tolist(), color=colors(i), alpha=0.15, lw=0
            )
            ax.set_title(label, fontsize=10)
    for ax in axes[1]:
        ax.set_xlabel("rollout step")
    axes.flat[0].legend(fontsize=8, loc="lower right")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def progress_bar(done: int, total: int, stream=None, _state={"t0": None, "last": -1}) -> None:
    """Progress with an ETA: a redrawn bar on a terminal, a line per 5% otherwise."""
    stream = stream if stream is not None else sys.stderr  # the current one, not the one at import
    if _state["t0"] is None or done <= 1:
        _state["t0"], _state["last"] = time.perf_counter(), -1
    el = time.perf_counter() - _state["t0"]
    eta = el / max(done, 1) * (total - done)
    msg = f"{done}/{total} steps  {el:5.0f}s elapsed, ~{eta:4.0f}s left"
    if stream.isatty():
        width = 30
        filled = int(width * done / max(total, 1))
        stream.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {msg}")
        if done == total:
            stream.write("\n")
    else:
        pct = int(20 * done / max(total, 1))
        if pct == _state["last"]:
            return
        _state["last"] = pct
        stream.write(msg + "\n")
    stream.flush()


# ---------------------------------------------------------------------------- command line
def build_parser() -> argparse.ArgumentParser:
    """Arguments of ``python -m nemo_rs_plugin.tools.lab`` / ``nemo-rs lab``."""
    d = LabSettings()
    p = argparse.ArgumentParser(prog="nemo-rs lab", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke run (< 2 min): 2 configs x 2 seeds, tiny sizes")
    p.add_argument("--out", default="lab-out", help="output folder (default lab-out)")
    p.add_argument("--configs", nargs="+", metavar="NAME", help=f"subset of: {', '.join(CONFIGS)}")
    p.add_argument("--seeds", nargs="+", type=int, help=f"seeds (default {' '.join(map(str, d.seeds))})")
    for f in dataclasses.fields(LabSettings):
        if f.name in ("seeds", "configs"):
            continue
        p.add_argument(
            "--" + f.name.replace("_", "-"),
            type=type(getattr(d, f.name)),
            default=None,
            help=f"default {getattr(d, f.name)}",
        )
    p.add_argument(
        "--workers",
        type=int,
        default=min(2, os.cpu_count() or 1),
        help="processes (one thread each; results do not depend on it)",
    )
    return p


def settings_from(args: argparse.Namespace) -> LabSettings:
    """Defaults, then ``--quick``, then explicit flags."""
    s = LabSettings(**(QUICK if args.quick else {}))
    for f in dataclasses.fields(LabSettings):
        v = getattr(args, f.name, None)
        if v is not None:
            setattr(s, f.name, list(v) if isinstance(v, list) else v)
    unknown = [c for c in s.configs if c not in CONFIGS]
    if unknown:
        raise SystemExit(f"error: unknown configuration(s) {', '.join(unknown)}; known: {', '.join(CONFIGS)}")
    return s


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the experiment; write the CSVs, the table and the figure under ``--out``."""
    args = build_parser().parse_args(argv)
    s = settings_from(args)
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("error: nemo-rs lab needs transformers: pip install 'transformers>=5.5,<5.9'", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    print(
        f"nemo-rs lab: {len(s.configs)} configs x {len(s.seeds)} seeds x {s.steps} steps, "
        f"{s.prompts}x{s.group} responses of {s.length} tokens, sampler {s.sampler_dtype} lag {s.lag}, "
        f"{args.workers} worker(s)",
        file=sys.stderr,
    )
    t0 = time.perf_counter()
    rows = run_all(s, workers=args.workers, progress=progress_bar)
    total = time.perf_counter() - t0
    summary = summarize(rows, s)
    table = format_table(summary, s)
    write_csv(rows, os.path.join(args.out, "lab_steps.csv"))
    write_summary_csv(summary, os.path.join(args.out, "lab_summary.csv"))
    with open(os.path.join(args.out, "lab_summary.md"), "w") as fh:
        fh.write(table + "\n")
    with open(os.path.join(args.out, "lab_settings.json"), "w") as fh:
        json.dump(
            {
                **dataclasses.asdict(s),
                "workers": args.workers,
                "total_wall_s": round(total, 1),
                "torch": torch.__version__,
                "transformers": transformers.__version__,
            },
            fh,
            indent=2,
        )
    try:
        write_plot(
            rows,
            s,
            os.path.join(args.out, "lab.png"),
            title=(
                f"GRPO, tiny Qwen3-MoE, count task, {s.length}-token responses, sampler "
                f"{s.sampler_dtype} lag {s.lag}; mean of {len(s.seeds)} seeds, band min-max"
            ),
        )
    except ImportError:
        print("note: no matplotlib, no figure (pip install 'nemo-rs-plugin[plot]')", file=sys.stderr)
    print(table)
    print(f"total wall time {total:.0f}s; outputs in {args.out}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
