"""The lab's reporting: the summary table, its CSV and Markdown forms, the learning curves."""

from __future__ import annotations

import math

import torch

from nemo_rs_plugin.tools import report
from nemo_rs_plugin.tools.lab_experiment import STEP_METRICS, LabSettings

__all__ = ["format_table", "summarize", "write_csv", "write_plot", "write_summary_csv"]

# Per-step quantities the table averages over steps (per seed), then over seeds.
_AVERAGED = (
    "mismatch_mean",
    "mismatch_max",
    "routing_diff_frac",
    "is_weight_mean",
    "is_ess",
    "seq_rejected_frac",
    "token_rejected_frac",
    "grad_norm",
)


def summarize(rows: list[dict], s: LabSettings, tail: int = 5) -> list[dict]:
    """The table: per configuration, over seeds (mean and standard deviation)."""
    out = []
    for c in s.configs:
        per_seed = []
        for seed in s.seeds:
            r = [x for x in rows if x["config"] == c and x["seed"] == seed]
            if not r:
                continue
            last = r[-min(tail, len(r)) :]
            reached = next((x["step"] for x in r if x["reward"] >= s.threshold), None)
            per_seed.append(
                {
                    "final_reward": sum(x["reward"] for x in last) / len(last),
                    "reached": reached,
                    "wall_s": r[-1]["wall_s"],
                    **{k: sum(x[k] for x in r) / len(r) for k in _AVERAGED},
                }
            )
        if not per_seed:
            continue
        n = len(per_seed)

        def mean(k):
            return sum(p[k] for p in per_seed) / n

        def std(k):
            m = mean(k)
            return math.sqrt(sum((p[k] - m) ** 2 for p in per_seed) / max(n - 1, 1))

        reached = [p["reached"] for p in per_seed if p["reached"] is not None]
        out.append(
            {
                "config": c,
                "seeds": n,
                "final_reward": mean("final_reward"),
                "final_reward_std": std("final_reward"),
                "steps_to_threshold": (sorted(reached)[len(reached) // 2] if len(reached) * 2 > n else None),
                "seeds_reaching": len(reached),
                "wall_s_per_run": mean("wall_s"),
                **{k: mean(k) for k in _AVERAGED},
            }
        )
    return out


def format_table(summary: list[dict], s: LabSettings) -> str:
    """The summary as a Markdown table."""
    tail = min(5, s.steps)
    header = [
        "config",
        f"final reward (last {tail} steps, mean ± sd)",
        f"steps to reward {s.threshold:g} (median; seeds reaching)",
        "wall s / run",
        "mean \\|prev-gen\\|",
        "max \\|prev-gen\\|",
        "routing differs",
        "is_weight_mean",
        "is_ess",
        "seq rejected",
        "token rejected",
        "grad norm",
    ]
    return report.markdown_table(header, [_table_cells(r) for r in summary])


def _table_cells(r: dict) -> list[str]:
    reach = "-" if r["steps_to_threshold"] is None else str(r["steps_to_threshold"])
    return [
        f"`{r['config']}`",
        f"{r['final_reward']:.3f} ± {r['final_reward_std']:.3f}",
        f"{reach} ({r['seeds_reaching']}/{r['seeds']})",
        f"{r['wall_s_per_run']:.0f}",
        f"{r['mismatch_mean']:.4f}",
        f"{r['mismatch_max']:.3f}",
        f"{r['routing_diff_frac']:.3f}",
        f"{r['is_weight_mean']:.3f}",
        f"{r['is_ess']:.3f}",
        f"{r['seq_rejected_frac']:.3f}",
        f"{r['token_rejected_frac']:.4f}",
        f"{r['grad_norm']:.3f}",
    ]


def write_csv(rows: list[dict], path: str) -> None:
    """One row per configuration, seed and step (floats to 6 significant digits)."""
    fields = ["config", "seed", "step", *STEP_METRICS]
    report.write_csv([{k: r[k] for k in fields} for r in rows], path, fields, float_digits=6)


def write_summary_csv(summary: list[dict], path: str) -> None:
    """The table as CSV."""
    report.write_csv(summary, path, list(summary[0]), float_digits=6)


_PANELS = (
    ("reward", "reward (fraction counted right)"),
    ("mismatch_mean", "mean |prev - gen| per token"),
    ("routing_diff_frac", "tokens with different expert routing"),
    ("is_weight_mean", "is_weight_mean"),
    ("is_ess", "effective sample size"),
    ("seq_rejected_frac", "sequences rejected"),
    ("token_rejected_frac", "tokens rejected"),
    ("grad_norm", "gradient norm (before clip)"),
)


def write_plot(rows: list[dict], s: LabSettings, path: str, title: str = "") -> None:
    """Learning curves: mean over seeds, band = min..max over seeds (needs matplotlib)."""
    plt = report.pyplot()

    fig, axes = plt.subplots(2, 4, figsize=(17, 7.5), sharex=True)
    colors = plt.get_cmap("tab10")
    for i, c in enumerate(s.configs):
        runs = [[x for x in rows if x["config"] == c and x["seed"] == seed] for seed in s.seeds]
        runs = [r for r in runs if r]
        if not runs:
            continue
        steps = [x["step"] for x in runs[0]]
        for ax, (key, label) in zip(axes.flat, _PANELS):
            vals = torch.tensor([[x[key] for x in r] for r in runs], dtype=torch.float64)
            ax.plot(steps, vals.mean(0).tolist(), color=colors(i), label=c, lw=1.6)
            ax.fill_between(
                steps, vals.min(0).values.tolist(), vals.max(0).values.tolist(), color=colors(i), alpha=0.15, lw=0
            )
            ax.set_title(label, fontsize=10)
    for ax in axes[1]:
        ax.set_xlabel("rollout step")
    axes.flat[0].legend(fontsize=8, loc="lower right")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
