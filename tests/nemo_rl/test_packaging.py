"""Packaging: sdist -> wheel -> a fresh virtual environment, as a user or uv gets it.

``python -m build`` builds the sdist and then the wheel from that sdist (not from the source
tree), so anything the sdist forgets breaks here. The wheel is installed into a new venv with
no other installation of the plugin; the start-up hook must activate there, and cost the
interpreter start nothing but its own module.
"""

import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from tests.nemo_rl.test_activation import REPO, _make_venv, run_script

RECIPES = sorted(p.name for p in (REPO / "recipes").glob("*.yaml"))


def build_command() -> tuple[list, dict]:
    """``python -m build`` (the ``[test]`` extra installs ``build``) and its environment."""
    import build  # noqa: F401 - in the [test] extra: a missing one is an install error, not a skip

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return [sys.executable, "-m", "build"], env


_BUILT: dict = {}


@pytest.fixture(scope="session")
def dists(tmp_path_factory) -> dict:
    """The sdist and the wheel built from it (``python -m build``, isolated build); built once
    per session, also for tests/nemo_rl/test_uv_install.py, which imports this fixture."""
    if not _BUILT:
        _BUILT.update(_build(tmp_path_factory.mktemp("dist")))
    return dict(_BUILT)


# Build output a source tree collects (editable installs write egg-info, whose SOURCES.txt
# setuptools would reuse as the sdist's manifest): not what a clean clone has.
_NOT_SOURCE = shutil.ignore_patterns(
    "*.egg-info", "build", "dist", ".venv", "__pycache__", ".pytest_cache", ".hypothesis", ".git"
)


def _build(out: Path) -> dict:
    source = out / "source"
    shutil.copytree(REPO, source, ignore=_NOT_SOURCE, symlinks=True)
    cmd, env = build_command()
    proc = subprocess.run(
        cmd + ["--outdir", str(out), str(source)], capture_output=True, text=True, env=env, timeout=900, cwd=out
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    (sdist,) = out.glob("*.tar.gz")
    (wheel,) = out.glob("*.whl")
    return {"sdist": sdist, "wheel": wheel}


@pytest.mark.slow
def test_sdist_carries_what_the_wheel_is_built_from(dists):
    with tarfile.open(dists["sdist"]) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    assert {"nemo_rs_plugin.pth", "_nemo_rs_plugin_hook.py", "LICENSE", "setup.py", "MANIFEST.in"} <= names
    assert {f"recipes/{r}" for r in RECIPES} <= names


@pytest.mark.slow
def test_wheel_from_the_sdist_has_the_hook_recipes_and_license(dists):
    with zipfile.ZipFile(dists["wheel"]) as whl:
        names = set(whl.namelist())
        (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        meta = whl.read(metadata).decode()
    assert {"nemo_rs_plugin.pth", "_nemo_rs_plugin_hook.py"} <= names
    assert {f"nemo_rs_plugin/recipes/{r}" for r in RECIPES} <= names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), sorted(names)
    assert "License-Expression: Apache-2.0" in meta


@pytest.mark.slow
def test_wheel_requires_numpy_so_that_import_torch_is_quiet(dists):
    """torch's CPU wheels leave numpy out; without it every ``import torch`` (each nemo-rs
    command) warns "Failed to initialize NumPy" on a fresh venv."""
    with zipfile.ZipFile(dists["wheel"]) as wheel:
        metadata = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
        requires = [line for line in wheel.read(metadata).decode().splitlines() if line.startswith("Requires-Dist:")]
    assert any(line.split(":", 1)[1].strip().split(";")[0].strip() == "numpy" for line in requires), requires


@pytest.mark.slow
def test_wheel_installs_into_a_fresh_venv_and_activates(dists, tmp_path):
    python = _make_venv(tmp_path / "venv")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "-q",
            "--no-deps",
            "--no-index",
            str(dists["wheel"]),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "NEMO_RS_PLUGIN_DISABLE")}
    assert run_script("startup", host=None, python=str(python), env=env, cwd=tmp_path) == {
        "finder": True,
        "torch": False,
        "pydantic": False,
        "nemo_rs_plugin": False,
    }
    out = run_script("select", python=str(python), env=env, cwd=tmp_path)
    assert out["plugin_type"] == "RSClippedPGLossFn" and out["loss_equal_core"]
    listed = subprocess.run(
        [
            str(python),
            "-c",
            "import json; from nemo_rs_plugin.tools.recipes import list_recipes; "
            "print(json.dumps([str(p) for p in list_recipes()]))",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        check=True,
    ).stdout
    recipes = json.loads(listed)
    assert sorted(Path(r).name for r in recipes) == RECIPES
    assert all("site-packages" in r for r in recipes)

    # The start-up cost of the installed hook: only its own module, enabled or disabled.
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    count = "import sys, json; print(json.dumps(sorted(sys.modules)))"

    def modules(extra_env=None):
        return set(
            json.loads(
                subprocess.run(
                    [str(python), "-c", count],
                    capture_output=True,
                    text=True,
                    check=True,
                    env={**env, **(extra_env or {})},
                    cwd=tmp_path,
                ).stdout
            )
        )

    with_hook, disabled = modules(), modules({"NEMO_RS_PLUGIN_DISABLE": "1"})
    (site / "nemo_rs_plugin.pth").rename(tmp_path / "aside.pth")
    without = modules()
    assert with_hook - without == {"_nemo_rs_plugin_hook"}, sorted(with_hook - without)
    assert disabled - without == {"_nemo_rs_plugin_hook"}, sorted(disabled - without)
