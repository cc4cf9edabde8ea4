"""The suite's tests sharing a world run in one xdist worker (``tests/support/xdist_units.py``).

A world cached in a module is computed once per worker that runs one of its tests: split between
workers, the same NeMo-RL world is computed twice or three times (what pytest 9.2 did to xdist's own
``loadgroup``, pytest-dev/pytest-xdist#1386). Here a small suite of two files, two checkouts each,
runs under two workers with this suite's scheduler, each test writing the worker it ran in.
"""

from __future__ import annotations

import collections
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.support.xdist_units import work_unit

REPO = Path(__file__).resolve().parents[2]
LABELS = ["v0.6.0", "v0.7.0", "main"]


@pytest.mark.parametrize(
    "nodeid, unit",
    [
        ("tests/core/test_masking.py::test_valid", "tests/core/test_masking.py"),
        ("tests/core/test_masking.py::test_valid[token-sum]", "tests/core/test_masking.py"),
        ("tests/nemo_rl/test_packing.py::test_packed[v0.7.0]", "tests/nemo_rl/test_packing.py@v0.7.0"),
        ("tests/nemo_rl/test_training_step.py::test_split[main-2]", "tests/nemo_rl/test_training_step.py@main"),
        ("tests/nemo_rl/test_training_step.py::test_split[2-v0.6.0]", "tests/nemo_rl/test_training_step.py@v0.6.0"),
        ("tests/nemo_rl/test_x.py::test_y[a-main-b]", "tests/nemo_rl/test_x.py@main"),
        ("tests/nemo_rl/test_x.py::test_y[domain]", "tests/nemo_rl/test_x.py"),  # a label only as a whole id
    ],
)
def test_a_test_s_work_unit_is_its_file_and_its_checkout(nodeid, unit):
    assert work_unit(nodeid, LABELS) == unit


PROBE = """
import os, pytest

@pytest.mark.parametrize("host", {hosts!r}, ids=lambda h: os.path.basename(h).removeprefix("nemo-rl-"))
@pytest.mark.parametrize("case", range(3))
def test_case(host, case):
    label = os.path.basename(host).removeprefix("nemo-rl-")
    with open(os.path.join({out!r}, f"{{os.path.basename(__file__)}}-{{label}}-{{case}}"), "w") as fh:
        fh.write(os.environ["PYTEST_XDIST_WORKER"])


def test_without_host():
    with open(os.path.join({out!r}, f"{{os.path.basename(__file__)}}-none"), "w") as fh:
        fh.write(os.environ["PYTEST_XDIST_WORKER"])
"""


@pytest.mark.slow  # about 10 s: a pytest run with two workers
def test_each_file_and_checkout_runs_in_one_worker_under_two_workers(tmp_path):
    suite, out = tmp_path / "suite", tmp_path / "out"
    suite.mkdir()
    out.mkdir()
    hosts = ["/x/nemo-rl-v0.7.0", "/x/nemo-rl-main"]
    (suite / "conftest.py").write_text("from tests.conftest import pytest_xdist_make_scheduler  # noqa: F401\n")
    for name in ("test_a.py", "test_b.py"):
        (suite / name).write_text(textwrap.dedent(PROBE.format(hosts=hosts, out=str(out))))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        "NEMO_RS_NEMO_RL_CHECKOUTS": os.pathsep.join(hosts),
    }
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadgroup", "-p", "no:cacheprovider", str(suite)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    workers = collections.defaultdict(set)
    for f in out.iterdir():
        file, _, rest = f.name.partition(".py-")
        host = rest.rsplit("-", 1)[0] if rest != "none" else "none"
        workers[(file, host)].add(f.read_text())
    assert len(list(out.iterdir())) == 2 * (2 * 3 + 1)
    assert set(workers) == {(f, h) for f in ("test_a", "test_b") for h in ["v0.7.0", "main", "none"]}
    split = {unit: sorted(w) for unit, w in workers.items() if len(w) > 1}
    assert split == {}, f"a file's checkout ran in several workers: {split}"
    # and the units were shared out: both workers ran something (5 units, 2 workers)
    assert set().union(*workers.values()) == {"gw0", "gw1"}
