"""The documented installs, in NeMo-RL's real workflow: a uv project, ``uv sync``, ``uv run``.

NeMo-RL is a uv project: its driver runs in the checkout's ``.venv`` (``uv run
examples/run_grpo.py``), and each Ray worker type gets its own venv, built from the same
lockfile the way ``nemo_rl.utils.venvs.create_local_venv`` builds it (``uv venv``, then
``uv sync`` and ``uv run --locked --extra <backend>`` with ``UV_PROJECT_ENVIRONMENT``
pointing at it). These tests build a small project of that shape (tests/fake_hosts/uv_project
around tests/fake_hosts/supported, with its own pyproject and lock, torch pinned to 2.13.0)
and check which install commands keep the plugin active through ``uv sync`` and reach the
workers: docs/install.md ("Into NeMo-RL's uv project") states what they find.

uv comes from PyPI (``pip install uv``); the tests skip only when it cannot be installed.
uv is pointed at the indexes pip is configured with, and never downloads a Python.
"""

import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.nemo_rl.test_activation import FAKE, REPO, run_script
from tests.nemo_rl.test_packaging import dists  # noqa: F401 - the session fixture (sdist -> wheel)

pytestmark = pytest.mark.slow

PROJECT = FAKE / "uv_project"
TORCH = "2.13.0"
RECIPE = (
    "loss_fn:\n  name: rs_clipped_pg\n  use_importance_sampling_correction: true\n"
    "  is_correction_level: sequence_mean\n"
)
WORKER = "nemo_rl.models.policy.workers.megatron_policy_worker.MegatronPolicyWorker"


def _uv_binary() -> str:
    """uv's binary, from the ``uv`` package of the ``[test]`` extra."""
    import uv  # in the [test] extra: a missing one is an install error, not a skip

    return uv.find_uv_bin()


def _pip_sources() -> tuple[list, list, list]:
    """pip's configured find-links, index-url and extra-index-url (what `pip config list` shows)."""
    proc = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True)
    found = {"find-links": [], "index-url": [], "extra-index-url": []}
    for line in proc.stdout.splitlines():
        key, _, value = line.partition("=")
        option = key.rsplit(".", 1)[-1]
        if option in found:
            for item in value.strip().strip("'\"").split():
                if item not in found[option]:
                    found[option].append(item)
    for option, variable in (
        ("find-links", "PIP_FIND_LINKS"),
        ("extra-index-url", "PIP_EXTRA_INDEX_URL"),
        ("index-url", "PIP_INDEX_URL"),
    ):
        for item in os.environ.get(variable, "").split():
            if item not in found[option]:
                found[option].append(item)
    return found["find-links"], found["index-url"], found["extra-index-url"]


def _local_torch_wheel(find_links: list) -> bool:
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    for place in find_links:
        path = Path(place[len("file://") :] if place.startswith("file://") else place)
        if path.is_dir() and any(path.glob(f"torch-{TORCH}*-{tag}-*.whl")):
            return True
    return False


@pytest.fixture(scope="module")
def uv_setup(tmp_path_factory):
    """The uv binary, its environment (pip's indexes, no Python downloads), the torch source."""
    binary = _uv_binary()
    home = tmp_path_factory.mktemp("uv")
    find_links, index_url, extra = _pip_sources()
    lines = [f"find-links = {json.dumps(find_links)}"]
    for url in extra:
        lines += ["[[index]]", f"url = {json.dumps(url)}"]
    for url in index_url:
        lines += ["[[index]]", f"url = {json.dumps(url)}", "default = true"]
    (home / "uv.toml").write_text("\n".join(lines) + "\n")
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("UV_") and k not in ("VIRTUAL_ENV", "PYTHONPATH", "NEMO_RS_PLUGIN_DISABLE")
    }
    env.update(
        UV_CONFIG_FILE=str(home / "uv.toml"),
        UV_PYTHON=getattr(sys, "_base_executable", sys.executable),
        UV_PYTHON_DOWNLOADS="never",
        # Shared between runs: torch is unpacked once, then hard-linked into each venv.
        UV_CACHE_DIR=os.environ.get("UV_CACHE_DIR") or os.path.join(tempfile.gettempdir(), "nemo-rs-test-uv-cache"),
        NEMO_RS_PLUGIN_WORKER_PATH=str(home / "worker-path"),
    )
    # torch only from pip's local wheel when there is one: never a multi-GB CUDA build.
    torch_source = find_links[0] if _local_torch_wheel(find_links) else None
    return {"uv": binary, "env": env, "torch_source": torch_source}


def _pyproject(torch_source) -> str:
    machine = f"sys_platform == '{sys.platform}' and platform_machine == '{platform.machine()}'"
    text = f"""\
[project]
name = "nemo-rl"
version = "0.0.0"
requires-python = "=={sys.version_info.major}.{sys.version_info.minor}.*"
dependencies = ["torch=={TORCH}", "pydantic>=2", "pyyaml"]

[project.optional-dependencies]
# NeMo-RL builds each worker venv with its backend's extra (uv run --locked --extra mcore).
mcore = []

[build-system]
requires = ["setuptools>=64"]
build-backend = "setuptools.build_meta"

[tool.setuptools.packages.find]
include = ["nemo_rl*"]

[tool.uv]
environments = ["{machine}"]
"""
    if torch_source:
        text += f"""
[tool.uv.sources]
torch = {{ index = "local-torch" }}

[[tool.uv.index]]
name = "local-torch"
url = {json.dumps(torch_source)}
format = "flat"
explicit = true
"""
    return text


class Project:
    """A NeMo-RL-shaped uv project in ``root`` and the uv commands a user runs there."""

    def __init__(self, root: Path, setup: dict):
        self.root = root
        self.setup = setup
        shutil.copytree(PROJECT, root)
        shutil.copytree(FAKE / "supported" / "nemo_rl", root / "nemo_rl")
        (root / "pyproject.toml").write_text(_pyproject(setup["torch_source"]))
        (root / "recipe.yaml").write_text(RECIPE)
        self.python = root / ".venv" / "bin" / "python"

    def uv(self, *args, env=None, check=True, cwd=None):
        proc = subprocess.run(
            [self.setup["uv"], *args],
            capture_output=True,
            text=True,
            timeout=900,
            cwd=cwd or self.root,
            env={**self.setup["env"], **(env or {})},
        )
        if check:
            assert proc.returncode == 0, f"uv {' '.join(args)}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
        return proc

    def run_grpo(self, *launcher, pickle_to=None):
        """``<launcher> python examples/run_grpo.py --config recipe.yaml``; its JSON line."""
        cmd = [*launcher, "python", "examples/run_grpo.py", "--config", "recipe.yaml"]
        cmd += ["--pickle", str(pickle_to)] if pickle_to else []
        if launcher and launcher[0] == "uv":
            proc = self.uv(*cmd[1:])
        else:
            cmd[cmd.index("python")] = str(self.python)
            proc = subprocess.run(
                cmd, capture_output=True, text=True, cwd=self.root, env=self.setup["env"], timeout=600
            )
            assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    def has_plugin(self, python=None) -> bool:
        """Whether the start-up hook runs in ``python`` (the project's .venv by default)."""
        proc = subprocess.run(
            [
                str(python or self.python),
                "-c",
                "import sys; print(any(type(f).__name__ == '_Finder' for f in sys.meta_path))",
            ],
            capture_output=True,
            text=True,
            env=self.setup["env"],
            check=True,
        )
        return proc.stdout.strip() == "True"

    def worker_venv(self, venvs: Path, name=WORKER):
        """A worker venv built the way NeMo-RL's create_local_venv builds one; its python."""
        venv = venvs / name
        self.uv("venv", "--allow-existing", str(venv))
        env = {"UV_PROJECT_ENVIRONMENT": str(venv)}
        self.uv("sync", "--directory", str(self.root), env=env, cwd=venvs)
        self.uv(
            "run",
            "--locked",
            "--extra",
            "mcore",
            "--directory",
            str(self.root),
            "echo",
            f"Finished creating venv {venv}",
            env=env,
            cwd=venvs,
        )
        return venv / "bin" / "python"


def _worker_unpickles(project, worker_python, pickled, driver_env, tmp_path):
    """The worker, started as Ray starts it: the driver's environment, the worker venv's python."""
    env = {
        **driver_env,
        "VIRTUAL_ENV": str(worker_python.parent.parent),
        "UV_PROJECT_ENVIRONMENT": str(worker_python.parent.parent),
    }
    return run_script("worker_unpickle", str(pickled), host=None, python=str(worker_python), env=env, cwd=tmp_path)


def test_uv_add_editable_survives_uv_sync_and_reaches_worker_venvs(uv_setup, tmp_path):
    project = Project(tmp_path / "RL", uv_setup)
    project.uv("sync")
    project.uv("add", "--editable", str(REPO))
    project.uv("sync")  # the command that removes anything not in the lock
    assert "nemo-rs-plugin" in (project.root / "uv.lock").read_text()
    assert project.has_plugin()
    out = project.run_grpo("uv", "run", "--locked", pickle_to=tmp_path / "loss.pkl")
    assert out["loss"] == "RSClippedPGLossFn"
    # Worker venvs are built from the same lock: the plugin is installed there too ...
    venvs = tmp_path / "venvs"
    worker = project.worker_venv(venvs)
    assert project.has_plugin(worker)
    worker_out = _worker_unpickles(project, worker, tmp_path / "loss.pkl", out["worker_env"], tmp_path)
    assert worker_out["type"] == "RSClippedPGLossFn"
    # ... and the doctor, run as training runs, proves all of it.
    proc = project.uv(
        "run",
        "--locked",
        "python",
        "-m",
        "nemo_rs_plugin.tools.doctor",
        "recipe.yaml",
        "--venvs",
        str(venvs),
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ok   install: a dependency in" in proc.stdout
    assert f"ok   worker {WORKER}: unpickles RSClippedPGLossFn" in proc.stdout


def test_uv_add_of_the_wheel_built_from_the_sdist(uv_setup, tmp_path, dists):  # noqa: F811
    project = Project(tmp_path / "RL", uv_setup)
    project.uv("add", str(dists["wheel"]))
    project.uv("sync")
    assert project.has_plugin()
    assert project.run_grpo("uv", "run", "--locked")["loss"] == "RSClippedPGLossFn"


def test_uv_run_with_activates_without_installing(uv_setup, tmp_path):
    project = Project(tmp_path / "RL", uv_setup)
    project.uv("sync")
    launcher = ("uv", "run", "--with", str(REPO))
    out = project.run_grpo(*launcher, pickle_to=tmp_path / "loss.pkl")
    assert out["loss"] == "RSClippedPGLossFn"
    project.uv("sync")
    assert project.run_grpo(*launcher)["loss"] == "RSClippedPGLossFn"
    # Nothing went into NeMo-RL's environment: plain `uv run` trains with NeMo-RL's loss.
    assert not project.has_plugin()
    assert project.run_grpo("uv", "run", "--locked")["loss"] == "ClippedPGLossFn"
    # Worker venvs from NeMo-RL's lock lack the plugin; the link the driver put on
    # PYTHONPATH lets them unpickle the loss all the same.
    worker = project.worker_venv(tmp_path / "venvs")
    assert not project.has_plugin(worker)
    worker_out = _worker_unpickles(project, worker, tmp_path / "loss.pkl", out["worker_env"], tmp_path)
    assert worker_out["type"] == "RSClippedPGLossFn"
    assert worker_out["plugin_from"].startswith(uv_setup["env"]["NEMO_RS_PLUGIN_WORKER_PATH"])


def test_uv_pip_install_is_undone_by_uv_sync_and_the_doctor_says_so(uv_setup, tmp_path):
    project = Project(tmp_path / "RL", uv_setup)
    project.uv("sync")
    project.uv("pip", "install", "--python", str(project.python), "-e", str(REPO))
    assert project.run_grpo()["loss"] == "RSClippedPGLossFn"
    # `uv run` syncs inexactly and keeps it; `uv sync` is exact and removes it.
    assert project.run_grpo("uv", "run", "--locked")["loss"] == "RSClippedPGLossFn"
    project.uv("sync")
    assert not project.has_plugin()
    # The recipe now trains silently with NeMo-RL's loss: nothing of the plugin is left to
    # object. The doctor, run the same way, fails.
    assert project.run_grpo("uv", "run", "--locked")["loss"] == "ClippedPGLossFn"
    proc = project.uv("run", "--locked", "python", "-m", "nemo_rs_plugin.tools.doctor", "recipe.yaml", check=False)
    assert proc.returncode != 0 and "No module named 'nemo_rs_plugin'" in proc.stderr
