"""How ``nemo-rs check`` loads a recipe: as NeMo-RL does where it is found, else itself.

With NeMo-RL importable (``--nemo-rl PATH`` puts a checkout on the path) the recipe goes
through NeMo-RL's own ``load_config`` (``defaults`` inheritance) and ``parse_hydra_overrides``.
Without it, the plugin reads the YAML, resolves ``defaults`` relative to each file where the
files exist, and applies Hydra-style overrides (``a.b=v``, ``+a.b=v``, ``++a.b=v``, ``~a.b``)
itself, and resolves ``${...}`` interpolations with OmegaConf (a dependency; NeMo-RL loads
recipes with it). An interpolation that NeMo-RL would refuse too (a key not in a whole recipe,
a malformed ``${``) is an error naming the field, the interpolation and why; one that only
NeMo-RL's environment resolves (its resolvers ``mul``, ``max``, ..., a key from ``defaults``
that were not found, an environment variable) leaves that field out, listed as not checked in
``report.unchecked`` and in ``report.unresolved``. Problems are one line each in
``report.errors``; what could not be loaded the way NeMo-RL loads it is in
``report.unchecked``; nothing raises.

This module chooses the way and writes the report; reading the YAML without NeMo-RL is
:mod:`~nemo_rs_plugin.tools.recipe_yaml`'s job, resolving its interpolations
:mod:`~nemo_rs_plugin.tools.recipe_interpolations`'s.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Optional, Protocol, cast

import yaml

from nemo_rs_plugin.core.settings.config import ConfigError
from nemo_rs_plugin.nemo_rl.recipe_defaults import defaults_of, nemo_rl_checkout_problem
from nemo_rs_plugin.nemo_rl.recipe_defaults import dotted_value as recipe_value  # the tools' name for it
from nemo_rs_plugin.tools.recipe_interpolations import resolve_interpolations
from nemo_rs_plugin.tools.recipe_overrides import OverrideError, apply_override, one_line, override_key
from nemo_rs_plugin.tools.recipe_yaml import defaults_found, load_with_defaults, parent_with_loss_mapping, read_yaml

__all__ = [
    "HOW_TO_CHECK",
    "HOW_TO_CHECK_IN_NEMO_RL",
    "INHERITED_NOT_FOUND",
    "LoadReport",
    "LoadedRecipe",
    "OverrideError",
    "flatten",
    "load_recipe",
    "one_line",
    "recipe_value",
    "unresolved_problems",
    "with_cause",
]

#: How an unchecked line about parents not found starts (check.py reads it to tell a missing loss_fn
#: from one that may be inherited).
INHERITED_NOT_FOUND = "fields inherited through defaults:"
#: What ends a 'not checked' line that only NeMo-RL's own environment can check; the remedy itself,
#: :data:`HOW_TO_CHECK_IN_NEMO_RL`, is said once after those lines (``nemo-rs check`` prints it).
HOW_TO_CHECK = "needs NeMo-RL's environment (how: below)"
HOW_TO_CHECK_IN_NEMO_RL = (
    "how to check what needs NeMo-RL's environment: run nemo-rs check in NeMo-RL's own environment "
    "(where `import nemo_rl.algorithms.grpo` works, e.g. `uv run nemo-rs check ...` in the NeMo-RL "
    "checkout with nemo-rs-plugin installed there); a checkout named by --nemo-rl outside it also needs "
    "what NeMo-RL's modules import, listed in .ci/nemo-rl-host-requirements.txt of nemo-rs-plugin's "
    "source (its sdist and git tree; pip install -r it), and NeMo-RL v0.7.0 and main need Python >= 3.12 "
    "for their MasterConfig (nemo_rl.algorithms.grpo does not import on an older Python; v0.6.0's is a "
    "TypedDict, which NeMo-RL does not validate)"
)


class LoadReport(Protocol):
    """What loading writes to (:class:`~nemo_rs_plugin.tools.check.CheckReport` is one).

    ``unresolved``: the fields left out of the recipe because their ``${...}`` interpolation
    does not resolve here (dotted path, e.g. ``loss_fn.rejection_sampling.0.upper``, to why).
    """

    errors: list[str]
    notes: list[str]
    unchecked: list[str]
    nemo_rl: bool
    unresolved: dict[str, str]


@dataclass
class LoadedRecipe:
    """A :class:`LoadReport` for the commands that load a recipe without checking it (simulate, calibrate)."""

    errors: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    unchecked: list[str] = field(default_factory=list)
    nemo_rl: bool = False
    unresolved: dict[str, str] = field(default_factory=dict)


def unresolved_problems(where: str, unresolved: dict[str, str], command: str, under: str) -> list[str]:
    """One line per field at or under ``under`` left out as unresolved (``report.unresolved``): ``command`` needs it.

    ``nemo-rs check`` lists such a field as not checked; a simulated row or a calibrated band
    without it would not be the recipe's.
    """
    return [
        f"{where}: {dotted}: {why}; {command} needs its value: make it resolve, or give it as an override "
        f"({dotted}=VALUE)"
        for dotted, why in unresolved.items()
        if dotted == under or dotted.startswith(f"{under}.") or under.startswith(f"{dotted}.")
    ]


def with_cause(exc: BaseException, strip: str = "") -> str:
    """:func:`one_line` plus the first line of the innermost cause (Hydra hides it)."""
    text = one_line(exc, strip)
    inner, seen = exc, 0
    cause = inner.__cause__ or inner.__context__
    while cause is not None and seen < 10:
        inner, seen = cause, seen + 1
        cause = inner.__cause__ or inner.__context__
    first = next((line.strip() for line in str(inner).splitlines() if line.strip()), "")
    if inner is not exc and first and first not in text:
        text += f" ({first})"
    return text


def flatten(line: str) -> str:
    """``line`` with its line breaks folded: one problem, one line of output."""
    return " ".join(part.strip() for part in str(line).splitlines() if part.strip())


def _find_nemo_rl(nemo_rl_path: Optional[str], report: LoadReport) -> tuple[bool, Optional[str]]:
    """``(importable, checkout root)``; a bad ``--nemo-rl`` is an error, an import failure unchecked."""
    root = None
    if nemo_rl_path:
        root = os.path.abspath(os.path.expanduser(nemo_rl_path))
        what = nemo_rl_checkout_problem(root)
        if what is not None:
            report.errors.append(f"--nemo-rl {nemo_rl_path}: not a NeMo-RL checkout ({what})")
            return False, None
        if root not in sys.path:
            sys.path.insert(0, root)
    why = None
    try:
        installed = importlib.util.find_spec("nemo_rl") is not None
    except (ImportError, ValueError):
        installed = False
    if not installed:
        why = "NeMo-RL is not installed in this environment"
    else:
        try:
            import nemo_rl.utils.config  # noqa: F401
        except Exception as exc:  # noqa: BLE001 - any import failure: reported as not checked
            where = f"NeMo-RL at {nemo_rl_path}" if nemo_rl_path else "NeMo-RL"
            why = f"{where} does not import here ({one_line(exc)})"
    if why is not None:
        report.unchecked.append(
            "NeMo-RL's config loading (defaults, interpolations, overrides), its MasterConfig and "
            f"its version's loss rules: {why}; {HOW_TO_CHECK}"
        )
        return False, root
    import nemo_rl

    found = os.path.dirname(os.path.dirname(os.path.realpath(nemo_rl.__file__)))
    if root and found != os.path.realpath(root):
        report.errors.append(f"--nemo-rl {nemo_rl_path}: this process already imported NeMo-RL from {found}")
        return False, None
    if root is None and os.path.isdir(os.path.join(found, "examples", "configs")):
        root = found
    return True, root


def _indentation_problem(path: str, line: int) -> Optional[str]:
    from nemo_rs_plugin.tools.recipe_yaml import indentation_problem

    try:
        with open(path) as fh:
            return indentation_problem(fh.read(), line)
    except (OSError, UnicodeDecodeError):
        return None


def load_recipe(path: str, overrides: list[str], nemo_rl_path: Optional[str], report: LoadReport) -> Optional[dict]:
    """The resolved recipe as plain data, or ``None`` with ``report.errors`` filled.

    Sets ``report.nemo_rl`` and adds to ``report.unchecked`` what could not be loaded the way
    NeMo-RL loads it. Temporary files (a shipped recipe placed in a checkout) are removed.
    """
    if os.path.isdir(path):
        report.errors.append(f"{path}: is a directory; name a recipe file (a .yaml in it)")
        return None
    if not os.path.isfile(path):
        report.errors.append(f"{path}: no such file")
        return None
    try:
        raw = read_yaml(path)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f":{mark.line + 1}:{mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        indentation = _indentation_problem(path, mark.line) if mark is not None else None
        if indentation is not None:  # PyYAML names a token ("found '?'") that is not in the file
            problem = f"mis-indented: {indentation} (PyYAML: {problem})"
        report.errors.append(f"{path}{where}: invalid YAML: {problem}")
        return None
    except (OSError, UnicodeDecodeError) as exc:
        report.errors.append(f"{path}: cannot read it ({one_line(exc)})")
        return None
    for o in overrides:
        try:
            override_key(o)
        except OverrideError as exc:
            report.errors.append(str(exc))
    have_nemo_rl, root = _find_nemo_rl(nemo_rl_path, report)
    report.nemo_rl = have_nemo_rl
    if report.errors:
        return None
    with tempfile.TemporaryDirectory(prefix="nemo-rs-check-") as tmp:
        load_path = path
        if root and defaults_of(raw) and not defaults_found(path):
            # A shipped recipe outside a checkout: resolve its defaults as if it sat in
            # <NeMo-RL>/examples/configs/recipes/llm/ (where `nemo-rs recipes` puts it).
            from nemo_rs_plugin.tools.recipes import export_recipe

            load_path = str(export_recipe(path, tmp, root))
            report.notes.append(f"defaults resolved against {root}")
        if isinstance(raw.get("loss_fn"), str):
            parent = parent_with_loss_mapping(load_path)
            if parent is not None:
                report.errors.append(
                    f"loss_fn: the shorthand `loss_fn: {raw['loss_fn']}` would replace the loss_fn "
                    f"mapping inherited from {parent} (dropping its settings); write the mapping "
                    f"form, loss_fn: {{name: {raw['loss_fn']}, ...}}"
                )
                return None
        if have_nemo_rl:
            return _load_with_nemo_rl(load_path, path, overrides, report)
        return _load_without_nemo_rl(load_path, path, overrides, report)


def _load_with_nemo_rl(load_path: str, path: str, overrides: list[str], report: LoadReport) -> Optional[dict]:
    from nemo_rl.utils import config as host_config

    if hasattr(host_config, "register_omegaconf_resolvers"):
        try:
            host_config.register_omegaconf_resolvers()
        except ValueError:
            pass  # already registered in this process
    try:
        cfg = host_config.load_config(load_path)
    except ConfigError as exc:
        report.errors.extend(exc.problems)
        return None
    except Exception as exc:  # noqa: BLE001 - reported as a line, never a traceback
        report.errors.append(f"{path}: NeMo-RL's load_config rejects it: {with_cause(exc)}")
        return None
    for o in overrides:
        try:
            cfg = host_config.parse_hydra_overrides(cfg, [o])
        except Exception as exc:  # noqa: BLE001
            report.errors.append(f"override {o!r}: {with_cause(exc, strip='Failed to parse Hydra overrides: ')}")
    if report.errors:
        return None
    if isinstance(cfg, dict):
        resolved = cfg
    else:
        try:
            from omegaconf import OmegaConf

            # load_config returns a DictConfig: its container is a dict
            resolved = cast(dict, OmegaConf.to_container(cfg, resolve=True))
        except Exception as exc:  # noqa: BLE001
            report.errors.append(f"{path}: NeMo-RL's config does not resolve: {one_line(exc)}")
            return None
    report.notes.append("loaded with NeMo-RL's load_config")
    return resolved


def _load_without_nemo_rl(load_path: str, path: str, overrides: list[str], report: LoadReport) -> Optional[dict]:
    missing: list[str] = []
    try:
        cfg = load_with_defaults(load_path, missing)
    except (yaml.YAMLError, OSError, UnicodeDecodeError) as exc:
        report.errors.append(f"{path}: a file it inherits through defaults does not load ({one_line(exc)})")
        return None
    for parent in dict.fromkeys(missing):
        report.unchecked.append(
            f"{INHERITED_NOT_FOUND} {parent} not found next to the recipe; run where the recipe sits in a "
            "NeMo-RL checkout (nemo-rs check also takes --nemo-rl PATH)"
        )
    for o in overrides:
        try:
            apply_override(cfg, o, complete=not missing)
        except OverrideError as exc:
            report.errors.append(str(exc))
    if report.errors:
        return None
    _resolve_interpolations(cfg, report, complete=not missing)
    return None if report.errors else cfg


def _resolve_interpolations(cfg: dict, report: LoadReport, complete: bool) -> None:
    """Resolve ``cfg``'s ``${...}`` leaves in place (:func:`resolve_interpolations`); report those that do not.

    An interpolation NeMo-RL would refuse too (a key not in the recipe when every ``defaults``
    file was found, a malformed one) is an error naming the field. One that only NeMo-RL's
    environment may resolve (its resolvers, a key from ``defaults`` not found, an environment
    variable), or every one without OmegaConf, is left out of ``cfg`` and listed in
    ``report.unresolved`` and ``report.unchecked`` (one line per field of ``loss_fn``, one line
    for all the others): refusing ``ratio_clip_max: ${loss_fn.ratio_clip_min}`` as "a string"
    would be wrong, and so would be reading a filter without its bound.
    """
    others: dict[str, list[str]] = {}
    needs_nemo_rl = False
    for path, text, value in resolve_interpolations(cfg, complete):
        dotted = ".".join(str(k) for k in path)
        if value.error:
            report.errors.append(f"{dotted}: the interpolation {text} {value.why}")
            continue
        report.unresolved[dotted] = f"the interpolation {text} does not resolve here: {value.why}"
        how = f"; {HOW_TO_CHECK}" if value.needs_nemo_rl else ""
        if path[0] == "loss_fn":
            report.unchecked.append(f"{dotted}: {report.unresolved[dotted]}; loss_fn is checked without it{how}")
        else:
            others.setdefault(value.why, []).append(dotted)
            needs_nemo_rl |= value.needs_nemo_rl
    if others:
        count = sum(len(paths) for paths in others.values())
        fields = "; ".join(f"{', '.join(paths)} ({why})" for why, paths in others.items())
        report.unchecked.append(
            f"{count} interpolation(s) outside loss_fn do not resolve here, so these fields are not checked: "
            f"{fields}{f'; {HOW_TO_CHECK}' if needs_nemo_rl else ''}"
        )
