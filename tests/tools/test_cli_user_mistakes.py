"""``nemo-rs`` and the Python API on the mistakes users make: each is one clear line, a warning, or fixed.

Each case gave a traceback, a silently wrong or ignored result, or a misleading message before:
sizes too large to allocate; outputs that cannot be written or that would overwrite the input
or each other; a directory given as a file; flags that did nothing; lab counts beyond the batch;
the Python API's data given as a list; pydantic's "valid tuple" wording for a mapping where
stages go; recipe YAML (duplicate keys, merge keys, interpolations); the tools' own synthetic
batches tripping the positive-log-prob warning; an option spelt with '=' taken for an override;
Hydra's ``+``/no-``+`` rule; a recipe whose ``loss_fn`` lives in unresolved defaults; a seed too
large for torch; an output stream or folder that cannot be written; repeated
seeds/configs/presets; a calibration from too few units or above the unhealthy share;
``--venvs`` with ``--no-workers``; an archive given as the NeMo-RL checkout; a blank
configuration name.
"""

from __future__ import annotations

import io
import json
import os
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch

from nemo_rs_plugin import CorrectedPGLoss
from nemo_rs_plugin.cli import main
from nemo_rs_plugin.core.batch.input_checks import InputWarning
from nemo_rs_plugin.core.settings.config import ConfigError
from nemo_rs_plugin.lab import cli as lab
from nemo_rs_plugin.tools.recipes import list_recipes
from nemo_rs_plugin.tools.simulate import MismatchModel, synthetic_batch

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


@pytest.mark.parametrize(
    "model",
    [
        MismatchModel(responses=8, length=256),
        MismatchModel(responses=8, length=256, mismatch=0.5, seed=3),
        MismatchModel(responses=8, length=256, outlier_rate=0.05, staleness=0.3, seed=1),
    ],
    ids=["default", "large-mismatch", "outliers-and-staleness"],
)
def test_synthetic_batches_hold_log_probs_only(model):
    """gen = prev - d stays <= 0: the tools' own batches never trip the loss's input warning."""
    for step in range(3):
        batch = synthetic_batch(model, step)
        assert batch["generation_logprobs"].max() <= 0 and batch["prev_logprobs"].max() <= 0


def test_simulate_and_check_of_every_shipped_recipe_do_not_warn_about_inputs(capsys):
    with warnings.catch_warnings():
        warnings.simplefilter("error", InputWarning)
        assert main(["simulate", "--responses", "4", "--length", "256", "--mismatch", "0.5", "--steps", "2"]) == 0
        for recipe in list_recipes():
            assert main(["check", str(recipe), "--mismatch", "0.5"]) in (0, 3), capsys.readouterr().err
    assert "InputWarning" not in capsys.readouterr().err


def test_an_option_spelt_with_equals_is_not_an_override(capsys):
    recipe = str(list_recipes()[0])
    with pytest.raises(SystemExit) as exit_info:
        main(["check", recipe, "--loss_fn.ratio_clip_max=0.3"])
    assert exit_info.value.code == 2
    assert "overrides are written without dashes" in capsys.readouterr().err


@pytest.fixture
def whole_recipe(tmp_path):
    """A recipe with no defaults: every key it has is known, so Hydra's struct rules apply."""
    path = tmp_path / "whole.yaml"
    path.write_text("grpo:\n  max_num_steps: 10\nloss_fn:\n  name: rs_clipped_pg\n  ratio_clip_max: 0.2\n")
    return str(path)


@pytest.mark.parametrize(
    "override, needle",
    [
        ("+loss_fn.ratio_clip_max=0.3", "loss_fn.ratio_clip_max is already in the recipe; to change it, write"),
        ("grpo.max_num_stepz=10", "grpo.max_num_stepz is not in the recipe; to add it, write +grpo.max_num_stepz"),
        ("loss_fn.rejection_sampling.0.upper=1.01", "there is no list at loss_fn.rejection_sampling to index"),
    ],
)
def test_hydras_plus_rule_without_nemo_rl(capsys, whole_recipe, override, needle, monkeypatch):
    monkeypatch.setattr("nemo_rs_plugin.tools.recipe_loading._find_nemo_rl", lambda path, report: (False, None))
    one_error(capsys, ["check", whole_recipe, override], needle)


def test_changing_adding_and_forcing_keys_that_fit_the_rule(capsys, whole_recipe, monkeypatch):
    monkeypatch.setattr("nemo_rs_plugin.tools.recipe_loading._find_nemo_rl", lambda path, report: (False, None))
    for override in ("loss_fn.ratio_clip_max=0.3", "+grpo.val_period=5", "++loss_fn.ratio_clip_max=0.25"):
        assert main(["check", whole_recipe, override]) == 0, capsys.readouterr().err


def test_a_recipe_whose_loss_fn_is_in_unresolved_defaults_is_not_checked_not_wrong(capsys, tmp_path):
    recipe = tmp_path / "only-defaults.yaml"
    recipe.write_text("defaults: ../../grpo_math_1B.yaml\ngrpo:\n  max_num_steps: 3\n")
    assert main(["check", str(recipe)]) == 3
    out, err = capsys.readouterr()
    assert "error:" not in err and "not checked: loss_fn: not in this file" in err, err
    assert "correction pipeline:" not in out  # no empty header


def test_a_seed_beyond_torchs_range_is_one_line(capsys):
    one_error(capsys, ["simulate", "--seed", "100000000000000000000000"], "--seed: got 100000000000000000000000")


def test_an_output_stream_that_cannot_be_written_is_one_line(capsys, monkeypatch):
    class Full(io.StringIO):
        def write(self, text):
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(sys, "stdout", Full())
    assert main(["reference"]) == 1
    # main() leaves stdout on an open os.devnull (a process exits next); in this process, close it.
    assert sys.stdout.name == os.devnull
    sys.stdout.close()
    assert "error: cannot write the output: No space left on device" in capsys.readouterr().err


def test_an_unrelated_os_error_is_not_worded_as_an_output_failure(monkeypatch):
    """Only a full disk or a closed pipe on the output stream is; any other error stays itself."""

    def fail(args):
        raise FileNotFoundError(2, "No such file or directory", "/some/input")

    monkeypatch.setattr("nemo_rs_plugin.tools.reference_command.run", fail)
    with pytest.raises(FileNotFoundError):
        main(["reference"])


def test_lab_out_that_cannot_be_created_is_one_line(capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "transformers", types.ModuleType("transformers"))  # the lab checks it first

    def refuse(path, exist_ok=False):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(lab.os, "makedirs", refuse)
    assert lab.main(["--quick", "--out", str(tmp_path / "labx")]) == 2
    err = capsys.readouterr().err
    assert "error: --out: got" in err and "cannot be created (Permission denied)" in err and "Traceback" not in err


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--seeds", "1", "1"], "--seeds: 1 given more than once"),
        (["--configs", "none", "none"], "--configs: none given more than once"),
        (["--configs", ""], "unknown configuration(s) ''"),
    ],
)
def test_lab_refuses_repeated_seeds_and_configs(argv, needle, tmp_path):
    args = lab.build_parser().parse_args([*argv, "--out", str(tmp_path / "o")])
    problems = lab.settings_problems(lab.settings_from(args), args)
    assert any(needle in p for p in problems), problems


@pytest.fixture
def small_dump(tmp_path):
    def write(sequences):
        path = tmp_path / f"dump{sequences}.jsonl"
        with open(path, "w") as fh:
            for i in range(sequences):
                gen = [-1.0 - 0.01 * t for t in range(20)]
                fh.write(json.dumps({"prev_logprobs": [g + (i - 3) / 100 for g in gen], "generation_logprobs": gen}))
                fh.write("\n")
        return str(path)

    return write


def test_calibrate_refuses_a_repeated_preset(capsys, small_dump):
    one_error(capsys, ["calibrate", "--from", small_dump(64), "--filters", "geo-rs", "geo-rs"], "geo-rs given more")


def test_calibrate_warns_about_too_few_units_and_an_unhealthy_target(capsys, small_dump):
    # Below MIN_UNITS it is an error (tests/tools/test_newcomer_edges.py); --allow-few prints it, warned.
    assert main(["calibrate", "--from", small_dump(1), "--allow-few"]) == 0
    assert "stage 0: only 1 units in --from; at least 40 are needed" in capsys.readouterr().err
    assert main(["calibrate", "--from", small_dump(64), "--target", "0.5", "--allow-tighter"]) == 0
    err = capsys.readouterr().err
    assert "--target 0.5 rejects more than the 20% of sequences" in err and "only" not in err


def test_doctor_says_venvs_does_nothing_without_workers():
    from nemo_rs_plugin.tools.doctor import run_checks

    out = io.StringIO()
    run_checks(venvs="/tmp", workers=False, out=out)
    assert "warn workers: --venvs /tmp does nothing with --no-workers" in out.getvalue()


def test_an_archive_given_as_the_checkout_is_named(capsys, tmp_path):
    archive = tmp_path / "nemo-rl-main.tar.gz"
    archive.write_bytes(b"\x1f\x8b")
    recipe = Path(list_recipes()[0])
    one_error(capsys, ["check", str(recipe), "--nemo-rl", str(archive)], "it is a file (an archive?)")


def test_exported_recipes_whose_defaults_do_not_resolve_get_a_note(capsys, tmp_path):
    assert main(["recipes", "--out", str(tmp_path / "a" / "b")]) == 0
    err = capsys.readouterr().err
    assert "note: the exported recipes' defaults (" in err and "pass --nemo-rl PATH" in err, err


def test_simulate_from_says_how_many_valid_tokens_were_not_finite(capsys, tmp_path):
    dump = tmp_path / "nan.jsonl"
    dump.write_text(
        '{"prev_logprobs": [-1.0, NaN, -0.5], "generation_logprobs": [-1.1, -0.4, -0.45]}\n'
        '{"prev_logprobs": [-1.0, -0.2], "generation_logprobs": [null, -0.25]}\n'
    )
    assert main(["simulate", "--from", str(dump)]) == 0
    assert "2 sequences, 2 valid token(s) with a non-finite log-prob (null/NaN)" in capsys.readouterr().out


@pytest.mark.parametrize(
    "second, said",
    [
        ("-Infinity, -0.25", "1 valid token(s) with a non-finite log-prob (infinite)"),
        ("null, -Infinity", "2 valid token(s) with a non-finite log-prob (null/NaN or infinite)"),
    ],
)
def test_simulate_from_does_not_call_an_infinity_null_or_nan(capsys, tmp_path, second, said):
    dump = tmp_path / "inf.jsonl"
    dump.write_text(
        '{"prev_logprobs": [-1.0, -0.3, -0.5], "generation_logprobs": [-1.1, -0.4, -0.45]}\n'
        f'{{"prev_logprobs": [-1.0, -0.2, -0.3], "generation_logprobs": [-1.0, {second}]}}\n'
    )
    assert main(["simulate", "--from", str(dump)]) == 0
    assert said in capsys.readouterr().out
