"""The doctor's output: one line per check (``ok``, ``warn``, ``FAIL``, ``note``), the failures counted.

Written to by the checks of :mod:`~nemo_rs_plugin.tools.doctor_driver` and
:mod:`~nemo_rs_plugin.tools.doctor_workers`; a failure that later checks depend on raises
:class:`StopChecks`, which :func:`~nemo_rs_plugin.tools.doctor.run_checks` catches. Standard
library only at import, as every module ``nemo-rs doctor`` imports.
"""

from __future__ import annotations

from typing import TextIO

__all__ = ["DoctorReport", "StopChecks"]


class StopChecks(Exception):
    """A failed check that later checks depend on."""


class DoctorReport:
    """Prints each check's line to ``out`` as it is made; ``failures``: how many failed."""

    def __init__(self, out: TextIO):
        self.out = out
        self.failures = 0

    def line(self, status: str, check: str, detail: str) -> None:
        if status == "FAIL":
            self.failures += 1
        print(f"{status:<4} {check}: {detail}", file=self.out, flush=True)

    def ok(self, check: str, detail: str) -> None:
        self.line("ok", check, detail)

    def warn(self, check: str, detail: str) -> None:
        self.line("warn", check, detail)

    def fail(self, check: str, detail: str, stop: bool = False) -> None:
        self.line("FAIL", check, detail)
        if stop:
            raise StopChecks
