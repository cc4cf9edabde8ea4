"""The nemo-rs command: simulate, check, recipes, reference; bad input gives clear lines."""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import yaml

from nemo_rs_plugin.cli import main
from nemo_rs_plugin.tools.check import check_recipe
from nemo_rs_plugin.tools.recipes import export_recipes, list_recipes
from nemo_rs_plugin.tools.reference import render_reference

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _files_only_in_tmp_path(tmp_path, monkeypatch):
    """Temporary files under tmp_path; where NeMo-RL is importable, check imports its GRPO
    module, and the start-up hook links the plugin for Ray workers and extends PYTHONPATH."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    monkeypatch.setenv("NEMO_RS_PLUGIN_WORKER_PATH", str(tmp_path / "worker-path"))
    saved = os.environ.get("PYTHONPATH")
    yield
    if saved is None:
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = saved


@pytest.fixture
def no_nemo_rl(monkeypatch):
    """NeMo-RL not importable, whatever this environment has (see tests/tools/test_cli_check.py)."""
    for k in [k for k in sys.modules if k == "nemo_rl" or k.startswith("nemo_rl.")]:
        monkeypatch.delitem(sys.modules, k)
    monkeypatch.setitem(sys.modules, "nemo_rl", None)


def run_cli(*args):
    """The console entry point in a fresh interpreter: exit code, stdout, stderr."""
    proc = subprocess.run(
        [sys.executable, "-m", "nemo_rs_plugin.cli", *args], capture_output=True, text=True, timeout=300
    )
    return proc.returncode, proc.stdout, proc.stderr


def test_simulate_writes_the_table_as_csv_and_json(tmp_path):
    # What the default run (PR #2269's situation) shows is checked against README.md in
    # tests/docs/test_cli_docs.py.
    out = tmp_path / "rows.json"
    assert (
        main(["simulate", "--length", "300", "--steps", "1", "--json", str(out), "--csv", str(tmp_path / "rows.csv")])
        == 0
    )
    data = json.loads(out.read_text())
    assert data["source"].startswith("synthetic: 16 responses x 1 steps of 150-300 tokens")
    assert [r["config"] for r in data["rows"]][:2] == ["uncorrected", "token"]
    assert (tmp_path / "rows.csv").read_text().startswith("config,is_weight_mean")


def test_simulate_plot(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "plot.png"
    assert main(["simulate", "--steps", "1", "--length", "500", "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_simulate_rejection_reacts_to_outliers_and_staleness(tmp_path):
    out = tmp_path / "rows.json"
    main(
        [
            "simulate",
            "--steps",
            "1",
            "--length",
            "2000",
            "--outlier-rate",
            "0.001",
            "--staleness",
            "0.02",
            "--configs",
            "uncorrected",
            "seqmean+geo-rs+veto",
            "--json",
            str(out),
        ]
    )
    rows = {r["config"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["seqmean+geo-rs+veto"]["seq_rejected"] > 0.2
    assert rows["uncorrected"]["seq_rejected"] == 0


def test_simulate_from_jsonl_and_torch(tmp_path, capsys):
    records = [
        {"prev_logprobs": [-1.0, -0.5, -0.2], "generation_logprobs": [-1.0, -0.52, -0.19], "advantage": 1.0},
        {"prev_logprobs": [-0.3, -0.4], "generation_logprobs": [-0.31, -0.38], "token_mask": [0, 1]},
    ]
    path = tmp_path / "run.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records))
    assert main(["simulate", "--from", str(path), "--configs", "token", "sequence_mean"]) == 0
    assert "2 sequences" in capsys.readouterr().out
    pt = tmp_path / "run.pt"
    torch.save(
        {
            "prev_logprobs": torch.zeros(2, 4),
            "generation_logprobs": torch.full((2, 4), -0.01),
            "token_mask": torch.ones(2, 4, dtype=torch.long),
            "advantages": torch.ones(2),
        },
        pt,
    )
    assert main(["simulate", "--from", str(pt), "--configs", "token"]) == 0


def test_check_bad_input_one_line_per_problem_exit_2(tmp_path, capsys):
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("loss_fn:\n  name: rs_clipped_pg\n   is_correction_level: x\n")
    no_loss = tmp_path / "noloss.yaml"
    no_loss.write_text("grpo:\n  num_prompts_per_step: 8\n")
    invalid = tmp_path / "invalid.yaml"
    token_filter = {"level": "token", "agg": "mean", "upper": 2}
    invalid.write_text(
        yaml.safe_dump(
            {"loss_fn": {"name": "rs_clipped_pg", "is_correction_level": "seq", "rejection_sampling": [token_filter]}}
        )
    )
    cases = {  # recipe: (number of problems, what the lines say)
        str(tmp_path / "missing.yaml"): (1, ["missing.yaml: no such file"]),
        str(bad_yaml): (1, ["bad.yaml:3:", "invalid YAML"]),
        str(no_loss): (1, ["loss_fn: missing"]),
        str(invalid): (
            2,
            [
                "loss_fn.is_correction_level: got 'seq'",
                "loss_fn.rejection_sampling.0.agg: got 'mean' on a token filter",
            ],
        ),
    }
    for recipe, (count, needles) in cases.items():
        code = main(["check", recipe])
        out, err = capsys.readouterr()
        assert code == 2, (recipe, out, err)
        lines = [line for line in err.splitlines() if line.startswith("error: ")]
        assert len(lines) == count, err
        for needle in needles:
            assert needle in err, (needle, err)


def test_console_script_bad_input_exit_code_and_no_traceback(tmp_path):
    """The one run through a real interpreter: exit codes and stderr as a shell sees them."""
    code, out, err = run_cli("check", str(tmp_path / "missing.yaml"))
    assert code == 2 and err.startswith("error: ") and "Traceback" not in err, err
    code, out, err = run_cli("simulate", "--length", "0")
    assert code == 2 and err == "error: --length: got 0; must be at least 1\n" and out == "", err


@pytest.mark.parametrize("recipe", list_recipes(), ids=lambda p: p.name)
def test_every_shipped_recipe_passes_validation(recipe):
    report = check_recipe(str(recipe))
    assert report.errors == [], report.errors
    assert report.config is not None and report.config.name == "rs_clipped_pg"
    assert report.config.use_importance_sampling_correction
    text = recipe.read_text()
    assert text.startswith("#") and "Launch" in text  # the header says how to run it
    assert not [w for w in report.warnings if "would reject" in w], report.warnings


def test_check_prints_the_pipeline_and_warnings(tmp_path, capsys, no_nemo_rl):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        yaml.safe_dump(
            {
                "grpo": {"async_grpo": {"enabled": True}},
                "policy": {"generation": {"max_new_tokens": 9000}},
                "loss_fn": {
                    "name": "rs_clipped_pg",
                    "sequence_level_importance_ratios": True,
                    "token_level_loss": False,
                    "rejection_sampling": [{"level": "sequence", "agg": "mean", "lower": 0.9999, "upper": 1.0001}],
                },
            }
        )
    )
    assert main(["check", str(recipe)]) == 3  # NeMo-RL is not importable here: not fully checked
    out = capsys.readouterr().out
    assert "GSPO sequence ratio" in out
    assert "the geometric mean of its token ratios (Geo-RS) is in [0.9999, 1.0001]" in out
    assert "async_grpo.enabled is true but loss_fn.use_importance_sampling_correction is false" in out
    assert "would reject" in out
    recipe.write_text(
        yaml.safe_dump(
            {
                "policy": {"generation": {"max_new_tokens": 9000}},
                "loss_fn": {
                    "name": "rs_clipped_pg",
                    "use_importance_sampling_correction": True,
                    "sequence_level_importance_ratios": True,
                    "token_level_loss": False,
                },
            }
        )
    )
    assert main(["check", str(recipe)]) == 3
    out = capsys.readouterr().out
    assert "is_correction_level is sequence" in out and "use is_correction_level: sequence_mean" in out


def test_check_applies_overrides(tmp_path, capsys, no_nemo_rl):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("loss_fn:\n  name: rs_clipped_pg\n")
    assert (
        main(
            [
                "check",
                str(recipe),
                "+loss_fn.is_correction_level=sequence_mean",  # + adds a key (Hydra's struct mode, as NeMo-RL)
                "+loss_fn.use_importance_sampling_correction=true",
            ]
        )
        == 3
    )
    assert "sequence_mean, w = exp(sum_t m_t d_t / n)" in capsys.readouterr().out
    assert main(["check", str(recipe), "+loss_fn.ratio_clip_c=0.5"]) == 2


def test_recipes_export_rewrites_defaults(tmp_path):
    checkout = tmp_path / "RL"
    out = export_recipes(str(tmp_path / "out"), str(checkout))
    assert len(out) == len(list_recipes()) >= 5
    for path in out:
        defaults = yaml.safe_load(path.read_text())["defaults"]
        assert defaults.startswith(str(checkout.resolve() / "examples" / "configs")), defaults


def test_configuration_reference_is_current():
    doc = (REPO / "docs" / "configuration-reference.md").read_text()
    assert doc == render_reference(), "docs are stale: run `nemo-rs reference > docs/configuration-reference.md`"


def test_doctor_is_a_nemo_rs_subcommand(capsys, monkeypatch):
    """`nemo-rs doctor` runs the activation check; without NeMo-RL it fails, saying so."""
    import builtins

    real_import = builtins.__import__

    def no_nemo_rl(name, *args, **kwargs):
        if name == "nemo_rl" or name.startswith("nemo_rl."):
            raise ModuleNotFoundError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_nemo_rl)
    from nemo_rs_plugin.cli import main

    assert main(["doctor", "--no-workers"]) == 1
    out = capsys.readouterr().out
    assert "NeMo-RL: not importable here" in out and "will not train with the plugin's loss" in out


def test_version_is_one_definition_cited_with_its_commit_and_dated_in_the_changelog(capsys, monkeypatch):
    """``nemo-rs --version``: the package's version (what pip's metadata says too), the commit when
    run from a checkout, and a dated CHANGELOG entry for that version."""
    import importlib.metadata
    import re
    import shutil

    import nemo_rs_plugin
    from nemo_rs_plugin import cli

    version = nemo_rs_plugin.__version__
    assert importlib.metadata.version("nemo-rs-plugin") == version  # pyproject reads it (dynamic)
    assert 'dynamic = ["version"]' in (REPO / "pyproject.toml").read_text()
    assert re.search(
        rf"^## {re.escape(version)} \(\d{{4}}-\d{{2}}-\d{{2}}\)$", (REPO / "CHANGELOG.md").read_text(), re.M
    )
    with pytest.raises(SystemExit):
        cli.main(["--version"])
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"nemo-rs-plugin {version}")
    if (REPO / ".git").exists() and shutil.which("git"):  # a checkout (CI clones one)
        assert re.search(r"\(commit [0-9a-f]{12}(-dirty)?, ", line), line
    monkeypatch.setattr(cli.os.path, "exists", lambda p: False)  # as installed from a wheel: no checkout
    assert cli.version_line() == f"nemo-rs-plugin {version}"
