"""Run a function on several CPU processes with the gloo backend and collect failures.

Each rank runs ``fn(rank, world_size, *args)`` after ``init_process_group`` with a
``file://`` rendezvous under a temporary folder; ``fn`` returns a list of failure strings.
The parent joins with a timeout and raises with every rank's failures or traceback.
"""

from __future__ import annotations

import os
import tempfile
import traceback

import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank, world_size, rdzv, fn, args, queue):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        dist.init_process_group("gloo", init_method=f"file://{rdzv}", rank=rank, world_size=world_size)
        try:
            failures = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        queue.put((rank, list(failures or [])))
    except BaseException:  # report everything, including assertion errors
        queue.put((rank, [f"exception:\n{traceback.format_exc()}"]))


def run_world(world_size: int, fn, *args, timeout: float = 240.0) -> None:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        rdzv = os.path.join(tmp, "rdzv")
        procs = [ctx.Process(target=_worker, args=(r, world_size, rdzv, fn, args, queue)) for r in range(world_size)]
        for p in procs:
            p.start()
        results = {}
        try:
            for _ in range(world_size):
                rank, failures = queue.get(timeout=timeout)
                results[rank] = failures
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
    problems = [f"rank {r}: {f}" for r in sorted(results) for f in results[r]]
    missing = set(range(world_size)) - set(results)
    if missing:
        problems.append(f"ranks {sorted(missing)} reported nothing")
    if problems:
        raise AssertionError("\n".join(problems[:40]))
