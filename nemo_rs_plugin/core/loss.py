"""``CorrectedPGLoss``: NeMo-RL's clipped PG loss with the off-policy correction layer.

This is the host-independent core: it takes NeMo-RL's data dict (or any mapping with the
same keys) and imports neither NeMo-RL nor Megatron. The NeMo-RL subclass in
:mod:`nemo_rs_plugin.nemo_rl.loss_fn` only forwards to it.

Loss (token-level; ``m`` valid mask, ``w`` IS weight, ``k`` rejection mask, ``N`` NeMo-RL's
``global_valid_toks``)::

    L = sum_t k_t [ g_t * w_t * pg_t + beta * kl_t + tau * (curr_t - gen_t)^2 ] / N  +  mu * NLL_correct

(``g`` the mask of the filters with ``applies_to: policy_gradient``, ``tau``
``sampler_kl_penalty``)
and, with ``token_level_loss: false``, the mean over sequences (``/ global_valid_seqs``) of
per-sequence token means. ``pg_t`` is the clipped objective of
:func:`~nemo_rs_plugin.core.policy_loss.clipped_objective`. With no plugin field set, ``k = 1``
and the result equals NeMo-RL's ``ClippedPGLossFn`` (loss, gradient, every metric).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from functools import partial
from typing import Any, Mapping, Optional

import torch

from nemo_rs_plugin.core.compiled import core_fn, free_host_reads, metrics_form
from nemo_rs_plugin.core.config import ConfigWarning, RSClippedPGLossConfig
from nemo_rs_plugin.core.correction import (
    CorrectionResult,
    PolicyLogProbs,
    SequenceCounts,
    apply_correction,
    plan_correction,
)
from nemo_rs_plugin.core.correction.filters import sequence_counts
from nemo_rs_plugin.core.distributed import NO_GROUPS, SequenceGroups, all_reduce_sum_with_grad
from nemo_rs_plugin.core.health import RejectionMonitor
from nemo_rs_plugin.core.input_checks import check_global_counts, check_logprob_signs
from nemo_rs_plugin.core.inputs import (
    LossInputs,
    SanitizedInputs,
    global_counts,
    nonfinite_metrics,
    sanitize_inputs,
)
from nemo_rs_plugin.core.masking import EPS, TokenMasks, masked_sum
from nemo_rs_plugin.core.metric_catalog import metric_specs
from nemo_rs_plugin.core.metrics import GlobalCounts, MetricSet, Normalization, batched_evaluation
from nemo_rs_plugin.core.microbatch import MicrobatchTotals, missing_totals
from nemo_rs_plugin.core.policy_loss import (
    KLOptions,
    RatioOptions,
    clipped_objective,
    kl_estimate,
    kl_penalty_per_token,
    policy_ratios,
    positive_example_nll,
)

#: The warning of a section that asks :class:`CorrectedPGLoss` itself to record (it never does).
RECORDS_NOTHING = (
    "record_logprobs: got true, but CorrectedPGLoss records nothing (nor reads record_dir, record_every): "
    "recording is done by NeMo-RL's loss (loss_fn.name: rs_clipped_pg in a recipe). Outside NeMo-RL, record "
    "with nemo_rs_plugin.nemo_rl.recording.LogprobRecorder(record_dir, every).observe(global_valid_toks, data) "
    "before each call (docs/cli.md#recording-outside-nemo-rl), or remove record_logprobs"
)

# LossInputs is defined in core.inputs and re-exported: callers import it from here.
__all__ = ["CorrectedPGLoss", "LossInputs", "metric_normalizations"]


class CorrectedPGLoss:
    """Clipped policy-gradient loss with decoupled IS level and composable rejection sampling.

    The host-independent core: plain torch in, ``(loss, metrics)`` out. NeMo-RL never sees
    this class; it builds :class:`~nemo_rs_plugin.nemo_rl.loss_fn.RSClippedPGLossFn` (the
    ``ClippedPGLossFn`` subclass registered as ``rs_clipped_pg``), which forwards here.

    Args:
        cfg: anything :meth:`RSClippedPGLossConfig.from_any` accepts; validated here, once.
        batched_metrics: evaluate the metrics stacked (``True``, the accelerator form) or row
            by row (``False``, the CPU form); ``None`` picks by device, and a compiled core row
            by row (:func:`~nemo_rs_plugin.core.compiled.metrics_form`).
        compile_backend: the ``torch.compile`` backend when ``cfg.compile`` is on
            (``aot_eager`` traces the same graph without generating kernels, for debugging).
        per_call_metrics: return the metrics that hold for this call alone (extremes, the ESS,
            the batch-normalisation factor; :mod:`nemo_rs_plugin.core.metrics`). The NeMo-RL
            loss turns them off: NeMo-RL sums every metric over calls, microbatches and ranks.

    This class records nothing: ``record_logprobs`` is read by the host that records (NeMo-RL's
    loss, with :class:`~nemo_rs_plugin.nemo_rl.recording.LogprobRecorder`), which hands over the
    validated :class:`RSClippedPGLossConfig`. A section given as a dict (a mapping, an object)
    that sets ``record_logprobs: true`` gets a :class:`ConfigWarning` saying so, and how to record
    outside NeMo-RL (docs/cli.md#recording-outside-nemo-rl).
    """

    def __init__(
        self,
        cfg: Any = None,
        *,
        batched_metrics: Optional[bool] = None,
        compile_backend: str = "inductor",
        per_call_metrics: bool = True,
    ):
        self.cfg = RSClippedPGLossConfig.from_any(cfg if cfg is not None else {})
        if self.cfg.record_logprobs and not isinstance(cfg, RSClippedPGLossConfig):
            warnings.warn(RECORDS_NOTHING, ConfigWarning, stacklevel=2)
        self.batched_metrics, self.compile_backend = batched_metrics, compile_backend
        self.per_call_metrics = per_call_metrics
        cfg = self.cfg
        self.token_level_loss = cfg.token_level_loss
        # use_kl_in_reward moves the KL into the reward: the loss has no KL term then.
        self.kl_coef = 0.0 if cfg.use_kl_in_reward else cfg.reference_policy_kl_penalty
        self.ratio_options = RatioOptions(
            force_on_policy=cfg.force_on_policy_ratio,
            disable_ppo_ratio=cfg.disable_ppo_ratio,
            sequence_level=cfg.sequence_level_importance_ratios,
            clip_min=cfg.ratio_clip_min,
            clip_max=cfg.ratio_clip_max,
        )
        self.kl_options = KLOptions(
            kl_type=cfg.reference_policy_kl_type,
            input_clamp=cfg.kl_input_clamp_value,
            output_clamp=cfg.kl_output_clamp_value,
            on_policy_approximation=cfg.use_on_policy_kl_approximation,
        )
        # Every metric this configuration returns, read off the catalog (no run): what the metric
        # set checks each declaration against, and what metric_normalizations() reports.
        self.metric_specs = metric_specs(cfg)
        # Warns (rate-limited, from the metrics already on the host) when filters eat the batch.
        self.rejection_monitor = RejectionMonitor() if cfg.rejection_sampling else None

    # ------------------------------------------------------------------ public API
    def __call__(
        self,
        next_token_logprobs: torch.Tensor,
        data: Mapping[str, Any],
        global_valid_seqs: torch.Tensor,
        global_valid_toks: torch.Tensor,
        groups: SequenceGroups = NO_GROUPS,
        microbatch: Optional[MicrobatchTotals] = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Loss and metrics from NeMo-RL's data dict (``[B, S]`` tensors, logprobs ``[B, S-1]``).

        ``groups`` and ``microbatch`` as in :meth:`compute`.
        """
        inputs = self.inputs_from_nemo_rl(next_token_logprobs, data)
        return self.compute(inputs, global_valid_seqs, global_valid_toks, groups, microbatch)

    def inputs_from_nemo_rl(self, next_token_logprobs: torch.Tensor, data: Mapping[str, Any]) -> LossInputs:
        """The :class:`LossInputs` this configuration reads from NeMo-RL's data dict (views, no copy)."""
        return LossInputs.from_nemo_rl(
            next_token_logprobs,
            data,
            need_prev=not self.cfg.force_on_policy_ratio,
            need_reference=self.kl_coef != 0,
        )

    def loss_dtype(self, next_token_logprobs: torch.Tensor, data: Mapping[str, Any]) -> torch.dtype:
        """The dtype of the loss :meth:`__call__` returns for these inputs (``LossInputs.compute_dtype``)."""
        return self.inputs_from_nemo_rl(next_token_logprobs, data).compute_dtype()

    def metric_normalizations(self) -> dict[str, str]:
        """Metric name -> ``tokens`` / ``sequences`` / ``none``, from the metric catalog.

        :func:`~nemo_rs_plugin.core.metric_catalog.metric_specs` of the configuration: which
        metrics exist depends on the config only, and every metric the loss declares is checked
        against its entry where it is declared (``MetricSet``). The per-call metrics are in it
        only where this loss returns them (``per_call_metrics``).
        """
        return {k: s.normalization for k, s in self.metric_specs.items() if self.per_call_metrics or not s.per_call}

    def per_call_metric_names(self) -> list[str]:
        """The metrics of this configuration that hold for one call alone (see ``per_call_metrics``)."""
        return [k for k, s in self.metric_specs.items() if s.per_call]

    def compute(
        self,
        x: LossInputs,
        global_valid_seqs: Any,
        global_valid_toks: Any,
        groups: SequenceGroups = NO_GROUPS,
        microbatch: Optional[MicrobatchTotals] = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Loss and metrics from aligned inputs; ``groups`` split the sequences' tokens.

        ``microbatch``: totals over the whole microbatch when ``x`` is a part of it (NeMo-RL's
        per-sequence packing wrapper), from :meth:`microbatch_totals`; ``None``: ``x`` is the
        whole microbatch.

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
        if microbatch is not None:
            missing = missing_totals(self.cfg, microbatch)
            if missing:
                raise ValueError(
                    f"microbatch: {', '.join(missing)} is None, and this configuration reads it; pass "
                    "CorrectedPGLoss.microbatch_totals(...) of the whole microbatch"
                )
        # The tensor math (optionally torch.compile'd, see nemo_rs_plugin/core/compiled.py) never
        # leaves the device; the one host transfer stays here, eager.
        # The evaluation form is decided here, eagerly: a compiled core specialises on the bool.
        core = core_fn(self, groups)
        if core is not type(self)._tensors:
            # Counts given as Python numbers become tensors here: the compiled core specialises
            # Python floats (compiled.py), and a count that changes every step would recompile.
            as_tensors = global_counts(global_valid_seqs, global_valid_toks, x.compute_dtype(), x.curr.device)
            global_valid_seqs, global_valid_toks = as_tensors.sequences, as_tensors.tokens
        batched = metrics_form(self, core, x.curr.device)
        host_reads = free_host_reads(self, core, x.curr.device, groups, batched)
        loss, metrics = core(self, x, global_valid_seqs, global_valid_toks, groups, batched, host_reads, microbatch)
        reported = metrics.finalize(groups)
        if self.rejection_monitor is not None:
            counts = sequence_counts(metrics.private)  # None where no filter ran
            if counts is not None:
                self.rejection_monitor.observe(*counts)
        return loss, reported

    def _tensors(
        self,
        x: LossInputs,
        global_valid_seqs: Any,
        global_valid_toks: Any,
        groups: SequenceGroups,
        batched: bool = False,
        host_reads: bool = False,
        microbatch: Optional[MicrobatchTotals] = None,
    ) -> tuple[torch.Tensor, MetricSet]:
        """The pure-tensor part of :meth:`compute`: the loss and the stacked, unreduced metrics."""
        x = x.to_dtype(x.compute_dtype())
        cfg = self.cfg
        counts = global_counts(global_valid_seqs, global_valid_toks, x.curr.dtype, x.curr.device)
        metrics = MetricSet(
            None, batched, host_reads, compute_per_call=self.per_call_metrics, catalog=self.metric_specs
        )
        # Set, not passed: a compiled core rebuilds the objects it returns from their constructor's
        # arguments, and the counts (views of the caller's tensors, dropped by stack()) would then
        # be graph outputs, rebuilt as aliases of its inputs on every call.
        metrics.counts = counts
        clean = sanitize_inputs(x, cfg.force_on_policy_ratio, self.kl_coef != 0, batched, host_reads)
        masks = clean.masks
        nonfinite_metrics(metrics, masks, clean.nonfinite, clean.input_names)
        clean.nonfinite = None  # counted: the [B, T] masks need not live on (the CPU form reduced them)

        # ---- the off-policy correction: plan (local) -> reduce (one collective) -> apply ----
        plan = plan_correction(
            cfg,
            clean.d,
            masks,
            log_probs=PolicyLogProbs(curr=x.curr.detach(), prev=clean.prev_raw.detach(), gen=x.generation),
            advantages=clean.advantages,
        )
        stats = plan.reduce(groups)
        corr = apply_correction(
            cfg,
            plan,
            stats,
            metrics,
            groups,
            batch_norm_factor=None if microbatch is None else microbatch.batch_norm_factor,
        )
        totals = microbatch if microbatch is not None else self._totals_of(corr, masks, x.rewards)

        terms = self._loss_terms(clean, corr, self._aggregation(counts, corr, masks, groups, totals), x.rewards, totals)
        check_global_counts(metrics, counts, masks)
        check_logprob_signs(metrics, clean, cfg.force_on_policy_ratio)
        # Metrics average over valid tokens whose inputs are all finite; without filters these
        # are exactly the tokens that reach the loss.
        loss_tokens = corr.loss_tokens
        usable = masks.where_inputs_finite(masks.valid) if cfg.rejection_sampling else loss_tokens
        self._upstream_metrics(metrics, terms, clean, usable, corr)
        metrics.stack()  # evaluated here, inside the (optionally compiled) tensor core
        return terms.total, metrics

    # ------------------------------------------------------------------ pieces
    def microbatch_totals(self, x: LossInputs, groups: SequenceGroups = NO_GROUPS) -> MicrobatchTotals:
        """The totals over the whole microbatch ``x`` that a call on one of its sequences needs.

        :mod:`nemo_rs_plugin.core.microbatch` says which and why. Computed from the inputs that
        exist before the forward pass (``x.curr`` is not read unless the configuration reads the
        current policy in a total: :func:`~nemo_rs_plugin.core.microbatch.current_policy_problems`);
        ``groups`` as in :meth:`compute` for ``x`` (``data_parallel`` for the batch
        normalisation's SUM, issued here once per microbatch instead of once per call).
        """
        with torch.no_grad():
            x = x.to_dtype(x.compute_dtype())
            cfg = self.cfg
            batched = batched_evaluation(x.curr.device)  # the device's form; its metrics are dropped
            clean = sanitize_inputs(x, cfg.force_on_policy_ratio, x.reference is not None, batched)
            plan = plan_correction(
                cfg,
                clean.d,
                clean.masks,
                log_probs=PolicyLogProbs(curr=x.curr, prev=clean.prev_raw, gen=x.generation),
                advantages=clean.advantages,
            )
            corr = apply_correction(cfg, plan, plan.reduce(groups), MetricSet(None, batched), groups)
            return self._totals_of(corr, clean.masks, x.rewards)

    def _totals_of(
        self, corr: CorrectionResult, masks: TokenMasks, rewards: Optional[torch.Tensor]
    ) -> MicrobatchTotals:
        """This call's own microbatch totals (only those the configuration reads; see :class:`MicrobatchTotals`)."""
        cfg = self.cfg
        kept_tokens = kept_seqs = correct_count = None
        if cfg.rejection_denominator == "kept":
            seqs = _sequence_counts(corr)
            n_valid = seqs.token_count.sum()
            n_seqs = masks.sample_mask @ torch.sign(seqs.token_count)
            kept_tokens = seqs.kept_tokens / n_valid.clamp_min(EPS)
            kept_seqs = seqs.kept_sequences / n_seqs.clamp_min(EPS)
        if cfg.positive_example_nll_weight > 0 and rewards is not None:
            token_count = _sequence_counts(corr).token_count
            correct_count = token_count @ (rewards > 0).to(token_count.dtype)
        return MicrobatchTotals(kept_tokens, kept_seqs, corr.batch_norm_factor, correct_count)

    def _aggregation(
        self,
        counts: GlobalCounts,
        corr: CorrectionResult,
        masks: TokenMasks,
        groups: SequenceGroups,
        totals: MicrobatchTotals,
    ) -> "_Aggregation":
        """The mask and the denominators every loss term is averaged with."""
        keep = corr.keep  # [B, T]
        loss_tokens = corr.loss_tokens  # [B, T] tokens that contribute to the loss
        token_mask, sample_mask = masks.token_mask, masks.sample_mask
        # NeMo-RL's sequence-level aggregation averages each row over token_mask.
        agg_mask = loss_tokens if self.token_level_loss else token_mask * keep
        token_denominator, seq_denominator = counts.tokens, counts.sequences
        kept_tokens, kept_seqs = totals.kept_token_fraction, totals.kept_sequence_fraction
        if kept_tokens is not None and kept_seqs is not None:  # set exactly with rejection_denominator: kept
            # VERL's decoupled semantics: shrink the global denominators by the kept fraction
            # of this microbatch (over all ranks that split its sequences).
            token_denominator = counts.tokens * kept_tokens
            seq_denominator = counts.sequences * kept_seqs
        return _Aggregation(
            mask=agg_mask,
            sample_mask=sample_mask,
            seq_mask_count=None if self.token_level_loss else _sequence_counts(corr).mask_count,
            seq_denominator=seq_denominator,
            token_denominator=token_denominator,
            groups=groups,
        )

    def _loss_terms(
        self,
        clean: SanitizedInputs,
        corr: CorrectionResult,
        agg: "_Aggregation",
        rewards: Optional[torch.Tensor],
        totals: MicrobatchTotals,
    ) -> "_LossTerms":
        """The policy-gradient term (IS-weighted), the KL penalty and the VAPO NLL, and their sum."""
        cfg = self.cfg
        # ---- policy-gradient term ----
        # Tokens with a non-finite input take no part in the GSPO sequence ratio either.
        ratio = corr.ratio  # the GSPO ratio's tokens, set exactly with sequence_level_importance_ratios
        ratio_mask = ratio.mask if ratio is not None else clean.masks.token_mask
        ratios, ratios_clamped = policy_ratios(
            clean.curr,
            clean.prev,
            ratio_mask,
            self.ratio_options,
            groups=agg.groups,
            row_count=ratio.count if ratio is not None else None,
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
        if corr.policy_gradient_keep is not None:  # filters that remove the policy-gradient term only
            pg_weighted = pg_weighted * corr.policy_gradient_keep
        loss = self._aggregate(pg_weighted, agg)

        # ---- penalty toward the sampler (prime-rl's kl_tau term): tau * (curr - gen)^2 ----
        sampler_kl = None
        if cfg.sampler_kl_penalty > 0:
            # Masked before squaring: a masked position may hold any finite log-prob, and a huge
            # one squared is inf, which the mask's 0 would turn into NaN.
            diff = torch.where(agg.mask > 0, clean.curr - clean.gen, 0.0)
            sampler_kl = self._aggregate(diff.square(), agg)
            loss = loss + cfg.sampler_kl_penalty * sampler_kl

        # ---- KL penalty ----
        kl = None
        if clean.kl is not None:  # sanitised exactly when the KL term is on (kl_coef != 0)
            kl_tok = self.kl_coef * kl_penalty_per_token(
                clean.kl.curr_unfiltered, clean.kl.reference, clean.gen, self.kl_options
            )
            kl = self._aggregate(kl_tok, agg)
            loss = loss + kl

        # ---- VAPO positive-example NLL ----
        nll = None
        correct_count = totals.correct_token_count  # set exactly when the NLL term is on and rewards given
        if cfg.positive_example_nll_weight > 0 and rewards is not None and correct_count is not None:
            correct = (rewards > 0).to(clean.curr.dtype)  # [B]
            # valid tokens of correct samples in the whole microbatch (also when this call holds one sequence)
            nll = positive_example_nll(clean.curr, corr.loss_tokens, correct, correct_count)
            loss = loss + cfg.positive_example_nll_weight * nll
        return _LossTerms(loss, kl, nll, ratios, ratios_clamped, sampler_kl)

    def _aggregate(
        self,
        per_token: torch.Tensor,  # [B, T] finite (inputs sanitized, log-ratios clamped)
        agg: "_Aggregation",
    ) -> torch.Tensor:
        """Token mean over ``global_valid_toks``, or mean over sequences of per-row means.

        Rejected tokens are zero in the numerators only; the per-row denominator is the
        row's full ``token_mask`` count (reduced over ``groups``), as NeMo-RL's.
        """
        if agg.seq_mask_count is None:  # token-level loss
            return masked_sum(per_token, agg.mask.to(per_token.dtype)) / (agg.token_denominator + EPS)
        row_sum = all_reduce_sum_with_grad((per_token * agg.mask).sum(-1), agg.groups)  # [B]
        row_mean = row_sum / (agg.seq_mask_count + EPS)
        loss = (row_mean * agg.sample_mask).sum() / (agg.seq_denominator + EPS)
        if agg.groups.active:
            # Every rank now holds the whole value; return its share so that the shares
            # summed over the ranks (the data-parallel gradient reduction) are the loss.
            for g in agg.groups.groups:
                loss = loss / torch.distributed.get_world_size(g)
        return loss

    def _upstream_metrics(
        self,
        metrics: MetricSet,
        terms: "_LossTerms",
        clean: SanitizedInputs,
        usable: torch.Tensor,  # [B, T] valid tokens with finite inputs (that reach the loss)
        corr: CorrectionResult,
    ) -> None:
        """Every metric NeMo-RL's ``ClippedPGLossFn`` returns, same names and meanings.

        Token means are masked totals over ``usable`` (:class:`MetricSet` evaluates them).
        """
        cfg = self.cfg
        grad_norm: Normalization = "tokens" if self.token_level_loss else "sequences"
        d = clean.d
        with torch.no_grad():
            kl, nll = terms.kl, terms.nll
            metrics.add("loss", terms.total, grad_norm, "sum")
            r, rc = terms.ratios.detach(), terms.ratios_clamped.detach()
            kl_type = cfg.reference_policy_kl_type
            # A masked position may hold any finite log-prob; exp of its log-ratio can overflow,
            # and inf * 0 in the masked sums below is NaN: no masked token reaches an exp.
            d = d * usable

            # One row at a time: the CPU form reduces each where it is declared (one [B, T] row alive).
            def token_mean(name: str, row: torch.Tensor) -> None:
                metrics.add_masked_total(name, row, usable, "tokens", "sum")

            token_mean("probs_ratio", r)
            token_mean("probs_ratio_clamped", rc)
            token_mean("token_mult_prob_error", torch.exp(d.abs()))
            token_mean("gen_kl_error", kl_estimate(d, kl_type))
            token_mean("policy_kl_error", kl_estimate(-d, kl_type))
            # NeMo-RL's per-token JS estimate with M = (P_train + P_gen) / 2,
            #   0.5 [k3(log M/P_train) + k3(log M/P_gen)],  k3(x) = exp(x) - 1 - x,
            # simplifies exactly to log cosh(d / 2) = softplus(-d) + d / 2 - log 2, which is
            # stable for any d and costs one transcendental instead of five.
            token_mean("js_divergence_error", torch.nn.functional.softplus(-d).add_(d, alpha=0.5).sub_(math.log(2.0)))
            # E_gen[-(pi/pi_gen) log pi]
            token_mean("approx_entropy", (clean.curr - clean.gen).mul_(usable).exp_().mul_(clean.curr).neg_())
            if self.cfg.is_level_entry.per_token:
                token_mean("sampling_importance_ratio", corr.is_weight)
            # NeMo-RL's own extremes: its wrappers and driver combine them by min and max
            metrics.add_masked_extrema(
                "probs_ratio_min", "probs_ratio_max", r, clean.masks.usable_penalty, per_call=False
            )
            self._clamped_extremes(metrics)
            if kl is not None:
                metrics.add("kl_penalty", kl / self.kl_coef, grad_norm, "sum")
            else:
                metrics.add_zero("kl_penalty", grad_norm)
            if not self.cfg.is_level_entry.per_token:
                self._sequence_sampling_importance_ratio(metrics, corr.is_weight, clean.masks.sample_mask)
            metrics.add("num_valid_samples", clean.masks.sample_mask.sum(), "none", "replicated")
            if terms.sampler_kl is not None:
                metrics.add("sampler_kl_penalty", terms.sampler_kl, grad_norm, "sum")
            if nll is not None:
                metrics.add("positive_nll_loss", nll, "none", "sum")
            else:
                metrics.add_zero("positive_nll_loss", "none")

    def _clamped_extremes(self, metrics: MetricSet) -> None:
        """Declare ``probs_ratio_clamped_{min,max}``, derived on the host after the reduction.

        The clamp is monotonic, so the extremes of clip(r) are clip(extremes of r); the
        "no token" sentinels (+-inf) stay as they are.
        """
        cfg = self.cfg
        unclamped = cfg.force_on_policy_ratio or cfg.disable_ppo_ratio  # no clamp in these modes
        lo, hi = (-math.inf, math.inf) if unclamped else (1.0 - cfg.ratio_clip_min, 1.0 + cfg.ratio_clip_max)
        # Module-level functions bound with partial, not closures: a compiled core rebuilds every
        # closure it returns on each call.
        metrics.derive("probs_ratio_clamped_min", "none", partial(_clipped_extreme, "probs_ratio_min", lo, hi))
        metrics.derive("probs_ratio_clamped_max", "none", partial(_clipped_extreme, "probs_ratio_max", lo, hi))

    def _sequence_sampling_importance_ratio(
        self, metrics: MetricSet, is_weight: torch.Tensor, sample_mask: torch.Tensor
    ) -> None:
        """``sampling_importance_ratio`` with a per-sequence weight: ``sum_i s_i w_i / N_seq``.

        (Per-token weights are averaged over tokens with the other token means.) The mean over
        valid sequences, in NeMo-RL's own GSPO mode too, where NeMo-RL's unpacked call logs
        ``sum_i w_i * sum_j s_j / N_seq`` instead: its ``[B, 1]`` weight broadcasts against the
        ``[B]`` sample mask (NeMo-RL #3753), so its number grows with the sequences per call and
        changes with packing (its per-sequence packing wrapper, one sequence per call, logs
        this mean). This one is the same whatever the call shape (docs/guide.md).
        """
        w_seq = is_weight.squeeze(-1)  # [B]
        metrics.add_masked_total("sampling_importance_ratio", w_seq, sample_mask, "sequences", "replicated")


def _clipped_extreme(source: str, lo: float, hi: float, out: dict[str, float]) -> float:
    """``out[source]`` clipped to ``[lo, hi]``; the "no token" sentinels (+-inf) stay as they are."""
    value = out[source]
    return value if not math.isfinite(value) else min(max(value, lo), hi)


def _sequence_counts(corr: CorrectionResult) -> SequenceCounts:
    """``corr``'s per-sequence counts, for a term the configuration turns on that reads them.

    :func:`~nemo_rs_plugin.core.correction.needs_sequence_statistics` holds for every such
    configuration, so the correction computed them; a reader it forgot fails here, by name.
    """
    if corr.sequences is None:
        raise RuntimeError(
            "the loss reads per-sequence counts the correction did not compute: "
            "needs_sequence_statistics(cfg) must hold for this configuration"
        )
    return corr.sequences


@dataclass
class _Aggregation:
    """How a per-token loss term becomes a number: its mask and denominators."""

    mask: torch.Tensor  # [B, T] valid (token-level) or token_mask (sequence-level), kept
    sample_mask: torch.Tensor  # [B]
    seq_mask_count: Optional[torch.Tensor]  # [B] token_mask count per row, all ranks (None: token-level loss)
    seq_denominator: torch.Tensor  # global_valid_seqs (or its kept share)
    token_denominator: torch.Tensor  # global_valid_toks (or its kept share)
    groups: SequenceGroups


@dataclass
class _LossTerms:
    """The loss and the terms its metrics report."""

    total: torch.Tensor
    kl: Optional[torch.Tensor]  # None without the KL term
    nll: Optional[torch.Tensor]  # None without the NLL term
    ratios: torch.Tensor  # [B, T] policy ratio
    ratios_clamped: torch.Tensor  # [B, T] its clamp
    sampler_kl: Optional[torch.Tensor] = None  # mean (curr - gen)^2 of the sampler penalty; None when off


def metric_normalizations(cfg: Any) -> dict[str, str]:
    """Metric name -> global denominator (``tokens``, ``sequences``, ``none``) for a config.

    The core loss's, read from the declarations next to each metric's computation (see
    :meth:`CorrectedPGLoss.metric_normalizations`); it includes the per-call metrics, which the
    NeMo-RL loss does not return (its ``metric_normalizations`` attribute leaves them out).
    """
    return CorrectedPGLoss(cfg).metric_normalizations()
