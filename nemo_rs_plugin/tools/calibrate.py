"""``nemo-rs calibrate``: rejection bounds from your own run's log-probs, for a target rejection rate.

Reads per-token ``prev_logprobs`` and ``generation_logprobs`` saved from a run (the formats
of ``nemo-rs simulate --from``: JSONL or a torch file in NeMo-RL's ``train_data`` layout),
takes filter templates (presets by name, or a recipe's ``loss_fn.rejection_sampling``), and
prints for each stage: the statistic's distribution on the data, what the template's bounds
reject there, the calibrated bounds (those rejecting ``--target`` of the stage's units, never
narrower than the template's unless ``--allow-tighter``), and a ``rejection_sampling`` section
to paste. The rule and its trade-off are in
:mod:`nemo_rs_plugin.core.correction.calibration` and docs/guide.md ("Setting the band from
your mismatch").
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Optional

from nemo_rs_plugin.tools.report import EXIT_INVALID

HELP = "set rejection bounds from a run's log-probs for a target rejection rate"
DEFAULT_TARGET = 0.05  # docs/guide.md: a few percent; the lab's calibrated arm uses it


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``nemo-rs calibrate``'s flags."""
    from nemo_rs_plugin.core.settings.presets import FILTERS

    p.add_argument(
        "--from",
        dest="from_file",
        metavar="FILE|DIR",
        required=True,
        help="log-probs from a run: a JSONL or torch file, or the loss's record_dir (docs/cli.md)",
    )
    p.add_argument(
        "--steps",
        type=int,
        metavar="N",
        help="with a record_dir: the newest N recorded optimizer steps of the run read (default: every recorded step)",
    )
    p.add_argument(
        "--run",
        metavar="ID",
        help="with a record_dir: the run to read (its id, as calibrate prints it; 'legacy': records from before "
        "runs had folders); default: the newest run",
    )
    p.add_argument(
        "--skip-bad-records",
        action="store_true",
        help="with a record_dir: leave out records that fail their checksum or cannot be read, and say how many "
        "(default: an error naming the first)",
    )
    p.add_argument(
        "--target",
        type=float,
        default=DEFAULT_TARGET,
        help=f"share of each stage's units (sequences or tokens) to reject on the data (default {DEFAULT_TARGET})",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument("--filters", nargs="+", metavar="NAME", help=f"presets, in stage order: {', '.join(FILTERS)}")
    src.add_argument(
        "--recipe",
        metavar="YAML",
        help="calibrate this recipe's loss_fn.rejection_sampling stages; Hydra-style overrides "
        "(loss_fn.rejection_sampling.0.upper=1.02) may follow, as for nemo-rs check",
    )
    p.set_defaults(overrides=[])
    p.add_argument(
        "--allow-tighter",
        action="store_true",
        help="let the band come out narrower than the template's (default: calibration only widens it)",
    )
    p.add_argument(
        "--allow-few",
        action="store_true",
        help="print the band even where a stage has fewer than 20 units (default: an error; such a band is "
        "not a calibration)",
    )
    p.add_argument("--json", metavar="FILE", help="also write the result as JSON")


def _templates(args: argparse.Namespace, problems: list[str]) -> list[dict]:
    from nemo_rs_plugin.core.settings.presets import FILTERS

    if args.recipe:
        from nemo_rs_plugin.core.settings.config import own_loss_problems
        from nemo_rs_plugin.core.settings.presets import selects_nemo_rl_loss
        from nemo_rs_plugin.tools.recipe_loading import (
            INHERITED_NOT_FOUND,
            LoadedRecipe,
            load_recipe,
            unresolved_problems,
        )

        report = LoadedRecipe()
        cfg = load_recipe(args.recipe, list(getattr(args, "overrides", [])), None, report)
        if cfg is None:
            problems.extend(f"--recipe: {e}" for e in report.errors or [f"{args.recipe}: could not be read"])
            return []
        where = f"--recipe {args.recipe}"
        for under in ("loss_fn.name", "loss_fn.rejection_sampling"):  # what calibration reads
            problems += unresolved_problems(where, report.unresolved, "calibrate", under=under)
        if problems:
            return []
        loss = cfg.get("loss_fn") or {}
        loss = {"name": loss} if isinstance(loss, str) else loss
        if not isinstance(loss, dict):
            problems.append(f"--recipe: {args.recipe}: loss_fn: got a {type(loss).__name__}; expected a mapping")
            return []
        if selects_nemo_rl_loss(loss.get("name")):  # NeMo-RL's own loss would ignore the stages
            own = own_loss_problems(loss, loss.get("name"))
            problems.extend(f"--recipe: {args.recipe}: loss_fn.{p}" for p in own)
            if own:
                return []
        stages = loss.get("rejection_sampling") or []
        if not stages:
            inherited = [u for u in report.unchecked if u.startswith(INHERITED_NOT_FOUND)]
            hint = f" (it may come from defaults that were not found: {'; '.join(inherited)})" if inherited else ""
            problems.append(f"--recipe: {args.recipe} has no loss_fn.rejection_sampling to calibrate{hint}")
        bad = [i for i, f in enumerate(stages) if not isinstance(f, dict)]
        if bad:
            problems.append(f"--recipe: rejection_sampling stage(s) {bad} are not mappings")
            return []
        return [dict(f) for f in stages]
    names = args.filters or ["geo-rs"]
    unknown = [n for n in names if n not in FILTERS]
    if unknown:
        problems.append(f"--filters: unknown {', '.join(unknown)}; allowed: {', '.join(FILTERS)}")
        return []
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:  # two stages with one label: the section printed would hold one of them
        problems.append(f"--filters: {', '.join(repeated)} given more than once; name each preset once")
        return []
    return [dict(FILTERS[n]) for n in names]


def run(args: argparse.Namespace) -> int:
    """Calibrate, print the table and the section; 2 with one ``error:`` line per problem."""
    problems: list[str] = []
    if args.steps is not None and args.steps < 1:
        problems.append(f"--steps: got {args.steps}; allowed: an integer >= 1 (recorded optimizer steps)")
    elif args.steps is not None and not os.path.isdir(args.from_file):
        problems.append(
            f"--steps: reads a record_dir (a folder of the loss's records); --from {args.from_file} is not one"
        )
    for flag, given in (("--run", args.run is not None), ("--skip-bad-records", args.skip_bad_records)):
        if given and not os.path.isdir(args.from_file):
            problems.append(
                f"{flag}: reads a record_dir (a folder of the loss's records); --from {args.from_file} is not one"
            )
    if not (math.isfinite(args.target) and 0.0 <= args.target < 1.0):
        problems.append(f"--target: got {args.target}; allowed: 0 <= target < 1 (a share, e.g. 0.05)")
    if args.json:
        from nemo_rs_plugin.tools.report import output_problems, same_file

        problems += output_problems("--json", args.json)
        if same_file(args.json, args.from_file):
            problems.append(f"--json {args.json}: is the --from file; writing it would destroy your log-probs")
    templates = _templates(args, problems)
    filters, batch, read = [], None, None
    if not problems:
        from pydantic import ValidationError

        from nemo_rs_plugin.core.settings.config import RejectionFilter
        from nemo_rs_plugin.tools.batch_formats import BatchFormatError, load_with_records

        if args.recipe:  # validated as check validates them: each problem names the stage, field, value, allowed
            filters = _recipe_filters(args.recipe, templates, problems)
        else:
            for i, t in enumerate(templates):
                try:
                    filters.append(RejectionFilter(**t))
                except ValidationError as e:
                    problems.append(f"stage {i}: {'; '.join(err['msg'] for err in e.errors())}")
        try:
            batch, read = load_with_records(args.from_file, args.steps, args.run, args.skip_bad_records)
        except BatchFormatError as e:
            problems.append(f"--from: {e}")
    if problems:
        for line in problems:
            print(f"error: {line}", file=sys.stderr)
        return EXIT_INVALID
    from nemo_rs_plugin.core.correction.calibration import calibrate_filters, rejected_fractions

    assert batch is not None  # loaded above, or a problem returned
    if read is not None:  # a records folder: which run, which steps, what was left out
        print(f"note: {read.summary()}", file=sys.stderr)
        for line in read.notes:
            print(f"note: {line}", file=sys.stderr)
        if read.skipped:
            print(
                f"warning: --skip-bad-records: left out {len(read.skipped)} bad record(s): " + "; ".join(read.skipped),
                file=sys.stderr,
            )
    prev, gen = batch["prev_logprobs"][:, 1:], batch["generation_logprobs"][:, 1:]
    mask = batch["token_mask"][:, 1:] * batch["sample_mask"][:, None]
    try:
        stages = calibrate_filters(filters, prev, gen, mask, args.target, widen_only=not args.allow_tighter)
        as_written = rejected_fractions(filters, prev, gen, mask)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_INVALID
    nonfinite = _nonfinite(prev, gen, mask)
    if nonfinite is not None:  # the loss rejects these whatever the bounds: calibration leaves them out
        print(f"warning: {nonfinite}", file=sys.stderr)
    few = [] if args.allow_few else _too_few(stages)
    if few:  # no band printed (or written) as if it were calibrated
        for line in few:
            print(f"error: {line}", file=sys.stderr)
        return EXIT_INVALID
    data_bands = (
        stages if args.allow_tighter else calibrate_filters(filters, prev, gen, mask, args.target, widen_only=False)
    )
    _print(args, filters, stages, as_written, batch, data_bands)
    for line in _warnings(args.target, filters, stages):
        print(f"warning: {line}", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(_as_json(args, filters, stages, as_written, read), fh, indent=2)
    return 0


#: Fewer units than this in a stage and its quantiles are not a calibration (a band from 1 sequence).
MIN_UNITS = 20


def _recipe_filters(recipe: str, stages: list[dict], problems: list[str]) -> list:
    """The recipe's stages validated by the config's own rules (``nemo-rs check``'s lines), or ``[]``."""
    import warnings

    from nemo_rs_plugin.core.settings.config import ConfigError, ConfigWarning, RSClippedPGLossConfig

    try:
        with warnings.catch_warnings():  # check's business; calibration reports what the data does
            warnings.simplefilter("ignore", ConfigWarning)
            return list(RSClippedPGLossConfig.from_any({"rejection_sampling": stages}).rejection_sampling)
    except ConfigError as exc:
        problems.extend(f"--recipe {recipe}: {p}" for p in exc.problems)
        return []


def _nonfinite(prev, gen, mask) -> Optional[str]:
    """What the data's non-finite log-probs on valid tokens do to calibration (``None`` if there are none)."""
    import torch

    valid = mask > 0
    bad = valid & ~(torch.isfinite(prev) & torch.isfinite(gen))
    tokens = int(bad.sum())
    if not tokens:
        return None
    sequences, total = int(bad.any(1).sum()), int(valid.any(1).sum())
    return (
        f"--from: {sequences} of the {total} sequences with a valid token have a non-finite log-prob (null, NaN "
        f"or inf; {tokens} valid token(s) in all); the loss rejects such a token at a token stage and such a "
        "sequence at a sequence stage whatever the bounds (docs/guide.md#non-finite-inputs), so calibration "
        "leaves them out of the stage's units: fix the dump (or the run) if they are many"
    )


def _too_few(stages: list) -> list[str]:
    """Stages with fewer than :data:`MIN_UNITS` units: an error unless ``--allow-few``."""
    return [
        f"stage {i}: only {st.units} units in --from; at least {MIN_UNITS} are needed to set a band from the "
        "data (from fewer it is not a calibration): dump more of the run, or pass --allow-few to print it anyway"
        for i, st in enumerate(stages)
        if st.units < MIN_UNITS
    ]


def _warnings(target: float, filters: list, stages: list) -> list[str]:
    """A target the loss itself calls unhealthy, and stages with too few units to set a band from."""
    from nemo_rs_plugin.core.reporting.health import UNHEALTHY_SEQ_REJECTION

    lines = []
    if target > UNHEALTHY_SEQ_REJECTION and any(f.level_entry.whole_sequences for f in filters):
        lines.append(
            f"--target {target:g} rejects more than the {UNHEALTHY_SEQ_REJECTION:.0%} of sequences the loss warns "
            "about at run time (docs/guide.md, 'When rejection eats the batch'); a few % is the usual target"
        )
    need = max(MIN_UNITS, math.ceil(2 / target)) if target > 0 else MIN_UNITS
    for i, st in enumerate(stages):
        if st.units < need:
            lines.append(
                f"stage {i}: only {st.units} units in --from; at least {need} are needed to place the target's "
                "quantiles, so this band is not calibrated: dump more of the run"
            )
    return lines


def _fmt(v: Optional[float]) -> str:
    return "open" if v is None else f"{v:.6g}"


def _tighter_sides(template, data_band) -> list[str]:
    """The sides on which the data's own band lies inside the template's (kept as written by widen-only)."""
    sides = []
    if template.lower is not None and data_band.lower is not None and data_band.lower > template.lower:
        sides.append("lower")
    if template.upper is not None and data_band.upper is not None and data_band.upper < template.upper:
        sides.append("upper")
    return sides


def _print(args, filters, stages, as_written, batch, data_bands) -> None:
    n_seq = int((batch["sample_mask"] > 0).sum())
    print(f"{args.from_file}: {n_seq} sequences; target rejection {args.target:g} per stage")
    for i, (f, st, written, own) in enumerate(zip(filters, stages, as_written, data_bands)):
        unit = f.level_entry.units
        q = st.quantiles
        print(f"stage {i} ({f.label}, {st.units} {unit}):")
        print(f"  statistic on the data: p1 {q['p1']:.6g}, median {q['p50']:.6g}, p99 {q['p99']:.6g}")
        print(f"  as written [{_fmt(f.lower)}, {_fmt(f.upper)}]: rejects {written:.1%} of the {unit}")
        tighter = [] if args.allow_tighter else _tighter_sides(f, own.filter)
        moved = (st.filter.lower, st.filter.upper) != (f.lower, f.upper)
        label = "calibrated" if moved or not tighter else "kept as written"
        print(
            f"  {label} [{_fmt(st.filter.lower)}, {_fmt(st.filter.upper)}]: rejects {st.rejected_frac:.1%} "
            f"of the {unit}"
        )
        if tighter:
            which = " and ".join(tighter)
            print(
                f"  the data's band [{_fmt(own.filter.lower)}, {_fmt(own.filter.upper)}] (rejects "
                f"{own.rejected_frac:.1%} of the {unit}) is narrower on the {which} side: calibration only widens "
                f"by default, so the {which} bound{'s stay' if len(tighter) > 1 else ' stays'} as written; "
                "--allow-tighter uses the data's band"
            )
    print("loss_fn:\n  rejection_sampling:")
    for st in stages:
        print(f"    - {_flow(st.filter)}")


def _flow(f) -> str:
    fields = f.model_dump(exclude_none=True, exclude_defaults=True)
    fields = {"level": f.level, **fields}
    parts = [f"{k}: {v:.6g}" if isinstance(v, float) else f"{k}: {v}" for k, v in fields.items()]
    return "{" + ", ".join(parts) + "}"


def _as_json(args, filters, stages, as_written, read) -> dict:
    records = None
    if read is not None:  # a records folder: what was read of it
        records = {
            "run": read.run,
            "steps": read.steps,
            "records": read.records,
            "rank_copies_read_once": read.copies,
            "bad_records_skipped": len(read.skipped),
        }
    return {
        "from": args.from_file,
        "records": records,
        "target": args.target,
        "stages": [
            {
                "template": f.model_dump(exclude_none=True),
                "calibrated": st.filter.model_dump(exclude_none=True),
                "units": st.units,
                "rejected_frac_as_written": written,
                "rejected_frac_calibrated": st.rejected_frac,
                "quantiles": st.quantiles,
            }
            for f, st, written in zip(filters, stages, as_written)
        ],
    }
