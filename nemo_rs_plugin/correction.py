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
from nemo_rs_plugin.masking import EPS, masked_extreme

__all__ = [
    "CorrectionResult",
    "is_weights",
    "truncate_weights",
    "compute_correction",
    "in_bounds",
    "token_filter_statistic",
    "finite_exp",
]


def finite_exp(x: torch.Tensor) -> torch.Tensor:
    """``exp(x)`` with non-finite results set to 0, as NeMo-RL's ``nan_to_num`` does.

    A weight that overflows float32 (``exp(x) = inf``) or comes from a NaN log-ratio gets
    weight 0: such a unit cannot be corrected, only rejected.
    """
    return torch.nan_to_num(torch.exp(x), nan=0.0, posinf=0.0, neginf=0.0)


def in_bounds(x: torch.Tensor, lower: Optional[float], upper: Optional[float]) -> torch.Tensor:
    """Boolean ``lower <= x <= upper`` (a ``None`` bound is open; NaN is out of bounds)."""
    keep = torch.isfinite(x) | torch.isinf(x)  # False only for NaN
    if lower is not None:
        keep = keep & (x >= lower)
    if upper is not None:
        keep = keep & (x <= upper)
    return keep


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
        keep_b: the same, boolean and restricted to valid tokens.
        loss_tokens: ``[B, T]`` ``valid * keep``, the tokens that reach the loss.
        seq_token_count: ``[B]`` valid tokens per sequence over all ranks (``sum_t m``);
            ``None`` when :func:`needs_sequence_statistics` is false, like the next three.
        seq_mask_count: ``[B]`` ``token_mask`` tokens per sequence over all ranks.
        kept_token_count: ``[]`` kept valid tokens over all ranks (for ``kept`` denominators).
        kept_seq_count: ``[]`` kept valid sequences.
        valid_b: ``[B, T]`` bool, valid tokens.
        metrics: name -> (0-dim tensor, normalization, reduction) of the correction layer.
    """

    is_weight: torch.Tensor
    keep: torch.Tensor
    keep_b: torch.Tensor
    loss_tokens: torch.Tensor
    seq_token_count: Optional[torch.Tensor]
    seq_mask_count: Optional[torch.Tensor]
    kept_token_count: Optional[torch.Tensor]
    kept_seq_count: Optional[torch.Tensor]
    valid_b: torch.Tensor
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
class _SeqFilterPlan:
    spec: RejectionFilter
    sum_idx: int = -1
    count_idx: int = -1
    nonfinite_idx: int = -1
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


def compute_correction(
    d: torch.Tensor,  # [B, T] prev - gen, non-finite entries already replaced by 0
    d_finite: torch.Tensor,  # [B, T] bool, False where prev - gen was not finite
    valid: torch.Tensor,  # [B, T] float, token_mask * sample_mask
    token_mask: torch.Tensor,  # [B, T] float
    sample_mask: torch.Tensor,  # [B] float
    inputs_finite: torch.Tensor,  # [B, T] bool, every log-prob input finite
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
    """
    d = d.detach()
    valid_b = valid != 0
    fdtype = d.dtype
    level = cfg.effective_is_level
    pack = _StatPack()

    # ---- per-sequence counts and IS log-ratio sums, when something reads them ----
    seq_stats = needs_sequence_statistics(cfg)
    if seq_stats:
        idx_d_sum = pack.add_sum((d * valid).sum(-1))  # sum_t m d
        idx_n = pack.add_sum(valid.sum(-1).to(fdtype))  # n_i
        idx_ntok = pack.add_sum(token_mask.sum(-1).to(fdtype))  # token_mask count
        idx_nonfinite = pack.add_sum((valid_b & ~d_finite).sum(-1).to(fdtype))

    # ---- token filters (local) and the per-sequence statistics of sequence filters ----
    token_keeps: list[Optional[torch.Tensor]] = []
    token_touch_idx: list[int] = []
    seq_plans: list[Optional[_SeqFilterPlan]] = []
    alive_tok = valid_b  # valid tokens kept by all token filters so far
    for f in cfg.rejection_sampling:
        lo, hi = _filter_bounds(f)
        stat = token_filter_statistic(d, f.metric)
        if f.level == "token":
            keep_t = in_bounds(stat, lo, hi) & d_finite  # a non-finite d rejects the token
            token_keeps.append(keep_t)
            # Tokens this filter rejects per row, before sequence decisions are known.
            token_touch_idx.append(pack.add_sum((alive_tok & ~keep_t).sum(-1).to(fdtype)))
            seq_plans.append(None)
            alive_tok = alive_tok & keep_t
            continue
        token_keeps.append(None)
        token_touch_idx.append(-1)
        plan = _SeqFilterPlan(spec=f)
        alive_finite = alive_tok & d_finite
        alive_f = alive_finite.to(fdtype)
        plan.count_idx = pack.add_sum(alive_tok.sum(-1).to(fdtype))
        plan.nonfinite_idx = pack.add_sum((alive_tok & ~d_finite).sum(-1).to(fdtype))
        agg = f.aggregation
        if agg in ("mean", "sum"):
            plan.sum_idx = pack.add_sum((stat * alive_f).sum(-1))
        if agg in ("max", "any"):
            plan.max_idx = pack.add_max(
                torch.where(alive_finite, stat, torch.full_like(stat, -math.inf)).amax(-1)
            )
        if agg in ("min", "any"):
            plan.negmin_idx = pack.add_max(
                torch.where(alive_finite, -stat, torch.full_like(stat, -math.inf)).amax(-1)
            )
        seq_plans.append(plan)
    if seq_stats:
        # Tokens that survive every token filter: their per-row count lets the ``kept``
        # denominator be computed after sequence decisions without another collective.
        idx_alive_tokens = pack.add_sum((alive_tok.to(fdtype) * valid).sum(-1))

    # ---- the one reduction: nothing below reads a partial statistic ----
    if seq_stats:
        sums, maxima = pack.reduce(groups)
        seq_d_sum = sums[idx_d_sum]
        seq_n = sums[idx_n]
        seq_ntok = sums[idx_ntok]
        seq_nonfinite = sums[idx_nonfinite]
        has_tokens = seq_n > 0
    else:
        sums = maxima = seq_d_sum = seq_n = seq_ntok = seq_nonfinite = has_tokens = None

    # ---- sequence filter decisions ----
    seq_keeps: list[Optional[torch.Tensor]] = []
    for plan in seq_plans:
        if plan is None:
            seq_keeps.append(None)
            continue
        f = plan.spec
        lo, hi = _filter_bounds(f)
        count = sums[plan.count_idx]
        agg = f.aggregation
        if agg == "mean":
            keep_s = in_bounds(sums[plan.sum_idx] / (count + EPS), lo, hi)
        elif agg == "sum":
            keep_s = in_bounds(sums[plan.sum_idx], lo, hi)
        elif agg == "max":
            keep_s = in_bounds(maxima[plan.max_idx], lo, hi)
        elif agg == "min":
            keep_s = in_bounds(-maxima[plan.negmin_idx], lo, hi)
        else:  # any: every valid token within the bounds
            keep_s = in_bounds(maxima[plan.max_idx], None, hi) & in_bounds(
                -maxima[plan.negmin_idx], lo, None
            )
        keep_s = keep_s & (sums[plan.nonfinite_idx] == 0)
        # A sequence with no token left at this stage is never rejected (and never NaN).
        keep_s = keep_s | (count == 0)
        seq_keeps.append(keep_s)

    # ---- the combined rejection mask, and per-stage metrics from the right tensors ----
    metrics: dict = {}
    stage_tok = valid_b
    stage_seq = torch.ones(valid.shape[0], dtype=torch.bool, device=valid.device)
    sm = sample_mask.to(fdtype)
    for f, keep_t, keep_s, touch_idx in zip(
        cfg.rejection_sampling, token_keeps, seq_keeps, token_touch_idx
    ):
        key = f"rs/{f.label}"
        if keep_t is not None:
            rejected_tok = stage_tok & ~keep_t  # [B, T]
            # Rows alive at this stage in which this filter rejected a token (all ranks).
            rejected_rows = (stage_seq & (sums[touch_idx] > 0)).to(fdtype)
            stage_tok = stage_tok & keep_t
            metrics[f"{key}/token_rejected_frac"] = (
                (rejected_tok.to(fdtype) * valid).sum() / (global_valid_toks + EPS),
                "tokens",
                "sum",
            )
            metrics[f"{key}/seq_touched_frac"] = (
                (rejected_rows * sm).sum() / (global_valid_seqs + EPS),
                "sequences",
                "replicated",
            )
        else:
            rejected_seq = stage_seq & ~keep_s  # [B]
            tok_in_rejected = stage_tok & rejected_seq.unsqueeze(-1)
            stage_seq = stage_seq & keep_s
            stage_tok = stage_tok & keep_s.unsqueeze(-1)
            metrics[f"{key}/seq_rejected_frac"] = (
                (rejected_seq.to(fdtype) * sm).sum() / (global_valid_seqs + EPS),
                "sequences",
                "replicated",
            )
            metrics[f"{key}/token_rejected_frac"] = (
                (tok_in_rejected.to(fdtype) * valid).sum() / (global_valid_toks + EPS),
                "tokens",
                "sum",
            )

    keep_b = stage_tok & inputs_finite  # [B, T]
    keep = keep_b.to(fdtype)
    loss_tokens = valid * keep  # [B, T] valid tokens that reach the loss
    if seq_stats:
        kept_rows = sums[idx_alive_tokens] * stage_seq.to(fdtype)  # [B] kept valid tokens
        kept_token_count = kept_rows.sum()
        kept_seq_count = (stage_seq.to(fdtype) * sm * has_tokens.to(fdtype)).sum()
        # Reduced already: identical on every rank.
        nonfinite = (seq_nonfinite.sum(), "none", "replicated")
    else:
        kept_token_count = kept_seq_count = None
        nonfinite = ((valid_b & ~d_finite).sum().to(fdtype), "none", "sum")
    if cfg.rejection_sampling:
        rejected_b = valid_b & ~stage_tok  # rejected by the filters (not by non-finite inputs)
        metrics["rs_token_rejected_frac"] = (
            (rejected_b.to(fdtype) * valid).sum() / (global_valid_toks + EPS),
            "tokens",
            "sum",
        )
        metrics["rs_seq_rejected_frac"] = (
            ((~stage_seq).to(fdtype) * sm).sum() / (global_valid_seqs + EPS),
            "sequences",
            "replicated",
        )
    metrics["nonfinite_log_ratio_count"] = nonfinite

    # ---- IS weights at the chosen level, then truncation ----
    raw_weight = is_weights(level, d, d_finite, seq_d_sum, seq_n, seq_nonfinite)
    weight, trunc_metrics = truncate_weights(
        raw_weight, cfg, seq_d_sum, seq_ntok, valid, sm, global_valid_seqs, global_valid_toks
    )
    metrics.update(trunc_metrics)

    _add_weight_metrics(
        metrics, raw_weight, weight, loss_tokens, stage_seq, valid, valid_b, sm, level,
        global_valid_seqs, global_valid_toks, has_tokens,
    )
    return CorrectionResult(
        is_weight=weight,
        keep=keep,
        keep_b=keep_b,
        loss_tokens=loss_tokens,
        seq_token_count=seq_n,
        seq_mask_count=seq_ntok,
        kept_token_count=kept_token_count,
        kept_seq_count=kept_seq_count,
        valid_b=valid_b,
        metrics=metrics,
    )


def is_weights(
    level: str,
    d: torch.Tensor,  # [B, T]
    d_finite: torch.Tensor,  # [B, T] bool
    seq_d_sum: torch.Tensor,  # [B] sum_t m d, reduced over ranks
    seq_n: torch.Tensor,  # [B] n_i, reduced over ranks
    seq_nonfinite: torch.Tensor,  # [B] valid tokens with non-finite d, reduced over ranks
) -> torch.Tensor:
    """Untruncated IS weight: ``[B, T]`` for ``token``, ``[B, 1]`` for the sequence levels.

    ``token``: ``exp(d_t)``; ``sequence``: ``exp(sum_t m d)``; ``sequence_mean``:
    ``exp(sum_t m d / n)``. A non-finite log-ratio gives weight 0 (its token, or its sequence).
    """
    if level == "token":
        return finite_exp(d) * d_finite
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
        oob = ((raw_weight > hi) | (raw_weight < lo)).to(fdtype)
        return raw_weight.clamp(lo, hi), {"is_oob_ratio": (_token_mean(oob, valid, gvt), "tokens", "sum")}
    if t == "icepop":
        inside = (raw_weight >= lo) & (raw_weight <= hi)
        oob = (~inside).to(fdtype)
        weight = torch.where(inside, raw_weight, torch.zeros_like(raw_weight))
        return weight, {"is_oob_ratio": (_token_mean(oob, valid, gvt), "tokens", "sum")}
    # seq-mask-tis: NeMo-RL's rule, the geometric mean over token_mask (non-finite
    # log-ratios counted as 0) decides; survivors keep the untruncated weight.
    geo = torch.exp(seq_d_sum / (seq_ntok + EPS))
    seq_in = ((geo >= lo) & (geo <= hi)).to(fdtype)  # [B]
    oob_frac = ((1.0 - seq_in) * sm).sum() / (gvs + EPS)
    return raw_weight * seq_in.unsqueeze(-1), {"is_oob_ratio": (oob_frac, "sequences", "replicated")}


def _token_mean(values: torch.Tensor, valid: torch.Tensor, denom: torch.Tensor) -> torch.Tensor:
    # values may be [B, 1] (a sequence weight): broadcast over the sequence's tokens on purpose.
    return (values.expand_as(valid) * valid).sum() / (denom + EPS)


def _add_weight_metrics(
    metrics: dict,
    raw_weight: torch.Tensor,
    weight: torch.Tensor,
    loss_tokens: torch.Tensor,
    seq_kept: torch.Tensor,
    valid: torch.Tensor,
    valid_b: torch.Tensor,
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
        unit_mask, unit_b = valid, valid_b  # [B, T]
        weighted = weight * loss_tokens  # applied weight x valid mask, rejected units 0
        raw = raw_weight
        norm, red, denom = "tokens", "sum", gvt
    else:
        unit_mask = sm * has_tokens.to(sm.dtype)  # [B]
        unit_b = unit_mask != 0
        # A sequence's weight after rejection: 0 when a sequence filter rejected it.
        weighted = weight.squeeze(-1) * seq_kept.to(weight.dtype) * unit_mask
        raw = raw_weight.squeeze(-1)
        norm, red, denom = "sequences", "replicated", gvs
    applied = weight if level == "token" else weight.squeeze(-1)
    sum_w = weighted.sum()
    sum_w2 = (weighted * applied).sum()
    metrics["is_weight_raw_mean"] = ((raw * unit_mask).sum() / (denom + EPS), norm, red)
    metrics["is_weight_mean"] = (sum_w / (denom + EPS), norm, red)
    metrics["is_weight_sq_mean"] = (sum_w2 / (denom + EPS), norm, red)
    metrics["is_weight_raw_min"] = (masked_extreme(raw, unit_b, largest=False), "none", "min")
    metrics["is_weight_raw_max"] = (masked_extreme(raw, unit_b, largest=True), "none", "max")
    kept_units = weighted > 0
    metrics["is_weight_min"] = (masked_extreme(applied, kept_units, largest=False), "none", "min")
    metrics["is_weight_max"] = (masked_extreme(applied, kept_units, largest=True), "none", "max")
    # ESS from sums; with sharded tokens they are reduced with the other metrics first.
    metrics["_ess_sum_w"] = (sum_w, "none", red)
    metrics["_ess_sum_w2"] = (sum_w2, "none", red)
    metrics["_ess_n"] = (unit_mask.sum(), "none", red)

