"""``nemo-rs check`` refuses every recipe the loss refuses at run time: one list, walked here.

:data:`~nemo_rs_plugin.nemo_rl.refusals.RUN_TIME_REFUSALS` holds the loss's recipe-dependent
refusals; the loss reads it (``run_time_refusal(name).judge``) and so does ``check``. Each entry's
example recipe must be refused by ``check`` with the entry's own message, and the loss must name
exactly the entries of the list (a refusal added to the loss outside the list fails here).
"""

import ast
import sys
from pathlib import Path

import pytest
import yaml

from nemo_rs_plugin.cli import EXIT_INVALID, main
from nemo_rs_plugin.core.settings.config import RSClippedPGLossConfig
from nemo_rs_plugin.nemo_rl.refusals import RUN_TIME_REFUSALS, Unknown, run_time_refusal, training_ranks
from nemo_rs_plugin.tools.recipe_overrides import apply_override

LOSS_FN = Path(__file__).resolve().parents[2] / "nemo_rs_plugin" / "nemo_rl" / "loss_fn.py"
BASE = {
    "grpo": {"num_prompts_per_step": 8},
    "loss_fn": {"name": "rs_clipped_pg", "use_importance_sampling_correction": True, "is_correction_level": "token"},
}


@pytest.fixture(autouse=True)
def no_nemo_rl(monkeypatch):
    """NeMo-RL not importable, whatever this environment has: ``check`` reads the list without it."""
    for k in [k for k in sys.modules if k == "nemo_rl" or k.startswith("nemo_rl.")]:
        monkeypatch.delitem(sys.modules, k)
    monkeypatch.setitem(sys.modules, "nemo_rl", None)


def example_recipe(overrides):
    cfg = yaml.safe_load(yaml.safe_dump(BASE))
    for o in overrides:
        apply_override(cfg, f"++{o}")
    return cfg


def run_check(tmp_path, capsys, cfg):
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(cfg))
    code = main(["check", str(path)])
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out + err


@pytest.mark.parametrize("refusal", RUN_TIME_REFUSALS, ids=lambda r: r.name)
def test_check_refuses_every_run_time_refusal_with_its_message(tmp_path, capsys, refusal):
    cfg = example_recipe(refusal.example)
    config = RSClippedPGLossConfig.from_any({k: v for k, v in cfg["loss_fn"].items() if k != "name"})
    facts = refusal.from_recipe(cfg, config)
    assert isinstance(facts, dict), facts
    problem = refusal.judge(**facts)
    assert problem is not None  # the example is one the loss refuses
    code, err = run_check(tmp_path, capsys, cfg)
    assert code == EXIT_INVALID, err
    assert problem in err, err


def test_the_loss_names_exactly_the_refusals_of_the_list():
    tree = ast.parse(LOSS_FN.read_text())
    named = {
        node.args[0].value
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and getattr(node.func, "id", None) == "run_time_refusal"
        and isinstance(node.args[0], ast.Constant)
    }
    assert named == {r.name for r in RUN_TIME_REFUSALS}
    imported = {a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) for a in node.names}
    # The judges' building blocks reach the loss only through the list.
    assert not imported & {"fused_sharded_problem", "training_time_filtering_problem", "chunk_size_problem"}


def test_dtensor_data_parallel_normalisation_on_one_gpu_passes_and_unknown_ranks_warn(tmp_path, capsys):
    dp = [o for o in run_time_refusal("data_parallel_group").example if not o.startswith("cluster.")]
    code, err = run_check(tmp_path, capsys, example_recipe([*dp, "cluster.gpus_per_node=1", "cluster.num_nodes=1"]))
    assert "is_batch_normalization" not in err, err
    code, err = run_check(tmp_path, capsys, example_recipe(dp))
    assert code != EXIT_INVALID, err
    assert "warning: loss_fn.is_batch_normalization: 'data_parallel' without the Megatron backend" in err


def test_megatron_data_parallel_normalisation_is_not_refused(tmp_path, capsys):
    example = run_time_refusal("data_parallel_group").example
    megatron = [o for o in example if "_cfg.enabled" not in o] + ["policy.megatron_cfg.enabled=true"]
    code, err = run_check(tmp_path, capsys, example_recipe(megatron))
    assert "is_batch_normalization" not in err, err


@pytest.mark.parametrize(
    "cluster, colocated, ranks",
    [
        ({"num_nodes": 1, "gpus_per_node": 8}, None, 8),
        ({"num_nodes": 2, "gpus_per_node": 8}, {"enabled": True}, 16),
        ({"num_nodes": 1, "gpus_per_node": 8}, {"enabled": False, "resources": {"gpus_per_node": 6}}, 2),
        ({"num_nodes": 1, "gpus_per_node": 2}, {"enabled": False, "resources": {"gpus_per_node": 1}}, 1),
        ({"num_nodes": 3, "gpus_per_node": 4}, {"enabled": False, "resources": {"num_nodes": 1}}, 8),
        ({"num_nodes": "${oc.env:NODES}", "gpus_per_node": 8}, None, None),
        ({}, None, None),
    ],
)
def test_training_ranks_as_nemo_rl_sizes_its_train_cluster(cluster, colocated, ranks):
    cfg = {"cluster": cluster, "policy": {"generation": {"colocated": colocated}} if colocated else {}}
    assert training_ranks(cfg) == ranks


def test_unknown_is_what_an_unsettled_recipe_gives():
    refusal = run_time_refusal("data_parallel_group")
    config = RSClippedPGLossConfig.from_any(
        {**BASE["loss_fn"], "name": None, "is_batch_normalization": "data_parallel"}
    )
    assert isinstance(refusal.from_recipe({}, config), Unknown)
