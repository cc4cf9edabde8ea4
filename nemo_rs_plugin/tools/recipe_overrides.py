"""Hydra-style overrides applied by ``nemo-rs check`` where NeMo-RL's own loader is absent.

``a.b=value`` changes a key the recipe has (the value read as YAML), ``+a.b=value`` adds one it
does not have, ``++a.b=value`` does either, ``~a.b`` deletes; list entries by index. The
rules are Hydra's struct mode, as NeMo-RL's ``parse_hydra_overrides`` applies them; a
problem is one :class:`OverrideError` line naming the override.
"""

from __future__ import annotations

from typing import Any, Optional

import yaml

__all__ = ["OverrideError", "apply_override", "one_line", "override_key"]


def one_line(exc: BaseException, strip: str = "") -> str:
    """``Type: message`` on one line (Hydra and pydantic messages span several)."""
    text = str(exc)
    if strip and text.startswith(strip):
        text = text[len(strip) :]
    parts = [line.strip() for line in text.splitlines()]
    parts = [p for p in parts if p and set(p) != {"^"} and not p.startswith("See https://")]
    return f"{type(exc).__name__}: {' '.join(parts)}" if parts else type(exc).__name__


class OverrideError(ValueError):
    """An override that does not fit the recipe; the message names the override."""


def override_key(override: str) -> tuple[str, str, Optional[str]]:
    """``(kind, dotted key, value)`` of ``key=value`` / ``+key=value`` / ``++key=value`` / ``~key``."""
    if override.startswith("~"):
        kind, rest = "~", override[1:]
        key, _, text = rest.partition("=")
        value: Optional[str] = text or None  # ~key deletes whatever is there; ~key=v only if it is v
    else:
        kind = "++" if override.startswith("++") else "+" if override.startswith("+") else ""
        key, sep, value = override[len(kind) :].partition("=")
        if not sep:
            raise OverrideError(f"override {override!r}: expected key=value")
    parts = key.split(".")
    if not key or any(not p.strip() or p != p.strip() for p in parts):
        raise OverrideError(f"override {override!r}: {key!r} is not a dotted key (e.g. loss_fn.ratio_clip_max)")
    return kind, key, value


def _child(node: Any, key: str, where: str, override: str, create: bool, indexes_next: bool) -> Any:
    if isinstance(node, dict):
        if key not in node:
            here = f"{where}.{key}" if where else key
            if indexes_next:  # a.b.0.c with no list at a.b: nothing to index
                raise OverrideError(
                    f"override {override!r}: there is no list at {here} to index; add it whole (+{here}=[...])"
                )
            if not create:
                raise OverrideError(
                    f"override {override!r}: {where or 'the recipe'} has no key {key!r}; to add {here}, "
                    f"write +{override.lstrip('+')}"
                )
            node[key] = {}
        return node[key]
    if isinstance(node, list):
        return node[_index(node, key, where, override)]
    raise OverrideError(
        f"override {override!r}: {where} is a {type(node).__name__} ({node!r}), not a mapping or a list"
    )


def _index(node: list, key: str, where: str, override: str) -> int:
    try:
        i = int(key)
    except ValueError:
        raise OverrideError(f"override {override!r}: {where} is a list; {key!r} is not an index") from None
    if not 0 <= i < len(node):
        raise OverrideError(f"override {override!r}: {where} has {len(node)} entries; index {i} is out of range")
    return i


def apply_override(cfg: dict, override: str, complete: bool = True) -> None:
    """``a.b.c=value`` / ``+a.b=value`` / ``++a.b=value`` (value parsed as YAML) / ``~a.b`` (delete), in place.

    Hydra's rules, as NeMo-RL applies them: ``key=value`` changes a key that exists, ``+key=value``
    adds one that does not, ``++`` does either. ``complete`` says the recipe is whole (every file of
    its ``defaults`` found): only then is a missing key known to be missing; otherwise it may
    come from an unresolved parent and ``key=value`` adds it.

    Raises:
        OverrideError: one line naming the override and what does not fit.
    """
    kind, key, value = override_key(override)
    if kind != "~":  # the value is parsed first, as Hydra parses the whole override first
        try:
            parsed = yaml.safe_load(value)
        except yaml.YAMLError as exc:
            raise OverrideError(f"override {override!r}: the value is not valid YAML ({one_line(exc)})") from None
    parts = key.split(".")
    node: Any = cfg
    create = kind in ("+", "++") or (kind == "" and not complete)
    for depth, k in enumerate(parts[:-1]):
        node = _child(node, k, ".".join(parts[:depth]), override, create, parts[depth + 1].isdigit())
    where, last = ".".join(parts[:-1]), parts[-1]
    if isinstance(node, dict) and kind == "" and complete and last not in node:
        raise OverrideError(
            f"override {override!r}: {key} is not in the recipe; to add it, write +{override} "
            "(Hydra refuses to change a key that does not exist)"
        )
    if isinstance(node, dict) and kind == "+" and last in node:
        raise OverrideError(
            f"override {override!r}: {key} is already in the recipe; to change it, write "
            f"{override[1:]} (or ++{override[1:]} to add or change)"
        )
    if kind == "~":
        if isinstance(node, dict) and last in node:
            del node[last]
        elif isinstance(node, list):
            del node[_index(node, last, where, override)]
        else:
            raise OverrideError(f"override {override!r}: nothing to delete at {key}")
        return
    if isinstance(node, dict):
        node[last] = parsed
    elif isinstance(node, list):
        node[_index(node, last, where, override)] = parsed
    else:
        raise OverrideError(
            f"override {override!r}: {where} is a {type(node).__name__} ({node!r}), not a mapping or a list"
        )
