"""``nemo-rs``: bad input anywhere is one ``error:`` line (exit 2) or a failed check, never a traceback.

In this process through the CLI's ``main()`` where the command allows it; the doctor and
``python -m nemo_rs_plugin.lab`` also in a fresh interpreter, as a shell runs them.
"""

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

import nemo_rs_plugin
from nemo_rs_plugin.cli import EXIT_INVALID, main
from nemo_rs_plugin.tools import doctor
from nemo_rs_plugin.tools.recipes import list_recipes

REPO = Path(__file__).resolve().parents[2]
FAKE_HOSTS = REPO / "tests" / "fake_hosts"
LOSS = {"name": "rs_clipped_pg", "use_importance_sampling_correction": True, "is_correction_level": "sequence_mean"}


@pytest.fixture(autouse=True)
def _files_only_in_tmp_path(tmp_path, monkeypatch):
    """Temporary files under tmp_path; NeMo-RL not importable (none is installed here)."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    monkeypatch.setenv("NEMO_RS_PLUGIN_WORKER_PATH", str(tmp_path / "worker-path"))
    for k in [k for k in sys.modules if k == "nemo_rl" or k.startswith("nemo_rl.")]:
        monkeypatch.delitem(sys.modules, k)
    monkeypatch.setitem(sys.modules, "nemo_rl", None)


def run(capsys, *argv):
    """``main(argv)``: exit code (a ``SystemExit`` from argparse included), stdout, stderr."""
    try:
        code = main(list(argv))
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    assert "Traceback" not in err, err
    return code, out, err


def error_lines(err):
    return [line for line in err.splitlines() if line.startswith("error: ")]


# --------------------------------------------------------------------------- 1. --version
def test_version_prints_the_package_version(capsys):
    """One line, the version first (and its commit from a checkout: tests/tools/test_cli.py)."""
    code, out, err = run(capsys, "--version")
    assert code == 0, err
    assert out.startswith(f"nemo-rs-plugin {nemo_rs_plugin.__version__}") and out.count("\n") == 1


# --------------------------------------------------------------------------- 2. check DIR
def test_check_a_directory_says_it_is_one(tmp_path, capsys):
    code, out, err = run(capsys, "check", str(tmp_path))
    assert code == EXIT_INVALID and out == ""
    [line] = error_lines(err)
    assert line.startswith(f"error: {tmp_path}: is a directory") and "no such file" not in line, line


# --------------------------------------------------------------------------- 3. unwritable outputs
@pytest.mark.skipif(not os.path.isfile("/proc/version"), reason="needs Linux's /proc")
@pytest.mark.parametrize(
    "flag, path", [("--json", "/proc/version"), ("--csv", "/proc/version"), ("--plot", "/proc/version.png")]
)
def test_simulate_refuses_an_unwritable_output_before_the_run(capsys, flag, path):
    code, out, err = run(capsys, "simulate", "--length", "50", "--steps", "1", "--configs", "token", flag, path)
    assert code == EXIT_INVALID
    assert out == "", "the run started"
    [line] = error_lines(err)
    assert line.startswith(f"error: {flag} {path}: cannot be written"), line


# --------------------------------------------------------------------------- 4. recipes
def test_recipes_out_that_is_a_file_is_one_line(tmp_path, capsys):
    target = tmp_path / "a-file"
    target.write_text("")
    code, out, err = run(capsys, "recipes", "--out", str(target))
    assert code == EXIT_INVALID and out == ""
    [line] = error_lines(err)
    assert line.startswith(f"error: --out: got {target}; it is a file"), line


def test_recipes_bad_nemo_rl_is_refused(tmp_path, capsys):
    (tmp_path / "not-rl").mkdir()
    out_dir = tmp_path / "out"
    for checkout, needle in [
        (tmp_path / "nonexistent", "no such directory"),
        (tmp_path / "not-rl", "no examples/configs in it"),
    ]:
        code, out, err = run(capsys, "recipes", "--nemo-rl", str(checkout), "--out", str(out_dir))
        assert code == EXIT_INVALID and out == ""
        [line] = error_lines(err)
        assert line.startswith(f"error: --nemo-rl: got {checkout}; not a NeMo-RL checkout ({needle})"), line
    assert not out_dir.exists()  # nothing written


def test_recipes_nemo_rl_without_out_is_refused(tmp_path, capsys):
    (tmp_path / "RL" / "examples" / "configs").mkdir(parents=True)
    code, out, err = run(capsys, "recipes", "--nemo-rl", str(tmp_path / "RL"))
    assert code == EXIT_INVALID and out == ""
    [line] = error_lines(err)
    assert line.startswith("error: --nemo-rl: got ") and "--out" in line, line


def test_recipes_export_keeps_an_edited_file_unless_forced(tmp_path, capsys):
    checkout = tmp_path / "RL"
    (checkout / "examples" / "configs").mkdir(parents=True)
    out_dir = tmp_path / "out"
    args = ["recipes", "--nemo-rl", str(checkout), "--out", str(out_dir)]
    assert run(capsys, *args)[0] == 0
    assert run(capsys, *args)[0] == 0  # identical files: rewritten without a word
    edited = out_dir / list_recipes()[0].name
    edited.write_text(edited.read_text() + "# my change\n")
    code, out, err = run(capsys, *args)
    assert code == EXIT_INVALID and out == ""
    [line] = error_lines(err)
    assert line.startswith(f"error: --out: {edited}: differs from the shipped recipe") and "--force" in line, line
    assert edited.read_text().endswith("# my change\n")
    code, out, _ = run(capsys, *args, "--force")
    assert code == 0 and str(edited) in out
    assert not edited.read_text().endswith("# my change\n")


# --------------------------------------------------------------------------- 5. lab
def test_lab_bad_settings_are_one_line_each_before_any_worker(tmp_path, capsys):
    code, out, err = run(
        capsys,
        "lab",
        "--quick",
        "--workers",
        "1",
        "--out",
        str(tmp_path / "lab"),
        "--sampler-dtype",
        "fp8",
        "--lag",
        "-1",
        "--steps",
        "0",
        "--length",
        "0",
        "--group",
        "1",
    )
    assert code == EXIT_INVALID and out == ""
    lines = error_lines(err)
    assert len(lines) == 5, err
    for needle in [
        "error: --sampler-dtype: got 'fp8'; allowed: bf16, fp16, fp32",
        "error: --lag: got -1; must be at least 0",
        "error: --steps: got 0; must be at least 1",
        "error: --length: got 0; must be at least 1",
        "error: --group: got 1; must be at least 2",
    ]:
        assert needle in lines, (needle, err)
    assert "nemo-rs lab:" not in err  # the run never started
    assert not (tmp_path / "lab").exists()


def test_lab_module_bad_settings_are_one_line(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "nemo_rs_plugin.lab", "--steps", "0", "--out", str(tmp_path / "lab")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == EXIT_INVALID, proc.stderr
    assert proc.stderr == "error: --steps: got 0; must be at least 1\n"


# --------------------------------------------------------------------------- 6. doctor
def test_doctor_missing_recipe_is_one_failed_check(tmp_path, capsys):
    missing = tmp_path / "missing.yaml"
    assert doctor.main([str(missing), "--no-workers"]) == 1
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if str(missing) in line]
    assert lines == [f"FAIL recipe: {missing}: no such file"], out


def test_doctor_unresolved_defaults_is_one_failed_check(tmp_path, capsys):
    (tmp_path / "base.yaml").write_text("defaults: gone/grpo.yaml\n")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"defaults": "base.yaml", "loss_fn": LOSS}))
    assert doctor.main([str(recipe), "--no-workers"]) == 1
    out = capsys.readouterr().out
    [line] = [line for line in out.splitlines() if line.startswith("FAIL recipe:")]
    assert str(tmp_path / "gone" / "grpo.yaml") in line and str(tmp_path / "base.yaml") in line, line


def test_doctor_missing_recipe_with_nemo_rl_is_no_traceback(tmp_path):
    """Where NeMo-RL imports (a stand-in), its load_config never sees a recipe that cannot load."""
    env = dict(os.environ, NEMO_RS_PLUGIN_WORKER_PATH=str(tmp_path / "worker-path"))
    env["PYTHONPATH"] = os.pathsep.join([str(FAKE_HOSTS / "supported"), str(REPO)])
    missing = tmp_path / "missing.yaml"
    proc = subprocess.run(
        [sys.executable, "-m", "nemo_rs_plugin.tools.doctor", str(missing), "--no-workers"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr, proc.stderr
    assert f"FAIL recipe: {missing}: no such file" in proc.stdout


# --------------------------------------------------------------------------- 7. not GRPO
@pytest.mark.parametrize(
    "cfg, section",
    [
        ({"sft": {"max_num_epochs": 1}, "policy": {"model_name": "m"}}, "sft"),
        ({"dpo": {"reference_policy_kl_penalty": 0.05}, "policy": {"model_name": "m"}}, "dpo"),
        ({"rm": {"max_num_epochs": 1}}, "rm"),
        ({"distillation": {"num_prompts_per_step": 8}, "loss_fn": {"kl_type": "forward"}}, "distillation"),
    ],
    ids=["sft", "dpo", "rm", "distillation"],
)
def test_check_a_non_grpo_config_says_so(tmp_path, capsys, cfg, section):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(cfg))
    code, out, err = run(capsys, "check", str(recipe))
    assert code == EXIT_INVALID
    [line] = error_lines(err)
    assert line.startswith(f"error: {recipe}: not a GRPO recipe") and f"{section}:" in line, line


def test_check_a_grpo_or_plugin_recipe_is_unaffected(tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"dpo": {"x": 1}, "loss_fn": LOSS}))  # names the plugin's loss
    code, _, err = run(capsys, "check", str(recipe))
    assert code == 3 and not error_lines(err), err
    recipe.write_text(yaml.safe_dump({"grpo": {"num_prompts_per_step": 8}, "sft": {"x": 1}}))
    code, _, err = run(capsys, "check", str(recipe))
    assert code == EXIT_INVALID and "loss_fn: missing" in err and "not a GRPO recipe" not in err


# --------------------------------------------------------------------------- 8. check: all at once, warnings
FIVE_MISTAKES = {
    **LOSS,
    "ratio_clip_c": 0.5,
    "reference_policy_kl_type": "k9",
    "ratio_clip_max": "0.28",
    "is_corection_level": "token",
    "rejection_sampling": [{"level": "sequence", "agg": "median", "lower": 2.0, "upper": 1.0}],
}


def test_check_reports_every_mistake_of_a_recipe_at_once(tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"grpo": {"num_prompts_per_step": 8}, "loss_fn": FIVE_MISTAKES}))
    code, out, err = run(capsys, "check", str(recipe))
    assert code == EXIT_INVALID
    lines = error_lines(err)
    for start in (
        "error: loss_fn.is_corection_level: unknown field",
        "error: loss_fn.reference_policy_kl_type: got 'k9'",
        "error: loss_fn.ratio_clip_max: got '0.28' (a string)",
        "error: loss_fn.ratio_clip_c: got 0.5",
        "error: loss_fn.rejection_sampling.0.agg: got 'median'",
        "error: loss_fn.rejection_sampling.0: lower > upper",
    ):
        assert sum(line.startswith(start) for line in lines) == 1, (start, lines)
    assert len(lines) == 6, lines


def test_check_prints_the_config_s_warnings_once_each(tmp_path, capsys):
    loss = {
        "name": "rs_clipped_pg",
        "is_correction_level": "sequence_mean",
        "rejection_sampling": [{"level": "token", "statistic": "total_variation", "upper": 5}],
    }
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"grpo": {"num_prompts_per_step": 8}, "loss_fn": loss}))
    code, out, err = run(capsys, "check", str(recipe))
    assert code == 3 and not error_lines(err), err
    warned = [line for line in out.splitlines() if line.startswith("warning: loss_fn.")]
    assert len(warned) == 2, out
    assert warned[0].startswith("warning: loss_fn.is_correction_level: got 'sequence_mean'")
    assert warned[1].startswith("warning: loss_fn.rejection_sampling.0.upper: got 5.0 with statistic 'total_variation'")


# --------------------------------------------------------------------------- 9. simulate --from bad data
def _pt(path, **tensors):
    import torch

    torch.save(tensors, path)
    return path


def _bad_batches(tmp_path):
    import pickle

    import numpy as np
    import torch

    nan = float("nan")
    ok = -torch.rand(2, 4) - 0.1
    text = tmp_path / "text.pt"
    text.write_text("prev_logprobs: -1.0\n")
    rand = tmp_path / "random.pt"
    rand.write_bytes(bytes(range(256)) * 8)
    numpy_pickle = tmp_path / "numpy.pt"
    numpy_pickle.write_bytes(pickle.dumps({"prev_logprobs": np.zeros((2, 4)), "generation_logprobs": np.zeros((2, 4))}))
    npy = tmp_path / "array.pt"
    with open(npy, "wb") as fh:
        np.save(fh, np.zeros((2, 4)))
    return {
        "jsonl all null": (
            _jsonl(tmp_path / "null.jsonl", {"prev_logprobs": [None, None], "generation_logprobs": [-1.0, -1.0]}),
            "field 'prev_logprobs' has no finite value on any valid token",
        ),
        "pt all nan": (
            _pt(tmp_path / "nan.pt", prev_logprobs=ok, generation_logprobs=torch.full((2, 4), nan)),
            "field 'generation_logprobs' has no finite value on any valid token",
        ),
        "jsonl positive": (
            _jsonl(tmp_path / "pos.jsonl", {"prev_logprobs": [-0.5, 0.7], "generation_logprobs": [-0.5, -0.6]}),
            "field 'prev_logprobs' value 1 is 0.7; log-probs are <= 0",
        ),
        "pt positive": (
            _pt(tmp_path / "pos.pt", prev_logprobs=-ok, generation_logprobs=ok),
            "field 'prev_logprobs' is positive there",
        ),
        "pt nan advantage": (
            _pt(tmp_path / "adv.pt", prev_logprobs=ok, generation_logprobs=ok, advantages=torch.tensor([nan, 1.0])),
            "field 'advantages' is nan at sequence 0; expected a finite number",
        ),
        "jsonl nan advantage": (
            _jsonl_text(
                tmp_path / "adv.jsonl", '{"prev_logprobs": [-1], "generation_logprobs": [-1], "advantage": NaN}'
            ),
            "field 'advantage' is NaN; expected a finite number",
        ),
        "pt int log-probs": (
            _pt(tmp_path / "int.pt", prev_logprobs=-torch.ones(2, 4, dtype=torch.long), generation_logprobs=ok),
            "field 'prev_logprobs' must hold floating-point log-probs, got dtype torch.int64",
        ),
        "numpy pickle": (numpy_pickle, "NumPy"),
        "numpy npy": (npy, "a NumPy .npy file, not a torch file"),
        "random bytes": (rand, "not a torch file"),
        "text": (text, "a text file, not a torch file"),
    }


def _jsonl(path, *records):
    import json

    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _jsonl_text(path, line):
    path.write_text(line + "\n")
    return path


@pytest.mark.parametrize(
    "case",
    [
        "jsonl all null",
        "pt all nan",
        "jsonl positive",
        "pt positive",
        "pt nan advantage",
        "jsonl nan advantage",
        "pt int log-probs",
        "numpy pickle",
        "numpy npy",
        "random bytes",
        "text",
    ],
)
def test_simulate_from_bad_data_is_one_clear_line(tmp_path, capsys, case):
    path, needle = _bad_batches(tmp_path)[case]
    code, out, err = run(capsys, "simulate", "--from", str(path), "--configs", "token")
    assert code == EXIT_INVALID and out == "", out
    [line] = error_lines(err)
    assert line.startswith(f"error: {path}") and needle in line, line
    assert "\x1b" not in err and len(err.splitlines()) == 1, err


def test_simulate_token_row_with_a_null_log_prob_is_consistent(tmp_path, capsys):
    path = _jsonl(tmp_path / "one-null.jsonl", {"prev_logprobs": [None, -1.0], "generation_logprobs": [-1.0, -1.0]})
    code, out, err = run(
        capsys, "simulate", "--from", str(path), "--configs", "token", "--json", str(tmp_path / "t.json")
    )
    assert code == 0, err
    import json

    [row] = json.loads((tmp_path / "t.json").read_text())["rows"]
    # The null token leaves the loss: the weights the loss applies are those of the other token.
    assert row["is_weight_min"] <= row["is_weight_mean"], row
    assert row["is_weight_mean"] == pytest.approx(1.0) and row["is_weight_min"] == pytest.approx(1.0)


# --------------------------------------------------------------------------- 10. recipes: descriptions
def test_recipes_listing_describes_each_recipe_from_its_own_first_line(capsys):
    code, out, err = run(capsys, "recipes")
    assert code == 0, err
    lines = out.splitlines()
    assert len(lines) == len(list_recipes()), out
    for line, path in zip(lines, list_recipes()):
        first = path.read_text().splitlines()[0]
        assert first.startswith("# "), (path, first)
        assert line.startswith(str(path)) and line.endswith(first[2:].strip()), line
