"""The eager operator budget against NeMo-RL's own loss, counted by ``benchmarks/bench_ops.py``.

On a GPU each aten operator is a kernel launch; the loss's eager cost is their count plus its
host syncs. Issue 43 set the budget: NeMo-RL's three configurations the plugin reproduces
(plain, token TIS, seq-mask-tis) together dispatch at most 0.68x NeMo-RL's operators, forward
and backward, in the accelerator (stacked) form, with one host transfer per call. The counts
come from the benchmark script itself, run in NeMo-RL's environment, so the test and the
number docs/performance.md quotes are one measurement. Counts depend on the torch version, not
on the batch size. The budget is against NeMo-RL's current loss, the newest host given; v0.6.0's
loss dispatches about a tenth fewer operators (fewer metrics, no seq-mask-tis bookkeeping), and
the same plugin measures 0.75x against it (docs/performance.md).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.support.fork_server import run_python
from tests.support.nemo_rl_hosts import host_label, nemo_rl_hosts, no_hosts_mark

pytestmark = [pytest.mark.slow, no_hosts_mark()]

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_ops.py"
BUDGET = 0.68  # issue 43: was 0.72 after issues 39-42, 0.68 before them
HOSTS = nemo_rl_hosts()[-1:]  # the newest: NEMO_RS_NEMO_RL_CHECKOUTS lists the oldest first


@pytest.mark.parametrize("host", HOSTS, ids=host_label)
def test_upstream_configurations_stay_within_the_operator_budget(host, tmp_path):
    out = tmp_path / "ops.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([host, os.environ.get("PYTHONPATH", "")]))
    proc = run_python(
        ["-W", "ignore", str(SCRIPT), "--json", str(out)],
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads(out.read_text())
    print(proc.stdout)
    rows = summary["rows"]
    upstream = {name: row for name, row in rows.items() if name.startswith("upstream-equivalent/")}
    assert len(upstream) == 3 and all(row["nemo_rl"] for row in upstream.values()), rows
    assert summary["upstream_ratio"] <= BUDGET, summary
    # One host transfer per call in every configuration, the pipeline's included.
    assert {row["host_transfers"] for row in rows.values()} == {1}, rows
