"""Run a function on several CPU processes with the gloo backend and collect failures.

Each rank runs ``fn(rank, world_size, *args)`` after ``init_process_group`` with a
``file://`` rendezvous under a temporary folder; ``fn`` returns a list of failure strings.
The parent joins with a timeout and raises with every rank's failures or traceback. Ranks are
forked from this process's fork server (:mod:`tests.support.fork_server`), which has the heavy
third-party modules imported already; each rank imports NeMo-RL and the plugin itself.
"""

from __future__ import annotations

import os
import queue as queue_module
import tempfile
import time
import traceback

import torch.distributed as dist

from tests.support import fork_server


def _worker(rank, world_size, rdzv, fn, args, queue, env):
    fork_server.apply_environment(env)
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


def run_cases(rank, world_size, cases):
    """Rank function running several ``(name, fn, args)`` checks in one world.

    Every rank runs every case in the same order (so process groups are created alike); a
    case's failures, or its traceback, come back prefixed with ``name::``.
    """
    failures = []
    for name, fn, args in cases:
        try:
            failures += [f"{name}::{f}" for f in (fn(rank, world_size, *args) or [])]
        except BaseException:  # one broken case must not hide the others
            failures.append(f"{name}::exception:\n{traceback.format_exc()}")
    return failures


def run_world_cases(world_size: int, cases, timeout: float = 600.0) -> dict:
    """Run ``cases`` (see :func:`run_cases`) in one world; ``{name: [failures]}`` over ranks.

    Starting a world (processes, imports, the gloo rendezvous) costs more than most checks:
    tests share one world per size and each asserts its own case's entry.
    """
    out = {name: [] for name, _, _ in cases}
    for problem in _world_problems(world_size, run_cases, (cases,), timeout):
        rank, _, rest = problem.partition(": ")
        name, sep, failure = rest.partition("::")
        if sep and name in out:
            out[name].append(f"{rank}: {failure}")
        else:  # a world-level problem (a rank died or reported nothing): every case has it
            for key in out:
                out[key].append(problem)
    return out


def run_world(world_size: int, fn, *args, timeout: float = 240.0) -> None:
    """Run ``fn`` on every rank; raise with every rank's failures (the first 40 lines)."""
    problems = _world_problems(world_size, fn, args, timeout)
    if problems:
        raise AssertionError("\n".join(problems[:40]))


def _world_problems(world_size: int, fn, args, timeout: float) -> list:
    ctx = fork_server.context()  # ranks forked with torch, megatron-core, transformers imported
    queue = ctx.Queue()
    env = dict(os.environ)
    with tempfile.TemporaryDirectory() as tmp:
        rdzv = os.path.join(tmp, "rdzv")
        procs = [
            ctx.Process(target=_worker, args=(r, world_size, rdzv, fn, args, queue, env)) for r in range(world_size)
        ]
        for p in procs:
            p.start()
        results: dict = {}
        died: dict = {}
        try:
            died = _collect(queue, procs, results, time.monotonic() + timeout)
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
    problems = [f"rank {r}: {f}" for r in sorted(results) for f in results[r]]
    if died:
        codes = ", ".join(f"rank {r}: {code}" for r, code in sorted(died.items()))
        problems.append(
            f"ranks {sorted(died)} exited before reporting ({codes}); their stderr says why (a crash, an "
            "os._exit, a rank function that could not be unpickled)"
        )
    missing = set(range(world_size)) - set(results) - set(died)
    if missing:
        problems.append(f"ranks {sorted(missing)} reported nothing within {timeout:.0f} s")
    return problems


def _collect(queue, procs, results: dict, deadline: float) -> dict:
    """Read the ranks' reports into ``results`` until all are in, the deadline, or a rank dies.

    A rank that exits with a non-zero code before reporting (a crash, its function not unpickled)
    ends the wait at once: its peers may be waiting for it in a collective, and waiting out
    the whole timeout would say only that nothing came. Returns ``{rank: exit code}`` of those.
    """
    while len(results) < len(procs) and time.monotonic() < deadline:
        try:
            rank, failures = queue.get(timeout=min(1.0, max(0.01, deadline - time.monotonic())))
            results[rank] = failures
            continue
        except queue_module.Empty:
            pass
        died = {r: p.exitcode for r, p in enumerate(procs) if r not in results and p.exitcode not in (None, 0)}
        if died:
            try:  # a report put just before the exit is still read
                while True:
                    rank, failures = queue.get(timeout=0.5)
                    results[rank] = failures
            except queue_module.Empty:
                pass
            return {r: code for r, code in died.items() if r not in results}
    return {}
