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


L, P, D, M, MS, IN, IC = (
    f"nemo_rs_plugin/core/{m}.py"
    for m in (
        "loss",
        "policy_loss",
        "distributed",
        "masking",
        "reporting/metrics",
        "batch/inputs",
        "batch/input_checks",
    )
)
# The objective (terms and their aggregation) and NeMo-RL's own metrics, out of loss.py.
OB, PM = "nemo_rs_plugin/core/loss_terms/objective.py", "nemo_rs_plugin/core/loss_terms/parity_metrics.py"
SAN = "nemo_rs_plugin/core/batch/sanitizing.py"  # the inputs' sanitising, out of inputs.py
MK = "nemo_rs_plugin/core/reporting/metric_kernels.py"  # the metrics' evaluation, out of metrics.py
CAT = "nemo_rs_plugin/core/reporting/metric_catalog.py"  # each metric's normalization and reduction
# The correction package: filter statistics and decisions, IS weights, the statistics and their
# reductions, the plan -> reduce -> apply pipeline.
CF, CW, CS, CP = (f"nemo_rs_plugin/core/correction/{m}.py" for m in ("filters", "weights", "statistics", "pipeline"))
IL = "nemo_rs_plugin/core/registries/is_levels.py"
FS = "nemo_rs_plugin/core/registries/filter_statistics.py"
# The NeMo-RL glue under the per-sequence packing wrapper.
GLUE, PACK, REC = (f"nemo_rs_plugin/nemo_rl/{m}.py" for m in ("loss_fn", "packing", "recording"))
VP = "nemo_rs_plugin/parallel/vocab_parallel.py"
RF = "nemo_rs_plugin/core/settings/rejection_filter.py"
# The registries of the sequence aggregations and of NeMo-RL's truncation types.
AG, TR = "nemo_rs_plugin/core/registries/aggregations.py", "nemo_rs_plugin/core/registries/truncation.py"
FO = "nemo_rs_plugin/core/registries/filter_options.py"  # applies_to, log_ratio, advantage_sign, rejection_denominator

MUTANTS: list[Mutant] = [
    # ---- filter bounds are inclusive (docs/guide.md#rejection-sampling): the one bound check
    Mutant(
        M,
        "return x != (x.clamp(lower, upper) if clamped is None else clamped)",
        "return (x != (x.clamp(lower, upper) if clamped is None else clamped)) | (x == upper)",
        "every bound check (filters, truncation, sequence decisions): upper bound made exclusive",
    ),
    Mutant(
        M,
        "return x != (x.clamp(lower, upper) if clamped is None else clamped)",
        "return (x != (x.clamp(lower, upper) if clamped is None else clamped)) | (x == lower)",
        "every bound check: lower bound made exclusive",
    ),
    Mutant(
        M,
        "        return x != x\n",
        "        return torch.zeros_like(x, dtype=torch.bool)\n",
        "a check without bounds passes NaN",
    ),
    # ---- filter statistics: KL(gen || prev) estimators from d = prev - gen
    Mutant(
        FS,
        'lambda d, target, behaviour: kl_estimate(d, "k3")',
        'lambda d, target, behaviour: kl_estimate(-d, "k3")',
        "filters' k3 statistic in the reverse direction (AReaL's k3 where VERL's is meant)",
    ),
    # ---- sequence aggregations
    Mutant(
        AG,
        "stat = s.total / (s.count + EPS)",
        "stat = s.total / (s.count + 1.0)",
        "agg mean (Geo-RS) divides the log-ratio sum by n + 1",
    ),
    Mutant(
        AG,
        "assert isinstance(s, MaximumStageStatistics)\n    return s.maximum, s.maximum",
        "return s.total, s.total  # type: ignore[union-attr]",
        "agg max compares the sum of the tokens' statistics",
    ),
    Mutant(
        AG,
        "    stat = -s.negated_minimum",
        "    stat = s.negated_minimum",
        "agg min compares the negated minimum",
    ),
    Mutant(
        CF,
        "reject = out_of_bounds(high, None, hi) | out_of_bounds(low, lo, None)",
        "reject = out_of_bounds(high, None, hi)",
        "agg any checks only the largest token (a low-side outlier passes)",
    ),
    Mutant(CF, "return reject & (s.count > 0)", "return reject", "a sequence with no token left can be rejected"),
    Mutant(
        CF,
        "reject = reject | (s.nonfinite > 0)",
        "reject = reject | (s.nonfinite < 0)",
        "a non-finite log-ratio no longer rejects its sequence",
    ),
    Mutant(
        CF,
        "alive_fin = alive * f_finite",
        "alive_fin = masks.valid_bin * f_finite",
        "stage order lost: a sequence filter sums over tokens earlier token filters rejected",
    ),
    Mutant(
        CF,
        "in_band = f_finite.masked_fill(out_of_bounds(stat, lo, hi), 0.0)",
        "in_band = torch.ones_like(f_finite).masked_fill(out_of_bounds(stat, lo, hi), 0.0)",
        "a token filter keeps tokens whose log-ratio is not finite",
    ),
    Mutant(
        CF,
        "rejected = torch.where(rejects, live, 0.0)",
        "rejected = torch.where(rejects, sample_mask, 0.0)",
        "seq_rejected_frac also counts sequences an earlier filter already rejected",
    ),
    # ---- counts behind rejection_denominator: kept
    Mutant(
        CP,
        "kept_tokens, kept_sequences = kept_per_row.sum(), in_loss @ has_tokens",
        "kept_tokens, kept_sequences = kept_per_row.sum(), in_loss.sum()",
        "kept_seq_count counts empty sequences",
    ),
    Mutant(
        CF,
        "kept_tokens = kept_tokens * seq_kept",
        "kept_tokens = kept_tokens * 1.0",
        "kept_token_count counts the tokens of rejected sequences",
    ),
    # ---- IS weights per level
    Mutant(
        CW,
        "return weight if d_finite is None else weight * d_finite",
        "return weight",
        "token IS weight 1 (not 0) where the log-ratio is not finite",
    ),
    Mutant(
        IL,
        "sequence_log_weight=lambda d_sum, n: d_sum / (n + EPS),",
        "sequence_log_weight=lambda d_sum, n: d_sum,",
        "sequence_mean's weight is the product, not the geometric mean",
    ),
    Mutant(
        CW,
        "return finite_exp(seq_log_w).masked_fill(stats.nonfinite > 0, 0.0).unsqueeze(-1)",
        "return finite_exp(seq_log_w).unsqueeze(-1)",
        "sequence IS weight not 0 when a token's log-ratio is not finite",
    ),
    # ---- truncation
    Mutant(
        TR,
        "lower = 0.0 if lower is None else lower",
        "lower = 0.0",
        "tis ignores truncated_importance_sampling_ratio_min",
    ),
    Mutant(
        TR,
        "clamped = w.clamp(lower, upper)",
        "clamped = w.clamp(lower, None)",
        "tis does not clamp above",
    ),
    Mutant(
        TR,
        "return w.masked_fill(oob, 0.0), oob.to(w.dtype)",
        "return w.clamp(lower, upper), oob.to(w.dtype)",
        "icepop clamps instead of zeroing out-of-band weights",
    ),
    Mutant(
        CW,
        "seq_mean_log_ratio = stats.d_sum / (stats.token_mask + EPS)",
        "seq_mean_log_ratio = stats.d_sum",
        "seq-mask-tis decides on the product, not the geometric mean",
    ),
    Mutant(
        TR,
        "oob = out_of_bounds(torch.exp(seq_mean_log_ratio), lower, upper)",
        "oob = out_of_bounds(torch.exp(seq_mean_log_ratio), None, upper)",
        "seq-mask-tis ignores its lower bound",
    ),
    # ---- IS weight metrics
    Mutant(
        CW,
        'metrics.add_total("is_weight_sq_mean", masked_sum(weight, applied))',
        'metrics.add_total("is_weight_sq_mean", applied.sum())',
        "is_weight_sq_mean reports the mean weight (token level)",
    ),
    Mutant(
        CW,
        "[applied, applied * applied],",
        "[applied, applied],",
        "is_weight_sq_mean reports the mean weight (sequence levels)",
    ),
    Mutant(
        CW,
        'metrics.add_total("is_weight_mean", applied.sum())',
        'metrics.add_total("is_weight_mean", masked_sum(weight, masks.valid))',
        "is_weight_mean counts rejected tokens with their weight",
    ),
    Mutant(
        CW,
        'metrics.add_total("_ess_units", masks.valid_total)',
        'metrics.add_total("_ess_units", torch.sign(loss_tokens).sum())',
        "is_ess divides by the kept units instead of all units",
    ),
    Mutant(
        MK,
        "return mean * mean / (units * sq_mean) if sq_mean > 0 and units > 0 else 0.0",
        "return mean / (units * sq_mean) if sq_mean > 0 and units > 0 else 0.0",
        "is_ess from the mean, not its square",
    ),
    # ---- the loss: denominators, IS weights, metrics
    Mutant(
        OB,
        "kept_seqs = seqs.kept_sequences / n_seqs.clamp_min(EPS)",
        "kept_seqs = seqs.kept_tokens / n_valid.clamp_min(EPS)",
        "rejection_denominator kept, token_level_loss false: sequences shrink by the kept token fraction",
    ),
    Mutant(
        OB,
        "kept = counts.tokens * kept_tokens if self.token_level_loss",
        "kept = counts.tokens if self.token_level_loss",
        "rejection_denominator kept leaves the token denominator unchanged",
    ),
    Mutant(
        OB,
        "agg_mask = loss_tokens if self.token_level_loss else token_mask * keep",
        "agg_mask = loss_tokens if self.token_level_loss else token_mask",
        "sequence-level loss ignores rejection",
    ),
    Mutant(
        OB,
        "weight = corr.is_weight if cfg.use_importance_sampling_correction else None",
        "weight = corr.is_weight",
        "IS weights applied with use_importance_sampling_correction false",
    ),
    Mutant(
        L,
        "usable = masks.where_inputs_finite(masks.valid) if cfg.rejection_sampling else loss_tokens",
        "usable = loss_tokens",
        "with filters, sampling_importance_ratio (and NeMo-RL's token metrics) average over kept tokens only",
    ),
    Mutant(
        PM,
        'metrics.add_masked_total("sampling_importance_ratio", w_seq, sample_mask)',
        'metrics.add_total("sampling_importance_ratio", w_seq.sum())',
        "decoupled sampling_importance_ratio ignores sample_mask",
    ),
    Mutant(
        CAT,
        'return MetricSpec("tokens" if per_token else "sequences", "sum" if per_token else "replicated", per_call)',
        'return MetricSpec("tokens", "sum" if per_token else "replicated", per_call)',
        "sequence-level IS metrics normalized by tokens (the catalog's unit of the IS level)",
    ),
    Mutant(
        OB,
        "loss = loss / torch.distributed.get_world_size(g)",
        "loss = loss",
        "sequence-level loss not split into per-rank shares (counted once per CP rank)",
    ),
    Mutant(
        PM,
        'metrics.add("kl_penalty", kl / objective.kl_coef)',
        'metrics.add("kl_penalty", kl)',
        "kl_penalty reported times the KL coefficient",
    ),
    Mutant(
        MK,
        "return value if not math.isfinite(value) else min(max(value, formula.low), formula.high)",
        "return value",
        "probs_ratio_clamped_min/max not clamped",
    ),
    Mutant(
        SAN,
        "inputs_finite = torch.rsub(any_bad, 1.0)",
        "inputs_finite = 1.0 - d_bad",
        "a token with a non-finite curr or reference log-prob stays in the loss",
    ),
    Mutant(
        IC,
        "return not math.isfinite(count) or count < 0 or below_own",
        "return not math.isfinite(count) or count < 0",
        "a global count below the microbatch's own, 0 included, is accepted (loss ~1e9 at 0)",
    ),
    # ---- the metric set: masked totals, normalisation, extrema
    Mutant(
        MK,
        "out.append(torch.dot(row.reshape(-1), flat))",
        "out.append(row.sum())",
        "masked totals ignore their mask (CPU form)",
    ),
    Mutant(
        MK,
        "parts.append(torch.stack(rows).reshape(len(rows), -1) @ flat_mask)",
        "parts.append(torch.stack(rows).reshape(len(rows), -1).sum(-1))",
        "masked totals ignore their mask (GPU form, rows given one by one)",
    ),
    Mutant(
        MK,
        "parts.append(matrix.reshape(matrix.shape[0], -1) @ flat_mask)",
        "parts.append(matrix.reshape(matrix.shape[0], -1).sum(-1))",
        "masked totals ignore their mask (GPU form, rows given stacked: the non-finite counts)",
    ),
    Mutant(
        MK,
        "return (v + p).amin(-1), (v - p).amax(-1)",
        "return v.amin(-1), (v - p).amax(-1)",
        "min metrics range over masked tokens too (GPU form; the maxima stay masked)",
    ),
    Mutant(
        MK,
        "return (values + penalty).amin(), (values - penalty).amax()",
        "return values.amin(), (values - penalty).amax()",
        "min metrics range over masked tokens too (CPU form; the maxima stay masked)",
    ),
    Mutant(
        MK,
        "if known is mask and dtype == row.dtype:",
        "if dtype == row.dtype:",
        "a row reduced over the first mask of its dtype, not its own (the per-call cast cache keyed on dtype alone)",
    ),
    Mutant(
        MS,
        "vector[start:end].div_(self.counts.divisor(bucket))",
        "vector[start:end]",
        "normalized totals not divided by their global count",
    ),
    Mutant(
        MS,
        "vector[start:end].div_(self.counts.divisor(bucket))",
        'vector[start:end].div_(self.counts.divisor("sequences" if bucket == "tokens" else "tokens"))',
        "token metrics divided by the sequence count and vice versa",
    ),
    Mutant(
        MK,
        "return (v + p).amin(-1), (v - p).amax(-1)",
        "return v.amin(-1), v.amax(-1)",
        "min/max metrics range over masked tokens too (GPU form)",
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
        "value = torch.maximum(unclipped, clipped)",
        "value = torch.minimum(unclipped, clipped)",
        "PPO takes the optimistic branch",
    ),
    Mutant(P, 'k1":\n        return -log_ratio', 'k1":\n        return log_ratio', "KL penalty k1 with the wrong sign"),
    Mutant(P, "return log_ratio.square() / 2", "return log_ratio.square()", "KL penalty k2 without the 1/2"),
    Mutant(
        P,
        "k3 = torch.expm1(log_ratio)\n",
        "log_ratio = -log_ratio\n        k3 = torch.expm1(log_ratio)\n",
        "KL penalty k3 in the reverse direction",
    ),
    Mutant(
        P,
        "slope = slope.masked_fill_(clamped_away, 0.0)",
        "slope = slope",
        "KL gradient not stopped where the input clamp is active",
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
        MK,
        "summed, maxed = reduce_sequence_statistics(summed.unsqueeze(0), maxed.unsqueeze(0), groups)",
        "summed, maxed = summed.unsqueeze(0), maxed.unsqueeze(0)",
        "metrics not reduced over the ranks (each rank reports its own part)",
    ),
    Mutant(
        MK,
        "return torch.where(is_min, -maxed, values)",
        "return torch.where(is_min, maxed, values)",
        "reduced minimum metrics come back negated",
    ),
    Mutant(
        "nemo_rs_plugin/core/settings/config.py",
        'level = "sequence" if self.sequence_level_importance_ratios else "token"',
        'level = "token"',
        "unset is_correction_level ignores the GSPO flag (NeMo-RL's sequence weight)",
    ),
    # ---- the peer modes: peer statistics, log-ratio choice, advantage condition, batch normalisation
    Mutant(
        FS,
        "lambda d, target, behaviour: torch.exp(d.abs())",
        "lambda d, target, behaviour: torch.exp(d)",
        "mult_prob_error reads exp(d), not exp(|d|) (NeMo-RL's seq_logprob_error)",
    ),
    Mutant(FS, "return (p_b - p_a).abs()", "return p_b - p_a", "total_variation signed"),
    Mutant(
        FS,
        "return p_b * (p_b / p_a).log() + (1.0 - p_b) * ((1.0 - p_b) / (1.0 - p_a)).log()",
        "return p_b * (p_b / p_a).log()",
        "binary_kl without its (1 - p) term",
    ),
    Mutant(
        CF,
        "target_raw = getattr(log_probs, log_ratio.target).detach()",
        "target_raw = getattr(log_probs, log_ratio.behaviour).detach()",
        "every non-default log_ratio reversed",
    ),
    Mutant(
        CF,
        "keep_tok = in_band if eligible is None else 1.0 - (1.0 - in_band) * eligible",
        "keep_tok = in_band",
        "a token filter ignores advantage_sign",
    ),
    Mutant(
        CP,
        "negative = (clean_advantages < 0).to(d.dtype)",
        "negative = (clean_advantages <= 0).to(d.dtype)",
        "a zero advantage counts as negative for OPSM",
    ),
    Mutant(
        CP,
        "keep = keep * (1.0 - outcome.conditional_rows.unsqueeze(-1) * plan.negative)",
        "keep = keep * (1.0 - outcome.conditional_rows.unsqueeze(-1))",
        "an advantage-conditioned sequence filter drops positive-advantage tokens too",
    ),
    Mutant(
        CF,
        "newly = rejected * (1.0 - conditional) * torch.sign(negative_alive)",
        "newly = rejected * torch.sign(negative_alive)",
        "a second advantage-conditioned rejection of a row is counted again",
    ),
    Mutant(
        CF,
        "rejected = rejected - conditional * s.rejected_negative",
        "rejected = rejected",
        "a token filter is credited with tokens an earlier conditional rejection removed",
    ),
    Mutant(
        CS,
        "factor = torch.where(mean > BATCH_MEAN_FLOOR, mean, torch.ones_like(mean))",
        "factor = mean",
        "batch normalisation divides by a zero mean",
    ),
    Mutant(
        CP,
        "weight_units = sample_mask * has_tokens",
        "weight_units = sample_mask",
        "per-sequence IS units count empty sequences (the batch mean slime's, not VERL's; the weight metrics too)",
    ),
    Mutant(
        CS,
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
        "nemo_rs_plugin/core/settings/config_problems.py",
        "        if len(where) > 1",
        "        if len(where) > 2",
        "two filters with one label are accepted (their metrics overwrite each other)",
    ),
    Mutant(
        CP,
        "ratio_mask = masks.where_inputs_finite(masks.token_mask) * (1.0 - masks.valid_bin + alive)",
        "ratio_mask = masks.where_inputs_finite(masks.token_mask)",
        "GSPO ratio keeps the tokens a token filter rejected",
    ),
    # ---- bands from measured log-probs, and the warning when rejection eats the batch
    Mutant(
        "nemo_rs_plugin/core/correction/calibration.py",
        "k = math.floor(per_side * low_values.numel() + 1e-9)",
        "k = math.floor(per_side * low_values.numel() + 1e-9) + 1",
        "the calibrated band rejects one unit more than the target on each side",
    ),
    Mutant(
        "nemo_rs_plugin/core/correction/calibration.py",
        "        if widen_only:",
        "        if False:",
        "calibration narrows a band below the template's (a near-zero mismatch gives [1.000, 1.000])",
    ),
    Mutant(
        "nemo_rs_plugin/core/reporting/health.py",
        "        if share <= self.threshold:",
        "        if share < 2 * self.threshold:",
        "the run-time warning waits for twice the unhealthy share",
    ),
    Mutant(
        "nemo_rs_plugin/core/correction/filters.py",
        "metrics.add_total(DROPPED_SEQUENCES, dropped @ sample_mask)",
        "metrics.add_total(DROPPED_SEQUENCES, 0 * dropped @ sample_mask)",
        "the run-time monitor never sees a dropped sequence",
    ),
    # ---- equivalent
    Mutant(
        D,
        "sums = sums.clone()",
        "sums = sums",
        "statistics reduced in place in the caller's tensor",
        equivalent="every caller passes a temporary it never reads again: SequenceStatistics.reduce a fresh "
        "torch.stack, MetricSet.finalize a fresh torch.where result, reduce_batch_totals a view of "
        "batch_normalize_weights' fresh torch.stack; reduce_sequence_statistics "
        "returns the reduced tensor either way",
    ),
    # ---- issue 20: prime-rl's DPPO / IPO (tests/core/test_peer_modes_prime_rl_ms_swift.py)
    Mutant(
        CP,
        "positive = (clean_advantages > 0).to(d.dtype)",
        "positive = (clean_advantages < 0).to(d.dtype)",
        "advantage_sign: positive conditions on the negative-advantage tokens (DPPO's sides swapped)",
    ),
    Mutant(
        OB,
        "sampler_kl = self.aggregate(diff.square(), agg)",
        "sampler_kl = self.aggregate(diff.abs(), agg)",
        "the penalty toward the sampler loses its square (|curr - gen| instead of (curr - gen)^2)",
    ),
    Mutant(
        OB,
        "sampler_kl = self.aggregate(diff.square(), agg)",
        "sampler_kl = self.aggregate((clean.curr - clean.gen).square() * (1.0 if corr.policy_gradient_keep is None "
        "else corr.policy_gradient_keep), agg)",
        "policy-gradient-only filters also remove the penalty toward the sampler (prime-rl keeps it)",
    ),
    Mutant(
        FS,
        "return _given(target).exp() - _given(behaviour).exp()",
        "return _given(behaviour).exp() - _given(target).exp()",
        "prob_diff reads p_b - p_a (p_gen - p_curr): DPPO's trust region on the wrong side",
    ),
    # ---- the eager CPU form's host reads (finite inputs used as given), the integer token_mask check
    Mutant(
        SAN,
        "return bool(torch.isfinite(totals).all())",
        "return True",
        "every input read as finite: NaN and inf reach the loss unsanitised",
    ),
    Mutant(
        IC,
        "if found.token_mask_min < 0 or found.token_mask_max > 1:",
        "if found.token_mask_min < 0 or found.token_mask_max > 2:",
        "an integer token_mask holding 2 passes",
    ),
    Mutant(
        M,
        "return row_dot(self.valid_bin, 1.0 - self.d_finite)",
        "return torch.zeros_like(self.sample_mask)",
        "a sequence with a non-finite log-ratio is not counted as such (sequence IS levels weight it)",
    ),
    Mutant(
        M,
        "return x if self.all_finite else x * self.inputs_finite",
        "return x",
        "tokens with a non-finite input stay in the loss's token set",
    ),
    # ---- the closed-form gradients of the objective and the KL penalty (policy_loss.with_slope)
    Mutant(
        P,
        "slope = (unclipped >= clipped).to(neg_adv.dtype).mul_(neg_adv)",
        "slope = (unclipped > clipped).to(neg_adv.dtype).mul_(neg_adv)",
        "PPO gradient lost inside the clip range (where both branches are equal)",
    ),
    Mutant(
        P,
        "binding = (value > bound).to(slope.dtype) + 0.5 * (value == bound)",
        "binding = (value > bound).to(slope.dtype)",
        "dual clip: a token exactly on -c A keeps its whole gradient (autograd's min halves it)",
    ),
    Mutant(P, "return log_ratio * (log_ratio / 2 - 1)", "return log_ratio * (log_ratio - 1)", "KL k2 gradient of x^2"),
    Mutant(P, 'k3":\n        return -log_ratio', 'k3":\n        return log_ratio', "KL k3 gradient, wrong sign"),
    Mutant(
        P,
        "slope = slope.masked_fill_((kl.abs() <= output_clamp).logical_not_(), 0.0)",
        "slope = slope.masked_fill_((kl.abs() < output_clamp).logical_not_(), 0.0)",
        "KL output clamp stops the gradient on its bound too (a clamp passes it there)",
    ),
    Mutant(P, "return 1 - log_ratio", "return -log_ratio", "KL k1 gradient without the weight's own term"),
    Mutant(
        P,
        "kl, slope = kl * weights, slope * weights",
        "kl = kl * weights",
        "on-policy KL approximation: the gradient misses its sampling weight",
    ),
    Mutant(
        P,
        "slope = slope.masked_fill_((kl.abs() <= output_clamp).logical_not_(), 0.0)",
        "slope = slope.mul_(kl.abs() <= output_clamp)",
        "KL output clamp stops an overflowed gradient by a product: 0 * inf = NaN",
    ),
    # ---- sequence packing: the microbatch totals a per-sequence call reads (tests/nemo_rl/test_packing.py)
    Mutant(
        L,
        "totals = microbatch if microbatch is not None else self.objective.totals_of(corr, masks, x.rewards)",
        "totals = self.objective.totals_of(corr, masks, x.rewards)",
        "a per-sequence call uses its own kept fractions and NLL count instead of the microbatch's",
    ),
    Mutant(
        CP,
        "weight, factor = weight / batch_norm_factor, batch_norm_factor",
        "weight, factor = weight, batch_norm_factor",
        "the microbatch's batch-normalisation factor is not applied to a per-sequence call",
    ),
    Mutant(
        OB,
        "correct_count = token_count @ (rewards > 0).to(token_count.dtype)",
        "correct_count = token_count.sum()",
        "the NLL divides by every valid token instead of the correct samples' tokens",
    ),
    Mutant(
        CW,
        "low = torch.count_nonzero((raw_weight + penalty) < 1.0 / WEIGHT_TAIL)",
        "low = torch.count_nonzero((raw_weight + penalty) < WEIGHT_TAIL)",
        "is_weight_raw_low_frac counts weights below C instead of below 1/C",
    ),
    Mutant(
        CW,
        "high = torch.count_nonzero((raw_weight - penalty) > WEIGHT_TAIL)",
        "high = torch.count_nonzero((raw_weight + penalty) > WEIGHT_TAIL)",
        "is_weight_raw_high_frac counts masked units (the penalty's sign)",
    ),
    Mutant(
        MS,
        "(report.public if per_call else report.public_per_call_off)",
        "report.public",
        "the NeMo-RL loss returns the per-call metrics, which NeMo-RL then sums",
    ),
    # ---- sequence packing: the wrapper's calls gathered into one (nemo_rs_plugin/nemo_rl/packing.py)
    Mutant(
        PACK,
        "logprobs = stack(kept_logprobs, lambda r, i: width - 1)",
        "logprobs = stack(kept_logprobs[::-1], lambda r, i: width - 1)",
        "the gathered sequences' log-probs stacked in the wrong rows",
    ),
    Mutant(
        PACK,
        "lambda done: LossInputs.stack_rows(done.rows))",
        "lambda done: LossInputs.stack_rows(done.rows[-1:]))",
        "logits as input: the gathered microbatch holds only its last sequence",
    ),
    Mutant(
        IN,
        "rows = [r if r.shape[-1] == w else F.pad(r, (0, w - r.shape[-1])) for r, w in zip(rows, widths)]",
        "rows = [r if r.shape[-1] == w else F.pad(r, (0, w - r.shape[-1]), value=1.0) for r, w in zip(rows, widths)]",
        "stacked sequences padded with ones: the padding counts as tokens of weight 1",
    ),
    Mutant(
        GLUE,
        "if packed is not None and packed.sequence_index is not None:\n            # Each call makes",
        "if False:\n            # Each call makes",
        "logits as input: every per-sequence call computed alone with the microbatch totals (the old path)",
    ),
    Mutant(
        PACK,
        "return WrapperCall(id(self), self.sequences, self.microbatch, index if self._readable else None)",
        "return WrapperCall(id(self), self.sequences, self.microbatch, None)",
        "the seam's position never used: every per-sequence call computed alone (refusals where it gathers)",
    ),
    Mutant(
        PACK,
        "if k not in full and isinstance(v, torch.Tensor) and v.dim() == 2",
        "if False",
        "what the preparation added per sequence (curr_logprobs_unfiltered) dropped from the gathered call",
    ),
    Mutant(
        GLUE,
        "return next_token_logprobs.new_zeros((), dtype=dtype), {}",
        "return next_token_logprobs.new_zeros(()), {}",
        "the wrapper sums into a zero of the log-probs' dtype, not the loss's (float32 for a float64 loss)",
    ),
    # ---- recording for calibration (nemo_rs_plugin/nemo_rl/recording.py)
    Mutant(
        REC,
        "if state.step % self.every:",
        "if False:",
        "every optimizer step recorded, not every record_every-th",
    ),
    Mutant(
        REC,
        "if state.last is not None and mask is not None and state.last() is mask:",
        "if False:",
        "the per-sequence wrapper's microbatch recorded once per sequence",
    ),
    Mutant(
        GLUE,
        "if packed is not None and is_microbatch(packed.microbatch, packed.sequences):",
        "if False:",
        "each packed sequence's call recorded as its own microbatch (killed by the slow test_recording case)",
    ),
    # ---- issue 40: log-probs from logits in chunks of positions
    Mutant(
        VP,
        "logprobs = ranks[:, 2].sum(0) + (shifts.gather(0, holder).squeeze(0) - top) - lse_minus_top",
        "logprobs = ranks[:, 2].sum(0) - lse_minus_top",
        "TP: the target logit taken relative to the global maximum without the holder's shift",
    ),
    Mutant(
        VP,
        "p.sub_(lse_minus_shift[:, s:e].unsqueeze(-1)).exp_()",
        "p.sub_(lse_minus_shift[:, s : s + 1].unsqueeze(-1)).exp_()",
        "backward: every position of a chunk normalised by the chunk's first log-sum-exp",
    ),
    Mutant(
        VP,
        "        ctx.save_for_backward(logits, shift, lse_minus_shift, local_idx, valid, held, bad)",
        "        ctx.save_for_backward(logits.float() * 1, shift, lse_minus_shift, local_idx, valid, held, bad)",
        "a float32 copy of the logits saved for backward (the memory the chunking removed)",
    ),
    Mutant(
        VP,
        'top = top.masked_fill(top == float("-inf"), 0.0)\n',
        'top = top.masked_fill(top == float("-inf"), 0.0).clamp_min(0.0)\n',
        "TP: the maximum over the vocabulary floored at 0 (a shard of -inf read as 0): +inf log-probs below -87",
    ),
    Mutant(
        VP,
        "        logprobs = logprobs.masked_fill(~valid, 0.0)\n",
        "",
        "a target outside the vocabulary gets a log-prob, not NeMo-RL's 0",
    ),
    Mutant(
        GLUE,
        '    value = prepare_keywords.get("chunk_size")',
        "    value = None",
        "NeMo-RL's policy.logprob_chunk_size ignored (killed by the slow test_real_megatron case)",
    ),
    # ---- issue 41: what NeMo-RL's training loop does with the metric names
    Mutant(
        "nemo_rs_plugin/core/registries/aggregations.py",
        '"max",\n            "largest",',
        '"max",\n            "max",',
        "agg max/min in default labels: NeMo-RL leaves those shares undivided by the global batches",
    ),
    # ---- issue 32: the filter-statistic registry (one entry per statistic)
    Mutant(
        FS,
        "lambda d, target, behaviour: torch.expm1(d).square()",
        "lambda d, target, behaviour: torch.expm1(-d).square()",
        "chi2 of the reverse ratio: (1/r - 1)^2 instead of (r - 1)^2",
    ),
    Mutant(
        FS,
        "            reaches=(True, False),\n            needs_probabilities=True,\n            clamped=True,",
        "            needs_probabilities=True,\n            clamped=True,",
        "total_variation's upper end counted as reached: a lower bound of 1 is not flagged as rejecting all",
    ),
    Mutant(
        FS,
        "            sequence_words=_RATIO_SEQUENCE_WORDS,\n            log_space=True,",
        "            sequence_words=_RATIO_SEQUENCE_WORDS,",
        "ratio bounds compared as ratios, not as logs (the registry's log_space flag)",
    ),
    # ---- issue 42: the lab's statistics and its confirmatory protocol (tools/, not the loss: the
    # numbers the docs' advice quotes)
    Mutant(
        "nemo_rs_plugin/lab/stats.py",
        "ttest_1samp(d, 0.0).confidence_interval(confidence_level=level)",
        "ttest_1samp(d, 0.0).confidence_interval(confidence_level=0.9)",
        "the paired interval at 90% whatever level is asked",
    ),
    Mutant(
        "nemo_rs_plugin/lab/stats.py",
        'method="holm"',
        'method="bonferroni"',
        "Bonferroni in place of Holm",
    ),
    Mutant(
        "nemo_rs_plugin/lab/stats.py",
        "binomtest(only_a, only_a + only_b, 0.5).pvalue",
        'binomtest(only_a, only_a + only_b, 0.5, alternative="greater").pvalue',
        "a one-sided McNemar test",
    ),
    Mutant(
        "nemo_rs_plugin/lab/stats.py",
        'alternative="two-sided")\n    return max',
        'alternative="larger")\n    return max',
        "the power plan sized for a one-sided test",
    ),
    Mutant(
        "nemo_rs_plugin/lab/dose.py",
        '"eval_auc": sum(evals) / len(evals) if evals else math.nan',
        '"eval_auc": sum(last) / len(last) if last else math.nan',
        "eval_auc is the final evaluation again, not the whole run's",
    ),
    Mutant(
        "nemo_rs_plugin/lab/confirm.py",
        'holm([r["p"] for r in rows])',
        '[min(1.0, r["p"]) for r in rows]',
        "the primary family left uncorrected",
    ),
    Mutant(
        "nemo_rs_plugin/lab/confirm.py",
        "protocol.alpha / m, protocol.power)",
        "protocol.alpha, protocol.power)",
        "the power plan ignores the multiple-comparison correction",
    ),
    Mutant(
        "nemo_rs_plugin/lab/confirm.py",
        "inside = -delta < tost_low and tost_high < delta",
        "inside = True",
        "'equivalent' said without the interval inside the smallest effect",
    ),
    Mutant(
        VP,
        "            p.masked_fill_(bad[:, s:e].unsqueeze(-1), 0.0)\n",
        "",
        "a NaN/+inf logit's row keeps its NaN softmax in the backward (issue 49: NaN gradient, finite loss)",
    ),
    Mutant(
        VP,
        "bad_parts.append(torch.isfinite(m).logical_not_().squeeze(-1))",
        "bad_parts.append(torch.isnan(m).squeeze(-1))",
        "a row of +inf logits, or of -inf only, not counted as non-finite (its NaN log-prob unflagged)",
    ),
    Mutant(
        VP,
        "    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)",
        "    return parts[0]",
        "several chunks: only the first chunk's positions kept (the shapes disagree past it)",
    ),
    Mutant(
        VP,
        "        target_grad = grad if ctx.held_is_valid else grad * held",
        "        target_grad = grad",
        "TP: the target's gradient added on every rank, not only on the one holding the target",
    ),
    # ---- the filter options' registries (core/registries/filter_options.py): each flag is what the loss does
    Mutant(
        FO,
        'Scope("policy_gradient", False, "policy_gradient")',
        'Scope("policy_gradient", True, "policy_gradient")',
        "applies_to: policy_gradient removes the rejected token from the loss (penalties included)",
    ),
    Mutant(
        FO,
        'AdvantageSign("negative", -1.0)',
        'AdvantageSign("negative", 1.0)',
        "advantage_sign: negative rejects the positive-advantage tokens",
    ),
    Mutant(
        FO,
        'Denominator("kept", True)',
        'Denominator("kept", False)',
        "rejection_denominator: kept divides by the original counts",
    ),
    Mutant(
        PM,
        '"gen_kl_error",\n    "policy_kl_error",',
        '"policy_kl_error",\n    "gen_kl_error",',
        "gen_kl_error and policy_kl_error swapped",
    ),
    Mutant(
        FO,
        'LogRatio("curr-gen", "curr", "gen", False, True, False, "curr-gen")',
        'LogRatio("curr-gen", "curr", "gen", False, False, False, "curr-gen")',
        "a filter on the current policy is taken as computable from recorded log-probs (calibrate, kept totals)",
    ),
]
