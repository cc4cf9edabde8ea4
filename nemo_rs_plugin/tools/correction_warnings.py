"""The warnings and notes about the correction itself, at the recipe's response length.

Read by ``nemo-rs check`` (:mod:`~nemo_rs_plugin.tools.check`) once the loss section is valid and
fully resolved: an importance-sampling level whose log-weight spreads with the length, the
rejection each filter would make on a simulated batch at the stated mismatch
(:mod:`~nemo_rs_plugin.tools.simulate`), and async GRPO with a sequence ratio band.
"""

from __future__ import annotations

import math
from typing import Optional

from nemo_rs_plugin.core.registries.filter_statistics import filter_statistic_entry
from nemo_rs_plugin.core.settings.config import RSClippedPGLossConfig
from nemo_rs_plugin.tools.grpo_setup import SetupReport
from nemo_rs_plugin.tools.recipe_loading import recipe_value

__all__ = ["FALLBACK_RESPONSE_TOKENS", "LONG_RESPONSE_TOKENS", "warn_about_correction"]

#: Responses longer than this: a log-weight that grows with the length gets a warning.
LONG_RESPONSE_TOKENS = 2048
#: The response length of the rejection estimate where neither ``--response-tokens`` nor the recipe
#: (``policy.generation.max_new_tokens``, ``policy.max_total_sequence_length``) gives one (docs/cli.md).
FALLBACK_RESPONSE_TOKENS = 4096
# Sequences in the simulated batch of the rejection estimate (fewer at long lengths: same cost).
_ESTIMATE_RESPONSES, _ESTIMATE_TOKENS = 64, 8192 * 64


def warn_about_correction(
    report: SetupReport, cfg: dict, config: RSClippedPGLossConfig, mismatch: float, response_tokens: Optional[int]
) -> None:
    """Warn about the correction at ``mismatch`` per token over the recipe's responses; notes for async GRPO.

    The length is ``response_tokens`` (``--response-tokens``), else the recipe's
    ``policy.generation.max_new_tokens`` or ``policy.max_total_sequence_length``, else, for the
    rejection estimate, :data:`FALLBACK_RESPONSE_TOKENS`.
    """
    tokens = (
        response_tokens
        or recipe_value(cfg, "policy.generation.max_new_tokens")
        or recipe_value(cfg, "policy.max_total_sequence_length")
    )
    if (
        config.use_importance_sampling_correction
        and config.is_level_entry.grows_with_length
        and isinstance(tokens, int)
        and tokens > LONG_RESPONSE_TOKENS
    ):
        spread = mismatch * math.sqrt(tokens)
        level = f"{config.effective_is_level} ({config.is_level_entry.formula})"
        report.warnings.append(
            f"is_correction_level is {level} with responses up to {tokens} tokens: at {mismatch:g} "
            f"per-token mismatch the log-weight spreads by ~{spread:.2g} nats, so most weights collapse "
            "towards 0 and the learning rate shrinks silently; use is_correction_level: sequence_mean"
        )
    zeroes_sequences = config.truncation_entry is not None and config.truncation_entry.per_sequence
    if config.rejection_sampling or zeroes_sequences:
        length = tokens if isinstance(tokens, int) else FALLBACK_RESPONSE_TOKENS
        _warn_rejection(report, config, mismatch, length)
    if recipe_value(cfg, "grpo.async_grpo.enabled", False) and any(
        f.aggregation_entry is not None
        and f.aggregation_entry.sums_tokens
        and filter_statistic_entry(f.statistic).log_space
        for f in config.rejection_sampling
    ):
        report.notes.append(
            "async GRPO with a sequence ratio band: staleness shifts whole sequences by far more than "
            "precision mismatch (docs/lab.md#confirmation: two batches stale, Geo-RS [0.99, 1.01] kept "
            "25% of the sequences, and a band calibrated from the run beat it by +0.258 [+0.222, +0.294] on the "
            "area under the eval curve, 38 seeds); set the band from your own run's "
            "log-probs (loss_fn.record_logprobs: true for a few steps): nemo-rs calibrate --from <record_dir> "
            "--recipe <this recipe>"
        )


def _warn_rejection(report: SetupReport, config: RSClippedPGLossConfig, mismatch: float, tokens: int) -> None:
    """Estimate the rejection at the recipe's response length; warn above the unhealthy share."""
    from nemo_rs_plugin.core.reporting.health import UNHEALTHY_SEQ_REJECTION
    from nemo_rs_plugin.tools.simulate import MAX_SYNTHETIC_TOKENS, MismatchModel, loss_metrics, synthetic_batch

    length = max(16, tokens)
    responses = max(16, min(_ESTIMATE_RESPONSES, _ESTIMATE_TOKENS // length))
    if responses * length > MAX_SYNTHETIC_TOKENS:
        report.warnings.append(
            f"rejection not estimated: responses of up to {length} tokens are too long to simulate here "
            f"(at most {MAX_SYNTHETIC_TOKENS // 16}); pass --response-tokens with a typical length"
        )
        return
    model = MismatchModel(responses=responses, length=length, mismatch=mismatch, seed=1)
    fields = config.model_dump()
    fields.update(name=None, reference_policy_kl_penalty=0.0, sharded_logits_input=False, record_logprobs=False)
    metrics, _ = loss_metrics(fields, synthetic_batch(model))
    stages = [
        (f"rejection stage {i}", metrics.get(f"rs/{f.label}/seq_rejected_frac", 0.0))
        for i, f in enumerate(config.rejection_sampling, 1)
        if f.level_entry.whole_sequences
    ]
    entry = config.truncation_entry
    if entry is not None and entry.per_sequence:  # it zeroes whole sequences, as a sequence filter does
        stages.append((entry.name, metrics.get("is_oob_ratio", 0.0)))
    total = metrics.get("rs_seq_rejected_frac", 0.0)
    limit = UNHEALTHY_SEQ_REJECTION
    advice = (
        f"more than {limit:.0%} is unhealthy (docs/guide.md, 'When rejection eats the batch'): widen the "
        "bounds, set them from your run with nemo-rs calibrate, or state your mismatch with --mismatch"
    )
    for label, frac in stages:
        if frac > limit:
            report.warnings.append(
                f"{label} would reject ~{frac:.0%} of sequences at {mismatch:g} per-token "
                f"mismatch over responses of up to {model.length} tokens; {advice}"
            )
    if total > limit and not any(frac > limit for _, frac in stages):
        report.warnings.append(
            f"the filters together would reject ~{total:.0%} of sequences at {mismatch:g} per-token mismatch "
            f"over responses of up to {model.length} tokens; {advice}"
        )
