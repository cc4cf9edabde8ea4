"""``nemo-rs reference``: its help, its options and the command's body.

Light at import: the reference itself (:mod:`nemo_rs_plugin.tools.reference`, which reads the
configuration's pydantic model and so imports torch) loads in :func:`run`.
"""

from __future__ import annotations

import argparse
import sys

HELP = "print the configuration reference (Markdown)"


def add_arguments(f: argparse.ArgumentParser) -> None:
    """``nemo-rs reference``'s options."""
    which = f.add_mutually_exclusive_group()
    which.add_argument("--metrics", action="store_true", help="print the guide's table of the metrics the plugin adds")
    which.add_argument("--statistics", action="store_true", help="print the guide's table of the filter statistics")


def run(args: argparse.Namespace) -> int:
    """Print the configuration reference, or one of the guide's tables."""
    from nemo_rs_plugin.tools.reference import render_metrics_table, render_reference, render_statistics_table

    if args.metrics:
        sys.stdout.write(render_metrics_table() + "\n")
    elif args.statistics:
        sys.stdout.write(render_statistics_table() + "\n")
    else:
        sys.stdout.write(render_reference())
    return 0
