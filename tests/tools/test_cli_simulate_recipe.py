"""``nemo-rs simulate --recipe FILE [overrides]``: a recipe's loss section next to the presets.

The recipe is loaded as ``check`` and ``calibrate --recipe`` load it (``defaults``, Hydra-style
overrides), its row is labelled by the file name, and it goes through the same table, CSV, JSON
and plot; what is wrong with it is an ``error:`` line before the run (docs/cli.md#--recipe-your-recipes-loss-section).
"""

from __future__ import annotations

import csv
import json

import pytest

from nemo_rs_plugin.cli import DEFAULT_CONFIG_NAMES, EXIT_INVALID, build_parser, main
from nemo_rs_plugin.core.settings import presets
from nemo_rs_plugin.tools import simulate as sim

SMALL = ["--responses", "6", "--length", "300", "--steps", "1"]


@pytest.fixture
def recipe(tmp_path):
    """``my.yaml`` inheriting the IS switch from ``base.yaml``; its band is overridden in the tests."""
    (tmp_path / "base.yaml").write_text(
        "grpo: {num_prompts_per_step: 2}\n"
        "loss_fn:\n  use_importance_sampling_correction: true\n  reference_policy_kl_penalty: 0.01\n"
    )
    path = tmp_path / "my.yaml"
    path.write_text(
        "defaults: base.yaml\n"
        "loss_fn:\n"
        "  name: rs_clipped_pg\n"
        "  is_correction_level: sequence_mean\n"
        "  record_logprobs: true\n"
        "  rejection_sampling:\n"
        "    - {level: sequence, statistic: ratio, agg: mean, lower: 0.99, upper: 1.01}\n"
    )
    return path


@pytest.fixture
def no_run(monkeypatch):
    def run(*args, **kwargs):
        raise AssertionError("the simulation ran before the recipe was checked")

    monkeypatch.setattr(sim, "run", run)


def error_lines(err):
    return [line for line in err.splitlines() if line.startswith("error: ")]


def test_the_recipe_row_is_its_loss_section_next_to_uncorrected_and_the_presets(recipe, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # record_logprobs: true must not write nemo-rs-records here
    out_csv, out_json = tmp_path / "t.csv", tmp_path / "t.json"
    argv = ["simulate", "--recipe", str(recipe), *SMALL, "loss_fn.rejection_sampling.0.upper=1.001"]
    assert main([*argv, "--csv", str(out_csv), "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    rows = list(csv.DictReader(out_csv.read_text().splitlines()))
    labels = [r["config"] for r in rows]
    assert labels == ["uncorrected", "my.yaml", *[c for c in sim.DEFAULT_CONFIGS if c != "uncorrected"]]
    assert any(line.startswith("my.yaml ") for line in out.splitlines())
    assert [r["config"] for r in json.loads(out_json.read_text())["rows"]] == labels
    assert not (tmp_path / "nemo-rs-records").exists()
    # The same numbers as the section written out by hand: inherited IS switch, the override's
    # band, no KL (as every row); the override bites (1.001 rejects more than 1.01 would).
    by_hand = {
        "reference_policy_kl_penalty": 0.0,
        "use_importance_sampling_correction": True,
        "is_correction_level": "sequence_mean",
        "rejection_sampling": [{**presets.GEO_RS, "upper": 1.001}],
    }
    model = sim.MismatchModel(responses=6, length=300)
    expected = sim.run({"by hand": by_hand}, [sim.synthetic_batch(model, 0)])[0]
    got = next(r for r in rows if r["config"] == "my.yaml")
    for column in sim.COLUMNS:
        assert float(got[column]) == pytest.approx(expected[column], rel=1e-6, abs=1e-9), column
    assert expected["seq_rejected"] > 0


def test_configs_pick_the_presets_and_the_recipe_row_stays(recipe, capsys):
    assert main(["simulate", "--recipe", str(recipe), *SMALL, "--configs", "token", "uncorrected"]) == 0
    rows = [line.split()[0] for line in capsys.readouterr().out.splitlines()[3:6]]
    assert rows == ["uncorrected", "my.yaml", "token"]


def test_the_recipe_runs_on_from_too(recipe, tmp_path, capsys):
    data = tmp_path / "lp.jsonl"
    data.write_text(
        "".join(
            json.dumps({"prev_logprobs": [-1.0, -0.5, -0.2], "generation_logprobs": [-1.0 + i / 50, -0.5, -0.2]}) + "\n"
            for i in range(4)
        )
    )
    assert main(["simulate", "--from", str(data), "--recipe", str(recipe), "--configs", "uncorrected"]) == 0
    assert [line.split()[0] for line in capsys.readouterr().out.splitlines()[3:5]] == ["uncorrected", "my.yaml"]


def test_a_label_taken_by_a_preset_is_marked_as_the_recipe(tmp_path, capsys):
    path = tmp_path / "token"
    path.write_text("loss_fn: {name: rs_clipped_pg}\n")
    assert main(["simulate", "--recipe", str(path), *SMALL, "--configs", "token"]) == 0
    assert "token (recipe)" in capsys.readouterr().out


@pytest.mark.parametrize(
    "text, overrides, needle",
    [
        ("grpo: {}\n", [], "--recipe {path}: no loss_fn section; simulate runs a recipe's loss section"),
        (
            "loss_fn: {name: rs_clipped_pg, is_correction_level: seq}\n",
            [],
            "--recipe {path}: loss_fn.is_correction_level: got 'seq'; Input should be",
        ),
        ("loss_fn: {name: rs_clipped_pg}\n", ["loss_fn.nope.x=1"], "--recipe: override 'loss_fn.nope.x=1'"),
        ("loss_fn: {name: rs_clipped_pg}\n", ["key"], "--recipe: override 'key': expected key=value"),
        ("loss_fn: {name: my_loss}\n", [], "--recipe {path}: loss_fn.name: got 'my_loss'; simulate runs"),
        ("loss_fn: {name: clipped_pg, rejection_sampling: []}\n", [], "--recipe {path}: loss_fn.rejection_sampling"),
        ("loss_fn: [1]\n", [], "--recipe {path}: loss_fn: got a list; expected a mapping"),
        ("defaults: gone.yaml\ngrpo: {}\n", [], "it may come from defaults that were not found"),
        ("a: [\n", [], "invalid YAML"),
    ],
)
def test_a_recipe_that_cannot_be_simulated_is_one_error_before_the_run(
    tmp_path, capsys, no_run, text, overrides, needle
):
    path = tmp_path / "r.yaml"
    path.write_text(text)
    assert main(["simulate", "--recipe", str(path), *overrides]) == EXIT_INVALID
    out, err = capsys.readouterr()
    errors = error_lines(err)
    assert len(errors) == 1, err
    assert needle.format(path=path) in errors[0]
    assert out == ""


def test_overrides_without_a_recipe_are_refused(capsys, no_run):
    with pytest.raises(SystemExit) as exc:
        main(["simulate", "loss_fn.x=1"])
    assert exc.value.code == 2
    assert "overrides apply to a recipe: add --recipe FILE" in capsys.readouterr().err


def test_the_config_s_warnings_and_unfound_defaults_are_warning_lines(tmp_path, capsys):
    path = tmp_path / "r.yaml"
    path.write_text("defaults: gone.yaml\nloss_fn: {name: rs_clipped_pg, is_correction_level: token}\n")
    assert main(["simulate", "--recipe", str(path), *SMALL, "--configs", "uncorrected"]) == 0
    err = capsys.readouterr().err
    assert f"warning: --recipe {path}: loss_fn.is_correction_level: got 'token' with use_importance" in err
    assert "gone.yaml not found next to the recipe" in err and "simulated without them" in err


def test_simulate_help_lists_the_configuration_names():
    assert DEFAULT_CONFIG_NAMES == tuple(sim.DEFAULT_CONFIGS)
    sub = build_parser()._subparsers._group_actions[0].choices["simulate"]
    text = " ".join(sub.format_help().split())
    assert ", ".join(sim.DEFAULT_CONFIGS) in text
    assert "--recipe YAML" in text
