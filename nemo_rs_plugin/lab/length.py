"""The lab's length study (``nemo-rs lab --lengths ...``): does the sequence weight's level matter as responses grow?

The hypothesis it tests: the geometric-mean sequence weight
(``is_correction_level: sequence_mean``, ``exp(mean d)``) trains where the product
``exp(sum d)`` (``sequence``) degenerates with length: ``sum d`` over ``L`` tokens has ``L``
times one token's variance, so the product's effective sample size falls with ``L`` while the
geometric mean's does not. What it measured is in docs/lab.md#length (the product's ESS falls
and it loses reward at 256 tokens; its collapse counts do not grow with length; the geometric
mean's reward at 256 tokens matches no correction within ±0.1 on 16 fresh seeds,
:data:`LENGTH_RERUN`).
``nemo-rs simulate`` shows the weights; this study trains.

Every arm of :data:`LENGTH_STUDY` (no correction, token IS truncated at 2, ``sequence_mean``,
``sequence``; untruncated sequence weights, so the level alone differs) runs at every length on
the same paired seeds, at one lag: the per-token mismatch then comes from staleness, large
enough that the product's collapse falls inside lengths a CPU trains (docs/lab.md#length).
Outcomes per run are the dose-response run's (:func:`~nemo_rs_plugin.lab.dose.run_outcome`:
``eval_auc`` first, the final evaluation, collapse counts) and the mean IS effective sample
size over the run (``is_ess_mean``). Each arm is compared with ``none`` at each length on the
primary outcome ``eval_auc`` (paired t interval and test), Holm's correction over this
study's comparisons only, and the confirmation's verdict words
(:func:`~nemo_rs_plugin.lab.confirm.verdict`, against the confirmation's smallest effect of
interest, ``PROTOCOL.delta``), so a sentence that quotes a row can say only what the row's
verdict says. With one paired seed a comparison has its difference but no interval, test or
verdict (the table says so).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Union

from nemo_rs_plugin.lab.confirm import PROTOCOL, verdict
from nemo_rs_plugin.lab.dose import BASELINE, SEED_FIELDS, by_seed, read_seed_csv, write_seed_csv
from nemo_rs_plugin.lab.dose_report import interval_text, p_text, too_few_seeds_sentence
from nemo_rs_plugin.lab.stats import SIGNIFICANCE, format_p, holm, t_interval, t_test_p
from nemo_rs_plugin.tools import report

__all__ = [
    "LENGTH_FIELDS",
    "LENGTH_RERUN",
    "LENGTH_STUDY",
    "format_length_study",
    "length_comparisons",
    "read_length_csv",
    "write_length_csv",
]

#: The published study's settings (docs/lab.md#length); ``--lengths`` takes them as defaults.
LENGTH_STUDY: dict[str, Any] = dict(
    configs=["none", "token-tis", "sequence_mean", "sequence"],
    lag=2,
    lengths=[16, 64, 256],
    seeds=list(range(6000, 6008)),
    steps=80,
)

#: The 256-token rerun (docs/lab.md#length), fixed before it ran: the study's open question,
#: ``sequence_mean`` against ``none`` at 256 tokens one batch stale, is its one primary comparison
#: (so no Holm step), on 16 seeds no run had used. Sized from the two earlier draws' paired sd of
#: ``eval_auc`` (0.071 on seeds 6000-6007, 0.050 on an outside rerun's 7100-7105): 7 seeds detect
#: the protocol's ±0.1 with power 0.8 at the larger sd, 16 with power above 0.99, and the 90%
#: interval's half-width at 16 seeds (about 0.03) is small enough to tell +0.07 from zero and
#: from ±0.1.
LENGTH_RERUN: dict[str, Any] = dict(
    configs=["none", "sequence_mean"],
    lag=2,
    lengths=[256],
    seeds=list(range(8000, 8016)),
    steps=80,
)

#: The study's per-seed CSV: the dose-response run's columns, each row with its length.
LENGTH_FIELDS = ("length", *SEED_FIELDS)

OUTCOME = "eval_auc"


def write_length_csv(outcomes: list[dict], path: Union[str, Path]) -> None:
    """Per-seed outcomes with their ``length`` (:data:`LENGTH_FIELDS`), read back by :func:`read_length_csv`."""
    write_seed_csv(outcomes, path, LENGTH_FIELDS)


def read_length_csv(path: Union[str, Path]) -> list[dict]:
    """The study's per-seed outcomes as :func:`write_length_csv` wrote them."""
    return read_seed_csv(path, LENGTH_FIELDS)


def _at(outcomes: list[dict], length: int) -> list[dict]:
    return [o for o in outcomes if o["length"] == length]


def length_comparisons(outcomes: list[dict]) -> list[dict]:
    """Each arm against ``none`` at each length, paired by seed, Holm over the study's comparisons."""
    configs = list(dict.fromkeys(o["config"] for o in outcomes))
    rows = []
    for length in sorted({o["length"] for o in outcomes}):
        at = _at(outcomes, length)
        lag = at[0]["lag"]
        base = by_seed(at, BASELINE, lag)
        for config in configs:
            runs = by_seed(at, config, lag)
            seeds = sorted(set(runs) & set(base))
            row = {
                "config": config,
                "length": length,
                "seeds": len(runs),
                "auc": sum(o[OUTCOME] for o in runs.values()) / len(runs),
                "is_ess": sum(o["is_ess_mean"] for o in runs.values()) / len(runs),
                "collapsed": sum(o["collapsed"] for o in runs.values()),
                "at_chance": sum(o["at_chance"] for o in runs.values()),
                "diff": math.nan,
                "low": math.nan,
                "high": math.nan,
                "p": math.nan,
                "low90": math.nan,
                "high90": math.nan,
            }
            if config != BASELINE and seeds:
                d = [runs[s][OUTCOME] - base[s][OUTCOME] for s in seeds]
                row["diff"] = sum(d) / len(d)
                row["low"], row["high"] = t_interval(d)  # NaN with one paired seed
                row["low90"], row["high90"] = t_interval(d, level=0.90)
                row["p"] = t_test_p(d)
            rows.append(row)
    for row, adjusted in zip(rows, holm([r["p"] for r in rows])):
        row["p_holm"] = adjusted
        if row["config"] != BASELINE and not math.isnan(row["diff"]):
            row["verdict"] = verdict(
                row["diff"], row["low"], row["high"], adjusted, PROTOCOL.delta, row["low90"], row["high90"]
            )
    return rows


def format_length_study(outcomes: list[dict]) -> str:
    """The study's table (the ``length`` block): per arm and length, ``eval_auc`` against ``none``, ESS, counts."""
    rows = length_comparisons(outcomes)
    lengths = sorted({o["length"] for o in outcomes})
    seeds = sorted({o["seed"] for o in outcomes})
    lag = outcomes[0]["lag"]
    tests = sum(not math.isnan(r["p"]) for r in rows)
    span = f"{seeds[0]}-{seeds[-1]}" if len(seeds) > 1 else f"{seeds[0]}"
    plural = {"seeds": "s" if len(seeds) != 1 else "", "lengths": "s" if len(lengths) != 1 else ""}
    plural["tests"] = "s" if tests != 1 else ""
    head = (
        f"{len(seeds)} paired seed{plural['seeds']} ({span}), lag {lag}, response length{plural['lengths']} "
        f"{', '.join(map(str, lengths))} tokens. Each cell: `{OUTCOME}` (mean of every evaluation), in brackets "
        f"the paired difference from `{BASELINE}` with its 95% t interval (* Holm p < {SIGNIFICANCE:g} over "
        f"the study's {tests} comparison{plural['tests']}); then the mean IS effective sample size over the run, "
        "and seeds collapsed / at chance. Verdicts as the confirmation's, against its smallest effect of interest "
        f"(±{PROTOCOL.delta:g})." + too_few_seeds_sentence(len(seeds), "t interval or t-test")
    )

    def cell(config: str, length: int) -> str:
        r = next((x for x in rows if x["config"] == config and x["length"] == length), None)
        if r is None:
            return "-"
        text = f"{r['auc']:.3f}"
        if not math.isnan(r["diff"]):
            mark = " *" if r["p_holm"] < SIGNIFICANCE else ""
            text += f" ({r['diff']:+.3f} {interval_text(r['low'], r['high'])}{mark})"
        return f"{text}; ESS {r['is_ess']:.2f}; {r['collapsed']} / {r['at_chance']} of {r['seeds']}"

    configs = list(dict.fromkeys(o["config"] for o in outcomes))
    table = report.markdown_table(
        ["arm", *(f"{length} tokens" for length in lengths)],
        [[f"`{c}`", *(cell(c, length) for length in lengths)] for c in configs],
    )
    ps = report.markdown_table(
        ["arm vs none", *(f"{length} tokens: p (Holm)" for length in lengths)],
        [
            [
                f"`{c}`",
                *(
                    next(
                        f"{format_p(r['p'])} ({format_p(r['p_holm'])})" if not math.isnan(r["p"]) else p_text(r["p"])
                        for r in rows
                        if r["config"] == c and r["length"] == length
                    )
                    for length in lengths
                ),
            ]
            for c in configs
            if c != BASELINE
        ],
    )
    verdicts = report.markdown_table(
        ["arm vs none: verdict", *(f"{length} tokens" for length in lengths)],
        [
            [
                f"`{c}`",
                *(
                    next(
                        (r.get("verdict", "-") for r in rows if r["config"] == c and r["length"] == length),
                        "-",
                    )
                    for length in lengths
                ),
            ]
            for c in configs
            if c != BASELINE
        ],
    )
    return f"{head}\n\n{table}\n\n{ps}\n\n{verdicts}"
