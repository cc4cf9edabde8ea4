"""``nemo-rs simulate``: its help, its options, their checks and the command's body.

The simulation itself (the mismatch model, the loss run per configuration, the table) is
:mod:`nemo_rs_plugin.tools.simulate`; this module is what the command line adds to it: the
options, every problem with them found before the (minutes long) run, and the output files.
"""

from __future__ import annotations

import argparse
import math
import sys

from nemo_rs_plugin.tools.report import EXIT_INVALID

HELP = "run corrections through the real loss on a mismatch"

#: ``simulate``'s built-in configurations, named here for ``--help`` without importing torch
#: (tests/tools/test_cli_simulate_recipe.py holds them equal to ``simulate.DEFAULT_CONFIGS``).
DEFAULT_CONFIG_NAMES = (
    "uncorrected",
    "token",
    "token+tis2",
    "sequence",
    "sequence+tis2",
    "sequence_mean",
    "seqmean+geo-rs+veto",
    "geo-rs+token-mis",
)

# Options that shape the synthetic batch: (flag, default); none of them applies to --from.
SYNTHETIC_OPTIONS = {
    "responses": ("--responses", 16),
    "length": ("--length", 9000),
    "mismatch": ("--mismatch", 0.02),
    "outlier_rate": ("--outlier-rate", 0.0),
    "staleness": ("--staleness", 0.0),
    "steps": ("--steps", 4),
    "seed": ("--seed", 0),
}


def _from_file_source(path: str, batch: dict) -> str:
    """The table's header for ``--from``: the file, its sequences, and its non-finite log-probs."""
    import torch  # simulate has loaded it already

    source = f"{path}: {batch['prev_logprobs'].shape[0]} sequences"
    valid = (batch["token_mask"][:, 1:] * batch["sample_mask"][:, None]) != 0
    lp = torch.stack([batch["prev_logprobs"][:, 1:], batch["generation_logprobs"][:, 1:]])
    nonfinite = int((~torch.isfinite(lp).all(0) & valid).sum())
    if nonfinite:  # null, NaN or infinite in the file: the loss zeroes those tokens (docs/guide.md#non-finite-inputs)
        infinite = int((torch.isinf(lp).any(0) & valid).sum())
        kinds = "null/NaN" if not infinite else "infinite" if infinite == nonfinite else "null/NaN or infinite"
        source += f", {nonfinite} valid token(s) with a non-finite log-prob ({kinds}), left out of the loss"
    return source


def option_problems(args: argparse.Namespace) -> list[str]:
    """Every problem with the options, found before the (minutes long) run."""
    from nemo_rs_plugin.tools import simulate as sim
    from nemo_rs_plugin.tools.report import output_problems, same_file

    problems = []
    if args.from_file:
        given = [flag for dest, (flag, _) in SYNTHETIC_OPTIONS.items() if getattr(args, dest) is not None]
        if given:
            problems.append(
                f"{', '.join(given)}: shape(s) the synthetic batch, which --from replaces; drop them or drop --from"
            )
    else:
        for dest, (_, default) in SYNTHETIC_OPTIONS.items():
            if getattr(args, dest) is None:
                setattr(args, dest, default)
        for dest in ("responses", "length", "steps"):
            if getattr(args, dest) < 1:
                problems.append(f"{SYNTHETIC_OPTIONS[dest][0]}: got {getattr(args, dest)}; must be at least 1")
        for dest, upper in (("mismatch", None), ("outlier_rate", 1.0), ("staleness", None)):
            v = getattr(args, dest)
            if not math.isfinite(v) or v < 0 or (upper is not None and v > upper):
                allowed = f"a number in [0, {upper:g}]" if upper is not None else "a finite number >= 0"
                problems.append(f"{SYNTHETIC_OPTIONS[dest][0]}: got {v}; allowed: {allowed}")
        if abs(args.seed) > sim.MAX_SEED:
            problems.append(f"--seed: got {args.seed}; allowed: an integer from -{sim.MAX_SEED} to {sim.MAX_SEED}")
        tokens = args.responses * args.length
        if args.length > sim.MAX_SYNTHETIC_TOKENS or tokens > sim.MAX_SYNTHETIC_TOKENS:
            problems.append(
                f"--responses x --length: got {args.responses} x {args.length} = {tokens} tokens; allowed: at most "
                f"{sim.MAX_SYNTHETIC_TOKENS} (the batch lives in memory, several float32 copies of it)"
            )
    outputs = [
        (flag, path) for flag, path in (("--csv", args.csv), ("--json", args.json), ("--plot", args.plot)) if path
    ]
    for flag, path in outputs:
        problems += output_problems(flag, path)
        if args.from_file and same_file(path, args.from_file):
            problems.append(f"{flag} {path}: is the --from file; writing it would destroy your log-probs")
    for i, (flag, path) in enumerate(outputs):  # the same file, also through a link: the last write wins
        problems += [
            f"{flag} and {other}: both name {path}" + ("" if p == path else f" (as {p})") + "; one would overwrite "
            "the other: name two files"
            for other, p in outputs[i + 1 :]
            if same_file(p, path)
        ]
    if args.plot:
        problems += sim.plot_problems(args.plot)
    return problems


def run(args: argparse.Namespace) -> int:
    """Run the configurations on the batches; print the table, write the files asked for."""
    from nemo_rs_plugin.tools import simulate as sim
    from nemo_rs_plugin.tools.report import ProgressBar

    configs = dict(sim.DEFAULT_CONFIGS)
    problems = []
    if args.configs:
        unknown = [c for c in args.configs if c not in configs]
        if unknown:
            problems.append(
                f"--configs: unknown configuration(s) {', '.join(map(repr, unknown))}; known: {', '.join(configs)}"
            )
        configs = {c: configs[c] for c in args.configs if c in configs}
    problems += option_problems(args)
    if args.recipe is not None:
        recipe = sim.recipe_row(args.recipe, args.overrides, taken=tuple(sim.DEFAULT_CONFIGS))
        problems += recipe.problems
        if recipe.config is not None:
            # Next to the uncorrected loss (when shown), before the built-in configurations.
            first = {k: v for k, v in configs.items() if k == "uncorrected"}
            configs = {**first, recipe.label: recipe.config, **configs}
    if not problems and args.from_file:
        try:
            batches = [sim.load_batch(args.from_file)]
        except sim.BatchFormatError as exc:
            problems.append(str(exc))
    for line in problems:
        print(f"error: {line}", file=sys.stderr)
    if problems:
        return EXIT_INVALID
    if args.from_file:
        source = _from_file_source(args.from_file, batches[0])
    else:
        model = sim.MismatchModel(
            responses=args.responses,
            length=args.length,
            mismatch=args.mismatch,
            outlier_rate=args.outlier_rate,
            staleness=args.staleness,
            seed=args.seed,
        )
        batches = [sim.synthetic_batch(model, step) for step in range(args.steps)]
        source = (
            f"synthetic: {args.responses} responses x {args.steps} steps of {max(1, args.length // 2)}-"
            f"{args.length} tokens, {args.mismatch:g} per-token mismatch, outlier rate "
            f"{args.outlier_rate:g}, staleness {args.staleness:g}, seed {args.seed}"
        )
    print(source)
    if args.recipe is not None:
        for line in recipe.warnings:
            print(f"warning: {line}", file=sys.stderr)
    import warnings

    from nemo_rs_plugin.core.settings.config import ConfigWarning

    with warnings.catch_warnings():  # the recipe's, printed above once; the loss would repeat them
        warnings.simplefilter("ignore", ConfigWarning)
        rows = sim.run(configs, batches, progress=ProgressBar())
    if sim.no_gradient(batches):  # e.g. every group's rewards were equal: one line, not nan in every row
        print(f"note: {sim.NO_GRADIENT}", file=sys.stderr)
        print(sim.format_table(rows, tuple(c for c in sim.COLUMNS if c != "grad_norm_ratio")))
    else:
        print(sim.format_table(rows))
    writers = (
        ("--csv", args.csv, lambda path: sim.write_csv(rows, path)),
        ("--json", args.json, lambda path: sim.write_json(rows, source, path)),
        ("--plot", args.plot, lambda path: sim.write_plot(rows, path)),
    )
    for flag, path, write in writers:
        if not path:
            continue
        try:
            write(path)
        except OSError as exc:  # checked before the run; the disk can still fill up
            print(f"error: {flag} {path}: {exc.strerror or exc}", file=sys.stderr)
            return EXIT_INVALID
    return 0


def add_arguments(s: argparse.ArgumentParser) -> None:
    """``nemo-rs simulate``'s options (its defaults are applied in ``tools/simulate.py``)."""
    s.add_argument(
        "--from",
        dest="from_file",
        metavar="FILE|DIR",
        help="per-token log-probs from a run: a JSONL or torch file, or the folder the loss records into "
        "(its record_dir; docs/cli.md)",
    )
    s.add_argument("--responses", type=int, help="sequences per batch (default 16)")
    s.add_argument("--length", type=int, help="longest response in tokens (default 9000)")
    s.add_argument("--mismatch", type=float, help="per-token log-prob noise std (default 0.02)")
    s.add_argument("--outlier-rate", type=float, help="fraction of MoE-routing outlier tokens (default 0)")
    s.add_argument("--staleness", type=float, help="per-sequence log-ratio shift scale, async (default 0)")
    s.add_argument("--steps", type=int, help="batches to average over (default 4)")
    s.add_argument("--seed", type=int, help="seed of the synthetic batches (default 0)")
    s.add_argument(
        "--configs",
        nargs="+",
        metavar="NAME",
        help=f"subset of the built-in configurations: {', '.join(DEFAULT_CONFIG_NAMES)} (default: all)",
    )
    s.add_argument(
        "--recipe",
        metavar="YAML",
        help="add this recipe's loss_fn as a row, labelled by its file name; Hydra-style overrides "
        "(loss_fn.rejection_sampling.0.upper=1.02) may follow",
    )
    s.set_defaults(overrides=[])
    s.add_argument("--csv", metavar="FILE", help="write the table as CSV")
    s.add_argument(
        "--json", metavar="FILE", help="write the table as strict JSON (non-finite values as the strings NaN, Infinity)"
    )
    s.add_argument("--plot", metavar="FILE.png", help="bar charts; the suffix names the format (needs matplotlib)")
