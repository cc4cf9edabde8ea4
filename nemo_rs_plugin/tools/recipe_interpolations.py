"""Resolving a plain-YAML recipe's ``${...}`` interpolations as NeMo-RL's OmegaConf would, without NeMo-RL.

:func:`resolve_interpolations` replaces each interpolation by its value with OmegaConf (a
dependency; NeMo-RL loads recipes with it) and classifies the ones that do not resolve here
(:class:`Unresolved`): refused by NeMo-RL too (a key not in a whole recipe, a malformed ``${``),
or resolved only in NeMo-RL's environment (its resolvers :data:`NEMO_RL_RESOLVERS`, a key from
``defaults`` that were not found, an environment variable). How they are reported is
:mod:`~nemo_rs_plugin.tools.recipe_loading`'s business.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, NamedTuple

from nemo_rs_plugin.tools.recipe_overrides import one_line

__all__ = ["NEMO_RL_RESOLVERS", "Unresolved", "UnresolvedLeaf", "resolve_interpolations"]

#: The OmegaConf resolvers NeMo-RL registers (``register_omegaconf_resolvers`` in
#: ``nemo_rl/utils/config.py``: ``mul``, ``div``, ``max`` in every supported version, ``add`` on main).
NEMO_RL_RESOLVERS = ("add", "mul", "div", "max")


@dataclass(frozen=True)
class Unresolved:
    """Why one interpolation does not resolve here; ``error``: NeMo-RL refuses the recipe for it too."""

    why: str
    error: bool = False
    needs_nemo_rl: bool = False


class UnresolvedLeaf(NamedTuple):
    """A ``${...}`` leaf that :func:`resolve_interpolations` removed from the recipe: it does not resolve here."""

    #: The keys and list indices down to the leaf.
    path: tuple
    #: The interpolation as the recipe writes it.
    interpolation: str
    reason: Unresolved


def resolve_interpolations(cfg: dict, complete: bool) -> list[UnresolvedLeaf]:
    """Replace each ``${...}`` leaf of ``cfg`` by its value, in place, as NeMo-RL's OmegaConf would.

    A leaf that does not resolve here is removed from ``cfg`` and returned, in the recipe's order,
    with why. One NeMo-RL would refuse too (a key not in the recipe when every ``defaults`` file was
    found, ``complete``; a malformed one) has ``reason.error`` set; one that only NeMo-RL's
    environment may resolve (its resolvers, a key from ``defaults`` not found, an environment
    variable), or every one without OmegaConf, does not.
    """
    leaves = _interpolated_leaves(cfg)
    if not leaves:
        return []
    outcome: dict[tuple, Any] = {}
    try:
        from omegaconf import OmegaConf
        from omegaconf import errors as oc_errors
    except ImportError as exc:
        missing = Unresolved(
            f"OmegaConf is not importable ({one_line(exc)}); nemo-rs-plugin depends on it: pip install omegaconf"
        )
        outcome = {path: missing for path in leaves}
    else:
        for path in leaves:  # a malformed interpolation would make the whole container fail
            try:
                OmegaConf.create({"value": _at(cfg, path)})
            except oc_errors.GrammarParseError as exc:
                outcome[path] = _why_unresolved(exc, complete)
        readable = _without(cfg, [p for p in outcome])
        try:
            container = OmegaConf.create(readable)
        except Exception as exc:  # noqa: BLE001 - e.g. a value of a type OmegaConf does not hold
            refused = Unresolved(f"OmegaConf cannot hold this recipe ({one_line(exc)})")
            container = None
            outcome.update({path: refused for path in leaves if path not in outcome})
        for path in leaves:
            if path in outcome or container is None:
                continue
            try:
                node: Any = container
                for key in path:
                    node = node[key]  # reading a node resolves its interpolation
                if OmegaConf.is_config(node):  # `${grpo}`: a whole section
                    node = OmegaConf.to_container(node, resolve=True)
                outcome[path] = node
            except Exception as exc:  # noqa: BLE001 - classified: an error, or not checked
                outcome[path] = _why_unresolved(exc, complete)
    texts = {path: _at(cfg, path) for path in leaves}
    for path in reversed(leaves):  # the last first: removing a list entry leaves the earlier ones in place
        parent = _at(cfg, path[:-1])
        if isinstance(outcome[path], Unresolved):
            del parent[path[-1]]
        else:
            parent[path[-1]] = outcome[path]
    return [
        UnresolvedLeaf(path, texts[path], outcome[path]) for path in leaves if isinstance(outcome[path], Unresolved)
    ]


def _interpolated_leaves(node: Any, path: tuple = ()) -> list[tuple]:
    """Paths (tuples of keys / indices) of the string leaves holding a ``${...}`` interpolation."""
    if isinstance(node, dict):
        return [p for k, v in node.items() for p in _interpolated_leaves(v, path + (k,))]
    if isinstance(node, list):
        return [p for i, v in enumerate(node) for p in _interpolated_leaves(v, path + (i,))]
    return [path] if isinstance(node, str) and "${" in node else []


def _first_line(exc: BaseException) -> str:
    return next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)


def _why_unresolved(exc: Exception, complete: bool) -> Unresolved:
    """Classify OmegaConf's failure to resolve one interpolation (``complete``: every ``defaults`` file was found)."""
    from omegaconf import errors as oc_errors

    message = _first_line(exc)
    if isinstance(exc, oc_errors.GrammarParseError):
        return Unresolved(f"is not a valid interpolation ({message}); NeMo-RL's OmegaConf refuses it too", error=True)
    if isinstance(exc, (oc_errors.InterpolationKeyError, oc_errors.InterpolationToMissingValueError)):
        if complete:
            return Unresolved(
                f"does not resolve: {message}; NeMo-RL resolves the recipe when the run starts and refuses it "
                "then: define that key in the recipe, or correct the reference",
                error=True,
            )
        return Unresolved(f"{message} (it may come from the defaults that were not found)")
    if isinstance(exc, oc_errors.UnsupportedInterpolationType):
        found = re.search(r"Unsupported interpolation type (\S+)", message)
        resolver = found.group(1) if found else "?"
        if resolver in NEMO_RL_RESOLVERS:
            return Unresolved(f"NeMo-RL's resolver {resolver}, registered only where NeMo-RL is", needs_nemo_rl=True)
        return Unresolved(
            f"the resolver {resolver} is not registered here (NeMo-RL registers {', '.join(NEMO_RL_RESOLVERS)}; "
            "another must be registered by the program that loads the recipe)"
        )
    return Unresolved(f"{message} (OmegaConf, here; the run's environment may differ)")


def _at(cfg: Any, path: tuple) -> Any:
    for key in path:
        cfg = cfg[key]
    return cfg


def _without(node: Any, paths: list[tuple]) -> Any:
    """A copy of ``node`` with the leaves at ``paths`` set to ``None`` (the containers copied, leaves shared)."""
    if isinstance(node, dict):
        node = dict(node)
        keys = node.items()
    elif isinstance(node, list):
        node = list(node)
        keys = enumerate(node)
    else:
        return node
    for key, value in list(keys):
        inner = [p[1:] for p in paths if p[:1] == (key,)]
        if () in inner:
            node[key] = None
        elif inner:
            node[key] = _without(value, inner)
    return node
