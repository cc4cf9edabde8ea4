"""``CorrectedPGLoss``: NeMo-RL's clipped PG loss with the off-policy correction layer.

This is the host-independent core: it takes NeMo-RL's data dict (or any mapping with the
same keys) and imports neither NeMo-RL nor Megatron. The NeMo-RL subclass in
:mod:`nemo_rs_plugin.nemo_rl.loss_fn` only forwards to it.

Loss (token-level; ``m`` valid mask, ``w`` IS weight, ``k`` rejection mask, ``N`` NeMo-RL's
``global_valid_toks``)::

    L = sum_t k_t [ w_t * pg_t + beta * kl_t ] / N  +  mu * NLL_correct

and, with ``token_level_loss: false``, the mean over sequences (``/ global_valid_seqs``) of
per-sequence token means. ``pg_t`` is the clipped objective of
:func:`~nemo_rs_plugin.core.policy_loss.clipped_objective`. With no plugin field set, ``k = 1``
and the result equals NeMo-RL's ``ClippedPGLossFn`` (loss, gradient, every metric).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch

from nemo_rs_plugin.core.compiled import core_fn
from nemo_rs_plugin.core.config import RSClippedPGLossConfig
from nemo_rs_plugin.core.correction import CorrectionResult, PolicyLogProbs, apply_correction, plan_correction
from nemo_rs_plugin.core.distributed import NO_GROUPS, SequenceGroups, all_reduce_sum_with_grad
from nemo_rs_plugin.core.masking import EPS, TokenMasks, masked_sum, nonfinite, sanitize
from nemo_rs_plugin.core.metrics import GlobalCounts, MetricSet, batched_evaluation
from nemo_rs_plugin.core.policy_loss import (
    clipped_objective,
    kl_estimate,
    kl_penalty_per_token,
    policy_ratios,
    positive_example_nll,
)

__all__ = ["CorrectedPGLoss", "LossInputs", "metric_normalizations"]

_LOGPROB_KEYS = ("prev_logprobs", "generation_logprobs", "reference_policy_logprobs")


@dataclass
class LossInputs:
    """Aligned per-token inputs of one microbatch (position t predicts token t + 1).

    All ``[B, T]`` tensors share one shape; ``sample_mask`` and ``rewards`` are ``[B]``.
    Under context parallelism each holds the local shard of every sequence.
    """

    curr: torch.Tensor
    prev: Optional[torch.Tensor]
    generation: torch.Tensor
    reference: Optional[torch.Tensor]
    advantages: torch.Tensor
    token_mask: torch.Tensor
    sample_mask: torch.Tensor
    rewards: Optional[torch.Tensor] = None
    curr_unfiltered: Optional[torch.Tensor] = None

    @classmethod
    def from_nemo_rl(
        cls,
        next_token_logprobs: torch.Tensor,
        data: Mapping[str, Any],
        need_prev: bool,
        need_reference: bool,
    ) -> "LossInputs":
        """Slice NeMo-RL's ``[B, S]`` data dict to the ``[B, S-1]`` next-token positions.

        Every per-token field must be ``[B, S]``, like NeMo-RL's: a ``[B]`` ``advantages`` is
        an error, as in NeMo-RL's ``ClippedPGLossFn`` (which slices ``[:, 1:]`` too), not
        broadcast.
        """
        lp_shape = tuple(getattr(next_token_logprobs, "shape", ()))
        want = f"({lp_shape[0]}, {lp_shape[1] + 1})" if len(lp_shape) == 2 else "[B, S]"

        def col(key: str) -> torch.Tensor:
            t = _required(data, key)
            if t.dim() != 2:
                hint = ""
                if key == "advantages" and t.dim() == 1:
                    hint = (
                        "; one advantage per token, as NeMo-RL's GRPO stores them: broadcast a "
                        "per-sequence advantage with advantages.unsqueeze(-1).expand(-1, S)"
                    )
                raise ValueError(
                    f"data[{key!r}]: got shape {tuple(t.shape)}; expected [B, S] = {want}, "
                    f"position 0 dropped to align with next_token_logprobs {lp_shape}{hint}"
                )
            return t[:, 1:]

        unfiltered = data.get("curr_logprobs_unfiltered") if need_reference else None
        return cls(
            curr=next_token_logprobs,
            prev=col("prev_logprobs") if need_prev else None,
            generation=col("generation_logprobs"),
            reference=col("reference_policy_logprobs") if need_reference else None,
            advantages=col("advantages"),
            token_mask=col("token_mask"),
            sample_mask=_required(data, "sample_mask"),
            rewards=data.get("rewards"),
            curr_unfiltered=unfiltered,
        )

    def compute_dtype(self) -> torch.dtype:
        """float32, or float64 when any float input is float64: the dtype the loss runs in.

        bf16 and fp16 cannot hold the sensitive steps: an fp16 ``exp`` overflows from a
        log-ratio of 11.1 (the +-20 clamp allows exp(20) = 4.9e8), and a bf16 count of
        global tokens rounds to 8 significant bits.
        """
        inputs = (
            self.curr,
            self.prev,
            self.generation,
            self.reference,
            self.advantages,
            self.token_mask,
            self.curr_unfiltered,
        )
        # Python-side dtype logic: torch.promote_types would dispatch an operator per input.
        wide = any(t is not None and t.dtype == torch.float64 for t in inputs)
        return torch.float64 if wide else torch.float32

    def to_dtype(self, dtype: torch.dtype) -> "LossInputs":
        """Float tensors cast to ``dtype`` (differentiably; a no-op for those already in it).

        Integer and boolean masks stay as they are; ``rewards`` is only compared with 0.
        """

        def cast(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
            if t is None or not t.is_floating_point() or t.dtype == dtype:
                return t
            return t.to(dtype)

        return LossInputs(
            curr=cast(self.curr),
            prev=cast(self.prev),
            generation=cast(self.generation),
            reference=cast(self.reference),
            advantages=cast(self.advantages),
            token_mask=cast(self.token_mask),
            sample_mask=cast(self.sample_mask),
            rewards=self.rewards,
            curr_unfiltered=cast(self.curr_unfiltered),
        )

    def validate(self) -> None:
        """Raise a clear error on shape or dtype mismatches (mixed float dtypes are fine)."""
        for name, t in (("next_token_logprobs", self.curr), ("sample_mask", self.sample_mask)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name}: got {type(t).__name__}; expected a torch.Tensor")
        if self.curr.dim() != 2:
            raise ValueError(f"next_token_logprobs: expected [B, T], got shape {tuple(self.curr.shape)}")
        if not self.curr.is_floating_point():
            raise TypeError(f"next_token_logprobs: expected a float tensor, got {self.curr.dtype}")
        shape = self.curr.shape
        named = {
            "prev_logprobs": self.prev,
            "generation_logprobs": self.generation,
            "reference_policy_logprobs": self.reference,
            "advantages": self.advantages,
            "token_mask": self.token_mask,
            "curr_logprobs_unfiltered": self.curr_unfiltered,
        }
        for name, t in named.items():
            if t is None:
                continue
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name}: got {type(t).__name__}; expected a torch.Tensor")
            if t.shape != shape:
                sliced = "" if name == "curr_logprobs_unfiltered" else " (after dropping position 0)"
                raise ValueError(
                    f"{name}: shape {tuple(t.shape)}{sliced} does not match next_token_logprobs {tuple(shape)}"
                )
            if name != "token_mask" and not t.is_floating_point():
                raise TypeError(f"{name}: expected a float tensor, got {t.dtype}")
        if self.sample_mask.shape != shape[:1]:
            raise ValueError(f"sample_mask: shape {tuple(self.sample_mask.shape)} does not match batch size {shape[0]}")
        if self.rewards is not None and self.rewards.shape[:1] != shape[:1]:
            raise ValueError(f"rewards: shape {tuple(self.rewards.shape)} does not match batch size {shape[0]}")


def _required(data: Mapping[str, Any], key: str) -> torch.Tensor:
    if key not in data:
        raise KeyError(f"data[{key!r}] is missing; the rs_clipped_pg loss needs it")
    t = data[key]
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"data[{key!r}]: got {type(t).__name__}; expected a torch.Tensor")
    return t


class CorrectedPGLoss:
    """Clipped policy-gradient loss with decoupled IS level and composable rejection sampling.

    The host-independent core: plain torch in, ``(loss, metrics)`` out. NeMo-RL never sees
    this class; it builds :class:`~nemo_rs_plugin.nemo_rl.loss_fn.RSClippedPGLossFn` (the
    ``ClippedPGLossFn`` subclass registered as ``rs_clipped_pg``), which forwards here.

    Args:
        cfg: anything :meth:`RSClippedPGLossConfig.from_any` accepts; validated here, once.
    """

    def __init__(self, cfg: Any = None):
        self.cfg = RSClippedPGLossConfig.from_any(cfg if cfg is not None else {})
        cfg = self.cfg
        self.token_level_loss = cfg.token_level_loss
        # use_kl_in_reward moves the KL into the reward: the loss has no KL term then.
        self.kl_coef = 0.0 if cfg.use_kl_in_reward else cfg.reference_policy_kl_penalty
        self._normalizations: Optional[dict[str, str]] = None

    # ------------------------------------------------------------------ public API
    def __call__(
        self,
        next_token_logprobs: torch.Tensor,
        data: Mapping[str, Any],
        global_valid_seqs: torch.Tensor,
        global_valid_toks: torch.Tensor,
        groups: SequenceGroups = NO_GROUPS,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Loss and metrics from NeMo-RL's data dict (``[B, S]`` tensors, logprobs ``[B, S-1]``)."""
        inputs = LossInputs.from_nemo_rl(
            next_token_logprobs,
            data,
            need_prev=not self.cfg.force_on_policy_ratio,
            need_reference=self.kl_coef != 0,
        )
        return self.compute(inputs, global_valid_seqs, global_valid_toks, groups)

    def metric_normalizations(self) -> dict[str, str]:
        """Metric name -> ``tokens`` / ``sequences`` / ``none``, as each metric declares it.

        Every metric is declared once, where it is defined, with its normalization and
        reduction (``MetricSet.add``, ``add_total``, ``add_masked_total(s)``, ``add_masked_extrema``,
        ``derive``); this reads the declarations off one run of the tensor
        core on a tiny probe batch (two sequences with valid tokens and rewards, on the CPU,
        eager), cached per instance. Which metrics exist depends on the config only.
        """
        if self._normalizations is None:
            B, S = 2, 4
            ones = torch.ones(B, S)
            data = {
                "input_ids": torch.zeros(B, S, dtype=torch.long),
                "advantages": ones,
                "prev_logprobs": -ones,
                "generation_logprobs": -ones,
                "reference_policy_logprobs": -ones,
                "token_mask": torch.ones(B, S, dtype=torch.long),
                "sample_mask": torch.ones(B),
                "rewards": torch.ones(B),
            }
            inputs = LossInputs.from_nemo_rl(
                -torch.ones(B, S - 1),
                data,
                need_prev=not self.cfg.force_on_policy_ratio,
                need_reference=self.kl_coef != 0,
            )
            _, metrics = type(self)._tensors(self, inputs, float(B), float(B * (S - 1)), NO_GROUPS)
            self._normalizations = metrics.normalizations()
        return dict(self._normalizations)

    def compute(
        self,
        x: LossInputs,
        global_valid_seqs: Any,
        global_valid_toks: Any,
        groups: SequenceGroups = NO_GROUPS,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Loss and metrics from aligned inputs; ``groups`` split the sequences' tokens.

        Global counts: ``global_valid_toks`` is the number of valid tokens
        (``token_mask * sample_mask``) and ``global_valid_seqs`` the number of valid
        sequences (``sample_mask``) of the whole global batch, all microbatches and
        data-parallel ranks, as NeMo-RL computes them; split-API callers may pass a
        placeholder 1. Both may be 0 only for a fully masked global batch: the loss is then 0,
        its gradient 0 and every metric finite (the ``_min``/``_max`` extremes report
        NeMo-RL's "no token" sentinels +-inf). A count that is negative or not finite, or 0
        while this microbatch has a valid token (sequence), raises ``ValueError`` naming the
        count, its value and the microbatch's own count; NeMo-RL divides by ``0 + 1e-8``
        there and returns a loss of order 1e9. The check rides on the one host transfer of
        the metrics, so the error comes at the end of the call.

        Precision: every step runs in float32 whatever the input dtypes (bf16, fp16, mixed;
        float64 if any input is float64), so log-ratios, ``exp``, clamps, IS weights and
        sequence statistics never run in half precision. The loss is returned in that dtype;
        its gradient reaches a bf16/fp16 ``curr`` through the cast, in ``curr``'s dtype (an
        fp16 gradient beyond +-65504 saturates to +-inf there). float32 inputs are untouched.
        """
        x.validate()
        # The tensor math (optionally torch.compile'd, see nemo_rs_plugin/core/compiled.py) never
        # leaves the device; the one host transfer stays here, eager.
        # The evaluation form is decided here, eagerly: a compiled core specialises on the bool.
        batched = batched_evaluation(x.curr.device)
        loss, metrics = core_fn(self, groups)(self, x, global_valid_seqs, global_valid_toks, groups, batched)
        return loss, metrics.finalize(groups)

    def _tensors(
        self,
        x: LossInputs,
        global_valid_seqs: Any,
        global_valid_toks: Any,
        groups: SequenceGroups,
        batched: bool = False,
    ) -> tuple[torch.Tensor, MetricSet]:
        """The pure-tensor part of :meth:`compute`: the loss and the stacked, unreduced metrics."""
        x = x.to_dtype(x.compute_dtype())
        cfg = self.cfg
        dtype, device = x.curr.dtype, x.curr.device
        counts = GlobalCounts(
            tokens=_global_count("global_valid_toks", global_valid_toks, dtype, device),
            sequences=_global_count("global_valid_seqs", global_valid_seqs, dtype, device),
        )
        metrics = MetricSet(counts, batched)
        clean = _sanitize_inputs(x, cfg.force_on_policy_ratio, self.kl_coef != 0, batched)
        masks = clean.masks
        token_mask, sample_mask = masks.token_mask, masks.sample_mask

        # ---- the off-policy correction: plan (local) -> reduce (one collective) -> apply ----
        plan = plan_correction(
            cfg,
            clean.d,
            masks,
            log_probs=PolicyLogProbs(curr=x.curr.detach(), prev=clean.prev_raw.detach(), gen=x.generation),
            advantages=clean.advantages,
        )
        stats = plan.reduce(groups)
        corr = apply_correction(cfg, plan, stats, metrics, groups)

        keep = corr.keep  # [B, T]
        loss_tokens = corr.loss_tokens  # [B, T] tokens that contribute to the loss
        # NeMo-RL's sequence-level aggregation averages each row over token_mask.
        agg_mask = loss_tokens if self.token_level_loss else token_mask * keep
        token_denominator, seq_denominator = counts.tokens, counts.sequences
        if cfg.rejection_denominator == "kept":
            # VERL's decoupled semantics: shrink the global denominators by the kept fraction
            # of this microbatch (over all ranks that split its sequences).
            n_valid = corr.seq_token_count.sum()
            n_seqs = sample_mask @ torch.sign(corr.seq_token_count)
            token_denominator = counts.tokens * corr.kept_token_count / n_valid.clamp_min(EPS)
            seq_denominator = counts.sequences * corr.kept_seq_count / n_seqs.clamp_min(EPS)

        # ---- policy-gradient term ----
        # Tokens with a non-finite input take no part in the GSPO sequence ratio either.
        ratio_mask = corr.ratio_mask if cfg.sequence_level_importance_ratios else token_mask
        ratios, ratios_clamped = policy_ratios(
            clean.curr,
            clean.prev,
            ratio_mask,
            force_on_policy=cfg.force_on_policy_ratio,
            disable_ppo_ratio=cfg.disable_ppo_ratio,
            sequence_level=cfg.sequence_level_importance_ratios,
            clip_min=cfg.ratio_clip_min,
            clip_max=cfg.ratio_clip_max,
            groups=groups,
            row_count=corr.ratio_token_count,
        )
        pg = clipped_objective(
            clean.advantages,
            ratios,
            ratios_clamped,
            clean.curr,
            use_cispo=cfg.use_cispo,
            dual_clip_c=cfg.ratio_clip_c,
        )
        weight = corr.is_weight if cfg.use_importance_sampling_correction else None
        pg_weighted = pg * weight if weight is not None else pg
        actor_loss = self._aggregate(
            pg_weighted, agg_mask, sample_mask, corr.seq_mask_count, seq_denominator, token_denominator, groups
        )

        # ---- KL penalty ----
        if self.kl_coef != 0:
            kl_tok = self.kl_coef * kl_penalty_per_token(
                clean.curr_unfiltered,
                clean.reference,
                clean.gen,
                kl_type=cfg.reference_policy_kl_type,
                input_clamp=cfg.kl_input_clamp_value,
                output_clamp=cfg.kl_output_clamp_value,
                on_policy_approximation=cfg.use_on_policy_kl_approximation,
            )
            kl = self._aggregate(
                kl_tok, agg_mask, sample_mask, corr.seq_mask_count, seq_denominator, token_denominator, groups
            )
            loss = actor_loss + kl
        else:
            kl, loss = None, actor_loss

        # ---- VAPO positive-example NLL ----
        nll = None
        if cfg.positive_example_nll_weight > 0 and x.rewards is not None:
            correct = (x.rewards > 0).to(dtype)  # [B]
            correct_count = corr.seq_token_count @ correct
            nll = positive_example_nll(clean.curr, loss_tokens, correct, correct_count)
            loss = loss + cfg.positive_example_nll_weight * nll

        _check_global_counts(metrics, counts, masks)
        # Metrics average over valid tokens whose inputs are all finite; without filters these
        # are exactly the tokens that reach the loss.
        usable = masks.valid * masks.inputs_finite if cfg.rejection_sampling else loss_tokens
        terms = _LossTerms(loss, kl, nll, ratios, ratios_clamped)
        self._upstream_metrics(metrics, terms, clean, usable, corr)
        _nonfinite_metrics(metrics, masks, clean.nonfinite, clean.input_names)
        metrics.stack()  # evaluated here, inside the (optionally compiled) tensor core
        return loss, metrics

    # ------------------------------------------------------------------ pieces
    def _aggregate(
        self,
        per_token: torch.Tensor,  # [B, T] finite (inputs sanitized, log-ratios clamped)
        mask: torch.Tensor,  # [B, T] valid (token-level) or token_mask (sequence-level), kept
        sample_mask: torch.Tensor,  # [B]
        seq_mask_count: torch.Tensor,  # [B] token_mask count per row, all ranks
        seq_denominator: torch.Tensor,  # global_valid_seqs (or its kept share)
        token_denominator: torch.Tensor,  # global_valid_toks (or its kept share)
        groups: SequenceGroups,
    ) -> torch.Tensor:
        """Token mean over ``global_valid_toks``, or mean over sequences of per-row means.

        Rejected tokens are zero in the numerators only; the per-row denominator is the
        row's full ``token_mask`` count (reduced over ``groups``), as NeMo-RL's.
        """
        if self.token_level_loss:
            return masked_sum(per_token, mask.to(per_token.dtype)) / (token_denominator + EPS)
        row_sum = all_reduce_sum_with_grad((per_token * mask).sum(-1), groups)  # [B]
        row_mean = row_sum / (seq_mask_count + EPS)
        loss = (row_mean * sample_mask).sum() / (seq_denominator + EPS)
        if groups.active:
            # Every rank now holds the whole value; return its share so that the shares
            # summed over the ranks (the data-parallel gradient reduction) are the loss.
            for g in groups.groups:
                loss = loss / torch.distributed.get_world_size(g)
        return loss

    def _upstream_metrics(
        self,
        metrics: MetricSet,
        terms: "_LossTerms",
        clean: "_Sanitized",
        usable: torch.Tensor,  # [B, T] valid tokens with finite inputs (that reach the loss)
        corr: CorrectionResult,
    ) -> None:
        """Every metric NeMo-RL's ``ClippedPGLossFn`` returns, same names and meanings.

        Token means are declared as masked totals over ``usable`` (one matrix-vector product
        for all of them, see :class:`MetricSet`).
        """
        cfg = self.cfg
        grad_norm = "tokens" if self.token_level_loss else "sequences"
        d = clean.d
        with torch.no_grad():
            kl, nll = terms.kl, terms.nll
            metrics.add("loss", terms.total, grad_norm, "sum")
            r, rc = terms.ratios.detach(), terms.ratios_clamped.detach()
            kl_type = cfg.reference_policy_kl_type
            per_token = {
                "probs_ratio": r,
                "probs_ratio_clamped": rc,
                "token_mult_prob_error": torch.exp(d.abs() * usable),
                "gen_kl_error": kl_estimate(d, kl_type),
                "policy_kl_error": kl_estimate(-d, kl_type),
                # NeMo-RL's per-token JS estimate with M = (P_train + P_gen) / 2,
                #   0.5 [k3(log M/P_train) + k3(log M/P_gen)],  k3(x) = exp(x) - 1 - x,
                # simplifies exactly to log cosh(d / 2) = softplus(-d) + d / 2 - log 2, which is
                # stable for any d and costs one transcendental instead of five.
                "js_divergence_error": torch.nn.functional.softplus(-d) + 0.5 * d - math.log(2.0),
                # E_gen[-(pi/pi_gen) log pi]
                "approx_entropy": -torch.exp(clean.curr - clean.gen) * clean.curr,
            }
            if self.cfg.effective_is_level == "token":
                per_token["sampling_importance_ratio"] = corr.is_weight
            metrics.add_masked_totals(list(per_token), list(per_token.values()), usable, "tokens", "sum")
            metrics.add_masked_extrema("probs_ratio_min", "probs_ratio_max", r, clean.masks.usable_penalty)
            self._clamped_extremes(metrics)
            if kl is not None:
                metrics.add("kl_penalty", kl / self.kl_coef, grad_norm, "sum")
            else:
                metrics.derive("kl_penalty", grad_norm, lambda out: 0.0)
            if self.cfg.effective_is_level != "token":
                self._sequence_sampling_importance_ratio(metrics, corr.is_weight, clean.masks.sample_mask)
            metrics.add("num_valid_samples", clean.masks.sample_mask.sum(), "none", "replicated")
            if nll is not None:
                metrics.add("positive_nll_loss", nll, "none", "sum")
            else:
                metrics.derive("positive_nll_loss", "none", lambda out: 0.0)

    def _clamped_extremes(self, metrics: MetricSet) -> None:
        """Declare ``probs_ratio_clamped_{min,max}``, derived on the host after the reduction.

        The clamp is monotonic, so the extremes of clip(r) are clip(extremes of r); the
        "no token" sentinels (+-inf) stay as they are.
        """
        cfg = self.cfg
        unclamped = cfg.force_on_policy_ratio or cfg.disable_ppo_ratio  # no clamp in these modes
        lo, hi = 1.0 - cfg.ratio_clip_min, 1.0 + cfg.ratio_clip_max

        def clip(value: float) -> float:
            return value if unclamped or not math.isfinite(value) else min(max(value, lo), hi)

        metrics.derive("probs_ratio_clamped_min", "none", lambda out: clip(out["probs_ratio_min"]))
        metrics.derive("probs_ratio_clamped_max", "none", lambda out: clip(out["probs_ratio_max"]))

    def _sequence_sampling_importance_ratio(
        self, metrics: MetricSet, is_weight: torch.Tensor, sample_mask: torch.Tensor
    ) -> None:
        """``sampling_importance_ratio`` with a per-sequence weight: its mean over sequences.

        (Per-token weights are averaged over tokens with the other token means.) In NeMo-RL's
        own GSPO mode (``is_correction_level`` unset) the value is NeMo-RL's, whose ``[B, 1]``
        weight broadcasts against the ``[B]`` sample mask: ``sum_i w_i * sum_j s_j / N_seq``
        (NeMo-RL #3753). It is reproduced for parity; ``is_weight_mean`` is the true mean.
        """
        w_seq = is_weight.squeeze(-1)  # [B]
        if self.cfg.is_correction_level is None:
            metrics.add_total("sampling_importance_ratio", w_seq.sum() * sample_mask.sum(), "sequences", "replicated")
        else:
            metrics.add_masked_total("sampling_importance_ratio", w_seq, sample_mask, "sequences", "replicated")


@dataclass
class _LossTerms:
    """The loss and the terms its metrics report."""

    total: torch.Tensor
    kl: Optional[torch.Tensor]  # None without the KL term
    nll: Optional[torch.Tensor]  # None without the NLL term
    ratios: torch.Tensor  # [B, T] policy ratio
    ratios_clamped: torch.Tensor  # [B, T] its clamp


@dataclass
class _Sanitized:
    """The inputs with NaN and +-inf replaced by 0, and where they were not finite.

    Non-finite log-probs are replaced by 0 *before* any arithmetic, so that a token that is
    masked or rejected receives an exact zero gradient, never 0 * NaN.
    """

    curr: torch.Tensor  # [B, T] differentiable
    prev: torch.Tensor  # [B, T] detached (curr's value under a forced on-policy ratio)
    prev_raw: torch.Tensor  # [B, T] as given
    gen: torch.Tensor
    reference: Optional[torch.Tensor]  # None without the KL term
    curr_unfiltered: Optional[torch.Tensor]  # the KL's curr (curr unless the caller passed one)
    advantages: torch.Tensor
    d: torch.Tensor  # [B, T] prev - gen, 0 where not finite
    masks: TokenMasks
    nonfinite: Any  # [K, B, T] (or K [B, T]) 0/1 non-finite entries of each input, rows named by
    input_names: tuple  # the K input names (keys of _NONFINITE_COUNTS)


def _sanitize_inputs(x: LossInputs, force_on_policy: bool, with_reference: bool, batched: bool) -> _Sanitized:
    """One pass over every input: sanitised copies, non-finite masks, the token masks.

    The detached inputs are stacked, so replacing and detecting non-finite entries costs two
    kernels whatever their number; ``curr`` is sanitised on its own (it carries the gradient).
    """
    curr = sanitize(x.curr)
    prev_raw = x.curr.detach() if force_on_policy else x.prev
    # The first rows are the log-prob inputs a token's loss reads (any non-finite one makes
    # the token unusable); the others are sanitised and counted only. Each row's name is the
    # metric counting its non-finite valid tokens (hidden when another metric covers it).
    rows = {"curr": x.curr, "d": prev_raw - x.generation}
    if with_reference:
        rows["reference"] = x.reference
        if x.curr_unfiltered is not None:
            rows["curr_unfiltered"] = x.curr_unfiltered
    n_logprob = len(rows)
    rows.update(prev=prev_raw, gen=x.generation, advantages=x.advantages)
    if batched:  # two kernels for all inputs (batched_evaluation: the GPU form)
        stacked = torch.stack([t.detach() for t in rows.values()])  # [K, B, T]
        clean = dict(zip(rows, sanitize(stacked)))
        bad = nonfinite(stacked)  # [K, B, T] 0/1
        any_bad = bad[:n_logprob].amax(0)
        checked = tuple(rows)
    else:  # per input, no copy into a stack, and only what is read
        # curr and curr_unfiltered are sanitised on their own (they carry the gradient); prev
        # and gen reach the loss, and its checks, through d.
        clean = {name: sanitize(t.detach()) for name, t in rows.items() if name not in ("curr", "curr_unfiltered")}
        checked = tuple(name for name in rows if name not in ("prev", "gen"))
        bad = [nonfinite(rows[name]) for name in checked]
        any_bad = functools.reduce(torch.maximum, bad[:n_logprob])
    d_finite = 1.0 - bad[1]
    inputs_finite = 1.0 - any_bad
    unfiltered = None
    if with_reference:
        unfiltered = sanitize(x.curr_unfiltered) if x.curr_unfiltered is not None else curr
    return _Sanitized(
        curr=curr,
        prev=curr.detach() if force_on_policy else clean["prev"],
        prev_raw=prev_raw,
        gen=clean["gen"],
        reference=clean.get("reference"),
        curr_unfiltered=unfiltered,
        advantages=clean["advantages"],
        d=clean["d"],
        masks=TokenMasks.build(x.token_mask, x.sample_mask, d_finite, inputs_finite),
        nonfinite=bad,
        input_names=checked,
    )


# Input row of _sanitize_inputs -> the metric counting its non-finite valid tokens ("_": hidden,
# covered by another count: prev and gen through the log-ratio).
_NONFINITE_COUNTS = {
    "curr": "nonfinite_curr_logprobs_count",
    "d": "nonfinite_log_ratio_count",
    "reference": "nonfinite_reference_logprobs_count",
    "curr_unfiltered": "_nonfinite_curr_unfiltered_count",
    "prev": "_nonfinite_prev_logprobs_count",
    "gen": "_nonfinite_generation_logprobs_count",
    "advantages": "nonfinite_advantages_count",
}


def _nonfinite_metrics(metrics: MetricSet, masks: TokenMasks, nonfinite: Any, inputs: tuple) -> None:
    """Valid tokens with a non-finite input, one count per input kind (summed over CP ranks).

    All counts are one matrix-vector product of the stacked non-finite masks. With a separate
    unfiltered ``curr`` (for the KL), ``nonfinite_curr_logprobs_count`` counts tokens where
    either is non-finite. See: docs/guide.md#non-finite-inputs
    """
    names = [_NONFINITE_COUNTS[row] for row in inputs]
    if "curr_unfiltered" in inputs:
        names[0] = "_nonfinite_curr_filtered_count"
        either = torch.maximum(nonfinite[0], nonfinite[inputs.index("curr_unfiltered")])
        metrics.add_masked_total(_NONFINITE_COUNTS["curr"], either, masks.valid_bin, "none", "sum")
    metrics.add_masked_totals(names, nonfinite, masks.valid_bin, "none", "sum")
    if "reference" not in inputs:
        metrics.derive(_NONFINITE_COUNTS["reference"], "none", lambda out: 0.0)


def _global_count(name: str, value: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A global count as a 0-dim ``dtype`` tensor on ``device``; a clear error if it is none."""
    try:
        count = torch.as_tensor(value, dtype=dtype, device=device)
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(
            f"{name}: got {type(value).__name__} {value!r}; expected a number or a 0-dim tensor "
            "(the global count NeMo-RL passes)"
        ) from None
    if count.numel() != 1:
        raise ValueError(
            f"{name}: got a tensor of shape {tuple(count.shape)}; expected one count (a number or a 0-dim tensor)"
        )
    return count.reshape(())


def _check_global_counts(metrics: MetricSet, counts: GlobalCounts, masks: TokenMasks) -> None:
    """Register the global-count checks of :meth:`CorrectedPGLoss.compute` (decided on the host).

    A count is wrong when it is negative or not finite, or 0 while this microbatch has a
    unit it counts: the loss would divide by ``0 + 1e-8``. The counts and the microbatch's
    own (summed over the ranks that split its tokens) ride on the one host transfer.
    """
    metrics.add("_global_valid_toks", counts.tokens, "none", "replicated")
    metrics.add("_global_valid_seqs", counts.sequences, "none", "replicated")
    metrics.add("_local_valid_toks", masks.valid.sum(), "none", "sum")
    metrics.add("_local_valid_seqs", masks.sample_mask.sum(), "none", "replicated")
    for name, local, unit in (
        ("global_valid_toks", "_local_valid_toks", "valid tokens (token_mask * sample_mask)"),
        ("global_valid_seqs", "_local_valid_seqs", "valid sequences (sample_mask)"),
    ):

        def failed(out: dict, name: str = name, local: str = local) -> bool:
            count = out[f"_{name}"]
            return not math.isfinite(count) or count < 0 or (count == 0 and out[local] > 0)

        def error(out: dict, name: str = name, local: str = local, unit: str = unit) -> ValueError:
            return ValueError(
                f"{name}: got {out[f'_{name}']:g} while this microbatch has "
                f"{out[local]:g} {unit}; expected the count of {unit} over the whole "
                "global batch (all microbatches and data-parallel ranks): a finite number, "
                "> 0 whenever a microbatch has one (0 only for a fully masked global batch)"
            )

        metrics.check(failed, error)


def metric_normalizations(cfg: Any) -> dict[str, str]:
    """Metric name -> global denominator (``tokens``, ``sequences``, ``none``) for a config.

    NeMo-RL's ``metric_normalizations`` counterpart, read from the declarations next to each
    metric's computation (see :meth:`CorrectedPGLoss.metric_normalizations`).
    """
    return CorrectedPGLoss(cfg).metric_normalizations()
