"""``benchmarks/bench_packing.py`` runs against a real NeMo-RL and prints its tables.

Its timings are not tested (ratios on a shared machine); what is: it builds both losses
without importing GRPO, runs NeMo-RL's real ``SequencePackingLossWrapper``, and prints one
ratio per configuration and case, and its GPU tables (host time, GPU span, kernel time,
kernels) format the measures it collects there.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.nemo_rl_hosts import host_label, nemo_rl_hosts, no_hosts_mark

REPO = Path(__file__).resolve().parents[2]
HOSTS = nemo_rl_hosts()
pytestmark = no_hosts_mark()


def _run(host: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (host, str(REPO)) if p)}
    return subprocess.run(
        [sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=False
    )


@pytest.mark.slow  # 9-12 s: a short benchmark run inside NeMo-RL
@pytest.mark.parametrize("host", HOSTS[-1:], ids=[host_label(h) for h in HOSTS[-1:]])
def test_the_tables_of_a_short_run(host):
    done = _run(
        host,
        "benchmarks/bench_packing.py",
        *("--only", "token TIS", "--rounds", "1", "--packed-rounds", "1", "--block", "2"),
        *("--sequences", "3", "--min-len", "64", "--max-len", "96"),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("IS + token TIS")]
    assert len(rows) == 1, done.stdout
    cells = [c.strip() for c in rows[0].split("|")]
    # B=1 plugin, NeMo-RL, ratio, packed plugin, NeMo-RL, ratio, +ms/seq
    assert len(cells) == 8 and cells[3].endswith("x") and cells[6].endswith("x"), rows[0]
    assert all(float(c) > 0 for c in (cells[1], cells[2], cells[4], cells[5])), rows[0]


GPU_TABLES = r"""
import sys
sys.argv = ["bench_packing.py"]
sys.path.insert(0, "benchmarks")
import bench_packing as bp
measures = {m: {"B=1": (2.0 * s0, 1.0 * s0), "packed": (3.0 * s0, 6.0 * s0)}
            for (m, _u, _s), s0 in zip(bp.CUDA_MEASURES, (1e-3, 2e-3, 1e-4, 100.0))}
bp.print_tables("NeMo-RL configuration", "NeMo-RL", {"plain": measures}, 4)
"""


@pytest.mark.parametrize("host", HOSTS[-1:], ids=[host_label(h) for h in HOSTS[-1:]])
def test_the_gpu_tables_print_every_measure_with_its_unit(host):
    done = _run(host, "-c", GPU_TABLES)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    for measure in ("host", "GPU span", "kernel time", "kernels"):
        assert f"\n{measure}:\n" in f"\n{out}"
    # two cases each in ms for host, GPU span and kernel time; the kernel count has no unit
    assert out.count("NeMo-RL ms") == 6
    kernels = out[out.index("kernels:") :].splitlines()
    row = next(line for line in kernels if line.startswith("plain"))
    cells = [c.strip() for c in row.split("|")]
    assert cells[1:4] == ["200.000", "100.000", "2.00x"] and cells[6] == "0.50x", row
    assert cells[7] == "-75.000", row  # (300 - 600) / 4 sequences
