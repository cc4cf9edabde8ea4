"""The lab's experiment: the settings and the GRPO training loop (the arms: :mod:`~nemo_rs_plugin.lab.arms`).

:func:`run_one` trains one arm with one seed and returns one row of metrics per rollout step
(:data:`STEP_METRICS`); :mod:`~nemo_rs_plugin.lab.pool` runs many, in worker processes if
asked. The model, task and sampler are in :mod:`~nemo_rs_plugin.lab.model`; what is measured
and why is in :mod:`nemo_rs_plugin.lab.cli` and docs/lab.md.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from nemo_rs_plugin.core.correction.calibration import calibrate_filters
from nemo_rs_plugin.core.loss import CorrectedPGLoss
from nemo_rs_plugin.core.policy_loss import kl_estimate
from nemo_rs_plugin.core.settings.config import RejectionFilter
from nemo_rs_plugin.lab.arms import (
    BASE_LOSS,
    CONFIGS,
    DEFAULT_ARMS,
    DOSE_ARMS,
    DOSE_LAGS,
    SEQ_MASK_TIS_BOUNDS,
    Arm,
)
from nemo_rs_plugin.lab.model import (
    DTYPES,
    RoutingRecorder,
    build_model,
    reward_of,
    routing_diff,
    sample,
    token_logprobs,
)

__all__ = [
    "Arm",
    "BASE_LOSS",
    "CONFIGS",
    "DEFAULT_ARMS",
    "DOSE",
    "DOSE_ARMS",
    "DOSE_LAGS",
    "QUICK",
    "QUICK_DOSE",
    "SEQ_MASK_TIS_BOUNDS",
    "STEP_METRICS",
    "LabSettings",
    "run_one",
]


@dataclass
class LabSettings:
    """Everything a run depends on (the defaults are the published run, docs/lab.md)."""

    length: int = 64
    """Response tokens (fixed length; the task's reward is length-independent)."""
    vocab: int = 16
    prompts: int = 4
    """Prompts per rollout step."""
    group: int = 4
    """Responses per prompt (GRPO group)."""
    steps: int = 60
    """Rollout steps."""
    minibatches: int = 2
    """Optimizer steps per rollout batch."""
    microbatches: int = 2
    """Microbatches per optimizer step (gradient accumulation, global counts)."""
    lr: float = 1e-2
    max_grad_norm: float = 1.0
    sampler_dtype: str = "bf16"
    lag: int = 8
    """The sampler's weights are this many optimizer steps older than the trainer's."""
    hidden: int = 64
    layers: int = 2
    experts: int = 8
    top_k: int = 2
    threshold: float = 0.3
    """Reward for the 'steps to threshold' column."""
    spike: float = 5.0
    """A gradient norm (before clipping) above this is a spike."""
    eval_every: int = 5
    """Evaluate the trainer's own policy every this many rollout steps (and at the last)."""
    calibration_steps: int = 10
    """Calibrated arms: rollout steps without those filters whose data sets the band."""
    calibration_target: float = 0.05
    """Calibrated arms: the share of sequences the band rejects on the calibration data."""
    seeds: list = field(default_factory=lambda: list(range(12)))
    configs: list = field(default_factory=lambda: list(DEFAULT_ARMS))


#: The dose-response run's defaults (``--lags``), over the single-lag defaults: 80 steps, so that
#: a late collapse falls inside the run, and 16 seeds the published runs (0-11) did not use.
DOSE: dict[str, Any] = dict(steps=80, seeds=list(range(100, 116)), configs=list(DOSE_ARMS))

QUICK: dict[str, Any] = dict(
    length=16,
    prompts=2,
    group=4,
    steps=4,
    hidden=32,
    experts=4,
    calibration_steps=2,
    eval_every=2,
    seeds=[0, 1],
    configs=["none", "seqmean+calibrated-geo-rs+veto"],
)

#: ``--quick --lags``: the quick sizes, 3 evaluations a run, the reference and two arms.
QUICK_DOSE: dict[str, Any] = dict(steps=6, configs=["on-policy", "none", "token-tis+veto"])

_PROMPT_TOKENS = 2  # [BOS, start]
_EVAL_SEED = 777  # the same prompts' random numbers at every evaluation, in every arm

#: The per-step metrics of :func:`run_one` (after ``config``, ``seed``, ``step``).
STEP_METRICS = (
    "reward",
    "eval_reward",
    "mismatch_mean",
    "mismatch_max",
    "kl_gen_prev",
    "routing_diff_frac",
    "is_weight_mean",
    "is_ess",
    "seq_rejected_frac",
    "token_rejected_frac",
    "grad_norm",
    "grad_norm_max",
    "grad_spikes",
    "band_lower",
    "band_upper",
    "rejection_warnings",
    "loss",
    "wall_s",
)


def run_one(name: str, seed: int, s: LabSettings, tick: Optional[Callable[[], None]] = None) -> list[dict]:
    """Train one arm with one seed; one dict of metrics per rollout step.

    Deterministic given (name, seed, settings): one thread, every random draw seeded.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run_one(name, seed, s, tick)
    finally:
        torch.set_num_threads(threads)


@dataclass
class _Rollout:
    """One rollout step's batch in NeMo-RL's layout, and what it measured before the update."""

    data: dict[str, torch.Tensor]
    rewards: torch.Tensor  # [B]
    d: torch.Tensor  # [B, L] prev - gen per response token
    routing_diff: float


class _Run:
    """One arm and seed in training: the policy, its lagging sampler, the optimizer, the band."""

    def __init__(self, name: str, seed: int, s: LabSettings) -> None:
        # The order of these steps is the order of the random draws: keep it (determinism).
        torch.manual_seed(seed)
        self.name, self.seed, self.s, self.arm = name, seed, s, CONFIGS[name]
        self.lag = 0 if self.arm.on_policy else s.lag
        self.loss_fn = self._loss({})
        self.applies_is = bool(self.arm.loss.get("use_importance_sampling_correction", False))
        # A per-sequence truncation (seq-mask-tis) zeroes whole sequences: counted with the rejected
        # ones (``seq_rejected_frac``).
        entry = self.loss_fn.cfg.truncation_entry
        self.masks_sequences = entry is not None and entry.per_sequence
        self.policy = build_model(s).train()
        self.sampler = build_model(s, DTYPES["fp32" if self.arm.on_policy else s.sampler_dtype])
        self.opt = torch.optim.AdamW(self.policy.parameters(), lr=s.lr, betas=(0.9, 0.99), weight_decay=0.0)
        self.history = [self._weights()]  # the policy's versions, the newest last
        self.gen = torch.Generator().manual_seed(10_000 + seed)
        self.rec_sampler, self.rec_trainer = RoutingRecorder(self.sampler), RoutingRecorder(self.policy)
        self.pilot: list[_Rollout] = []  # calibration data (calibrated arms, first steps)
        self.band = (math.nan, math.nan)
        self.earlier_warnings = 0  # run-time rejection warnings of the losses replaced so far

    def _loss(self, calibrated: dict) -> CorrectedPGLoss:
        """The arm's loss; calibrated filters (once set) run before the section's own."""
        section = {**BASE_LOSS, **self.arm.loss}
        if calibrated:
            section["rejection_sampling"] = [*calibrated["filters"], *self.arm.loss.get("rejection_sampling", [])]
        return CorrectedPGLoss(section)

    def _weights(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.policy.state_dict().items()}

    def rollout(self) -> _Rollout:
        """Sample with the weights of ``lag`` optimizer steps ago; recompute ``prev`` (float32)."""
        s, P, L = self.s, _PROMPT_TOKENS, self.s.length
        B = s.prompts * s.group
        self.sampler.load_state_dict(self.history[max(0, len(self.history) - 1 - self.lag)])
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
            d=prev[:, P - 1 :] - gen_lp,
            routing_diff=routing_diff(self.rec_sampler.calls, self.rec_trainer.calls, B, P, L),
        )

    def calibrate_if_due(self, step: int, rollout: _Rollout) -> None:
        """Calibrated arms: pool the first ``calibration_steps`` batches, then set the band once."""
        if not self.arm.calibrated or step >= self.s.calibration_steps:
            return
        self.pilot.append(rollout)
        if step + 1 < self.s.calibration_steps:
            return
        P = _PROMPT_TOKENS
        prev = torch.cat([r.data["prev_logprobs"][:, P:] for r in self.pilot])
        gen = torch.cat([r.data["generation_logprobs"][:, P:] for r in self.pilot])
        stages = calibrate_filters(
            [RejectionFilter(**f) for f in self.arm.calibrated],
            prev,
            gen,
            torch.ones_like(prev),
            self.s.calibration_target,
            widen_only=self.arm.widen_only,
        )
        filters = [st.filter.model_dump(exclude_none=True) for st in stages]
        self.band = (stages[0].filter.lower or math.nan, stages[0].filter.upper or math.nan)
        self.earlier_warnings = self.warnings()
        self.loss_fn = self._loss({"filters": filters})
        self.pilot = []

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
            self.history = self.history[-(self.lag + 1) :]
            summed.append(acc)
        return summed, norms

    def warnings(self) -> int:
        """Unhealthy windows the loss's run-time rejection monitor has counted (core/reporting/health.py)."""
        monitor = self.loss_fn.rejection_monitor
        return self.earlier_warnings + (monitor.unhealthy_windows if monitor is not None else 0)

    @torch.no_grad()
    def evaluate(self) -> float:
        """The trainer's own policy (float32, current weights) on every start token, sampled."""
        s = self.s
        start = torch.arange(s.vocab)
        prompts = torch.stack([torch.full_like(start, s.vocab), start], dim=1)
        self.policy.eval()
        responses, _ = sample(self.policy, prompts, s.length, torch.Generator().manual_seed(_EVAL_SEED))
        self.policy.train()
        return float(reward_of(responses, start, s.vocab).mean())

    def seq_rejected(self, avg: Callable[[str], float]) -> float:
        """The share of sequences the filters rejected; under seq-mask-tis also those it zeroed.

        (The one seq-mask-tis arm, ``seq-mis``, has no filter: no sequence is counted twice.)
        """
        rejected = avg("rs_seq_rejected_frac")
        return min(1.0, rejected + avg("is_oob_ratio")) if self.masks_sequences else rejected

    def step_row(self, step: int, rollout: _Rollout, summed: list[dict[str, float]], norms: list[float]) -> dict:
        """The row of :data:`STEP_METRICS` for one rollout step (``wall_s`` is set by the caller)."""

        def avg(key: str, default: float = 0.0) -> float:
            return sum(a.get(key, default) for a in summed) / len(summed)

        w_mean, w_sq = avg("is_weight_mean"), avg("is_weight_sq_mean")
        last = step + 1 == self.s.steps
        due = (step + 1) % self.s.eval_every == 0 or last
        return {
            "config": self.name,
            "seed": self.seed,
            "lag": self.lag,
            "step": step + 1,
            "reward": float(rollout.rewards.mean()),
            "eval_reward": self.evaluate() if due else math.nan,
            "mismatch_mean": float(rollout.d.abs().mean()),
            "mismatch_max": float(rollout.d.abs().max()),
            # KL(gen || prev) per token: the k3 estimator under the sampler's own samples.
            "kl_gen_prev": float(kl_estimate(rollout.d, "k3").mean()),
            "routing_diff_frac": rollout.routing_diff,
            # Without IS correction the loss applies weight 1 (its metric reports the would-be weight).
            "is_weight_mean": w_mean if self.applies_is else 1.0,
            "is_ess": (w_mean**2 / w_sq if w_sq > 0 else 0.0) if self.applies_is else 1.0,
            "seq_rejected_frac": self.seq_rejected(avg),
            "token_rejected_frac": avg("rs_token_rejected_frac"),
            "grad_norm": sum(norms) / len(norms),
            "grad_norm_max": max(norms),
            "grad_spikes": sum(n > self.s.spike for n in norms),
            "band_lower": self.band[0],
            "band_upper": self.band[1],
            "rejection_warnings": self.warnings(),
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
    # The run-time rejection warning is counted per step (``rejection_warnings``), not printed.
    logging.getLogger("nemo_rs_plugin").setLevel(logging.ERROR)
    run = _Run(name, seed, s)
    rows = []
    t_start = time.perf_counter()
    for step in range(s.steps):
        rollout = run.rollout()
        summed, norms = run.update(rollout.data)
        rows.append({**run.step_row(step, rollout, summed, norms), "wall_s": time.perf_counter() - t_start})
        run.calibrate_if_due(step, rollout)
        if tick is not None:
            tick()
    return rows
