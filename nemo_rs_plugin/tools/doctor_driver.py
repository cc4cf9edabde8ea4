"""The doctor's checks in the driver: the recipe, the start-up hook, NeMo-RL, its loss selectors, the loss, the install.

Each check prints its line to a :class:`~nemo_rs_plugin.tools.doctor_report.DoctorReport`; one
that later checks depend on stops them when it fails. What they import beyond the standard
library (PyYAML, NeMo-RL, the plugin's NeMo-RL glue) is imported inside them: this module is
standard library only at import, as every module ``nemo-rs doctor`` imports.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from typing import Any, Optional

from nemo_rs_plugin.core.settings.presets import PLUGIN_LOSS_NAME as PLUGIN_NAME  # standard library only
from nemo_rs_plugin.nemo_rl.recipe_defaults import nemo_rl_checkout_problem, parent_paths  # standard library only
from nemo_rs_plugin.tools.doctor_report import DoctorReport, StopChecks  # standard library only

__all__ = [
    "check_hook",
    "check_install",
    "check_loss",
    "check_nemo_rl",
    "check_recipe_files",
    "check_selectors",
    "inspect_source",
    "nemo_rl_commit",
]


def check_recipe_files(report: DoctorReport, recipe: str) -> None:
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


def check_hook(report: DoctorReport) -> Any:
    """The start-up hook ran in this interpreter and is not switched off; the hook module."""
    hook: Any = sys.modules.get("_nemo_rs_plugin_hook")
    if hook is None or not hook.installed():
        import nemo_rs_plugin

        report.fail(
            "start-up hook",
            f"did not run in this interpreter ({sys.executable}): nemo-rs-plugin is not installed "
            f"in {sys.prefix} (nemo_rs_plugin was imported from "
            f"{os.path.dirname(nemo_rs_plugin.__file__)}), so NeMo-RL builds its own loss "
            "whatever the recipe names. In NeMo-RL's checkout: uv add --editable "
            "/path/to/nemo-rs-plugin (docs/install.md: Into NeMo-RL's uv project).",
            stop=True,
        )
    if hook.disabled():
        report.fail(
            "start-up hook",
            f"{hook.DISABLE_ENV}={os.environ.get(hook.DISABLE_ENV)} switches the plugin off: "
            "NeMo-RL builds its own loss, and recipes naming a plugin loss are refused.",
            stop=True,
        )
    if hook.unrecognised_setting() is not None:
        report.warn("start-up hook", hook.state())
    report.ok("start-up hook", f"active in {sys.executable} ({hook.__file__}); {hook.state()}")
    return hook


def use_checkout(report: DoctorReport, path: str) -> None:
    """``--nemo-rl PATH``: NeMo-RL from that checkout, put first on the path as ``nemo-rs check --nemo-rl`` does."""
    root = os.path.abspath(os.path.expanduser(path))
    what = nemo_rl_checkout_problem(root)
    if what is not None:
        report.fail("NeMo-RL", f"--nemo-rl {path}: not a NeMo-RL checkout ({what})", stop=True)
    if root not in sys.path:
        sys.path.insert(0, root)


def check_nemo_rl(report: DoctorReport) -> Any:
    """NeMo-RL imports here and its loss API is supported; the ``nemo_rl`` package."""
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


def check_selectors(report: DoctorReport, hook: Any) -> Any:
    """``ClippedPGLossFn`` is the plugin's selector where NeMo-RL builds its loss; the GRPO module.

    Also that NeMo-RL's own class refuses a plugin loss and that ``load_config`` is patched.
    """
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
        raise StopChecks
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


def check_loss(report: DoctorReport, grpo: Any, hook: Any, recipe: Optional[str]) -> Any:
    """GRPO's ``ClippedPGLossFn`` builds the class ``recipe``'s ``loss_fn.name`` (else the plugin's) names; the loss."""
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


def check_install(report: DoctorReport, nemo_rl: Any) -> None:
    """Whether the plugin is a dependency of NeMo-RL's project (else the next ``uv sync`` removes it: a warning)."""
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
            "/path/to/nemo-rs-plugin` keeps it (docs/install.md: Into NeMo-RL's uv project)",
        )
