"""Seeded random batches against the naive reference (tests/support/naive_reference.py).

Every filter kind (level x metric x agg x bound kind), every IS level x truncation x
denominator x loss aggregation, and random multi-stage pipelines are run through the
package in float64 and through plain Python loops written from the docs. Kept masks must be
identical; IS weights, loss, gradient and metrics agree to 1e-6; the metric normalizations
are the documented ones. Bounds come from the batch's own statistics, so that filters keep
some units and reject others, and are redrawn when one falls within rounding of a
statistic. The same comparison runs on token shards over emulated CP / TP ranks.
"""

from __future__ import annotations

import contextlib
import math
import random

import pytest
import torch

import nemo_rs_plugin.core.loss as loss_module
from nemo_rs_plugin import CorrectedPGLoss
from nemo_rs_plugin.core.distributed import SequenceGroups
from nemo_rs_plugin.core.loss import LossInputs
from nemo_rs_plugin.core.registries.filter_statistics import FILTER_STATISTICS
from tests.support.config_warnings import DRAWN_CONFIG_WARNINGS
from tests.support.logprobs import at_most_zero_lists
from tests.support.naive_reference import reference, sequence_statistic, token_statistic, with_unique_labels
from tests.support.threaded_world import ThreadGroup, run_ranks

RTOL, ATOL = 1e-6, 1e-9
MIN_MARGIN = 1e-7  # statistics this close to a bound could fall either side by rounding
BAD = [math.nan, math.inf, -math.inf]

# Every test here draws configurations at random, and the reference must match wherever they
# land, including legal settings that do nothing: bounds outside a statistic's range (the fixed
# fallback bounds of _split, for a batch with fewer than 3 distinct values of a statistic, never
# reject or reject every unit), an IS level with the correction off, rejection_denominator 'kept'
# with no filter. Their ConfigWarnings are a side effect, not the subject.
pytestmark = [
    pytest.mark.filterwarnings(
        r"ignore:loss_fn\.rejection_sampling\.\d+:nemo_rs_plugin.core.settings.config.ConfigWarning"
    ),
    *DRAWN_CONFIG_WARNINGS,
]

#: Every statistic of the registry with its aggregations (prob_diff included).
AGGS = {name: list(s.aggregations) for name, s in FILTER_STATISTICS.items()}
BOUND_KINDS = ["lower", "upper", "both"]
FILTER_KINDS = [("token", m, None, b) for m in AGGS for b in BOUND_KINDS] + [
    ("sequence", m, a, b) for m in AGGS for a in AGGS[m] for b in BOUND_KINDS
]
# What a filter compares, and whether it rejects only negative-advantage tokens (OPSM).
LOG_RATIOS = ["gen-prev", "curr-gen", "curr-prev"]
OPTION_KINDS = [
    (level, metric, agg, log_ratio, negative)
    for level, agg in (("token", None), ("sequence", "mean"), ("sequence", "max"))
    for metric in ("ratio", "kl_k3", "binary_kl")
    for log_ratio in LOG_RATIOS
    for negative in (False, True)
]
LEVELS = [None, "token", "sequence", "sequence_mean"]
OBJECTIVES = {
    "ppo-token-mean": {"token_level_loss": True},
    "ppo-sequence-mean": {"token_level_loss": False},
    "gspo": {"token_level_loss": False, "sequence_level_importance_ratios": True},
    "reinforce": {"token_level_loss": True, "disable_ppo_ratio": True},
}


# ----------------------------------------------------------------------------- batches
def random_batch(rng: random.Random, nonfinite: bool = False) -> dict:
    """A ragged microbatch as Python lists: empty and sample-masked rows, outlier tokens of
    both signs, optionally non-finite log-probs; global counts local or larger."""
    B, T = rng.randint(3, 6), rng.randint(4, 10)
    sigma = rng.choice([0.05, 0.3, 1.0])
    prev = [[-rng.uniform(0.1, 3.0) for _ in range(T)] for _ in range(B)]
    d = [
        [
            rng.gauss(0, sigma) + (rng.choice([-1, 1]) * rng.uniform(2, 5) if rng.random() < 0.08 else 0.0)
            for _ in range(T)
        ]
        for _ in range(B)
    ]
    gen = [[prev[i][t] - d[i][t] for t in range(T)] for i in range(B)]
    curr = [[prev[i][t] + rng.gauss(0, 0.15) for t in range(T)] for i in range(B)]
    ref = [[prev[i][t] + rng.gauss(0, 0.3) for t in range(T)] for i in range(B)]
    adv = [[rng.gauss(0, 1) for _ in range(T)] for _ in range(B)]
    token_mask = [[0] * T for _ in range(B)]
    empty = rng.randrange(1, B) if rng.random() < 0.5 else None
    for i in range(B):
        if i == empty:
            continue
        start = rng.randint(0, T - 2)
        length = rng.randint(2 if i == 0 else 1, T - start)
        for t in range(start, start + length):
            token_mask[i][t] = 1
    sample_mask = [1.0 if i == 0 or rng.random() < 0.8 else 0.0 for i in range(B)]
    # Log-probs <= 0 (the noise above puts some above), every log-ratio between them unchanged.
    curr, prev, gen, ref = at_most_zero_lists(curr, prev, gen, ref)
    if nonfinite:
        for _ in range(rng.randint(1, 3)):
            target = rng.choice([gen, gen, prev, curr])
            target[rng.randrange(B)][rng.randrange(T)] = rng.choice(BAD)
    n_valid = sum(token_mask[i][t] * sample_mask[i] for i in range(B) for t in range(T))
    scale = rng.choice([1.0, 1.0, 1.5])  # 1.5: other microbatches / DP ranks share the step
    return {
        "curr": curr,
        "prev": prev,
        "gen": gen,
        "ref": ref,
        "adv": adv,
        "token_mask": token_mask,
        "sample_mask": sample_mask,
        "gvs": sum(sample_mask) * scale,
        "gvt": max(n_valid, 1.0) * scale,
    }


def _split(values: list[float], rng: random.Random, lo_q: tuple, hi_q: tuple, log_space: bool):
    """Two bounds between neighbouring values (geometric midpoint for ratios)."""
    v = sorted(set(values))
    if len(v) < 3:
        return (0.8, 1.25) if log_space else (-0.1, 0.1)

    def between(q: float) -> float:
        k = min(max(int(q * (len(v) - 1)), 0), len(v) - 2)
        return math.sqrt(v[k] * v[k + 1]) if log_space else (v[k] + v[k + 1]) / 2

    lo, hi = between(rng.uniform(*lo_q)), between(rng.uniform(*hi_q))
    return min(lo, hi), max(lo, hi)


def draw_filter(
    rng: random.Random,
    batch: dict,
    level: str,
    metric: str,
    agg,
    bounds: str,
    log_ratio: str = "prev-gen",
    negative: bool = False,
) -> dict:
    """A filter whose bounds split this batch's statistics (before earlier stages)."""
    B, T = len(batch["token_mask"]), len(batch["token_mask"][0])
    a_name, b_name = log_ratio.split("-")
    ds, pairs = [], []
    for i in range(B):
        row, row_pairs = [], []
        for t in range(T):
            a, b = batch[a_name][i][t], batch[b_name][i][t]
            if batch["token_mask"][i][t] and batch["sample_mask"][i] and math.isfinite(a - b):
                row.append(a - b)
                row_pairs.append((a, b))
        ds.append(row)
        pairs.append(row_pairs)
    if level == "token" or agg == "any":
        values = [token_statistic(metric, x, *ab) for row, rp in zip(ds, pairs) for x, ab in zip(row, rp)]
        qs = ((0.02, 0.3), (0.7, 0.98)) if agg == "any" else ((0.05, 0.45), (0.55, 0.95))
    else:
        values = [sequence_statistic(metric, agg, row, rp) for row, rp in zip(ds, pairs) if row]
        qs = ((0.05, 0.45), (0.55, 0.95))
    lo, hi = _split(values, rng, *qs, log_space=FILTER_STATISTICS[metric].log_space)
    f = {"level": level, "statistic": metric}
    if agg is not None:
        f["agg"] = agg
    if log_ratio != "prev-gen":
        f["log_ratio"] = log_ratio
    if negative:
        f["advantage_sign"] = "negative"
    if bounds in ("lower", "both"):
        f["lower"] = lo
    if bounds in ("upper", "both"):
        f["upper"] = hi
    return f


def draw_truncation(rng: random.Random, kind) -> dict:
    if kind is None:
        return {}
    jitter = rng.uniform(0.97, 1.03)
    if kind == "tis":
        cfg = {"truncated_importance_sampling_ratio": rng.choice([0.9, 1.1, 1.5, 2.0]) * jitter}
        low = rng.choice([None, 0.5, 0.9])
        if low is not None:
            high = cfg["truncated_importance_sampling_ratio"]
            cfg["truncated_importance_sampling_ratio_min"] = min(low * jitter, high)
    elif kind == "icepop":
        lo, hi = rng.choice([(0.7, 1.3), (0.5, 2.0), (0.9, 1.5)])
    else:
        lo, hi = rng.choice([(0.9, 1.1), (0.95, 1.05), (0.8, 1.02)])
    if kind != "tis":
        cfg = {
            "truncated_importance_sampling_ratio": hi * jitter,
            "truncated_importance_sampling_ratio_min": lo * jitter,
        }
    return {"use_importance_sampling_correction": True, "truncated_importance_sampling_type": kind, **cfg}


def draw_kl(rng: random.Random) -> dict:
    if rng.random() < 0.5:
        return {"reference_policy_kl_penalty": 0.0}
    return {
        "reference_policy_kl_penalty": rng.choice([0.05, 0.2]),
        "reference_policy_kl_type": rng.choice(["k1", "k2", "k3"]),
    }


def with_margin(rng: random.Random, batch: dict, make_cfg) -> tuple[dict, dict]:
    """``make_cfg(rng)`` until no decided statistic sits within rounding of its bound."""
    for _ in range(40):
        cfg = make_cfg(rng)
        want = reference(cfg, batch)
        if want["margin"] > MIN_MARGIN:
            return cfg, want
    raise AssertionError("could not draw bounds away from the statistics")


# ----------------------------------------------------------------------------- package side
def as_tensor(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


def nemo_rl_data(batch: dict) -> dict:
    B = len(batch["token_mask"])

    def pad(x):
        return torch.cat([torch.zeros(B, 1, dtype=x.dtype), x], dim=1)

    return {
        "advantages": pad(as_tensor(batch["adv"])),
        "prev_logprobs": pad(as_tensor(batch["prev"])),
        "generation_logprobs": pad(as_tensor(batch["gen"])),
        "reference_policy_logprobs": pad(as_tensor(batch["ref"])),
        "token_mask": pad(torch.tensor(batch["token_mask"], dtype=torch.long)),
        "sample_mask": as_tensor(batch["sample_mask"]),
    }


@contextlib.contextmanager
def captured_correction():
    """Record the :class:`CorrectionResult` the loss computes (masks and weights it used)."""
    seen = []
    original = loss_module.apply_correction  # the correction's last step (apply): its result is the correction's

    def spy(*args, **kwargs):
        out = original(*args, **kwargs)
        seen.append(out)
        return out

    loss_module.apply_correction = spy
    try:
        yield seen
    finally:
        loss_module.apply_correction = original


def run_package(cfg: dict, batch: dict):
    loss_fn = CorrectedPGLoss(cfg)
    lp = as_tensor(batch["curr"]).requires_grad_(True)
    with captured_correction() as seen:
        loss, metrics = loss_fn(
            lp,
            nemo_rl_data(batch),
            torch.tensor(batch["gvs"], dtype=torch.float64),
            torch.tensor(batch["gvt"], dtype=torch.float64),
        )
    loss.backward()
    return loss.item(), lp.grad, seen[0], metrics, loss_fn.metric_normalizations()


# ----------------------------------------------------------------------------- comparison
def close(a: float, b: float) -> bool:
    if math.isinf(b) or math.isinf(a):
        return a == b
    return math.isclose(a, b, rel_tol=RTOL, abs_tol=ATOL)


def assert_metrics(label: str, metrics: dict, want: dict) -> None:
    for key, value in want.items():
        assert key in metrics, f"{label}: metric {key} missing"
        assert close(metrics[key], value), f"{label}: {key} = {metrics[key]!r}, reference {value!r}"
    ours = {k for k in metrics if k.startswith(("rs", "is_"))}
    theirs = {k for k in want if k.startswith(("rs", "is_"))}
    assert ours == theirs, f"{label}: correction metrics {sorted(ours ^ theirs)} differ"


def assert_matches_reference(label: str, cfg: dict, batch: dict, want: dict) -> None:
    loss, grad, corr, metrics, norms = run_package(cfg, batch)
    B, T = len(batch["token_mask"]), len(batch["token_mask"][0])
    kept = (corr.loss_tokens != 0).int().tolist()
    assert kept == want["kept"], f"{label}: kept mask\n package   {kept}\n reference {want['kept']}"
    weight = corr.is_weight.expand(B, T)
    for i in range(B):
        for t in range(T):
            if want["weight"][i][t] is not None:
                got = weight[i, t].item()
                assert close(got, want["weight"][i][t]), f"{label}: IS weight [{i},{t}] {got} vs {want['weight'][i][t]}"
    assert close(loss, want["loss"]), f"{label}: loss {loss} vs {want['loss']}"
    torch.testing.assert_close(grad, as_tensor(want["grad"]), rtol=RTOL, atol=ATOL, msg=lambda m: f"{label}: grad {m}")
    assert_metrics(label, metrics, want["metrics"])
    for key, norm in want["normalizations"].items():
        assert norms.get(key) == norm, f"{label}: normalization of {key} is {norms.get(key)!r}, documented {norm!r}"


def objective_cfg(rng: random.Random, name: str, level) -> dict:
    cfg = {**OBJECTIVES[name], "ratio_clip_min": rng.choice([0.1, 0.2]), "ratio_clip_max": rng.choice([0.2, 0.28])}
    cfg["use_importance_sampling_correction"] = rng.random() < 0.75
    if level is not None:
        cfg["is_correction_level"] = level
    cfg["rejection_denominator"] = rng.choice(["original", "kept"])
    return cfg


# ----------------------------------------------------------------------------- the tests
@pytest.mark.parametrize("kind", FILTER_KINDS, ids=["-".join(str(x) for x in k if x) for k in FILTER_KINDS])
def test_each_filter_kind_matches_the_reference(kind):
    level, metric, agg, bounds = kind
    rng = random.Random(f"filter-{kind}")
    for case in range(2):  # a finite batch, then one with non-finite log-probs
        batch = random_batch(rng, nonfinite=case == 1)
        objective = rng.choice(sorted(OBJECTIVES))
        base = {**objective_cfg(rng, objective, rng.choice(LEVELS)), **draw_kl(rng)}

        def make(r, base=base, batch=batch):
            return {**base, "rejection_sampling": [draw_filter(r, batch, level, metric, agg, bounds)]}

        cfg, want = with_margin(rng, batch, make)
        assert_matches_reference(f"{kind} case {case} {cfg}", cfg, batch, want)


@pytest.mark.parametrize("kind", OPTION_KINDS, ids=["-".join(str(x) for x in k if x) for k in OPTION_KINDS])
def test_log_ratio_and_advantage_condition_match_the_reference(kind):
    level, metric, agg, log_ratio, negative = kind
    rng = random.Random(f"option-{kind}")
    for case in range(2):  # a finite batch, then one with non-finite log-probs
        batch = random_batch(rng, nonfinite=case == 1)
        base = {**objective_cfg(rng, rng.choice(sorted(OBJECTIVES)), rng.choice(LEVELS)), **draw_kl(rng)}

        def make(r, base=base, batch=batch):
            return {
                **base,
                "rejection_sampling": [draw_filter(r, batch, level, metric, agg, "upper", log_ratio, negative)],
            }

        cfg, want = with_margin(rng, batch, make)
        assert_matches_reference(f"{kind} case {case} {cfg}", cfg, batch, want)


BATCH_NORM_CASES = [
    (lv, tr, scope)
    for lv in ("token", "sequence", "sequence_mean")
    for tr in (None, "tis", "icepop")
    for scope in ("microbatch", "data_parallel")
]


@pytest.mark.parametrize("case", BATCH_NORM_CASES, ids=["-".join(str(x) for x in c) for c in BATCH_NORM_CASES])
def test_batch_normalisation_matches_the_reference(case):
    level, trunc, scope = case
    rng = random.Random(f"batch-norm-{case}")
    batch = random_batch(rng, nonfinite=rng.random() < 0.3)

    def make(r):
        cfg = {
            **objective_cfg(r, r.choice(sorted(OBJECTIVES)), level),
            **draw_kl(r),
            **draw_truncation(r, trunc),
            "use_importance_sampling_correction": True,
            "is_batch_normalization": scope,
        }
        # Rejected units still count in the batch mean; an OPSM filter rejects some of them.
        cfg["rejection_sampling"] = [
            draw_filter(r, batch, "sequence", "ratio", "mean", "both"),
            draw_filter(r, batch, "sequence", "kl_k1", "mean", "upper", "curr-gen", True),
        ]
        return cfg

    cfg, want = with_margin(rng, batch, make)
    assert_matches_reference(f"{case} {cfg}", cfg, batch, want)


IS_CASES = [
    (lv, tr, den, obj)
    for lv in LEVELS
    for tr in (None, "tis", "icepop", "seq-mask-tis")
    for den in ("original", "kept")
    for obj in ("ppo-token-mean", "ppo-sequence-mean", "gspo")
    if not (tr == "seq-mask-tis" and obj == "gspo" and lv is None)
]


@pytest.mark.parametrize("case", IS_CASES, ids=["-".join(str(x) for x in c) for c in IS_CASES])
def test_is_level_truncation_and_denominator_match_the_reference(case):
    level, trunc, denominator, objective = case
    rng = random.Random(f"is-{case}")
    batch = random_batch(rng, nonfinite=rng.random() < 0.3)

    def make(r):
        cfg = {
            **objective_cfg(r, objective, level),
            **draw_kl(r),
            "use_importance_sampling_correction": True,
            "rejection_denominator": denominator,
            **draw_truncation(r, trunc),
        }
        # Geo-RS then Token-MIS, so that rejection shrinks the kept counts.
        cfg["rejection_sampling"] = [
            draw_filter(r, batch, "sequence", "ratio", "mean", "both"),
            draw_filter(r, batch, "token", "ratio", None, "both"),
        ]
        return cfg

    cfg, want = with_margin(rng, batch, make)
    assert_matches_reference(f"{case} {cfg}", cfg, batch, want)


def random_pipeline_cfg(rng: random.Random, batch: dict) -> dict:
    objective = rng.choice(sorted(OBJECTIVES))
    level = rng.choice(LEVELS)
    trunc = rng.choice([None, None, "tis", "icepop", "seq-mask-tis"])
    if trunc == "seq-mask-tis" and objective == "gspo" and level is None:
        trunc = "tis"
    cfg = {**objective_cfg(rng, objective, level), **draw_kl(rng), **draw_truncation(rng, trunc)}
    filters = [draw_filter(rng, batch, *rng.choice(FILTER_KINDS)) for _ in range(rng.randint(2, 4))]
    for _ in range(rng.choice([0, 0, 1, 2])):  # filters with a log-ratio option or the advantage condition
        level_, metric, agg, log_ratio, negative = rng.choice(OPTION_KINDS)
        filters.insert(
            rng.randrange(len(filters) + 1), draw_filter(rng, batch, level_, metric, agg, "upper", log_ratio, negative)
        )
    cfg["rejection_sampling"] = with_unique_labels(filters)
    if cfg.get("use_importance_sampling_correction") and rng.random() < 0.3:
        cfg["is_batch_normalization"] = rng.choice(["microbatch", "data_parallel"])
    return cfg


@pytest.mark.parametrize("seed", range(40))
def test_random_filter_pipelines_match_the_reference(seed):
    rng = random.Random(f"pipeline-{seed}")
    batch = random_batch(rng, nonfinite=rng.random() < 0.3)
    cfg, want = with_margin(rng, batch, lambda r: random_pipeline_cfg(r, batch))
    assert_matches_reference(f"seed {seed} {cfg}", cfg, batch, want)


# ------------------------------------------------------------- token shards on emulated ranks
LAYOUTS = {
    "cp2": (2, lambda: [[ThreadGroup([0, 1])]] * 2),
    # TP2 x CP2, tokens split over both: each rank reduces over its CP group, then its TP group.
    "tp2xcp2": (4, lambda: _grid()),
}


def _grid():
    tp = [ThreadGroup([0, 1]), ThreadGroup([2, 3])]
    cp = [ThreadGroup([0, 2]), ThreadGroup([1, 3])]
    return [[cp[r % 2], tp[r // 2]] for r in range(4)]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("seed", range(6))
def test_token_shards_on_emulated_ranks_match_the_reference(seed, layout, monkeypatch):
    """Each rank holds a contiguous slice of every sequence's tokens; its loss share, its
    slice of the gradient, and its metrics must equal the reference on the whole batch."""
    rng = random.Random(f"shards-{seed}")
    batch = random_batch(rng, nonfinite=seed % 3 == 2)
    cfg, want = with_margin(rng, batch, lambda r: random_pipeline_cfg(r, batch))
    world, make_groups = LAYOUTS[layout]
    rank_groups = make_groups()
    T = len(batch["token_mask"][0])
    if T < world:
        pytest.skip("fewer tokens than ranks")
    slices = torch.tensor_split(torch.arange(T), world)
    data = nemo_rl_data(batch)
    full = {k: v[:, 1:] for k, v in data.items() if k != "sample_mask"}
    curr = as_tensor(batch["curr"])
    gvs = torch.tensor(batch["gvs"], dtype=torch.float64)
    gvt = torch.tensor(batch["gvt"], dtype=torch.float64)
    loss_fn = CorrectedPGLoss(cfg)

    def rank_fn(rank):
        cols = slices[rank]
        lp = curr[:, cols].clone().requires_grad_(True)
        inputs = LossInputs(
            curr=lp,
            prev=full["prev_logprobs"][:, cols],
            generation=full["generation_logprobs"][:, cols],
            reference=full["reference_policy_logprobs"][:, cols],
            advantages=full["advantages"][:, cols],
            token_mask=full["token_mask"][:, cols],
            sample_mask=data["sample_mask"],
        )
        loss, metrics = loss_fn.compute(inputs, gvs, gvt, SequenceGroups(tuple(rank_groups[rank])))
        loss.backward()
        return loss.item(), lp.grad, metrics

    results = run_ranks(world, rank_fn, [g for gs in rank_groups for g in gs], monkeypatch)
    label = f"{layout} seed {seed} {cfg}"
    total = sum(r[0][0] for r in results)
    assert close(total, want["loss"]), f"{label}: loss shares sum to {total}, reference {want['loss']}"
    grad = torch.cat([r[0][1] for r in results], dim=1)
    torch.testing.assert_close(grad, as_tensor(want["grad"]), rtol=RTOL, atol=ATOL, msg=lambda m: f"{label}: grad {m}")
    for rank, ((_, _, metrics), _) in enumerate(results):
        assert_metrics(f"{label} rank {rank}", metrics, want["metrics"])
        assert metrics == results[0][0][2], f"{label}: rank {rank} reports other metrics than rank 0"
