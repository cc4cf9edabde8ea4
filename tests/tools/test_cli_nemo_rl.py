"""``nemo-rs check`` against the real NeMo-RL: full validation, version rules, what it cannot check.

Runs for each checkout in ``$NEMO_RS_NEMO_RL_CHECKOUTS`` (paths separated by ``os.pathsep``)
or for the NeMo-RL importable here; skips cleanly when there is none, or when this Python
lacks NeMo-RL's dependencies. Each host gets two fresh interpreters (NeMo-RL's import takes
seconds; several checks share one): one as a user's shell runs it, one with the shim that
NeMo-RL >= 0.7 needs on Python < 3.12 (``typing.TypedDict``; see shared/nemo-rl/README.md),
so that its ``MasterConfig`` imports and the full validation runs.
"""

import json
import os
from pathlib import Path

import pytest
import yaml

from nemo_rs_plugin.tools.recipes import list_recipes
from tests.support.fork_server import run_python
from tests.support.nemo_rl_hosts import RUN_CLI_SOURCE, host_label, nemo_rl_hosts, no_hosts_mark, skip_or_fail

HOSTS = nemo_rl_hosts()
pytestmark = no_hosts_mark()

RUNNER = (
    r"""
import json, sys
if sys.argv[1] == "shim" and sys.version_info < (3, 12):
    import typing, typing_extensions
    typing.TypedDict = typing_extensions.TypedDict
"""
    + RUN_CLI_SOURCE
    + r"""
results = run_cli(json.loads(sys.argv[2]))
api = None
try:
    from nemo_rs_plugin.nemo_rl.host import host_api
    api = host_api()
except Exception:
    pass
try:
    from nemo_rl.algorithms.grpo import MasterConfig
    master = True
except Exception:
    master = False
print(json.dumps({"api": api, "master_imports": master, "results": results}))
"""
)


def checkout_of(host):
    if host:
        return Path(host)
    import nemo_rl

    return Path(nemo_rl.__file__).resolve().parents[1]


def run_checks(host, tmp_path, mode, arg_lists):
    env = dict(os.environ, TMPDIR=str(tmp_path / "tmp"), NEMO_RS_PLUGIN_WORKER_PATH=str(tmp_path / "worker-path"))
    (tmp_path / "tmp").mkdir(exist_ok=True)
    proc = run_python(
        ["-c", RUNNER, mode, json.dumps(arg_lists)],
        env=env,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    data = json.loads(proc.stdout.strip().splitlines()[-1])
    for r in data["results"]:
        assert "Traceback" not in r["err"], r["err"]
    return data, data["results"]


def left_behind(tmp_path):
    return [p.name for p in (tmp_path / "tmp").iterdir() if p.name.startswith("nemo-rs-check-")]


def not_checked(result):
    return [line for line in result["err"].splitlines() if line.startswith("not checked: ")]


def errors(result):
    return [line for line in result["err"].splitlines() if line.startswith("error: ")]


@pytest.mark.slow  # 9-16 s per host
@pytest.mark.parametrize("host", HOSTS, ids=host_label)
def test_check_as_a_user_runs_it_never_says_valid_without_checking(host, tmp_path):
    root = checkout_of(host)
    recipe = str(next(p for p in list_recipes() if "async" in p.name))
    data, [result] = run_checks(host, tmp_path, "plain", [["check", recipe, "--nemo-rl", str(root)]])
    if not data["master_imports"]:  # e.g. NeMo-RL >= 0.7's MasterConfig on Python < 3.12
        # 3 (or 2 where not even NeMo-RL's loss imports: v0.6.0's rules could not be applied).
        assert result["code"] in ((3,) if data["api"] else (2, 3)) and ": valid" not in result["out"], result
        assert any("MasterConfig" in line for line in not_checked(result)), result
        assert all("needs NeMo-RL's environment (how: below)" in line for line in not_checked(result))
        assert result["err"].count("run nemo-rs check in NeMo-RL's own environment") == 1  # the remedy once
    else:
        assert result["code"] == 0 and f"{recipe}: valid" in result["out"], result
    assert left_behind(tmp_path) == []  # the temporary copy of the recipe is gone


@pytest.mark.slow  # 11-20 s per host
@pytest.mark.parametrize("host", HOSTS, ids=host_label)
def test_check_validates_fully_in_nemo_rl_s_environment(host, tmp_path):
    root = checkout_of(host)
    base = root / "examples" / "configs" / "grpo_math_1B.yaml"
    shorthand = tmp_path / "shorthand.yaml"
    shorthand.write_text(yaml.safe_dump({"defaults": str(base), "loss_fn": "rs_clipped_pg"}))
    # The plugin's loss on NeMo-RL's base as it is: v0.6.0's grpo_math_1B.yaml sets `tis` with a null ratio.
    inherits = tmp_path / "inherits.yaml"
    inherits.write_text(yaml.safe_dump({"defaults": str(base), "loss_fn": {"name": "rs_clipped_pg"}}))
    nemo_rl = ["--nemo-rl", str(root)]
    shipped = [str(p) for p in list_recipes()]
    data, results = run_checks(
        host,
        tmp_path,
        "shim",
        [
            *[["check", p, *nemo_rl] for p in shipped],
            ["check", str(base), *nemo_rl],
            ["check", str(inherits), *nemo_rl],
            ["check", shipped[0], *nemo_rl, "loss_fn.rejection_sampling.7.upper=1"],
            ["check", str(shorthand), *nemo_rl],
            ["check", str(base), *nemo_rl, "grpo.num_prompts_per_step=many"],
        ],
    )
    api = data["api"]
    if api is None or not data["master_imports"]:
        skip_or_fail(
            f"NeMo-RL at {host or 'this environment'} does not import with this Python: {results[0]['err'][-300:]}"
        )
    *recipes, own_base, inherited, bad_override, bad_shorthand, bad_master = results
    # Every shipped recipe and NeMo-RL's own base config are fully valid at every version,
    # v0.6.0 included (its grpo_math_1B.yaml sets `tis` with a null ratio).
    for path, r in zip(shipped, recipes):
        assert r["code"] == 0 and not not_checked(r) and not errors(r), (path, r)
    assert own_base["code"] == 0, own_base
    assert inherited["code"] == 0 and not errors(inherited), inherited
    if api == "typeddict":
        assert "NeMo-RL v0.6.0 semantics" in inherited["out"], inherited
    assert bad_override["code"] == 2 and len(errors(bad_override)) == 1
    assert "override 'loss_fn.rejection_sampling.7.upper=1'" in errors(bad_override)[0]
    assert bad_shorthand["code"] == 2 and len(errors(bad_shorthand)) == 1
    assert "the shorthand `loss_fn: rs_clipped_pg`" in errors(bad_shorthand)[0]
    if api == "pydantic":  # v0.6.0's MasterConfig is a TypedDict: NeMo-RL does not validate it
        assert bad_master["code"] == 2 and "(NeMo-RL MasterConfig)" in bad_master["err"], bad_master
    assert left_behind(tmp_path) == []
