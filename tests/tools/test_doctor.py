"""``python -m nemo_rs_plugin.tools.doctor``: passes only where the plugin really is active.

Run in fresh interpreters against tests/fake_hosts (as tests/nemo_rl/test_activation.py), with a worker
virtual environment made as NeMo-RL's are seen by a worker: its own interpreter without the
plugin, started with the driver's environment.
"""

import os
import subprocess
import sys

import pytest

from tests.nemo_rl.test_activation import FAKE, REPO, _make_venv, needs_install


def doctor(*args, host="supported", env=None, python=sys.executable, cwd):
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(FAKE / host)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    )
    proc = subprocess.run(
        [python, "-m", "nemo_rs_plugin.tools.doctor", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=600,
    )
    return proc.returncode, proc.stdout, proc.stderr


@pytest.fixture(scope="module")
def worker_venvs(tmp_path_factory):
    venvs = tmp_path_factory.mktemp("venvs")
    _make_venv(venvs / "nemo_rl.models.policy.workers.dtensor_policy_worker.DTensorPolicyWorker")
    return venvs


@needs_install
def test_doctor_passes_where_the_plugin_is_active(tmp_path, worker_venvs):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("loss_fn:\n  name: rs_clipped_pg\n  is_correction_level: sequence_mean\n")
    rc, out, err = doctor(str(recipe), "--venvs", str(worker_venvs), cwd=tmp_path)
    assert rc == 0, out + err
    assert "FAIL" not in out
    assert "ok   nemo_rl.algorithms.grpo: ClippedPGLossFn is the plugin's selector" in out
    assert "ok   NeMo-RL's ClippedPGLossFn: refuses configs that name a plugin loss" in out
    assert (
        f"ok   loss: loss_fn.name 'rs_clipped_pg' builds nemo_rs_plugin.nemo_rl.loss_fn.RSClippedPGLossFn from {recipe}"
    ) in out
    assert (
        "ok   worker nemo_rl.models.policy.workers.dtensor_policy_worker.DTensorPolicyWorker: unpickles "
        "RSClippedPGLossFn" in out
    )
    assert out.rstrip().endswith("nemo-rs-plugin is active: loss_fn.name: rs_clipped_pg builds the plugin's loss")


@needs_install
def test_doctor_fails_when_disabled(tmp_path):
    rc, out, _ = doctor("--no-workers", env=dict(os.environ, NEMO_RS_PLUGIN_DISABLE="1"), cwd=tmp_path)
    assert rc == 1
    assert "FAIL start-up hook: NEMO_RS_PLUGIN_DISABLE=1 switches the plugin off" in out


@needs_install
def test_doctor_fails_where_nemo_rl_builds_its_loss_elsewhere(tmp_path):
    rc, out, _ = doctor("--no-workers", host="elsewhere", cwd=tmp_path)
    assert rc == 1
    assert "FAIL nemo_rl.algorithms.grpo: nemo-rs-plugin: nemo_rl.algorithms.grpo has no class ClippedPGLossFn" in out


@needs_install
def test_doctor_fails_when_a_worker_cannot_unpickle(tmp_path, worker_venvs):
    # A worker path nobody can create: the workers get no link to the plugin.
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    env = dict(os.environ, NEMO_RS_PLUGIN_WORKER_PATH=str(blocker / "worker-path"))
    rc, out, _ = doctor("--venvs", str(worker_venvs), env=env, cwd=tmp_path)
    assert rc == 1
    assert "FAIL worker path: nemo-rs-plugin: cannot link the package into" in out


def test_doctor_fails_where_the_plugin_is_not_installed(tmp_path):
    # An interpreter that can import the package (from a source tree) but never ran the
    # start-up hook: what `uv sync` leaves behind, or running from the plugin's checkout.
    python = _make_venv(tmp_path / "venv")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(REPO)
    rc, out, _ = doctor("--no-workers", env=env, python=str(python), cwd=tmp_path)
    assert rc == 1
    assert f"FAIL start-up hook: did not run in this interpreter ({python})" in out
    assert "uv add --editable" in out
