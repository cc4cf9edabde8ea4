"""The plugin against the real NeMo-RL: recipe loading, input preparation, parity.

Runs for each checkout in ``$NEMO_RS_NEMO_RL_CHECKOUTS`` (paths separated by ``os.pathsep``,
e.g. v0.6.0, v0.7.0 and main), or for the NeMo-RL importable in this environment; skips
cleanly when there is none. Each check runs in a fresh interpreter with that checkout on
PYTHONPATH, so the installed start-up hook activates the plugin as in a real run.
"""

import json
import os
from pathlib import Path

import pytest

from tests.conftest import fixtures_path
from tests.nemo_rl.test_activation import plugin_installed
from tests.support.fork_server import run_python
from tests.support.nemo_rl_hosts import host_label, nemo_rl_hosts, no_hosts_mark, real_host_required, skip_or_fail

SCRIPTS = Path(__file__).resolve().parents[1] / "support" / "nemo_rl_scripts.py"


HOSTS = nemo_rl_hosts()
pytestmark = [
    no_hosts_mark(),
    pytest.mark.skipif(
        not plugin_installed() and not real_host_required(), reason="nemo-rs-plugin is not pip-installed here"
    ),
]


def run(host, name, *args):
    env = dict(os.environ)
    if host:
        env["PYTHONPATH"] = os.pathsep.join([host] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    proc = run_python(
        [str(SCRIPTS), name, *args],
        env=env,
        timeout=900,
        cwd=SCRIPTS.parents[3],
    )
    if proc.returncode != 0 and "ModuleNotFoundError" in proc.stderr and "nemo_rl" not in proc.stderr.splitlines()[-1]:
        skip_or_fail(f"NeMo-RL at {host or 'this environment'} lacks a dependency: {proc.stderr.splitlines()[-1]}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


_RESULTS: dict = {}


def checked(host, name, tmp_path_factory):
    """The result of check ``name`` at ``host``; all checks of a host run in one interpreter."""
    if host not in _RESULTS:
        fx = fixtures_path()
        if fx is None:
            skip_or_fail("the recorded NeMo-RL fixtures are not found")
        _RESULTS[host] = run(host, "all_checks", str(tmp_path_factory.mktemp("nemo-rl-host")), str(fx))
    out = _RESULTS[host][name]
    assert "__traceback__" not in out, out.get("__traceback__")
    return out


@pytest.mark.parametrize("host", HOSTS, ids=host_label)
def test_recipe_through_nemo_rl_config_loading_builds_the_plugin(host, tmp_path_factory):
    out = checked(host, "recipe", tmp_path_factory)
    assert out["type"] == "RSClippedPGLossFn" and out["is_host_instance"]
    assert out["level"] == "sequence_mean" and out["filters"] == 2
    assert out["ratio_clip_max"] == 0.28  # the Hydra override
    assert out["inherited_kl_penalty"] == 0.01  # from grpo_math_1B.yaml through defaults
    assert out["own_type"].endswith("loss_functions.ClippedPGLossFn")


@pytest.mark.parametrize("host", HOSTS, ids=host_label)
def test_inside_nemo_rl_input_preparation_and_packing(host, tmp_path_factory):
    out = checked(host, "prepare", tmp_path_factory)
    for mode in ("unpacked", "packed"):
        loss_diff, metric_diffs = out[mode]
        assert loss_diff < 1e-6, (mode, loss_diff)
        assert all(v < 1e-5 for v in metric_diffs.values()), (mode, metric_diffs)


@pytest.mark.parametrize("host", HOSTS, ids=host_label)
def test_fixture_parity_through_the_subclass(host, tmp_path_factory):
    out = checked(host, "parity", tmp_path_factory)
    assert out["type"] == "RSClippedPGLossFn"
    assert out["cases"] == 120 and out["failures"] == []


@pytest.mark.parametrize("host", HOSTS, ids=host_label)
def test_shipped_recipes_load_with_nemo_rl(host, tmp_path_factory):
    out = checked(host, "recipes_load", tmp_path_factory)
    assert len(out) >= 5
    assert all(v == "RSClippedPGLossFn" for v in out.values()), out


@pytest.mark.parametrize("host", HOSTS, ids=host_label)
def test_a_registry_alias_of_the_plugin_builds_it_without_the_name_warning(host, tmp_path_factory):
    """The name chose the class; the config it builds is nameless (the warning is for direct use)."""
    out = checked(host, "registry_alias", tmp_path_factory)
    assert out == {"type": "RSClippedPGLossFn", "config_warnings": []}, out


@pytest.mark.parametrize("host", HOSTS, ids=host_label)
def test_a_new_upstream_field_passes_at_its_default_and_is_refused_when_set(host, tmp_path_factory):
    out = checked(host, "new_upstream_field", tmp_path_factory)
    if out["api"] == "typeddict":  # v0.6.0: a TypedDict has no defaults; nothing to decide
        return
    assert out["default_builds"] == "RSClippedPGLossFn"
    assert out["error"] and "new_upstream_option: got 0.5" in out["error"] and "NeMo-RL" in out["error"], out


@pytest.mark.slow
@pytest.mark.parametrize("host", [h for h in HOSTS if h], ids=host_label)
def test_ray_worker_unpickles_the_loss_against_real_nemo_rl(host, tmp_path):
    from tests.nemo_rl.test_activation import ray_worker_roundtrip

    ray_worker_roundtrip(tmp_path, host)
