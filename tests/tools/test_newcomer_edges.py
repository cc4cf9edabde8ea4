"""A newcomer's rough edges (issue 31, item 4): each is a clear line, a documented result, or fixed.

Ctrl-C, overrides without ``=`` wherever they stand, ``check`` without a recipe, a missing
``--venvs``, calibrating from too few units, ``--from`` data with no gradient, ``kept``
denominators that cannot shrink, a JSONL key given twice, the worker-path link written into
the user's cache, and the docs' lists of subcommands, configurations and lab flags.
"""

from __future__ import annotations

import io
import json
import re
import signal
import types
import warnings
from pathlib import Path

import pytest

from nemo_rs_plugin.cli import EXIT_INTERRUPTED, EXIT_INVALID, build_parser, main
from nemo_rs_plugin.core.settings.config import ConfigWarning, RSClippedPGLossConfig
from nemo_rs_plugin.tools import simulate as sim
from nemo_rs_plugin.tools.batch_formats import BatchFormatError, load_batch

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def recipe(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("grpo: {}\nloss_fn: {name: rs_clipped_pg, is_correction_level: sequence_mean}\n")
    return str(path)


def jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


# ----------------------------------------------------------------------------- Ctrl-C
def test_ctrl_c_during_simulate_is_one_line_and_130(monkeypatch, capsys):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(sim, "run", interrupted)
    assert main(["simulate", "--steps", "1", "--length", "10"]) == EXIT_INTERRUPTED == 130
    assert capsys.readouterr().err == "interrupted\n"


@pytest.mark.parametrize("via_cli", [True, False])
def test_ctrl_c_during_the_lab_is_one_line_and_130(monkeypatch, capsys, via_cli):
    from nemo_rs_plugin.lab import cli as lab

    def interrupted(argv):
        raise KeyboardInterrupt

    monkeypatch.setattr(lab, "_main", interrupted)
    assert (main(["lab", "--quick"]) if via_cli else lab.main(["--quick"])) == 130
    assert capsys.readouterr().err == "interrupted\n"


def test_lab_workers_leave_ctrl_c_to_the_parent():
    from nemo_rs_plugin.lab.pool import _leave_ctrl_c_to_the_parent

    before = signal.getsignal(signal.SIGINT)
    try:
        _leave_ctrl_c_to_the_parent()
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)


# ----------------------------------------------------------------------------- check's arguments
def test_check_without_a_recipe_asks_for_the_recipe_only(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["check"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.rstrip().endswith("nemo-rs check: error: the following arguments are required: recipe")


@pytest.mark.parametrize(
    "argv", [["check", "{r}", "key"], ["check", "{r}", "--mismatch", "0.03", "key"], ["check", "{r}", "--json", "key"]]
)
def test_an_override_without_equals_is_the_same_line_wherever_it_stands(recipe, capsys, argv):
    assert main([a.format(r=recipe) for a in argv]) == EXIT_INVALID
    out, err = capsys.readouterr()
    assert "override 'key': expected key=value" in out + err
    assert "unrecognized arguments" not in err


def test_an_override_after_nemo_rl_is_read_as_one(recipe, tmp_path, capsys):
    assert main(["check", recipe, "--nemo-rl", str(tmp_path), "key"]) == EXIT_INVALID
    err = capsys.readouterr().err
    assert "error: override 'key': expected key=value" in err and "unrecognized" not in err


# ----------------------------------------------------------------------------- doctor --venvs
def test_doctor_missing_venvs_is_one_fail_line_not_a_fail_then_a_warn(monkeypatch, tmp_path):
    from nemo_rs_plugin.tools import doctor, doctor_driver, doctor_workers

    fake_nemo_rl = types.SimpleNamespace(__file__=str(tmp_path / "RL" / "nemo_rl" / "__init__.py"))
    for name in ("check_hook", "check_selectors", "check_loss", "check_install"):
        monkeypatch.setattr(doctor_driver, name, lambda *a, **k: None)
    monkeypatch.setattr(doctor_driver, "check_nemo_rl", lambda report: fake_nemo_rl)
    monkeypatch.setattr(doctor_workers, "check_worker_path", lambda report, hook: str(tmp_path / "shim"))
    out = io.StringIO()
    missing = str(tmp_path / "missing")
    assert doctor.run_checks(venvs=missing, out=out) == 1
    lines = [line for line in out.getvalue().splitlines() if missing in line]
    assert lines == [
        f"FAIL workers: --venvs {missing}: no such directory (NeMo-RL's worker venvs, e.g. <NeMo-RL>/venvs)"
    ]


# ----------------------------------------------------------------------------- calibrate on too few
@pytest.fixture
def few(tmp_path):
    gen = [-1.0 - 0.01 * t for t in range(20)]
    return jsonl(
        tmp_path / "few.jsonl",
        [{"prev_logprobs": [g + (i - 3) / 100 for g in gen], "generation_logprobs": gen} for i in range(5)],
    )


def test_calibrate_on_too_few_units_prints_no_band(few, tmp_path, capsys):
    band = tmp_path / "band.json"
    assert main(["calibrate", "--from", few, "--json", str(band)]) == EXIT_INVALID
    out, err = capsys.readouterr()
    assert out == "" and not band.exists()
    assert err == (
        "error: stage 0: only 5 units in --from; at least 20 are needed to set a band from the data (from fewer "
        "it is not a calibration): dump more of the run, or pass --allow-few to print it anyway\n"
    )
    assert main(["calibrate", "--from", few, "--allow-few"]) == 0
    out, err = capsys.readouterr()
    assert "rejection_sampling:" in out and "warning: stage 0: only 5 units" in err


# ----------------------------------------------------------------------------- --from with no gradient
def test_simulate_from_zero_advantages_says_no_gradient_once(tmp_path, capsys):
    path = jsonl(
        tmp_path / "z.jsonl",
        [{"prev_logprobs": [-1.2, -0.3], "generation_logprobs": [-1.21, -0.29], "advantage": 0}] * 3,
    )
    table = tmp_path / "t.csv"
    assert main(["simulate", "--from", path, "--csv", str(table)]) == 0
    out, err = capsys.readouterr()
    assert [line for line in err.splitlines() if "no gradient" in line] == [f"note: {sim.NO_GRADIENT}"]
    assert "nan" not in out and "grad_norm_ratio " not in out.splitlines()[1]
    assert "grad_norm_ratio" in table.read_text().splitlines()[0]  # the machine formats keep the column
    # One advantage not 0: the usual table.
    path = jsonl(tmp_path / "g.jsonl", [{"prev_logprobs": [-1.2], "generation_logprobs": [-1.21], "advantage": 0.5}])
    assert main(["simulate", "--from", path]) == 0
    out, err = capsys.readouterr()
    assert "no gradient" not in err and "grad_norm_ratio" in out.splitlines()[1]


# ----------------------------------------------------------------------------- kept denominators
PG_ONLY = {
    "level": "token",
    "statistic": "prob_diff",
    "log_ratio": "curr-gen",
    "upper": 0.2,
    "applies_to": "policy_gradient",
}


def kept_warnings(filters):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ConfigWarning)
        RSClippedPGLossConfig.from_any({"rejection_denominator": "kept", "rejection_sampling": filters})
    return [str(w.message) for w in caught if "rejection_denominator" in str(w.message)]


def test_kept_with_only_policy_gradient_filters_warns_as_with_none():
    assert kept_warnings([PG_ONLY]) == [
        "loss_fn.rejection_denominator: got 'kept' with only applies_to: policy_gradient filters (and no icepop "
        "or seq-mask-tis): they keep every token in the denominators, which never shrink; add a filter with "
        "applies_to: loss, or remove rejection_denominator"
    ]
    assert len(kept_warnings([])) == 1  # no filter at all: the existing warning
    assert kept_warnings([PG_ONLY, {"level": "token", "statistic": "ratio", "lower": 0.5, "upper": 2.0}]) == []


# ----------------------------------------------------------------------------- JSONL key twice
def test_a_jsonl_key_given_twice_is_refused_naming_the_line_and_key(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(
        '{"prev_logprobs": [-1.0], "generation_logprobs": [-1.0]}\n'
        '{"prev_logprobs": [-1.0], "generation_logprobs": [-1.1], "prev_logprobs": [-2.0]}\n'
    )
    with pytest.raises(BatchFormatError) as exc:
        load_batch(str(path))
    assert str(exc.value) == f"{path}:2: field 'prev_logprobs' is given twice (JSON would keep only the last); keep one"


# ----------------------------------------------------------------------------- the user's cache
def test_check_says_where_it_wrote_the_worker_link(recipe, tmp_path, monkeypatch, capsys):
    from nemo_rs_plugin.nemo_rl import workers
    from nemo_rs_plugin.tools import check

    base = tmp_path / "worker-path"
    monkeypatch.setenv(workers.WORKER_PATH_ENV, str(base))
    monkeypatch.setenv("PYTHONPATH", "")
    real = check.check_recipe

    def importing_grpo(*args, **kwargs):  # what NeMo-RL's GRPO import does under the plugin's hook
        workers.expose_to_workers()
        return real(*args, **kwargs)

    monkeypatch.setattr(check, "check_recipe", importing_grpo)
    main(["check", recipe])
    note = f"note: the plugin's worker-path link was written under {base} (as training writes it;"
    assert note in capsys.readouterr().out
    main(["check", recipe])  # the link is there already: nothing written, nothing said
    assert "worker-path" not in capsys.readouterr().out
    monkeypatch.setattr(check, "check_recipe", real)
    main(["check", recipe])
    assert "worker-path" not in capsys.readouterr().out


def test_doctor_says_where_it_wrote_the_worker_link(tmp_path, monkeypatch):
    from nemo_rs_plugin.nemo_rl import workers
    from nemo_rs_plugin.tools.doctor_report import DoctorReport
    from nemo_rs_plugin.tools.doctor_workers import check_worker_path

    monkeypatch.setenv(workers.WORKER_PATH_ENV, str(tmp_path / "wp"))
    monkeypatch.setenv("PYTHONPATH", "")
    out = io.StringIO()
    assert check_worker_path(DoctorReport(out), None) is not None
    notes = [line for line in out.getvalue().splitlines() if line.startswith("note")]
    assert notes == [
        f"note worker path: the plugin's worker-path link was written under {tmp_path / 'wp'} (as training writes "
        f"it; {workers.WORKER_PATH_ENV} chooses the folder; docs/install.md: Ray workers)"
    ]


# ----------------------------------------------------------------------------- docs
def test_the_readme_docs_table_lists_every_subcommand():
    row = next(line for line in (REPO / "README.md").read_text().splitlines() if line.startswith("| [docs/cli.md]"))
    listed = set(re.findall(r"`(?:nemo-rs )?([a-z]+)`", row))
    commands = set(build_parser()._subparsers._group_actions[0].choices)
    assert commands <= listed, commands - listed


def test_every_lab_flag_is_in_the_cli_page():
    from nemo_rs_plugin.lab.cli import build_parser as lab_parser

    page = (REPO / "docs" / "cli.md").read_text()
    section = page[page.index("## `nemo-rs lab`") : page.index("## `nemo-rs calibrate`")]
    flags = {o for a in lab_parser()._actions for o in a.option_strings if o.startswith("--") and o != "--help"}
    assert {f for f in flags if f not in section} == set()


def test_doctor_names_the_nemo_rl_commit_a_version_cannot_tell(tmp_path):
    """NeMo-RL main's ``__version__`` says 0.6.0: the doctor names the checkout's commit instead."""
    import shutil
    import subprocess
    import types

    from nemo_rs_plugin.tools.doctor_driver import nemo_rl_commit

    package = tmp_path / "RL" / "nemo_rl"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("__version__ = '0.6.0'\n")
    fake = types.SimpleNamespace(__file__=str(package / "__init__.py"))
    assert nemo_rl_commit(fake).startswith("commit unknown")  # an unpacked archive: no checkout
    if shutil.which("git") is None:
        pytest.skip("git is not installed here")
    git = ["git", "-C", str(tmp_path / "RL"), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "x"], check=True)
    sha = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    assert nemo_rl_commit(fake) == f"commit {sha[:12]}"
    # installed into a virtual environment inside that repository: not that repository's code
    installed = tmp_path / "RL" / ".venv" / "lib" / "site-packages" / "nemo_rl"
    installed.mkdir(parents=True)
    (installed / "__init__.py").write_text("__version__ = '0.6.0'\n")
    inside = types.SimpleNamespace(__file__=str(installed / "__init__.py"))
    assert nemo_rl_commit(inside).startswith("commit unknown")
