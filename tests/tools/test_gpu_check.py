"""``benchmarks/gpu_check.sh --dry-run`` starts and completes on a CPU machine.

The GPU run itself needs a CUDA device (docs/performance.md#on-a-gpu); the dry run proves
that the script, the GPU tests' collection and ``bench_gpu.py`` (on CPU, compiled rows with
the ``eager`` backend) work, so that a GPU session does not spend its time on a typo.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def dry_run(tmp_path, timeout=240, **env):
    """``gpu_check.sh --dry-run`` with ``OUT`` in ``tmp_path`` and ``env`` added: the process and its log."""
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable, **env}
    proc = subprocess.run(
        ["bash", str(REPO / "benchmarks" / "gpu_check.sh"), "--dry-run"],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    log = tmp_path / "gpu_check.log"
    return proc, log.read_text() if log.exists() else ""


@pytest.mark.slow  # ~40 s: the whole GPU script, dry
@pytest.mark.skipif(sys.platform != "linux", reason="bash script for the Linux GPU machines")
def test_gpu_check_dry_run_completes(tmp_path):
    proc, log = dry_run(tmp_path, NEMO_RL=str(tmp_path / "no-nemo-rl"))
    assert proc.returncode == 0, log[-4000:]
    assert "gpu_check: done" in log
    assert "NeMo-RL comparison skipped: no NeMo-RL checkout" in log
    rows = json.loads((tmp_path / "bench_gpu.json").read_text())["rows"]
    assert {r["candidate"] for r in rows} == {
        "upstream-equivalent",
        "upstream-equivalent compiled",
        "rs-pipeline-3",
        "rs-pipeline-3 compiled",
    }


_WITHOUT_RAY = """
import importlib.abc, sys

sys.path.insert(0, "benchmarks")
from tests.support import nemo_rl_shims


class NoRay(importlib.abc.MetaPathFinder):
    # As on the lent GPU machine, ray is not installed: only the shims may answer for it.
    def find_spec(self, name, path, target=None):
        if name == "ray" or name.startswith("ray."):
            spec = nemo_rl_shims._StandInFinder().find_spec(name, path, target)
            if spec is None:
                raise ModuleNotFoundError(f"No module named {name!r}")
            return spec
        return None


sys.meta_path.insert(0, NoRay())
nemo_rl_shims.install()
from pathlib import Path
import bench_gpu, bench_ops
fn, why = bench_gpu.nemo_rl_loss(Path(sys.argv[1]))
assert fn is not None, why
curr, data, gvs, gvt = bench_ops.make_inputs(2, 16)
lp = curr.clone().requires_grad_(True)
loss, metrics = fn(lp, data, gvs, gvt)
loss.backward()
assert lp.grad is not None and metrics
print("ray stand-ins:", [n for n in nemo_rl_shims.stand_ins() if n.split(".")[0] == "ray"][:3], float(loss))
"""


def _checkout() -> str:
    """The NeMo-RL checkout a GPU run would carry: the last host's (skips, or fails in CI, without one)."""
    from tests.support.nemo_rl_hosts import nemo_rl_hosts, skip_or_fail

    hosts = [h for h in nemo_rl_hosts() if h]
    if not hosts:
        skip_or_fail("no NeMo-RL checkout")
    return hosts[-1]


@pytest.mark.slow  # 10-14 s: a fresh interpreter importing NeMo-RL
def test_nemo_rl_loss_runs_without_ray_for_the_gpu_comparison():
    """bench_gpu.py compares with NeMo-RL's own loss on a machine without ray (the lent GPU
    machine has none): NeMo-RL's loss module imports ray only for its cluster code, which the
    shims answer with a stand-in; the loss itself runs for real."""
    from tests.support.fork_server import run_python

    host = _checkout()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), host]))
    proc = run_python(["-c", _WITHOUT_RAY, host], env=env, cwd=REPO, timeout=300)  # ray is not preloaded
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "ray stand-ins: ['ray'" in proc.stdout, proc.stdout


@pytest.mark.slow  # ~45 s: NeMo-RL imported in fresh interpreters, a few packed calls, four log-prob variants
@pytest.mark.skipif(sys.platform != "linux", reason="bash script for the Linux GPU machines")
def test_gpu_check_dry_run_runs_the_steps_that_need_a_checkout(tmp_path):
    """With the checkout that GPU run would carry, on the CPU, in one dry run (each start of the
    script costs its dependency check and its interpreters):

    * the ``packing`` step (bench_packing.py, NeMo-RL's real ``SequencePackingLossWrapper``) prints
      its table, its ``--only`` rows and nothing else;
    * the ``logprob_memory`` step (bench_logprob_memory.py against NeMo-RL's own log-prob
      functions) prints its four rows, which agree on the log-probs' sum;
    * the steps left out of ``STEPS`` do not run.
    """
    proc, log = dry_run(tmp_path, NEMO_RL=_checkout(), STEPS="packing,logprob_memory")
    assert proc.returncode == 0, log[-4000:]
    assert "=== bench_packing on CPU (dry run): rc=0" in log
    assert "SequencePackingLossWrapper + prepare_loss_input over 4 sequences" in log
    assert "\nplain " in log and "\nGSPO " in log  # --only "plain, GSPO": both rows, nothing else
    assert "\nIS + token TIS " not in log
    assert "=== bench_logprob_memory on CPU (dry run): rc=0" in log
    rows = [
        line.split()
        for line in log.splitlines()
        if line.strip().split(" ")[0] in ("plugin", "nemo-rl-chunked", "nemo-rl", "plugin-unchunked")
    ]
    assert [r[0] for r in rows] == ["plugin", "nemo-rl-chunked", "nemo-rl", "plugin-unchunked"], log[-2000:]
    assert len({r[-1] for r in rows}) == 1, rows  # the four agree on the log-probs' sum
    assert "collect the GPU tests" not in log and not (tmp_path / "bench_gpu.json").exists()


@pytest.mark.skipif(sys.platform != "linux", reason="bash script for the Linux GPU machines")
def test_gpu_check_refuses_an_unknown_step(tmp_path):
    """A misspelt step would run nothing and spend a lease on it: refused before any step, naming it."""
    proc, _ = dry_run(tmp_path, timeout=60, STEPS="tests,packng")
    assert proc.returncode == 2
    assert (
        "unknown step 'packng' in STEPS (allowed: tests, bench_gpu, packing, packing_compiled, logprob_memory)"
        in proc.stdout
    )
    assert "=== " not in proc.stdout  # no step ran
