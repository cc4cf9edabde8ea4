"""One-line mutants of the loss math and its reductions, for ``tests/mutation/run.py``.

Each mutant replaces one exact, unique piece of text in one file of ``nemo_rs_plugin/``. A
mutant whose old text is missing or ambiguous is an error of this list (the code moved on),
never a silent skip. Every mutant changes a number a user sees unless ``equivalent`` holds
the argument why it cannot.
"""

from __future__ import annotations

from typing import NamedTuple, Optional


class Mutant(NamedTuple):
    file: str  # relative to the repository root
    old: str  # exact text, must occur exactly once in the file
    new: str
    description: str
    equivalent: Optional[str] = None  # why no test can observe it, for equivalent mutants


C, L, P, D = (f"nemo_rs_plugin/{m}.py" for m in ("correction", "loss", "policy_loss", "distributed"))

MUTANTS: list[Mutant] = [
    # ---- filter bounds are inclusive (docs/guide.md#rejection-sampling)
    Mutant(
        C,
        "return (x >= lower) & (x <= upper)",
        "return (x >= lower) & (x < upper)",
        "sequence filter with both bounds: upper bound made exclusive",
    ),
    Mutant(
        C, "return x <= upper", "return x < upper", "sequence filter with an upper bound only: bound made exclusive"
    ),
    Mutant(C, "return x >= lower", "return x > lower", "sequence filter with a lower bound only: bound made exclusive"),
    # ---- filter statistics: KL(gen || prev) estimators from d = prev - gen
    Mutant(
        C,
        "return kl_estimate(d, metric[3:])",
        "return kl_estimate(-d, metric[3:])",
        "filters' KL statistics in the reverse direction (AReaL's k3 where VERL's is meant)",
    ),
    # ---- sequence aggregations
    Mutant(
        C,
        "keep = in_bounds(stats.sum(st.total) / (count + EPS), lo, hi)",
        "keep = in_bounds(stats.sum(st.total) / (count + 1.0), lo, hi)",
        "agg mean (Geo-RS) divides the log-ratio sum by n + 1",
    ),
    Mutant(
        C,
        "keep = in_bounds(stats.max(st.maximum), lo, hi)",
        "keep = in_bounds(stats.max(st.maximum), None, hi)",
        "agg max ignores its lower bound",
    ),
    Mutant(
        C,
        "keep = in_bounds(-stats.max(st.negated_minimum), lo, hi)",
        "keep = in_bounds(stats.max(st.negated_minimum), lo, hi)",
        "agg min compares the negated minimum",
    ),
    Mutant(
        C,
        "keep = in_bounds(stats.max(st.maximum), None, hi) & in_bounds(-stats.max(st.negated_minimum), lo, None)",
        "keep = in_bounds(stats.max(st.maximum), None, hi)",
        "agg any checks only the largest token (a low-side outlier passes)",
    ),
    Mutant(C, "return keep | (count == 0)", "return keep", "a sequence with no token left can be rejected"),
    Mutant(
        C,
        "keep = keep & (stats.sum(st.nonfinite) == 0)",
        "keep = keep & (stats.sum(st.nonfinite) >= 0)",
        "a non-finite log-ratio no longer rejects its sequence",
    ),
    Mutant(
        C,
        "alive_fin = alive * f_finite",
        "alive_fin = valid_bin * f_finite",
        "stage order lost: a sequence filter sums over tokens earlier token filters rejected",
    ),
    Mutant(
        C,
        "in_band = (1.0 - outside(stat, lo, hi)) * f_finite",
        "in_band = 1.0 - outside(stat, lo, hi)",
        "a token filter keeps tokens whose log-ratio is not finite",
    ),
    Mutant(
        C,
        "rejected = live * (~keep_s).to(fdtype)",
        "rejected = sm * (~keep_s).to(fdtype)",
        "seq_rejected_frac also counts sequences an earlier filter already rejected",
    ),
    # ---- counts behind rejection_denominator: kept
    Mutant(
        C,
        "kept_seq_count = (seq_in_loss * sm * has_tokens.to(fdtype)).sum()",
        "kept_seq_count = (seq_in_loss * sm).sum()",
        "kept_seq_count counts empty sequences",
    ),
    Mutant(
        C,
        "kept_tokens = kept_tokens * seq_kept",
        "kept_tokens = kept_tokens * 1.0",
        "kept_token_count counts the tokens of rejected sequences",
    ),
    # ---- IS weights per level
    Mutant(
        C,
        "return finite_exp(d) * d_finite",
        "return finite_exp(d)",
        "token IS weight 1 (not 0) where the log-ratio is not finite",
    ),
    Mutant(
        C,
        'seq_log_w = seq_d_sum if level == "sequence" else seq_d_sum / (seq_n + EPS)',
        'seq_log_w = seq_d_sum if level == "sequence_mean" else seq_d_sum / (seq_n + EPS)',
        "sequence and sequence_mean swapped (product vs geometric mean)",
    ),
    Mutant(
        C,
        "w = torch.where(seq_nonfinite == 0, finite_exp(seq_log_w), torch.zeros_like(seq_log_w))",
        "w = finite_exp(seq_log_w)",
        "sequence IS weight not 0 when a token's log-ratio is not finite",
    ),
    # ---- truncation
    Mutant(C, "lo = 0.0 if lo is None else lo", "lo = 0.0", "tis ignores truncated_importance_sampling_ratio_min"),
    Mutant(C, "clamped = raw_weight.clamp(lo, hi)", "clamped = raw_weight.clamp(lo, None)", "tis does not clamp above"),
    Mutant(
        C,
        "weight = raw_weight * (1.0 - oob)",
        "weight = raw_weight.clamp(lo, hi)",
        "icepop clamps instead of zeroing out-of-band weights",
    ),
    Mutant(
        C,
        "geo = torch.exp(seq_d_sum / (seq_ntok + EPS))",
        "geo = torch.exp(seq_d_sum)",
        "seq-mask-tis decides on the product, not the geometric mean",
    ),
    Mutant(
        C,
        "seq_in = ((geo >= lo) & (geo <= hi)).to(fdtype)",
        "seq_in = ((geo >= lo) & (geo < hi)).to(fdtype)",
        "seq-mask-tis upper bound made exclusive",
    ),
    # ---- IS weight metrics
    Mutant(
        C,
        'metrics["is_weight_sq_mean"] = (sum_w2 / (denom + EPS), norm, red)',
        'metrics["is_weight_sq_mean"] = (sum_w / (denom + EPS), norm, red)',
        "is_weight_sq_mean reports the mean weight",
    ),
    Mutant(
        C,
        "weighted = weight * loss_tokens",
        "weighted = weight * valid",
        "is_weight_mean counts rejected tokens with their weight",
    ),
    Mutant(
        C,
        'metrics["_ess_n"] = (unit_mask.sum(), "none", red)',
        'metrics["_ess_n"] = (torch.sign(weighted).sum(), "none", red)',
        "is_ess divides by the kept units instead of all units",
    ),
    # ---- the loss: denominators, IS weights, metrics
    Mutant(
        L,
        "gvs_loss = gvs * corr.kept_seq_count / n_seqs.clamp_min(EPS)",
        "gvs_loss = gvs * corr.kept_token_count / n_valid.clamp_min(EPS)",
        "rejection_denominator kept, token_level_loss false: sequences shrink by the kept token fraction",
    ),
    Mutant(
        L,
        "gvt_loss = gvt * corr.kept_token_count / n_valid.clamp_min(EPS)",
        "gvt_loss = gvt",
        "rejection_denominator kept leaves the token denominator unchanged",
    ),
    Mutant(
        L,
        "agg_mask = loss_tokens if self.token_level_loss else token_mask * keep",
        "agg_mask = loss_tokens if self.token_level_loss else token_mask",
        "sequence-level loss ignores rejection",
    ),
    Mutant(
        L,
        "weight = corr.is_weight if c.use_importance_sampling_correction else None",
        "weight = corr.is_weight",
        "IS weights applied with use_importance_sampling_correction false",
    ),
    Mutant(
        L,
        "usable = valid * inputs_finite if c.rejection_sampling else loss_tokens",
        "usable = loss_tokens",
        "with filters, sampling_importance_ratio (and NeMo-RL's token metrics) average over kept tokens only",
    ),
    Mutant(
        L,
        "value = (w_seq * sample_mask).sum() / (gvs + EPS)",
        "value = w_seq.sum() / (gvs + EPS)",
        "decoupled sampling_importance_ratio ignores sample_mask",
    ),
    Mutant(
        "nemo_rs_plugin/correction.py",
        'norm, red, denom = "sequences", "replicated", gvs',
        'norm, red, denom = "tokens", "replicated", gvs',
        "sequence-level IS metrics declared as normalized by tokens",
    ),
    Mutant(
        L,
        "loss = loss / torch.distributed.get_world_size(g)",
        "loss = loss",
        "sequence-level loss not split into per-rank shares (counted once per CP rank)",
    ),
    # ---- policy ratios, objective, KL penalty
    Mutant(
        P,
        "seq_log_ratio = _clamp_value(row_sum / (row_count + EPS), LOG_RATIO_CLAMP)",
        "seq_log_ratio = _clamp_value(row_sum, LOG_RATIO_CLAMP)",
        "GSPO ratio uses the sum, not the mean",
    ),
    # (Targets the signature, which main's rewrite of the body keeps: an early hard clamp.)
    Mutant(
        P,
        "def _clamp_value(x: torch.Tensor, bound: float) -> torch.Tensor:",
        "def _clamp_value(x: torch.Tensor, bound: float) -> torch.Tensor:\n    return x.clamp(-bound, bound)",
        "log-ratio clamp no longer straight-through: no gradient beyond +-20",
    ),
    Mutant(
        P,
        "ratios = torch.exp(_clamp_value(log_ratios, LOG_RATIO_CLAMP))",
        "ratios = torch.exp(log_ratios)",
        "token log-ratio not clamped at +-20",
    ),
    Mutant(
        P,
        "loss = torch.max(neg_adv * ratios, neg_adv * ratios_clamped)",
        "loss = torch.min(neg_adv * ratios, neg_adv * ratios_clamped)",
        "PPO takes the optimistic branch",
    ),
    Mutant(P, "return -log_ratio", "return log_ratio", "KL penalty k1 with the wrong sign"),
    Mutant(P, "return log_ratio.square() / 2", "return log_ratio.square()", "KL penalty k2 without the 1/2"),
    Mutant(
        P,
        "return torch.expm1(log_ratio) - log_ratio",
        "return torch.expm1(-log_ratio) + log_ratio",
        "KL penalty k3 in the reverse direction",
    ),
    Mutant(
        P,
        "weights = torch.lerp(weights.detach(), weights, free)",
        "weights = weights",
        "KL sampling weight not detached where the input clamp is active",
    ),
    # ---- reductions over the ranks that split a sequence
    Mutant(
        D,
        "dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)",
        "dist.all_reduce(sums, op=dist.ReduceOp.MAX, group=group)",
        "sequence statistics max-reduced, not summed",
    ),
    Mutant(
        D,
        "dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=group)",
        "dist.all_reduce(maxima, op=dist.ReduceOp.SUM, group=group)",
        "sequence maxima summed, not max-reduced",
    ),
    Mutant(
        D,
        "dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)",
        "pass",
        "differentiable all-reduce: backward does not sum the gradient over ranks",
    ),
    Mutant(
        "nemo_rs_plugin/metrics.py",
        "summed, maxed = reduce_sequence_statistics(summed.unsqueeze(0), maxed.unsqueeze(0), groups)",
        "summed, maxed = summed.unsqueeze(0), maxed.unsqueeze(0)",
        "metrics not reduced over the ranks (each rank reports its own part)",
    ),
    Mutant(
        "nemo_rs_plugin/metrics.py",
        "values = torch.where(is_min, -maxed, values)",
        "values = torch.where(is_min, maxed, values)",
        "reduced minimum metrics come back negated",
    ),
    Mutant(
        "nemo_rs_plugin/config.py",
        'return "sequence" if self.sequence_level_importance_ratios else "token"',
        'return "token"',
        "unset is_correction_level ignores the GSPO flag (NeMo-RL's sequence weight)",
    ),
    # ---- issue 9: peer statistics, log-ratio choice, advantage condition, batch normalisation
    Mutant(
        C,
        "return torch.exp(d.abs())",
        "return torch.exp(d)",
        "mult_prob_error reads exp(d), not exp(|d|) (NeMo-RL's seq_logprob_error)",
    ),
    Mutant(C, "return (p_b - p_a).abs()", "return p_b - p_a", "total_variation signed"),
    Mutant(
        C,
        "return p_b * (p_b / p_a).log() + (1.0 - p_b) * ((1.0 - p_b) / (1.0 - p_a)).log()",
        "return p_b * (p_b / p_a).log()",
        "binary_kl without its (1 - p) term",
    ),
    Mutant(
        C,
        'target_name, behaviour_name = log_ratio.split("-")',
        'behaviour_name, target_name = log_ratio.split("-")',
        "every non-default log_ratio reversed",
    ),
    Mutant(
        C,
        "st.keep_tok = in_band if eligible is None else 1.0 - (1.0 - in_band) * eligible",
        "st.keep_tok = in_band",
        "a token filter ignores negative_advantages_only",
    ),
    Mutant(
        C,
        "negative = (sanitize(advantages.detach()) < 0).to(fdtype)",
        "negative = (sanitize(advantages.detach()) <= 0).to(fdtype)",
        "a zero advantage counts as negative for OPSM",
    ),
    Mutant(
        C,
        "keep = keep * (1.0 - outcome.conditional_rows.unsqueeze(-1) * negative)",
        "keep = keep * (1.0 - outcome.conditional_rows.unsqueeze(-1))",
        "an advantage-conditioned sequence filter drops positive-advantage tokens too",
    ),
    Mutant(
        C,
        "newly = rejected * (1.0 - conditional) * torch.sign(negative_alive)",
        "newly = rejected * torch.sign(negative_alive)",
        "a second advantage-conditioned rejection of a row is counted again",
    ),
    Mutant(
        C,
        "rejected = rejected - conditional * stats.sum(st.negative)",
        "rejected = rejected",
        "a token filter is credited with tokens an earlier conditional rejection removed",
    ),
    Mutant(
        C,
        "factor = torch.where(mean > BATCH_MEAN_FLOOR, mean, torch.ones_like(mean))",
        "factor = mean",
        "batch normalisation divides by a zero mean",
    ),
    Mutant(
        C,
        'units = valid if level == "token" else sm * has_tokens.to(fdtype)',
        'units = valid if level == "token" else sm',
        "sequence batch mean counts empty sequences (slime's, not VERL's)",
    ),
    Mutant(
        C,
        'totals, groups, tokens_split=token_level, across_data_parallel=scope == "data_parallel"',
        'totals, groups, tokens_split=False, across_data_parallel=scope == "data_parallel"',
        "token batch totals not summed over the ranks that split the tokens",
    ),
    Mutant(
        D,
        "    if across_data_parallel and groups.data_parallel is not None:",
        "    if False:",
        "batch totals never reduced over the data-parallel group",
    ),
    Mutant(
        "nemo_rs_plugin/config.py",
        "        if len(where) > 1",
        "        if len(where) > 2",
        "two filters with one label are accepted (their metrics overwrite each other)",
    ),
    Mutant(
        "nemo_rs_plugin/correction.py",
        "ratio_mask = token_mask * inputs_finite * (1.0 - valid_bin + alive)",
        "ratio_mask = token_mask * inputs_finite",
        "GSPO ratio keeps the tokens a token filter rejected",
    ),
    # ---- equivalent
    Mutant(
        D,
        "sums = sums.clone()",
        "sums = sums",
        "statistics reduced in place in the caller's tensor",
        equivalent="every caller passes a temporary it never reads again: _StatPack.reduce a fresh "
        "torch.stack, MetricSet.finalize a fresh torch.where result, reduce_batch_totals a view of "
        "batch_normalize_weights' fresh torch.stack; reduce_sequence_statistics "
        "returns the reduced tensor either way",
    ),
]
