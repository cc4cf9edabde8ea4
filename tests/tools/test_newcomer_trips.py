"""What a new user still tripped on (a review of 305 first attempts): each is a true, clear line.

Interpolations from elsewhere in the recipe (with OmegaConf and without it: named, never a false
error), ``name: clipped_pg`` said once and truly, outputs that are one file under two names,
``calibrate --recipe`` naming the stage, field and value and taking overrides, the core loss
asked to record, non-finite log-probs dropped by calibration, ``NEMO_RS_PLUGIN_DISABLE`` seen by
``check``, NeMo-RL's own interpolations in one line, and the docs' veto, fallback length and help.
"""

from __future__ import annotations

import json
import os
import re
import sys
import warnings
from pathlib import Path

import pytest
import torch
import yaml

from nemo_rs_plugin.cli import EXIT_INVALID, EXIT_UNCHECKED, build_parser, main
from nemo_rs_plugin.core.loss import CorrectedPGLoss
from nemo_rs_plugin.core.settings.config import ConfigWarning, RSClippedPGLossConfig
from nemo_rs_plugin.nemo_rl.recording import LogprobRecorder
from nemo_rs_plugin.tools import recipe_yaml
from nemo_rs_plugin.tools.correction_warnings import FALLBACK_RESPONSE_TOKENS

REPO = Path(__file__).resolve().parents[2]
BAND = "    - level: sequence\n      statistic: ratio\n      agg: mean\n      lower: {lower}\n      upper: {upper}\n"
LOSS = (
    "loss_fn:\n  name: rs_clipped_pg\n  is_correction_level: sequence_mean\n"
    "  use_importance_sampling_correction: true\n"
)


@pytest.fixture(autouse=True)
def no_nemo_rl(monkeypatch):
    """NeMo-RL not importable: the plugin's own loader reads the recipe."""
    for k in [k for k in sys.modules if k == "nemo_rl" or k.startswith("nemo_rl.")]:
        monkeypatch.delitem(sys.modules, k)
    monkeypatch.setitem(sys.modules, "nemo_rl", None)
    monkeypatch.delenv("NEMO_RS_PLUGIN_DISABLE", raising=False)


@pytest.fixture
def no_omegaconf(monkeypatch):
    """OmegaConf not importable (an install without the plugin's dependencies)."""
    for k in [k for k in sys.modules if k == "omegaconf" or k.startswith("omegaconf.")]:
        monkeypatch.delitem(sys.modules, k)
    monkeypatch.setitem(sys.modules, "omegaconf", None)


def band_recipe(tmp_path, lower, upper, grpo="grpo:\n  band_lo: 0.99\n  band_hi: 1.01\n", name="r.yaml"):
    path = tmp_path / name
    path.write_text(grpo + LOSS + "  rejection_sampling:\n" + BAND.format(lower=lower, upper=upper))
    return str(path)


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def lines(text, start):
    return [line for line in text.splitlines() if line.startswith(start)]


def logprob_dump(path, sequences=32, tokens=40, nonfinite_rows=0, seed=0):
    g = torch.Generator().manual_seed(seed)
    prev = -torch.rand(sequences, tokens + 1, generator=g)
    gen = (prev + 0.01 * torch.randn(sequences, tokens + 1, generator=g)).clamp_max(0)
    gen[:nonfinite_rows, 5] = float("nan")
    data = {
        "prev_logprobs": prev,
        "generation_logprobs": gen,
        "token_mask": torch.ones(sequences, tokens + 1),
        "advantages": torch.ones(sequences),
        "sample_mask": torch.ones(sequences),
    }
    torch.save(data, path)
    return str(path), data


# ----------------------------------------------------------------------------- (a) interpolations
def test_bounds_from_elsewhere_in_the_recipe_are_resolved_in_check_json_and_simulate(capsys, tmp_path):
    recipe = band_recipe(tmp_path, "${grpo.band_lo}", "${grpo.band_hi}")
    code, out, err = run(capsys, "check", recipe)
    assert code == EXIT_UNCHECKED and not lines(err, "error:"), err  # only NeMo-RL itself is not checked
    [unchecked] = lines(err, "not checked:")
    assert "NeMo-RL is not installed" in unchecked
    assert "is in [0.99, 1.01]" in out, out
    code, out, _ = run(capsys, "check", recipe, "--json")
    assert json.loads(out)["errors"] == [] and code == EXIT_UNCHECKED
    code, out, err = run(capsys, "simulate", "--recipe", recipe, "--steps", "1", "--length", "16")
    assert code == 0 and "r.yaml" in out, err


@pytest.mark.parametrize("lower", ["0.99", "${grpo.band_lo}"])
def test_without_omegaconf_an_interpolation_is_named_never_a_false_error(capsys, tmp_path, no_omegaconf, lower):
    recipe = band_recipe(tmp_path, lower, "${grpo.band_hi}")
    for argv in (["check", recipe], ["check", recipe, "--json"]):
        code, out, err = run(capsys, *argv)
        assert code == EXIT_UNCHECKED, (out, err)
        text = "\n".join(json.loads(out)["unchecked"]) if "--json" in argv else err
        assert "a filter needs at least one bound" not in out + err and "error:" not in err, (out, err)
        [line] = [u for u in text.splitlines() if "loss_fn.rejection_sampling.0.upper" in u]
        assert "${grpo.band_hi}" in line and "OmegaConf is not importable" in line, line
        assert "pip install omegaconf" in line, line
        if lower != "0.99":
            [line] = [u for u in text.splitlines() if "loss_fn.rejection_sampling.0.lower" in u]
            assert "${grpo.band_lo}" in line, line
    code, out, err = run(capsys, "check", recipe)
    assert "correction pipeline" not in out, out  # a band without its upper bound is not the recipe's
    code, _, err = run(capsys, "simulate", "--recipe", recipe, "--steps", "1", "--length", "16")
    assert code == EXIT_INVALID, err
    [line] = [e for e in lines(err, "error:") if ".0.upper" in e]  # and one for the lower bound where it is one
    assert "loss_fn.rejection_sampling.0.upper: the interpolation ${grpo.band_hi}" in line, line
    assert "simulate needs its value" in line, line


def test_an_undefined_interpolation_is_an_error_naming_it_in_every_command(capsys, tmp_path):
    recipe = band_recipe(tmp_path, "${grpo.band_lo}", "${grpo.band_high}")
    dump, _ = logprob_dump(tmp_path / "d.pt")
    for argv in (
        ["check", recipe],
        ["simulate", "--recipe", recipe, "--steps", "1", "--length", "16"],
        ["calibrate", "--from", dump, "--recipe", recipe],
    ):
        code, out, err = run(capsys, *argv)
        assert code == EXIT_INVALID, (argv, out, err)
        [line] = lines(err, "error:")
        assert "loss_fn.rejection_sampling.0.upper: the interpolation ${grpo.band_high}" in line, line
        assert "'grpo.band_high' not found" in line, line
    code, out, _ = run(capsys, "check", recipe, "--json")
    [error] = json.loads(out)["errors"]
    assert "${grpo.band_high}" in error and code == EXIT_INVALID


def test_a_loss_field_only_nemo_rl_resolves_is_not_checked_here_and_not_simulated(capsys, tmp_path):
    recipe = band_recipe(tmp_path, "0.99", "${mul:1.01,1}")
    code, out, err = run(capsys, "check", recipe)
    assert code == EXIT_UNCHECKED and not lines(err, "error:"), err
    [line] = [u for u in lines(err, "not checked:") if "upper" in u]
    assert "${mul:1.01,1}" in line and "NeMo-RL's resolver mul" in line, line
    assert "+inf" not in out and "correction pipeline" not in out, out  # not the band [0.99, inf]
    code, out, err = run(capsys, "simulate", "--recipe", recipe, "--steps", "1", "--length", "16")
    assert code == EXIT_INVALID and "loss_fn.rejection_sampling.0.upper" in err, (out, err)


def test_a_number_reads_as_nemo_rls_loader_reads_it(capsys, tmp_path):
    """OmegaConf (NeMo-RL's load_config) reads 1e-4 as a number; PyYAML alone as a string."""
    recipe = band_recipe(tmp_path, "1e-4", "1e4", grpo="grpo: {}\n")
    code, out, err = run(capsys, "check", recipe)
    assert code == EXIT_UNCHECKED and not lines(err, "error:"), err
    assert "[0.0001, 10000]" in out, out


def test_the_plain_loader_reads_scalars_as_omegaconf_does():
    from omegaconf import OmegaConf

    text = "".join(
        f"k{i}: {v}\n"
        for i, v in enumerate(
            ["1e-4", "1e4", "1.0e4", "-2E+3", ".5", "1_000", "2024-01-01", "0x1F", ".inf", "-.inf", "yes", "'1e-4'"]
            + ["12:30", "1.5", "1_0.5e-3", "+7", "null", "~", "true", "1e", "e4", "1.0e+4"]
        )
    )
    ours = yaml.load(text, Loader=recipe_yaml._RecipeLoader)  # noqa: S506 - a SafeLoader subclass
    assert ours == OmegaConf.to_container(OmegaConf.create(text)), ours


# ----------------------------------------------------------------------------- (b) clipped_pg
@pytest.mark.parametrize("name", ["name: clipped_pg, ", ""])
def test_nemo_rls_own_loss_is_said_once_and_truly(capsys, tmp_path, name):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"grpo: {{}}\nloss_fn: {{{name}ratio_clip_min: 0.2, ratio_clip_max: 0.28}}\n")
    code, out, err = run(capsys, "check", str(recipe))
    assert code == EXIT_UNCHECKED, err
    assert lines(out, "note: loss_fn") == [
        f"note: loss_fn {'names clipped_pg' if name else 'has no name'}: NeMo-RL's own ClippedPGLossFn is used"
    ], out
    assert not lines(out, "warning:"), out


# ----------------------------------------------------------------------------- (c) one file, two names
@pytest.mark.parametrize("alias", ["same", "dot", "symlink", "hardlink"])
def test_two_outputs_naming_one_file_exit_2(capsys, tmp_path, alias, monkeypatch):
    monkeypatch.chdir(tmp_path)
    first = tmp_path / "table.out"
    first.write_text("")
    second = {"same": "table.out", "dot": "./table.out", "symlink": "link.out", "hardlink": "hard.out"}[alias]
    if alias == "symlink":
        os.symlink(first, tmp_path / second)
    elif alias == "hardlink":
        os.link(first, tmp_path / second)
    code, _, err = run(capsys, "simulate", "--steps", "1", "--length", "16", "--csv", "table.out", "--json", second)
    assert code == EXIT_INVALID, err
    assert lines(err, "error:") == [
        "error: --csv and --json: both name table.out"
        + ("" if alias == "same" else f" (as {second})")
        + "; one would overwrite the other: name two files"
    ], err
    assert first.read_text() == ""


def test_an_output_linked_to_the_from_file_is_refused(capsys, tmp_path):
    dump, _ = logprob_dump(tmp_path / "d.pt")
    os.symlink(dump, tmp_path / "link.json")
    before = Path(dump).read_bytes()
    code, _, err = run(capsys, "simulate", "--from", dump, "--json", str(tmp_path / "link.json"))
    assert code == EXIT_INVALID and "is the --from file" in err, err
    code, _, err = run(capsys, "calibrate", "--from", dump, "--json", str(tmp_path / "link.json"))
    assert code == EXIT_INVALID and "is the --from file" in err, err
    assert Path(dump).read_bytes() == before


# ----------------------------------------------------------------------------- (d) calibrate --recipe
def test_calibrate_names_the_stage_field_value_and_allowed_values(capsys, tmp_path):
    recipe = band_recipe(tmp_path, "0.99", "1.01", grpo="grpo: {}\n")
    Path(recipe).write_text(Path(recipe).read_text().replace("statistic: ratio", "statistic: ratios"))
    dump, _ = logprob_dump(tmp_path / "d.pt")
    code, _, err = run(capsys, "calibrate", "--from", dump, "--recipe", recipe)
    assert code == EXIT_INVALID, err
    [line] = lines(err, "error:")
    assert f"--recipe {recipe}: loss_fn.rejection_sampling.0.statistic: got 'ratios';" in line, line
    assert "'ratio'" in line and "'kl_k3'" in line, line  # the allowed values
    _, _, check_err = run(capsys, "check", recipe)
    assert line.split(f"--recipe {recipe}: ", 1)[1] in check_err  # check's own words


def test_calibrate_takes_overrides_after_a_recipe(capsys, tmp_path):
    recipe = band_recipe(tmp_path, "0.99", "1.01", grpo="grpo: {}\n")
    dump, _ = logprob_dump(tmp_path / "d.pt")
    override = "loss_fn.rejection_sampling.0.upper=1.5"
    code, out, err = run(capsys, "calibrate", "--from", dump, "--recipe", recipe, override, "--target", "0.1")
    assert code == 0, err
    assert "as written [0.99, 1.5]" in out, out
    code, _, err = run(capsys, "calibrate", "--from", dump, "--recipe", recipe, "loss_fn.nope=1")
    assert code == EXIT_INVALID and "override 'loss_fn.nope=1'" in err, err
    with pytest.raises(SystemExit) as exc:
        main(["calibrate", "--from", dump, override])
    assert exc.value.code == 2
    assert "overrides apply to a recipe: add --recipe FILE" in capsys.readouterr().err


# ----------------------------------------------------------------------------- (e) the core loss and recording
def test_the_core_loss_asked_to_record_says_it_records_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.warns(ConfigWarning, match="CorrectedPGLoss records nothing") as caught:
        CorrectedPGLoss({"record_logprobs": True, "record_dir": "runs", "record_every": 2})
    assert "LogprobRecorder" in str(caught[0].message) and "docs/cli.md#recording-outside-nemo-rl" in str(
        caught[0].message
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a host that records hands over the validated config: no warning
        CorrectedPGLoss(RSClippedPGLossConfig(record_logprobs=True), per_call_metrics=False)
    assert not os.listdir(tmp_path)


def test_check_of_a_recording_recipe_does_not_warn_about_its_own_estimate(capsys, tmp_path):
    recipe = band_recipe(tmp_path, "0.99", "1.01", grpo="grpo: {}\n")
    Path(recipe).write_text(
        Path(recipe).read_text().replace("  name: rs_clipped_pg\n", "  name: rs_clipped_pg\n  record_logprobs: true\n")
    )
    code, out, err = run(capsys, "check", recipe)
    assert code == EXIT_UNCHECKED and "records nothing" not in out + err, (out, err)


def test_the_docs_recording_example_runs_and_calibrate_reads_it(capsys, tmp_path, monkeypatch):
    text = (REPO / "docs" / "cli.md").read_text()
    section = text[text.index('<a id="recording-outside-nemo-rl"></a>') :]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "docs/cli.md", "exec"), {})
    (run_id,) = os.listdir(tmp_path / "my-records")  # the recorder's run, in its own folder
    records = sorted(os.listdir(tmp_path / "my-records" / run_id))
    assert records == ["manifest.json", "step000000-dp000-mb000.pt", "step000001-dp000-mb000.pt"]
    capsys.readouterr()
    status, out, err = run(capsys, "calibrate", "--from", "my-records", "--allow-few")
    assert status == 0 and "my-records: 8 sequences" in out, err


# ----------------------------------------------------------------------------- (f) non-finite log-probs
def test_calibrate_says_how_many_sequences_it_leaves_out_and_why(capsys, tmp_path):
    records = tmp_path / "records"
    _, data = logprob_dump(tmp_path / "d.pt", nonfinite_rows=30)
    LogprobRecorder(str(records), every=1, writer=lambda: (True, 0)).observe(torch.tensor(1.0), data)
    code, _, err = run(capsys, "calibrate", "--from", str(records))
    assert code == EXIT_INVALID, err  # 2 sequences left: no calibration
    [warning] = lines(err, "warning:")
    assert "30 of the 32 sequences" in warning and "non-finite log-prob" in warning, warning
    assert "whatever the bounds" in warning, warning
    code, out, err = run(capsys, "calibrate", "--from", str(records), "--filters", "token-mis")
    assert code == 0 and lines(err, "warning:") == [warning], err


# ----------------------------------------------------------------------------- (g) NEMO_RS_PLUGIN_DISABLE
def test_check_reports_the_plugin_switched_off_as_the_run_would(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("NEMO_RS_PLUGIN_DISABLE", "1")
    recipe = band_recipe(tmp_path, "0.99", "1.01", grpo="grpo: {}\n")
    code, out, err = run(capsys, "check", recipe)
    assert code == EXIT_INVALID, (out, err)
    [line] = lines(err, "error:")
    assert "NEMO_RS_PLUGIN_DISABLE=1" in line and "PluginDisabledError" in line, line
    own = tmp_path / "own.yaml"
    own.write_text("grpo: {}\nloss_fn: {ratio_clip_max: 0.28}\n")
    code, out, err = run(capsys, "check", str(own))
    assert code == EXIT_UNCHECKED and "note: NEMO_RS_PLUGIN_DISABLE=1 is set here" in out, (out, err)


# ----------------------------------------------------------------------------- (h) NeMo-RL's own interpolations
def test_nemo_rls_own_interpolations_are_one_not_checked_line(capsys, tmp_path):
    (tmp_path / "base.yaml").write_text(
        "policy:\n  max_total_sequence_length: 512\n  train_micro_batch_size: 1\n  logprob_batch_size: 2\n"
        "  dynamic_batching:\n    train_mb_tokens: ${mul:${policy.max_total_sequence_length}, "
        "${policy.train_micro_batch_size}}\n    logprob_mb_tokens: ${mul:${policy.max_total_sequence_length}, "
        "${policy.logprob_batch_size}}\n  sequence_packing:\n    train_mb_tokens: ${mul:1, 2}\n"
        "  generation:\n    top_k: null\n    val_top_k: ${.top_k}\n"
    )
    recipe = tmp_path / "r.yaml"
    recipe.write_text("defaults: base.yaml\ngrpo: {}\n" + LOSS)
    code, _, err = run(capsys, "check", str(recipe))
    assert code == EXIT_UNCHECKED and not lines(err, "error:"), err
    [line] = [u for u in lines(err, "not checked:") if "NeMo-RL is not installed" not in u]
    assert line.startswith("not checked: 3 interpolation(s) outside loss_fn"), line
    for field in ("dynamic_batching.train_mb_tokens", "dynamic_batching.logprob_mb_tokens", "packing.train_mb"):
        assert field in line, line
    assert "NeMo-RL's resolver mul" in line and "val_top_k" not in err, err  # ${.top_k} resolves (to null)


# ----------------------------------------------------------------------------- (i) the docs
def test_the_troubleshooting_veto_pastes_into_a_recipe_that_any_yaml_reader_reads(capsys, tmp_path):
    text = (REPO / "docs" / "troubleshooting.md").read_text()
    [stage] = re.findall(r"`(\{level: sequence, agg: any, lower: [^`]*\})`", text)
    assert yaml.safe_load(stage) == {"level": "sequence", "agg": "any", "lower": 1e-4, "upper": 1e4}
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"grpo: {{}}\nloss_fn:\n  name: rs_clipped_pg\n  rejection_sampling:\n    - {stage}\n")
    code, _, err = run(capsys, "check", str(recipe))
    assert code == EXIT_UNCHECKED and not lines(err, "error:"), err


def test_checks_fallback_response_length_is_documented():
    text = " ".join((REPO / "docs" / "cli.md").read_text().split())
    assert f"else {FALLBACK_RESPONSE_TOKENS} tokens" in text


def test_simulate_help_names_the_records_folder_for_from():
    simulate = build_parser()._subparsers._group_actions[0].choices["simulate"]
    [action] = [a for a in simulate._actions if "--from" in a.option_strings]
    assert "record_dir" in action.help and action.metavar == "FILE|DIR", action
