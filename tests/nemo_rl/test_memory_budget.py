"""Peak memory of one loss call against NeMo-RL's own loss, measured by ``benchmarks/bench_memory.py``.

The same script docs/performance.md quotes, run in NeMo-RL's environment on its token-TIS
configuration and the plugin's three benchmark configurations (4 x 2048, forward + backward,
torch's allocator events). Issue 52 asks the GPU form for no more than NeMo-RL's peak: it stands
at 0.84-0.99x on this CPU proxy (0.97-1.16x and 1.57-1.80x before), the CPU form at 0.47-0.54x.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tests.support.fork_server import run_python
from tests.support.nemo_rl_hosts import host_label, nemo_rl_hosts, no_hosts_mark

pytestmark = [
    pytest.mark.slow,
    no_hosts_mark(),
    pytest.mark.skipif(
        not hasattr(torch.profiler.profile, "_memory_profile"), reason="this torch's profiler has no memory timeline"
    ),
]

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_memory.py"
HOSTS = nemo_rl_hosts()[-1:]  # the newest, as the operator budget
GPU_FORM_BUDGET = 1.0  # x NeMo-RL's peak: issue 52's bound
CPU_FORM_BUDGET = 0.58


@pytest.mark.parametrize("host", HOSTS, ids=host_label)
def test_peak_memory_against_nemo_rl(host, tmp_path):
    out = tmp_path / "memory.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([host, os.environ.get("PYTHONPATH", "")]))
    proc = run_python(
        ["-W", "ignore", str(SCRIPT), "--size", "4x2048", "--json", str(out), *(["--nemo-rl", host] if host else [])],
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    print(proc.stdout)
    rows = {row["candidate"]: row for row in json.loads(out.read_text())}
    plugin = {name: row["vs_nemo_rl"] for name, row in rows.items() if name.endswith("form")}
    assert len(plugin) == 6 and all(ratio is not None for ratio in plugin.values()), rows
    over = {
        name: round(ratio, 2)
        for name, ratio in plugin.items()
        if ratio > (GPU_FORM_BUDGET if name.endswith("GPU form") else CPU_FORM_BUDGET)
    }
    assert not over, f"peak memory / NeMo-RL's above budget: {over}"
