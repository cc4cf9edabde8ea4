"""Guards the fixes of a second round of user mistakes (tracebacks and silent results).

Each case was a traceback or a silently wrong result before: sizes too large to allocate,
outputs that cannot be written or that would overwrite the input or each other, a directory
given as a file, flags that did nothing, lab counts beyond the batch, the Python API's data
given as a list, and pydantic's "valid tuple" wording for a mapping where stages go.
"""

import json

import pytest
import torch

from nemo_rs_plugin import CorrectedPGLoss
from nemo_rs_plugin.core.config import ConfigError
from nemo_rs_plugin.tools.cli import main

RECIPE = "recipes/grpo-qwen3-30ba3b-4n8g-megatron-tp4ep8-32k-rs.yaml"


@pytest.fixture
def dump(tmp_path):
    path = tmp_path / "dump.jsonl"
    path.write_text(json.dumps({"prev_logprobs": [-1.0, -0.5], "generation_logprobs": [-1.1, -0.4]}) + "\n")
    return str(path)


def one_error(capsys, argv, needle, status=2):
    """``nemo-rs ARGV`` exits with ``status`` and prints exactly one ``error:`` line holding ``needle``."""
    assert main(argv) == status
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in err, err


def test_sizes_too_large_to_simulate_are_refused_before_allocating(capsys):
    one_error(capsys, ["simulate", "--length", "1000000000"], "--responses x --length: got 16 x 1000000000")
    one_error(capsys, ["check", RECIPE, "--response-tokens", "1000000000"], "--response-tokens: got 1000000000")


def test_outputs_that_would_destroy_the_input_or_each_other(capsys, dump, tmp_path):
    one_error(capsys, ["simulate", "--from", dump, "--csv", dump], "is the --from file")
    out = str(tmp_path / "o.csv")
    one_error(capsys, ["simulate", "--from", dump, "--csv", out, "--json", out], "both name")


def test_calibrate_json_is_checked_before_the_work(capsys, dump, tmp_path):
    one_error(capsys, ["calibrate", "--from", dump, "--json", str(tmp_path)], "is a directory")
    one_error(capsys, ["calibrate", "--from", dump, "--json", str(tmp_path / "no" / "b.json")], "does not exist")


def test_a_directory_given_as_the_dump(capsys, tmp_path):
    one_error(capsys, ["simulate", "--from", str(tmp_path)], "a folder without records (stepNNNNNN-dpRRR-mbMMM.pt)")


def test_recipes_flags_that_did_nothing(capsys):
    one_error(capsys, ["recipes", "--force"], "--force: without --out")
    one_error(capsys, ["recipes", "--out", ""], "--out: got an empty path")


def test_lab_out_that_cannot_be_created_and_counts_beyond_the_batch(capsys, tmp_path):
    afile = tmp_path / "f.txt"
    afile.write_text("x")
    one_error(capsys, ["lab", "--quick", "--out", str(afile / "sub")], "cannot be created")
    out = str(tmp_path / "o")
    one_error(capsys, ["lab", "--quick", "--out", out, "--minibatches", "100"], "--minibatches: got 100")
    one_error(capsys, ["lab", "--quick", "--out", out, "--microbatches", "9"], "--microbatches: got 9")


def test_api_data_as_a_list_and_stages_as_a_mapping():
    with pytest.raises(TypeError, match="data: got list; expected NeMo-RL's data dict"):
        CorrectedPGLoss({})(torch.zeros(2, 3), [{}], 1, 1)
    with pytest.raises(ConfigError, match="allowed: a list of stages"):
        CorrectedPGLoss({"rejection_sampling": {"level": "sequence", "upper": 1.01}})


def test_a_duplicate_key_in_a_recipe_is_refused(capsys, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "loss_fn:\n  name: rs_clipped_pg\n  is_correction_level: sequence\n  is_correction_level: sequence_mean\n"
    )
    one_error(capsys, ["check", str(recipe)], "duplicate key 'is_correction_level'")


def test_a_misspelt_field_of_a_torch_dump_is_refused(capsys, tmp_path):
    path = tmp_path / "s.pt"
    torch.save(
        {"prev_logprobs": -torch.rand(2, 5), "generation_logprobs": -torch.rand(2, 5), "token_masks": torch.ones(2, 5)},
        path,
    )
    one_error(capsys, ["simulate", "--from", str(path)], "field 'token_masks' is not read; did you mean 'token_mask'?")


def test_a_merge_key_may_override_what_it_merges(capsys, tmp_path):
    """``<<: *anchor`` then an explicit key is YAML's override, not a duplicate (NeMo-RL's configs use it)."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "base: &base {ratio_clip_min: 0.2, ratio_clip_max: 0.2}\n"
        "loss_fn:\n  <<: *base\n  name: rs_clipped_pg\n  ratio_clip_max: 0.28\n"
    )
    main(["check", str(recipe)])
    assert "duplicate key" not in capsys.readouterr().err


def test_an_interpolation_is_resolved_or_left_unchecked_never_refused(capsys, tmp_path, monkeypatch):
    """``${...}`` is OmegaConf's (NeMo-RL loads recipes with it); without NeMo-RL, check must not call it a string."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "loss_fn:\n  name: rs_clipped_pg\n  ratio_clip_min: 0.2\n  ratio_clip_max: ${loss_fn.ratio_clip_min}\n"
        "  ratio_clip_c: ${mul:2,3}\n"
    )
    monkeypatch.setattr("nemo_rs_plugin.tools.recipe_loading._find_nemo_rl", lambda path, report: (False, None))
    assert main(["check", str(recipe)]) == 3  # no error; not fully checked
    err = capsys.readouterr().err
    assert "error:" not in err and "a string" not in err, err
    # NeMo-RL's own resolvers (mul) are not registered here: that field is named as not checked
    assert "not checked: loss_fn.ratio_clip_c: the interpolation ${mul:2,3} does not resolve" in err, err
    omegaconf = pytest.importorskip("omegaconf", reason="without OmegaConf every interpolation stays unchecked")
    assert omegaconf and "loss_fn.ratio_clip_max" not in err, err  # resolved to 0.2 by OmegaConf


def test_doctor_names_a_venvs_directory_that_does_not_exist(tmp_path):
    """Named even where NeMo-RL is absent (the worker check that reads --venvs never runs then)."""
    import io

    from nemo_rs_plugin.tools.doctor import run_checks

    out = io.StringIO()
    missing = tmp_path / "no-venvs"
    assert run_checks(venvs=str(missing), out=out) >= 1
    assert f"FAIL workers: --venvs {missing}: no such directory" in out.getvalue(), out.getvalue()
    out = io.StringIO()
    run_checks(venvs=str(tmp_path), out=out)  # an existing directory: no such line
    assert "no such directory" not in out.getvalue()
