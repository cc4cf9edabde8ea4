"""Off-policy correction: IS weights at a chosen level, truncation, and rejection sampling.

Problem: the log-probs reported by the inference engine (``gen``) differ from the training
engine's (``prev``): kernel and precision mismatch, MoE routing, staleness in async runs.
With ``d = prev - gen`` per token, the IS weight ``pi_prev / pi_gen`` corrects the policy
gradient; truncation bounds its variance; rejection sampling drops tokens or sequences whose
mismatch is too large to correct.

Entry points (all pure torch; no NeMo-RL, no Megatron, no ``.item()``):

* :func:`token_filter_statistic`, :func:`in_bounds`: token-level building blocks.
* :func:`compute_correction`: the whole pipeline. It computes every per-sequence statistic
  locally, passes all of them through **one** call of
  :func:`~nemo_rs_plugin.distributed.reduce_sequence_statistics` (one SUM and one MAX
  all-reduce when sequences are sharded), and only then derives masks and weights.

IS weights and masks are detached: they change the measure the gradient is estimated under,
not the objective being differentiated.
See: docs/guide.md#is-correction-level and docs/guide.md#rejection-sampling.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch

from nemo_rs_plugin.config import RejectionFilter, RSClippedPGLossConfig
from nemo_rs_plugin.distributed import NO_GROUPS, SequenceGroups, reduce_sequence_statistics
from nemo_rs_plugin.masking import EPS, extrema_penalty, finite_exp, masked_extrema, masked_sum, outside

__all__ = [
    "CorrectionResult",
    "is_weights",
    "truncate_weights",
    "compute_correction",
    "in_bounds",
    "token_filter_statistic",
    "finite_exp",
]


def in_bounds(x: torch.Tensor, lower: Optional[float], upper: Optional[float]) -> torch.Tensor:
    """Boolean ``lower <= x <= upper`` (a ``None`` bound is open; NaN is out of bounds)."""
    if lower is None and upper is None:
        return x == x  # everything but NaN
    if lower is None:
        return x <= upper
    if upper is None:
        return x >= lower
    return (x >= lower) & (x <= upper)


def token_filter_statistic(d: torch.Tensor, metric: str) -> torch.Tensor:
    """Per-token statistic of a filter, from ``d = prev - gen``.

    ``ratio`` is returned in log space (``d`` itself; bounds are compared as ``log``);
    ``kl_k1 = -d``, ``kl_k2 = d^2/2``, ``kl_k3 = exp(d) - 1 - d`` estimate KL(gen || prev).
    """
    if metric == "ratio":
        return d
    if metric == "kl_k1":
        return -d
    if metric == "kl_k2":
        return d.square() / 2
    if metric == "kl_k3":
        return torch.expm1(d) - d
    raise ValueError(f"metric: got {metric!r}; allowed: ratio, kl_k1, kl_k2, kl_k3")


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
        ratio_token_count: ``[B]`` ``token_mask`` tokens with finite inputs per sequence over
            all ranks: the GSPO ratio's denominator (``None`` without the GSPO ratio).
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
    usable_bin: torch.Tensor
    usable_penalty: torch.Tensor
    metrics: dict = field(default_factory=dict)


class _StatPack:
    """Collects [B] statistics to be reduced together (SUM or MAX) in one collective each."""

    def __init__(self) -> None:
        self.sum_rows: list[torch.Tensor] = []
        self.max_rows: list[torch.Tensor] = []

    def add_sum(self, row: torch.Tensor) -> int:
        self.sum_rows.append(row)
        return len(self.sum_rows) - 1

    def add_max(self, row: torch.Tensor) -> int:
        self.max_rows.append(row)
        return len(self.max_rows) - 1

    def reduce(self, groups: SequenceGroups) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        sums = torch.stack(self.sum_rows)  # [K, B]
        maxima = torch.stack(self.max_rows) if self.max_rows else None  # [J, B]
        return reduce_sequence_statistics(sums, maxima, groups)


@dataclass
class _Stage:
    """One rejection filter, with the pack indices of its per-sequence statistics."""

    spec: RejectionFilter
    keep_tok: Optional[torch.Tensor] = None  # token filter: [B, T] 0/1
    touch_idx: int = -1  # token filter: tokens it rejects per row
    count_idx: int = -1  # sequence filter: tokens alive at this stage per row
    nonfinite_idx: int = -1
    sum_idx: int = -1
    max_idx: int = -1
    negmin_idx: int = -1


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
    pack: _StatPack,
) -> tuple[list[_Stage], torch.Tensor, int]:
    """Token-filter masks (local decisions) and the local statistics of sequence filters.

    A sequence filter reads the valid tokens that the token filters listed before it kept.
    Returns the stages, the ``[B, T]`` 0/1 mask of valid tokens every token filter kept, and
    the pack index of its per-row count (weighted like ``valid``).
    """
    big = torch.finfo(d.dtype).max
    d_bad = 1.0 - d_finite
    stages = []
    alive = valid_bin  # [B, T] valid tokens kept by the token filters so far
    for f in cfg.rejection_sampling:
        lo, hi = _filter_bounds(f)
        stat = token_filter_statistic(d, f.metric)
        if f.metric != "ratio":  # d is finite; KL estimators can overflow: keep them finite
            stat = torch.nan_to_num(stat, nan=0.0, posinf=big, neginf=-big)
        st = _Stage(spec=f)
        if f.level == "token":
            st.keep_tok = (1.0 - outside(stat, lo, hi)) * d_finite  # non-finite d: rejected
            kept = alive * st.keep_tok
            st.touch_idx = pack.add_sum((alive - kept).sum(-1))
            alive = kept
        else:
            alive_fin = alive * d_finite
            st.count_idx = pack.add_sum(alive.sum(-1))
            st.nonfinite_idx = pack.add_sum((alive * d_bad).sum(-1))
            agg = f.aggregation
            masked = stat * alive_fin  # [B, T], 0 off the stage's tokens
            if agg in ("mean", "sum"):
                st.sum_idx = pack.add_sum(masked.sum(-1))
            if agg in ("max", "min", "any"):
                penalty = (1.0 - alive_fin) * big  # pushes other tokens out of max/min
                if agg in ("max", "any"):
                    st.max_idx = pack.add_max(_row_max(masked - penalty, -big))
                if agg in ("min", "any"):
                    st.negmin_idx = pack.add_max(_row_max(-masked - penalty, -big))
        stages.append(st)
    return stages, alive, pack.add_sum((alive * valid).sum(-1))


def _row_max(x: torch.Tensor, empty: float) -> torch.Tensor:
    """``[B]`` max over the last dimension; ``empty`` when it has no position (T = 0, as in
    a CP shard or a batch of prompts without a response), where ``amax`` raises."""
    if x.shape[-1] == 0:
        return x.new_full(x.shape[:-1], empty)
    return x.amax(-1)


def _sequence_keep(st: _Stage, sums: torch.Tensor, maxima: Optional[torch.Tensor]) -> torch.Tensor:
    """``[B]`` bool: the sequence filter's decision on reduced statistics."""
    f = st.spec
    lo, hi = _filter_bounds(f)
    count = sums[st.count_idx]
    agg = f.aggregation
    if agg == "mean":
        keep = in_bounds(sums[st.sum_idx] / (count + EPS), lo, hi)
    elif agg == "sum":
        keep = in_bounds(sums[st.sum_idx], lo, hi)
    elif agg == "max":
        keep = in_bounds(maxima[st.max_idx], lo, hi)
    elif agg == "min":
        keep = in_bounds(-maxima[st.negmin_idx], lo, hi)
    else:  # any: every valid token within the bounds
        keep = in_bounds(maxima[st.max_idx], None, hi) & in_bounds(-maxima[st.negmin_idx], lo, None)
    keep = keep & (sums[st.nonfinite_idx] == 0)
    # A sequence with no token left at this stage is never rejected (and never NaN).
    return keep | (count == 0)


def _apply_stages(
    stages: list[_Stage],
    sums: torch.Tensor,
    maxima: Optional[torch.Tensor],
    kept_rows: torch.Tensor,  # [B] valid tokens every token filter kept (weighted, reduced)
    seq_n: torch.Tensor,  # [B] valid tokens (weighted, reduced)
    sm: torch.Tensor,  # [B]
    gvs: torch.Tensor,
    gvt: torch.Tensor,
    metrics: dict,
) -> torch.Tensor:
    """Run the sequence decisions in stage order and record per-stage metrics.

    Every number comes from the reduced per-row statistics, so the metrics are identical on
    all ranks and cost O(batch). Returns the ``[B]`` bool mask of sequences every sequence
    filter kept.
    """
    stage_seq = torch.ones(sm.shape[0], dtype=torch.bool, device=sm.device)
    fdtype = sm.dtype
    per_tok, per_seq = 1.0 / (gvt + EPS), 1.0 / (gvs + EPS)
    for st in stages:
        key = f"rs/{st.spec.label}"
        live = stage_seq.to(fdtype) * sm  # rows still alive at this stage, weighted like valid
        if st.keep_tok is not None:
            rejected = sums[st.touch_idx]  # tokens this filter rejected per row
            metrics[f"{key}/token_rejected_frac"] = ((rejected * live).sum() * per_tok, "tokens", "replicated")
            touched = (rejected > 0).to(fdtype)
            metrics[f"{key}/seq_touched_frac"] = ((touched * live).sum() * per_seq, "sequences", "replicated")
        else:
            keep_s = _sequence_keep(st, sums, maxima)
            rejected = live * (~keep_s).to(fdtype)  # [B]
            stage_seq = stage_seq & keep_s
            metrics[f"{key}/seq_rejected_frac"] = (rejected.sum() * per_seq, "sequences", "replicated")
            # The tokens those sequences still had at this stage.
            in_rejected = (rejected * sums[st.count_idx]).sum()
            metrics[f"{key}/token_rejected_frac"] = (in_rejected * per_tok, "tokens", "replicated")
    kept = (kept_rows * stage_seq.to(fdtype)).sum()
    metrics["rs_token_rejected_frac"] = ((seq_n.sum() - kept) * per_tok, "tokens", "replicated")
    metrics["rs_seq_rejected_frac"] = (((~stage_seq).to(fdtype) * sm).sum() * per_seq, "sequences", "replicated")
    return stage_seq


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
) -> CorrectionResult:
    """IS weights, truncation and rejection masks for one microbatch.

    Order: token filters are local decisions and run first; each sequence filter aggregates
    over the valid tokens kept by the token filters listed *before* it (SkyRL's order when a
    token filter comes first, VERL's when it comes after); all per-sequence statistics are
    reduced over ``groups`` in one step; then sequence decisions, IS weights and truncation.

    IS weight per level (``n_i = sum_t m_it``):
    ``token``: ``w_it = exp(d_it)``; ``sequence``: ``w_i = exp(sum_t m_it d_it)``;
    ``sequence_mean``: ``w_i = exp(sum_t m_it d_it / n_i)``.

    Token masks are 0/1 floats throughout: on CPU, float arithmetic is several times cheaper
    than boolean ops, and none of it syncs with the host.
    """
    d = d.detach()
    fdtype = d.dtype
    valid_bin = torch.sign(valid)  # [B, T] 0/1 (valid may be fractional)
    d_bad = 1.0 - d_finite  # [B, T] 1 where d was not finite
    sm = sample_mask.to(fdtype)
    metrics: dict = {}

    # ---- local statistics, then the one reduction: nothing after it reads a partial value
    seq_stats = needs_sequence_statistics(cfg)
    sums = maxima = seq_d_sum = seq_n = seq_ntok = seq_nonfinite = has_tokens = None
    stages: list[_Stage] = []
    alive = None
    if seq_stats:
        pack = _StatPack()
        stages, alive, alive_idx = _plan_stages(cfg, d, d_finite, valid_bin, valid, pack)
        idx_d_sum = pack.add_sum((d * valid).sum(-1))  # sum_t m d
        idx_n = pack.add_sum(valid.sum(-1).to(fdtype))  # n_i
        idx_ntok = pack.add_sum(token_mask.sum(-1).to(fdtype))  # token_mask count
        idx_nonfinite = pack.add_sum((valid_bin * d_bad).sum(-1))
        if cfg.sequence_level_importance_ratios:
            idx_ratio = pack.add_sum((token_mask * inputs_finite).sum(-1).to(fdtype))
        sums, maxima = pack.reduce(groups)
        seq_d_sum, seq_n, seq_ntok = sums[idx_d_sum], sums[idx_n], sums[idx_ntok]
        seq_nonfinite = sums[idx_nonfinite]
        has_tokens = seq_n > 0
        metrics["nonfinite_log_ratio_count"] = (seq_nonfinite.sum(), "none", "replicated")
    else:
        metrics["nonfinite_log_ratio_count"] = (masked_sum(valid_bin, d_bad), "none", "sum")

    # ---- rejection: sequence decisions, the combined mask, per-stage metrics ----
    stage_seq = torch.ones(valid.shape[0], dtype=torch.bool, device=valid.device)
    keep = inputs_finite  # [B, T]
    if stages:
        stage_seq = _apply_stages(
            stages, sums, maxima, sums[alive_idx], seq_n, sm, global_valid_seqs, global_valid_toks, metrics
        )
        keep = alive * stage_seq.to(fdtype).unsqueeze(-1) * inputs_finite
    loss_tokens = valid * keep  # [B, T] valid tokens that reach the loss
    kept_token_count = kept_seq_count = ratio_token_count = None
    if seq_stats and cfg.sequence_level_importance_ratios:
        ratio_token_count = sums[idx_ratio]
    if seq_stats:
        seq_kept = stage_seq.to(fdtype)
        kept_token_count = (sums[alive_idx] * seq_kept).sum()
        kept_seq_count = (seq_kept * sm * has_tokens.to(fdtype)).sum()

    usable_bin = valid_bin * inputs_finite  # [B, T]
    usable_penalty = extrema_penalty(usable_bin)  # shared by every per-token extreme

    # ---- IS weights at the chosen level, then truncation ----
    level = cfg.effective_is_level
    raw_weight = is_weights(level, d, d_finite, seq_d_sum, seq_n, seq_nonfinite)
    weight, trunc_metrics = truncate_weights(
        raw_weight, cfg, seq_d_sum, seq_ntok, valid, sm, global_valid_seqs, global_valid_toks
    )
    metrics.update(trunc_metrics)
    _add_weight_metrics(
        metrics, raw_weight, weight, loss_tokens, stage_seq, valid, usable_bin, usable_penalty,
        sm, level, global_valid_seqs, global_valid_toks, has_tokens,
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
        usable_bin=usable_bin,
        usable_penalty=usable_penalty,
        metrics=metrics,
    )


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

