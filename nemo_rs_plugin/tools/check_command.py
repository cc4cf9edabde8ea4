"""``nemo-rs check RECIPE [overrides]``: its help, its options, its exit codes and the command's body.

The checks themselves are :mod:`nemo_rs_plugin.tools.check`; this module prints their report
(text, or one JSON object with ``--json``) and turns it into the exit code: 2 on errors, one
line each; 3 when no error was found but something could not be checked (``not checked:``).
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any, Optional, Sequence

from nemo_rs_plugin.tools.report import EXIT_INVALID, EXIT_UNCHECKED

HELP = "validate a recipe's loss_fn and explain it"


def add_arguments(c: argparse.ArgumentParser) -> None:
    """``nemo-rs check``'s arguments."""
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


def run(args: argparse.Namespace) -> int:
    """Check the recipe; print the report as text or one JSON object; return its exit code."""
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

    from nemo_rs_plugin.core.settings.config import ConfigWarning

    # With --json, stdout is the JSON object alone: anything NeMo-RL prints while loading goes to stderr.
    quiet = contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext()
    from nemo_rs_plugin.tools.doctor_workers import worker_links_now, wrote_worker_links

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
