"""``nemo-rs doctor --nemo-rl PATH``: NeMo-RL from a checkout, as ``nemo-rs check --nemo-rl`` takes it.

Run in fresh interpreters, with tests/fake_hosts/supported named by ``--nemo-rl`` and not on
``PYTHONPATH`` (as tests/tools/test_doctor.py runs the doctor).
"""

import os
import subprocess
import sys

import pytest

from nemo_rs_plugin.tools.recipe_loading import HOW_TO_CHECK_IN_NEMO_RL
from tests.nemo_rl.test_activation import FAKE, needs_install


def doctor(*args, cwd):
    env = {k: v for k, v in os.environ.items() if k != "NEMO_RS_PLUGIN_DISABLE"}
    proc = subprocess.run(
        [sys.executable, "-m", "nemo_rs_plugin.tools.doctor", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=600,
    )
    return proc.returncode, proc.stdout, proc.stderr


@needs_install
@pytest.mark.slow
def test_doctor_takes_nemo_rl_from_the_checkout_it_is_given(tmp_path):
    rc, out, err = doctor("--no-workers", "--nemo-rl", str(FAKE / "supported"), cwd=tmp_path)
    assert rc == 0, (out, err)
    assert out.rstrip().endswith("nemo-rs-plugin is active: loss_fn.name: rs_clipped_pg builds the plugin's loss")
    rc, out, err = doctor("--no-workers", "--nemo-rl", str(tmp_path / "nowhere"), cwd=tmp_path)
    assert rc == 1, (out, err)
    assert f"FAIL NeMo-RL: --nemo-rl {tmp_path / 'nowhere'}: not a NeMo-RL checkout (no such directory)" in out


def test_how_to_check_says_which_python_nemo_rls_master_config_needs():
    assert "NeMo-RL v0.7.0 and main need Python >= 3.12 for their MasterConfig" in HOW_TO_CHECK_IN_NEMO_RL
