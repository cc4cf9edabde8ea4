"""The lab's experiment: a tiny MoE decoder, its sampler, and the GRPO training loop.

:func:`run_one` trains one configuration with one seed and returns one row of metrics per
rollout step (:data:`STEP_METRICS`); :func:`run_all` runs every configuration and seed, in
worker processes if asked. The task, the mismatch and what is measured are described in
:mod:`nemo_rs_plugin.tools.lab` and docs/lab.md.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from nemo_rs_plugin.core import presets
from nemo_rs_plugin.core.loss import CorrectedPGLoss

__all__ = [
    "BASE_LOSS",
    "CONFIGS",
    "QUICK",
    "STEP_METRICS",
    "LabSettings",
    "RoutingRecorder",
    "build_model",
    "reward_of",
    "run_all",
    "run_one",
    "sample",
    "token_logprobs",
]

#: The compared corrections (the loss sections; the common fields are in ``BASE_LOSS``).
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
BASE_LOSS = {
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


#: The per-step metrics of :func:`run_one` (after ``config``, ``seed``, ``step``).
STEP_METRICS = (
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


_PROMPT_TOKENS = 2  # [BOS, start]


@dataclass
class _Rollout:
    """One rollout step's batch in NeMo-RL's layout, and what it measured before the update."""

    data: dict[str, torch.Tensor]
    rewards: torch.Tensor  # [B]
    mismatch: torch.Tensor  # [B, L] |prev - gen| per response token
    routing_diff: float


class _Run:
    """One configuration and seed in training: the policy, its lagging sampler, the optimizer."""

    def __init__(self, name: str, seed: int, s: LabSettings) -> None:
        # The order of these steps is the order of the random draws: keep it (determinism).
        torch.manual_seed(seed)
        self.name, self.seed, self.s = name, seed, s
        self.loss_fn = CorrectedPGLoss({**BASE_LOSS, **CONFIGS[name]})
        self.applies_is = bool(CONFIGS[name].get("use_importance_sampling_correction", False))
        self.policy = build_model(s).train()
        self.sampler = build_model(s, _DTYPES[s.sampler_dtype])
        self.opt = torch.optim.AdamW(self.policy.parameters(), lr=s.lr, betas=(0.9, 0.99), weight_decay=0.0)
        self.history = [self._weights()]  # the policy's versions, the newest last
        self.gen = torch.Generator().manual_seed(10_000 + seed)
        self.rec_sampler, self.rec_trainer = RoutingRecorder(self.sampler), RoutingRecorder(self.policy)

    def _weights(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.policy.state_dict().items()}

    def rollout(self) -> _Rollout:
        """Sample with the weights of ``lag`` optimizer steps ago; recompute ``prev`` (float32)."""
        s, P, L = self.s, _PROMPT_TOKENS, self.s.length
        B = s.prompts * s.group
        self.sampler.load_state_dict(self.history[max(0, len(self.history) - 1 - s.lag)])
        start = torch.randint(0, s.vocab, (s.prompts,), generator=self.gen).repeat_interleave(s.group)
        prompts = torch.stack([torch.full_like(start, s.vocab), start], dim=1)
        self.rec_sampler.clear()
        responses, gen_lp = sample(self.sampler, prompts, L, self.gen)
        ids = torch.cat([prompts, responses], dim=1)
        rewards = reward_of(responses, start, s.vocab)
        grouped = rewards.view(s.prompts, s.group)
        adv = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-6)).reshape(B)
        # The trainer recomputes prev_logprobs (float32) before the update.
        self.rec_trainer.clear()
        with torch.no_grad():
            self.policy.eval()
            prev = token_logprobs(self.policy, ids)
            self.policy.train()
        return _Rollout(
            data=_nemo_rl_data(ids, adv, prev, gen_lp, P),
            rewards=rewards,
            mismatch=(prev[:, P - 1 :] - gen_lp).abs(),
            routing_diff=_routing_diff(self.rec_sampler.calls, self.rec_trainer.calls, B, P, L),
        )

    def update(self, data_all: dict[str, torch.Tensor]) -> tuple[list[dict[str, float]], list[float]]:
        """GRPO: several optimizer steps per rollout batch, microbatches inside.

        Returns each optimizer step's metrics (summed over its microbatches, as NeMo-RL sums
        them) and its gradient norm before clipping.
        """
        s = self.s
        summed: list[dict[str, float]] = []
        norms, order = [], torch.randperm(len(data_all["sample_mask"]), generator=self.gen)
        for mb in order.chunk(s.minibatches):
            data_mb = {k: v[mb] for k, v in data_all.items()}
            gvs = data_mb["sample_mask"].sum()
            gvt = (data_mb["token_mask"][:, 1:] * data_mb["sample_mask"][:, None]).sum()
            self.opt.zero_grad(set_to_none=True)
            acc: dict[str, float] = {}
            for micro in torch.arange(len(mb)).chunk(s.microbatches):
                data = {k: v[micro] for k, v in data_mb.items()}
                self.rec_trainer.clear()
                lp = token_logprobs(self.policy, data["input_ids"])
                loss, metrics = self.loss_fn(lp, data, gvs, gvt)
                loss.backward()
                for k, v in metrics.items():  # NeMo-RL sums microbatch metrics
                    acc[k] = acc.get(k, 0.0) + float(v)
            norms.append(float(torch.nn.utils.clip_grad_norm_(self.policy.parameters(), s.max_grad_norm)))
            self.opt.step()
            self.history.append(self._weights())
            self.history = self.history[-(s.lag + 1) :]
            summed.append(acc)
        return summed, norms

    def step_row(self, step: int, rollout: _Rollout, summed: list[dict[str, float]], norms: list[float]) -> dict:
        """The row of :data:`STEP_METRICS` for one rollout step (``wall_s`` is set by the caller)."""

        def avg(key: str, default: float = 0.0) -> float:
            return sum(a.get(key, default) for a in summed) / len(summed)

        w_mean, w_sq = avg("is_weight_mean"), avg("is_weight_sq_mean")
        return {
            "config": self.name,
            "seed": self.seed,
            "step": step + 1,
            "reward": float(rollout.rewards.mean()),
            "mismatch_mean": float(rollout.mismatch.mean()),
            "mismatch_max": float(rollout.mismatch.max()),
            "routing_diff_frac": rollout.routing_diff,
            # Without IS correction the loss applies weight 1 (its metric reports the would-be weight).
            "is_weight_mean": w_mean if self.applies_is else 1.0,
            "is_ess": (w_mean**2 / w_sq if w_sq > 0 else 0.0) if self.applies_is else 1.0,
            "seq_rejected_frac": avg("rs_seq_rejected_frac"),
            "token_rejected_frac": avg("rs_token_rejected_frac"),
            "grad_norm": sum(norms) / len(norms),
            "loss": avg("loss"),
        }


def _nemo_rl_data(
    ids: torch.Tensor, adv: torch.Tensor, prev: torch.Tensor, gen_lp: torch.Tensor, prompt_tokens: int
) -> dict[str, torch.Tensor]:
    """NeMo-RL's ``[B, S]`` data dict: log-probs shifted one right, the prompt masked out."""
    B, S = ids.shape
    token_mask = torch.zeros(B, S, dtype=torch.long)
    token_mask[:, prompt_tokens:] = 1
    pad = torch.zeros(B, 1)
    return {
        "input_ids": ids,
        "advantages": adv[:, None].expand(B, S).contiguous(),
        "prev_logprobs": torch.cat([pad, prev], 1) * token_mask,
        "generation_logprobs": torch.cat([torch.zeros(B, prompt_tokens), gen_lp], 1) * token_mask,
        "reference_policy_logprobs": torch.cat([pad, prev], 1) * token_mask,
        "token_mask": token_mask,
        "sample_mask": torch.ones(B),
    }


def _run_one(name: str, seed: int, s: LabSettings, tick: Optional[Callable[[], None]]) -> list[dict]:
    run = _Run(name, seed, s)
    rows = []
    t_start = time.perf_counter()
    for step in range(s.steps):
        rollout = run.rollout()
        summed, norms = run.update(rollout.data)
        rows.append({**run.step_row(step, rollout, summed, norms), "wall_s": time.perf_counter() - t_start})
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
