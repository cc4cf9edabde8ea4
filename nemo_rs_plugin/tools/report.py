"""What the tools' reports share: tables, CSV and strict JSON files, a progress bar, matplotlib.

``nemo-rs simulate`` and ``nemo-rs lab`` both print a table, write CSV, draw figures and
show progress; the one way of doing each lives here, the columns and panels with each tool.
"""

from __future__ import annotations

import csv
import json
import math
import os
import sys
import time
from typing import Any, Iterable, Optional, Sequence, TextIO

__all__ = [
    "ProgressBar",
    "fixed_width_table",
    "markdown_table",
    "output_problems",
    "pyplot",
    "same_file",
    "write_csv",
    "write_strict_json",
]


def fixed_width_table(
    rows: Iterable[dict[str, Any]], label: str, columns: Sequence[str], label_width: int, width: int, spec: str
) -> list[str]:
    """Header, rule and one line per row: ``row[label]`` left-aligned, ``columns`` right-aligned in ``spec``."""
    head = f"{label:<{label_width}}" + "".join(f"{c:>{width}}" for c in columns)
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r[label]:<{label_width}}" + "".join(f"{r[c]:>{width}{spec}}" for c in columns))
    return lines


def markdown_table(header: Sequence[str], body: Iterable[Sequence[str]]) -> str:
    """A Markdown table of already formatted cells (``|`` inside a cell escaped by the caller)."""

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(cells) + " |"

    return "\n".join([line(header), line(["---"] * len(header)), *(line(cells) for cells in body)])


def write_csv(
    rows: Iterable[dict[str, Any]], path: str, fields: Sequence[str], float_digits: Optional[int] = None
) -> None:
    """``rows`` as CSV under the header ``fields``.

    With ``float_digits``, floats are written to that many significant digits; without, each
    value as Python prints it (non-finite ones as ``nan`` / ``inf``), and a row holding a key
    outside ``fields`` is an error.
    """
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(fields))
        writer.writeheader()
        for r in rows:
            if float_digits is None:
                writer.writerow(r)
            else:
                writer.writerow({k: (f"{v:.{float_digits}g}" if isinstance(v, float) else v) for k, v in r.items()})


def _strict_json_value(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return "NaN" if math.isnan(v) else ("Infinity" if v > 0 else "-Infinity")
    return v


def write_strict_json(data: dict[str, Any], rows_key: str, path: str) -> None:
    """``data`` in strict JSON (RFC 8259 has no NaN or Infinity), indented, newline-terminated.

    In the rows under ``data[rows_key]``, a non-finite value is written as the string
    ``"NaN"``, ``"Infinity"`` or ``"-Infinity"``, which Python's ``float()`` and
    JavaScript's ``Number()`` both read back.
    """
    rows = [{k: _strict_json_value(v) for k, v in r.items()} for r in data[rows_key]]
    with open(path, "w") as fh:
        json.dump({**data, rows_key: rows}, fh, indent=2, allow_nan=False)
        fh.write("\n")


def output_problems(flag: str, path: str) -> list[str]:
    """Why ``path`` cannot be written (``[]`` if it can), checked before a run.

    The path is probed, not judged by its permission bits: for root ``os.access`` says yes to
    ``/proc/version`` or a read-only file, and the write would fail only after the run.
    """
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        return [f"{flag} {path}: is a directory"]
    if not os.path.isdir(parent):
        return [f"{flag} {path}: directory {parent} does not exist"]
    if not os.access(parent, os.W_OK):
        return [f"{flag} {path}: directory {parent} is not writable"]
    why = _write_probe(path)
    if why is not None:
        return [f"{flag} {path}: cannot be written ({why}); name a file you can write"]
    return []


def same_file(a: str, b: str) -> bool:
    """Whether paths ``a`` and ``b`` name one file: the same path, or a symbolic or hard link to it."""
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist (yet): two names of a file to be created differ by path
        return False


def _write_probe(path: str) -> Optional[str]:
    """``None`` if ``path`` takes a write, else why not; leaves an existing file as it was.

    An existing file is opened for appending (nothing truncated; non-blocking, so a FIFO
    without a reader fails instead of hanging) and written zero bytes, which pseudo-files
    such as ``/proc/version`` refuse. A new file is created and removed again.
    """
    exists = os.path.exists(path)
    flags = os.O_WRONLY | (os.O_APPEND | os.O_NONBLOCK if exists else os.O_CREAT | os.O_EXCL)
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as exc:
        return exc.strerror or str(exc)
    try:
        os.write(fd, b"")
    except OSError as exc:
        return exc.strerror or str(exc)
    finally:
        os.close(fd)
        if not exists:
            try:
                os.remove(path)
            except OSError:
                pass  # the run writes it anyway
    return None


def pyplot(missing: str = "matplotlib is not installed") -> Any:
    """``matplotlib.pyplot`` on the file-only Agg backend.

    Raises:
        ImportError: with the message ``missing`` when matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError(missing) from exc
    return plt


class ProgressBar:
    """A progress callback ``(done, total)``: a one-line bar redrawn on a terminal.

    With ``eta``, the bar is followed by the elapsed time and an estimate of the time left,
    and where the stream is not a terminal (a log file) that line is written once per 5%;
    without, nothing is written there. ``stream`` defaults to the ``sys.stderr`` of each
    call, not the one at construction. A new run (``done <= 1``) restarts the clock.
    """

    WIDTH = 30

    def __init__(self, eta: bool = False, stream: Optional[TextIO] = None, unit: str = "steps") -> None:
        self.eta = eta
        self.stream = stream
        self.unit = unit
        self._t0: Optional[float] = None
        self._last_twentieth = -1

    def __call__(self, done: int, total: int) -> None:
        """Show that ``done`` of ``total`` are done."""
        stream = self.stream if self.stream is not None else sys.stderr
        if not self.eta:
            if stream.isatty():
                self._draw(stream, done, total, f"{done}/{total}")
            return
        if self._t0 is None or done <= 1:
            self._t0, self._last_twentieth = time.perf_counter(), -1
        elapsed = time.perf_counter() - self._t0
        left = elapsed / max(done, 1) * (total - done)
        msg = f"{done}/{total} {self.unit}  {elapsed:5.0f}s elapsed, ~{left:4.0f}s left"
        if stream.isatty():
            self._draw(stream, done, total, msg)
            return
        twentieth = int(20 * done / max(total, 1))
        if twentieth == self._last_twentieth:
            return
        self._last_twentieth = twentieth
        stream.write(msg + "\n")
        stream.flush()

    def _draw(self, stream: TextIO, done: int, total: int, msg: str) -> None:
        filled = int(self.WIDTH * done / max(total, 1))
        stream.write(f"\r[{'#' * filled}{'.' * (self.WIDTH - filled)}] {msg}")
        if done == total:
            stream.write("\n")
        stream.flush()


EXIT_INVALID = 2  # bad input: one ``error:`` line each (every ``nemo-rs`` command)
EXIT_UNCHECKED = 3  # check: no errors found, but part of the recipe could not be checked
#: The shell's exit status after Ctrl-C (128 + SIGINT).
EXIT_INTERRUPTED = 130


def interrupted() -> int:
    """Ctrl-C: one line on stderr instead of a traceback, and the shell's status for it."""
    # After a progress bar redrawn in place, start a line of its own.
    print("\ninterrupted" if sys.stderr.isatty() else "interrupted", file=sys.stderr)
    return EXIT_INTERRUPTED


def git_commit(root: str) -> Optional[str]:
    """``<sha>[-dirty]`` (12 hex digits) of the git checkout whose top folder is ``root``, or ``None``.

    For a package run from its checkout: its version alone does not say which code runs (NeMo-RL
    main's ``package_info`` says 0.6.0). Only ``root`` itself counts (it holds ``.git``): a
    package installed into a virtual environment inside some other repository is not that
    repository's code. ``None`` otherwise, or where git is absent.
    """
    import subprocess

    if not os.path.exists(os.path.join(root, ".git")):
        return None
    try:
        out = subprocess.run(
            ["git", "-C", root, "describe", "--always", "--dirty", "--abbrev=12", "--exclude", "*"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    commit = out.stdout.strip()
    return commit if out.returncode == 0 and commit else None
