"""Off-policy correction: IS weights at a chosen level, truncation, and rejection sampling.

Problem: the log-probs reported by the inference engine (``gen``) differ from the training
engine's (``prev``): kernel and precision mismatch, MoE routing, staleness in async runs.
With ``d = prev - gen`` per token, the IS weight ``pi_prev / pi_gen`` corrects the policy
gradient; truncation bounds its variance; rejection sampling drops tokens or sequences whose
mismatch is too large to correct.

Entry points (all pure torch; no NeMo-RL, no Megatron, no ``.item()``):

* :func:`token_filter_statistic`, :func:`filter_log_ratio`, :func:`in_bounds`: token-level
  building blocks.
* :func:`compute_correction`: the whole pipeline. It computes every per-sequence statistic
  locally, passes all of them through **one** call of
  :func:`~nemo_rs_plugin.distributed.reduce_sequence_statistics` (one SUM and one MAX
  all-reduce when sequences are sharded), and only then derives masks and weights.
* :func:`batch_normalize_weights`: IS weights over their batch mean (one more SUM of two
  numbers, over the data-parallel group too when asked).

IS weights and masks are detached: they change the measure the gradient is estimated under,
not the objective being differentiated.
See: docs/guide.md#is-correction-level, docs/guide.md#rejection-sampling, docs/guide.md#filter-statistics
and docs/guide.md#batch-normalisation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch

from nemo_rs_plugin.config import RejectionFilter, RSClippedPGLossConfig
from nemo_rs_plugin.distributed import (
    NO_GROUPS,
    SequenceGroups,
    reduce_batch_totals,
    reduce_sequence_statistics,
)
from nemo_rs_plugin.masking import (
    EPS,
    extrema_penalty,
    finite_exp,
    masked_extrema,
    masked_sum,
    nonfinite,
    outside,
    sanitize,
)
from nemo_rs_plugin.policy_loss import kl_estimate

__all__ = [
    "BATCH_MEAN_FLOOR",
    "CorrectionResult",
    "PolicyLogProbs",
    "PROBABILITY_CLAMP",
    "batch_normalize_weights",
    "is_weights",
    "truncate_weights",
    "compute_correction",
    "filter_log_ratio",
    "in_bounds",
    "token_filter_statistic",
    "finite_exp",
]

# Probability-space statistics clamp the sampled token's probabilities to [1e-6, 1 - 1e-6]
# (OpenRLHF's clamp), which keeps both logs of the binary KL finite.
PROBABILITY_CLAMP = 1e-6
# A batch mean at or below this leaves the weights unnormalised (VERL and slime's guard).
BATCH_MEAN_FLOOR = 1e-8


@dataclass
class PolicyLogProbs:
    """Detached per-token log-probs a filter's ``log_ratio`` may compare, ``[B, T]`` each.

    Raw values (non-finite entries included): :func:`filter_log_ratio` sanitises them and
    marks where the log-ratio was not finite. ``prev`` is ``curr`` under a forced on-policy
    ratio.
    """

    curr: torch.Tensor
    prev: torch.Tensor
    gen: torch.Tensor


def in_bounds(x: torch.Tensor, lower: Optional[float], upper: Optional[float]) -> torch.Tensor:
    """Boolean ``lower <= x <= upper`` (a ``None`` bound is open; NaN is out of bounds)."""
    if lower is None and upper is None:
        return x == x  # everything but NaN
    if lower is None:
        return x <= upper
    if upper is None:
        return x >= lower
    return (x >= lower) & (x <= upper)


def token_filter_statistic(
    d: torch.Tensor,
    metric: str,
    target: Optional[torch.Tensor] = None,
    behaviour: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Per-token statistic of a filter, from ``d = target - behaviour`` (log-probs).

    ``ratio`` is returned in log space (``d`` itself; bounds are compared as ``log``);
    ``kl_k1 = -d``, ``kl_k2 = d^2/2``, ``kl_k3 = exp(d) - 1 - d`` estimate
    KL(behaviour || target); ``mult_prob_error = exp(|d|)``. The probability-space
    statistics read ``p_a = exp(target)`` and ``p_b = exp(behaviour)``, both clamped to
    ``[1e-6, 1 - 1e-6]``: ``binary_kl = p_b log(p_b/p_a) + (1-p_b) log((1-p_b)/(1-p_a))``,
    ``total_variation = |p_b - p_a|``.
    """
    if metric == "ratio":
        return d
    if metric in ("kl_k1", "kl_k2", "kl_k3"):
        return kl_estimate(d, metric[3:])
    if metric == "mult_prob_error":
        return torch.exp(d.abs())
    if metric in ("binary_kl", "total_variation"):
        if target is None or behaviour is None:
            raise ValueError(f"metric {metric!r} needs the target and behaviour log-probs")
        p_a = target.exp().clamp(PROBABILITY_CLAMP, 1.0 - PROBABILITY_CLAMP)
        p_b = behaviour.exp().clamp(PROBABILITY_CLAMP, 1.0 - PROBABILITY_CLAMP)
        if metric == "total_variation":
            return (p_b - p_a).abs()
        return p_b * (p_b / p_a).log() + (1.0 - p_b) * ((1.0 - p_b) / (1.0 - p_a)).log()
    raise ValueError(
        f"metric: got {metric!r}; allowed: ratio, kl_k1, kl_k2, kl_k3, mult_prob_error, binary_kl, total_variation"
    )


def filter_log_ratio(
    log_ratio: str,
    d: torch.Tensor,  # [B, T] prev - gen, sanitised
    d_finite: torch.Tensor,  # [B, T] 0/1
    log_probs: Optional[PolicyLogProbs],
    needs_log_probs: bool,
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """``(d, d_finite, target, behaviour)`` for a filter's ``log_ratio`` ``"a-b"``.

    ``d = log pi_a - log pi_b`` with non-finite entries replaced by 0 and ``d_finite`` the
    0/1 mask of where it was finite; ``target``/``behaviour`` are the sanitised log-probs of
    ``a`` and ``b`` (``None`` unless ``needs_log_probs``). ``prev-gen`` reuses the loss's
    ``d``; the others read :class:`PolicyLogProbs`.
    """
    target_name, behaviour_name = log_ratio.split("-")
    if log_ratio != "prev-gen" or needs_log_probs:
        if log_probs is None:
            raise ValueError(
                f"log_ratio {log_ratio!r}: this filter needs the policies' log-probs "
                "(compute_correction(..., log_probs=PolicyLogProbs(...)))"
            )
        target_raw = getattr(log_probs, target_name).detach()
        behaviour_raw = getattr(log_probs, behaviour_name).detach()
        target, behaviour = sanitize(target_raw), sanitize(behaviour_raw)
    else:
        target = behaviour = None
    if log_ratio == "prev-gen":
        return d, d_finite, target, behaviour
    d_raw = target_raw - behaviour_raw
    return sanitize(d_raw), 1.0 - nonfinite(d_raw), target, behaviour


def _log_bound(v: Optional[float]) -> Optional[float]:
    if v is None:
        return None
    return -math.inf if v == 0 else math.log(v)


def _filter_bounds(f: RejectionFilter) -> tuple[Optional[float], Optional[float]]:
    """Bounds in the space the statistic lives in (log space for ratios)."""
    if f.metric == "ratio":
        return _log_bound(f.lower), _log_bound(f.upper)
    return f.lower, f.upper


@dataclass
class CorrectionResult:
    """What the loss needs from the correction layer; every tensor is detached.

    Attributes:
        is_weight: ``[B, T]`` or ``[B, 1]`` IS weight after truncation (1 where unused).
        keep: ``[B, T]`` float, 1 for units kept by rejection sampling and finite inputs.
        loss_tokens: ``[B, T]`` ``valid * keep``, the tokens that reach the loss.
        seq_token_count: ``[B]`` valid tokens per sequence over all ranks (``sum_t m``);
            ``None`` when :func:`needs_sequence_statistics` is false, like the next three.
        seq_mask_count: ``[B]`` ``token_mask`` tokens per sequence over all ranks.
        kept_token_count: ``[]`` kept valid tokens over all ranks (for ``kept`` denominators).
        kept_seq_count: ``[]`` kept valid sequences.
        ratio_mask: ``[B, T]`` the tokens the GSPO ratio averages over: ``token_mask`` tokens
            with finite inputs, less valid tokens a token filter rejected (``None`` without
            the GSPO ratio; with no token filter it is NeMo-RL's mask).
        ratio_token_count: ``[B]`` ``ratio_mask`` tokens per sequence over all ranks: the GSPO
            ratio's denominator.
        usable_bin: ``[B, T]`` float 0/1, valid tokens whose log-prob inputs are all finite.
        usable_penalty: :func:`~nemo_rs_plugin.masking.extrema_penalty` of ``usable_bin``.
        metrics: name -> (0-dim tensor, normalization, reduction) of the correction layer.
    """

    is_weight: torch.Tensor
    keep: torch.Tensor
    loss_tokens: torch.Tensor
    seq_token_count: Optional[torch.Tensor]
    seq_mask_count: Optional[torch.Tensor]
    kept_token_count: Optional[torch.Tensor]
    kept_seq_count: Optional[torch.Tensor]
    ratio_token_count: Optional[torch.Tensor]
    ratio_mask: Optional[torch.Tensor]
    usable_bin: torch.Tensor
    usable_penalty: torch.Tensor
    metrics: dict = field(default_factory=dict)


class _StatPack:
    """Named ``[B]`` per-sequence statistics, reduced together: plan, reduce once, then read.

    ``add_sum``/``add_max`` record this rank's partial value of a statistic under a name;
    :meth:`reduce` runs the one SUM (and at most one MAX) collective over the groups that
    split the sequences and returns :class:`_ReducedStatistics`, read by the same names. A
    name read that was never added is a ``KeyError`` naming it, not a silent wrong row.
    """

    def __init__(self) -> None:
        self._sums: dict[str, torch.Tensor] = {}
        self._maxima: dict[str, torch.Tensor] = {}

    def add_sum(self, name: str, row: torch.Tensor) -> str:
        if name in self._sums:
            raise KeyError(f"per-sequence statistic {name!r} added twice")
        self._sums[name] = row
        return name

    def add_max(self, name: str, row: torch.Tensor) -> str:
        if name in self._maxima:
            raise KeyError(f"per-sequence maximum {name!r} added twice")
        self._maxima[name] = row
        return name

    def reduce(self, groups: SequenceGroups) -> "_ReducedStatistics":
        sums = torch.stack(list(self._sums.values()))  # [K, B]
        maxima = torch.stack(list(self._maxima.values())) if self._maxima else None  # [J, B]
        sums, maxima = reduce_sequence_statistics(sums, maxima, groups)
        return _ReducedStatistics(
            dict(zip(self._sums, sums)),
            dict(zip(self._maxima, maxima)) if maxima is not None else {},
        )


@dataclass(frozen=True)
class _ReducedStatistics:
    """The per-sequence statistics after the reduction, identical on every rank of a group."""

    sums: dict
    maxima: dict

    def sum(self, name: str) -> torch.Tensor:
        return self.sums[name]

    def max(self, name: str) -> torch.Tensor:
        return self.maxima[name]


@dataclass
class _Stage:
    """One rejection filter, with the names of its per-sequence statistics (``None``: unused)."""

    spec: RejectionFilter
    keep_tok: Optional[torch.Tensor] = None  # token filter: [B, T] 0/1
    touched: Optional[str] = None  # token filter: tokens it rejects per row
    count: Optional[str] = None  # sequence filter: tokens alive at this stage per row
    nonfinite: Optional[str] = None  # sequence filter: of those, with a non-finite log-ratio
    total: Optional[str] = None  # sequence filter (mean, sum): sum of the statistic
    maximum: Optional[str] = None  # sequence filter (max, any): max of the statistic
    negated_minimum: Optional[str] = None  # sequence filter (min, any): max of -statistic
    # Only when some filter is advantage-conditioned: per row, the negative-advantage tokens
    # a token filter rejects, or those alive at a sequence filter.
    negative: Optional[str] = None


_PROBABILITY_METRICS = ("binary_kl", "total_variation")


def needs_sequence_statistics(cfg: RSClippedPGLossConfig) -> bool:
    """Whether anything in this configuration reads a per-sequence statistic.

    NeMo-RL's default (token IS level, token-level loss, no filter) reads none, and then no
    per-sequence sum is computed or reduced at all.
    """
    return (
        cfg.effective_is_level != "token"
        or cfg.truncated_importance_sampling_type == "seq-mask-tis"
        or bool(cfg.rejection_sampling)
        or not cfg.token_level_loss
        or cfg.positive_example_nll_weight > 0
        or cfg.rejection_denominator == "kept"
    )


def _plan_stages(
    cfg: RSClippedPGLossConfig,
    d: torch.Tensor,  # [B, T]
    d_finite: torch.Tensor,  # [B, T] 0/1
    valid_bin: torch.Tensor,  # [B, T] 0/1
    valid: torch.Tensor,  # [B, T]
    negative: Optional[torch.Tensor],  # [B, T] 0/1 negative advantage; None if unused
    log_probs: Optional[PolicyLogProbs],
    pack: _StatPack,
) -> tuple[list[_Stage], torch.Tensor]:
    """Token-filter masks (local decisions) and the local statistics of sequence filters.

    A sequence filter reads the valid tokens that the token filters listed before it kept.
    Returns the stages and the ``[B, T]`` 0/1 mask of valid tokens every token filter kept;
    adds to ``pack`` each stage's statistics and, per row, ``kept`` (those tokens, weighted
    like ``valid``) and ``kept_negative`` (their negative-advantage part, only when some
    filter is advantage-conditioned).
    """
    big = torch.finfo(d.dtype).max
    stages = []
    alive = valid_bin  # [B, T] valid tokens kept by the token filters so far
    for i, f in enumerate(cfg.rejection_sampling):
        name = f"stage{i}"
        lo, hi = _filter_bounds(f)
        fd, f_finite, target, behaviour = filter_log_ratio(
            f.log_ratio, d, d_finite, log_probs, f.metric in _PROBABILITY_METRICS
        )
        stat = token_filter_statistic(fd, f.metric, target, behaviour)
        if f.metric != "ratio":  # fd is finite; the statistics can overflow: keep them finite
            stat = torch.nan_to_num(stat, nan=0.0, posinf=big, neginf=-big)
        st = _Stage(spec=f)
        # Tokens this filter may reject: all, or only those with a negative advantage.
        eligible = negative if f.negative_advantages_only else None  # [B, T] or None
        if f.level == "token":
            in_band = (1.0 - outside(stat, lo, hi)) * f_finite  # non-finite d: out of band
            st.keep_tok = in_band if eligible is None else 1.0 - (1.0 - in_band) * eligible
            kept = alive * st.keep_tok
            rejected = alive - kept
            st.touched = pack.add_sum(f"{name}/touched", rejected.sum(-1))
            if negative is not None:
                st.negative = pack.add_sum(f"{name}/negative", (rejected * negative).sum(-1))
            alive = kept
        else:
            alive_fin = alive * f_finite
            st.count = pack.add_sum(f"{name}/count", alive.sum(-1))
            st.nonfinite = pack.add_sum(f"{name}/nonfinite", (alive * (1.0 - f_finite)).sum(-1))
            if negative is not None:
                st.negative = pack.add_sum(f"{name}/negative", (alive * negative).sum(-1))
            agg = f.aggregation
            masked = stat * alive_fin  # [B, T], 0 off the stage's tokens
            if agg in ("mean", "sum"):
                st.total = pack.add_sum(f"{name}/total", masked.sum(-1))
            if agg in ("max", "min", "any"):
                penalty = (1.0 - alive_fin) * big  # pushes other tokens out of max/min
                if agg in ("max", "any"):
                    st.maximum = pack.add_max(f"{name}/max", _row_max(masked - penalty, -big))
                if agg in ("min", "any"):
                    st.negated_minimum = pack.add_max(f"{name}/negated_min", _row_max(-masked - penalty, -big))
        stages.append(st)
    pack.add_sum("kept", (alive * valid).sum(-1))
    if negative is not None:
        pack.add_sum("kept_negative", (alive * valid * negative).sum(-1))
    return stages, alive


def _row_max(x: torch.Tensor, empty: float) -> torch.Tensor:
    """``[B]`` max over the last dimension; ``empty`` when it has no position.

    T = 0 happens in a CP shard or a batch of prompts without a response, where ``amax`` raises.
    """
    if x.shape[-1] == 0:
        return x.new_full(x.shape[:-1], empty)
    return x.amax(-1)


def _sequence_keep(st: _Stage, stats: _ReducedStatistics) -> torch.Tensor:
    """``[B]`` bool: the sequence filter's decision on reduced statistics."""
    f = st.spec
    lo, hi = _filter_bounds(f)
    count = stats.sum(st.count)
    agg = f.aggregation
    if agg == "mean":
        keep = in_bounds(stats.sum(st.total) / (count + EPS), lo, hi)
    elif agg == "sum":
        keep = in_bounds(stats.sum(st.total), lo, hi)
    elif agg == "max":
        keep = in_bounds(stats.max(st.maximum), lo, hi)
    elif agg == "min":
        keep = in_bounds(-stats.max(st.negated_minimum), lo, hi)
    else:  # any: every valid token within the bounds
        keep = in_bounds(stats.max(st.maximum), None, hi) & in_bounds(-stats.max(st.negated_minimum), lo, None)
    keep = keep & (stats.sum(st.nonfinite) == 0)
    # A sequence with no token left at this stage is never rejected (and never NaN).
    return keep | (count == 0)


@dataclass
class _RejectionOutcome:
    """The sequence-level result of the filters, from reduced statistics (``[B]`` each)."""

    sequence_kept: torch.Tensor  # bool: no unconditional sequence filter rejected the row
    conditional_rows: Optional[torch.Tensor]  # 0/1: an advantage-conditioned sequence filter
    # rejected the row, which loses its negative-advantage tokens (None: no such filter)
    kept_tokens: torch.Tensor  # valid tokens of the row still in the loss (weighted like valid)
    sequence_in_loss: torch.Tensor  # 0/1: not dropped as a whole sequence


def _apply_stages(
    stages: list[_Stage],
    stats: _ReducedStatistics,
    seq_n: torch.Tensor,  # [B] valid tokens (weighted, reduced)
    sm: torch.Tensor,  # [B]
    gvs: torch.Tensor,
    gvt: torch.Tensor,
    metrics: dict,
) -> _RejectionOutcome:
    """Run the sequence decisions in stage order and record per-stage metrics.

    Every number comes from the reduced per-row statistics, so the metrics are identical on
    all ranks and cost O(batch). A stage's metrics count only what it removed from the
    loss: units an earlier stage had already removed are not counted again.
    """
    stage_seq = torch.ones(sm.shape[0], dtype=torch.bool, device=sm.device)
    fdtype = sm.dtype
    conditional = sm.new_zeros(sm.shape)  # [B] rows an advantage-conditioned filter rejected
    conditional_touched = sm.new_zeros(sm.shape)  # [B] ... and that lost a token to it
    per_tok, per_seq = 1.0 / (gvt + EPS), 1.0 / (gvs + EPS)
    for st in stages:
        key = f"rs/{st.spec.label}"
        live = stage_seq.to(fdtype) * sm  # rows still alive at this stage, weighted like valid
        if st.keep_tok is not None:
            rejected = stats.sum(st.touched)  # tokens this filter rejected per row
            if st.negative is not None:  # not those an earlier conditional rejection removed
                rejected = rejected - conditional * stats.sum(st.negative)
            metrics[f"{key}/token_rejected_frac"] = ((rejected * live).sum() * per_tok, "tokens", "replicated")
            touched = (rejected > 0).to(fdtype)
            metrics[f"{key}/seq_touched_frac"] = ((touched * live).sum() * per_seq, "sequences", "replicated")
            continue
        keep_s = _sequence_keep(st, stats)
        rejected = live * (~keep_s).to(fdtype)  # [B]
        in_loss = stats.sum(st.count)  # the tokens those rows still have at this stage
        if st.negative is not None:
            in_loss = in_loss - conditional * stats.sum(st.negative)
        if st.spec.negative_advantages_only:
            negative_alive = stats.sum(st.negative)  # [B]
            # Rows that lose negative-advantage tokens now (not already removed earlier).
            newly = rejected * (1.0 - conditional) * torch.sign(negative_alive)
            conditional = torch.maximum(conditional, torch.sign(rejected))
            conditional_touched = torch.maximum(conditional_touched, torch.sign(newly))
            metrics[f"{key}/seq_rejected_frac"] = (newly.sum() * per_seq, "sequences", "replicated")
            removed = (newly * negative_alive).sum()
            metrics[f"{key}/token_rejected_frac"] = (removed * per_tok, "tokens", "replicated")
            continue
        stage_seq = stage_seq & keep_s
        metrics[f"{key}/seq_rejected_frac"] = (rejected.sum() * per_seq, "sequences", "replicated")
        metrics[f"{key}/token_rejected_frac"] = ((rejected * in_loss).sum() * per_tok, "tokens", "replicated")
    seq_kept = stage_seq.to(fdtype)
    kept_rows = stats.sum("kept")  # [B] valid tokens every token filter kept (weighted)
    kept_tokens = kept_rows
    sequence_in_loss = seq_kept
    conditional_rows = None
    if "kept_negative" in stats.sums:  # some filter is advantage-conditioned
        conditional_rows = conditional
        kept_tokens = kept_rows - conditional * stats.sum("kept_negative")
        # A conditionally rejected row that has no token left leaves as a whole sequence.
        emptied = conditional_touched * (kept_tokens <= 0).to(fdtype)
        sequence_in_loss = seq_kept * (1.0 - emptied)
    kept_tokens = kept_tokens * seq_kept
    metrics["rs_token_rejected_frac"] = ((seq_n.sum() - kept_tokens.sum()) * per_tok, "tokens", "replicated")
    dropped = torch.maximum((~stage_seq).to(fdtype), conditional_touched)
    metrics["rs_seq_rejected_frac"] = ((dropped * sm).sum() * per_seq, "sequences", "replicated")
    return _RejectionOutcome(stage_seq, conditional_rows, kept_tokens, sequence_in_loss)


def compute_correction(
    d: torch.Tensor,  # [B, T] prev - gen, non-finite entries already replaced by 0
    d_finite: torch.Tensor,  # [B, T] float 0/1, 0 where prev - gen was not finite
    valid: torch.Tensor,  # [B, T] float, token_mask * sample_mask
    token_mask: torch.Tensor,  # [B, T]
    sample_mask: torch.Tensor,  # [B] float
    inputs_finite: torch.Tensor,  # [B, T] float 0/1, every log-prob input finite
    cfg: RSClippedPGLossConfig,
    global_valid_seqs: torch.Tensor,
    global_valid_toks: torch.Tensor,
    groups: SequenceGroups = NO_GROUPS,
    *,
    log_probs: Optional[PolicyLogProbs] = None,
    advantages: Optional[torch.Tensor] = None,  # [B, T]; read by advantage-conditioned filters
) -> CorrectionResult:
    """IS weights, truncation, batch normalisation and rejection masks for one microbatch.

    Order: token filters are local decisions and run first; each sequence filter aggregates
    over the valid tokens kept by the token filters listed *before* it (SkyRL's order when a
    token filter comes first, VERL's when it comes after); all per-sequence statistics are
    reduced over ``groups`` in one step; then sequence decisions, IS weights, truncation and
    the batch normalisation (:func:`batch_normalize_weights`).

    IS weight per level (``n_i = sum_t m_it``):
    ``token``: ``w_it = exp(d_it)``; ``sequence``: ``w_i = exp(sum_t m_it d_it)``;
    ``sequence_mean``: ``w_i = exp(sum_t m_it d_it / n_i)``.

    ``log_probs`` is needed by filters whose ``log_ratio`` is not ``prev-gen`` or whose
    statistic lives in probability space; ``advantages`` by advantage-conditioned filters.

    Token masks are 0/1 floats throughout: on CPU, float arithmetic is several times cheaper
    than boolean ops, and none of it syncs with the host.
    """
    d = d.detach()
    fdtype = d.dtype
    valid_bin = torch.sign(valid)  # [B, T] 0/1 (valid may be fractional)
    d_bad = 1.0 - d_finite  # [B, T] 1 where d was not finite
    sm = sample_mask.to(fdtype)
    metrics: dict = {}
    negative = None  # [B, T] 0/1 tokens with a negative advantage
    if any(f.negative_advantages_only for f in cfg.rejection_sampling):
        if advantages is None:
            raise ValueError(
                "rejection_sampling: a filter with negative_advantages_only needs the "
                "advantages (compute_correction(..., advantages=...))"
            )
        negative = (sanitize(advantages.detach()) < 0).to(fdtype)

    # ---- local statistics, then the one reduction: nothing after it reads a partial value
    seq_stats = needs_sequence_statistics(cfg)
    stats = seq_d_sum = seq_n = seq_ntok = seq_nonfinite = has_tokens = ratio_mask = None
    stages: list[_Stage] = []
    alive = None
    if seq_stats:
        pack = _StatPack()
        stages, alive = _plan_stages(cfg, d, d_finite, valid_bin, valid, negative, log_probs, pack)
        pack.add_sum("d_sum", (d * valid).sum(-1))  # sum_t m d
        pack.add_sum("valid", valid.sum(-1).to(fdtype))  # n_i
        pack.add_sum("token_mask", token_mask.sum(-1).to(fdtype))  # token_mask count
        pack.add_sum("nonfinite", (valid_bin * d_bad).sum(-1))
        if cfg.sequence_level_importance_ratios:
            # The GSPO ratio averages over the row's token_mask tokens with finite inputs, less
            # the valid tokens a token filter rejected (a rejected token gets no gradient; as
            # VERL, whose rejection edits the response mask its GSPO ratio reads).
            ratio_mask = token_mask * inputs_finite * (1.0 - valid_bin + alive)
            pack.add_sum("ratio_tokens", ratio_mask.sum(-1).to(fdtype))
        stats = pack.reduce(groups)
        seq_d_sum, seq_n, seq_ntok = stats.sum("d_sum"), stats.sum("valid"), stats.sum("token_mask")
        seq_nonfinite = stats.sum("nonfinite")
        has_tokens = seq_n > 0
        metrics["nonfinite_log_ratio_count"] = (seq_nonfinite.sum(), "none", "replicated")
    else:
        metrics["nonfinite_log_ratio_count"] = (masked_sum(valid_bin, d_bad), "none", "sum")

    # ---- rejection: sequence decisions, the combined mask, per-stage metrics ----
    seq_in_loss = torch.ones(valid.shape[0], dtype=fdtype, device=valid.device)
    keep = inputs_finite  # [B, T]
    kept_token_count = kept_seq_count = ratio_token_count = None
    if stages:
        outcome = _apply_stages(stages, stats, seq_n, sm, global_valid_seqs, global_valid_toks, metrics)
        keep = alive * outcome.sequence_kept.to(fdtype).unsqueeze(-1) * inputs_finite
        if outcome.conditional_rows is not None:
            keep = keep * (1.0 - outcome.conditional_rows.unsqueeze(-1) * negative)
        seq_in_loss = outcome.sequence_in_loss
        kept_token_count = outcome.kept_tokens.sum()
    elif seq_stats:
        kept_token_count = stats.sum("kept").sum()
    loss_tokens = valid * keep  # [B, T] valid tokens that reach the loss
    if seq_stats and cfg.sequence_level_importance_ratios:
        ratio_token_count = stats.sum("ratio_tokens")
    if seq_stats:
        kept_seq_count = (seq_in_loss * sm * has_tokens.to(fdtype)).sum()

    usable_bin = valid_bin * inputs_finite  # [B, T]
    usable_penalty = extrema_penalty(usable_bin)  # shared by every per-token extreme

    # ---- IS weights at the chosen level, truncation, batch normalisation ----
    level = cfg.effective_is_level
    raw_weight = is_weights(level, d, d_finite, seq_d_sum, seq_n, seq_nonfinite)
    weight, trunc_metrics = truncate_weights(
        raw_weight, cfg, seq_d_sum, seq_ntok, valid, sm, global_valid_seqs, global_valid_toks
    )
    metrics.update(trunc_metrics)
    if cfg.is_batch_normalization is not None:
        units = valid if level == "token" else sm * has_tokens.to(fdtype)
        weight, factor = batch_normalize_weights(weight, units, level, cfg.is_batch_normalization, groups)
        metrics["is_batch_norm_factor"] = (factor, "none", "replicated")
    _add_weight_metrics(
        metrics,
        raw_weight,
        weight,
        loss_tokens,
        seq_in_loss,
        valid,
        usable_bin,
        usable_penalty,
        sm,
        level,
        global_valid_seqs,
        global_valid_toks,
        has_tokens,
    )
    return CorrectionResult(
        is_weight=weight,
        keep=keep,
        loss_tokens=loss_tokens,
        seq_token_count=seq_n,
        seq_mask_count=seq_ntok,
        kept_token_count=kept_token_count,
        kept_seq_count=kept_seq_count,
        ratio_token_count=ratio_token_count,
        ratio_mask=ratio_mask,
        usable_bin=usable_bin,
        usable_penalty=usable_penalty,
        metrics=metrics,
    )


def batch_normalize_weights(
    weight: torch.Tensor,  # [B, T] (token level) or [B, 1] (sequence levels), truncated
    units: torch.Tensor,  # [B, T] valid tokens, or [B] sequences with a valid token
    level: str,
    scope: str,
    groups: SequenceGroups = NO_GROUPS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """IS weights over their batch mean, and the 0-dim factor divided by.

    ``w / mu`` with ``mu = sum_u m_u w_u / sum_u m_u`` over the IS level's units ``u``
    before rejection (``m`` = ``units``): valid tokens at the ``token`` level (VERL and
    slime), sequences with a valid token at the sequence levels (VERL; slime's sequence mean
    also counts empty sequences, as 0). Weights zeroed by truncation count as 0; where
    ``mu <= 1e-8`` the weights are left as they are (factor 1), as both peers do.

    ``scope`` ``microbatch``: the units of this call. Token totals are partial sums when CP
    splits the tokens, so they are summed over ``groups.groups``; per-sequence weights are
    already identical there. ``data_parallel``: also summed over ``groups.data_parallel``,
    the ranks holding the batch's other sequences.
    """
    token_level = level == "token"
    if token_level:
        totals = torch.stack([masked_sum(weight, units), units.sum()])
    else:
        w_seq = weight.squeeze(-1)  # [B]
        totals = torch.stack([(w_seq * units).sum(), units.sum()])
    totals = reduce_batch_totals(
        totals, groups, tokens_split=token_level, across_data_parallel=scope == "data_parallel"
    )
    mean = totals[0] / totals[1].clamp_min(EPS)
    factor = torch.where(mean > BATCH_MEAN_FLOOR, mean, torch.ones_like(mean))
    return weight / factor, factor


def is_weights(
    level: str,
    d: torch.Tensor,  # [B, T]
    d_finite: torch.Tensor,  # [B, T] float 0/1
    seq_d_sum: torch.Tensor,  # [B] sum_t m d, reduced over ranks
    seq_n: torch.Tensor,  # [B] n_i, reduced over ranks
    seq_nonfinite: torch.Tensor,  # [B] valid tokens with non-finite d, reduced over ranks
) -> torch.Tensor:
    """Untruncated IS weight: ``[B, T]`` for ``token``, ``[B, 1]`` for the sequence levels.

    ``token``: ``exp(d_t)``; ``sequence``: ``exp(sum_t m d)``; ``sequence_mean``:
    ``exp(sum_t m d / n)``. A non-finite log-ratio gives weight 0 (its token, or its sequence).
    """
    if level == "token":
        return finite_exp(d) * d_finite  # d is 0 where it was not finite: weight 0 there
    seq_log_w = seq_d_sum if level == "sequence" else seq_d_sum / (seq_n + EPS)
    w = torch.where(seq_nonfinite == 0, finite_exp(seq_log_w), torch.zeros_like(seq_log_w))
    return w.unsqueeze(-1)


def truncate_weights(
    raw_weight: torch.Tensor,  # [B, T] or [B, 1]
    cfg: RSClippedPGLossConfig,
    seq_d_sum: torch.Tensor,  # [B]
    seq_ntok: torch.Tensor,  # [B] token_mask count
    valid: torch.Tensor,  # [B, T]
    sm: torch.Tensor,  # [B]
    gvs: torch.Tensor,
    gvt: torch.Tensor,
) -> tuple[torch.Tensor, dict]:
    """NeMo-RL's truncation on the chosen level, and ``is_oob_ratio`` from the raw weights.

    ``tis``: ``clamp(w, min or 0, max)``; ``icepop``: ``w`` inside ``[min, max]``, else 0;
    ``seq-mask-tis``: sequences whose geometric mean ``exp(sum_t m d / n)`` is outside
    ``[min, max]`` get 0, the others keep the untruncated weight.
    """
    t = cfg.truncated_importance_sampling_type
    hi = cfg.truncated_importance_sampling_ratio
    lo = cfg.truncated_importance_sampling_ratio_min
    fdtype = raw_weight.dtype
    if t is None:
        return raw_weight, {}
    if t == "tis":
        lo = 0.0 if lo is None else lo
        clamped = raw_weight.clamp(lo, hi)
        oob = torch.sign((raw_weight - clamped).abs())  # 1 where the clamp changed the weight
        return clamped, {"is_oob_ratio": (_token_mean(oob, valid, gvt), "tokens", "sum")}
    if t == "icepop":
        oob = outside(raw_weight, lo, hi)
        weight = raw_weight * (1.0 - oob)
        return weight, {"is_oob_ratio": (_token_mean(oob, valid, gvt), "tokens", "sum")}
    # seq-mask-tis: NeMo-RL's rule, the geometric mean over token_mask (non-finite
    # log-ratios counted as 0) decides; survivors keep the untruncated weight.
    geo = torch.exp(seq_d_sum / (seq_ntok + EPS))
    seq_in = ((geo >= lo) & (geo <= hi)).to(fdtype)  # [B]
    oob_frac = ((1.0 - seq_in) * sm).sum() / (gvs + EPS)
    return raw_weight * seq_in.unsqueeze(-1), {"is_oob_ratio": (oob_frac, "sequences", "replicated")}


def _token_mean(values: torch.Tensor, valid: torch.Tensor, denom: torch.Tensor) -> torch.Tensor:
    if values.shape == valid.shape:
        return masked_sum(values, valid) / (denom + EPS)
    # values may be [B, 1] (a sequence weight): broadcast over the sequence's tokens on purpose.
    return (values.expand_as(valid) * valid).sum() / (denom + EPS)


def _add_weight_metrics(
    metrics: dict,
    raw_weight: torch.Tensor,
    weight: torch.Tensor,
    loss_tokens: torch.Tensor,
    seq_kept: torch.Tensor,
    valid: torch.Tensor,
    usable_bin: torch.Tensor,
    usable_penalty: torch.Tensor,
    sm: torch.Tensor,
    level: str,
    gvs: torch.Tensor,
    gvt: torch.Tensor,
    has_tokens: torch.Tensor,
) -> None:
    """IS weight statistics before and after truncation/rejection.

    Per token when the weight is per token (sums of per-token terms / global_valid_toks; a
    ``sum`` across CP ranks), per sequence otherwise (``/ global_valid_seqs``; identical on
    every CP rank). Effective sample size ``(sum w)^2 / (n sum w^2)`` of the applied weights
    is reported per microbatch; ``is_weight_mean^2 / is_weight_sq_mean`` gives it globally.
    """
    if level == "token":
        unit_mask, unit_bin, penalty = valid, usable_bin, usable_penalty  # [B, T]
        weighted = weight * loss_tokens  # applied weight x valid mask, rejected units 0
        raw = raw_weight
        norm, red, denom = "tokens", "sum", gvt
    else:
        unit_mask = sm * has_tokens.to(sm.dtype)  # [B]
        unit_bin = torch.sign(unit_mask)
        penalty = None
        # A sequence's weight after rejection: 0 when a sequence filter rejected it.
        weighted = weight.squeeze(-1) * seq_kept.to(weight.dtype) * unit_mask
        raw = raw_weight.squeeze(-1)
        norm, red, denom = "sequences", "replicated", gvs
    applied = weight if level == "token" else weight.squeeze(-1)
    sum_w = weighted.sum()
    sum_w2 = masked_sum(weighted, applied)
    metrics["is_weight_raw_mean"] = (masked_sum(raw, unit_mask) / (denom + EPS), norm, red)
    metrics["is_weight_mean"] = (sum_w / (denom + EPS), norm, red)
    metrics["is_weight_sq_mean"] = (sum_w2 / (denom + EPS), norm, red)
    raw_min, raw_max = masked_extrema(raw, unit_bin, penalty)
    metrics["is_weight_raw_min"] = (raw_min, "none", "min")
    metrics["is_weight_raw_max"] = (raw_max, "none", "max")
    applied_min, applied_max = masked_extrema(applied, torch.sign(weighted))  # kept units
    metrics["is_weight_min"] = (applied_min, "none", "min")
    metrics["is_weight_max"] = (applied_max, "none", "max")
    # ESS from sums; with sharded tokens they are reduced with the other metrics first.
    metrics["_ess_sum_w"] = (sum_w, "none", red)
    metrics["_ess_sum_w2"] = (sum_w2, "none", red)
    metrics["_ess_n"] = (unit_mask.sum(), "none", red)
