"""``nemo-rs``: check a recipe's correction, simulate corrections, export recipes.

Subcommands, each a module exposing its ``HELP``, ``add_arguments`` and ``run``:

* ``nemo-rs simulate``: run correction configurations through the real loss on a synthetic
  training/inference mismatch (default: NeMo-RL PR #2269's 9k tokens at 2%) or on
  log-probs saved from a run (``--from``), with a recipe's loss section as a row (``--recipe``);
  prints a table, can write CSV/JSON/PNG.
* ``nemo-rs check RECIPE [overrides]``: validate the loss section, print the pipeline in
  words, warn about legal but likely wrong settings. Exit 2 on errors, one line each; exit 3
  when no error was found but something could not be checked (``not checked:`` lines).
* ``nemo-rs recipes``: list the shipped recipes, or copy them next to a NeMo-RL checkout.
* ``nemo-rs reference``: print the configuration reference (docs/configuration-reference.md).
* ``nemo-rs lab``: the GRPO experiment of docs/lab.md (its own flags).
* ``nemo-rs doctor``: prove the plugin is active where NeMo-RL runs.
* ``nemo-rs calibrate --from FILE``: rejection bounds from a run's log-probs for a target
  rejection rate (docs/guide.md, "Setting the band from your mismatch").

This module is the program, above every layer (``tools`` and ``lab``): only the console
script and ``python -m nemo_rs_plugin.cli`` import it. Every command's module is light at
import (torch, NeMo-RL and the lab's libraries load when the command runs), so ``--help``
and a mistyped flag answer at once.
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
from typing import Optional, Sequence

from nemo_rs_plugin import lab
from nemo_rs_plugin.tools import calibrate, check_command, doctor, recipes, reference_command, simulate_command
from nemo_rs_plugin.tools.report import EXIT_INTERRUPTED, EXIT_INVALID, EXIT_UNCHECKED, interrupted
from nemo_rs_plugin.tools.simulate_command import DEFAULT_CONFIG_NAMES

__all__ = [
    "main",
    "build_parser",
    "COMMANDS",
    "DEFAULT_CONFIG_NAMES",
    "EXIT_INVALID",
    "EXIT_UNCHECKED",
    "EXIT_INTERRUPTED",
    "interrupted",
]

#: ``nemo-rs``'s subcommands, in ``--help``'s order: the module of each (``HELP``,
#: ``add_arguments``, ``run``; the lab's ``HELP`` only, its flags are its own).
COMMANDS = {
    "simulate": simulate_command,
    "check": check_command,
    "recipes": recipes,
    "reference": reference_command,
    "lab": lab,
    "doctor": doctor,
    "calibrate": calibrate,
}


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
    """The ``nemo-rs`` parser: one subcommand per entry of :data:`COMMANDS`."""
    parser = argparse.ArgumentParser(prog="nemo-rs", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--version", action=_VersionAction, help="the plugin's version (and its commit, installed from a checkout)"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, command in COMMANDS.items():
        if command is lab:  # the lab parses its own flags (docs/lab.md): listed here, run by main()
            sub.add_parser(name, help=command.HELP, add_help=False)
            continue
        s = sub.add_parser(name, help=command.HELP)
        command.add_arguments(s)
        s.set_defaults(func=command.run)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``nemo-rs`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["lab"]:  # the lab parses its own flags (docs/lab.md); it handles Ctrl-C itself
        from nemo_rs_plugin.lab import cli as lab

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
