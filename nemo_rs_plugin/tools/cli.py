"""``nemo-rs``: check a recipe's correction, simulate corrections, export recipes.

Subcommands:

* ``nemo-rs simulate``: run correction configurations through the real loss on a synthetic
  training/inference mismatch (default: NeMo-RL PR #2269's 9k tokens at 2%) or on
  log-probs saved from a run (``--from``), with a recipe's loss section as a row (``--recipe``);
  prints a table, can write CSV/JSON/PNG.
* ``nemo-rs check RECIPE [overrides]``: validate the loss section, print the pipeline in
  words, warn about legal but likely wrong settings. Exit 2 on errors, one line each; exit 3
  when no error was found but something could not be checked (``not checked:`` lines).
* ``nemo-rs recipes``: list the shipped recipes, or copy them next to a NeMo-RL checkout.
* ``nemo-rs reference``: print the configuration reference (docs/configuration-reference.md).
* ``nemo-rs calibrate --from FILE``: rejection bounds from a run's log-probs for a target
  rejection rate (docs/guide.md, "Setting the band from your mismatch").
"""

from __future__ import annotations

import argparse
import errno
import math
import os
import sys
from typing import Any, Optional, Sequence

from nemo_rs_plugin.tools.report import EXIT_INTERRUPTED, interrupted

__all__ = ["main", "EXIT_INVALID", "EXIT_UNCHECKED", "EXIT_INTERRUPTED", "interrupted"]

EXIT_INVALID = 2  # bad input: one ``error:`` line each
EXIT_UNCHECKED = 3  # check: no errors found, but part of the recipe could not be checked


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
    if nonfinite:  # null or NaN in the file: the loss zeroes those tokens (docs/guide.md#non-finite-inputs)
        source += f", {nonfinite} valid token(s) with a non-finite log-prob (null/NaN), left out of the loss"
    return source


def _simulate_problems(args: argparse.Namespace) -> list[str]:
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


def _cmd_simulate(args: argparse.Namespace) -> int:
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
    problems += _simulate_problems(args)
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

    from nemo_rs_plugin.core.config import ConfigWarning

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


#: ``nemo-rs check``'s exit codes: (``result`` in ``--json``, meaning).
CHECK_EXIT_CODES = {
    0: ("valid", "every check ran, nothing wrong"),
    EXIT_INVALID: ("invalid", "see errors, one per problem"),
    EXIT_UNCHECKED: ("not_fully_checked", "no error found, but see unchecked: what was not checked, why, how to"),
}


def _how_to_check(unchecked: Sequence[str]) -> Optional[str]:
    """The remedy for the 'not checked' lines that need NeMo-RL's environment, said once (or ``None``)."""
    from nemo_rs_plugin.tools.recipe_loading import HOW_TO_CHECK, HOW_TO_CHECK_IN_NEMO_RL

    return HOW_TO_CHECK_IN_NEMO_RL if any(HOW_TO_CHECK in line for line in unchecked) else None


def _check_json(recipe: str, code: int, report: Any = None, errors: Sequence[str] = ()) -> None:
    """``nemo-rs check --json``: one JSON object on stdout (docs/cli.md#nemo-rs-check-recipe-overrides)."""
    import json

    print(
        json.dumps(
            {
                "recipe": recipe,
                "exit_code": code,
                "result": CHECK_EXIT_CODES[code][0],
                "exit_codes": {str(k): f"{result}: {meaning}" for k, (result, meaning) in CHECK_EXIT_CODES.items()},
                "errors": list(report.errors if report is not None else errors),
                "unchecked": list(report.unchecked if report is not None else ()),
                "how_to_check": _how_to_check(report.unchecked if report is not None else ()),
                "warnings": list(report.warnings if report is not None else ()),
                "notes": list(report.notes if report is not None else ()),
                "pipeline": list(report.pipeline if report is not None else ()),
                "nemo_rl": bool(report is not None and report.nemo_rl),
                "nemo_rl_versions": list(report.nemo_rl_versions if report is not None else ()),
            },
            indent=2,
        )
    )


def _cmd_check(args: argparse.Namespace) -> int:
    from nemo_rs_plugin.tools import simulate as sim
    from nemo_rs_plugin.tools.check import check_recipe

    problems = []
    if not math.isfinite(args.mismatch) or args.mismatch < 0:
        problems.append(f"--mismatch: got {args.mismatch}; allowed: a finite number >= 0")
    if args.response_tokens is not None and not 1 <= args.response_tokens <= sim.MAX_SYNTHETIC_TOKENS // 16:
        problems.append(
            f"--response-tokens: got {args.response_tokens}; allowed: 1 to {sim.MAX_SYNTHETIC_TOKENS // 16} "
            "(the rejection estimate simulates 16 responses of that length)"
        )
    if problems and args.json:
        _check_json(args.recipe, EXIT_INVALID, errors=problems)
        return EXIT_INVALID
    for line in problems:
        print(f"error: {line}", file=sys.stderr)
    if problems:
        return EXIT_INVALID
    import contextlib
    import warnings

    from nemo_rs_plugin.core.config import ConfigWarning

    # With --json, stdout is the JSON object alone: anything NeMo-RL prints while loading goes to stderr.
    quiet = contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext()
    from nemo_rs_plugin.tools.doctor import worker_links_now, wrote_worker_links

    links = worker_links_now()
    with warnings.catch_warnings(record=True) as caught, quiet:
        warnings.simplefilter("always", ConfigWarning)
        report = check_recipe(args.recipe, args.overrides, args.nemo_rl, args.mismatch, args.response_tokens)
    # Importing NeMo-RL's GRPO module activates the plugin, which links itself for the Ray workers.
    wrote = wrote_worker_links(links)
    if wrote is not None:
        report.notes.append(wrote)
    # The config's own warnings (settings that do nothing), once each, before check's.
    said = [str(w.message) for w in caught if issubclass(w.category, ConfigWarning)]
    report.warnings[:0] = [line for i, line in enumerate(said) if line not in said[:i]]
    for w in caught:  # anything else is shown as Python would have
        if not issubclass(w.category, ConfigWarning):
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    code = EXIT_INVALID if report.errors else EXIT_UNCHECKED if report.unchecked else 0
    if args.json:
        _check_json(args.recipe, code, report)
        return code
    for line in report.errors:
        print(f"error: {line}", file=sys.stderr)
    if report.errors and wrote is not None:  # the notes below are not printed then
        print(f"note: {wrote}", file=sys.stderr)
    for line in report.unchecked:
        print(f"not checked: {line}", file=sys.stderr)
    remedy = _how_to_check(report.unchecked)
    if remedy is not None:  # said once, not per line
        print(remedy, file=sys.stderr)
    if report.errors:
        return EXIT_INVALID
    if report.unchecked:
        print(
            f"{args.recipe}: no errors found, but not fully checked (the 'not checked' lines on stderr "
            "say what, why and how to check it)"
        )
    else:
        print(f"{args.recipe}: valid")
    for note in report.notes:
        print(f"note: {note}")
    if report.pipeline:  # none when the loss section itself could not be read (not checked)
        print("correction pipeline:")
        for line in report.pipeline:
            print(f"  {line}")
    for warning in report.warnings:
        print(f"warning: {warning}")
    return code


def _note_unresolved_defaults(paths: list, nemo_rl: Optional[str]) -> None:
    """Say so when the exported recipes' ``defaults`` do not resolve where they were written."""
    import yaml

    from nemo_rs_plugin.nemo_rl.recipe_defaults import parent_paths

    parents = set()
    for path in paths:
        with open(path) as fh:
            parents.update(os.path.normpath(p) for p in parent_paths(str(path), yaml.safe_load(fh)))
    missing = sorted(p for p in parents if not os.path.isfile(p))
    if missing:
        hint = "" if nemo_rl else "; pass --nemo-rl PATH (your NeMo-RL checkout) to point them there"
        print(
            f"note: the exported recipes' defaults ({', '.join(missing)}) do not exist there{hint}, or export into "
            "<NeMo-RL>/examples/configs/recipes/llm",
            file=sys.stderr,
        )


def _cmd_recipes(args: argparse.Namespace) -> int:
    from nemo_rs_plugin.tools.recipes import export_problems, export_recipes, list_recipes, recipe_description

    if args.out == "":
        print("error: --out: got an empty path; name a directory", file=sys.stderr)
        return EXIT_INVALID
    if args.force and not args.out:
        print("error: --force: without --out it has nothing to overwrite; add --out DIR", file=sys.stderr)
        return EXIT_INVALID
    if args.nemo_rl and not args.out:
        print(
            f"error: --nemo-rl: got {args.nemo_rl} without --out; it rewrites exported recipes: "
            "add --out DIR (or drop --nemo-rl to list the recipes)",
            file=sys.stderr,
        )
        return EXIT_INVALID
    if args.out:
        problems = export_problems(args.out, args.nemo_rl, args.force)
        for line in problems:
            print(f"error: {line}", file=sys.stderr)
        if problems:
            return EXIT_INVALID
        try:
            paths = export_recipes(args.out, args.nemo_rl)
        except OSError as exc:  # checked above; what remains is e.g. a full disk
            print(f"error: --out: {exc.filename or args.out}: {exc.strerror or exc}", file=sys.stderr)
            return EXIT_INVALID
        for path in paths:
            print(path)
        _note_unresolved_defaults(paths, args.nemo_rl)
        return 0
    for path in list_recipes():  # the path, then the recipe's own first line (a shell comment)
        description = recipe_description(path)
        print(f"{path}  # {description}" if description else path)
    return 0


def _cmd_reference(args: argparse.Namespace) -> int:
    from nemo_rs_plugin.tools.reference import render_metrics_table, render_reference, render_statistics_table

    if args.metrics:
        sys.stdout.write(render_metrics_table() + "\n")
    elif args.statistics:
        sys.stdout.write(render_statistics_table() + "\n")
    else:
        sys.stdout.write(render_reference())
    return 0


def _add_simulate_arguments(s: argparse.ArgumentParser) -> None:
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


def version_line() -> str:
    """``nemo-rs-plugin X.Y.Z``, and ``(commit <sha>[-dirty], <checkout>)`` when the package is a git checkout's.

    Installed from a checkout (``pip install -e .``) the version alone does not say which code
    runs; the commit does. From a wheel there is no checkout, and only the version is printed.
    """
    import nemo_rs_plugin  # the package itself, not a layer: its __init__ imports nothing
    from nemo_rs_plugin.tools.report import git_commit

    line = f"nemo-rs-plugin {nemo_rs_plugin.__version__}"
    root = os.path.dirname(os.path.dirname(os.path.abspath(nemo_rs_plugin.__file__)))
    commit = git_commit(root)
    return f"{line} (commit {commit}, {root})" if commit else line


class _VersionAction(argparse.Action):
    """``--version``: :func:`version_line`, computed only when asked (git runs then, not per command)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_line())
        parser.exit()


def build_parser() -> argparse.ArgumentParser:

    parser = argparse.ArgumentParser(prog="nemo-rs", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--version", action=_VersionAction, help="the plugin's version (and its commit, installed from a checkout)"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    s = sub.add_parser("simulate", help="run corrections through the real loss on a mismatch")
    _add_simulate_arguments(s)
    s.set_defaults(func=_cmd_simulate)

    c = sub.add_parser("check", help="validate a recipe's loss_fn and explain it")
    c.add_argument("recipe")
    # default=[]: optional (argparse would otherwise list it as required when RECIPE is missing)
    c.add_argument("overrides", nargs="*", default=[], help="Hydra-style overrides, e.g. loss_fn.ratio_clip_max=0.28")
    c.add_argument("--nemo-rl", metavar="PATH", help="NeMo-RL checkout, to load the recipe with its loader")
    c.add_argument(
        "--mismatch",
        type=float,
        default=0.02,
        help="per-token mismatch you see (std of prev - gen), for the rejection estimate",
    )
    c.add_argument("--response-tokens", type=int, help="typical response length (default: from the recipe)")
    c.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object (errors, unchecked, warnings, notes, exit code and its meaning) instead of text",
    )
    c.set_defaults(func=_cmd_check)

    r = sub.add_parser("recipes", help="list the shipped recipes, or export them")
    r.add_argument("--out", metavar="DIR", help="copy the recipes into DIR")
    r.add_argument("--nemo-rl", metavar="PATH", help="rewrite their defaults to this NeMo-RL checkout (with --out)")
    r.add_argument("--force", action="store_true", help="overwrite exported recipes that differ (e.g. edited) in DIR")
    r.set_defaults(func=_cmd_recipes)

    f = sub.add_parser("reference", help="print the configuration reference (Markdown)")
    which = f.add_mutually_exclusive_group()
    which.add_argument("--metrics", action="store_true", help="print the guide's table of the metrics the plugin adds")
    which.add_argument("--statistics", action="store_true", help="print the guide's table of the filter statistics")
    f.set_defaults(func=_cmd_reference)

    sub.add_parser("lab", help="GRPO on a tiny MoE with a real sampler/trainer mismatch (docs/lab.md)", add_help=False)

    from nemo_rs_plugin.tools import doctor  # standard library only at import

    d = sub.add_parser("doctor", help=doctor.HELP)
    doctor.add_arguments(d)
    d.set_defaults(func=doctor.run)

    from nemo_rs_plugin.tools import calibrate  # light at import; torch is imported in run()

    k = sub.add_parser("calibrate", help=calibrate.HELP)
    calibrate.add_arguments(k)
    k.set_defaults(func=calibrate.run)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``nemo-rs`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["lab"]:  # the lab parses its own flags (docs/lab.md); it handles Ctrl-C itself
        from nemo_rs_plugin.tools import lab

        return lab.main(argv[1:])
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # Hydra-style overrides may come after options (check RECIPE --nemo-rl X a.b=1). Where the
    # command takes them, any word without a dash is one (`key` alone gets the loader's own
    # "expected key=value" line, wherever it stands). An option spelt with '=' (--loss_fn.x=1,
    # --foo=bar) is not an override: refused, not ignored.
    takes_overrides = args.command == "check" or (
        args.command in ("simulate", "calibrate") and getattr(args, "recipe", None) is not None
    )
    if takes_overrides:
        overrides = [a for a in extra if not a.startswith("-")]
    else:
        overrides = [a for a in extra if ("=" in a or a.startswith("~")) and not a.startswith("-")]
    unknown = [a for a in extra if a not in overrides]
    if any(a.startswith("-") and "=" in a for a in unknown):
        parser.error(
            f"unrecognized arguments: {' '.join(unknown)} (Hydra-style overrides are written without dashes: "
            "loss_fn.ratio_clip_max=0.28)"
        )
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if overrides and not takes_overrides:
        hint = " (overrides apply to a recipe: add --recipe FILE)" if args.command in ("simulate", "calibrate") else ""
        parser.error(f"unrecognized arguments: {' '.join(overrides)}{hint}")
    if overrides:
        args.overrides = list(args.overrides) + overrides
    try:
        status = int(args.func(args) or 0)
        sys.stdout.flush()  # a full disk or a closed pipe shows here, not as a traceback at exit
    except KeyboardInterrupt:
        return interrupted()
    except OSError as exc:
        # The commands report their own files; what reaches here without a file name and with
        # a full disk or a closed pipe is the output stream. Anything else is not ours to word.
        if exc.filename is not None or exc.errno not in (errno.ENOSPC, errno.EPIPE):
            raise
        print(f"error: cannot write the output: {exc.strerror or exc}", file=sys.stderr)
        sys.stdout = open(os.devnull, "w")  # nothing more to flush at exit
        return 1
    return status


if __name__ == "__main__":
    sys.exit(main())
