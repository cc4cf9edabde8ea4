"""``nemo-rs check``: what it could not check, NeMo-RL version rules, invalid combinations, clean errors.

Everything runs in this process through the CLI's ``main()``. NeMo-RL is either blocked
(``sys.modules["nemo_rl"] = None``: "not importable") or a stand-in written into
``tmp_path`` by these tests (no NeMo-RL code); the real NeMo-RL is exercised in
tests/tools/test_cli_nemo_rl.py.
"""

import os
import sys
import tempfile
import textwrap

import pytest
import yaml

from nemo_rs_plugin.cli import EXIT_INVALID, EXIT_UNCHECKED, main
from nemo_rs_plugin.tools.recipes import list_recipes

LOSS = {"name": "rs_clipped_pg", "use_importance_sampling_correction": True, "is_correction_level": "sequence_mean"}


def _is_nemo_rl(name):
    return name == "nemo_rl" or name.startswith("nemo_rl.") or name == "nemo_rs_plugin.nemo_rl.loss_fn"


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    """Temporary files under tmp_path; NeMo-RL modules, sys.path and PYTHONPATH restored after."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    # The start-up hook links the plugin for Ray workers when a GRPO module is imported.
    monkeypatch.setenv("NEMO_RS_PLUGIN_WORKER_PATH", str(tmp_path / "worker-path"))
    saved_modules = {k: v for k, v in sys.modules.items() if _is_nemo_rl(k)}
    for k in saved_modules:  # each test imports the NeMo-RL it names (or none)
        del sys.modules[k]
    saved_path = list(sys.path)
    saved_pythonpath = os.environ.get("PYTHONPATH")
    yield temp
    for k in [k for k in sys.modules if _is_nemo_rl(k)]:
        del sys.modules[k]
    sys.modules.update(saved_modules)
    sys.path[:] = saved_path
    if saved_pythonpath is None:
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = saved_pythonpath
    from nemo_rs_plugin import nemo_rl as glue

    if "nemo_rs_plugin.nemo_rl.loss_fn" in saved_modules:
        glue.loss_fn = saved_modules["nemo_rs_plugin.nemo_rl.loss_fn"]
    elif hasattr(glue, "loss_fn"):
        del glue.loss_fn


@pytest.fixture
def no_nemo_rl(monkeypatch):
    """NeMo-RL not importable, whatever this environment has."""
    for k in [k for k in sys.modules if _is_nemo_rl(k)]:
        monkeypatch.delitem(sys.modules, k)
    monkeypatch.setitem(sys.modules, "nemo_rl", None)


# --------------------------------------------------------------------------- stand-in hosts
_LOSS_MODULE = """
from nemo_rl.algorithms.loss.interfaces import LossInputType
{config}

class ClippedPGLossFn:
    input_type = LossInputType.LOGPROB

    def __init__(self, cfg, use_fused_linear_logprobs=False):
        self.use_fused_linear_logprobs = use_fused_linear_logprobs

    def __call__(self, next_token_logprobs, data, global_valid_seqs, global_valid_toks):
        raise NotImplementedError


# the loss wrappers' names, which nemo_rs_plugin.nemo_rl.seam replaces (never called here)
def wrap_loss_fn_with_input_preparation(
    next_token_logits, data, global_valid_seqs, global_valid_toks, loss_fn, prepare_fn
):
    raise NotImplementedError


class SequencePackingLossWrapper:
    def __init__(self, loss_fn, prepare_fn, cu_seqlens_q, cu_seqlens_q_padded=None):
        self.loss_fn, self.prepare_fn, self.cu_seqlens_q = loss_fn, prepare_fn, cu_seqlens_q


class SequencePackingFusionLossWrapper(SequencePackingLossWrapper):
    pass
"""
_PYDANTIC_CONFIG = "from pydantic import BaseModel\n\nclass ClippedPGLossConfig(BaseModel, extra='allow'):\n    pass\n"
_TYPEDDICT_CONFIG = "class ClippedPGLossConfig(dict):  # v0.6.0: a TypedDict\n    pass\n"
_CONFIG_MODULE = """
import os
import yaml

def load_config(path):
    with open(path) as fh:
        cfg = yaml.safe_load(fh) or {}
    if cfg.get("multiline_error"):  # as the adapter's shorthand error: a ConfigError over lines
        from nemo_rs_plugin.core.settings.config import ConfigError
        raise ConfigError(["write the mapping form,\\n  loss_fn:\\n    name: rs_clipped_pg"])
    parents = cfg.pop("defaults", None) or []
    merged = {}
    for parent in [parents] if isinstance(parents, str) else parents:
        merged.update(load_config(os.path.join(os.path.dirname(os.path.abspath(path)), parent)))
    merged.update(cfg)
    return merged

class OverridesError(Exception):
    pass

def parse_hydra_overrides(cfg, overrides):
    try:
        try:
            raise KeyError("Key 'foo' is not in struct")
        except KeyError as inner:
            raise RuntimeError("Could not override 'x'.\\nTo append to your config use +x=1") from inner
    except Exception as e:
        raise OverridesError(f"Failed to parse Hydra overrides: {e}") from e
"""
GRPO_BROKEN = (
    'raise TypeError("Please use `typing_extensions.TypedDict` instead of `typing.TypedDict` on Python < 3.12.")\n'
)
GRPO_PYDANTIC = """
from pydantic import BaseModel, ConfigDict

from nemo_rl.algorithms.loss import ClippedPGLossFn  # as NeMo-RL's GRPO module (the plugin patches it)

class GRPOConfig(BaseModel):
    num_prompts_per_step: int = 8

class MasterConfig(BaseModel):
    model_config = ConfigDict(extra="allow")
    grpo: GRPOConfig = GRPOConfig()
    loss_fn: dict
"""
GRPO_TYPEDDICT = (
    "from nemo_rl.algorithms.loss import ClippedPGLossFn\n\n"
    "class MasterConfig(dict):  # v0.6.0: a TypedDict\n    pass\n"
)


def fake_nemo_rl(root, grpo, typeddict=False):
    """A NeMo-RL stand-in checkout at ``root`` with the given GRPO module."""
    files = {
        "nemo_rl/__init__.py": "__version__ = '0.0.0+test'\n",
        "nemo_rl/utils/__init__.py": "",
        "nemo_rl/utils/config.py": _CONFIG_MODULE,
        "nemo_rl/algorithms/__init__.py": "",
        "nemo_rl/algorithms/grpo.py": grpo,
        "nemo_rl/algorithms/loss/__init__.py": _LOSS_MODULE.format(
            config=_TYPEDDICT_CONFIG if typeddict else _PYDANTIC_CONFIG
        ),
        "nemo_rl/algorithms/loss/interfaces.py": "import enum\n\nclass LossInputType(enum.Enum):\n"
        "    LOGIT = 'logit'\n    LOGPROB = 'logprob'\n",
        "examples/configs/grpo_math_qwen30ba3b_megatron.yaml": yaml.safe_dump(
            {"grpo": {"num_prompts_per_step": 8}, "loss_fn": {"reference_policy_kl_penalty": 0.01}}
        ),
    }
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


def write_recipe(path, data):
    path.write_text(yaml.safe_dump(data))
    return str(path)


def run_check(capsys, *args):
    code = main(["check", *args])
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err


def error_lines(err):
    return [line for line in err.splitlines() if line.startswith("error: ")]


# --------------------------------------------------------------------------- what was not checked
def test_without_nemo_rl_it_says_what_was_not_checked_and_never_exits_0(tmp_path, capsys, no_nemo_rl):
    recipe = write_recipe(tmp_path / "r.yaml", {"loss_fn": LOSS})
    code, out, err = run_check(capsys, recipe)
    assert code == EXIT_UNCHECKED
    assert ": valid" not in out and "not fully checked" in out
    assert "not checked: NeMo-RL's config loading" in err and "MasterConfig" in err
    assert "NeMo-RL is not installed in this environment" in err  # why
    assert err.count("run nemo-rs check in NeMo-RL's own environment") == 1  # how, once for every line
    assert ".ci/nemo-rl-host-requirements.txt" in err  # what NeMo-RL's import needs outside its environment


def test_master_config_that_does_not_import_is_not_valid(tmp_path, capsys):
    host = fake_nemo_rl(tmp_path / "RL", GRPO_BROKEN)
    recipe = write_recipe(tmp_path / "r.yaml", {"loss_fn": LOSS})
    code, out, err = run_check(capsys, recipe, "--nemo-rl", str(host))
    assert code == EXIT_UNCHECKED, (out, err)
    assert ": valid" not in out
    [line] = [line for line in err.splitlines() if line.startswith("not checked: ")]
    assert "NeMo-RL's MasterConfig" in line and "typing_extensions.TypedDict" in line
    assert "needs NeMo-RL's environment (how: below)" in line


def test_master_config_validates_when_it_imports(tmp_path, capsys):
    host = fake_nemo_rl(tmp_path / "RL", GRPO_PYDANTIC)
    good = write_recipe(tmp_path / "good.yaml", {"loss_fn": LOSS})
    code, out, err = run_check(capsys, good, "--nemo-rl", str(host))
    assert code == 0 and f"{good}: valid" in out and "not checked" not in err, (out, err)
    bad = write_recipe(tmp_path / "bad.yaml", {"grpo": {"num_prompts_per_step": "many"}, "loss_fn": LOSS})
    code, out, err = run_check(capsys, bad, "--nemo-rl", str(host))
    assert code == EXIT_INVALID
    assert error_lines(err) == [error_lines(err)[0]] and "grpo.num_prompts_per_step" in err
    assert "(NeMo-RL MasterConfig)" in err


# --------------------------------------------------------------------------- per-version rules
V060_LOSS = {**LOSS, "truncated_importance_sampling_type": "tis", "truncated_importance_sampling_ratio": None}


def test_v060_semantics_come_from_the_host_rules(tmp_path, capsys, monkeypatch):
    """A v0.6.0 host accepts `tis` with a null ratio (truncation off), as the run reads it."""
    host = fake_nemo_rl(tmp_path / "RL", GRPO_TYPEDDICT, typeddict=True)
    recipe = write_recipe(tmp_path / "r.yaml", {"loss_fn": V060_LOSS})
    sys.path.insert(0, str(host))
    from nemo_rs_plugin.nemo_rl import host as host_rules

    calls = []
    original = host_rules.v06_semantics
    monkeypatch.setattr(host_rules, "v06_semantics", lambda cfg: calls.append(cfg) or original(cfg))
    code, out, err = run_check(capsys, recipe, "--nemo-rl", str(host))
    assert code == 0, (out, err)
    assert "NeMo-RL v0.6.0 semantics" in out and "truncation: none" in out
    assert len(calls) == 1  # one source of truth: nemo_rl/host.py, which the run reads too


def test_later_versions_reject_tis_without_a_ratio(tmp_path, capsys):
    host = fake_nemo_rl(tmp_path / "RL", GRPO_PYDANTIC)
    recipe = write_recipe(tmp_path / "r.yaml", {"loss_fn": V060_LOSS})
    code, _, err = run_check(capsys, recipe, "--nemo-rl", str(host))
    assert code == EXIT_INVALID
    assert error_lines(err) == [
        "error: loss_fn.truncated_importance_sampling_ratio: got None with truncated_importance_sampling_type "
        "'tis'; allowed: a number > 0"
    ]


# --------------------------------------------------------------------------- invalid combinations
SHARDED = {**LOSS, "sharded_logits_input": True}


@pytest.mark.parametrize(
    "policy, needle",
    [
        ({"megatron_cfg": {"enabled": True, "use_fused_linear_logprobs": True}}, "use_fused_linear_logprobs"),
        ({"megatron_cfg": {"enabled": False}, "dtensor_cfg": {"enabled": True}}, "DTensor backend"),
        ({"megatron_cfg": {"enabled": True}, "generation": {"top_k": 50, "top_p": 1.0}}, "top_k: 50"),
        ({"megatron_cfg": {"enabled": True}, "generation": {"top_k": None, "top_p": 0.9}}, "top_p: 0.9"),
    ],
)
def test_sharded_input_invalid_combinations(tmp_path, capsys, no_nemo_rl, policy, needle):
    recipe = write_recipe(tmp_path / "r.yaml", {"policy": policy, "loss_fn": SHARDED})
    code, _, err = run_check(capsys, recipe)
    assert code == EXIT_INVALID
    [line] = error_lines(err)
    assert line.startswith("error: loss_fn.sharded_logits_input: got true with") and needle in line


def test_sharded_input_on_megatron_without_filtering_passes(tmp_path, capsys, no_nemo_rl):
    policy = {
        "megatron_cfg": {"enabled": True, "use_fused_linear_logprobs": False},
        "generation": {"top_k": None, "top_p": 1.0},
    }
    recipe = write_recipe(tmp_path / "r.yaml", {"policy": policy, "loss_fn": SHARDED})
    code, out, err = run_check(capsys, recipe)
    assert code == EXIT_UNCHECKED and not error_lines(err), err  # NeMo-RL itself was not checked
    assert "input: local logits shard" in out


@pytest.mark.parametrize(
    "policy, says",
    [
        (
            {"megatron_cfg": {"enabled": True, "tensor_model_parallel_size": 4}},
            [
                "chunks of 1024 positions (the plugin's default; policy.logprob_chunk_size is unset)",
                "1024 x V/4 x 4 bytes per sequence at a time (148 MiB",
                "defer_fp32_logits is not true",
            ],
        ),
        (
            {
                "logprob_chunk_size": 2048,
                "train_micro_batch_size": 2,
                "megatron_cfg": {"enabled": True, "tensor_model_parallel_size": 4, "defer_fp32_logits": True},
            },
            ["chunks of 2048 positions (policy.logprob_chunk_size", "(297 MiB", "2 sequences per loss call"],
        ),
    ],
)
def test_sharded_input_says_which_chunk_size_applies_and_its_cost(tmp_path, capsys, no_nemo_rl, policy, says):
    recipe = write_recipe(tmp_path / "r.yaml", {"policy": policy, "loss_fn": SHARDED})
    code, out, err = run_check(capsys, recipe)
    text = " ".join((out + err).split())
    assert code == EXIT_UNCHECKED and not error_lines(err), err
    assert all(s in text for s in says), text
    assert ("defer_fp32_logits is not true" in text) == (not policy["megatron_cfg"].get("defer_fp32_logits"))


@pytest.mark.parametrize("bad", [0, -1, 1.5])
def test_sharded_input_refuses_a_chunk_size_that_cannot_work(tmp_path, capsys, no_nemo_rl, bad):
    policy = {"logprob_chunk_size": bad, "megatron_cfg": {"enabled": True, "defer_fp32_logits": True}}
    recipe = write_recipe(tmp_path / "r.yaml", {"policy": policy, "loss_fn": SHARDED})
    code, _, err = run_check(capsys, recipe)
    assert code == EXIT_INVALID
    [line] = error_lines(err)
    assert line.startswith(f"error: policy.logprob_chunk_size: got {bad!r}; allowed: a positive integer"), line


def test_a_filter_name_nemo_rl_would_not_divide_is_warned_about_by_check(tmp_path, capsys, no_nemo_rl):
    loss = {**LOSS, "rejection_sampling": [{"level": "sequence", "agg": "max", "upper": 50.0, "name": "ratio_max"}]}
    recipe = write_recipe(tmp_path / "r.yaml", {"loss_fn": loss})
    _, out, err = run_check(capsys, recipe)
    assert "rejection_sampling.0.name: got 'ratio_max', which contains '_max'" in " ".join((out + err).split())


# --------------------------------------------------------------------------- sequence packing
#: Needs every sequence's current log-probs for its totals: runs where the calls are gathered, log-probs or logits.
CURRENT_POLICY_TOTALS = {
    **LOSS,
    "is_correction_level": "token",
    "is_batch_normalization": "microbatch",
    "force_on_policy_ratio": True,
}
CURRENT_POLICY_TOTALS_LOGITS = {**CURRENT_POLICY_TOTALS, "sharded_logits_input": True}


def _packing(fuse=None, megatron=True):
    packing = {"enabled": True, **({} if fuse is None else {"fuse_loss": fuse})}
    return {"sequence_packing": packing, "megatron_cfg": {"enabled": megatron}}


@pytest.mark.parametrize("policy", [_packing(), _packing(fuse=False)])
def test_per_sequence_packing_gathers_logits_input_too(tmp_path, capsys, no_nemo_rl, policy):
    """Each call makes its sequence's log-probs from its logits shard; the last computes the microbatch:
    settings that read every sequence's current policy run (tests/nemo_rl/test_packing.py runs them)."""
    recipe = write_recipe(tmp_path / "r.yaml", {"policy": policy, "loss_fn": CURRENT_POLICY_TOTALS_LOGITS})
    code, out, err = run_check(capsys, recipe)
    assert code == EXIT_UNCHECKED and not error_lines(err), err
    assert (
        "the loss keeps each sequence's log-probs, made from its logits shard in that call, and computes the "
        "whole microbatch in the last call, as unpacked"
    ) in " ".join((out + err).split())


@pytest.mark.parametrize("policy", [_packing(), _packing(fuse=True, megatron=False)])
def test_per_sequence_packing_gathers_log_prob_input(tmp_path, capsys, no_nemo_rl, policy):
    recipe = write_recipe(tmp_path / "r.yaml", {"policy": policy, "loss_fn": CURRENT_POLICY_TOTALS})
    code, out, err = run_check(capsys, recipe)
    assert code == EXIT_UNCHECKED and not error_lines(err), err
    assert "computes the whole microbatch in the last call, as unpacked" in out + err
    assert "logits shard" not in out + err


@pytest.mark.parametrize("policy", [_packing(fuse=True), {"sequence_packing": {"enabled": False}}])
def test_fused_or_no_packing_runs_it(tmp_path, capsys, no_nemo_rl, policy):
    loss = CURRENT_POLICY_TOTALS if policy["sequence_packing"].get("fuse_loss") else CURRENT_POLICY_TOTALS_LOGITS
    recipe = write_recipe(tmp_path / "r.yaml", {"policy": policy, "loss_fn": loss})
    code, _, err = run_check(capsys, recipe)
    assert code == EXIT_UNCHECKED and not error_lines(err), err


def test_fused_packing_refuses_the_sharded_input(tmp_path, capsys, no_nemo_rl):
    recipe = write_recipe(tmp_path / "r.yaml", {"policy": _packing(fuse=True), "loss_fn": SHARDED})
    code, _, err = run_check(capsys, recipe)
    assert code == EXIT_INVALID
    assert any("fuse_loss: got true with loss_fn.sharded_logits_input" in line for line in error_lines(err)), err


def test_fuse_loss_on_dtensor_is_a_warning(tmp_path, capsys, no_nemo_rl):
    recipe = write_recipe(tmp_path / "r.yaml", {"policy": _packing(fuse=True, megatron=False), "loss_fn": LOSS})
    _, out, err = run_check(capsys, recipe)
    assert "warning: policy.sequence_packing.fuse_loss: true is read by the Megatron backend only" in out + err


# --------------------------------------------------------------------------- one clear line
@pytest.mark.parametrize(
    "nemo_rl, needle",
    [
        ("missing-dir", "not a NeMo-RL checkout (no such directory)"),
        ("empty-dir", "not a NeMo-RL checkout (no nemo_rl/__init__.py in it)"),
    ],
)
def test_bad_nemo_rl_path_is_one_line(tmp_path, capsys, nemo_rl, needle):
    (tmp_path / "empty-dir").mkdir()
    recipe = write_recipe(tmp_path / "r.yaml", {"loss_fn": LOSS})
    code, _, err = run_check(capsys, recipe, "--nemo-rl", str(tmp_path / nemo_rl))
    assert code == EXIT_INVALID
    assert error_lines(err) == [f"error: --nemo-rl {tmp_path / nemo_rl}: {needle}"]


@pytest.mark.parametrize(
    "override, needle",
    [
        ("loss_fn.name.foo=1", "loss_fn.name is a str ('rs_clipped_pg'), not a mapping or a list"),
        ("loss_fn.rejection_sampling.5.upper=1", "loss_fn.rejection_sampling has 1 entries; index 5 is out of range"),
        ("loss_fn.rejection_sampling.x.upper=1", "loss_fn.rejection_sampling is a list; 'x' is not an index"),
        ("loss_fn.rejection_sampling.0.upper.x=1", "loss_fn.rejection_sampling.0.upper is a float (1.01)"),
        ("~loss_fn.nothere", "nothing to delete at loss_fn.nothere"),
        ("loss_fn..x=1", "'loss_fn..x' is not a dotted key"),
        ("loss_fn.ratio_clip_max=[1", "the value does not parse as Hydra parses it: expected ']', found the end"),
    ],
)
def test_bad_override_is_one_line(tmp_path, capsys, no_nemo_rl, override, needle):
    loss = {**LOSS, "rejection_sampling": [{"level": "sequence", "agg": "mean", "lower": 0.99, "upper": 1.01}]}
    recipe = write_recipe(tmp_path / "r.yaml", {"loss_fn": loss})
    code, _, err = run_check(capsys, recipe, override)
    assert code == EXIT_INVALID
    [line] = error_lines(err)
    assert line.startswith(f"error: override {override!r}: ") and needle in line, line


def test_override_rejected_by_nemo_rl_is_one_line_with_its_cause(tmp_path, capsys):
    host = fake_nemo_rl(tmp_path / "RL", GRPO_PYDANTIC)
    recipe = write_recipe(tmp_path / "r.yaml", {"loss_fn": LOSS})
    code, _, err = run_check(capsys, recipe, "--nemo-rl", str(host), "loss_fn.name.foo=1")
    assert code == EXIT_INVALID
    assert error_lines(err) == [
        "error: override 'loss_fn.name.foo=1': OverridesError: Could not override 'x'. To append to your config "
        "use +x=1 (\"Key 'foo' is not in struct\")"
    ]


def test_multi_line_message_from_the_loader_is_one_line(tmp_path, capsys):
    host = fake_nemo_rl(tmp_path / "RL", GRPO_PYDANTIC)
    recipe = write_recipe(tmp_path / "r.yaml", {"multiline_error": True, "loss_fn": LOSS})
    code, _, err = run_check(capsys, recipe, "--nemo-rl", str(host))
    assert code == EXIT_INVALID
    assert error_lines(err) == ["error: loss_fn.write the mapping form, loss_fn: name: rs_clipped_pg"]


@pytest.mark.parametrize("with_host", [False, True], ids=["plain", "nemo-rl-loader"])
def test_shorthand_with_an_inherited_loss_mapping_is_one_line(tmp_path, capsys, monkeypatch, with_host):
    (tmp_path / "base.yaml").write_text(yaml.safe_dump({"loss_fn": {"reference_policy_kl_penalty": 0.01}}))
    recipe = write_recipe(tmp_path / "r.yaml", {"defaults": "base.yaml", "loss_fn": "rs_clipped_pg"})
    if with_host:
        args = ["--nemo-rl", str(fake_nemo_rl(tmp_path / "RL", GRPO_PYDANTIC))]
    else:
        monkeypatch.setitem(sys.modules, "nemo_rl", None)
        args = []
    code, _, err = run_check(capsys, recipe, *args)
    assert code == EXIT_INVALID
    [line] = error_lines(err)
    assert line.startswith(
        "error: loss_fn: the shorthand `loss_fn: rs_clipped_pg` would replace the loss_fn "
        "mapping inherited from base.yaml"
    )


def test_unreadable_parent_is_one_line(tmp_path, capsys, no_nemo_rl):
    (tmp_path / "base.yaml").write_text("loss_fn: [unclosed\n")
    recipe = write_recipe(tmp_path / "r.yaml", {"defaults": "base.yaml", "loss_fn": "rs_clipped_pg"})
    code, _, err = run_check(capsys, recipe)
    assert code == EXIT_INVALID
    [line] = error_lines(err)
    assert line.startswith(f"error: {recipe}: a file it inherits through defaults does not load ("), line


def test_shorthand_without_defaults_is_fine(tmp_path, capsys, no_nemo_rl):
    recipe = write_recipe(tmp_path / "r.yaml", {"loss_fn": "rs_clipped_pg"})
    code, _, err = run_check(capsys, recipe)
    assert code == EXIT_UNCHECKED and not error_lines(err)


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--mismatch", "-0.01"], "--mismatch: got -0.01; allowed: a finite number >= 0"),
        (["--mismatch", "nan"], "--mismatch: got nan; allowed: a finite number >= 0"),
        (
            ["--response-tokens", "0"],
            "--response-tokens: got 0; allowed: 1 to 4194304 (the rejection estimate simulates 16 responses of "
            "that length)",
        ),
    ],
)
def test_bad_check_option_is_one_line(tmp_path, capsys, no_nemo_rl, args, needle):
    recipe = write_recipe(
        tmp_path / "r.yaml",
        {
            "loss_fn": {
                **LOSS,
                "rejection_sampling": [{"level": "sequence", "agg": "mean", "lower": 0.99, "upper": 1.01}],
            }
        },
    )
    code, out, err = run_check(capsys, recipe, *args)
    assert code == EXIT_INVALID and out == ""
    assert error_lines(err) == [f"error: {needle}"]


# --------------------------------------------------------------------------- temporary files
def test_no_temporary_directory_is_left_behind(tmp_path, capsys, isolated):
    """A shipped recipe is placed in the checkout through a temporary directory: removed after."""
    host = fake_nemo_rl(tmp_path / "RL", GRPO_PYDANTIC)
    recipe = str(list_recipes()[0])
    code, out, err = run_check(capsys, recipe, "--nemo-rl", str(host))
    assert f"defaults resolved against {host}" in out, (out, err)
    assert code in (0, EXIT_INVALID)  # the stand-in's MasterConfig is not NeMo-RL's; cleanup is the point
    assert list(isolated.iterdir()) == []


@pytest.mark.parametrize(
    "policy, loss, said",
    [
        ({"train_micro_batch_size": 1, "sequence_packing": {"enabled": False}}, LOSS, True),
        ({"train_micro_batch_size": 1, "sequence_packing": {"enabled": False}}, "rs_clipped_pg", True),
        ({"train_micro_batch_size": 1}, LOSS, False),  # packing unset: may be inherited (NeMo-RL's base packs)
        (
            {
                "train_micro_batch_size": 1,
                "sequence_packing": {"enabled": False},
                "dynamic_batching": {"enabled": True},
            },
            LOSS,
            False,  # microbatches sized by tokens
        ),
        ({"train_micro_batch_size": 1, "sequence_packing": {"enabled": False}}, {**LOSS, "compile": True}, False),
        ({"train_micro_batch_size": 1, "sequence_packing": {"enabled": True}}, LOSS, False),  # gathered
        ({"train_micro_batch_size": 4, "sequence_packing": {"enabled": False}}, LOSS, False),
        # NeMo-RL's own loss: no compile field
        ({"train_micro_batch_size": 1, "sequence_packing": {"enabled": False}}, {"name": "clipped_pg"}, False),
    ],
    ids=[
        "packing-off",
        "loss-named-by-a-string",
        "packing-unset",
        "dynamic-batching",
        "compiled",
        "packing-on",
        "four-per-microbatch",
        "own-loss",
    ],
)
def test_one_sequence_per_call_suggests_the_compiled_core(tmp_path, capsys, no_nemo_rl, policy, loss, said):
    """A lone B = 1 call pays the loss's fixed cost on every call (docs/performance.md)."""
    recipe = write_recipe(tmp_path / "r.yaml", {"policy": policy, "loss_fn": loss})
    _, out, err = run_check(capsys, recipe)
    assert ("every loss call holds one sequence" in out + err) is said, out + err
    if said:
        assert "set loss_fn.compile: true" in out + err


def test_check_says_how_to_update_a_filter_s_old_metric_field(tmp_path, capsys, no_nemo_rl):
    """``metric`` (the old name of ``statistic``) still validates, and ``check`` names the new spelling."""
    loss = {**LOSS, "rejection_sampling": [{"level": "sequence", "metric": "kl_k3", "agg": "mean", "upper": 0.01}]}
    recipe = write_recipe(tmp_path / "r.yaml", {"loss_fn": loss})
    code, out, err = run_check(capsys, recipe)
    assert code != EXIT_INVALID, err
    said = " ".join((out + err).split())
    assert "rejection_sampling.0.metric: deprecated; write statistic: kl_k3 instead" in said, said
