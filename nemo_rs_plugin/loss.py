"""``RSClippedPGLoss``: NeMo-RL's clipped PG loss with the off-policy correction layer.

This is the host-independent core: it takes NeMo-RL's data dict (or any mapping with the
same keys) and imports neither NeMo-RL nor Megatron. The NeMo-RL subclass in
:mod:`nemo_rs_plugin.nemo_rl_adapter` only forwards to it.

Loss (token-level; ``m`` valid mask, ``w`` IS weight, ``k`` rejection mask, ``N`` NeMo-RL's
``global_valid_toks``)::

    L = sum_t k_t [ w_t * pg_t + beta * kl_t ] / N  +  mu * NLL_correct

and, with ``token_level_loss: false``, the mean over sequences (``/ global_valid_seqs``) of
per-sequence token means. ``pg_t`` is the clipped objective of
:func:`~nemo_rs_plugin.policy_loss.clipped_objective`. With no plugin field set, ``k = 1``
and the result equals NeMo-RL's ``ClippedPGLossFn`` (loss, gradient, every metric).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch

from nemo_rs_plugin.compiled import core_fn
from nemo_rs_plugin.config import RSClippedPGLossConfig
from nemo_rs_plugin.correction import PolicyLogProbs, compute_correction
from nemo_rs_plugin.distributed import NO_GROUPS, SequenceGroups, all_reduce_sum_with_grad
from nemo_rs_plugin.masking import EPS, log_ratio, masked_extrema, masked_sum, nonfinite, sanitize
from nemo_rs_plugin.metrics import MetricSet
from nemo_rs_plugin.policy_loss import (
    clipped_objective,
    kl_estimate,
    kl_penalty_per_token,
    policy_ratios,
    positive_example_nll,
)

__all__ = ["RSClippedPGLoss", "LossInputs", "metric_normalizations"]

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
        dtype = torch.float32
        for t in (
            self.curr,
            self.prev,
            self.generation,
            self.reference,
            self.advantages,
            self.token_mask,
            self.curr_unfiltered,
        ):
            if t is not None and t.is_floating_point():
                dtype = torch.promote_types(dtype, t.dtype)
        return dtype

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


class RSClippedPGLoss:
    """Clipped policy-gradient loss with decoupled IS level and composable rejection sampling.

    Args:
        cfg: anything :meth:`RSClippedPGLossConfig.from_any` accepts; validated here, once.
    """

    def __init__(self, cfg: Any = None):
        self.cfg = RSClippedPGLossConfig.from_any(cfg if cfg is not None else {})
        c = self.cfg
        self.token_level_loss = c.token_level_loss
        # use_kl_in_reward moves the KL into the reward: the loss has no KL term then.
        self.kl_coef = 0.0 if c.use_kl_in_reward else c.reference_policy_kl_penalty
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

        Every metric is declared once, where it is computed (``MetricSet.add(name, value,
        normalization, reduction)``); this reads the declarations off one run of the tensor
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
        # The tensor math (optionally torch.compile'd, see nemo_rs_plugin/compiled.py) never
        # leaves the device; the one host transfer stays here, eager.
        loss, metrics = core_fn(self, groups)(self, x, global_valid_seqs, global_valid_toks, groups)
        return loss, metrics.finalize(groups)

    def _tensors(
        self, x: LossInputs, global_valid_seqs: Any, global_valid_toks: Any, groups: SequenceGroups
    ) -> tuple[torch.Tensor, MetricSet]:
        """The pure-tensor part of :meth:`compute`: the loss and the unreduced metric tensors."""
        x = x.to_dtype(x.compute_dtype())
        c = self.cfg
        curr_raw = x.curr
        dtype = curr_raw.dtype
        device = curr_raw.device
        gvs = _global_count("global_valid_seqs", global_valid_seqs, dtype, device)
        gvt = _global_count("global_valid_toks", global_valid_toks, dtype, device)

        token_mask = x.token_mask  # integer, bool or float (already in `dtype`)
        sample_mask = x.sample_mask.to(dtype)
        valid = token_mask * sample_mask.unsqueeze(-1)  # [B, T]

        # Non-finite log-probs are replaced by 0 *before* any arithmetic, so that a token
        # that is masked or rejected receives an exact zero gradient, never 0 * NaN.
        curr = sanitize(curr_raw)
        prev_raw = curr_raw.detach() if c.force_on_policy_ratio else x.prev
        prev = curr.detach() if c.force_on_policy_ratio else sanitize(prev_raw)
        gen = sanitize(x.generation)
        _, d, d_finite = log_ratio(prev_raw, x.generation)  # [B, T] each
        # 0/1 masks of non-finite entries per input kind, counted in the metrics.
        bad_curr = nonfinite(curr_raw)  # [B, T]
        bad_ref = None
        bad_any = bad_curr + (1.0 - d_finite)
        ref = curr_unfiltered = None
        if self.kl_coef != 0:
            ref = sanitize(x.reference)
            bad_ref = nonfinite(x.reference)
            bad_any = bad_any + bad_ref
            if x.curr_unfiltered is not None:
                curr_unfiltered = sanitize(x.curr_unfiltered)
                bad_unfiltered = nonfinite(x.curr_unfiltered)
                bad_curr = torch.maximum(bad_curr, bad_unfiltered)
                bad_any = bad_any + bad_unfiltered
            else:
                curr_unfiltered = curr
        inputs_finite = 1.0 - torch.sign(bad_any)  # [B, T] 0/1: every log-prob input finite
        advantages = sanitize(x.advantages)  # a non-finite advantage: no policy-gradient term

        corr = compute_correction(
            d,
            d_finite,
            valid,
            token_mask,
            sample_mask,
            inputs_finite,
            c,
            gvs,
            gvt,
            groups,
            log_probs=PolicyLogProbs(curr=curr_raw.detach(), prev=prev_raw.detach(), gen=x.generation),
            advantages=advantages,
        )
        keep = corr.keep  # [B, T]
        loss_tokens = corr.loss_tokens  # [B, T] tokens that contribute to the loss
        # NeMo-RL's sequence-level aggregation averages each row over token_mask.
        agg_mask = loss_tokens if self.token_level_loss else token_mask * keep
        gvt_loss, gvs_loss = gvt, gvs
        if c.rejection_denominator == "kept":
            # VERL's decoupled semantics: shrink the global denominators by the kept fraction
            # of this microbatch (over all ranks that split its sequences).
            n_valid = corr.seq_token_count.sum()
            n_seqs = (sample_mask * (corr.seq_token_count > 0).to(dtype)).sum()
            gvt_loss = gvt * corr.kept_token_count / n_valid.clamp_min(EPS)
            gvs_loss = gvs * corr.kept_seq_count / n_seqs.clamp_min(EPS)

        # ---- policy-gradient term ----
        # Tokens with a non-finite input take no part in the GSPO sequence ratio either.
        ratio_mask = corr.ratio_mask if c.sequence_level_importance_ratios else token_mask
        ratios, ratios_clamped = policy_ratios(
            curr,
            prev,
            ratio_mask,
            force_on_policy=c.force_on_policy_ratio,
            disable_ppo_ratio=c.disable_ppo_ratio,
            sequence_level=c.sequence_level_importance_ratios,
            clip_min=c.ratio_clip_min,
            clip_max=c.ratio_clip_max,
            groups=groups,
            row_count=corr.ratio_token_count,
        )
        pg = clipped_objective(
            advantages,
            ratios,
            ratios_clamped,
            curr,
            use_cispo=c.use_cispo,
            dual_clip_c=c.ratio_clip_c,
        )
        weight = corr.is_weight if c.use_importance_sampling_correction else None
        pg_weighted = pg * weight if weight is not None else pg
        actor_loss = self._aggregate(
            pg_weighted, agg_mask, sample_mask, corr.seq_mask_count, gvs_loss, gvt_loss, groups
        )

        # ---- KL penalty ----
        if self.kl_coef != 0:
            kl_tok = self.kl_coef * kl_penalty_per_token(
                curr_unfiltered,
                ref,
                gen,
                kl_type=c.reference_policy_kl_type,
                input_clamp=c.kl_input_clamp_value,
                output_clamp=c.kl_output_clamp_value,
                on_policy_approximation=c.use_on_policy_kl_approximation,
            )
            kl = self._aggregate(kl_tok, agg_mask, sample_mask, corr.seq_mask_count, gvs_loss, gvt_loss, groups)
        else:
            kl = torch.zeros((), dtype=dtype, device=device)

        # ---- VAPO positive-example NLL ----
        nll = torch.zeros((), dtype=dtype, device=device)
        if c.positive_example_nll_weight > 0 and x.rewards is not None:
            correct = (x.rewards > 0).to(dtype)  # [B]
            correct_count = (corr.seq_token_count * correct).sum()
            nll = positive_example_nll(curr, loss_tokens, correct, correct_count)

        loss = actor_loss + kl + c.positive_example_nll_weight * nll

        metrics = MetricSet()
        _check_global_counts(metrics, gvs, gvt, valid, sample_mask)
        # Metrics average over valid tokens whose inputs are all finite; without filters these
        # are exactly the tokens that reach the loss.
        usable = valid * inputs_finite if c.rejection_sampling else loss_tokens
        self._upstream_metrics(
            metrics, loss, kl, nll, ratios, ratios_clamped, curr, gen, d, usable, sample_mask, corr, gvs, gvt
        )
        metrics.update(corr.metrics)
        self._nonfinite_metrics(metrics, valid, bad_curr, bad_ref, x.advantages)
        return loss, metrics

    # ------------------------------------------------------------------ pieces
    def _aggregate(
        self,
        per_token: torch.Tensor,  # [B, T] finite (inputs sanitized, log-ratios clamped)
        mask: torch.Tensor,  # [B, T] valid (token-level) or token_mask (sequence-level), kept
        sample_mask: torch.Tensor,  # [B]
        seq_mask_count: torch.Tensor,  # [B] token_mask count per row, all ranks
        gvs: torch.Tensor,
        gvt: torch.Tensor,
        groups: SequenceGroups,
    ) -> torch.Tensor:
        """Token mean over ``global_valid_toks``, or mean over sequences of per-row means.

        Rejected tokens are zero in the numerators only; the per-row denominator is the
        row's full ``token_mask`` count (reduced over ``groups``), as NeMo-RL's.
        """
        if self.token_level_loss:
            return masked_sum(per_token, mask.to(per_token.dtype)) / (gvt + EPS)
        row_sum = all_reduce_sum_with_grad((per_token * mask).sum(-1), groups)  # [B]
        row_mean = row_sum / (seq_mask_count + EPS)
        loss = (row_mean * sample_mask).sum() / (gvs + EPS)
        if groups.active:
            # Every rank now holds the whole value; return its share so that the shares
            # summed over the ranks (the data-parallel gradient reduction) are the loss.
            for g in groups.groups:
                loss = loss / torch.distributed.get_world_size(g)
        return loss

    def _upstream_metrics(
        self,
        metrics: MetricSet,
        loss: torch.Tensor,
        kl: torch.Tensor,
        nll: torch.Tensor,
        ratios: torch.Tensor,
        ratios_clamped: torch.Tensor,
        curr: torch.Tensor,
        gen: torch.Tensor,
        d: torch.Tensor,
        mask: torch.Tensor,  # [B, T] valid tokens with finite inputs
        sample_mask: torch.Tensor,
        corr: Any,
        gvs: torch.Tensor,
        gvt: torch.Tensor,
    ) -> None:
        """Every metric NeMo-RL's ``ClippedPGLossFn`` returns, same names and meanings."""
        c = self.cfg
        grad_norm = "tokens" if self.token_level_loss else "sequences"

        def token_mean(v: torch.Tensor) -> torch.Tensor:
            return masked_sum(v, mask) / (gvt + EPS)

        with torch.no_grad():
            metrics.add("loss", loss, grad_norm, "sum")
            r, rc = ratios.detach(), ratios_clamped.detach()
            metrics.add("probs_ratio", token_mean(r), "tokens", "sum")
            metrics.add("probs_ratio_clamped", token_mean(rc), "tokens", "sum")
            r_min, r_max = masked_extrema(r, corr.usable_bin, corr.usable_penalty)
            metrics.add("probs_ratio_min", r_min, "none", "min")
            metrics.add("probs_ratio_max", r_max, "none", "max")
            # The clamp is monotonic, so the extremes of clip(r) are clip(extremes of r);
            # the empty-mask sentinels (+-inf) stay as they are.
            rc_min, rc_max = self._clamped_extremes(r_min, r_max)
            metrics.add("probs_ratio_clamped_min", rc_min, "none", "min")
            metrics.add("probs_ratio_clamped_max", rc_max, "none", "max")
            kl_metric = kl / self.kl_coef if self.kl_coef != 0 else torch.zeros_like(kl)
            metrics.add("kl_penalty", kl_metric, grad_norm, "sum")
            metrics.add("token_mult_prob_error", token_mean(torch.exp(d.abs() * mask)), "tokens", "sum")
            kl_type = c.reference_policy_kl_type
            metrics.add("gen_kl_error", token_mean(kl_estimate(d, kl_type)), "tokens", "sum")
            metrics.add("policy_kl_error", token_mean(kl_estimate(-d, kl_type)), "tokens", "sum")
            # NeMo-RL's per-token JS estimate with M = (P_train + P_gen) / 2,
            #   0.5 [k3(log M/P_train) + k3(log M/P_gen)],  k3(x) = exp(x) - 1 - x,
            # simplifies exactly to log cosh(d / 2) = softplus(-d) + d / 2 - log 2, which is
            # stable for any d and costs one transcendental instead of five.
            js = torch.nn.functional.softplus(-d) + 0.5 * d - math.log(2.0)
            metrics.add("js_divergence_error", token_mean(js), "tokens", "sum")
            self._sampling_importance_ratio(metrics, corr, mask, sample_mask, gvs, gvt)
            metrics.add("num_valid_samples", sample_mask.sum(), "none", "replicated")
            entropy = -token_mean(torch.exp(curr - gen) * curr)  # E_gen[-(pi/pi_gen) log pi]
            metrics.add("approx_entropy", entropy, "tokens", "sum")
            metrics.add("positive_nll_loss", nll, "none", "sum")

    @staticmethod
    def _nonfinite_metrics(
        metrics: MetricSet,
        valid: torch.Tensor,  # [B, T]
        bad_curr: torch.Tensor,  # [B, T] 0/1
        bad_ref: Optional[torch.Tensor],  # [B, T] 0/1, None when the KL term is off
        advantages: torch.Tensor,  # [B, T] raw
    ) -> None:
        """Valid tokens with a non-finite input, one count per input kind.

        ``nonfinite_log_ratio_count`` (``prev - gen``) comes from the correction layer.
        See: docs/guide.md#non-finite-inputs
        """
        valid_bin = torch.sign(valid)
        zero = valid_bin.new_zeros(())
        metrics.add("nonfinite_curr_logprobs_count", masked_sum(valid_bin, bad_curr), "none", "sum")
        ref_count = masked_sum(valid_bin, bad_ref) if bad_ref is not None else zero
        metrics.add("nonfinite_reference_logprobs_count", ref_count, "none", "sum")
        metrics.add("nonfinite_advantages_count", masked_sum(valid_bin, nonfinite(advantages)), "none", "sum")

    def _clamped_extremes(self, r_min: torch.Tensor, r_max: torch.Tensor):
        c = self.cfg
        if c.force_on_policy_ratio or c.disable_ppo_ratio:
            return r_min, r_max  # no clamp in these modes
        lo, hi = 1.0 - c.ratio_clip_min, 1.0 + c.ratio_clip_max
        half = torch.finfo(r_min.dtype).max / 2  # "no token" sentinels stay sentinels
        return (
            torch.where(r_min >= half, r_min, r_min.clamp(lo, hi)),
            torch.where(r_max <= -half, r_max, r_max.clamp(lo, hi)),
        )

    def _sampling_importance_ratio(self, metrics, corr, mask, sample_mask, gvs, gvt) -> None:
        """``sampling_importance_ratio``: mean IS weight after truncation.

        Per token when the weight is per token, per sequence otherwise. In NeMo-RL's own
        GSPO mode (``is_correction_level`` unset) the value is NeMo-RL's, whose ``[B, 1]``
        weight broadcasts against the ``[B]`` sample mask: ``sum_i w_i * sum_j s_j / N_seq``
        (NeMo-RL #3753). It is reproduced for parity; ``is_weight_mean`` is the true mean.
        """
        w = corr.is_weight
        if self.cfg.effective_is_level == "token":
            value = masked_sum(w, mask) / (gvt + EPS)
            metrics.add("sampling_importance_ratio", value, "tokens", "sum")
            return
        w_seq = w.squeeze(-1)  # [B]
        if self.cfg.is_correction_level is None:
            value = w_seq.sum() * sample_mask.sum() / (gvs + EPS)
        else:
            value = (w_seq * sample_mask).sum() / (gvs + EPS)
        metrics.add("sampling_importance_ratio", value, "sequences", "replicated")


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


def _check_global_counts(
    metrics: MetricSet,
    gvs: torch.Tensor,
    gvt: torch.Tensor,
    valid: torch.Tensor,  # [B, T] token_mask * sample_mask
    sample_mask: torch.Tensor,  # [B]
) -> None:
    """Register the global-count checks of :meth:`RSClippedPGLoss.compute` (no host sync).

    A count is wrong when it is negative or not finite, or 0 while this microbatch has a
    unit it counts: the loss would divide by ``0 + 1e-8``.
    """
    for name, count, local, reduction, unit in (
        ("global_valid_toks", gvt, valid.sum(), "sum", "valid tokens (token_mask * sample_mask)"),
        ("global_valid_seqs", gvs, sample_mask.sum(), "replicated", "valid sequences (sample_mask)"),
    ):
        bad = (count < 0) | ~torch.isfinite(count) | ((count == 0) & (local > 0))
        metrics.add(f"_{name}", count, "none", "replicated")
        # Tokens are split over the group's ranks (summed); sample_mask is replicated.
        metrics.add(f"_local_{name}", local, "none", reduction)

        def error(out: dict, name: str = name, unit: str = unit) -> ValueError:
            return ValueError(
                f"{name}: got {out[f'_{name}']:g} while this microbatch has "
                f"{out[f'_local_{name}']:g} {unit}; expected the count of {unit} over the whole "
                "global batch (all microbatches and data-parallel ranks): a finite number, "
                "> 0 whenever a microbatch has one (0 only for a fully masked global batch)"
            )

        metrics.check(f"_bad_{name}", bad.to(count.dtype), error)


def metric_normalizations(cfg: Any) -> dict[str, str]:
    """Metric name -> global denominator (``tokens``, ``sequences``, ``none``) for a config.

    NeMo-RL's ``metric_normalizations`` counterpart, read from the declarations next to each
    metric's computation (see :meth:`RSClippedPGLoss.metric_normalizations`).
    """
    return RSClippedPGLoss(cfg).metric_normalizations()
