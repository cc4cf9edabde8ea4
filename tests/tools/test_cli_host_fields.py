"""Under NeMo-RL's own loss, a NeMo-RL field the target NeMo-RL does not have is
refused, naming the field and the version, through one rule (``nemo_rl/host.py``) that ``nemo-rs
check`` and the run read; the plugin's loss computes such a field itself (on v0.6.0 the loss of
v0.7.0, pinned by the v0.6.0 fixture parity), so check only notes it there.

Against a stand-in NeMo-RL written into ``tmp_path`` (no NeMo-RL code: its config declares field
names only), and against every real checkout in ``$NEMO_RS_NEMO_RL_CHECKOUTS`` (v0.6.0 has no
``use_cispo`` and no ``positive_example_nll_weight``; v0.7.0 and main have both).
"""

import json
import os
import sys
import textwrap

import pytest
import yaml

from tests.support.fork_server import run_python
from tests.support.nemo_rl_hosts import RUN_CLI_SOURCE, host_label, nemo_rl_hosts, real_host_required, skip_or_fail
from tests.tools.test_cli_check import (  # noqa: F401 - `isolated` is an autouse fixture
    GRPO_TYPEDDICT,
    error_lines,
    fake_nemo_rl,
    isolated,
    run_check,
    write_recipe,
)

CISPO = {"name": "rs_clipped_pg", "use_cispo": True}

# A v0.6.0-like TypedDict config: the names of the fields it declares (no use_cispo, no NLL weight).
_V060_LIKE_CONFIG = """
from typing import TypedDict

class ClippedPGLossConfig(TypedDict):
    reference_policy_kl_penalty: float
    ratio_clip_min: float
    ratio_clip_max: float
    use_importance_sampling_correction: bool
    token_level_loss: bool
"""


def v060_like_host(tmp_path):
    host = fake_nemo_rl(tmp_path / "RL", GRPO_TYPEDDICT, typeddict=True)
    loss = host / "nemo_rl" / "algorithms" / "loss" / "__init__.py"
    text = loss.read_text()
    start = text.index("class ClippedPGLossConfig")
    end = text.index("class ClippedPGLossFn")
    loss.write_text(text[:start] + textwrap.dedent(_V060_LIKE_CONFIG) + "\n\n" + text[end:])
    return host


def test_check_refuses_a_field_the_host_does_not_have_under_its_own_loss(tmp_path, capsys):
    host = v060_like_host(tmp_path)
    recipe = write_recipe(tmp_path / "r.yaml", {"grpo": {"num_prompts_per_step": 8}, "loss_fn": {"use_cispo": True}})
    code, out, err = run_check(capsys, recipe, "--nemo-rl", str(host))
    assert code == 2, (out, err)
    [line] = error_lines(err)
    assert line.startswith("error: loss_fn.use_cispo: got true; NeMo-RL 0.0.0+test has no use_cispo"), line


def test_the_plugin_s_loss_computes_it_and_check_notes_it(tmp_path, capsys):
    host = v060_like_host(tmp_path)
    recipe = write_recipe(tmp_path / "r.yaml", {"grpo": {"num_prompts_per_step": 8}, "loss_fn": CISPO})
    code, out, err = run_check(capsys, recipe, "--nemo-rl", str(host))
    assert code == 0 and not error_lines(err), (out, err)
    assert "note: loss_fn.use_cispo: NeMo-RL 0.0.0+test has no such option; rs_clipped_pg computes it" in out


def test_check_and_run_read_the_one_rule(tmp_path, capsys, monkeypatch):
    host = v060_like_host(tmp_path)
    loss = {"use_cispo": True, "positive_example_nll_weight": 0.1}
    recipe = write_recipe(tmp_path / "r.yaml", {"grpo": {"num_prompts_per_step": 8}, "loss_fn": loss})
    sys.path.insert(0, str(host))
    from nemo_rs_plugin.nemo_rl import host as host_rules

    calls = []
    original = host_rules.host_field_problems
    monkeypatch.setattr(host_rules, "host_field_problems", lambda raw, **kw: calls.append(kw) or original(raw, **kw))
    code, _, err = run_check(capsys, recipe, "--nemo-rl", str(host))
    assert code == 2 and calls == [{"own_loss": True}], err
    # check's lines are the rule's lines
    assert error_lines(err) == [f"error: loss_fn.{p}" for p in original(dict(loss), own_loss=True)[1]]
    assert len(error_lines(err)) == 2

    from nemo_rs_plugin.core.settings.config import ConfigError
    from nemo_rs_plugin.nemo_rl.loss_fn import RSClippedPGLossFn

    RSClippedPGLossFn({**CISPO, "positive_example_nll_weight": 0.1})  # the plugin computes both
    assert calls[1:] == [{}]  # the run read the same rule (the plugin's loss: host-only fields)
    with pytest.raises(ConfigError) as info:  # and its problems come with the config's, at once
        RSClippedPGLossFn({"name": "rs_clipped_pg", "ratio_clip_min": -0.1, "ratio_clip_c": 0.5})
    assert [p.split(":")[0] for p in info.value.problems] == ["loss_fn.ratio_clip_min", "loss_fn.ratio_clip_c"]


def test_a_field_at_its_default_passes(tmp_path, capsys):
    host = v060_like_host(tmp_path)
    loss = {"use_cispo": False, "positive_example_nll_weight": 0.0}
    recipe = write_recipe(tmp_path / "r.yaml", {"grpo": {"num_prompts_per_step": 8}, "loss_fn": loss})
    code, out, err = run_check(capsys, recipe, "--nemo-rl", str(host))
    assert code == 0 and not error_lines(err), (out, err)


# --------------------------------------------------------------------------- the real NeMo-RL
RUNNER = (
    RUN_CLI_SOURCE
    + r"""
import json, sys
results = run_cli(json.loads(sys.argv[1]))
from nemo_rs_plugin.core.settings.config import ConfigError
from nemo_rs_plugin.nemo_rl.host import host_config_fields, host_version
from nemo_rs_plugin.nemo_rl.loss_fn import RSClippedPGLossFn
try:
    RSClippedPGLossFn({"name": "rs_clipped_pg", "use_cispo": True})
    run = None
except ConfigError as exc:
    run = exc.problems
print(json.dumps({"results": results, "run": run, "version": host_version(),
                  "has_cispo": "use_cispo" in host_config_fields()}))
"""
)


@pytest.mark.slow  # 9-14 s per host
@pytest.mark.skipif(not nemo_rl_hosts() and not real_host_required(), reason="no NeMo-RL checkout")
@pytest.mark.parametrize("host", nemo_rl_hosts(), ids=host_label)
def test_real_nemo_rl_refuses_exactly_the_fields_it_lacks(host, tmp_path):
    if not host:
        skip_or_fail("needs a checkout path in NEMO_RS_NEMO_RL_CHECKOUTS")
    base = os.path.join(host, "examples", "configs", "grpo_math_1B.yaml")
    recipes = []
    for name, loss in (("rs", CISPO), ("own", {"use_cispo": True})):
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump({"defaults": base, "loss_fn": loss}))
        recipes.append(["check", str(path), "--nemo-rl", host])
    env = dict(os.environ, TMPDIR=str(tmp_path), NEMO_RS_PLUGIN_WORKER_PATH=str(tmp_path / "worker-path"))
    proc = run_python(["-c", RUNNER, json.dumps(recipes)], env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    data = json.loads(proc.stdout.strip().splitlines()[-1])
    if host_label(host) == "v0.6.0":
        assert not data["has_cispo"]
    elif host_label(host) in ("v0.7.0", "main"):
        assert data["has_cispo"]
    refused = f"loss_fn.use_cispo: got true; NeMo-RL {data['version']} has no use_cispo"
    rs, own = data["results"]
    for result in (rs, own):
        assert "Traceback" not in result["err"], result["err"]
    said = [line for line in own["err"].splitlines() if line.startswith(f"error: {refused}")]
    if data["has_cispo"]:
        assert not said and "use_cispo" not in own["err"], own
    else:
        assert own["code"] == 2 and len(said) == 1, own
    assert rs["code"] != 2 and "use_cispo" not in rs["err"], rs  # the plugin computes it (v0.6.0: v0.7.0's loss)
    assert data["run"] is None, data["run"]
