"""Activation on install, selection by ``loss_fn.name``, errors, shorthand and Ray workers.

These run against tests/fake_hosts (written for these tests; no NeMo-RL code) in fresh
interpreters, so they run in CI without NeMo-RL; tests/nemo_rl/test_nemo_rl_host.py repeats the
important ones against the real NeMo-RL where it is importable.
"""

import json
import math
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.support.fork_server import run_python

REPO = Path(__file__).resolve().parents[2]
FAKE = Path(__file__).resolve().parents[1] / "fake_hosts"


def plugin_installed() -> bool:
    site = Path(sysconfig.get_paths()["purelib"])
    return (site / "nemo_rs_plugin.pth").is_file()


needs_install = pytest.mark.skipif(not plugin_installed(), reason="nemo-rs-plugin is not pip-installed here")


SCRIPTS = Path(__file__).resolve().parents[1] / "support" / "host_scripts.py"


def run_script(name, *args, host="supported", python=sys.executable, env=None, cwd=None, forked=False):
    """Run tests/support/host_scripts.py by path: the repository root is not on sys.path, so the
    plugin is imported from wherever it is installed (or not at all).

    A new interpreter each time (these tests are about what an interpreter's start does), unless
    ``forked``: a script that only computes after start-up runs from the fork server."""
    env = dict(os.environ if env is None else env)
    paths = [str(host if os.path.isabs(str(host)) else FAKE / host)] if host else []
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    if forked and python == sys.executable:
        proc = run_python([str(SCRIPTS), name, *args], env=env, cwd=cwd or REPO.parent, timeout=300)
    else:
        proc = subprocess.run(
            [python, str(SCRIPTS), name, *args],
            capture_output=True,
            text=True,
            env=env,
            cwd=cwd or REPO.parent,
            timeout=300,
        )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@needs_install
def test_startup_hook_imports_nothing_heavy():
    out = run_script("startup", host=None)
    assert out == {"finder": True, "torch": False, "pydantic": False, "nemo_rs_plugin": False}


@needs_install
def test_environment_variable_disables_activation_but_refuses_plugin_recipes(tmp_path):
    env = dict(os.environ, NEMO_RS_PLUGIN_DISABLE="1")
    # The hook still registers (a guard), and imports nothing.
    assert run_script("startup", host=None, env=env) == {
        "finder": True,
        "torch": False,
        "pydantic": False,
        "nemo_rs_plugin": False,
    }
    (tmp_path / "named.yaml").write_text("loss_fn:\n  name: rs_clipped_pg\n  is_correction_level: sequence_mean\n")
    (tmp_path / "short.yaml").write_text("loss_fn: rs_clipped_pg\n")
    (tmp_path / "plain.yaml").write_text("loss_fn:\n  reference_policy_kl_penalty: 0.0\n")
    out = run_script(
        "disabled_guard", *(str(tmp_path / n) for n in ("named.yaml", "short.yaml", "plain.yaml")), env=env
    )
    # NeMo-RL's own loss is built, the plugin never loads ...
    assert out["selector"] == "type" and out["plugin_imported"] == []
    assert out["plain.yaml"] == "no error"
    assert out["build_unnamed"] == "no error" and out["build_host_named"] == "no error"
    # The guard is in place whichever is imported first, the plugin or NeMo-RL's loss.
    assert run_script("guard_with_adapter_first", host="elsewhere") == {"guarded": True}
    # ... but a recipe that names a plugin loss is refused, on loading and on construction.
    for key in ("named.yaml", "short.yaml", "build_named"):
        assert out[key].startswith("PluginDisabledError: loss_fn.name is 'rs_clipped_pg'"), (key, out[key])
        assert "NEMO_RS_PLUGIN_DISABLE=1" in out[key] and "NeMo-RL would train with its own loss" in out[key]


@needs_install
def test_name_selects_the_plugin_and_no_name_keeps_nemo_rl():
    out = run_script("select")
    assert out["selector"] == "ClippedPGLossSelector"
    assert out["plugin_type"] == "RSClippedPGLossFn" and out["plugin_is_host_instance"]
    assert out["own_is_host_class"] and out["own_type_module"] == "nemo_rl.algorithms.loss"
    assert out["level"] == "sequence_mean" and out["fused"] is True
    assert out["input_type"] == "LossInputType.LOGPROB"
    assert out["normalizer"] == "MetricNormalizer.SEQUENCES"
    assert out["loss_equal_core"] and out["pickle_equal"]


@needs_install
def test_bad_loss_sections_fail_at_construction_with_the_fix():
    out = run_script("errors")
    assert "known losses: clipped_pg, rs_clipped_pg" in out["unknown_name"]
    assert "is_correction_level: a nemo-rs-plugin field under NeMo-RL's own loss" in out["plugin_field_without_name"]
    assert "add `name: rs_clipped_pg`" in out["plugin_field_without_name"]
    assert "did you mean 'is_correction_level'" in out["misspelled_without_name"]
    assert "rejection_sampling_: unknown field; did you mean 'rejection_sampling'?" in out["misspelled_with_name"]
    # name: clipped_pg is NeMo-RL's own loss, which would ignore the plugin's fields.
    assert (
        "is_correction_level: a nemo-rs-plugin field under NeMo-RL's own loss, which would ignore it; set "
        "`name: rs_clipped_pg` (name 'clipped_pg' is NeMo-RL's own loss)"
    ) in out["plugin_field_with_host_name"]
    assert out["host_name_alone"] == "no error"


@needs_install
def test_a_loss_built_where_the_selector_cannot_reach_is_refused(tmp_path):
    (tmp_path / "named.yaml").write_text("loss_fn:\n  name: rs_clipped_pg\n")
    (tmp_path / "plain.yaml").write_text("loss_fn:\n  reference_policy_kl_penalty: 0.0\n")
    out = run_script("elsewhere", str(tmp_path / "named.yaml"), str(tmp_path / "plain.yaml"), host="elsewhere")
    # Said at once, when NeMo-RL's GRPO module is imported ...
    assert len(out["warnings"]) == 1
    assert "nemo_rl.algorithms.grpo has no class ClippedPGLossFn to replace" in out["warnings"][0]
    # ... refused when a recipe names the plugin's loss, on loading and on construction ...
    assert (
        out["named.yaml"].startswith("PluginNotActiveError: ")
        and "NeMo-RL would train with its own loss" in out["named.yaml"]
    )
    assert out["build_named"].startswith(
        "PluginNotActiveError: loss_fn.name is 'rs_clipped_pg', but NeMo-RL's own ClippedPGLossFn is being built"
    )
    assert "a nemo-rs-plugin field under NeMo-RL's own loss" in out["build_host_with_plugin_field"]
    # ... and NeMo-RL's own loss still builds for recipes that ask for it.
    assert out["plain.yaml"] == "no error"
    assert out["build_unnamed"] == "no error" and out["build_host_named"] == "no error"
    # The guard is in place whichever is imported first, the plugin or NeMo-RL's loss.
    assert run_script("guard_with_adapter_first", host="elsewhere") == {"guarded": True}


@needs_install
def test_unsupported_host_version_is_named():
    out = run_script("unsupported", host="unsupported")
    assert "NeMo-RL 0.3.1+fake is not supported" in out["error"]
    assert "v0.6.0, v0.7.0 and main" in out["error"]


@needs_install
def test_shorthand_and_its_limit(tmp_path):
    (tmp_path / "base.yaml").write_text("loss_fn:\n  reference_policy_kl_penalty: 0.0\n")
    (tmp_path / "short.yaml").write_text("loss_fn: rs_clipped_pg\n")
    (tmp_path / "inherits.yaml").write_text("defaults: base.yaml\nloss_fn: rs_clipped_pg\n")
    (tmp_path / "mapping.yaml").write_text("defaults: base.yaml\nloss_fn:\n  name: rs_clipped_pg\n")
    out = run_script("shorthand", *(str(tmp_path / n) for n in ("short.yaml", "inherits.yaml", "mapping.yaml")))
    assert out["short.yaml"] == {"loss_fn": {"name": "rs_clipped_pg"}}
    assert "name: rs_clipped_pg" in out["inherits.yaml"]["error"] and "defaults" in out["inherits.yaml"]["error"]
    assert out["mapping.yaml"] == {"loss_fn": {"reference_policy_kl_penalty": 0.0, "name": "rs_clipped_pg"}}


@needs_install
def test_unwritable_worker_path_is_reported(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    env = dict(os.environ, NEMO_RS_PLUGIN_WORKER_PATH=str(blocker / "worker-path"))
    out = run_script("worker_path", env=env)
    assert len(out["warnings"]) == 1, out
    assert f"cannot link the package into {blocker / 'worker-path'}" in out["warnings"][0]
    assert "ModuleNotFoundError: No module named 'nemo_rs_plugin'" in out["warnings"][0]
    assert "NEMO_RS_PLUGIN_WORKER_PATH" in out["warnings"][0]


@needs_install
def test_dangling_worker_links_are_removed_and_taken_off_pythonpath(tmp_path):
    base = tmp_path / "worker-path"
    stale = base / "deadbeef"
    stale.mkdir(parents=True)
    (stale / "nemo_rs_plugin").symlink_to(tmp_path / "uninstalled" / "nemo_rs_plugin")
    env = dict(os.environ, NEMO_RS_PLUGIN_WORKER_PATH=str(base), PYTHONPATH=str(stale))
    out = run_script("worker_path", env=env)
    assert out["warnings"] == []
    assert len(out["entries"]) == 1 and out["entries"] != ["deadbeef"], out
    shim = str(base / out["entries"][0])
    assert str(stale) not in out["pythonpath"] and out["pythonpath"][-1] == shim
    assert os.path.isfile(os.path.join(shim, "nemo_rs_plugin", "__init__.py"))


def _bare_venv(path: Path) -> tuple[Path, Path]:
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(path)], check=True, capture_output=True, timeout=300
    )
    python = path / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    return python, Path(site)


def _startup_modules(python: Path, env=None) -> set:
    code = "import sys, json; print(json.dumps(sorted(sys.modules)))"
    # -c imports json after start-up; the modules it pulls in are the same with or without the hook.
    proc = subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=True, env=env)
    return set(json.loads(proc.stdout))


@pytest.mark.parametrize("disabled", [False, True], ids=["enabled", "disabled"])
def test_startup_hook_adds_only_itself_to_interpreter_start(tmp_path, disabled):
    # The two files a regular install puts at the root of site-packages.
    python, site = _bare_venv(tmp_path / "venv")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "NEMO_RS_PLUGIN_DISABLE")}
    if disabled:
        env["NEMO_RS_PLUGIN_DISABLE"] = "1"
    without = _startup_modules(python, env)
    for name in ("_nemo_rs_plugin_hook.py", "nemo_rs_plugin.pth"):
        (site / name).write_bytes((REPO / name).read_bytes())
    with_hook = _startup_modules(python, env)
    assert with_hook - without == {"_nemo_rs_plugin_hook"}, sorted(with_hook - without)


def test_pth_line_is_quiet_when_the_hook_module_is_gone(tmp_path):
    # An editable install whose source tree was removed: no traceback at every start.
    python, site = _bare_venv(tmp_path / "venv")
    (site / "nemo_rs_plugin.pth").write_bytes((REPO / "nemo_rs_plugin.pth").read_bytes())
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([str(python), "-c", "pass"], capture_output=True, text=True, env=env)
    assert proc.returncode == 0 and proc.stderr == ""


def _deps_dir() -> str:
    import torch

    return str(Path(torch.__file__).resolve().parents[1])


def _make_venv(path: Path) -> Path:
    python, site = _bare_venv(path)
    # The dependencies (torch, pydantic, ...) as a plain path: .pth files there are not run,
    # so no other installation of the plugin can activate in this venv.
    Path(site, "deps.pth").write_text(_deps_dir() + "\n")
    return python


@pytest.mark.slow
@pytest.mark.parametrize("editable", [False, True], ids=["regular", "editable"])
def test_activation_works_for_regular_and_editable_installs(tmp_path, editable):
    python = _make_venv(tmp_path / "venv")
    # This interpreter's pip installs into the venv; the build uses the setuptools visible
    # there (through deps.pth), so nothing is downloaded.
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "--python",
        str(python),
        "install",
        "-q",
        "--no-deps",
        "--no-build-isolation",
        "--no-index",
    ]
    cmd += ["-e", str(REPO)] if editable else [str(REPO)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = run_script("startup", host=None, python=str(python), env=env, cwd=tmp_path)
    assert out == {"finder": True, "torch": False, "pydantic": False, "nemo_rs_plugin": False}
    out = run_script("select", python=str(python), env=env, cwd=tmp_path)
    assert out["plugin_type"] == "RSClippedPGLossFn" and out["loss_equal_core"]


def ray_worker_roundtrip(tmp_path, host):
    """Driver builds and pickles the loss; a worker venv without the plugin unpickles it."""
    pickled = tmp_path / "loss.pkl"
    env = dict(os.environ, NEMO_RS_PLUGIN_WORKER_PATH=str(tmp_path / "worker-path"))
    driver = run_script("driver_pickle", str(pickled), env=env, host=host, forked=True)
    # A worker venv as NeMo-RL builds one: its own interpreter and site-packages (NeMo-RL's
    # lockfile dependencies, not the plugin), started with the driver's environment.
    worker_python = _make_venv(tmp_path / "worker-venv")
    worker_env = dict(driver["worker_env"])
    probe_code = "import importlib.util as u; print(u.find_spec('nemo_rs_plugin') is None)"
    probe = subprocess.run(
        [str(worker_python), "-c", probe_code],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={k: v for k, v in worker_env.items() if k != "PYTHONPATH"},
    )
    if probe.stdout.strip() != "True":
        pytest.skip("the dependency directory holds a regular install of the plugin: no clean worker venv")
    out = run_script(
        "worker_unpickle", str(pickled), python=str(worker_python), env=worker_env, cwd=tmp_path, host=host
    )
    assert out["type"] == "RSClippedPGLossFn" and not out["preloaded"]
    assert out["loss"] == driver["loss"]
    assert out["plugin_from"].startswith(str(tmp_path / "worker-path")), out["plugin_from"]


@pytest.mark.slow
@needs_install
def test_ray_worker_env_unpickles_the_loss_without_the_plugin_installed(tmp_path):
    ray_worker_roundtrip(tmp_path, "supported")


@needs_install
def test_sharded_logits_input_through_the_adapter():
    out = run_script("sharded_adapter")
    assert out["input_type"] == "LossInputType.LOGIT"
    assert out["diff"] < 1e-6 and out["padded_diff"] < 1e-6
    assert out["groups"] == {"cp": True, "tp": True}
    assert "use_fused_linear_logprobs" in out["errors"]["fused"]


@needs_install
def test_batch_normalization_data_parallel_group_through_the_adapter():
    out = run_script("batch_norm_adapter")
    assert math.isfinite(out["single_process_loss"]) and not out["factor_returned"]
    assert "is_batch_normalization: got 'data_parallel'" in out["dtensor_error"]
    assert "allowed here: 'microbatch'" in out["dtensor_error"]
    assert out["groups"] == {"gathered": True, "sharded": True}
    assert out["microbatch_group"] is None
