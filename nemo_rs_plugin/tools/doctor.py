"""``python -m nemo_rs_plugin.tools.doctor [RECIPE] [--nemo-rl PATH]``: prove the plugin is active where NeMo-RL runs.

Run it the way training runs, from NeMo-RL's checkout (``uv run python -m
nemo_rs_plugin.tools.doctor my-recipe.yaml``). In this interpreter, the driver, it checks that:

* the start-up hook ran here and is not switched off (``NEMO_RS_PLUGIN_DISABLE``);
* NeMo-RL is importable and its loss API supported;
* after importing ``nemo_rl.algorithms.grpo`` (and ``ppo``, and the single-controller setup
  where they exist) the name ``ClippedPGLossFn`` there is the plugin's selector, and the
  module calls it; NeMo-RL's own class refuses configs naming a plugin loss; ``load_config``
  is patched;
* a loss built through GRPO's ``ClippedPGLossFn`` from RECIPE's ``loss_fn`` (loaded with
  NeMo-RL's ``load_config``), or from ``name: rs_clipped_pg``, is the plugin's class;
* the plugin is a dependency of NeMo-RL's project (a ``uv pip install`` is undone by the next
  ``uv sync``);
* the worker-path link is in place; then every worker virtual environment NeMo-RL has built
  (``$NEMO_RL_VENV_DIR``, else ``venvs/`` in the checkout) unpickles that loss, started with
  the environment the driver hands its Ray workers.

RECIPE is read first, before NeMo-RL is imported: a missing file, or ``defaults`` that do not
resolve (relative to the file naming them, as NeMo-RL resolves them), is one failed check
naming the file, and no other check runs.

One line per check; exit status 0 when none fails, 1 otherwise.

This module is the command and the order of the checks; the checks in the driver are
:mod:`~nemo_rs_plugin.tools.doctor_driver`'s, those of the worker side
:mod:`~nemo_rs_plugin.tools.doctor_workers`'s, the lines they print
:mod:`~nemo_rs_plugin.tools.doctor_report`'s. ``nemo-rs`` imports this module to build its
parser: it and every module it imports are standard library only at import.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence, TextIO

from nemo_rs_plugin.core.settings.presets import PLUGIN_LOSS_NAME as PLUGIN_NAME  # standard library only
from nemo_rs_plugin.tools import doctor_driver, doctor_workers  # standard library only
from nemo_rs_plugin.tools.doctor_report import DoctorReport, StopChecks  # standard library only

__all__ = ["HELP", "add_arguments", "main", "run", "run_checks"]

HELP = "prove the plugin is active where NeMo-RL runs (driver and worker venvs)"


def run_checks(
    recipe: Optional[str] = None,
    venvs: Optional[str] = None,
    workers: bool = True,
    out: Optional[TextIO] = None,
    nemo_rl_path: Optional[str] = None,
) -> int:
    """Run every check, printing one line each (to ``out``, else the current ``sys.stdout``).

    ``nemo_rl_path``: a NeMo-RL checkout to import NeMo-RL from (``--nemo-rl``, as ``nemo-rs check``'s).
    Returns the number of failed checks.
    """
    report = DoctorReport(out if out is not None else sys.stdout)
    if venvs is not None and not workers:
        report.warn("workers", f"--venvs {venvs} does nothing with --no-workers (the worker check is skipped)")
    elif venvs is not None and not os.path.isdir(venvs):
        # Named up front: the worker check that reads it runs only once NeMo-RL is found. It is
        # then skipped: its "no worker venvs there yet" warning would repeat this failure.
        report.fail("workers", f"--venvs {venvs}: no such directory (NeMo-RL's worker venvs, e.g. <NeMo-RL>/venvs)")
        workers = False
    recipe_loads = True
    try:
        if recipe:
            recipe_loads = False
            doctor_driver.check_recipe_files(report, recipe)
            recipe_loads = True
        hook = doctor_driver.check_hook(report)
        if nemo_rl_path:
            doctor_driver.use_checkout(report, nemo_rl_path)
        nemo_rl = doctor_driver.check_nemo_rl(report)
        grpo = doctor_driver.check_selectors(report, hook)
        loss = doctor_driver.check_loss(report, grpo, hook, recipe)
        doctor_driver.check_install(report, nemo_rl)
        if doctor_workers.check_worker_path(report, hook) is not None and workers:
            doctor_workers.check_worker_venvs(report, nemo_rl, loss, venvs)
    except StopChecks:
        pass
    if not recipe_loads:
        # Nothing about the plugin was checked: say so rather than that it is inactive.
        print(f"{report.failures} check(s) failed: the recipe does not load; fix it and run the doctor again", file=out)
    elif report.failures:
        print(
            f"{report.failures} check(s) failed: a recipe naming {PLUGIN_NAME} will not train "
            "with the plugin's loss here",
            file=out,
        )
    else:
        print(f"nemo-rs-plugin is active: loss_fn.name: {PLUGIN_NAME} builds the plugin's loss", file=out)
    return report.failures


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The doctor's options, for ``nemo-rs doctor`` and ``python -m nemo_rs_plugin.tools.doctor``."""
    parser.add_argument("recipe", nargs="?", help="a recipe to load with NeMo-RL's load_config and build")
    parser.add_argument(
        "--nemo-rl",
        metavar="PATH",
        help="NeMo-RL checkout to import NeMo-RL from (as nemo-rs check --nemo-rl); default: the importable one",
    )
    parser.add_argument(
        "--venvs",
        metavar="DIR",
        help="worker virtual environments (default: $NEMO_RL_VENV_DIR, else venvs/ in NeMo-RL)",
    )
    parser.add_argument(
        "--no-workers", dest="workers", action="store_false", help="skip the worker virtual environments"
    )


def run(args: argparse.Namespace) -> int:
    """Run the checks for parsed ``args``; the exit status (0: active, 1: not)."""
    return 1 if run_checks(args.recipe, args.venvs, args.workers, nemo_rl_path=args.nemo_rl) else 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``python -m nemo_rs_plugin.tools.doctor``."""
    parser = argparse.ArgumentParser(prog="python -m nemo_rs_plugin.tools.doctor", description=HELP)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
