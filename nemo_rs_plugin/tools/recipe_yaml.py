"""Reading a recipe's YAML as NeMo-RL's loader reads it, without NeMo-RL.

OmegaConf's scalars (``1e-4`` is a number, ``2024-01-01`` a string), a duplicate key refused as
OmegaConf refuses it, and ``defaults`` merged relative to each file naming them, where the files
exist (the names not found are handed back). Used by
:mod:`~nemo_rs_plugin.tools.recipe_loading` when NeMo-RL is not importable, and to tell whether a
recipe's ``defaults`` resolve where it sits.
"""

from __future__ import annotations

import os
import re
from typing import Any, Optional

import yaml

from nemo_rs_plugin.nemo_rl.recipe_defaults import defaults_of, parent_paths

__all__ = ["defaults_found", "indentation_problem", "load_with_defaults", "parent_with_loss_mapping", "read_yaml"]


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.safe_load`` keeps the last of two equal keys silently; OmegaConf (NeMo-RL) refuses them."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor`: merged keys may be overridden
                continue
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (the first would be ignored)", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


class _RecipeLoader(_UniqueKeyLoader):
    """Plain scalars read as NeMo-RL's loader, OmegaConf's, reads them.

    OmegaConf (``get_yaml_loader``, 2.3 and 2.4) adds this float rule to PyYAML's and drops
    timestamps: ``1e-4`` and ``1e4`` are numbers (YAML 1.1, PyYAML alone: strings) and
    ``2024-01-01`` stays a string, so a recipe means here what it means in the run.
    """


_RecipeLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:
         [-+]?[0-9]+(?:_[0-9]+)*\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?[0-9]+(?:_[0-9]+)*(?:[eE][-+]?[0-9]+)
        |\.[0-9]+(?:_[0-9]+)*(?:[eE][-+][0-9]+)?
        |[-+]?[0-9]+(?:_[0-9]+)*(?::[0-5]?[0-9])+\.[0-9_]*
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)
_RecipeLoader.yaml_implicit_resolvers = {
    first: [(tag, rule) for tag, rule in rules if tag != "tag:yaml.org,2002:timestamp"]
    for first, rules in _RecipeLoader.yaml_implicit_resolvers.items()
}


def read_yaml(path: str) -> dict:
    """The mapping in ``path``, read as OmegaConf reads it (``{}`` for an empty file); another top level raises."""
    with open(path) as fh:
        data = yaml.load(fh, Loader=_RecipeLoader)  # noqa: S506 - a SafeLoader subclass
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise yaml.YAMLError(f"top level is a {type(data).__name__}, expected a mapping")
    return data


def _merge(base: Any, override: Any) -> Any:
    """``base`` with ``override`` merged in, mapping by mapping; any other value replaces."""
    if isinstance(base, dict) and isinstance(override, dict):
        out = dict(base)
        for k, v in override.items():
            out[k] = _merge(base[k], v) if k in base else v
        return out
    return override


def load_with_defaults(path: str, missing: list[str]) -> dict:
    """Resolve ``defaults`` relative to each file, as NeMo-RL does, where the files exist.

    The ``defaults`` entries whose files do not exist are appended to ``missing``.
    """
    raw = read_yaml(path)
    parents = zip(defaults_of(raw), parent_paths(path, raw))
    raw.pop("defaults", None)
    merged: dict = {}
    for parent, parent_path in parents:
        if not os.path.isfile(parent_path):
            missing.append(parent)
            continue
        merged = _merge(merged, load_with_defaults(parent_path, missing))
    return _merge(merged, raw)


def parent_with_loss_mapping(path: str) -> Optional[str]:
    """The parent (from ``defaults``) that defines a ``loss_fn`` mapping, if any."""
    raw = read_yaml(path)
    for parent, parent_path in zip(defaults_of(raw), parent_paths(path, raw)):
        try:
            inherited = load_with_defaults(parent_path, []) if os.path.isfile(parent_path) else {}
        except (yaml.YAMLError, OSError, UnicodeDecodeError):
            continue  # reported by the loader that follows
        if isinstance(inherited.get("loss_fn"), dict):
            return parent
    return None


def defaults_found(path: str) -> bool:
    """Whether every file ``path``'s ``defaults`` name exists (``True`` where ``path`` does not read)."""
    try:
        raw = read_yaml(path)
    except (yaml.YAMLError, OSError, UnicodeDecodeError):
        return True
    return all(os.path.isfile(p) for p in parent_paths(path, raw))


# ----------------------------------------------------------------------------- indentation errors
def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def _content(line: str) -> bool:
    stripped = line.strip()
    return bool(stripped) and not stripped.startswith("#")


def _is_entry(line: str) -> bool:
    stripped = line.strip()
    return stripped == "-" or stripped.startswith("- ")


def _has_value(line: str) -> bool:
    """``key: value`` (a value after the colon on the line itself), not ``key:`` opening a block."""
    stripped = line.strip()
    if _is_entry(stripped):
        stripped = stripped[1:].strip()
    key, sep, value = stripped.partition(": ")
    return bool(sep) and bool(value.split(" #")[0].strip())


def _spaces(n: int) -> str:
    return f"{n} space{'' if n == 1 else 's'}"


def indentation_problem(text: str, line_no: int) -> Optional[str]:
    """What is mis-indented under what, for PyYAML's indentation errors at 0-based ``line_no`` (or ``None``).

    PyYAML reports the token it stopped at ("found '?'", "found '<block mapping start>'",
    "mapping values are not allowed here"), which is not in the file; this says which line is
    indented how, under which key, and where its siblings are.
    """
    lines = text.splitlines()
    if not 0 <= line_no < len(lines) or not _content(lines[line_no]):
        return None
    line = lines[line_no]
    n = _indent(line)
    above = [(i, lines[i]) for i in range(line_no - 1, -1, -1) if _content(lines[i])]
    if not above:
        return None
    where = f"line {line_no + 1}: `{line.strip()}`"
    prev_i, prev = above[0]
    if n > _indent(prev) and _has_value(prev):
        # the column of prev's key: after the "- " of a list entry
        column = _indent(prev) + (len(prev.strip()) - len(prev.strip()[1:].lstrip()) if _is_entry(prev) else 0)
        return (
            f"{where} is indented by {_spaces(n)}, more than `{prev.strip()}` (line {prev_i + 1}), which already has "
            f"a value and so cannot hold it: indent it by {_spaces(column)} to make it a sibling of that key"
        )
    parent = next(((i, t) for i, t in above if _indent(t) < n), None)
    under = f"`{parent[1].strip()}` (line {parent[0] + 1})" if parent is not None else "the top level"
    start = parent[0] if parent is not None else -1
    siblings = [(i, t) for i, t in above if i > start and (parent is None or _indent(t) > _indent(parent[1]))]
    if not siblings:
        return None
    level = min(_indent(t) for _, t in siblings)
    first_i, first = min(((i, t) for i, t in siblings if _indent(t) == level), key=lambda x: x[0])
    if n != level:
        ends = f", or by {_spaces(_indent(parent[1]))} to end it" if parent is not None else ""
        return (
            f"{where} is indented by {_spaces(n)} under {under}, whose entries are at {_spaces(level)} "
            f"(`{first.strip()}`, line {first_i + 1}): indent it by {_spaces(level)} to put it there{ends}"
        )
    if _is_entry(line) != _is_entry(first):
        kind, others = ("a list entry", "keys") if _is_entry(line) else ("a key", "list entries")
        return (
            f"{where} is {kind} at {_spaces(n)} under {under}, whose entries at that indentation are {others} "
            f"(`{first.strip()}`, line {first_i + 1}): a block holds keys or list entries, not both; indent it "
            "under one of them, or make it the same kind"
        )
    return None
