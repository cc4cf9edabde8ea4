"""Many lab runs: every arm x seed (x lag), in worker processes if asked.

Each run (:func:`~nemo_rs_plugin.lab.experiment.run_one`) depends only on its arm, seed and
settings, never on the number of workers or on the other runs: the rows are the same with one
worker or many (tests/lab/test_lab.py reruns one).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Optional

from nemo_rs_plugin.lab.arms import CONFIGS
from nemo_rs_plugin.lab.experiment import LabSettings, run_one

__all__ = ["dose_jobs", "run_all"]


def _leave_ctrl_c_to_the_parent() -> None:
    """A worker ignores SIGINT: Ctrl-C reaches the whole process group, and each worker would print a traceback."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _worker(args):
    name, seed, settings, queue = args
    tick = (lambda: queue.put(1)) if queue is not None else None
    return run_one(name, seed, settings, tick)


def dose_jobs(configs: list[str], seeds: list[int], lags: list[int]) -> list[tuple[str, int, int]]:
    """``(arm, seed, lag)`` of a dose-response run: every arm at every lag over the same seeds.

    The on-policy reference has no lag (its sampler is the trainer's current weights in float32):
    it runs once per seed, at lag 0.
    """
    jobs = []
    for c in configs:
        for lag in [0] if CONFIGS[c].on_policy else lags:
            jobs += [(c, seed, lag) for seed in seeds]
    return jobs


def run_all(
    s: LabSettings,
    workers: int = 1,
    progress: Optional[Callable[[int, int], None]] = None,
    lags: Optional[list[int]] = None,
    jobs: Optional[list[tuple[str, int, int]]] = None,
) -> list[dict]:
    """Every arm x seed (x lag with ``lags``: :func:`dose_jobs`); rows sorted by (arm order, lag, seed, step).

    ``jobs``: exactly these ``(arm, seed, lag)`` runs instead (the confirmation's,
    :func:`~nemo_rs_plugin.lab.confirm.protocol_jobs`). Each run depends only on its arm,
    seed and settings (``s`` with its ``lag``), never on ``workers`` or on the other runs.
    """
    if jobs is None:
        jobs = (
            dose_jobs(s.configs, s.seeds, lags)
            if lags is not None
            else [(c, seed, s.lag) for c in s.configs for seed in s.seeds]
        )
    settings = {lag: (s if lag == s.lag else replace(s, lag=lag)) for lag in {lag for _, _, lag in jobs}}
    total, done = len(jobs) * s.steps, 0
    rows: list[dict] = []
    if workers <= 1:
        for c, seed, lag in jobs:

            def tick():
                nonlocal done
                done += 1
                if progress:
                    progress(done, total)

            rows += run_one(c, seed, settings[lag], tick)
    else:
        import multiprocessing as mp
        from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

        ctx = mp.get_context("spawn")
        with (
            ctx.Manager() as manager,
            ProcessPoolExecutor(workers, mp_context=ctx, initializer=_leave_ctrl_c_to_the_parent) as pool,
        ):
            queue = manager.Queue()
            pending = {pool.submit(_worker, (c, seed, settings[lag], queue)) for c, seed, lag in jobs}
            try:
                while pending:
                    finished, pending = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
                    while not queue.empty():
                        queue.get()
                        done += 1
                        if progress:
                            progress(done, total)
                    for f in finished:
                        rows += f.result()
            except KeyboardInterrupt:
                # Stop the running jobs now (the public API only cancels those not started), so the
                # pool's exit does not wait for them; the caller prints one "interrupted" line.
                for proc in list((getattr(pool, "_processes", None) or {}).values()):
                    proc.terminate()
                pool.shutdown(wait=False, cancel_futures=True)
                raise
    order = {c: i for i, c in enumerate(s.configs)}
    return sorted(rows, key=lambda r: (order[r["config"]], r["lag"], r["seed"], r["step"]))
