"""The doctor's checks of the worker side: the worker-path link, and each worker venv unpickling the loss.

Also what ``nemo-rs check`` reads to say it wrote the worker-path link (:func:`worker_links_now`,
:func:`wrote_worker_links`). Standard library only at import, as every module ``nemo-rs doctor``
imports.
"""

from __future__ import annotations

import glob
import json
import os
import pickle
import subprocess
import warnings
from typing import Any, Optional

from nemo_rs_plugin.nemo_rl import workers as worker_links  # standard library only
from nemo_rs_plugin.tools.doctor_report import DoctorReport  # standard library only

__all__ = ["WORKER_PROBE", "check_worker_path", "check_worker_venvs", "worker_links_now", "wrote_worker_links"]

#: What each worker venv's python runs: unpickle the loss from stdin, say its class and which plugin it found.
WORKER_PROBE = (
    "import json, pickle, sys\n"
    "loss = pickle.loads(sys.stdin.buffer.read())\n"
    "import nemo_rs_plugin\n"
    "print(json.dumps({'type': type(loss).__name__, 'plugin_from': nemo_rs_plugin.__file__,"
    " 'version': nemo_rs_plugin.__version__}))\n"
)


def worker_links_now() -> dict[str, str]:
    """The worker-path folder's entries and where their links point (to tell when a command wrote there)."""
    base = worker_links.worker_path_base()
    try:
        entries = sorted(os.listdir(base))
    except OSError:
        return {}
    return {e: os.path.realpath(os.path.join(base, e, worker_links.LINK_NAME)) for e in entries}


def wrote_worker_links(before: dict[str, str]) -> Optional[str]:
    """The note to print when the worker-path folder changed since ``before`` (a link made or removed)."""
    if worker_links_now() == before:
        return None
    return (
        f"the plugin's worker-path link was written under {worker_links.worker_path_base()} (as training writes "
        f"it; {worker_links.WORKER_PATH_ENV} chooses the folder; docs/install.md: Ray workers)"
    )


def check_worker_path(report: DoctorReport, hook: Any) -> Optional[str]:
    """The worker-path link is in place, in a folder on ``PYTHONPATH``; that folder, or ``None`` where it is not."""
    before = worker_links_now()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        shim = worker_links.expose_to_workers()
    wrote = wrote_worker_links(before)
    if wrote is not None:
        report.line("note", "worker path", wrote)
    if shim is None:
        detail = "; ".join(str(w.message) for w in caught) or "the package location is unknown"
        report.fail("worker path", detail)
        return None
    report.ok(
        "worker path",
        f"{shim} is on PYTHONPATH, linking to {os.path.realpath(os.path.join(shim, worker_links.LINK_NAME))}",
    )
    for dangling in worker_links.dangling_links():
        report.warn("worker path", f"dangling link left by a removed install: {dangling} (remove it)")
    return shim


def check_worker_venvs(report: DoctorReport, nemo_rl: Any, loss: Any, venvs: Optional[str]) -> None:
    """Every worker venv NeMo-RL built unpickles ``loss``, started with the environment the driver hands it."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(nemo_rl.__file__)))
    venv_dir = venvs or os.environ.get("NEMO_RL_VENV_DIR") or os.path.join(root, "venvs")
    pythons = sorted(glob.glob(os.path.join(venv_dir, "*", "bin", "python")))
    if not pythons:
        report.warn(
            "workers",
            f"no worker virtual environments in {venv_dir} yet: NeMo-RL builds them "
            "on its first run; run the doctor again after it (or pass --venvs DIR)",
        )
        return
    blob = pickle.dumps(loss)
    for python in pythons:
        venv = os.path.dirname(os.path.dirname(python))
        name = os.path.basename(venv)
        # What NeMo-RL hands a worker: the driver's environment, pointed at the worker venv.
        env = {**os.environ, "VIRTUAL_ENV": venv, "UV_PROJECT_ENVIRONMENT": venv}
        try:
            proc = subprocess.run(
                [python, "-c", WORKER_PROBE], input=blob, env=env, capture_output=True, timeout=600, cwd=venv
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            report.fail(f"worker {name}", f"{type(exc).__name__}: {exc}")
            continue
        if proc.returncode != 0:
            tail = proc.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
            report.fail(f"worker {name}", f"cannot unpickle the loss: {tail[0]}")
            continue
        out = json.loads(proc.stdout.decode().strip().splitlines()[-1])
        report.ok(
            f"worker {name}",
            f"unpickles {out['type']} (nemo_rs_plugin {out['version']} from {os.path.dirname(out['plugin_from'])})",
        )
