"""The loss call's peak memory, read from torch's allocator events by ``benchmarks/bench_memory.py``.

In ``[B, T]`` float32 units (size-independent): what one forward + backward allocates beyond its
inputs, in the form that runs on a GPU (every metric row stacked) and in the CPU form. Exact on
every run and machine (the profiler's record of every allocation and free), so the budgets
below are the measured values plus half a unit. NeMo-RL's own loss peaks at 26.8 units on the
same inputs (tests/nemo_rl/test_memory_budget.py compares the two live); issue 52 asks for at most
that in the GPU form (docs/performance.md#peak-memory-of-one-call).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not hasattr(torch.profiler.profile, "_memory_profile"), reason="this torch's profiler has no memory timeline"
)

#: candidate -> its peak in [B, T] float32 units, measured at 4 x 2048 (torch 2.13) plus 0.5 (the
#: upstream-equivalent GPU form plus 0.25: below NeMo-RL's 26.8, issue 52's bound)
BUDGET_UNITS = {
    # 48.0, 42.0, 44.0 before the stacked groups were reduced where declared; 31.0, 26.0, 28.0
    # before the rows built for one metric were reduced as built, the extremes grouped by mask
    # and the KL penalty's clamps taken in place (2026-11-30)
    "upstream-equivalent, GPU form": 26.75,
    "seq_mean+seq-mask-tis, GPU form": 23.0,
    "rs-pipeline-3, GPU form": 24.5,
    "upstream-equivalent, CPU form": 14.0,
    "seq_mean+seq-mask-tis, CPU form": 13.0,
    "rs-pipeline-3, CPU form": 15.0,
}


def test_peak_memory_of_one_call_stays_within_its_budget():
    from benchmarks.bench_memory import measure

    rows = {row["candidate"]: row for row in measure("4x2048", torch.device("cpu"), None)}
    assert set(rows) == set(BUDGET_UNITS), rows
    over = {
        name: round(rows[name]["units"], 2) for name, budget in BUDGET_UNITS.items() if rows[name]["units"] > budget
    }
    assert not over, f"peak memory above budget ([B, T] float32 units): {over}"
    # The CPU form reduces every row where it is declared: never above the GPU form's.
    for name in BUDGET_UNITS:
        if name.endswith("CPU form"):
            assert rows[name]["units"] < rows[name.replace("CPU form", "GPU form")]["units"]
