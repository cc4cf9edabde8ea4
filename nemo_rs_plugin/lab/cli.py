"""A small GRPO experiment with a real training/inference mismatch: does the correction help?

``python -m nemo_rs_plugin.lab`` or ``nemo-rs lab`` (``--quick`` for the smoke run CI
uses). Every arm trains the same tiny mixture-of-experts decoder (transformers' Qwen3-MoE,
random initialisation from a tiny config, nothing downloaded) on the same task with GRPO;
only the loss's off-policy correction differs, except the ``on-policy`` reference, whose
sampler has no mismatch. The loss is the plugin's public API, called as NeMo-RL calls it:
``loss_fn(next_token_logprobs, data, global_valid_seqs, global_valid_toks)`` with NeMo-RL's
data dict, ``prev_logprobs`` recomputed by the trainer (float32) before the update,
``generation_logprobs`` from the sampler.

The mismatch is real, not injected: the sampler is a copy of the trainer's weights run in
another precision (``--sampler-dtype``, default bfloat16, so MoE routing decisions flip for
real) and ``--lag`` optimizer steps behind the trainer (asynchronous GRPO; default 8, with
lr 1e-2: the regime where the uncorrected loss spikes and collapses, docs/lab.md).

The task ("count"): the prompt is ``[BOS, s]`` with ``s`` a random token of ``--vocab``; the
response has exactly ``--length`` tokens and should count on, ``s+1, s+2, ...`` mod vocab.
The verifiable reward is the fraction of response tokens equal to their predecessor + 1
(so a policy uniform over the task's tokens scores ``1/vocab``, a perfect one 1.0, at every
length; one uniform over the model's whole vocabulary, BOS included, scores a little less:
:func:`~nemo_rs_plugin.lab.model.chance_reward`, the dose-response run's chance).

``--lags 0 1 2 4 8`` is the dose-response run instead: every arm at every lag over the same
paired seeds (the on-policy reference once per seed), 80 steps, 16 seeds the published runs did
not use, and paired tests (:mod:`~nemo_rs_plugin.lab.dose`). ``--report DIR`` re-renders
its tables from a saved ``lab_dose_seeds.csv`` without rerunning.

Outputs under ``--out``: ``lab_steps.csv`` (one row per arm, seed and step),
``lab_seeds.csv`` (the outcomes of every run), ``lab_summary.csv`` / ``lab_summary.md`` (per
arm, and whether the seeds separate the compared pairs), ``lab_comparisons.csv``,
``lab.png`` (curves: mean over seeds, min-max band, log-scale gradient norm and KL) and
``lab_seeds.png`` (every seed's curve, per arm). See docs/lab.md for the published run. With
``--lags``: ``lab_dose_steps.csv`` (per step, with ``lag``), ``lab_dose_seeds.csv`` (the
outcomes of every run), ``lab_dose.csv`` (per arm and lag), ``lab_dose_comparisons.csv``,
``lab_dose.md`` (the tables, between the markers a page embeds), ``lab_dose_settings.json``
and ``lab_dose.png``.

This module is the command line (its flags and their checks); each kind of run and what it
writes is :mod:`~nemo_rs_plugin.lab.runs`, the experiment :mod:`~nemo_rs_plugin.lab.experiment`
(the model and sampler in :mod:`~nemo_rs_plugin.lab.model`), the tables and figures
:mod:`~nemo_rs_plugin.lab.run_report`.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
from typing import Any, Optional, Sequence

from nemo_rs_plugin.lab import runs
from nemo_rs_plugin.lab.confirm import (
    PROTOCOL,
    protocol_arms,
)
from nemo_rs_plugin.lab.experiment import (
    CONFIGS,
    DEFAULT_ARMS,
    DOSE,
    DOSE_ARMS,
    DOSE_LAGS,
    QUICK,
    QUICK_DOSE,
    LabSettings,
)
from nemo_rs_plugin.lab.length import LENGTH_STUDY
from nemo_rs_plugin.lab.model import DTYPES
from nemo_rs_plugin.lab.runs import SEEDS_CSV
from nemo_rs_plugin.tools.report import EXIT_INVALID, interrupted

# Smallest value of each count (below it a worker fails, or the run means nothing): a group
# of one response has no GRPO advantage (the std of one reward is NaN).
_MINIMUM = {
    "length": 1,
    "vocab": 1,
    "prompts": 1,
    "group": 2,
    "steps": 1,
    "minibatches": 1,
    "microbatches": 1,
    "layers": 1,
    "experts": 1,
    "top_k": 1,
    "lag": 0,
    "eval_every": 1,
    "calibration_steps": 1,
}


# ---------------------------------------------------------------------------- command line
def _span(values: list) -> str:
    return (
        f"{values[0]}..{values[-1]}" if values == list(range(values[0], values[-1] + 1)) else " ".join(map(str, values))
    )


def build_parser() -> argparse.ArgumentParser:
    """Arguments of ``python -m nemo_rs_plugin.lab`` / ``nemo-rs lab``."""
    d = LabSettings()
    p = argparse.ArgumentParser(prog="nemo-rs lab", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke run (well under a minute): 2 arms x 2 seeds, tiny sizes")
    p.add_argument("--out", default="lab-out", help="output folder (default lab-out)")
    p.add_argument(
        "--configs",
        nargs="+",
        metavar="NAME",
        help=f"arms to run (default: {' '.join(DEFAULT_ARMS)}); known: {', '.join(CONFIGS)}",
    )
    p.add_argument(
        "--seeds",
        nargs="+",
        type=int,
        help=f"seeds (default {' '.join(map(str, d.seeds))}; with --lags {_span(DOSE['seeds'])})",
    )
    p.add_argument(
        "--lags",
        nargs="+",
        type=int,
        metavar="LAG",
        help=(
            f"dose-response run: every arm at each lag (e.g. {' '.join(map(str, DOSE_LAGS))}) over the same "
            f"seeds, the on-policy reference once per seed; defaults --steps {DOSE['steps']}, "
            f"--configs {' '.join(DOSE_ARMS)} (instead of --lag)"
        ),
    )
    p.add_argument(
        "--confirm",
        action="store_true",
        help=(
            "the confirmatory protocol's run (docs/lab.md#confirmation): the arms and lags of its primary "
            f"comparisons on its confirmation seeds ({_span(list(PROTOCOL.confirmation_seeds))}; --seeds to "
            "override), tested as fixed in advance"
        ),
    )
    p.add_argument(
        "--lengths",
        nargs="+",
        type=int,
        metavar="L",
        help=(
            "length study (docs/lab.md#length): every arm at each response length over the same seeds, one "
            f"lag; defaults --lag {LENGTH_STUDY['lag']}, --steps {LENGTH_STUDY['steps']}, --seeds "
            f"{_span(LENGTH_STUDY['seeds'])}, --configs {' '.join(LENGTH_STUDY['configs'])} (published: "
            f"--lengths {' '.join(map(str, LENGTH_STUDY['lengths']))})"
        ),
    )
    p.add_argument(
        "--plan",
        nargs="+",
        metavar="DIR",
        help=(
            "print the confirmation's power calculation from exploration runs (--lags output folders, their "
            "outcomes recomputed from lab_dose_steps.csv, or per-seed CSVs holding the primary outcome); "
            "runs nothing"
        ),
    )
    p.add_argument(
        "--report",
        metavar="DIR",
        help=f"print the dose-response tables re-rendered from DIR/{SEEDS_CSV} (or that CSV itself); runs nothing",
    )
    for f in dataclasses.fields(LabSettings):
        if f.name in ("seeds", "configs"):
            continue
        p.add_argument(
            "--" + f.name.replace("_", "-"),
            type=type(getattr(d, f.name)),
            default=None,
            help=f"default {getattr(d, f.name)}",
        )
    p.add_argument(
        "--workers",
        type=int,
        default=min(2, os.cpu_count() or 1),
        help="processes (one thread each; results do not depend on it)",
    )
    return p


def settings_from(args: argparse.Namespace) -> LabSettings:
    """Defaults (with ``--lags``, the dose-response run's), then ``--quick``, then explicit flags."""
    base: dict[str, Any] = {}
    dose = bool(getattr(args, "lags", None)) or bool(getattr(args, "confirm", False))
    if dose:
        base.update(DOSE)
    if getattr(args, "confirm", False):
        base.update(seeds=list(PROTOCOL.confirmation_seeds))
    lengths = bool(getattr(args, "lengths", None))
    if lengths:
        base.update(DOSE)
        base.update({k: v for k, v in LENGTH_STUDY.items() if k != "lengths"})
    if args.quick:
        base.update(QUICK)
        if dose or lengths:
            base.update(QUICK_DOSE)
        if lengths:
            base.update(configs=["none", "sequence"])
    if getattr(args, "confirm", False):  # the protocol's arms, whatever the sizes
        base.update(configs=protocol_arms(PROTOCOL))
    fields: dict[str, Any] = {k: list(v) if isinstance(v, list) else v for k, v in base.items()}  # copies
    s = LabSettings(**fields)
    for f in dataclasses.fields(LabSettings):
        v = getattr(args, f.name, None)
        if v is not None:
            setattr(s, f.name, list(v) if isinstance(v, list) else v)
    return s


def _repeated_problems(s: LabSettings, lags: Optional[list[int]] = None) -> list[str]:
    """A seed, an arm or a lag named twice: it would count twice in the seed tests (Fisher, permutation)."""
    problems = []
    for flag, values in (("--seeds", s.seeds), ("--configs", s.configs), ("--lags", lags or [])):
        repeated = sorted({str(v) for v in values if list(values).count(v) > 1})
        if repeated:
            problems.append(f"{flag}: {', '.join(repeated)} given more than once; name each once")
    return problems


def settings_problems(s: LabSettings, args: argparse.Namespace) -> list[str]:
    """Every problem with the settings and flags, found before a worker starts (one line each)."""
    problems = []
    unknown = [c for c in s.configs if c not in CONFIGS]
    if unknown:
        problems.append(
            f"--configs: unknown configuration(s) {', '.join(map(repr, unknown))}; known: {', '.join(CONFIGS)}"
        )
    if s.sampler_dtype not in DTYPES:
        problems.append(f"--sampler-dtype: got {s.sampler_dtype!r}; allowed: {', '.join(DTYPES)}")
    for name, minimum in _MINIMUM.items():
        if getattr(s, name) < minimum:
            problems.append(f"--{name.replace('_', '-')}: got {getattr(s, name)}; must be at least {minimum}")
    if s.experts >= 1 and s.top_k > s.experts:
        problems.append(f"--top-k: got {s.top_k}; must be at most --experts ({s.experts})")
    # head_dim = hidden / 4 must be even (rotary embedding), and a half-precision sampler's
    # expert kernels need rows of a multiple of 16 bytes.
    if s.hidden < 8 or s.hidden % 8:
        problems.append(f"--hidden: got {s.hidden}; allowed: a positive multiple of 8")
    for name in ("lr", "max_grad_norm"):
        v = getattr(s, name)
        if not math.isfinite(v) or v < 0:
            problems.append(f"--{name.replace('_', '-')}: got {v}; allowed: a finite number >= 0")
    if not (0.0 <= s.calibration_target < 1.0):
        problems.append(f"--calibration-target: got {s.calibration_target}; allowed: 0 <= target < 1")
    calibrated = [c for c in s.configs if c in CONFIGS and CONFIGS[c].calibrated]
    if calibrated and s.steps >= 1 and s.calibration_steps >= s.steps:  # (--steps 0 is its own error)
        problems.append(
            f"--calibration-steps: got {s.calibration_steps}; must be below --steps ({s.steps}) for "
            f"{', '.join(calibrated)} (the band is set after those steps)"
        )
    if not (math.isfinite(s.spike) and s.spike > 0):
        problems.append(f"--spike: got {s.spike}; allowed: a finite number > 0")
    if not math.isfinite(s.threshold):
        problems.append(f"--threshold: got {s.threshold}; allowed: a finite number (a reward in [0, 1])")
    if args.workers < 1:
        problems.append(f"--workers: got {args.workers}; must be at least 1")
    if getattr(args, "confirm", False):
        for flag, given in (("--lags", args.lags), ("--lag", args.lag), ("--configs", args.configs)):
            if given is not None:
                problems.append(f"{flag}: --confirm runs the protocol's own arms and lags; drop {flag}")
        overlap = sorted(set(s.seeds) & set(PROTOCOL.exploration_seeds))
        if overlap:
            problems.append(
                f"--seeds: {' '.join(map(str, overlap))} belong to the exploration "
                f"({_span(list(PROTOCOL.exploration_seeds))}); a confirmation needs seeds it never saw"
            )
    if getattr(args, "lengths", None):
        for flag, given in (("--lags", args.lags), ("--confirm", args.confirm or None), ("--length", args.length)):
            if given is not None:
                problems.append(f"{flag}: the length study (--lengths) sets the lengths at one lag; drop {flag}")
        short = [n for n in args.lengths if n < 1]
        if short:
            problems.append(f"--lengths: got {' '.join(map(str, short))}; each must be at least 1")
        repeated = sorted({n for n in args.lengths if args.lengths.count(n) > 1})
        if repeated:
            problems.append(f"--lengths: {', '.join(map(str, repeated))} given more than once; name each once")
    lags = getattr(args, "lags", None)
    if lags:
        if args.lag is not None:
            problems.append("--lag: one lag, or --lags for a dose-response run, not both")
        negative = [lag for lag in lags if lag < 0]
        if negative:
            problems.append(f"--lags: got {' '.join(map(str, negative))}; each must be at least 0")
    problems += _repeated_problems(s, lags)
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        problems.append(f"--out: got {args.out}; it is a file: name a directory (it is created if missing)")
    else:
        existing = os.path.abspath(args.out)
        while not os.path.exists(existing):
            existing = os.path.dirname(existing)
        if not os.path.isdir(existing) or not os.access(existing, os.W_OK):
            problems.append(f"--out: got {args.out}; {existing} is not a writable directory, so it cannot be created")
    responses = s.prompts * s.group
    counts_valid = s.prompts >= 1 and s.group >= 2 and s.minibatches >= 1  # else reported above
    if counts_valid and s.minibatches > responses:
        problems.append(
            f"--minibatches: got {s.minibatches}; at most the {responses} responses of a step (--prompts x --group)"
        )
    elif counts_valid and s.microbatches > responses // s.minibatches:
        problems.append(
            f"--microbatches: got {s.microbatches}; at most the {responses // s.minibatches} responses of a "
            "minibatch (--prompts x --group / --minibatches)"
        )
    return problems


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the experiment; write the CSVs, the table and the figure under ``--out``.

    Ctrl-C stops it with one ``interrupted`` line on stderr and exit status 130 (no traceback;
    nothing of the unfinished run is written).
    """
    try:
        return _main(argv)
    except KeyboardInterrupt:
        return interrupted()


def _main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.report is not None:
        return runs.report_main(args.report)
    if args.plan is not None:
        return runs.plan_main(args.plan)
    s = settings_from(args)
    problems = settings_problems(s, args)
    for line in problems:
        print(f"error: {line}", file=sys.stderr)
    if problems:
        return EXIT_INVALID
    try:
        import transformers  # noqa: F401
    except ImportError:
        print(
            "error: nemo-rs lab needs transformers: install the [lab] extra, pip install 'nemo-rs-plugin[lab]' "
            """(from a clone: pip install -e ".[lab]"), which brings it (transformers>=5.5,<5.9) with the """
            "lab's statistics and figures",
            file=sys.stderr,
        )
        return EXIT_INVALID
    try:  # permission bits lie for root (/proc says writable): the creation itself decides
        os.makedirs(args.out, exist_ok=True)
    except OSError as exc:
        print(f"error: --out: got {args.out}; it cannot be created ({exc.strerror or exc})", file=sys.stderr)
        return EXIT_INVALID
    if args.confirm:
        return runs.confirm_main(s, args)
    if args.lengths:
        return runs.length_main(s, args)
    if args.lags:
        return runs.dose_main(s, args)
    return runs.single_main(s, args)
