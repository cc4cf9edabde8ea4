"""The correction pipeline of a config, in words (for ``nemo-rs check`` and logs)."""

from __future__ import annotations

from nemo_rs_plugin.core.registries.filter_statistics import filter_statistic_entry
from nemo_rs_plugin.core.settings.config import RejectionFilter, RSClippedPGLossConfig

__all__ = ["describe_pipeline", "describe_filter"]


def _bounds(f: RejectionFilter) -> str:
    lo = "-inf" if f.lower is None else f"{f.lower:g}"
    hi = "+inf" if f.upper is None else f"{f.upper:g}"
    return f"[{lo}, {hi}]"


def describe_filter(f: RejectionFilter) -> str:
    """One filter as a sentence, e.g. 'reject a sequence unless the geometric mean ... is in [..]'."""
    log_ratio = f.log_ratio_entry
    a, b = log_ratio.target, log_ratio.behaviour
    statistic = filter_statistic_entry(f.statistic)
    aggregation = f.aggregation  # None for a per-token level
    unit = f"a {f.level_entry.unit}"
    sentence = f"reject {unit} unless {statistic.describe(aggregation, a, b)} is in {_bounds(f)}"
    if not log_ratio.is_loss_log_ratio and not statistic.names_its_sources(aggregation):
        sentence += f", with d = {a} - {b}"
    if f.advantage_sign is not None:
        sentence += f" (only its tokens with a {f.advantage_sign} advantage)"
    if not f.scope_entry.leaves_loss:
        sentence += "; a rejected token loses only its policy-gradient term, its KL penalties stay"
    return sentence


def describe_pipeline(cfg: RSClippedPGLossConfig) -> list[str]:
    """Numbered lines: policy ratio, IS weight, truncation, filters, denominators."""
    lines = [_ratio_line(cfg), _is_weight_line(cfg), _truncation_line(cfg)]
    if cfg.is_batch_normalization is not None:
        lines.append(_batch_normalization_line(cfg))
    if cfg.rejection_sampling:
        for i, f in enumerate(cfg.rejection_sampling, 1):
            lines.append(f"rejection stage {i}: {describe_filter(f)}")
    else:
        lines.append("rejection sampling: none")
    lines.append(_loss_line(cfg))
    if cfg.reference_policy_kl_penalty and not cfg.use_kl_in_reward:
        lines.append(f"KL penalty: {cfg.reference_policy_kl_penalty:g} x {cfg.reference_policy_kl_type}")
    if cfg.sampler_kl_penalty:
        lines.append(
            f"penalty toward the sampler: {cfg.sampler_kl_penalty:g} x (curr - gen)^2 per token, not IS-weighted"
        )
    if cfg.sharded_logits_input:
        lines.append("input: local logits shard (TP/CP), statistics all-reduced, no all-gather")
    return [f"{i}. {line}" for i, line in enumerate(lines, 1)]


def _ratio_line(cfg: RSClippedPGLossConfig) -> str:
    if cfg.force_on_policy_ratio:
        ratio = "forced to 1 (on-policy; one update per rollout)"
    elif cfg.disable_ppo_ratio:
        ratio = "none: REINFORCE, -A * log pi"
    elif cfg.sequence_level_importance_ratios:
        ratio = "GSPO sequence ratio exp(mean_t(curr - prev))"
    elif cfg.use_cispo:
        ratio = "CISPO: -A * sg(clip(r)) * log pi with the token ratio r"
    else:
        ratio = "PPO/GRPO token ratio exp(curr - prev)"
    clip = f", clipped to [1-{cfg.ratio_clip_min:g}, 1+{cfg.ratio_clip_max:g}]"
    if cfg.ratio_clip_c is not None:
        clip += f", dual clip c={cfg.ratio_clip_c:g}"
    return f"policy ratio: {ratio}{clip if not (cfg.force_on_policy_ratio or cfg.disable_ppo_ratio) else ''}"


def _is_weight_line(cfg: RSClippedPGLossConfig) -> str:
    level, entry = cfg.effective_is_level, cfg.is_level_entry
    formula = f"{entry.formula} {entry.unit}"
    source = "set" if cfg.is_correction_level is not None else "NeMo-RL's default for this ratio"
    d = "curr - gen (prev is curr: force_on_policy_ratio)" if cfg.force_on_policy_ratio else "prev - gen"
    if cfg.use_importance_sampling_correction:
        return f"IS weight ({source}): {level}, {formula}, d = {d}"
    return f"IS weight: off (use_importance_sampling_correction: false); {level} weights are only reported"


def _truncation_line(cfg: RSClippedPGLossConfig) -> str:
    entry = cfg.truncation_entry
    if entry is None:
        return "truncation: none"
    return entry.describe(cfg.truncated_importance_sampling_ratio_min, cfg.truncated_importance_sampling_ratio)


def _batch_normalization_line(cfg: RSClippedPGLossConfig) -> str:
    assert cfg.is_batch_normalization is not None  # described only where it is on
    scope = {"microbatch": "this microbatch", "data_parallel": "the microbatches of all data-parallel ranks"}[
        cfg.is_batch_normalization
    ]
    units = "valid tokens" if cfg.is_level_entry.per_token else "sequences"
    return f"batch normalisation: weights divided by their mean over the {units} of {scope}"


def _loss_line(cfg: RSClippedPGLossConfig) -> str:
    denom = (
        "the valid tokens/sequences before rejection (rejected units count as 0)"
        if not cfg.denominator_entry.counts_kept
        else "the kept tokens/sequences (VERL decoupled semantics)"
    )
    loss = "token mean" if cfg.token_level_loss else "mean over sequences of token means"
    return f"loss: {loss}, divided by {denom}"
