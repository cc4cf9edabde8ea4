"""Guards the fixes of a third round of user mistakes (116 tried, 26 answered badly before).

Each case gave a traceback, a silently wrong or ignored input, or a misleading message: the
tools' own synthetic batches tripping the positive-log-prob warning, an option spelt with '='
taken for an override, Hydra's ``+``/no-``+`` rule, a recipe whose ``loss_fn`` lives in
unresolved defaults, a seed too large for torch, an output stream that cannot be written, an
output folder that cannot be created, repeated seeds/configs/presets, a calibration from too
few units or above the unhealthy share, ``--venvs`` with ``--no-workers``, an archive given as
the NeMo-RL checkout, a blank configuration name.
"""

from __future__ import annotations

import io
import json
import sys
import types
import warnings
from pathlib import Path

import pytest

from nemo_rs_plugin.core.input_checks import InputWarning
from nemo_rs_plugin.tools import lab
from nemo_rs_plugin.tools.cli import main
from nemo_rs_plugin.tools.recipes import list_recipes
from nemo_rs_plugin.tools.simulate import MismatchModel, synthetic_batch
from tests.tools.test_cli_mistakes_round2 import one_error


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
    assert "error: cannot write the output: No space left on device" in capsys.readouterr().err


def test_an_unrelated_os_error_is_not_worded_as_an_output_failure(monkeypatch):
    """Only a full disk or a closed pipe on the output stream is; any other error stays itself."""

    def fail(args):
        raise FileNotFoundError(2, "No such file or directory", "/some/input")

    monkeypatch.setattr("nemo_rs_plugin.tools.cli._cmd_reference", fail)
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
