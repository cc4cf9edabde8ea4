"""``run_python`` starts a script as a fresh interpreter would, and the harness's ranks see the caller's world.

The suite runs most NeMo-RL scripts and every gloo world through one fork server per pytest
process (``tests/support/fork_server.py``): these tests compare what a probe script observes when
run by ``run_python`` with what it observes run by ``subprocess`` in a new interpreter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support.fork_server import HEAVY_MODULES, run_python

PROBE = r"""
import atexit, json, os, sys, tempfile
def annotated(x: int): pass
atexit.register(lambda: print("atexit ran"))
print(json.dumps({
    "argv": sys.argv,
    "path": sys.path,
    "annotations": repr(annotated.__annotations__),
    "cwd": os.getcwd(),
    "env": os.environ.get("FORK_SERVER_PROBE"),
    "tmp": tempfile.gettempdir(),
    "stdin": sys.stdin.read(),
    "main": __name__,
    "imported": sorted(m for m in ("nemo_rl", "nemo_rs_plugin", "ray", "tests") if m in sys.modules),
}))
sys.stderr.write("to stderr\n")
sys.exit(int(os.environ.get("FORK_SERVER_PROBE_EXIT", "0")))
"""


@pytest.fixture
def probe(tmp_path):
    script = tmp_path / "scripts" / "probe.py"
    script.parent.mkdir()
    script.write_text(PROBE)
    (tmp_path / "tmp").mkdir()
    env = dict(
        os.environ,
        FORK_SERVER_PROBE="seen",
        FORK_SERVER_PROBE_EXIT="3",
        # as the interpreter reads it: relative made absolute, an empty entry the working directory
        PYTHONPATH=os.pathsep.join([str(tmp_path / "first"), "relative", "", str(tmp_path / "second")]),
        TMPDIR=str(tmp_path / "tmp"),
    )
    return script, env, tmp_path


def _observed(proc):
    lines = proc.stdout.splitlines()
    return json.loads(lines[0]), lines[1:], proc.returncode, proc.stderr


@pytest.mark.parametrize("form", ["script", "-c", "-m"])
def test_a_forked_script_observes_what_a_fresh_interpreter_observes(probe, form):
    script, env, tmp_path = probe
    args = {
        "script": [str(script), "a", "b"],
        "-c": ["-c", PROBE, "a", "b"],
        "-m": ["-m", "probe", "a", "b"],
    }[form]
    cwd = script.parent if form == "-m" else tmp_path
    fresh = subprocess.run(
        [sys.executable, *args], env=env, cwd=cwd, input="from stdin", capture_output=True, text=True, timeout=120
    )
    forked = run_python(args, env=env, cwd=cwd, input="from stdin", timeout=120)
    assert _observed(forked) == _observed(fresh)
    seen, after, code, err = _observed(forked)
    assert code == 3 and after == ["atexit ran"] and err == "to stderr\n"
    assert seen["env"] == "seen" and seen["tmp"] == str(tmp_path / "tmp") and seen["stdin"] == "from stdin"
    assert seen["imported"] == []  # NeMo-RL, the plugin, ray and the test modules: imported by the script itself


def test_an_uncaught_exception_exits_1_with_its_traceback():
    proc = run_python(["-c", "raise ValueError('named here')"], timeout=120)
    assert proc.returncode == 1
    assert "ValueError: named here" in proc.stderr


def test_a_script_past_its_timeout_is_killed():
    with pytest.raises(subprocess.TimeoutExpired):
        run_python(["-c", "import time; time.sleep(60)"], timeout=2)


def test_interpreter_options_other_than_warnings_are_refused():
    """``-S`` (no site) cannot be had in a process forked from one that ran site: callers keep ``subprocess``."""
    with pytest.raises(ValueError, match="-S"):
        run_python(["-S", "-c", "pass"], timeout=120)


def test_only_third_party_modules_are_preloaded():
    """What a script may need to find absent (NeMo-RL, the plugin, ray) is never imported ahead of it."""
    tops = {name.split(".")[0] for name in HEAVY_MODULES}
    assert not tops & {"nemo_rl", "nemo_rs_plugin", "ray", "tests", "_nemo_rs_plugin_hook"}


def test_a_forked_script_finds_the_heavy_modules_imported_already():
    """What the fork server is for: a ``-c`` script sees torch in ``sys.modules`` before importing it."""
    proc = run_python(["-c", "import sys; print('torch' in sys.modules)"], timeout=120)
    assert (proc.returncode, proc.stdout) == (0, "True\n"), proc.stderr


def _rank_one_exits_without_reporting(rank, world_size):
    """Rank 1 dies as a crash does (no exception, no report); rank 0 waits for it in a collective."""
    import torch.distributed as dist

    if rank == 1:
        os._exit(3)
    dist.barrier()
    return []


def test_a_rank_that_dies_before_reporting_ends_the_world_at_once():
    """The harness stops waiting when a rank exits with a non-zero code before its report (a crash,
    a rank function that could not be unpickled) and says so, instead of waiting out the timeout and
    saying only that nothing came (rank 0 reports its broken collective, or is killed)."""
    import time

    from tests.support.distributed_harness import run_world

    started = time.monotonic()
    with pytest.raises(AssertionError) as failure:
        run_world(2, _rank_one_exits_without_reporting, timeout=180)
    assert "ranks [1] exited before reporting (rank 1: 3)" in str(failure.value), str(failure.value)
    assert time.monotonic() - started < 60
