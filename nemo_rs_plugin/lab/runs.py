"""Each kind of lab run and what it writes; ``--plan`` and ``--report`` from saved outcomes.

The kinds: the single-lag run, the dose-response run, the confirmation, the length study.

Called by :mod:`~nemo_rs_plugin.lab.cli` once the flags are checked and ``--out`` exists.
Every table is rendered from the per-seed CSV as written, so ``--report`` on it prints the
same text as the run did.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import torch

from nemo_rs_plugin.lab.confirm import (
    PROTOCOL,
    format_confirmation,
    format_power_plan,
    power_plan,
    protocol_jobs,
)
from nemo_rs_plugin.lab.dose import (
    dose_comparisons,
    dose_outcomes,
    dose_table,
    planned_tests,
    read_seed_csv,
    smallest_p,
    write_seed_csv,
)
from nemo_rs_plugin.lab.dose_report import render_blocks, render_from_csv, write_dose_plot
from nemo_rs_plugin.lab.experiment import LabSettings
from nemo_rs_plugin.lab.length import format_length_study, read_length_csv, write_length_csv
from nemo_rs_plugin.lab.pool import dose_jobs, run_all
from nemo_rs_plugin.lab.run_report import (
    as_written,
    compare,
    default_pairs,
    format_comparisons,
    format_table,
    read_steps_csv,
    seed_outcomes,
    summarize,
    write_csv,
    write_plot,
    write_seed_plot,
    write_summary_csv,
)
from nemo_rs_plugin.lab.stats import SIGNIFICANCE
from nemo_rs_plugin.tools.report import EXIT_INVALID, ProgressBar

SEEDS_CSV = "lab_dose_seeds.csv"  # the dose-response run's per-seed outcomes: every table is rendered from it
CONFIRM_SEEDS_CSV = "lab_confirm_seeds.csv"  # the confirmation's per-seed outcomes
LENGTH_SEEDS_CSV = "lab_length_seeds.csv"  # the length study's per-seed outcomes


def _write_settings(path: str, settings: dict, run_facts: dict) -> None:
    """A run's settings, facts (time, workers) and library versions, as JSON next to its outputs."""
    import transformers

    with open(path, "w") as fh:
        json.dump(
            {**settings, **run_facts, "torch": torch.__version__, "transformers": transformers.__version__},
            fh,
            indent=2,
        )


def write_outputs(rows: list, s: LabSettings, out: str, run_facts: dict) -> str:
    """Write the step, seed, summary and comparison CSVs, the table, the settings and the figures.

    ``run_facts`` (workers, wall time) go into ``lab_settings.json`` beside the settings and the
    versions. Returns the table (summary, then the pairwise comparisons).

    The run's own data (``lab_steps.csv``, ``lab_seeds.csv``) is written before any statistic
    over seeds is computed (and the settings that read it): a statistic that fails cannot lose it.
    """
    write_csv(rows, os.path.join(out, "lab_steps.csv"))
    outcomes = seed_outcomes(rows, s)
    write_summary_csv(outcomes, os.path.join(out, "lab_seeds.csv"))
    _write_settings(os.path.join(out, "lab_settings.json"), dataclasses.asdict(s), run_facts)
    summary = summarize(outcomes, s)
    comparisons = compare(outcomes, default_pairs(s.configs))
    table = format_table(summary, s)
    if comparisons:
        table += "\n\n" + format_comparisons(comparisons)
    write_summary_csv(summary, os.path.join(out, "lab_summary.csv"))
    if comparisons:
        write_summary_csv(comparisons, os.path.join(out, "lab_comparisons.csv"))
    with open(os.path.join(out, "lab_summary.md"), "w") as fh:
        fh.write(table + "\n")
    try:
        write_plot(
            rows,
            s,
            os.path.join(out, "lab.png"),
            title=(
                f"GRPO, tiny Qwen3-MoE, count task, {s.length}-token responses, sampler "
                f"{s.sampler_dtype} lag {s.lag}, lr {s.lr:g}; mean of {len(s.seeds)} seeds, band min-max"
            ),
        )
        write_seed_plot(rows, s, os.path.join(out, "lab_seeds.png"))
    except ImportError:
        print("note: no matplotlib, no figure (pip install 'nemo-rs-plugin[plot]')", file=sys.stderr)
    return table


def write_dose_outputs(rows: list, s: LabSettings, lags: list[int], out: str, run_facts: dict) -> str:
    """Write the dose-response run's CSVs, tables, settings and figure; return the tables (markdown).

    Every table is rendered from ``lab_dose_seeds.csv`` as written, so ``--report`` on it
    prints the same text. The steps, the per-seed outcomes and the settings are written before
    any statistic over seeds is computed.
    """
    write_csv(rows, os.path.join(out, "lab_dose_steps.csv"))
    seeds_csv = os.path.join(out, SEEDS_CSV)
    write_seed_csv(dose_outcomes(rows, s), seeds_csv)
    settings = {k: v for k, v in dataclasses.asdict(s).items() if k != "lag"}
    _write_settings(os.path.join(out, "lab_dose_settings.json"), {**settings, "lags": list(lags)}, run_facts)
    outcomes = read_seed_csv(seeds_csv)
    comparisons = dose_comparisons(outcomes)
    write_summary_csv(dose_table(outcomes, comparisons), os.path.join(out, "lab_dose.csv"))
    if comparisons:
        write_summary_csv(comparisons, os.path.join(out, "lab_dose_comparisons.csv"))
    blocks = render_blocks(outcomes)
    with open(os.path.join(out, "lab_dose.md"), "w") as fh:
        fh.write(blocks)
    try:
        write_dose_plot(
            outcomes,
            os.path.join(out, "lab_dose.png"),
            title=(
                f"GRPO, tiny Qwen3-MoE, count task, {s.length}-token responses, sampler {s.sampler_dtype}, "
                f"lr {s.lr:g}, {s.steps} steps; {len(s.seeds)} paired seeds"
            ),
        )
    except ImportError:
        print("note: no matplotlib, no figure (pip install 'nemo-rs-plugin[plot]')", file=sys.stderr)
    return blocks


def dose_main(s: LabSettings, args: argparse.Namespace) -> int:
    """The dose-response run (``--lags``): every arm at every lag, then the outputs."""
    lags = list(args.lags)
    jobs = dose_jobs(s.configs, s.seeds, lags)
    print(
        f"nemo-rs lab: dose-response, {len(s.configs)} configs x lags {' '.join(map(str, lags))} x "
        f"{len(s.seeds)} seeds = {len(jobs)} runs x {s.steps} steps, {s.prompts}x{s.group} responses of "
        f"{s.length} tokens, sampler {s.sampler_dtype}, {args.workers} worker(s)",
        file=sys.stderr,
    )
    tests = planned_tests(s.configs, lags)
    if tests and smallest_p(len(s.seeds)) * tests >= SIGNIFICANCE:
        print(
            f"warning: with {len(s.seeds)} seeds no count (collapsed, at chance) can reach p < {SIGNIFICANCE:g} "
            f"after Holm's correction over {tests} tests (McNemar's smallest p is {smallest_p(len(s.seeds)):.2g}): "
            "no count will be separated; add seeds or drop arms or lags",
            file=sys.stderr,
        )
    t0 = time.perf_counter()
    rows = as_written(run_all(s, workers=args.workers, progress=ProgressBar(eta=True), lags=lags))
    total = time.perf_counter() - t0
    blocks = write_dose_outputs(rows, s, lags, args.out, {"workers": args.workers, "total_wall_s": round(total, 1)})
    print(blocks, end="")
    print(f"total wall time {total:.0f}s; outputs in {args.out}/")
    return 0


def write_confirm_outputs(rows: list, s: LabSettings, out: str, run_facts: dict) -> str:
    """Write the confirmation's CSVs, its settings and its table (``lab_confirm.md``); return the table.

    The CSVs and the settings are written before any statistic over seeds is computed.
    """
    write_csv(rows, os.path.join(out, "lab_confirm_steps.csv"))
    seeds_csv = os.path.join(out, CONFIRM_SEEDS_CSV)
    write_seed_csv(dose_outcomes(rows, s), seeds_csv)
    settings = {k: v for k, v in dataclasses.asdict(s).items() if k != "lag"}
    protocol = {
        "primary": [dataclasses.asdict(c) for c in PROTOCOL.primary],
        "outcome": PROTOCOL.outcome,
        "delta": PROTOCOL.delta,
        "alpha": PROTOCOL.alpha,
        "power": PROTOCOL.power,
        "exploration_seeds": list(PROTOCOL.exploration_seeds),
    }
    _write_settings(os.path.join(out, "lab_confirm_settings.json"), {**settings, "protocol": protocol}, run_facts)
    block = format_confirmation(read_seed_csv(seeds_csv))
    with open(os.path.join(out, "lab_confirm.md"), "w") as fh:
        fh.write(f"<!-- lab:confirmation:begin -->\n{block}\n<!-- lab:confirmation:end -->\n")
    return block


def confirm_main(s: LabSettings, args: argparse.Namespace) -> int:
    """The confirmation (``--confirm``): the protocol's arms and lags on its seeds, then its table."""
    jobs = protocol_jobs(PROTOCOL, s.seeds)
    print(
        f"nemo-rs lab: confirmation, {len(PROTOCOL.primary)} primary comparisons, {len(jobs)} runs "
        f"({len(s.seeds)} seeds) x {s.steps} steps, {s.prompts}x{s.group} responses of {s.length} tokens, "
        f"sampler {s.sampler_dtype}, {args.workers} worker(s)",
        file=sys.stderr,
    )
    t0 = time.perf_counter()
    rows = as_written(run_all(s, workers=args.workers, progress=ProgressBar(eta=True), jobs=jobs))
    total = time.perf_counter() - t0
    block = write_confirm_outputs(rows, s, args.out, {"workers": args.workers, "total_wall_s": round(total, 1)})
    print(block)
    print(f"total wall time {total:.0f}s; outputs in {args.out}/")
    return 0


def length_main(s: LabSettings, args: argparse.Namespace) -> int:
    """The length study (``--lengths``): every arm at every length at one lag, then its table."""
    lengths = list(args.lengths)
    print(
        f"nemo-rs lab: length study, {len(s.configs)} configs x lengths {' '.join(map(str, lengths))} x "
        f"{len(s.seeds)} seeds at lag {s.lag}, {s.steps} steps, {args.workers} worker(s)",
        file=sys.stderr,
    )
    t0 = time.perf_counter()
    rows: list[dict] = []
    outcomes: list[dict] = []
    for length in lengths:
        at = dataclasses.replace(s, length=length)
        got = as_written(run_all(at, workers=args.workers, progress=ProgressBar(eta=True), lags=[s.lag]))
        rows += [{**r, "length": length} for r in got]
        outcomes += [{**o, "length": length} for o in dose_outcomes(got, at)]
    total = time.perf_counter() - t0
    write_csv(rows, os.path.join(args.out, "lab_length_steps.csv"))
    seeds_csv = os.path.join(args.out, LENGTH_SEEDS_CSV)
    write_length_csv(outcomes, seeds_csv)
    settings = {k: v for k, v in dataclasses.asdict(s).items() if k != "length"}
    facts = {"workers": args.workers, "total_wall_s": round(total, 1)}
    _write_settings(os.path.join(args.out, "lab_length_settings.json"), {**settings, "lengths": lengths}, facts)
    block = format_length_study(read_length_csv(seeds_csv))  # the statistics, after the run's data is saved
    with open(os.path.join(args.out, "lab_length.md"), "w") as fh:
        fh.write(f"<!-- lab:length:begin -->\n{block}\n<!-- lab:length:end -->\n")
    print(block)
    print(f"total wall time {total:.0f}s; outputs in {args.out}/")
    return 0


def outcomes_of_run(path: str) -> list[dict]:
    """A dose-response run's per-seed outcomes, recomputed from its steps where it has them.

    From ``path/lab_dose_steps.csv`` and its settings where the folder has them (so outcomes
    added since the run are there); else ``path/lab_dose_seeds.csv`` or ``path`` itself, as written.
    """
    steps = os.path.join(path, "lab_dose_steps.csv")
    settings = os.path.join(path, "lab_dose_settings.json")
    if os.path.isdir(path) and os.path.isfile(steps) and os.path.isfile(settings):
        with open(settings) as fh:
            raw = json.load(fh)
        s = LabSettings(**{k: v for k, v in raw.items() if k in LabSettings.__dataclass_fields__})
        return dose_outcomes(read_steps_csv(steps), s)
    csv_path = os.path.join(path, SEEDS_CSV) if os.path.isdir(path) else path
    if not os.path.isfile(csv_path):
        raise ValueError(f"got {path}; neither lab_dose_steps.csv with its settings nor {SEEDS_CSV} there")
    return read_seed_csv(csv_path)


def plan_main(paths: list[str]) -> int:
    """``--plan DIR ...``: the confirmation's power calculation from exploration runs' per-seed outcomes."""
    try:
        outcomes = [o for path in paths for o in outcomes_of_run(path)]
        text = format_power_plan(power_plan(outcomes))
    except (ValueError, KeyError) as exc:
        print(f"error: --plan: {exc}", file=sys.stderr)
        return EXIT_INVALID
    print(text)
    return 0


def _render_length(path: str) -> str:
    return format_length_study(read_length_csv(path))


def _render_confirmation(path: str) -> str:
    return format_confirmation(read_seed_csv(path))


def report_main(path: str) -> int:
    """``--report DIR``: print the tables re-rendered from the per-seed CSV of a run saved in ``DIR``.

    The length study's, the confirmation's or the dose-response run's (that CSV may be named itself).
    """
    # A CSV named by its file name is read as what it is; a folder by the first CSV it holds.
    named = os.path.basename(path) if os.path.isfile(path) else None
    for name, render in ((LENGTH_SEEDS_CSV, _render_length), (CONFIRM_SEEDS_CSV, _render_confirmation)):
        csv_file = path if named == name else os.path.join(path, name)
        if (named == name) or (named is None and os.path.isfile(csv_file)):
            try:
                print(render(csv_file))
            except (ValueError, KeyError) as exc:
                print(f"error: --report: {exc}", file=sys.stderr)
                return EXIT_INVALID
            return 0
    csv_path = os.path.join(path, SEEDS_CSV) if os.path.isdir(path) else path
    if not os.path.isfile(csv_path):
        print(
            f"error: --report: got {path}; no {SEEDS_CSV} or {CONFIRM_SEEDS_CSV} there "
            "(run nemo-rs lab --lags ... or --confirm with --out DIR first)",
            file=sys.stderr,
        )
        return EXIT_INVALID
    try:
        text = render_from_csv(csv_path)
    except (ValueError, KeyError) as exc:
        print(f"error: --report: {exc}", file=sys.stderr)
        return EXIT_INVALID
    print(text, end="")
    return 0


def single_main(s: LabSettings, args: argparse.Namespace) -> int:
    """The single-lag run (the default): every arm on every seed, then the outputs."""
    print(
        f"nemo-rs lab: {len(s.configs)} configs x {len(s.seeds)} seeds x {s.steps} steps, "
        f"{s.prompts}x{s.group} responses of {s.length} tokens, sampler {s.sampler_dtype} lag {s.lag}, "
        f"{args.workers} worker(s)",
        file=sys.stderr,
    )
    t0 = time.perf_counter()
    # The tables are computed from the rows as the CSV holds them: rerunning the report on
    # lab_steps.csv (tests/docs/test_lab_docs.py does, for docs/lab.md) prints the same table.
    rows = as_written(run_all(s, workers=args.workers, progress=ProgressBar(eta=True)))
    total = time.perf_counter() - t0
    table = write_outputs(rows, s, args.out, {"workers": args.workers, "total_wall_s": round(total, 1)})
    print(table)
    print(f"total wall time {total:.0f}s; outputs in {args.out}/")
    return 0
