"""Fresh processes without fresh imports: one fork server per pytest process, third-party modules preloaded.

Most of the suite's real-host time was interpreters starting: every rank of a gloo world and
every script run in a NeMo-RL checkout's interpreter imported torch, megatron-core and what
NeMo-RL's loss module pulls in (transformers, the loggers, the servers): 15-20 s of CPU each,
against 0.4-3 s for a typical case (``python -X importtime -c "import nemo_rl.algorithms.loss"``
at NeMo-RL main: 16 s, 94% of it outside NeMo-RL and the plugin).

Python's ``forkserver`` start method imports a preload list once, in a server process, and forks
every new process from it. What is preloaded is :data:`HEAVY_MODULES`: only third-party modules
that do not depend on which checkout or which environment a test gives the process. NeMo-RL, the
plugin and ``ray`` are imported by each process itself, as before, so a checkout is chosen per
process (``sys.path``), the plugin's import-time switches read the process's environment, and a
script that makes ``ray`` absent (the GPU machine's case, ``tests/tools/test_gpu_check.py``) still
meets a missing module.

What a forked process does not inherit from the server it gets explicitly: ``sys.path`` and the
working directory come from the caller (multiprocessing's preparation data), the environment is
passed with each call (the server's is the one of the moment it started).
"""

from __future__ import annotations

import importlib
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.util
import os
import subprocess
import sys
import tempfile
from pathlib import Path

#: The modules NeMo-RL's loss and Megatron chains import that cost the most to import (seconds
#: at NeMo-RL main, ``-X importtime``): torch 2.3, transformers' processing and model
#: utilities 4.4, megatron-core 2.1, mlflow 1.1, wandb 0.7, matplotlib 0.5, tensorboard 0.4,
#: swanlab 0.3, fastapi 0.3. A module missing here is skipped (NeMo-RL stands it in or does
#: without it).
HEAVY_MODULES = (
    "torch",
    "torch.distributed",
    "numpy",
    "yaml",
    "pydantic",
    "transformers",
    "transformers.modeling_utils",
    "transformers.image_processing_utils",
    "transformers.processing_utils",
    "transformers.models.auto.auto_factory",
    "megatron.core",
    "megatron.core.parallel_state",
    "mlflow",
    "wandb",
    "matplotlib.pyplot",
    "torch.utils.tensorboard",
    "swanlab",
    "fastapi",
    "hydra.utils",
)


def preload() -> None:
    """Import :data:`HEAVY_MODULES`, skipping any that fails (the fork server must start regardless)."""
    for name in HEAVY_MODULES:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - absent or broken here: the forked process imports it (or not) itself
            pass


# The fork server listens on a socket under multiprocessing's temporary folder, chosen once per
# process: chosen here, at collection, before a test's fixture points TMPDIR at a folder too deep
# for a socket's path (108 bytes; tmp_path's are often longer).
multiprocessing.util.get_temp_dir()


#: The repository root: on the fork server's ``PYTHONPATH`` alone, so that it finds its preload
#: module wherever pytest was started (Python 3.11's fork server does not take the caller's path).
_REPO = str(Path(__file__).resolve().parents[2])


def context() -> multiprocessing.context.ForkServerContext:
    """The ``forkserver`` context whose server runs, with :data:`HEAVY_MODULES` imported."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([f"{__name__}_preload"])
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([_REPO, saved] if saved else [_REPO])
    try:
        multiprocessing.forkserver.ensure_running()  # started with this environment, if not running
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved
    return ctx


def apply_environment(env: dict) -> None:
    """In a forked process: the caller's environment, not the fork server's (and the temporary
    folder it names: ``tempfile`` keeps the first one it found)."""
    if os.environ != env:
        os.environ.clear()
        os.environ.update(env)
    tempfile.tempdir = None


def run_python(
    args: list[str], *, env: dict | None = None, cwd=None, timeout: float | None = None, input: str | None = None
) -> subprocess.CompletedProcess:
    """``subprocess.run([sys.executable, *args], capture_output=True, text=True, ...)``, forked.

    ``args`` as the interpreter takes them: ``script.py ...``, ``-c CODE ...`` or ``-m MODULE
    ...``, after any ``-W ACTION``. The process starts as a fresh interpreter would in what a
    script reads after start-up: ``sys.argv``, ``sys.path`` (the script's folder, ``''`` or the
    working directory first, then ``PYTHONPATH`` from ``env``, then the interpreter's own), the
    environment and working directory given, the temporary folder they name, standard input from
    ``input``; NeMo-RL, the plugin and the test modules are not imported yet. It differs in what
    was decided at the server's start: :data:`HEAVY_MODULES` imported (and what they read from
    the environment then), the hash seed, ``PYTHONWARNINGS``/``PYTHONIOENCODING``, the ``.pth``
    start-up hook run; and ``atexit`` handlers run before the fork server's ``os._exit``, not at
    interpreter shutdown. A script about any of those keeps ``subprocess``. Output comes back
    whole whatever the exit (files, not pipes: no deadlock on a large output).
    """
    if args[0].startswith("-") and args[0] not in ("-c", "-m", "-W"):
        raise ValueError(f"run_python: interpreter option {args[0]} is not supported (use subprocess)")
    env = dict(os.environ if env is None else env)
    cwd = os.fspath(cwd) if cwd is not None else os.getcwd()
    with tempfile.TemporaryDirectory(prefix="fork-run-") as tmp:
        paths = {name: os.path.join(tmp, name) for name in ("stdin", "stdout", "stderr")}
        with open(paths["stdin"], "w") as f:
            f.write(input or "")
        proc = context().Process(target=_run_as_interpreter, args=(list(args), env, cwd, paths), name="run_python")
        proc.start()
        proc.join(timeout)
        timed_out = proc.is_alive()
        if timed_out:
            proc.kill()
            proc.join()
        out, err = (Path(paths[name]).read_text(errors="replace") for name in ("stdout", "stderr"))
    if timed_out:
        raise subprocess.TimeoutExpired([sys.executable, *args], timeout, output=out, stderr=err)
    return subprocess.CompletedProcess([sys.executable, *args], proc.exitcode, out, err)


def _run_as_interpreter(args, env, cwd, paths):  # in the forked process
    import atexit
    import runpy
    import types
    import warnings

    write = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    for fd, name, mode in ((0, "stdin", os.O_RDONLY), (1, "stdout", write), (2, "stderr", write)):
        os.dup2(os.open(paths[name], mode, 0o644), fd)
    sys.stdin = open(0, closefd=False)
    sys.stdout = open(1, "w", closefd=False)
    sys.stderr = open(2, "w", buffering=1, errors="backslashreplace", closefd=False)  # as an interpreter's
    # The server's own start-up path, kept by its preload; missing, nothing was preloaded (say so).
    preloaded = sys.modules.get("tests.support.fork_server_preload")
    if preloaded is None:
        raise RuntimeError("the fork server did not import tests.support.fork_server_preload: nothing is preloaded")
    apply_environment(env)
    os.chdir(cwd)
    # Forget the test modules this process inherited: the script imports what it imports.
    for name in [m for m in sys.modules if m == "tests" or m.startswith("tests.")]:
        del sys.modules[name]
    while args[0] == "-W":  # the one interpreter option the tests pass: ``-W ignore``
        sys.warnoptions.append(args[1])
        warnings.simplefilter(args[1])  # type: ignore[arg-type]
        args = args[2:]
    if args[0] == "-c":
        first, sys.argv = "", ["-c", *args[2:]]
    elif args[0] == "-m":
        first, sys.argv = cwd, [args[1], *args[2:]]
    else:
        first, sys.argv = os.path.dirname(os.path.abspath(args[0])), list(args)
    # As the interpreter reads PYTHONPATH: entries made absolute, an empty one is the working directory.
    python_path = (
        [os.path.abspath(p) if p else cwd for p in env["PYTHONPATH"].split(os.pathsep)] if env.get("PYTHONPATH") else []
    )
    server_only = set(preloaded.SERVER_PYTHONPATH)
    interpreter_path = [p for p in preloaded.SERVER_SYS_PATH[1:] if p not in server_only]
    sys.path[:] = [first, *python_path, *interpreter_path]
    try:
        if args[0] == "-c":
            main = types.ModuleType("__main__")
            sys.modules["__main__"] = main
            exec(compile(args[1], "<string>", "exec", dont_inherit=True), main.__dict__)  # not this module's __future__
        elif args[0] == "-m":
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(args[0], run_name="__main__")
    finally:
        atexit._run_exitfuncs()  # the fork server's child leaves with os._exit, which skips them
