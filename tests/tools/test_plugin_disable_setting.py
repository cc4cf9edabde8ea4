"""``NEMO_RS_PLUGIN_DISABLE``: an unrecognised value is named in a warning; ``check`` and ``doctor`` say the state.

Only ``1/true/yes/on`` switch the plugin off; ``disabled`` or ``2`` leave it on, which a user who
set them did not mean: the hook warns when NeMo-RL's modules load, ``check`` warns, ``doctor``
warns, each naming the value.
"""

import os
import sys

import pytest

import _nemo_rs_plugin_hook as hook
from nemo_rs_plugin.cli import main

ENV = "NEMO_RS_PLUGIN_DISABLE"
RECIPE = (
    "grpo: {}\nloss_fn:\n  name: rs_clipped_pg\n  is_correction_level: sequence_mean\n"
    "  use_importance_sampling_correction: true\n"
)


@pytest.fixture(autouse=True)
def no_nemo_rl(monkeypatch):
    for k in [k for k in sys.modules if k == "nemo_rl" or k.startswith("nemo_rl.")]:
        monkeypatch.delitem(sys.modules, k)
    monkeypatch.setitem(sys.modules, "nemo_rl", None)
    monkeypatch.setattr(hook, "_warned", [])


@pytest.mark.parametrize("value", ["disabled", "2", " Disable "])
def test_an_unrecognised_value_leaves_the_plugin_on_with_a_warning_naming_it(monkeypatch, value):
    monkeypatch.setenv(ENV, value)
    assert not hook.disabled() and hook.unrecognised_setting() == value
    with pytest.warns(hook.PluginDisableWarning) as caught:
        hook.warn_unrecognised()
        hook.warn_unrecognised()  # once per process
    [warning] = caught
    message = str(warning.message)
    assert f"{ENV}={value!r}" in message and "nemo-rs-plugin is on" in message, message
    assert "1, true, yes, on" in message, message


@pytest.mark.parametrize("value, off", [("1", True), ("TRUE", True), ("0", False), ("off", False), ("", False)])
def test_recognised_values_say_their_state_without_a_warning(monkeypatch, recwarn, value, off):
    monkeypatch.setenv(ENV, value)
    hook.warn_unrecognised()
    assert not recwarn.list
    assert hook.disabled() is off
    assert hook.state().startswith(f"nemo-rs-plugin is {'off' if off else 'on'} ({ENV}={value})")


def test_unset_is_on():
    env = os.environ.pop(ENV, None)
    try:
        assert hook.state() == f"nemo-rs-plugin is on ({ENV} is not set)"
    finally:
        if env is not None:
            os.environ[ENV] = env


def run_check(tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(RECIPE)
    code = main(["check", str(recipe)])
    out, err = capsys.readouterr()
    return code, out, err


def test_check_warns_about_an_unrecognised_value(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv(ENV, "disabled")
    code, out, err = run_check(tmp_path, capsys)
    assert "error:" not in err, err
    [line] = [line for line in out.splitlines() if ENV in line]
    assert line.startswith("warning: nemo-rs-plugin is on: NEMO_RS_PLUGIN_DISABLE='disabled'"), line


def test_check_notes_a_value_that_leaves_the_plugin_on(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv(ENV, "0")
    code, out, err = run_check(tmp_path, capsys)
    assert f"note: nemo-rs-plugin is on ({ENV}=0)" in out, out


@pytest.mark.slow
def test_doctor_warns_about_an_unrecognised_value_and_says_the_state(tmp_path):
    from tests.nemo_rl.test_activation import plugin_installed
    from tests.tools.test_doctor import doctor

    if not plugin_installed():
        pytest.skip("nemo-rs-plugin is not pip-installed here")
    rc, out, err = doctor("--no-workers", env=dict(os.environ, **{ENV: "2"}), cwd=tmp_path)
    assert rc == 0, (out, err)
    assert f"warn start-up hook: nemo-rs-plugin is on: {ENV}='2' is not a value it reads" in out, out
    [ok] = [line for line in out.splitlines() if line.startswith("ok   start-up hook:")]
    assert ok.endswith(
        f"; nemo-rs-plugin is on: {ENV}='2' is not a value it reads (off: 1, true, yes, on; on: "
        "unset, empty, 0, false, no, off), so it does not switch the plugin off"
    ), ok
    rc, out, err = doctor("--no-workers", env={k: v for k, v in os.environ.items() if k != ENV}, cwd=tmp_path)
    assert f"; nemo-rs-plugin is on ({ENV} is not set)" in out, out
