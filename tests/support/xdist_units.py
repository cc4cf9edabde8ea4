"""How the suite is split between pytest-xdist's workers: one work unit per test file and NeMo-RL checkout.

Many test files compute one world (a multi-process run of every case, or one interpreter running
every case against a NeMo-RL checkout) per module or per checkout and share it between their tests
through a module-level cache. That cache lives in one worker process: a test of the same world run
in another worker computes the world again. So every test of one file runs in one worker, split
by checkout where the test takes a ``host`` (the three checkouts' worlds of one file then run side
by side).

The controller decides this from the node id, here, and not from ``xdist_group`` marks: pytest-xdist
carries a mark's group to the controller as a suffix its worker hook writes into the node id, and
from pytest 9.2 on that write no longer takes (pytest-dev/pytest-xdist#1386): every test was
scheduled on its own, and the packing world, for one, was computed by each of its three tests
(52 s each per checkout in a full run). ``tests/structure/test_xdist_units.py`` runs a small suite
under two workers to hold this.

Used by ``tests/conftest.py`` for ``--dist loadgroup`` (pyproject's ``addopts``); any other
``--dist`` is xdist's own.
"""

from __future__ import annotations

from typing import Iterable

from xdist.scheduler import LoadScopeScheduling

from tests.support.nemo_rl_hosts import host_label, nemo_rl_hosts


def work_unit(nodeid: str, host_labels: Iterable[str]) -> str:
    """``path`` of the test's file, plus ``@<label>`` when a parameter id is a NeMo-RL checkout's label.

    ``tests/nemo_rl/test_packing.py::test_x[v0.7.0]`` -> ``tests/nemo_rl/test_packing.py@v0.7.0``;
    a parameter id joins its parameters' ids with ``-`` (``test_y[main-2]``: host ``main``, 2 ranks).
    """
    path, _, rest = nodeid.partition("::")
    labels = set(host_labels)
    if rest.endswith("]") and "[" in rest:
        params = rest[rest.index("[") + 1 : -1]
        # A label may itself hold "-" (a checkout folder's name): match whole labels first.
        for label in sorted(labels, key=len, reverse=True):
            if (
                params == label
                or params.startswith(label + "-")
                or params.endswith("-" + label)
                or f"-{label}-" in params
            ):
                return f"{path}@{label}"
    return path


class FileAndCheckoutScheduling(LoadScopeScheduling):
    """xdist's scope scheduling with :func:`work_unit` as the scope."""

    def __init__(self, config, log=None) -> None:
        super().__init__(config, log)
        self._host_labels = [host_label(h) for h in nemo_rl_hosts()]

    def _split_scope(self, nodeid: str) -> str:
        return work_unit(nodeid, self._host_labels)


def make_scheduler(config, log):
    """The scheduler for ``--dist loadgroup``; ``None`` (xdist's own) for any other mode."""
    if config.getvalue("dist") != "loadgroup":
        return None
    return FileAndCheckoutScheduling(config, log)
