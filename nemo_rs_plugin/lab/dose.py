"""The lab's dose-response run (``nemo-rs lab --lags ...``): outcomes that mean harm, paired tests, tables.

Every arm runs at every lag over the same seeds (the on-policy reference once per seed), so
seed ``i`` is a pair across arms and lags: the same initial weights, the same prompts. Per
run (:func:`run_outcome`), on the trainer's own policy (evaluated every ``eval_every`` steps):

* ``final_eval``: the mean of the last :data:`FINAL_EVALS` evaluations;
* ``eval_auc``: the mean of every evaluation of the run, the area under the evaluation curve
  over its length (evaluations are equally spaced): a collapse late in the run costs it only
  the share of the run it lasts, so one seed's collapse does not decide a comparison of it;
* ``regret``: the on-policy reference's ``final_eval`` at the same seed minus the run's;
* ``collapsed``: the evaluation peaked at :data:`COLLAPSE_PEAK` x chance or more (a real
  learning peak) and ``final_eval`` ended at or below :data:`COLLAPSE_DROP` of that peak;
* ``at_chance``: every one of the last :data:`FINAL_EVALS` evaluations at most
  :data:`AT_CHANCE` x chance;
* ``is_ess_mean`` (a diagnostic): the IS weights' effective sample size, mean over the steps;
* ``spiked`` (a diagnostic, relative to the run's own norm): a gradient norm before clipping
  above :data:`SPIKE_FACTOR` x the run's median (over the steps that had a gradient).

Chance is the expected reward of a sampler uniform over the model's whole vocabulary
(:func:`~nemo_rs_plugin.lab.model.chance_reward`).

Comparisons (:func:`dose_comparisons`): every arm against ``none`` at each lag, and every arm
against the on-policy reference at each lag, on the paired seeds: the sign-flip test and a
paired t interval and t-test on ``final_eval``, exact McNemar tests on ``collapsed`` and ``at_chance``,
and Holm's correction over every test of the run; "separated" means a Holm-adjusted
p < :data:`~nemo_rs_plugin.lab.stats.SIGNIFICANCE`. With one paired seed there is no t interval
or t-test (NaN, left out of Holm's family; the tables say so) and no sd over seeds.

The tables and the figure, rendered from the per-seed outcomes as :func:`write_seed_csv` writes
them, are in :mod:`~nemo_rs_plugin.lab.dose_report`.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path
from statistics import median
from typing import Any, Optional, Union

from nemo_rs_plugin.lab.experiment import CONFIGS, LabSettings
from nemo_rs_plugin.lab.model import chance_reward
from nemo_rs_plugin.lab.stats import MIN_SEEDS, SIGNIFICANCE, holm, mcnemar_exact, t_interval, t_test_p
from nemo_rs_plugin.tools import report

__all__ = [
    "AT_CHANCE",
    "BASELINE",
    "COLLAPSE_DROP",
    "COLLAPSE_PEAK",
    "FINAL_EVALS",
    "SEED_FIELDS",
    "OUTCOME_LABELS",
    "SPIKE_FACTOR",
    "TESTED",
    "by_seed",
    "configs_of",
    "lags_of",
    "reference_of",
    "dose_comparisons",
    "dose_outcomes",
    "dose_table",
    "planned_tests",
    "read_seed_csv",
    "run_outcome",
    "smallest_p",
    "write_seed_csv",
]

FINAL_EVALS = 3  # evaluations averaged into final_eval; all of them at chance for at_chance
COLLAPSE_PEAK = 3.0  # x chance: the evaluation's peak that counts as learning
COLLAPSE_DROP = 0.5  # final_eval at or below this share of the peak: collapsed
AT_CHANCE = 2.0  # x chance
SPIKE_FACTOR = 10.0  # x the run's median gradient norm
BASELINE = "none"
#: The outcomes tested for every comparison (all of them in one Holm family).
TESTED = ("final_eval", "collapsed", "at_chance")
OUTCOME_LABELS = {"final_eval": "final eval", "collapsed": "collapsed", "at_chance": "at chance"}

#: The per-seed CSV's columns (:func:`write_seed_csv`), the input of every table.
SEED_FIELDS = (
    "config",
    "lag",
    "seed",
    "final_eval",
    "eval_auc",
    "regret",
    "collapsed",
    "at_chance",
    "spiked",
    "eval_peak",
    "evals",
    "chance",
    "final_reward",
    "max_grad_norm",
    "median_grad_norm",
    "max_kl_gen_prev",
    "is_ess_mean",
    "seq_kept_mean",
    "warned",
    "band_lower",
    "band_upper",
    "wall_s",
)
#: Columns a per-seed CSV may lack: it was written before they existed (read as NaN). The
#: exploration run (docs/lab/lab_dose_seeds.csv) predates both.
OPTIONAL_FIELDS = ("eval_auc", "is_ess_mean")
_INTS = ("lag", "seed", "evals", "length")
_BOOLS = ("collapsed", "at_chance", "spiked", "warned")
_SEED_DIGITS = 10  # significant digits of the per-seed CSV's floats


# ---------------------------------------------------------------------------- outcomes
def _is_reference(config: str) -> bool:
    return config in CONFIGS and CONFIGS[config].on_policy


def run_outcome(rows: list[dict], chance: float) -> dict:
    """The outcomes of one run from its per-step rows (one arm, seed and lag, in step order)."""
    evals = [x["eval_reward"] for x in rows if not math.isnan(x["eval_reward"])]
    last = evals[-FINAL_EVALS:]
    final_eval = sum(last) / len(last) if last else math.nan
    peak = max(evals) if evals else math.nan
    with_gradient = [x["grad_norm"] for x in rows if x["grad_norm"] > 0]  # a fully rejected step has none
    norm = median(with_gradient) if with_gradient else 0.0
    max_norm = max(x["grad_norm_max"] for x in rows)
    tail = rows[-5:]
    return {
        "final_eval": final_eval,
        "eval_auc": sum(evals) / len(evals) if evals else math.nan,
        "collapsed": bool(evals) and peak >= COLLAPSE_PEAK * chance and final_eval <= COLLAPSE_DROP * peak,
        "at_chance": bool(last) and all(e <= AT_CHANCE * chance for e in last),
        "spiked": norm > 0 and max_norm > SPIKE_FACTOR * norm,
        "eval_peak": peak,
        "evals": len(evals),
        "chance": chance,
        "final_reward": sum(x["reward"] for x in tail) / len(tail),
        "max_grad_norm": max_norm,
        "median_grad_norm": norm,
        "max_kl_gen_prev": max(x["kl_gen_prev"] for x in rows),
        "is_ess_mean": sum(x["is_ess"] for x in rows) / len(rows),
        "seq_kept_mean": 1 - sum(x["seq_rejected_frac"] for x in rows) / len(rows),
        "warned": rows[-1]["rejection_warnings"] > 0,
        "band_lower": rows[-1]["band_lower"],
        "band_upper": rows[-1]["band_upper"],
        "wall_s": rows[-1]["wall_s"],
    }


def dose_outcomes(rows: list[dict], s: LabSettings) -> list[dict]:
    """One dict of :data:`SEED_FIELDS` per (arm, lag, seed), in arm order, then lag, then seed.

    ``regret`` is the on-policy reference's ``final_eval`` at the same seed minus the run's
    (NaN where the reference did not run that seed).
    """
    chance = chance_reward(s.vocab, s.length)
    runs: dict[tuple, list[dict]] = {}
    for r in rows:
        runs.setdefault((r["config"], r["lag"], r["seed"]), []).append(r)
    order = {c: i for i, c in enumerate(s.configs)}
    out = []
    for config, lag, seed in sorted(runs, key=lambda k: (order.get(k[0], len(order)), k[1], k[2])):
        steps = sorted(runs[(config, lag, seed)], key=lambda x: x["step"])
        out.append({"config": config, "lag": lag, "seed": seed, **run_outcome(steps, chance)})
    reference = {o["seed"]: o["final_eval"] for o in out if _is_reference(o["config"])}
    for o in out:
        o["regret"] = reference.get(o["seed"], math.nan) - o["final_eval"]
    return [{k: o[k] for k in SEED_FIELDS} for o in out]


def write_seed_csv(outcomes: list[dict], path: Union[str, Path], fields: tuple[str, ...] = SEED_FIELDS) -> None:
    """The per-seed outcomes (``fields``: :data:`SEED_FIELDS`, or a study's with more), floats to 10 digits."""
    report.write_csv(outcomes, str(path), list(fields), float_digits=_SEED_DIGITS)


def read_seed_csv(path: Union[str, Path], fields: tuple[str, ...] = SEED_FIELDS) -> list[dict]:
    """The per-seed outcomes as :func:`write_seed_csv` wrote them (the same ``fields``)."""

    def value(k: str, v: str):
        if k == "config":
            return v
        if k in _INTS:
            return int(v)
        if k in _BOOLS:
            if v not in ("True", "False"):
                raise ValueError(f"{path}: column {k}: expected True or False, got {v!r}")
            return v == "True"
        return float(v)

    with open(path, newline="") as fh:
        reader = csv.DictReader(fh)
        present = reader.fieldnames or []
        missing = [k for k in fields if k not in present and k not in OPTIONAL_FIELDS]
        if missing:
            raise ValueError(f"{path}: not a per-seed CSV of this run (missing columns: {', '.join(missing)})")
        return [{k: value(k, r[k]) if k in present else math.nan for k in fields} for r in reader]


# ---------------------------------------------------------------------------- comparisons
def configs_of(outcomes: list[dict]) -> list[str]:
    return list(dict.fromkeys(o["config"] for o in outcomes))


def lags_of(outcomes: list[dict]) -> list[int]:
    return sorted({o["lag"] for o in outcomes if not _is_reference(o["config"])})


def reference_of(outcomes: list[dict]) -> Optional[str]:
    return next((c for c in configs_of(outcomes) if _is_reference(c)), None)


def by_seed(outcomes: list[dict], config: str, lag: Optional[int]) -> dict[int, dict]:
    """The runs of ``config`` at ``lag`` by seed (``lag`` None: the reference, which has no lag)."""
    return {o["seed"]: o for o in outcomes if o["config"] == config and (lag is None or o["lag"] == lag)}


def _count(runs: list[dict], key: str) -> str:
    return f"{sum(o[key] for o in runs)}/{len(runs)}"


def _compare(a: str, b: str, lag: int, ra: dict[int, dict], rb: dict[int, dict]) -> Optional[dict]:
    seeds = sorted(set(ra) & set(rb))
    if not seeds:
        return None
    pa, pb = [ra[i] for i in seeds], [rb[i] for i in seeds]
    diffs = [x["final_eval"] - y["final_eval"] for x, y in zip(pa, pb)]
    lo, hi = t_interval(diffs)
    row = {
        "a": a,
        "b": b,
        "lag": lag,
        "seeds": len(seeds),
        "final_eval_a": sum(x["final_eval"] for x in pa) / len(pa),
        "final_eval_b": sum(y["final_eval"] for y in pb) / len(pb),
        "final_eval_diff": sum(diffs) / len(diffs),
        "final_eval_low": lo,
        "final_eval_high": hi,
        "final_eval_p": t_test_p(diffs),
    }
    for k in ("collapsed", "at_chance"):
        row[k] = f"{_count(pa, k)} vs {_count(pb, k)}"
        only_a = sum(x[k] and not y[k] for x, y in zip(pa, pb))
        only_b = sum(y[k] and not x[k] for x, y in zip(pa, pb))
        row[f"{k}_p"] = mcnemar_exact(only_a, only_b)
    return row


def dose_comparisons(outcomes: list[dict]) -> list[dict]:
    """Each arm against ``none`` at each lag, then each arm against the on-policy reference.

    Paired on the seeds both ran. ``*_p`` are the raw p-values, ``*_p_holm`` Holm-adjusted
    over every test of every comparison returned (:data:`TESTED` per comparison);
    ``separated`` lists the outcomes with a Holm-adjusted p below ``SIGNIFICANCE``.
    """
    configs, lags, ref = configs_of(outcomes), lags_of(outcomes), reference_of(outcomes)
    rows = []
    for b in (BASELINE, ref):
        if b is None or b not in configs:
            continue
        for a in configs:
            if a in (b, ref):
                continue
            for lag in lags:
                rb = by_seed(outcomes, b, None if b == ref else lag)
                row = _compare(a, b, lag, by_seed(outcomes, a, lag), rb)
                if row is not None:
                    rows.append(row)
    adjusted = holm([r[f"{k}_p"] for r in rows for k in TESTED])
    for i, r in enumerate(rows):
        for j, k in enumerate(TESTED):
            r[f"{k}_p_holm"] = adjusted[i * len(TESTED) + j]
        r["separated"] = [k for k in TESTED if r[f"{k}_p_holm"] < SIGNIFICANCE]
    return rows


def planned_tests(configs: list[str], lags: list[int]) -> int:
    """How many tests :func:`dose_comparisons` makes for these arms and lags (the Holm family)."""
    ref = next((c for c in configs if _is_reference(c)), None)
    arms = [c for c in configs if c != ref]
    comparisons = 0
    if BASELINE in configs:
        comparisons += (len(arms) - 1) * len(lags)
    if ref is not None:
        comparisons += len(arms) * len(lags)
    return comparisons * len(TESTED)


def smallest_p(seeds: int) -> float:
    """The smallest p-value the exact McNemar test of a count outcome reaches with ``seeds`` paired seeds.

    ``2 / 2^n``: every seed discordant the same way. (The t-test on ``final_eval`` has no floor.)
    """
    return 2.0 / 2**seeds


def _mean_sd(values: list[float]) -> tuple[float, float]:
    """The mean and the sample sd (NaN for one value: no spread to estimate)."""
    n = len(values)
    m = sum(values) / n
    return m, math.sqrt(sum((v - m) ** 2 for v in values) / (n - 1)) if n >= MIN_SEEDS else math.nan


def dose_table(outcomes: list[dict], comparisons: list[dict]) -> list[dict]:
    """One row per arm and lag (the reference once): means and counts over seeds.

    With the paired differences from ``none`` and from the reference (``regret``, reference
    minus arm) of ``comparisons``.
    """
    ref = reference_of(outcomes)
    found = {(c["a"], c["b"], c["lag"]): c for c in comparisons}
    out = []
    for config in configs_of(outcomes):
        for lag in [None] if config == ref else lags_of(outcomes):
            runs = list(by_seed(outcomes, config, lag).values())
            if not runs:
                continue
            mean, sd = _mean_sd([o["final_eval"] for o in runs])
            row: dict[str, Any] = {"config": config, "lag": "" if lag is None else lag, "seeds": len(runs)}
            row.update(final_eval=mean, final_eval_sd=sd)
            vs_none = found.get((config, BASELINE, lag))
            vs_ref = found.get((config, ref, lag))
            row.update(
                diff_vs_none=vs_none["final_eval_diff"] if vs_none else math.nan,
                diff_vs_none_low=vs_none["final_eval_low"] if vs_none else math.nan,
                diff_vs_none_high=vs_none["final_eval_high"] if vs_none else math.nan,
                diff_vs_none_p_holm=vs_none["final_eval_p_holm"] if vs_none else math.nan,
                regret=-vs_ref["final_eval_diff"] if vs_ref else math.nan,
                regret_low=-vs_ref["final_eval_high"] if vs_ref else math.nan,
                regret_high=-vs_ref["final_eval_low"] if vs_ref else math.nan,
                regret_p_holm=vs_ref["final_eval_p_holm"] if vs_ref else math.nan,
            )
            for k in ("collapsed", "at_chance", "spiked", "warned"):
                row[k] = sum(o[k] for o in runs)
            row["seq_kept_mean"] = sum(o["seq_kept_mean"] for o in runs) / len(runs)
            row["max_grad_norm_median"] = median(o["max_grad_norm"] for o in runs)
            row["max_kl_median"] = median(o["max_kl_gen_prev"] for o in runs)
            out.append(row)
    return out
