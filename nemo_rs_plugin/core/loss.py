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

import warnings
from typing import Any, Mapping, Optional

import torch

from nemo_rs_plugin.core.batch.input_checks import (
    count_global_counts,
    count_positive_logprobs,
    judge_inputs,
    warn_nonfinite_logits,
)
from nemo_rs_plugin.core.batch.inputs import LossInputs, global_counts
from nemo_rs_plugin.core.batch.microbatch import MicrobatchTotals, missing_totals
from nemo_rs_plugin.core.batch.sanitizing import nonfinite_logit_metric, nonfinite_metrics, sanitize_inputs
from nemo_rs_plugin.core.compiled import core_fn
from nemo_rs_plugin.core.correction import PolicyLogProbs, apply_correction, compute_correction, plan_correction
from nemo_rs_plugin.core.distributed import NO_GROUPS, SequenceGroups
from nemo_rs_plugin.core.evaluation import ROW_BY_ROW, EvaluationForm, evaluation_form
from nemo_rs_plugin.core.loss_terms.objective import Objective
from nemo_rs_plugin.core.loss_terms.parity_metrics import record_nemo_rl_metrics
from nemo_rs_plugin.core.reporting.health import RejectionMonitor
from nemo_rs_plugin.core.reporting.metric_catalog import declared_specs, metric_specs
from nemo_rs_plugin.core.reporting.metrics import MetricLayout, MetricSet
from nemo_rs_plugin.core.settings.config import ConfigWarning, RSClippedPGLossConfig
from nemo_rs_plugin.core.settings.rejection_filter import resolved_stages

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
            by row (:func:`~nemo_rs_plugin.core.evaluation.evaluation_form`).
        compile_backend: the ``torch.compile`` backend when ``cfg.compile`` is on
            (``aot_eager`` traces the same graph without generating kernels, for debugging).
        per_call_metrics: return the metrics that hold for this call alone (extremes, the ESS,
            the batch-normalisation factor; :mod:`nemo_rs_plugin.core.reporting.metrics`). The NeMo-RL
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
        self.objective = Objective(cfg)
        # Each filter's registry entries, looked up here once instead of on every call.
        self.filter_stages = resolved_stages(cfg.rejection_sampling)
        self.kl_coef = self.objective.kl_coef  # 0 without the KL term: the reference log-probs are not read
        # Every metric this configuration returns, read off the catalog (no run): what
        # metric_normalizations() reports; with the loss's own diagnostics, what each metric set
        # reads a declaration's normalization, reduction and per-call flag from.
        self.metric_specs = metric_specs(cfg)
        self.declared_specs = declared_specs(cfg)
        # ... resolved once into where each declared value waits and how each call reports them.
        self.metric_layout = MetricLayout(self.declared_specs, per_call_metrics)
        # Warns (rate-limited, from the metrics already on the host) when filters eat the batch.
        self.rejection_monitor = RejectionMonitor() if cfg.rejection_sampling else None

    def __getstate__(self) -> dict:
        """Pickled (NeMo-RL ships its loss to Ray workers) without the resolved filter stages.

        They hold registry entries, some of whose formulas are lambdas that pickle cannot name;
        they are a function of the configuration, rebuilt on unpickling.
        """
        state = dict(self.__dict__)
        del state["filter_stages"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.filter_stages = resolved_stages(self.cfg.rejection_sampling)

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
        return LossInputs.dtype_from_nemo_rl(
            next_token_logprobs, data, need_prev=not self.cfg.force_on_policy_ratio, need_reference=self.kl_coef != 0
        )

    def metric_normalizations(self) -> dict[str, str]:
        """Metric name -> ``tokens`` / ``sequences`` / ``none``, from the metric catalog.

        :func:`~nemo_rs_plugin.core.reporting.metric_catalog.metric_specs` of the configuration: which
        metrics exist depends on the config only, and every metric the loss declares takes its
        spec from its entry where it is declared (``MetricSet``). The per-call metrics are in it
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
        # leaves the device; the one host transfer stays here, eager. The evaluation form is
        # decided here, eagerly: a compiled core specialises on its bools.
        form = evaluation_form(self, x.curr.device, groups)
        if form.compiled:
            # Counts given as Python numbers become tensors here: the compiled core specialises
            # Python floats (compiled.py), and a count that changes every step would recompile.
            as_tensors = global_counts(global_valid_seqs, global_valid_toks, x.compute_dtype(), x.curr.device)
            global_valid_seqs, global_valid_toks = as_tensors.sequences, as_tensors.tokens
        core = core_fn(self, form)
        loss, metrics = core(self, x, global_valid_seqs, global_valid_toks, groups, form, microbatch)
        reported = metrics.finalize(groups)  # the one host transfer
        diagnostics = metrics.diagnostics  # the loss's own values, from the same transfer
        judge_inputs(diagnostics)  # raises on a bad count or token mask, warns on positive log-probs
        warn_nonfinite_logits(reported, diagnostics)
        dropped, valid = diagnostics.dropped_sequences, diagnostics.valid_sequences  # None where no filter ran
        if self.rejection_monitor is not None and dropped is not None and valid is not None:
            self.rejection_monitor.observe(dropped, valid)
        return loss, reported

    def _tensors(
        self,
        x: LossInputs,
        global_valid_seqs: Any,
        global_valid_toks: Any,
        groups: SequenceGroups,
        form: EvaluationForm = ROW_BY_ROW,
        microbatch: Optional[MicrobatchTotals] = None,
    ) -> tuple[torch.Tensor, MetricSet]:
        """The pure-tensor part of :meth:`compute`: the loss and the stacked, unreduced metrics, in ``form``."""
        x = x.to_dtype(x.compute_dtype())
        cfg = self.cfg
        counts = global_counts(global_valid_seqs, global_valid_toks, x.curr.dtype, x.curr.device)
        metrics = MetricSet(self.metric_layout, form=form)
        # Set, not passed: a compiled core rebuilds the objects it returns from their constructor's
        # arguments, and the counts (views of the caller's tensors, dropped by stack()) would then
        # be graph outputs, rebuilt as aliases of its inputs on every call.
        metrics.counts = counts
        clean = sanitize_inputs(x, cfg.force_on_policy_ratio, self.kl_coef != 0, form)
        masks = clean.masks
        nonfinite_metrics(metrics, masks, clean.nonfinite, clean.input_names)
        nonfinite_logit_metric(metrics, x.nonfinite_logit_rows, self.metric_specs)
        clean.nonfinite = None  # counted: the [B, T] masks need not live on (the CPU form reduced them)
        # ---- input checks: counted here, judged on the host after the one transfer (compute) ----
        count_global_counts(metrics, counts, masks)
        count_positive_logprobs(metrics, clean, cfg.force_on_policy_ratio)

        # ---- the off-policy correction: plan (local) -> reduce (one collective) -> apply ----
        plan = plan_correction(
            cfg,
            clean.d,
            masks,
            log_probs=PolicyLogProbs(curr=x.curr.detach(), prev=clean.prev_raw.detach(), gen=x.generation),
            advantages=clean.advantages,
            stages=self.filter_stages,
        )
        reduced = plan.reduce(groups)  # every per-sequence statistic, over the ranks that split a sequence
        corr = apply_correction(
            cfg, plan, reduced, metrics, groups, None if microbatch is None else microbatch.batch_norm_factor
        )
        del plan, reduced  # their [B, T] rows (the token filters' masks, the statistics) end here: the peak comes later
        totals = microbatch if microbatch is not None else self.objective.totals_of(corr, masks, x.rewards)

        objective = self.objective
        terms = objective.terms(
            clean, corr, objective.aggregation(counts, corr, masks, groups, totals), x.rewards, totals
        )
        # Metrics average over valid tokens whose inputs are all finite; without filters these
        # are exactly the tokens that reach the loss.
        loss_tokens = corr.loss_tokens
        usable = masks.where_inputs_finite(masks.valid) if cfg.rejection_sampling else loss_tokens
        record_nemo_rl_metrics(objective, metrics, terms, clean, usable, corr)
        metrics.stack()  # evaluated here, inside the (optionally compiled) tensor core
        return terms.total, metrics

    # ------------------------------------------------------------------ pieces
    def microbatch_totals(self, x: LossInputs, groups: SequenceGroups = NO_GROUPS) -> MicrobatchTotals:
        """The totals over the whole microbatch ``x`` that a call on one of its sequences needs.

        :mod:`nemo_rs_plugin.core.batch.microbatch` says which and why. Computed from the inputs that
        exist before the forward pass (``x.curr`` is not read unless the configuration reads the
        current policy in a total: :func:`~nemo_rs_plugin.core.batch.microbatch.current_policy_problems`);
        ``groups`` as in :meth:`compute` for ``x`` (``data_parallel`` for the batch
        normalisation's SUM, issued here once per microbatch instead of once per call).
        """
        with torch.no_grad():
            x = x.to_dtype(x.compute_dtype())
            cfg = self.cfg
            form = EvaluationForm.for_device(x.curr.device)  # the device's; its metrics are dropped
            clean = sanitize_inputs(x, cfg.force_on_policy_ratio, x.reference is not None, form)
            corr = compute_correction(
                cfg,
                clean.d,
                clean.masks,
                groups,
                log_probs=PolicyLogProbs(curr=x.curr, prev=clean.prev_raw, gen=x.generation),
                advantages=clean.advantages,
                metrics=MetricSet(self.metric_layout, form=form),  # dropped: its per-call metrics need not be computed
                stages=self.filter_stages,
            )
            return self.objective.totals_of(corr, clean.masks, x.rewards)


def metric_normalizations(cfg: Any) -> dict[str, str]:
    """Metric name -> global denominator (``tokens``, ``sequences``, ``none``) for a config.

    The core loss's, read from the declarations next to each metric's computation (see
    :meth:`CorrectedPGLoss.metric_normalizations`); it includes the per-call metrics, which the
    NeMo-RL loss does not return (its ``metric_normalizations`` attribute leaves them out).
    """
    return CorrectedPGLoss(cfg).metric_normalizations()
