"""The lab's confirmatory protocol: a few comparisons fixed in advance, tested on seeds the exploration never saw.

The dose-response run (:mod:`~nemo_rs_plugin.lab.dose`, seeds 100-115) explored every arm
at every lag and found many differences; a new draw of seeds shrank or reversed most of them
(docs/lab.md#confirmation). What the docs advise rests only on this protocol:

* :data:`PROTOCOL` names the **primary family** (:class:`Comparison`: arm ``a`` against arm ``b``
  at one lag, and which recipe or advice it decides), the **primary outcome** (``eval_auc``, the
  mean evaluation over the whole run, which a single late collapse does not decide), the
  smallest effect the advice would act on (``delta``), and the seeds: the exploration's and
  a disjoint confirmation range.
* :func:`power_plan` sizes the confirmation from the exploration: for each primary comparison
  the paired standard deviation of the outcome, and the seeds a two-sided paired t-test at
  ``alpha / m`` (Holm's first step over the ``m`` primary comparisons, the strictest) needs to
  detect ``delta`` with ``power``; the protocol's seeds are the largest of them.
* :func:`confirm` tests the family on the confirmation seeds: paired t interval and t-test on
  the outcome, Holm's correction over the primary family only, a sign-flip p as a check that
  needs no normality, and the verdict in words the interval supports
  (:func:`verdict`). Every other number (final eval, collapse counts) is reported unadjusted
  and labelled exploratory.

The run itself is ``nemo-rs lab --confirm`` (:func:`protocol_jobs`: each arm at each lag the
family needs, on :attr:`Protocol.confirmation_seeds`); its tables are rendered from its
per-seed CSV (:func:`format_confirmation`), as the dose-response run's are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from nemo_rs_plugin.lab.dose import OUTCOME_LABELS, by_seed
from nemo_rs_plugin.lab.dose_report import interval_text, p_text, signed, too_few_seeds_sentence
from nemo_rs_plugin.lab.stats import (
    MIN_SEEDS,
    SIGNIFICANCE,
    format_p,
    holm,
    mcnemar_exact,
    needs_seeds,
    power_of,
    seeds_for_power,
    sign_flip_p,
    t_interval,
    t_test_p,
)
from nemo_rs_plugin.tools import report

__all__ = [
    "PROTOCOL",
    "SMALLER_THAN_DELTA",
    "Comparison",
    "Protocol",
    "confirm",
    "format_confirmation",
    "format_power_plan",
    "power_plan",
    "protocol_arms",
    "protocol_jobs",
    "verdict",
]


@dataclass(frozen=True)
class Comparison:
    """Arm ``a`` against arm ``b`` at ``lag`` (optimizer steps), paired by seed."""

    a: str
    b: str
    lag: int
    decides: str
    """The recipe or the advice the comparison decides."""

    @property
    def label(self) -> str:
        return f"`{self.a}` vs `{self.b}`, lag {self.lag}"


@dataclass(frozen=True)
class Protocol:
    """What is tested, on which outcome and seeds, and how large an effect matters."""

    primary: tuple[Comparison, ...]
    outcome: str
    """The primary outcome: a column of the per-seed CSV."""
    delta: float
    """The smallest difference in ``outcome`` the advice would act on."""
    exploration_seeds: tuple[int, ...]
    confirmation_seeds: tuple[int, ...]
    alpha: float = SIGNIFICANCE
    power: float = 0.8
    secondary: tuple[str, ...] = ("final_eval", "collapsed", "at_chance")
    """Reported per comparison, unadjusted, as exploratory."""

    def __post_init__(self) -> None:
        overlap = set(self.exploration_seeds) & set(self.confirmation_seeds)
        if overlap:
            raise ValueError(f"confirmation seeds overlap the exploration's: {sorted(overlap)}")


#: The confirmatory protocol of docs/lab.md#confirmation, fixed before its run (the commit that
#: set ``confirmation_seeds`` precedes the one that published the run's CSV).
PROTOCOL = Protocol(
    primary=(
        Comparison(
            "token-tis+veto",
            "none",
            4,
            "the async recipe (token TIS at 2 + veto) at the staleness it allows "
            "(max_trajectory_age_steps 2 = 4 optimizer steps here)",
        ),
        Comparison(
            "seqmean+geo-rs+veto",
            "none",
            0,
            "the synchronous recipes' fixed Geo-RS band [0.99, 1.01] + veto at synchronous staleness",
        ),
        Comparison(
            "seqmean+calibrated-geo-rs+veto",
            "seqmean+geo-rs+veto",
            4,
            "a band set from the run (nemo-rs calibrate) against the fixed band, stale",
        ),
        Comparison(
            "seqmean+calibrated-geo-rs+veto",
            "none",
            4,
            "adding a calibrated band to a stale run at all",
        ),
    ),
    outcome="eval_auc",
    delta=0.10,
    exploration_seeds=tuple(range(100, 116)),
    confirmation_seeds=tuple(range(5000, 5000 + 38)),  # the power plan of docs/lab.md#confirmation
)


def protocol_arms(protocol: Protocol) -> list[str]:
    """The arms the primary family compares, each once, in order of appearance."""
    return list(dict.fromkeys(arm for c in protocol.primary for arm in (c.a, c.b)))


def protocol_jobs(protocol: Protocol, seeds: Optional[list[int]] = None) -> list[tuple[str, int, int]]:
    """``(arm, seed, lag)`` for every arm and lag the primary family needs, each once, on ``seeds``."""
    needed: dict[tuple[str, int], None] = {}
    for c in protocol.primary:
        needed[(c.a, c.lag)] = None
        needed[(c.b, c.lag)] = None
    chosen = list(protocol.confirmation_seeds if seeds is None else seeds)
    return [(arm, seed, lag) for arm, lag in needed for seed in chosen]


def _paired(outcomes: list[dict], c: Comparison) -> tuple[list[dict], list[dict]]:
    ra, rb = by_seed(outcomes, c.a, c.lag), by_seed(outcomes, c.b, c.lag)
    seeds = sorted(set(ra) & set(rb))
    return [ra[s] for s in seeds], [rb[s] for s in seeds]


def _diffs(pa: list[dict], pb: list[dict], key: str) -> list[float]:
    return [x[key] - y[key] for x, y in zip(pa, pb)]


def _sd(values: list[float]) -> float:
    n = len(values)
    m = sum(values) / n
    return math.sqrt(sum((v - m) ** 2 for v in values) / (n - 1)) if n > 1 else math.nan


def power_plan(exploration: list[dict], protocol: Protocol = PROTOCOL) -> list[dict]:
    """Per primary comparison: the exploration's paired mean and sd of the outcome, and the seeds needed.

    ``seeds_needed``: a two-sided paired t-test at ``alpha / m`` (``m`` primary comparisons)
    detecting ``delta`` with ``power`` (:func:`~nemo_rs_plugin.lab.stats.seeds_for_power`).
    """
    m = len(protocol.primary)
    rows = []
    for c in protocol.primary:
        pa, pb = _paired(exploration, c)
        d = _diffs(pa, pb, protocol.outcome)
        if len(d) < MIN_SEEDS or any(math.isnan(x) for x in d):
            raise ValueError(
                f"{c.label}: the exploration has no paired {protocol.outcome} for it (need {MIN_SEEDS}+ seeds)"
            )
        sd = _sd(d)
        rows.append(
            {
                "comparison": c.label,
                "seeds": len(d),
                "mean_diff": sum(d) / len(d),
                "sd_diff": sd,
                "seeds_needed": seeds_for_power(sd, protocol.delta, protocol.alpha / m, protocol.power),
            }
        )
    return rows


#: The verdict's words for a separated difference whose 90% interval lies inside ``±delta``.
SMALLER_THAN_DELTA = "smaller than the smallest effect the advice acts on"


def verdict(
    diff: float, low: float, high: float, p_holm: float, delta: float, tost_low: float, tost_high: float
) -> str:
    """Words the interval supports.

    Separated (Holm p < alpha): "a higher" / "a lower"; when its 90% t interval also lies inside
    ``(-delta, delta)`` the difference is real but smaller than the smallest effect the advice
    acts on, and the verdict says so ("a higher: a gain smaller than ..."): a separated effect is
    judged against ``delta`` as an unseparated one is. Otherwise "no detectable difference",
    with "within ±delta" when the 90% t interval lies inside ``(-delta, delta)`` (two one-sided
    tests at 5%: equivalence shown), else "not shown equivalent within ±delta". No 90% interval
    (one paired seed): no verdict, and why.
    """
    if math.isnan(tost_low) or math.isnan(tost_high):
        return needs_seeds("verdict")
    inside = -delta < tost_low and tost_high < delta
    if p_holm < SIGNIFICANCE:
        words = "a higher" if diff > 0 else "a lower"
        if inside:
            change = "gain" if diff > 0 else "loss"
            words += f": a {change} {SMALLER_THAN_DELTA} (90% interval inside ±{delta:g})"
        return words
    if inside:
        return f"no detectable difference; equivalent within ±{delta:g}"
    return f"no detectable difference; not shown equivalent within ±{delta:g}"


def confirm(outcomes: list[dict], protocol: Protocol = PROTOCOL) -> list[dict]:
    """The primary family on ``outcomes``: one row per comparison, Holm over the family only.

    A comparison with one paired seed has its difference and counts but no interval, test or
    verdict (NaN; the verdict says why); one with none is refused.
    """
    rows = []
    for c in protocol.primary:
        pa, pb = _paired(outcomes, c)
        if not pa:
            raise ValueError(f"{c.label}: no paired seeds in the confirmation outcomes")
        d = _diffs(pa, pb, protocol.outcome)
        low, high = t_interval(d)
        tost_low, tost_high = t_interval(d, level=0.90)
        row = {
            "a": c.a,
            "b": c.b,
            "lag": c.lag,
            "decides": c.decides,
            "seeds": len(d),
            "outcome": protocol.outcome,
            "mean_a": sum(x[protocol.outcome] for x in pa) / len(pa),
            "mean_b": sum(y[protocol.outcome] for y in pb) / len(pb),
            "diff": sum(d) / len(d),
            "low": low,
            "high": high,
            "low90": tost_low,
            "high90": tost_high,
            "p": t_test_p(d),
            "p_sign_flip": sign_flip_p(d),
            "better_seeds": sum(x > 0 for x in d),
            "worse_seeds": sum(x < 0 for x in d),
        }
        fd = _diffs(pa, pb, "final_eval")
        row["final_eval_diff"] = sum(fd) / len(fd)
        row["final_eval_low"], row["final_eval_high"] = t_interval(fd)
        for k in ("collapsed", "at_chance"):
            row[k] = f"{sum(x[k] for x in pa)}/{len(pa)} vs {sum(y[k] for y in pb)}/{len(pb)}"
            row[f"{k}_p"] = mcnemar_exact(
                sum(x[k] and not y[k] for x, y in zip(pa, pb)), sum(y[k] and not x[k] for x, y in zip(pa, pb))
            )
        rows.append(row)
    for row, adjusted in zip(rows, holm([r["p"] for r in rows])):
        row["p_holm"] = adjusted
        row["verdict"] = verdict(
            row["diff"], row["low"], row["high"], adjusted, protocol.delta, row["low90"], row["high90"]
        )
    return rows


def format_power_plan(plan: list[dict], protocol: Protocol = PROTOCOL) -> str:
    """The power calculation as a Markdown table, with the rule above it."""
    m = len(protocol.primary)
    head = (
        f"Primary outcome `{protocol.outcome}`; smallest effect the advice acts on: {protocol.delta:g}; "
        f"two-sided paired t-test at {protocol.alpha:g} / {m} = {protocol.alpha / m:.4f} (Holm's strictest "
        f"step over the {m} primary comparisons), power {protocol.power:g}; the paired sd from the "
        f"exploration's seeds {_span(protocol.exploration_seeds)}."
    )
    rows = [
        [r["comparison"], str(r["seeds"]), signed(r["mean_diff"]), f"{r['sd_diff']:.3f}", str(r["seeds_needed"])]
        for r in plan
    ]
    table = report.markdown_table(
        ["primary comparison", "exploration seeds", "mean difference", "paired sd", "seeds needed"], rows
    )
    need = max(r["seeds_needed"] for r in plan)
    n = len(protocol.confirmation_seeds)
    weakest = min(power_of(r["sd_diff"], protocol.delta, protocol.alpha / m, n) for r in plan)
    return (
        f"{head}\n\n{table}\n\nThe confirmation runs {n} seeds ({_span(protocol.confirmation_seeds)}); the plan "
        f"asks for {need}. At {n} seeds the least powered primary comparison detects {protocol.delta:g} with "
        f"power {weakest:.2f}."
    )


def _span(seeds: tuple[int, ...]) -> str:
    s = sorted(seeds)
    if len(s) == 1:
        return str(s[0])
    return f"{s[0]}-{s[-1]}" if s == list(range(s[0], s[-1] + 1)) else ", ".join(map(str, s))


def format_confirmation(outcomes: list[dict], protocol: Protocol = PROTOCOL) -> str:
    """The confirmation's primary table and its exploratory companions (the ``confirmation`` block)."""
    rows = confirm(outcomes, protocol)
    seeds = sorted({o["seed"] for o in outcomes})
    lines = [
        f"{len(seeds)} paired seed{'s' if len(seeds) != 1 else ''} ({_span(tuple(seeds))}), "
        f"{'none of them' if len(seeds) != 1 else 'not'} in the exploration "
        f"({_span(protocol.exploration_seeds)}). Primary outcome `{protocol.outcome}` (the mean of every "
        f"evaluation of the run); 95% paired t interval; p: paired t-test, Holm over the "
        f"{len(protocol.primary)} primary comparisons only (sign-flip p beside it needs no normality). "
        f"Equivalence: the 90% interval inside ±{protocol.delta:g}, the smallest effect the advice acts on; "
        "a separated difference whose 90% interval lies inside it is a gain or loss smaller than that."
        + too_few_seeds_sentence(len(seeds), "interval, t-test, sign-flip test or verdict"),
        "",
        report.markdown_table(
            [
                "primary comparison",
                "a",
                "b",
                "a − b [95% CI]",
                "p (Holm)",
                "sign-flip p",
                "seeds a > b / a < b",
                "verdict",
            ],
            [
                [
                    f"`{r['a']}` vs `{r['b']}`, lag {r['lag']}",
                    f"{r['mean_a']:.3f}",
                    f"{r['mean_b']:.3f}",
                    f"{signed(r['diff'])} {interval_text(r['low'], r['high'])}",
                    p_text(r["p"]) if math.isnan(r["p"]) else f"{format_p(r['p'])} ({format_p(r['p_holm'])})",
                    p_text(r["p_sign_flip"], "sign-flip test"),
                    f"{r['better_seeds']} / {r['worse_seeds']}",
                    r["verdict"],
                ]
                for r in rows
            ],
        ),
        "",
        "Exploratory (unadjusted, not advice): the same pairs on the final evaluation and the counts",
        "",
        report.markdown_table(
            [
                "comparison",
                "final eval a − b [95% CI]",
                f"{OUTCOME_LABELS['collapsed']} (McNemar p)",
                f"{OUTCOME_LABELS['at_chance']} (McNemar p)",
            ],
            [
                [
                    f"`{r['a']}` vs `{r['b']}`, lag {r['lag']}",
                    f"{signed(r['final_eval_diff'])} {interval_text(r['final_eval_low'], r['final_eval_high'])}",
                    f"{r['collapsed']} ({format_p(r['collapsed_p'])})",
                    f"{r['at_chance']} ({format_p(r['at_chance_p'])})",
                ]
                for r in rows
            ],
        ),
    ]
    return "\n".join(lines)
