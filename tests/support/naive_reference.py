"""Naive reference of the ``rs_clipped_pg`` correction layer: plain Python, one sequence and
one token at a time, float64 (Python floats).

Written from the formulas of docs/guide.md and the config docstrings (and, for the objective,
NeMo-RL's ``ClippedPGLossFn``), as VERL checks its rollout correction: no tensor code and
nothing from ``nemo_rs_plugin``, so a vectorisation, masking or reduction slip in the package
cannot be repeated here. The gradient with respect to the current log-probs is derived by
hand, token by token.

Scope (anything else raises ``NotImplementedError``): PPO token ratio, GSPO sequence ratio,
REINFORCE; token- or sequence-level loss; the reference-policy KL penalty (k1/k2/k3 with input
and output clamps, no on-policy approximation); IS weights at every level; ``tis``,
``icepop``, ``seq-mask-tis``; the batch normalisation of one process (``microbatch``, and
``data_parallel`` without a data-parallel group); every rejection filter (every metric,
``log_ratio`` and ``advantage_sign: negative``); both rejection denominators. Not
covered (parity with NeMo-RL's recordings covers them): CISPO, dual clip, forced on-policy
ratio, on-policy KL approximation, the VAPO NLL term.

Conventions the docs leave open and the reference fixes (each says where it comes from):

* An empty sequence (no valid token) has the log-mean ``0`` (NeMo-RL's ``sum / (n + 1e-8)``),
  so its ``sequence_mean`` weight and seq-mask-tis geometric mean are 1.
* ``is_weight_min/max`` range over kept units whose applied weight is non-zero; a weight
  zeroed by truncation or a non-finite log-ratio counts as removed, like a rejected unit.
* The GSPO ratio averages ``curr - prev`` over the row's ``token_mask`` tokens with finite
  inputs (NeMo-RL's ratio), less the valid tokens a token filter rejected, so that a rejected
  token gets no gradient (VERL's rejection edits the mask its GSPO ratio reads).
* Tokens whose inputs are not finite are not "rejected": they count as kept for the
  ``kept`` denominators, but carry no loss (every term is 0 there).

Every decision of a filter or a truncation records its distance to the bound (in log space
for ratios) in ``margin``: a random test redraws bounds that fall within float rounding of
a statistic, so that exact mask comparisons are meaningful.
"""

from __future__ import annotations

import math
from typing import Any, Optional

INF = math.inf
#: The weight-tail factor C of is_weight_raw_{low,high}_frac, as docs/guide.md states it (written here, not imported).
WEIGHT_TAIL = 2.0
LOG_RATIO_CLAMP = 20.0  # policy log-ratios are clamped straight-through (value only)

SUPPORTED = {
    "name",
    "sequence_level_importance_ratios",
    "token_level_loss",
    "disable_ppo_ratio",
    "ratio_clip_min",
    "ratio_clip_max",
    "reference_policy_kl_penalty",
    "reference_policy_kl_type",
    "kl_input_clamp_value",
    "kl_output_clamp_value",
    "use_importance_sampling_correction",
    "truncated_importance_sampling_type",
    "truncated_importance_sampling_ratio",
    "truncated_importance_sampling_ratio_min",
    "is_correction_level",
    "rejection_sampling",
    "rejection_denominator",
    "use_kl_in_reward",
    "is_batch_normalization",
}
OFF = {
    "use_cispo": False,
    "ratio_clip_c": None,
    "force_on_policy_ratio": False,
    "use_on_policy_kl_approximation": False,
    "positive_example_nll_weight": 0.0,
}


def filter_label(f: dict) -> str:
    """``<level>_<metric>[_<agg>][_<log_ratio>][_negative_advantages]`` unless the filter names
    itself (docs/guide.md)."""
    if f.get("name"):
        return f["name"]
    parts = [f["level"], f.get("statistic", "ratio")]
    if f["level"] == "sequence":
        agg = f.get("agg") or "mean"
        parts.append({"max": "largest", "min": "smallest"}.get(agg, agg))  # no "_max": NeMo-RL scales those
    if f.get("log_ratio", "prev-gen") != "prev-gen":
        parts.append(f["log_ratio"])
    if f.get("advantage_sign") == "negative" or f.get("negative_advantages_only"):
        parts.append("negative_advantages")
    return "_".join(parts)


def with_unique_labels(filters: list[dict]) -> list[dict]:
    """Filters with a ``name`` added where a label repeats (the config refuses duplicates)."""
    seen: set[str] = set()
    out = []
    for i, f in enumerate(filters):
        if filter_label(f) in seen:
            f = {**f, "name": f"{filter_label(f)}_stage{i}"}
        seen.add(filter_label(f))
        out.append(f)
    return out


PROBABILITY_CLAMP = 1e-6  # OpenRLHF's clamp of the sampled token's probabilities


def _probabilities(a: float, b: float) -> tuple[float, float]:
    """The sampled token's probabilities under the target ``a`` and the behaviour ``b``, clamped."""
    clamp = lambda p: min(max(p, PROBABILITY_CLAMP), 1 - PROBABILITY_CLAMP)  # noqa: E731
    return clamp(math.exp(a)), clamp(math.exp(b))


def _binary_kl(d: float, a: float, b: float) -> float:
    pa, pb = _probabilities(a, b)
    return pb * math.log(pb / pa) + (1 - pb) * math.log((1 - pb) / (1 - pa))


def _total_variation(d: float, a: float, b: float) -> float:
    pa, pb = _probabilities(a, b)
    return abs(pb - pa)


#: Each filter statistic, written again from its formula (not read from the plugin's registry, so
#: that a wrong formula there is caught); ``tests/core/test_reference.py`` holds the keys equal to
#: the registry's.
TOKEN_STATISTICS: dict = {
    "ratio": lambda d, a, b: math.exp(d),
    "kl_k1": lambda d, a, b: -d,
    "kl_k2": lambda d, a, b: d * d / 2,
    "kl_k3": lambda d, a, b: math.exp(d) - 1 - d,
    "mult_prob_error": lambda d, a, b: math.exp(abs(d)),
    "chi2": lambda d, a, b: (math.exp(d) - 1) ** 2,
    "binary_kl": _binary_kl,
    "total_variation": _total_variation,
    "prob_diff": lambda d, a, b: math.exp(a) - math.exp(b),  # unclamped (prime-rl)
}


def token_statistic(metric: str, d: float, a: Optional[float] = None, b: Optional[float] = None) -> float:
    """Per-token statistic from ``d = a - b`` (log-probs of the target ``a`` and behaviour ``b``):
    the ratio ``exp(d)`` itself, a KL(b || a) estimator, ``exp(|d|)``, the sampled token's
    binary KL / total variation (probabilities clamped to [1e-6, 1 - 1e-6]) or its probability
    difference ``p_a - p_b``. An unknown metric is a ``KeyError``."""
    return TOKEN_STATISTICS[metric](d, a, b)


def sequence_statistic(metric: str, agg: str, ds: list[float], pairs: Optional[list] = None) -> Optional[float]:
    """A sequence filter's statistic over the log-ratios ``ds`` of its tokens (None if empty);
    ``pairs`` holds each token's ``(a, b)`` log-probs for the probability-space metrics.

    Ratios aggregate in log space: ``mean`` the geometric mean, ``sum`` the product,
    ``max``/``min`` the extreme token ratio. Every other statistic aggregates arithmetically.
    (``any`` has no single statistic; see :func:`_sequence_keep`.)
    """
    if not ds:
        return None
    if metric == "ratio":
        logs = {"mean": sum(ds) / len(ds), "sum": sum(ds), "max": max(ds), "min": min(ds)}[agg]
        return math.exp(logs)
    pairs = pairs or [(None, None)] * len(ds)
    vals = [token_statistic(metric, d, a, b) for d, (a, b) in zip(ds, pairs)]
    return {"mean": sum(vals) / len(vals), "sum": sum(vals), "max": max(vals)}[agg]


class _Margins:
    """Smallest distance between a decided statistic and a bound."""

    def __init__(self) -> None:
        self.value = INF

    def inside(self, x: float, lower: Optional[float], upper: Optional[float], log_space: bool) -> bool:
        """``lower <= x <= upper`` (None = open), recording the distance to each bound."""
        for bound in (lower, upper):
            if bound is None:
                continue
            if log_space:
                if bound > 0 and x > 0:
                    self.value = min(self.value, abs(math.log(x) - math.log(bound)))
            else:
                self.value = min(self.value, abs(x - bound))
        return (lower is None or x >= lower) and (upper is None or x <= upper)


def _kl_k(kl_type: str, x: float) -> tuple[float, float]:
    """Schulman's estimator of KL(curr || ref) from ``x = ref - curr``, and its derivative in x."""
    if kl_type == "k1":
        return -x, -1.0
    if kl_type == "k2":
        return x * x / 2, x
    if kl_type == "k3":
        return math.exp(x) - 1 - x, math.exp(x) - 1
    raise ValueError(kl_type)


def _ppo(adv: float, r: float, lo: float, hi: float) -> tuple[float, float]:
    """``max(-A r, -A clip(r, 1 - lo, 1 + hi))`` and its derivative in ``r``."""
    rc = min(max(r, 1 - lo), 1 + hi)
    a, b = -adv * r, -adv * rc
    if 1 - lo <= r <= 1 + hi or a > b:
        return max(a, b), -adv  # unclipped branch (inside the range both branches agree)
    return b, 0.0


def reference(cfg: dict, batch: dict) -> dict[str, Any]:
    """Loss, gradient, kept mask, IS weights and metrics of one microbatch.

    Args:
        cfg: the loss configuration (dict, as a recipe's ``loss_fn``).
        batch: aligned ``[B][T]`` lists ``curr``, ``prev``, ``gen``, ``ref``, ``adv``,
            ``token_mask`` (0/1); ``sample_mask`` ``[B]`` (0/1); floats ``gvs``, ``gvt``.

    Returns:
        ``loss``; ``grad`` ``[B][T]`` (d loss / d curr); ``kept`` ``[B][T]`` 0/1 (valid tokens
        that reach the loss); ``weight`` ``[B][T]`` (IS weight after truncation, at valid
        tokens; None elsewhere); ``metrics``; ``normalizations``; ``margin``.
    """
    unknown = set(cfg) - SUPPORTED - set(OFF)
    off = [k for k, v in OFF.items() if cfg.get(k, v) != v]
    if unknown or off:
        raise NotImplementedError(f"outside the reference's scope: {sorted(unknown) + off}")

    curr, prev, gen, ref, adv = (batch[k] for k in ("curr", "prev", "gen", "ref", "adv"))
    tm, sm = batch["token_mask"], batch["sample_mask"]
    gvs, gvt = float(batch["gvs"]), float(batch["gvt"])
    B, T = len(tm), len(tm[0])
    rows = range(B)
    margins = _Margins()

    gspo = cfg.get("sequence_level_importance_ratios", False)
    token_level_loss = cfg.get("token_level_loss", True)
    reinforce = cfg.get("disable_ppo_ratio", False)
    clip_lo, clip_hi = cfg.get("ratio_clip_min", 0.2), cfg.get("ratio_clip_max", 0.2)
    beta = 0.0 if cfg.get("use_kl_in_reward", False) else cfg.get("reference_policy_kl_penalty", 0.01)
    kl_type = cfg.get("reference_policy_kl_type", "k3")
    kl_in, kl_out = cfg.get("kl_input_clamp_value", 20.0), cfg.get("kl_output_clamp_value", 10.0)
    use_is = cfg.get("use_importance_sampling_correction", False)
    trunc = cfg.get("truncated_importance_sampling_type")
    t_hi = cfg.get("truncated_importance_sampling_ratio")
    t_lo = cfg.get("truncated_importance_sampling_ratio_min")
    level = cfg.get("is_correction_level") or ("sequence" if gspo else "token")
    filters = list(cfg.get("rejection_sampling") or [])
    kept_denominator = cfg.get("rejection_denominator", "original") == "kept"

    # ---- per token: validity, the log-ratio d = prev - gen, finiteness of the inputs
    valid = [[tm[i][t] * sm[i] > 0 for t in range(T)] for i in rows]
    d_ok = [[math.isfinite(prev[i][t] - gen[i][t]) for t in range(T)] for i in rows]
    d = [[prev[i][t] - gen[i][t] if d_ok[i][t] else 0.0 for t in range(T)] for i in rows]
    ok = [
        [d_ok[i][t] and math.isfinite(curr[i][t]) and (beta == 0 or math.isfinite(ref[i][t])) for t in range(T)]
        for i in rows
    ]
    n = [sum(valid[i]) for i in rows]  # valid tokens per sequence
    ntm = [sum(tm[i]) for i in rows]  # token_mask tokens per sequence
    d_sum = [sum(d[i][t] for t in range(T) if valid[i][t]) for i in rows]
    d_bad = [any(valid[i][t] and not d_ok[i][t] for t in range(T)) for i in rows]

    # ---- IS weight at the chosen level (docs/guide.md#is-correction-level), then truncation
    def raw_weight(i: int, t: int) -> float:
        if level == "token":
            return math.exp(d[i][t]) if d_ok[i][t] else 0.0
        if d_bad[i]:
            return 0.0
        log_w = d_sum[i] if level == "sequence" else (d_sum[i] / n[i] if n[i] else 0.0)
        return math.exp(log_w)

    seq_mask_in = [True] * B
    if trunc == "seq-mask-tis":  # NeMo-RL: geometric mean over token_mask decides
        for i in rows:
            geo = math.exp(d_sum[i] / ntm[i]) if ntm[i] else 1.0
            seq_mask_in[i] = margins.inside(geo, t_lo, t_hi, log_space=True)

    raw = [[raw_weight(i, t) for t in range(T)] for i in rows]
    weight = [row[:] for row in raw]
    oob_tokens = 0
    for i in rows:
        for t in range(T):
            w = raw[i][t]
            # Decisions that reach a number: valid tokens, and each counted row's weight.
            record = valid[i][t] or (level != "token" and t == 0 and sm[i] > 0)
            inside = margins.inside if record else _Margins().inside
            if trunc == "tis":  # clamp to [min or 0, max]
                lo = t_lo or 0.0
                out_of_bounds = not inside(w, lo, t_hi, True)
                weight[i][t] = min(max(w, lo), t_hi)
            elif trunc == "icepop":  # zero outside [min, max]
                out_of_bounds = not inside(w, t_lo, t_hi, True)
                weight[i][t] = 0.0 if out_of_bounds else w
            elif trunc == "seq-mask-tis":  # zero the sequences outside, keep the others untruncated
                out_of_bounds = False
                weight[i][t] = w if seq_mask_in[i] else 0.0
            else:
                out_of_bounds = False
            oob_tokens += valid[i][t] and out_of_bounds

    # ---- batch normalisation (docs/guide.md#batch-normalisation): one process holds the batch
    batch_norm = cfg.get("is_batch_normalization")
    if batch_norm is not None:
        if level == "token":
            unit_w = [weight[i][t] for i in rows for t in range(T) if valid[i][t]]
        else:
            unit_w = [weight[i][0] for i in rows if sm[i] > 0 and n[i] > 0]
        mu = sum(unit_w) / len(unit_w) if unit_w else 0.0
        factor = mu if mu > 1e-8 else 1.0
        weight = [[w / factor for w in row] for row in weight]

    # ---- rejection: the ordered filters (docs/guide.md#rejection-sampling)
    metrics: dict[str, float] = {}
    if batch_norm is not None:
        metrics["is_batch_norm_factor"] = factor
    logp = {"curr": curr, "prev": prev, "gen": gen}
    negative = [[math.isfinite(adv[i][t]) and adv[i][t] < 0 for t in range(T)] for i in rows]
    alive = [[valid[i][t] for t in range(T)] for i in rows]  # valid tokens kept by token filters
    seq_alive = [True] * B  # not rejected by an unconditional sequence filter so far
    # Tokens an advantage-conditioned sequence filter removed, and the rows that lost one.
    removed = [[False] * T for _ in rows]
    cond_touched = [False] * B
    for f in filters:
        key = f"rs/{filter_label(f)}"
        metric = f.get("statistic", "ratio")
        lo, hi = f.get("lower"), f.get("upper")
        log_space = metric == "ratio"
        only_negative = f.get("advantage_sign") == "negative" or f.get("negative_advantages_only", False)
        a_name, b_name = f.get("log_ratio", "prev-gen").split("-")
        fa, fb = logp[a_name], logp[b_name]
        f_ok = [[math.isfinite(fa[i][t] - fb[i][t]) for t in range(T)] for i in rows]
        fd = [[fa[i][t] - fb[i][t] if f_ok[i][t] else 0.0 for t in range(T)] for i in rows]
        live = [seq_alive[i] and sm[i] > 0 for i in rows]  # rows still in play at this stage
        if f["level"] == "token":
            rejected_tokens, touched = 0, 0
            for i in rows:
                count = 0
                for t in range(T):
                    if not alive[i][t]:
                        continue
                    in_band = f_ok[i][t] and margins.inside(
                        token_statistic(metric, fd[i][t], fa[i][t], fb[i][t]), lo, hi, log_space
                    )
                    if not in_band and (negative[i][t] or not only_negative):
                        alive[i][t] = False
                        count += not removed[i][t]  # not already counted by a conditional filter
                if live[i]:
                    rejected_tokens += count
                    touched += count > 0
            metrics[f"{key}/token_rejected_frac"] = rejected_tokens / gvt
            metrics[f"{key}/seq_touched_frac"] = touched / gvs
        else:
            agg = f.get("agg") or "mean"
            rejected_seqs, rejected_tokens = 0, 0
            for i in rows:
                toks = [t for t in range(T) if alive[i][t]]
                if not toks:
                    keep = True  # a sequence with no token left is never rejected
                elif any(not f_ok[i][t] for t in toks):
                    keep = False  # a non-finite log-ratio rejects its sequence
                elif agg == "any":
                    keep = all([margins.inside(math.exp(fd[i][t]), lo, hi, True) for t in toks])
                else:
                    stat = sequence_statistic(
                        metric, agg, [fd[i][t] for t in toks], [(fa[i][t], fb[i][t]) for t in toks]
                    )
                    keep = margins.inside(stat, lo, hi, log_space)
                if keep or not live[i]:
                    continue
                if only_negative:
                    newly = [t for t in toks if negative[i][t] and not removed[i][t]]
                    for t in newly:
                        removed[i][t] = True
                    rejected_seqs += bool(newly)
                    rejected_tokens += len(newly)
                    cond_touched[i] = cond_touched[i] or bool(newly)
                else:
                    rejected_seqs += 1
                    rejected_tokens += sum(1 for t in toks if not removed[i][t])
                    seq_alive[i] = False
            metrics[f"{key}/seq_rejected_frac"] = rejected_seqs / gvs
            metrics[f"{key}/token_rejected_frac"] = rejected_tokens / gvt
    kept_not_rejected = [[alive[i][t] and seq_alive[i] and not removed[i][t] for t in range(T)] for i in rows]
    kept = [[kept_not_rejected[i][t] and ok[i][t] for t in range(T)] for i in rows]
    # A conditionally rejected row left with no token leaves as a sequence.
    seq_in_loss = [seq_alive[i] and not (cond_touched[i] and not any(kept_not_rejected[i])) for i in rows]
    if filters:
        n_kept = sum(sum(kept_not_rejected[i]) for i in rows)
        metrics["rs_token_rejected_frac"] = (sum(n) - n_kept) / gvt
        metrics["rs_seq_rejected_frac"] = (
            sum(1 for i in rows if sm[i] > 0 and (not seq_alive[i] or cond_touched[i])) / gvs
        )

    # ---- denominators: the batch's, or shrunk by the kept fraction (VERL decoupled)
    gvt_loss, gvs_loss = gvt, gvs
    if kept_denominator:
        n_valid = sum(n)
        n_seqs = sum(1 for i in rows if sm[i] > 0 and n[i] > 0)
        kept_toks = sum(sum(kept_not_rejected[i]) for i in rows)
        kept_seqs = sum(1 for i in rows if sm[i] > 0 and n[i] > 0 and seq_in_loss[i])
        gvt_loss = gvt * kept_toks / n_valid if n_valid else 0.0
        gvs_loss = gvs * kept_seqs / n_seqs if n_seqs else 0.0

    # ---- objective per token, and its derivative in curr
    gspo_r = [1.0] * B
    gspo_m = [0] * B
    gspo_idx = [[] for _ in rows]  # the tokens each row's GSPO ratio averages over
    if gspo and not reinforce:
        for i in rows:
            idx = [t for t in range(T) if tm[i][t] and ok[i][t] and (alive[i][t] or not valid[i][t])]
            gspo_idx[i] = idx
            gspo_m[i] = len(idx)
            x = sum(curr[i][t] - prev[i][t] for t in idx) / len(idx) if idx else 0.0
            gspo_r[i] = math.exp(max(-LOG_RATIO_CLAMP, min(LOG_RATIO_CLAMP, x)))

    def policy_term(i: int, t: int) -> tuple[float, float]:
        """pg value and d pg / d (the token's own ratio input): d/d curr (token), d/d r (GSPO)."""
        a = adv[i][t]
        if reinforce:
            return -a * curr[i][t], -a
        if gspo:
            return _ppo(a, gspo_r[i], clip_lo, clip_hi)
        x = curr[i][t] - prev[i][t]
        r = math.exp(max(-LOG_RATIO_CLAMP, min(LOG_RATIO_CLAMP, x)))
        value, d_dr = _ppo(a, r, clip_lo, clip_hi)
        return value, d_dr * r  # straight-through clamp: d r / d curr = r

    def kl_term(i: int, t: int) -> tuple[float, float]:
        """beta * w * k(ref - curr) with w = exp(curr - sg(curr)) (value 1), and its derivative."""
        if beta == 0:
            return 0.0, 0.0
        x = ref[i][t] - curr[i][t]
        clamped = kl_in is not None and abs(x) > kl_in
        xc = max(-kl_in, min(kl_in, x)) if kl_in is not None else x
        k, dk = _kl_k(kl_type, xc)
        grad = 0.0 if clamped else k - dk  # d/dcurr [w k(x)] = k(x) * 1 + k'(x) * (-1)
        if kl_out is not None and abs(k) > kl_out:
            k, grad = math.copysign(kl_out, k), 0.0
        return beta * k, beta * grad

    is_w = weight if use_is else [[1.0] * T for _ in rows]
    loss = kl_total = 0.0
    grad = [[0.0] * T for _ in rows]
    for i in rows:
        if token_level_loss:
            scale = 1.0 / gvt_loss if gvt_loss else 0.0
            row_tokens = [t for t in range(T) if kept[i][t]]  # valid, kept, finite
        else:
            scale = sm[i] / ntm[i] / gvs_loss if ntm[i] and gvs_loss else 0.0
            row_tokens = [t for t in range(T) if kept[i][t]]  # rows with sample_mask 0 have scale 0
        gspo_dr = 0.0
        for t in row_tokens:
            pg, dpg = policy_term(i, t)
            kl, dkl = kl_term(i, t)
            loss += scale * (is_w[i][t] * pg + kl)
            kl_total += scale * kl
            if gspo and not reinforce:
                gspo_dr += scale * is_w[i][t] * dpg
                grad[i][t] += scale * dkl
            else:
                grad[i][t] += scale * (is_w[i][t] * dpg + dkl)
        if gspo and not reinforce and gspo_m[i]:
            for s in gspo_idx[i]:  # d r_i / d curr_is = r_i / m_i on the ratio's tokens
                grad[i][s] += gspo_dr * gspo_r[i] / gspo_m[i]

    # ---- metrics of the correction layer
    metrics["loss"] = loss
    metrics["kl_penalty"] = kl_total / beta if beta else 0.0
    metrics["nonfinite_log_ratio_count"] = float(sum(valid[i][t] and not d_ok[i][t] for i in rows for t in range(T)))
    if level == "token":
        units = [(i, t) for i in rows for t in range(T) if valid[i][t]]
        raw_of = {u: raw[u[0]][u[1]] for u in units}
        applied = {u: weight[u[0]][u[1]] for u in units if kept[u[0]][u[1]]}
        raw_range = [raw_of[u] for u in units if ok[u[0]][u[1]]]
        denom = gvt
        sir = sum(weight[i][t] for (i, t) in units if ok[i][t]) / gvt
    else:
        units = [i for i in rows if sm[i] > 0 and n[i] > 0]
        raw_of = {i: raw[i][0] for i in units}
        applied = {i: weight[i][0] for i in units if seq_in_loss[i]}
        raw_range = list(raw_of.values())
        denom = gvs
        # the mean over valid sequences, in NeMo-RL's GSPO mode too (not its [B, 1] x [B] broadcast, #3753)
        sir = sum(weight[i][0] for i in rows if sm[i] > 0) / gvs
    positive = [w for w in applied.values() if w != 0]
    sum_w, sum_w2 = sum(applied.values()), sum(w * w for w in applied.values())
    metrics["is_weight_raw_mean"] = sum(raw_of.values()) / denom
    metrics["is_weight_mean"] = sum_w / denom
    metrics["is_weight_sq_mean"] = sum_w2 / denom
    metrics["is_weight_raw_min"] = min(raw_range, default=INF)
    metrics["is_weight_raw_max"] = max(raw_range, default=-INF)
    # the tails count the units of the extremes (valid with finite inputs at the token level)
    metrics["is_weight_raw_low_frac"] = sum(w < 1 / WEIGHT_TAIL for w in raw_range) / denom
    metrics["is_weight_raw_high_frac"] = sum(w > WEIGHT_TAIL for w in raw_range) / denom
    metrics["is_weight_min"] = min(positive, default=INF)
    metrics["is_weight_max"] = max(positive, default=-INF)
    metrics["is_ess"] = sum_w**2 / (len(units) * sum_w2) if sum_w2 > 0 and units else 0.0
    metrics["sampling_importance_ratio"] = sir
    if trunc in ("tis", "icepop"):
        metrics["is_oob_ratio"] = oob_tokens / gvt
    elif trunc == "seq-mask-tis":
        metrics["is_oob_ratio"] = sum(1 for i in rows if sm[i] > 0 and not seq_mask_in[i]) / gvs

    return {
        "loss": loss,
        "grad": grad,
        "kept": [[1 if kept[i][t] else 0 for t in range(T)] for i in rows],
        "weight": [[weight[i][t] if valid[i][t] else None for t in range(T)] for i in rows],
        "metrics": metrics,
        "normalizations": normalizations(cfg),
        "margin": margins.value,
    }


def normalizations(cfg: dict) -> dict[str, str]:
    """The global denominator of each correction metric, from docs/guide.md#metrics."""
    gspo = cfg.get("sequence_level_importance_ratios", False)
    level = cfg.get("is_correction_level") or ("sequence" if gspo else "token")
    unit = "tokens" if level == "token" else "sequences"
    out = {
        "loss": "tokens" if cfg.get("token_level_loss", True) else "sequences",
        "is_weight_raw_mean": unit,
        "is_weight_mean": unit,
        "is_weight_sq_mean": unit,
        "sampling_importance_ratio": unit,
        "is_weight_raw_min": "none",
        "is_weight_raw_max": "none",
        "is_weight_raw_low_frac": unit,
        "is_weight_raw_high_frac": unit,
        "is_weight_min": "none",
        "is_weight_max": "none",
        "is_ess": "none",
        "nonfinite_log_ratio_count": "none",
    }
    trunc = cfg.get("truncated_importance_sampling_type")
    if trunc is not None:
        out["is_oob_ratio"] = "sequences" if trunc == "seq-mask-tis" else "tokens"
    if cfg.get("is_batch_normalization") is not None:
        out["is_batch_norm_factor"] = "none"
    for f in cfg.get("rejection_sampling") or []:
        key = f"rs/{filter_label(f)}"
        out[f"{key}/token_rejected_frac"] = "tokens"
        out[f"{key}/{'seq_touched_frac' if f['level'] == 'token' else 'seq_rejected_frac'}"] = "sequences"
    if cfg.get("rejection_sampling"):
        out["rs_token_rejected_frac"] = "tokens"
        out["rs_seq_rejected_frac"] = "sequences"
    return out
