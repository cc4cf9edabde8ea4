"""``python -m nemo_rs_plugin.tools.doctor [RECIPE]``: prove the plugin is active where NeMo-RL runs.

Run it the way training runs, from NeMo-RL's checkout (``uv run python -m
nemo_rs_plugin.tools.doctor my-recipe.yaml``). In this interpreter, the driver, it checks that:

* the start-up hook ran here and is not switched off (``NEMO_RS_PLUGIN_DISABLE``);
* NeMo-RL is importable and its loss API supported;
* after importing ``nemo_rl.algorithms.grpo`` (and ``ppo``, and the single-controller setup
  where they exist) the name ``ClippedPGLossFn`` there is the plugin's selector, and the
  module calls it; NeMo-RL's own class refuses configs naming a plugin loss; ``load_config``
  is patched;
* a loss built through GRPO's ``ClippedPGLossFn`` from RECIPE's ``loss_fn`` (loaded with
  NeMo-RL's ``load_config``), or from ``name: rs_clipped_pg``, is the plugin's class;
* the plugin is a dependency of NeMo-RL's project (a ``uv pip install`` is undone by the next
  ``uv sync``);
* the worker-path link is in place; then every worker virtual environment NeMo-RL has built
  (``$NEMO_RL_VENV_DIR``, else ``venvs/`` in the checkout) unpickles that loss, started with
  the environment the driver hands its Ray workers.

RECIPE is read first, before NeMo-RL is imported: a missing file, or ``defaults`` that do not
resolve (relative to the file naming them, as NeMo-RL resolves them), is one failed check
naming the file, and no other check runs.

One line per check; exit status 0 when none fails, 1 otherwise.
"""

from __future__ import annotations

import argparse
import glob
import importlib
import importlib.util
import json
import os
import pickle
import subprocess
import sys
import warnings
from typing import Any, Optional, Sequence, TextIO

from nemo_rs_plugin.core.presets import PLUGIN_LOSS_NAME as PLUGIN_NAME  # standard library only
from nemo_rs_plugin.nemo_rl import workers as worker_links  # standard library only
from nemo_rs_plugin.nemo_rl.recipe_defaults import parent_paths  # standard library only

__all__ = ["HELP", "add_arguments", "main", "run", "run_checks"]

HELP = "prove the plugin is active where NeMo-RL runs (driver and worker venvs)"

WORKER_PROBE = (
    "import json, pickle, sys\n"
    "loss = pickle.loads(sys.stdin.buffer.read())\n"
    "import nemo_rs_plugin\n"
    "print(json.dumps({'type': type(loss).__name__, 'plugin_from': nemo_rs_plugin.__file__,"
    " 'version': nemo_rs_plugin.__version__}))\n"
)


class _Stop(Exception):
    """A failed check that later checks depend on."""


class _Report:
    def __init__(self, out: TextIO):
        self.out = out
        self.failures = 0

    def line(self, status: str, check: str, detail: str) -> None:
        if status == "FAIL":
            self.failures += 1
        print(f"{status:<4} {check}: {detail}", file=self.out, flush=True)

    def ok(self, check: str, detail: str) -> None:
        self.line("ok", check, detail)

    def warn(self, check: str, detail: str) -> None:
        self.line("warn", check, detail)

    def fail(self, check: str, detail: str, stop: bool = False) -> None:
        self.line("FAIL", check, detail)
        if stop:
            raise _Stop


def _recipe(report: _Report, recipe: str) -> None:
    """RECIPE and every file its ``defaults`` chain names exist and read as YAML mappings.

    Checked before NeMo-RL is imported, so that a typo in a path is one failed check, not a
    traceback from NeMo-RL's ``load_config`` (PyYAML, a plugin dependency, is imported here,
    not at the module's import).
    """
    import yaml

    seen: set[str] = set()
    todo: list[tuple[str, Optional[str]]] = [(recipe, None)]  # (file, the file naming it in defaults)
    while todo:
        path, named_by = todo.pop(0)
        where = "" if named_by is None else f" (named in defaults of {named_by})"
        if os.path.isdir(path):
            report.fail("recipe", f"{path}: is a directory{where}; name a recipe file", stop=True)
        if not os.path.isfile(path):
            report.fail("recipe", f"{path}: no such file{where}", stop=True)
        real = os.path.realpath(path)
        if real in seen:
            continue  # NeMo-RL would merge it again; a cycle is not this check's business
        seen.add(real)
        try:
            with open(path) as fh:
                raw = yaml.safe_load(fh)
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
            detail = " ".join(str(exc).split())
            report.fail("recipe", f"{path}: cannot be read as YAML{where}: {type(exc).__name__}: {detail}", stop=True)
        if raw is not None and not isinstance(raw, dict):
            report.fail("recipe", f"{path}: top level is a {type(raw).__name__}{where}; expected a mapping", stop=True)
        todo += [(parent, path) for parent in parent_paths(path, raw)]
    report.ok("recipe", f"{recipe} and the files its defaults name exist and read as YAML")


def _hook(report: _Report) -> Any:
    hook: Any = sys.modules.get("_nemo_rs_plugin_hook")
    if hook is None or not hook.installed():
        import nemo_rs_plugin

        report.fail(
            "start-up hook",
            f"did not run in this interpreter ({sys.executable}): nemo-rs-plugin is not installed "
            f"in {sys.prefix} (nemo_rs_plugin was imported from "
            f"{os.path.dirname(nemo_rs_plugin.__file__)}), so NeMo-RL builds its own loss "
            "whatever the recipe names. In NeMo-RL's checkout: uv add --editable "
            "/path/to/nemo-rs-plugin (README: Use it in NeMo-RL).",
            stop=True,
        )
    if hook.disabled():
        report.fail(
            "start-up hook",
            f"{hook.DISABLE_ENV}={os.environ.get(hook.DISABLE_ENV)} switches the plugin off: "
            "NeMo-RL builds its own loss, and recipes naming a plugin loss are refused.",
            stop=True,
        )
    report.ok("start-up hook", f"active in {sys.executable} ({hook.__file__})")
    return hook


def _nemo_rl(report: _Report) -> Any:
    try:
        import nemo_rl
    except ImportError as exc:
        report.fail(
            "NeMo-RL",
            f"not importable here ({exc}); run the doctor in NeMo-RL's "
            "environment (uv run python -m nemo_rs_plugin.tools.doctor)",
            stop=True,
        )
    from nemo_rs_plugin.nemo_rl.host import host_api

    try:
        api = host_api()
    except ImportError as exc:
        report.fail("NeMo-RL", str(exc), stop=True)
    report.ok(
        "NeMo-RL",
        f"{getattr(nemo_rl, '__version__', 'unknown')}, {nemo_rl_commit(nemo_rl)}, at "
        f"{os.path.dirname(nemo_rl.__file__)} ({api} config)",
    )
    return nemo_rl


def nemo_rl_commit(nemo_rl: Any) -> str:
    """Which NeMo-RL code runs: its checkout's commit, else the one pip or uv recorded, else say so.

    NeMo-RL's ``__version__`` does not tell main from a release (main's says 0.6.0).
    """
    from nemo_rs_plugin.tools.report import git_commit

    commit = git_commit(os.path.dirname(os.path.dirname(os.path.abspath(nemo_rl.__file__))))  # its checkout
    if commit:
        return f"commit {commit}"
    try:  # installed from git by pip / uv: PEP 610's direct_url.json names the commit
        import importlib.metadata
        import json

        direct = json.loads(importlib.metadata.distribution("nemo-rl").read_text("direct_url.json") or "{}")
        recorded = direct.get("vcs_info", {}).get("commit_id")
    except Exception:  # noqa: BLE001 - no distribution, no record: the commit is unknown
        recorded = None
    return f"commit {recorded[:12]} (recorded at install)" if recorded else "commit unknown (not a git checkout)"


def _module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:
        return False


def _selectors(report: _Report, hook: Any) -> Any:
    from nemo_rs_plugin.nemo_rl import activation
    from nemo_rs_plugin.nemo_rl.host import SUPPORTED_NEMO_RL

    grpo = None
    for name in hook.LOSS_MODULES:
        required = name == "nemo_rl.algorithms.grpo"
        if not required and not _module_exists(name):
            continue
        try:
            module = importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - reported, not hidden
            (report.fail if required else report.warn)(name, f"cannot import: {type(exc).__name__}: {exc}")
            continue
        if not isinstance(getattr(module, "ClippedPGLossFn", None), activation.ClippedPGLossSelector):
            report.fail(name, activation.install_failure(module))
            continue
        try:
            calls = "ClippedPGLossFn(" in inspect_source(module)
        except (OSError, TypeError):
            calls = None
        if calls is False:
            report.fail(
                name,
                "ClippedPGLossFn is the plugin's selector, but the module never calls "
                "ClippedPGLossFn(...): this NeMo-RL builds its loss somewhere else "
                f"(supported: {SUPPORTED_NEMO_RL})",
            )
            continue
        report.ok(
            name,
            "ClippedPGLossFn is the plugin's selector"
            + ("" if calls else " (module source not readable: call site not checked)"),
        )
        if required:
            grpo = module
    from nemo_rl.algorithms import loss as host_loss

    if getattr(host_loss.ClippedPGLossFn.__init__, hook.WRAPPED, False):
        report.ok("NeMo-RL's ClippedPGLossFn", "refuses configs that name a plugin loss")
    else:
        report.fail(
            "NeMo-RL's ClippedPGLossFn",
            "not guarded: a construction site the selector misses would train with NeMo-RL's loss",
        )
    if _module_exists(hook.CONFIG_MODULE):
        config = importlib.import_module(hook.CONFIG_MODULE)
        if getattr(config.load_config, hook.WRAPPED, False):
            report.ok(hook.CONFIG_MODULE, "load_config is patched (loss_fn shorthand, early refusal)")
        else:
            report.fail(hook.CONFIG_MODULE, "load_config is not patched")
    if grpo is None:
        raise _Stop
    return grpo


def inspect_source(module: Any) -> str:
    """The source of ``module`` (its loader may be the plugin's, which delegates)."""
    import inspect

    return inspect.getsource(module)


def _plain(section: Any) -> Any:
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(section, DictConfig):
            return OmegaConf.to_container(section, resolve=True)
    except ImportError:
        pass
    return dict(section) if hasattr(section, "keys") else section


def _build(report: _Report, grpo: Any, hook: Any, recipe: Optional[str]) -> Any:
    from nemo_rs_plugin.nemo_rl.registry import get_loss_class

    cfg: Any = {"name": PLUGIN_NAME}
    if recipe:
        config = importlib.import_module(hook.CONFIG_MODULE).load_config(recipe)
        section = config.get("loss_fn")
        name = section.get("name") if hasattr(section, "get") else None
        if name is None:
            report.warn(
                "recipe",
                f"{recipe} names no loss (loss_fn.name): NeMo-RL's own loss will be "
                f"built; the checks below use `name: {PLUGIN_NAME}`",
            )
        else:
            cfg = _plain(section)
    try:
        loss = grpo.ClippedPGLossFn(cfg)
    except Exception as exc:  # noqa: BLE001 - the message is the diagnosis
        report.fail("loss", f"{type(exc).__name__}: {exc}", stop=True)
    expected = get_loss_class(cfg["name"])
    if type(loss) is not expected:
        report.fail(
            "loss",
            f"loss_fn.name {cfg['name']!r} built {type(loss).__module__}."
            f"{type(loss).__qualname__}, not {expected.__module__}.{expected.__qualname__}",
            stop=True,
        )
    report.ok(
        "loss",
        f"loss_fn.name {cfg['name']!r} builds {expected.__module__}.{expected.__qualname__}"
        + (f" from {recipe}" if recipe else ""),
    )
    return loss


def _project(report: _Report, nemo_rl: Any) -> None:
    root = os.path.dirname(os.path.dirname(os.path.abspath(nemo_rl.__file__)))
    pyproject = os.path.join(root, "pyproject.toml")
    try:
        with open(pyproject) as fh:
            text = fh.read()
    except OSError:
        return
    if "nemo-rs-plugin" in text or "nemo_rs_plugin" in text:
        report.ok("install", f"a dependency in {pyproject}: `uv sync` keeps it, worker venvs get it")
    else:
        report.warn(
            "install",
            f"not a dependency in {pyproject}: unless this runs under "
            "`uv run --with`, the next `uv sync` removes it; `uv add --editable "
            "/path/to/nemo-rs-plugin` keeps it (README: Use it in NeMo-RL)",
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
        f"it; {worker_links.WORKER_PATH_ENV} chooses the folder; README: Ray workers)"
    )


def _worker_path(report: _Report, hook: Any) -> Optional[str]:
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


def _workers(report: _Report, nemo_rl: Any, loss: Any, venvs: Optional[str]) -> None:
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


def run_checks(
    recipe: Optional[str] = None, venvs: Optional[str] = None, workers: bool = True, out: Optional[TextIO] = None
) -> int:
    """Run every check, printing one line each (to ``out``, else the current ``sys.stdout``).

    Returns the number of failed checks.
    """
    report = _Report(out if out is not None else sys.stdout)
    if venvs is not None and not workers:
        report.warn("workers", f"--venvs {venvs} does nothing with --no-workers (the worker check is skipped)")
    elif venvs is not None and not os.path.isdir(venvs):
        # Named up front: the worker check that reads it runs only once NeMo-RL is found. It is
        # then skipped: its "no worker venvs there yet" warning would repeat this failure.
        report.fail("workers", f"--venvs {venvs}: no such directory (NeMo-RL's worker venvs, e.g. <NeMo-RL>/venvs)")
        workers = False
    recipe_loads = True
    try:
        if recipe:
            recipe_loads = False
            _recipe(report, recipe)
            recipe_loads = True
        hook = _hook(report)
        nemo_rl = _nemo_rl(report)
        grpo = _selectors(report, hook)
        loss = _build(report, grpo, hook, recipe)
        _project(report, nemo_rl)
        if _worker_path(report, hook) is not None and workers:
            _workers(report, nemo_rl, loss, venvs)
    except _Stop:
        pass
    if not recipe_loads:
        # Nothing about the plugin was checked: say so rather than that it is inactive.
        print(f"{report.failures} check(s) failed: the recipe does not load; fix it and run the doctor again", file=out)
    elif report.failures:
        print(
            f"{report.failures} check(s) failed: a recipe naming {PLUGIN_NAME} will not train "
            "with the plugin's loss here",
            file=out,
        )
    else:
        print(f"nemo-rs-plugin is active: loss_fn.name: {PLUGIN_NAME} builds the plugin's loss", file=out)
    return report.failures


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The doctor's options, for ``nemo-rs doctor`` and ``python -m nemo_rs_plugin.tools.doctor``."""
    parser.add_argument("recipe", nargs="?", help="a recipe to load with NeMo-RL's load_config and build")
    parser.add_argument(
        "--venvs",
        metavar="DIR",
        help="worker virtual environments (default: $NEMO_RL_VENV_DIR, else venvs/ in NeMo-RL)",
    )
    parser.add_argument(
        "--no-workers", dest="workers", action="store_false", help="skip the worker virtual environments"
    )


def run(args: argparse.Namespace) -> int:
    """Run the checks for parsed ``args``; the exit status (0: active, 1: not)."""
    return 1 if run_checks(args.recipe, args.venvs, args.workers) else 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``python -m nemo_rs_plugin.tools.doctor``."""
    parser = argparse.ArgumentParser(prog="python -m nemo_rs_plugin.tools.doctor", description=HELP)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
