"""The rules of a loss section, each returning every problem it finds (one line each).

NeMo-RL's numbers outside their range, the loss type's combinations (GSPO, the dual clip,
CISPO), batch normalisation without applied weights, NeMo-RL's truncation, the range of each
filter statistic and the bounds that can never (or always) reject, the filter combinations
that cannot work, and the legal settings that do nothing (warnings), so that
:class:`~nemo_rs_plugin.core.settings.config.RSClippedPGLossConfig` reports every problem at once. How
pydantic's own errors become lines is :mod:`nemo_rs_plugin.core.settings.config_errors`.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import ValidationError

from nemo_rs_plugin.core.registries.filter_statistics import FILTER_STATISTICS
from nemo_rs_plugin.core.registries.truncation import TRUNCATIONS, truncation
from nemo_rs_plugin.core.settings.presets import PLUGIN_LOSS_NAME
from nemo_rs_plugin.core.settings.rejection_filter import NEMO_RL_UNDIVIDED_MARKERS, RejectionFilter


def statistic_range(f: RejectionFilter) -> tuple[float, float, bool, bool]:
    """Where ``f``'s statistic can lie: ``(lowest, highest, lowest reached, highest reached)``.

    A token's range is its statistic's entry
    (:data:`~nemo_rs_plugin.core.registries.filter_statistics.FILTER_STATISTICS`), and so is that
    of its mean, max and min over a sequence's tokens. A sum over tokens has no upper limit, and
    its lower one only where the token's is >= 0 (the ratio's ``sum`` is the product: the ratio's
    range). An infinite end is never reached (the statistics are finite).
    """
    entry = FILTER_STATISTICS[f.statistic]
    (lo, hi), (reaches_lo, reaches_hi) = entry.value_range, entry.reaches
    aggregation = f.aggregation_entry
    if aggregation is not None and not aggregation.keeps_token_range and not entry.log_space:
        lo, hi = (lo if lo >= 0 else -math.inf), math.inf
    return lo, hi, reaches_lo and math.isfinite(lo), reaches_hi and math.isfinite(hi)


def filter_bound_extremes(i: int, f: RejectionFilter) -> list[str]:
    """A bound outside the statistic's range that makes the filter reject every unit.

    A warning, not an error: legal (the loss is then 0, its metrics finite), but the run trains on
    nothing.
    """
    lo, hi, reaches_lo, reaches_hi = statistic_range(f)
    what = f"{f.statistic}" + (f" ({f.aggregation} over a sequence)" if f.aggregation else " (per token)")
    if not f.scope_entry.leaves_loss:
        consequence = "only the penalty terms train"
    elif f.advantage_sign is not None:
        consequence = f"the {f.advantage_sign}-advantage tokens train on nothing"
    else:
        consequence = "the loss trains on nothing"
    p = []
    # Bounds are inclusive: a bound at an end of the range rejects every unit only where no unit reaches that end.
    for side, bound in (("upper", f.upper), ("lower", f.lower)):
        if bound is not None and not math.isfinite(bound) and (bound < 0) == (side == "upper"):
            p.append(
                f"rejection_sampling.{i}: {side}: got {bound}: no value of {what} is on the kept side of it, so "
                f"the filter rejects every unit and {consequence}; set a finite {side} bound"
            )
            return p
    if f.upper is not None and (f.upper < lo or (f.upper == lo and not reaches_lo)):
        p.append(
            f"rejection_sampling.{i}: upper: got {f.upper} with statistic {f.statistic!r}, but {what} is never "
            f"below {lo:g}: the filter rejects every unit and {consequence}; set an upper bound >= {lo:g}"
        )
    if f.lower is not None and (f.lower > hi or (f.lower == hi and not reaches_hi)):
        p.append(
            f"rejection_sampling.{i}: lower: got {f.lower} with statistic {f.statistic!r}, but {what} is below "
            f"{hi:g}: the filter rejects every unit and {consequence}; set a lower bound < {hi:g}"
        )
    return p


def filter_bound_warnings(i: int, f: RejectionFilter) -> list[str]:
    """A bound that can never reject: harmless, but not what was meant."""
    entry = FILTER_STATISTICS[f.statistic]
    lo, hi, _, _ = statistic_range(f)
    what = f"a {f.level_entry.unit}'s" + (f" {f.aggregation}" if f.aggregation is not None else "")
    clamped = f"; below {hi:g} with the probabilities clamped" if entry.clamped else ""
    w = []
    if f.upper == math.inf and hi == math.inf:
        w.append(
            f"rejection_sampling.{i}.upper: got {f.upper} with statistic {f.statistic!r}: an infinite upper bound "
            "never rejects; remove it (no upper bound means the same)"
        )
    elif f.upper is not None and f.upper >= hi:
        w.append(
            f"rejection_sampling.{i}.upper: got {f.upper} with statistic {f.statistic!r}, which is at most {hi:g} "
            f"({what}{clamped}): this bound never rejects; set an upper bound below {hi:g}, or remove it"
        )
    # Bounds are inclusive: a lower bound at the lowest value keeps every unit (for a ratio, lower: 0 is
    # the documented way to write "no lower bound").
    never_below = f.lower is not None and f.lower <= lo
    if never_below and not entry.log_space:
        w.append(
            f"rejection_sampling.{i}.lower: got {f.lower} with statistic {f.statistic!r}, which is never below "
            f"{lo:g}: this bound never rejects; set a lower bound above {lo:g}, or remove it"
        )
    return w


def filter_problems(filters: Any, force_on_policy_ratio: bool) -> list[str]:
    """``(position, filter)`` pairs that cannot work with ``force_on_policy_ratio``."""
    p: list[str] = []
    for i, f in filters:
        if f.log_ratio_entry.zero_on_policy and force_on_policy_ratio is True:
            p.append(
                f"rejection_sampling.{i}.log_ratio: got 'curr-prev' with force_on_policy_ratio: true, which "
                "sets prev to curr: the log-ratio is 0 everywhere, so the filter rejects nothing or "
                "everything; allowed here: prev-gen, gen-prev or curr-gen"
            )
    return p


def valid_filters(entries: Any) -> list[tuple[int, RejectionFilter]]:
    """The entries of ``rejection_sampling`` that are valid filters on their own, with their positions."""
    valid = []
    for i, entry in enumerate(entries if isinstance(entries, (list, tuple)) else ()):
        try:
            valid.append((i, RejectionFilter.model_validate(entry)))
        except ValidationError:
            continue
    return valid


def duplicate_label_problems(filters: tuple[RejectionFilter, ...]) -> list[str]:
    """Filters sharing a label would overwrite each other's ``rs/<label>/*`` metrics."""
    positions: dict[str, list[int]] = {}
    for i, f in enumerate(filters):
        positions.setdefault(f.label, []).append(i)
    return [
        f"rejection_sampling: filters {', '.join(map(str, where))} share the label {label!r}, "
        f"so their rs/{label}/* metrics would overwrite each other; allowed: unique labels, "
        "give each a distinct `name`"
        for label, where in positions.items()
        if len(where) > 1
    ]


def setting_warnings(cfg: Any) -> list[str]:
    """Legal settings of ``cfg`` (an ``RSClippedPGLossConfig``) that do nothing here, one line each."""
    w: list[str] = []
    clamps = cfg.truncation_entry is not None and not cfg.truncation_entry.zeroes_units
    if clamps and cfg.truncated_importance_sampling_ratio == math.inf:
        w.append(
            "truncated_importance_sampling_ratio: got inf with truncated_importance_sampling_type "
            f"{cfg.truncated_importance_sampling_type!r}: no weight is ever truncated; for no truncation remove "
            "truncated_importance_sampling_type and the ratio"
        )
    if cfg.name is not None and cfg.name != PLUGIN_LOSS_NAME:
        # NeMo-RL's loss registry reads the name; NeMo-RL's glue strips it before building
        # this config, so only a direct construction (the Python API) gets here with one.
        w.append(
            f"name: got {cfg.name!r}; this configuration is the {PLUGIN_LOSS_NAME} loss whatever the name: "
            "a name selects a loss only in a recipe (NeMo-RL's loss_fn.name); remove it here"
        )
    if cfg.is_correction_level is not None and not cfg.use_importance_sampling_correction:
        w.append(
            f"is_correction_level: got {cfg.is_correction_level!r} with use_importance_sampling_correction: "
            "false; no IS weight is applied (only the is_weight_* metrics follow the level): set "
            "use_importance_sampling_correction: true to correct, or remove is_correction_level"
        )
    zeroes_sequences = cfg.truncation_entry is not None and cfg.truncation_entry.zeroes_units
    counts_kept = cfg.denominator_entry.counts_kept
    if counts_kept and not cfg.rejection_sampling and not zeroes_sequences:
        w.append(
            "rejection_denominator: got 'kept' with no rejection_sampling filter (and no icepop or "
            "seq-mask-tis): nothing is rejected, so the denominators never shrink; add a filter, or "
            "remove rejection_denominator"
        )
    elif counts_kept and not zeroes_sequences and not any(f.scope_entry.leaves_loss for f in cfg.rejection_sampling):
        # Such a filter removes a token's policy-gradient term only: the token stays kept, in every count.
        w.append(
            "rejection_denominator: got 'kept' with only applies_to: policy_gradient filters (and no icepop or "
            "seq-mask-tis): they keep every token in the denominators, which never shrink; add a filter with "
            "applies_to: loss, or remove rejection_denominator"
        )
    for i, f in enumerate(cfg.rejection_sampling):
        w += filter_bound_extremes(i, f) + filter_bound_warnings(i, f)
        if f.metric is not None:
            # One name per concept: "metric" also names what the loss logs.
            w.append(
                f"rejection_sampling.{i}.metric: deprecated; write statistic: {f.statistic} instead (the same "
                "filter, the same metric names)"
            )
        if f.negative_advantages_only:
            # One name per concept: the sign field says both signs; the old flag said only one.
            w.append(
                f"rejection_sampling.{i}.negative_advantages_only: deprecated; write advantage_sign: negative "
                "instead (the same filter, the same metric names)"
            )
        markers = [m for m in NEMO_RL_UNDIVIDED_MARKERS if f.name is not None and m in f.name]
        if markers:
            w.append(
                f"rejection_sampling.{i}.name: got {f.name!r}, which contains {' and '.join(map(repr, markers))}: "
                "NeMo-RL's workers divide every metric by the number of global batches per step except those "
                f"whose name contains '_min' or '_max', so rs/{f.name}/... would be logged that many times too "
                "large in a step with several global batches; choose a name without '_min' and '_max'"
            )
    if not cfg.record_logprobs:
        for name in ("record_dir", "record_every"):
            if getattr(cfg, name) != type(cfg).model_fields[name].default:
                w.append(
                    f"{name}: got {getattr(cfg, name)!r} with record_logprobs: false; nothing is recorded: "
                    f"set record_logprobs: true, or remove {name}"
                )
    if cfg.compile and cfg.sharded_logits_input:
        w.append(
            "compile: got true with sharded_logits_input: true; the sharded TP/CP path stays eager (its "
            "collectives stay outside the graph), so nothing is compiled there: remove compile, or "
            "compile where the loss gets all-gathered log-probs"
        )
    if cfg.ratio_clip_min > 1:
        w.append(
            f"ratio_clip_min: got {cfg.ratio_clip_min}; the ratio is clipped below at 1 - ratio_clip_min = "
            f"{1 - cfg.ratio_clip_min:g}, below 0, where no ratio lies: no lower clipping (1.0 says so; "
            "0.2 is NeMo-RL's default)"
        )
    return w


def truncation_problems(cfg: Any) -> list[str]:
    """NeMo-RL's truncation in ``cfg``: its type, bounds and what it needs."""
    p: list[str] = []
    t = cfg.truncated_importance_sampling_type
    hi = cfg.truncated_importance_sampling_ratio
    lo = cfg.truncated_importance_sampling_ratio_min
    if t is None and hi is not None:
        p.append(
            f"truncated_importance_sampling_ratio: got {hi} with "
            f"truncated_importance_sampling_type: null; set the type ({', '.join(TRUNCATIONS)}) or remove the ratio"
        )
    if t is not None:
        if not cfg.use_importance_sampling_correction:
            p.append(
                f"truncated_importance_sampling_type: got {t!r} with "
                "use_importance_sampling_correction: false; truncation needs "
                "use_importance_sampling_correction: true"
            )
        if hi is None or not hi > 0:
            p.append(
                f"truncated_importance_sampling_ratio: got {hi} with "
                f"truncated_importance_sampling_type {t!r}; allowed: a number > 0"
            )
        entry = truncation(t)
        if entry.requires_lower and lo is None:
            reference = ", ".join(f"{e.name} {e.reference_lower:g}" for e in TRUNCATIONS.values() if e.requires_lower)
            p.append(
                f"truncated_importance_sampling_ratio_min: got null with "
                f"truncated_importance_sampling_type {t!r}; set a lower bound "
                f"(reference bounds: {reference})"
            )
        if lo is not None and hi is not None and lo > hi:
            p.append(
                # NeMo-RL's own wording first: callers (and NeMo-RL's tests) match on it.
                "truncated_importance_sampling_ratio_min must be <= "
                f"truncated_importance_sampling_ratio: got {lo} > {hi}"
            )
        if lo is not None and lo < 0:
            p.append(f"truncated_importance_sampling_ratio_min: got {lo}; allowed: >= 0")
        if entry.per_sequence and cfg.sequence_level_importance_ratios and cfg.is_correction_level is None:
            p.append(
                f"truncated_importance_sampling_type: got {t!r} with "
                "sequence_level_importance_ratios: true, which ties the IS weight to "
                "the sequence product; set is_correction_level (token or "
                f"sequence_mean) to combine {t} with the GSPO ratio"
            )
    elif lo is not None:
        p.append(
            f"truncated_importance_sampling_ratio_min: got {lo} with "
            "truncated_importance_sampling_type: null; set the type or remove it"
        )
    return p


def range_problems(cfg: Any) -> list[str]:
    """NeMo-RL's numbers outside the range where they do what their name says."""
    p: list[str] = []
    lo = cfg.ratio_clip_min
    if not lo >= 0:
        p.append(
            f"ratio_clip_min: got {lo}; allowed: a number >= 0 (the ratio is clipped below at "
            f"1 - ratio_clip_min = {1 - lo:g}, above 1, which clips every ratio under it)"
        )
    if not cfg.ratio_clip_max >= 0:
        p.append(
            f"ratio_clip_max: got {cfg.ratio_clip_max}; allowed: a number >= 0 (the ratio is clipped "
            "above at 1 + ratio_clip_max)"
        )
    for name in ("reference_policy_kl_penalty", "positive_example_nll_weight", "sampler_kl_penalty"):
        v = getattr(cfg, name)
        if not (math.isfinite(v) and v >= 0):
            p.append(f"{name}: got {v}; allowed: a finite number >= 0 (0 switches the term off)")
    for name in ("kl_input_clamp_value", "kl_output_clamp_value"):
        v = getattr(cfg, name)
        if v is not None and not v > 0:
            p.append(f"{name}: got {v}; allowed: a number > 0, or null (no clamp)")
    if cfg.record_every < 1:
        p.append(f"record_every: got {cfg.record_every}; allowed: an integer >= 1 (optimizer steps)")
    if not cfg.record_dir.strip():
        p.append(f"record_dir: got {cfg.record_dir!r}; allowed: a folder name")
    return p


def loss_type_problems(cfg: Any) -> list[str]:
    """The GSPO ratio, the dual clip and CISPO against the loss type."""
    p: list[str] = []
    if cfg.sequence_level_importance_ratios and cfg.token_level_loss:
        p.append(
            "sequence_level_importance_ratios: got true with token_level_loss: true; "
            "the GSPO ratio needs token_level_loss: false"
        )
    if cfg.ratio_clip_c is not None and not cfg.ratio_clip_c > 1:
        p.append(f"ratio_clip_c: got {cfg.ratio_clip_c}; allowed: a number > 1, or null")
    if cfg.use_cispo:
        for field, bad in (
            ("disable_ppo_ratio", cfg.disable_ppo_ratio),
            ("force_on_policy_ratio", cfg.force_on_policy_ratio),
            ("sequence_level_importance_ratios", cfg.sequence_level_importance_ratios),
        ):
            if bad:
                p.append(f"{field}: got true with use_cispo: true; allowed: false")
        if cfg.ratio_clip_c is not None:
            p.append(f"ratio_clip_c: got {cfg.ratio_clip_c} with use_cispo: true; allowed: null")
        if not cfg.token_level_loss:
            p.append("token_level_loss: got false with use_cispo: true; allowed: true")
    return p


def batch_normalization_problems(cfg: Any) -> list[str]:
    """Batch normalisation needs the weights it normalises applied."""
    p: list[str] = []
    if cfg.is_batch_normalization is not None and not cfg.use_importance_sampling_correction:
        p.append(
            f"is_batch_normalization: got {cfg.is_batch_normalization!r} with "
            "use_importance_sampling_correction: false; normalising weights that are not "
            "applied changes nothing: set use_importance_sampling_correction: true or "
            "is_batch_normalization: null"
        )
    return p
