"""``benchmarks/gpu_check.sh --dry-run`` starts and completes on a CPU machine.

The GPU run itself needs a CUDA device (docs/performance.md#on-a-gpu); the dry run proves
that the script, the GPU tests' collection and ``bench_gpu.py`` (on CPU, compiled rows with
the ``aot_eager`` backend) work, so that a GPU session does not spend its time on a typo.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(sys.platform != "linux", reason="bash script for the Linux GPU machines")
def test_gpu_check_dry_run_completes(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable, "NEMO_RL": str(tmp_path / "no-nemo-rl")}
    env.pop("NEMO_RS_COMPILE", None)
    proc = subprocess.run(
        ["bash", str(REPO / "benchmarks" / "gpu_check.sh"), "--dry-run"],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    log = (tmp_path / "gpu_check.log").read_text()
    assert proc.returncode == 0, log[-4000:]
    assert "gpu_check: done" in log
    assert "NeMo-RL comparison skipped: no NeMo-RL checkout" in log
    rows = json.loads((tmp_path / "bench_gpu.json").read_text())["rows"]
    assert {r["candidate"] for r in rows} == {
        "upstream-equivalent",
        "upstream-equivalent compiled",
        "rs-pipeline-3",
        "rs-pipeline-3 compiled",
    }
