"""The dose-response run's tables and figure, rendered from its per-seed outcomes (``nemo-rs lab --lags``).

Every table is rendered from the outcomes as :func:`~nemo_rs_plugin.lab.dose.write_seed_csv`
writes them (:func:`render_blocks`, :func:`render_from_csv`), so ``nemo-rs lab --report DIR``
reproduces them without running anything. Docs embed them verbatim between
``<!-- lab:NAME:begin -->`` and ``<!-- lab:NAME:end -->`` (:func:`marked_block`), and
:func:`doc_block_mismatch` checks such a block against a committed CSV. What the outcomes and
comparisons mean: :mod:`~nemo_rs_plugin.lab.dose`.
"""

from __future__ import annotations

import difflib
import math
from pathlib import Path
from typing import Callable, Optional, Union

from nemo_rs_plugin.lab.dose import (
    AT_CHANCE,
    BASELINE,
    COLLAPSE_DROP,
    COLLAPSE_PEAK,
    FINAL_EVALS,
    OUTCOME_LABELS,
    TESTED,
    by_seed,
    configs_of,
    dose_comparisons,
    dose_table,
    lags_of,
    read_seed_csv,
    reference_of,
    smallest_p,
)
from nemo_rs_plugin.lab.stats import MIN_SEEDS, SIGNIFICANCE, format_p, needs_seeds
from nemo_rs_plugin.tools import report

__all__ = [
    "BLOCKS",
    "interval_text",
    "mean_sd_text",
    "p_text",
    "too_few_seeds_sentence",
    "signed",
    "doc_block_mismatch",
    "format_dose_comparisons",
    "format_dose_response",
    "marked_block",
    "render_blocks",
    "render_from_csv",
    "with_block",
    "write_dose_plot",
]


def signed(x: float) -> str:
    """A difference as the tables print it: ``+0.063``."""
    return f"{x:+.3f}"


def interval_text(lo: float, hi: float) -> str:
    """An interval as the tables print it: ``[+0.023, +0.103]``; NaN (one paired seed) says why there is none."""
    if math.isnan(lo) or math.isnan(hi):
        return f"[{needs_seeds('interval')}]"
    return f"[{lo:+.3f}, {hi:+.3f}]"


def p_text(p: float, what: str = "t-test") -> str:
    """A p-value as :func:`~nemo_rs_plugin.lab.stats.format_p` prints it; NaN (one paired seed) says why it is none."""
    return needs_seeds(what) if math.isnan(p) else format_p(p)


def mean_sd_text(mean: float, sd: float, seeds: int) -> str:
    """``0.412 ± 0.087``; with one seed, that it has no sd."""
    return f"{mean:.3f} ± {sd:.3f}" if seeds >= MIN_SEEDS else f"{mean:.3f} ({needs_seeds('sd', 'seeds', seeds)})"


def too_few_seeds_sentence(seeds: int, lacking: str) -> str:
    """The sentence a report adds when its run has fewer than ``MIN_SEEDS`` seeds (empty otherwise)."""
    if seeds >= MIN_SEEDS:
        return ""
    return (
        f" With {seeds} seed there is no {lacking}: each needs {MIN_SEEDS} or more paired seeds, "
        "and the tables say so in their place."
    )


def _seed_list(seeds: list[int]) -> str:
    s = sorted(seeds)
    if len(s) > 2 and s == list(range(s[0], s[-1] + 1)):
        return f"{s[0]}-{s[-1]}"
    return ", ".join(map(str, s))


def _arm(config: str) -> str:
    return f"`{config}`"


def format_dose_response(outcomes: list[dict], comparisons: Optional[list[dict]] = None) -> str:
    """The arm x lag tables (the ``dose-response`` block).

    The final evaluation and its paired difference from ``none``, the regret against the
    on-policy reference, and the counts of seeds collapsed / at chance. ``comparisons``:
    :func:`dose_comparisons` of ``outcomes``, if already computed.
    """
    if comparisons is None:
        comparisons = dose_comparisons(outcomes)
    table = {(r["config"], r["lag"]): r for r in dose_table(outcomes, comparisons)}
    configs, lags, ref = configs_of(outcomes), lags_of(outcomes), reference_of(outcomes)
    arms = [c for c in configs if c != ref]
    seeds = sorted({o["seed"] for o in outcomes})
    chance = outcomes[0]["chance"]
    tests = sum(not math.isnan(c[f"{k}_p"]) for c in comparisons for k in TESTED)  # Holm's family: tests run
    floor = smallest_p(len(seeds))
    found = {(c["a"], c["b"], c["lag"]): c for c in comparisons}
    header = ["arm", *(f"lag {lag}" for lag in lags)]

    word = "seed" if len(seeds) == 1 else "seeds"
    lines = [
        f"{len(seeds)} paired {word} ({_seed_list(seeds)}); lags in optimizer steps (2 per rollout batch). "
        f"Final eval: the mean of the trainer's last {FINAL_EVALS} evaluations. Chance {chance:.4f} "
        f"(a uniform sampler over the model's vocabulary). Collapsed: the evaluation peaked at "
        f"{COLLAPSE_PEAK:g}x chance or more and final eval ended at or below {COLLAPSE_DROP:g}x that peak; "
        f"at chance: the last {FINAL_EVALS} evaluations all at most {AT_CHANCE:g}x chance. "
        f"Intervals: 95% paired t. * separated: Holm-adjusted p < {SIGNIFICANCE:g} over all "
        f"{tests} tests of the run (paired t-test on final eval, exact McNemar on the counts; with "
        f"{len(seeds)} {word} no McNemar p is below {floor:.2g}, {min(1.0, floor * tests):.2g} after Holm's "
        "correction)."
        + too_few_seeds_sentence(len(seeds), "paired t interval or t-test on final eval and no sd over seeds")
    ]
    if ref is not None and (ref, "") in table:
        r = table[(ref, "")]
        lines.append(
            f"\n{_arm(ref)} (reference, no lag): final eval "
            f"{mean_sd_text(r['final_eval'], r['final_eval_sd'], r['seeds'])}, "
            f"collapsed {r['collapsed']}/{r['seeds']}, at chance {r['at_chance']}/{r['seeds']}."
        )

    def final_cell(config: str, lag: int) -> str:
        r = table.get((config, lag))
        if r is None:
            return "-"
        cell = f"{r['final_eval']:.3f}"
        c = found.get((config, BASELINE, lag))
        if c is not None:
            mark = " *" if "final_eval" in c["separated"] else ""
            cell += (
                f" ({signed(c['final_eval_diff'])} {interval_text(c['final_eval_low'], c['final_eval_high'])}{mark})"
            )
        return cell

    lines.append(f"\nFinal eval, mean over seeds (in brackets: paired difference from `{BASELINE}` at the same lag)\n")
    lines.append(report.markdown_table(header, [[_arm(c), *(final_cell(c, lag) for lag in lags)] for c in arms]))

    if ref is not None:

        def regret_cell(config: str, lag: int) -> str:
            c = found.get((config, ref, lag))
            if c is None:
                return "-"
            mark = " *" if "final_eval" in c["separated"] else ""
            return f"{signed(-c['final_eval_diff'])} {interval_text(-c['final_eval_high'], -c['final_eval_low'])}{mark}"

        lines.append(f"\nRegret: {_arm(ref)}'s final eval minus the arm's, paired by seed\n")
        lines.append(report.markdown_table(header, [[_arm(c), *(regret_cell(c, lag) for lag in lags)] for c in arms]))

    def count_cell(config: str, lag: int) -> str:
        r = table.get((config, lag))
        if r is None:
            return "-"
        c = found.get((config, BASELINE, lag))
        mark = {k: "*" if c is not None and k in c["separated"] else "" for k in ("collapsed", "at_chance")}
        return f"{r['collapsed']}{mark['collapsed']} / {r['at_chance']}{mark['at_chance']} of {r['seeds']}"

    lines.append(f"\nSeeds collapsed / at chance (* separated from `{BASELINE}`)\n")
    lines.append(report.markdown_table(header, [[_arm(c), *(count_cell(c, lag) for lag in lags)] for c in arms]))
    return "\n".join(lines)


def format_dose_comparisons(outcomes: list[dict], comparisons: Optional[list[dict]] = None) -> str:
    """Every paired comparison of the run: raw and Holm-adjusted p-values, and what separates.

    ``comparisons``: :func:`dose_comparisons` of ``outcomes``, if already computed.
    """
    header = [
        "a vs b",
        "lag",
        "seeds",
        "final eval a − b [95% CI]",
        "paired t p (Holm)",
        "collapsed (McNemar p; Holm)",
        "at chance (McNemar p; Holm)",
        f"separated (Holm p < {SIGNIFICANCE:g})",
    ]
    rows = [
        [
            f"{_arm(c['a'])} vs {_arm(c['b'])}",
            str(c["lag"]),
            str(c["seeds"]),
            f"{signed(c['final_eval_diff'])} {interval_text(c['final_eval_low'], c['final_eval_high'])}",
            p_text(c["final_eval_p"])
            if math.isnan(c["final_eval_p"])
            else f"{format_p(c['final_eval_p'])} ({format_p(c['final_eval_p_holm'])})",
            f"{c['collapsed']} ({format_p(c['collapsed_p'])}; {format_p(c['collapsed_p_holm'])})",
            f"{c['at_chance']} ({format_p(c['at_chance_p'])}; {format_p(c['at_chance_p_holm'])})",
            ", ".join(OUTCOME_LABELS[k] for k in c["separated"]) or "no",
        ]
        for c in (dose_comparisons(outcomes) if comparisons is None else comparisons)
    ]
    return report.markdown_table(header, rows)


#: The blocks a page can embed, by marker name: ``<!-- lab:NAME:begin -->`` ... ``<!-- lab:NAME:end -->``.
BLOCKS: dict[str, Callable[..., str]] = {
    "dose-response": format_dose_response,
    "dose-comparisons": format_dose_comparisons,
}


def _markers(name: str) -> tuple[str, str]:
    return f"<!-- lab:{name}:begin -->", f"<!-- lab:{name}:end -->"


def render_blocks(outcomes: list[dict]) -> str:
    """Every block of :data:`BLOCKS`, each between its markers (``lab_dose.md``)."""
    comparisons = dose_comparisons(outcomes)
    parts = []
    for name, render in BLOCKS.items():
        begin, end = _markers(name)
        parts.append(f"{begin}\n{render(outcomes, comparisons)}\n{end}")
    return "\n\n".join(parts) + "\n"


def render_from_csv(path: Union[str, Path], name: Optional[str] = None) -> str:
    """Re-render from a saved per-seed CSV without rerunning.

    One block's text (``name``), or every block with its markers (``name`` None).
    """
    outcomes = read_seed_csv(path)
    if not outcomes:
        raise ValueError(f"{path}: no runs in the per-seed CSV")
    if name is None:
        return render_blocks(outcomes)
    if name not in BLOCKS:
        raise ValueError(f"unknown block {name!r}; known: {', '.join(BLOCKS)}")
    return BLOCKS[name](outcomes)


def marked_block(text: str, name: str) -> str:
    """The text between a page's ``<!-- lab:NAME:begin -->`` and ``<!-- lab:NAME:end -->``.

    The newlines next to the markers are stripped; ValueError unless each marker occurs once,
    in order.
    """
    begin, end = _markers(name)
    if text.count(begin) != 1 or text.count(end) != 1:
        raise ValueError(f"expected one {begin} and one {end}, found {text.count(begin)} and {text.count(end)}")
    start, stop = text.index(begin) + len(begin), text.index(end)
    if stop < start:
        raise ValueError(f"{end} comes before {begin}")
    return text[start:stop].strip("\n")


def with_block(text: str, name: str, content: str) -> str:
    """``text`` with its marked block ``name`` replaced by ``content`` (the markers kept)."""
    marked_block(text, name)  # exactly one, in order
    begin, end = _markers(name)
    start, stop = text.index(begin) + len(begin), text.index(end)
    return text[:start] + "\n" + content.strip("\n") + "\n" + text[stop:]


def doc_block_mismatch(
    doc: Union[str, Path], seeds_csv: Union[str, Path], name: str = "dose-response"
) -> Optional[str]:
    """None when ``doc``'s marked block ``name`` is what the lab renders from ``seeds_csv``.

    Else what differs: a unified diff, the page against the render.
    """
    found = marked_block(Path(doc).read_text(), name)
    expected = render_from_csv(seeds_csv, name)
    if found == expected:
        return None
    diff = difflib.unified_diff(
        found.splitlines(), expected.splitlines(), f"{doc} ({name})", f"rendered from {seeds_csv}", lineterm=""
    )
    return "\n".join(diff)


# ---------------------------------------------------------------------------- figure
def write_dose_plot(outcomes: list[dict], path: str, title: str = "") -> None:
    """Final eval against lag per arm (mean over seeds, band min..max), and the seeds collapsed or at chance."""
    plt = report.pyplot()
    configs, lags, ref = configs_of(outcomes), lags_of(outcomes), reference_of(outcomes)
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5))
    colors = plt.get_cmap("tab10")
    x = list(range(len(lags)))
    for i, c in enumerate(configs):
        if c == ref:
            runs = list(by_seed(outcomes, c, None).values())
            m = sum(o["final_eval"] for o in runs) / len(runs)
            left.axhline(m, color="black", ls="--", lw=1, label=f"{c} (no lag)")
            continue
        per = [list(by_seed(outcomes, c, lag).values()) for lag in lags]
        pts = [(xi, r) for xi, r in zip(x, per) if r]
        vals = [[o["final_eval"] for o in r] for _, r in pts]
        xs = [xi for xi, _ in pts]
        color = colors(i % 10)
        left.plot(xs, [sum(v) / len(v) for v in vals], marker="o", color=color, label=c, lw=1.5)
        left.fill_between(xs, [min(v) for v in vals], [max(v) for v in vals], color=color, alpha=0.10, lw=0)
        right.plot(
            xs, [sum(o["collapsed"] or o["at_chance"] for o in r) for _, r in pts], marker="o", color=color, label=c
        )
    chance = outcomes[0]["chance"]
    left.axhline(chance, color="grey", ls=":", lw=1, label="chance")
    for ax in (left, right):
        ax.set_xticks(x, [str(lag) for lag in lags])
        ax.set_xlabel("sampler lag (optimizer steps)")
    left.set_ylabel(f"final eval (mean of last {FINAL_EVALS})")
    right.set_ylabel("seeds collapsed or at chance")
    seeds = len({o["seed"] for o in outcomes})
    right.set_ylim(-0.3, seeds + 0.3)
    left.legend(fontsize=7, loc="best")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=85)
    plt.close(fig)
