"""The lab's reporting: outcomes per seed, the summary and comparison tables, CSVs, figures.

Per seed (:func:`seed_outcomes`): the final rewards (the stale sampler's training reward
over the last steps, and the trainer's own policy evaluated on fixed prompts), the largest
gradient norm and the optimizer steps above ``--spike``, collapse (the 5-step mean reward
peaks at least twice chance, then ends at half its peak or less), ending at chance (final
evaluation at most twice chance), the largest KL(gen || prev), the kept share of sequences
and tokens. Per arm (:func:`summarize`) those over seeds; :func:`compare` says, for pairs of
arms, whether the seeds separate them (:mod:`~nemo_rs_plugin.lab.stats`).
"""

from __future__ import annotations

import csv
import math
from statistics import median

import torch

from nemo_rs_plugin.lab.experiment import CONFIGS, STEP_METRICS, LabSettings
from nemo_rs_plugin.lab.stats import MIN_SEEDS, SIGNIFICANCE, fisher_exact, format_p, needs_seeds, permutation_p
from nemo_rs_plugin.tools import report

__all__ = [
    "as_written",
    "compare",
    "format_comparisons",
    "format_table",
    "seed_outcomes",
    "summarize",
    "write_csv",
    "write_plot",
    "write_seed_plot",
    "write_summary_csv",
]

STEP_DIGITS = 6  # significant digits of the per-step CSV
_TAIL = 5  # the last rollout steps the final training reward averages; the collapse window
# Per-seed yes/no outcomes compared by Fisher's test. The run-time rejection warning ("warned")
# is reported per arm, not compared: only filtered arms can warn.
_COUNTED = ("spiked", "collapsed", "at_chance")


def _rolling(values: list[float], window: int) -> list[float]:
    return [sum(values[max(0, i - window + 1) : i + 1]) / (i + 1 - max(0, i - window + 1)) for i in range(len(values))]


def seed_outcomes(rows: list[dict], s: LabSettings) -> list[dict]:
    """One dict per (arm, seed): the outcomes of that run."""
    chance = 1.0 / s.vocab
    out = []
    for c in s.configs:
        for seed in s.seeds:
            r = [x for x in rows if x["config"] == c and x["seed"] == seed]
            if not r:
                continue
            rewards = [x["reward"] for x in r]
            smooth = _rolling(rewards, _TAIL)
            peak = max(smooth)
            evals = [x["eval_reward"] for x in r if not math.isnan(x["eval_reward"])]
            reached = next((x["step"] for x in r if x["reward"] >= s.threshold), None)
            out.append(
                {
                    "config": c,
                    "seed": seed,
                    "final_reward": sum(rewards[-_TAIL:]) / len(rewards[-_TAIL:]),
                    "eval_final": evals[-1] if evals else math.nan,
                    "eval_peak": max(evals) if evals else math.nan,
                    "reached": reached,
                    "max_grad_norm": max(x["grad_norm_max"] for x in r),
                    "spike_steps": sum(x["grad_spikes"] for x in r),
                    "spiked": any(x["grad_spikes"] for x in r),
                    "collapsed": peak >= 2 * chance and smooth[-1] <= peak / 2,
                    "at_chance": bool(evals) and evals[-1] <= 2 * chance,
                    "max_kl_gen_prev": max(x["kl_gen_prev"] for x in r),
                    "seq_kept_mean": 1 - sum(x["seq_rejected_frac"] for x in r) / len(r),
                    "seq_kept_min": 1 - max(x["seq_rejected_frac"] for x in r),
                    "token_kept_mean": 1 - sum(x["token_rejected_frac"] for x in r) / len(r),
                    "is_ess_mean": sum(x["is_ess"] for x in r) / len(r),
                    "mismatch_mean": sum(x["mismatch_mean"] for x in r) / len(r),
                    "routing_diff_mean": sum(x["routing_diff_frac"] for x in r) / len(r),
                    "band_lower": r[-1]["band_lower"],
                    "band_upper": r[-1]["band_upper"],
                    "warned": r[-1]["rejection_warnings"] > 0,
                    "wall_s": r[-1]["wall_s"],
                }
            )
    return out


def _mean_sd(values: list[float]) -> tuple[float, float]:
    """The mean and the sample sd (NaN for one value: no spread to estimate)."""
    n = len(values)
    m = sum(values) / n
    return m, math.sqrt(sum((v - m) ** 2 for v in values) / (n - 1)) if n >= MIN_SEEDS else math.nan


def summarize(outcomes: list[dict], s: LabSettings) -> list[dict]:
    """Per arm, over its seeds: means, medians and counts of the outcomes."""
    out = []
    for c in s.configs:
        per = [o for o in outcomes if o["config"] == c]
        if not per:
            continue
        n = len(per)
        eval_mean, eval_sd = _mean_sd([o["eval_final"] for o in per])
        final_mean, final_sd = _mean_sd([o["final_reward"] for o in per])
        reached = sorted(o["reached"] for o in per if o["reached"] is not None)
        bands = [o for o in per if not math.isnan(o["band_lower"])]
        out.append(
            {
                "config": c,
                "role": CONFIGS[c].role if c in CONFIGS else "",
                "seeds": n,
                "eval_final": eval_mean,
                "eval_final_sd": eval_sd,
                "final_reward": final_mean,
                "final_reward_sd": final_sd,
                "steps_to_threshold": reached[len(reached) // 2] if len(reached) * 2 > n else None,
                "seeds_reaching": len(reached),
                **{f"seeds_{k}": sum(o[k] for o in per) for k in (*_COUNTED, "warned")},
                "max_grad_norm_median": median(o["max_grad_norm"] for o in per),
                "max_grad_norm_max": max(o["max_grad_norm"] for o in per),
                "max_kl_median": median(o["max_kl_gen_prev"] for o in per),
                "seq_kept_mean": sum(o["seq_kept_mean"] for o in per) / n,
                "seq_kept_min": min(o["seq_kept_min"] for o in per),
                "token_kept_mean": sum(o["token_kept_mean"] for o in per) / n,
                "is_ess_mean": sum(o["is_ess_mean"] for o in per) / n,
                "mismatch_mean": sum(o["mismatch_mean"] for o in per) / n,
                "routing_diff_mean": sum(o["routing_diff_mean"] for o in per) / n,
                "band_lower_median": median(o["band_lower"] for o in bands) if bands else math.nan,
                "band_upper_median": median(o["band_upper"] for o in bands) if bands else math.nan,
                "wall_s_per_run": sum(o["wall_s"] for o in per) / n,
            }
        )
    return out


def default_pairs(configs: list[str]) -> list[tuple[str, str]]:
    """Every arm against ``none``, and the calibrated band against the fixed band and token TIS."""
    pairs = [(c, "none") for c in configs if c != "none"] if "none" in configs else []
    calibrated = [c for c in configs if CONFIGS.get(c) is not None and CONFIGS[c].calibrated]
    for c in calibrated:
        for other in ("seqmean+geo-rs+veto", "token-tis"):
            if other in configs:
                pairs.append((c, other))
    return pairs


def compare(outcomes: list[dict], pairs: list[tuple[str, str]]) -> list[dict]:
    """For each pair ``(a, b)``: the difference of final evaluation rewards and the counts, with p-values.

    ``eval_p`` is NaN (no test) where an arm has one seed; Fisher's exact test is defined at any count.
    """
    out = []
    for a, b in pairs:
        oa = [o for o in outcomes if o["config"] == a]
        ob = [o for o in outcomes if o["config"] == b]
        if not oa or not ob:
            continue
        row = {
            "a": a,
            "b": b,
            "eval_diff": sum(o["eval_final"] for o in oa) / len(oa) - sum(o["eval_final"] for o in ob) / len(ob),
            "eval_p": permutation_p([o["eval_final"] for o in oa], [o["eval_final"] for o in ob]),
        }
        for k in _COUNTED:
            ka, kb = sum(o[k] for o in oa), sum(o[k] for o in ob)
            row[k] = f"{ka}/{len(oa)} vs {kb}/{len(ob)}"
            row[f"{k}_p"] = fisher_exact(ka, len(oa), kb, len(ob))
        row["separated"] = [
            name for name in ("eval", *_COUNTED) if row[f"{name}_p"] < SIGNIFICANCE
        ]  # outcomes whose difference the seeds support
        out.append(row)
    return out


def format_table(summary: list[dict], s: LabSettings) -> str:
    """The per-arm outcomes as a Markdown table."""
    header = [
        "arm",
        "final eval reward (mean ± sd)",
        f"train reward, last {_TAIL} steps",
        f"steps to {s.threshold:g} (median; seeds)",
        f"seeds with a grad-norm spike > {s.spike:g}",
        "max grad norm (median; max)",
        "seeds collapsed",
        "seeds at chance",
        "max KL(gen‖prev) (median)",
        "sequences kept (mean; min step)",
        "seeds warned",
        "tokens kept",
        "is_ess",
        "band (median)",
    ]
    return report.markdown_table(header, [_table_cells(r) for r in summary])


def _mean_pm_sd(mean: float, sd: float, n: int) -> str:
    return f"{mean:.3f} ± {sd:.3f}" if n >= MIN_SEEDS else f"{mean:.3f} ({needs_seeds('sd', 'seeds', n)})"


def _table_cells(r: dict) -> list[str]:
    n = r["seeds"]
    reach = "-" if r["steps_to_threshold"] is None else str(r["steps_to_threshold"])
    name = f"`{r['config']}`" + (f" ({r['role']})" if r["role"] else "")
    lo, hi = r["band_lower_median"], r["band_upper_median"]
    band = "-" if math.isnan(lo) else f"[{lo:.3f}, {hi:.3f}]"
    return [
        name,
        _mean_pm_sd(r["eval_final"], r["eval_final_sd"], n),
        _mean_pm_sd(r["final_reward"], r["final_reward_sd"], n),
        f"{reach} ({r['seeds_reaching']}/{n})",
        f"{r['seeds_spiked']}/{n}",
        f"{r['max_grad_norm_median']:.2g}; {r['max_grad_norm_max']:.2g}",
        f"{r['seeds_collapsed']}/{n}",
        f"{r['seeds_at_chance']}/{n}",
        f"{r['max_kl_median']:.3g}",
        f"{r['seq_kept_mean']:.2f}; {r['seq_kept_min']:.2f}",
        f"{r['seeds_warned']}/{n}",
        f"{r['token_kept_mean']:.3f}",
        f"{r['is_ess_mean']:.3f}",
        band,
    ]


def _eval_p_text(c: dict) -> str:
    """The permutation p, or why there is none (an arm with one seed)."""
    if not math.isnan(c["eval_p"]):
        return format_p(c["eval_p"])
    return needs_seeds("permutation p", "seeds per arm")


def format_comparisons(comparisons: list[dict]) -> str:
    """The pairwise comparisons as a Markdown table."""
    header = [
        "a vs b",
        "final eval reward a − b (permutation p)",
        "spiked (Fisher p)",
        "collapsed (Fisher p)",
        "at chance (Fisher p)",
        f"separated at p < {SIGNIFICANCE:g}",
    ]
    rows = [
        [
            f"`{c['a']}` vs `{c['b']}`",
            f"{c['eval_diff']:+.3f} ({_eval_p_text(c)})",
            f"{c['spiked']} ({format_p(c['spiked_p'])})",
            f"{c['collapsed']} ({format_p(c['collapsed_p'])})",
            f"{c['at_chance']} ({format_p(c['at_chance_p'])})",
            ", ".join(c["separated"]) or "no",
        ]
        for c in comparisons
    ]
    return report.markdown_table(header, rows)


def as_written(rows: list[dict]) -> list[dict]:
    """``rows`` with every float as :func:`write_csv` writes it.

    The tables computed from the rows in memory and from the CSV are then the same, to the
    last digit.
    """
    return [{k: float(f"{v:.{STEP_DIGITS}g}") if isinstance(v, float) else v for k, v in r.items()} for r in rows]


def write_csv(rows: list[dict], path: str) -> None:
    """One row per arm, seed and step (floats to ``STEP_DIGITS`` significant digits).

    ``lag`` (the sampler's lag of the run, 0 for the on-policy reference) and ``length`` (the
    length study's) follow ``seed`` where the rows have them.
    """
    extra = [k for k in ("lag", "length") if rows and k in rows[0]]
    fields = ["config", "seed", *extra, "step", *STEP_METRICS]
    report.write_csv([{k: r[k] for k in fields} for r in rows], path, fields, float_digits=STEP_DIGITS)


def read_steps_csv(path: str) -> list[dict]:
    """The rows :func:`write_csv` wrote: ``config`` a string, ``seed``, ``lag``, ``length`` and ``step`` ints."""
    ints = ("seed", "lag", "length", "step")
    with open(path, newline="") as fh:
        return [
            {k: v if k == "config" else int(v) if k in ints else float(v) for k, v in r.items()}
            for r in csv.DictReader(fh)
        ]


def write_summary_csv(records: list[dict], path: str) -> None:
    """A list of flat dicts (the summary, the per-seed outcomes, the comparisons) as CSV."""
    flat = [{k: (";".join(v) if isinstance(v, list) else v) for k, v in r.items()} for r in records]
    report.write_csv(flat, path, list(flat[0]), float_digits=6)


# (key, title, log-scale floor or None): a log panel shows values from its floor up (a step whose
# every sequence was rejected has gradient norm 0; the on-policy KL is ~1e-14).
_PANELS = (
    ("reward", "training reward (stale sampler)", None),
    ("eval_reward", "trainer's policy, fixed prompts", None),
    ("grad_norm_max", "max gradient norm (before clip)", 1e-2),
    ("kl_gen_prev", "KL(gen || prev) per token", 1e-4),
    ("seq_rejected_frac", "sequences rejected", None),
    ("token_rejected_frac", "tokens rejected", None),
    ("is_ess", "effective sample size", None),
    ("routing_diff_frac", "tokens with different expert routing", None),
)


def write_plot(rows: list[dict], s: LabSettings, path: str, title: str = "") -> None:
    """Curves per arm: mean over seeds, band = min..max over seeds; log scales where marked."""
    plt = report.pyplot()
    fig, axes = plt.subplots(2, 4, figsize=(18, 8), sharex=True)
    colors = plt.get_cmap("tab10")
    for i, c in enumerate(s.configs):
        runs = [[x for x in rows if x["config"] == c and x["seed"] == seed] for seed in s.seeds]
        runs = [r for r in runs if r]
        if not runs:
            continue
        for ax, (key, label, floor) in zip(axes.flat, _PANELS):
            points = [(x["step"], j) for j, x in enumerate(runs[0]) if not math.isnan(x[key])]
            steps = [p for p, _ in points]
            vals = torch.tensor([[r[j][key] for _, j in points] for r in runs], dtype=torch.float64)
            ax.plot(steps, vals.mean(0).tolist(), color=colors(i % 10), label=c, lw=1.5)
            ax.fill_between(
                steps, vals.min(0).values.tolist(), vals.max(0).values.tolist(), color=colors(i % 10), alpha=0.12, lw=0
            )
            ax.set_title(label, fontsize=10)
    for ax, (_, _, floor) in zip(axes.flat, _PANELS):
        if floor is not None:  # after every arm is drawn, so the top still fits them all
            ax.set_yscale("log")
            ax.set_ylim(bottom=floor)
    for ax in axes[1]:
        ax.set_xlabel("rollout step")
    axes.flat[0].legend(fontsize=7, loc="upper left")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=85)
    plt.close(fig)


def write_seed_plot(rows: list[dict], s: LabSettings, path: str) -> None:
    """One panel per arm: every seed's 5-step mean training reward, and its max gradient norm."""
    plt = report.pyplot()
    n = len(s.configs)
    fig, axes = plt.subplots(2, n, figsize=(2.6 * n, 5.5), sharex=True, squeeze=False)
    colors = plt.get_cmap("viridis")
    for i, c in enumerate(s.configs):
        top, bottom = axes[0][i], axes[1][i]
        for j, seed in enumerate(s.seeds):
            r = [x for x in rows if x["config"] == c and x["seed"] == seed]
            if not r:
                continue
            steps = [x["step"] for x in r]
            color = colors(j / max(len(s.seeds) - 1, 1))
            top.plot(steps, _rolling([x["reward"] for x in r], _TAIL), color=color, lw=0.8)
            bottom.plot(steps, [x["grad_norm_max"] for x in r], color=color, lw=0.8)
        top.set_title(c, fontsize=8)
        top.set_ylim(0, 1)
        bottom.set_yscale("log")
        bottom.set_ylim(1e-2, 1e5)
        bottom.axhline(s.spike, color="red", lw=0.6, ls="--")
        bottom.set_xlabel("rollout step")
    axes[0][0].set_ylabel(f"training reward ({_TAIL}-step mean)")
    axes[1][0].set_ylabel("max grad norm")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
