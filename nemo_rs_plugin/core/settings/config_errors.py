"""How a loss section's values and pydantic's errors become one line per problem.

Values pydantic would coerce silently (a string for a number or a bool) are refused before it
sees them (:func:`without_coercions`); what it refuses is read into lines naming the field,
the value and what is allowed (:func:`format_validation_error`); and a field already reported
on its own is left out of the combination checks, so that one mistake is one line
(:func:`failed_locations`, :func:`without_locations`, :func:`blames`). The rules themselves are
:mod:`nemo_rs_plugin.core.settings.config_problems`.
"""

from __future__ import annotations

import difflib
import numbers
import re
import typing
from collections.abc import Mapping
from typing import Any, Optional

from pydantic import ValidationError

from nemo_rs_plugin.core.settings.rejection_filter import FILTER_KINDS, current_filter_fields, filter_field


def shown(value: Any) -> str:
    """A value as the recipe's YAML spells it: true/false, null, quoted strings, numbers as given."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    return repr(value)


_YAML_EXPONENT = re.compile(r"^[+-]?[0-9]+[eE][+-]?[0-9]+$")


def scalar_kind(annotation: Any) -> Optional[str]:
    """``"bool"`` or ``"number"`` for a (possibly Optional) bool or float field, else None."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)] or [annotation]
    if args == [bool]:
        return "bool"
    if args == [float]:
        return "number"
    return None


def coercion_problem(loc: str, value: Any, annotation: Any) -> Optional[str]:
    """What pydantic would coerce silently into a bool or float field: a string, or a bool for a number."""
    kind = scalar_kind(annotation)
    if kind is None or value is None:
        return None
    if isinstance(value, str):
        if kind == "bool":
            return f"{loc}: got {value!r} (a string); allowed: true or false, unquoted"
        hint = ", unquoted"
        if _YAML_EXPONENT.match(value.strip()):
            mantissa, exponent = re.split("[eE]", value.strip())
            # YAML 1.1 (PyYAML) needs a dot and a signed exponent to read a float: 1.0e+4, 1.0e-4
            signed = exponent if exponent[:1] in "+-" else f"+{exponent}"
            hint = f": YAML 1.1 reads {value.strip()} as a string, write {mantissa}.0e{signed}"
        return f"{loc}: got {value!r} (a string); allowed: a number{hint}"
    if kind == "number" and (isinstance(value, bool) or not isinstance(value, numbers.Real)):
        what = "a boolean" if isinstance(value, bool) else type(value).__name__
        return f"{loc}: got {shown(value)} ({what}); allowed: a number"
    return None


def without_coercions(raw: dict, fields: Mapping[str, Any]) -> tuple[dict, list[str], set[tuple]]:
    """``raw`` without the values pydantic would coerce into ``fields``, the problem lines, their locations.

    Top-level fields and the fields of each ``rejection_sampling`` entry.
    """
    problems: list[str] = []
    bad: set[tuple] = set()
    clean = {}
    for key, value in raw.items():
        problem = coercion_problem(key, value, fields[key].annotation) if key in fields else None
        if problem:
            problems.append(problem)
            bad.add((key,))
            continue
        if key == "rejection_sampling" and isinstance(value, (list, tuple)):
            entries = []
            for i, entry in enumerate(value):
                if isinstance(entry, Mapping):
                    kept = {}
                    for k, v in entry.items():
                        f = filter_field(str(k))
                        p = coercion_problem(f"{key}.{i}.{k}", v, f.annotation) if f is not None else None
                        if p:
                            problems.append(p)
                            bad.add((key, i, str(k)))
                        else:
                            kept[k] = v
                    entry = kept
                entries.append(entry)
            value = entries
        clean[key] = value
    return clean, problems, bad


def _errors(exc: ValidationError) -> list[Any]:
    """Pydantic's errors, each located as the recipe spells it.

    A ``rejection_sampling`` entry is parsed as the kind its ``level`` names, and pydantic puts
    that tag into the location (``rejection_sampling.0.token.upper``); the recipe has no such
    key, so it is dropped (``rejection_sampling.0.upper``).
    """
    errors = []
    for err in exc.errors():
        loc = tuple(err["loc"])
        if len(loc) >= 3 and loc[0] == "rejection_sampling" and loc[2] in FILTER_KINDS:
            err = {**err, "loc": loc[:2] + loc[3:]}
        errors.append(err)
    return errors


def failed_locations(exc: ValidationError) -> set[tuple]:
    """What failed below the top level.

    A field on its own (type, literal, required), or a whole filter (its own combinations), which
    keeps the section's combination checks from running.
    """
    return {tuple(err["loc"]) for err in _errors(exc) if err["loc"]}


def left_out(failed: set[tuple]) -> set[str]:
    """The top-level fields that were left out whole (a filter failing leaves out its section)."""
    return {str(loc[0]) for loc in failed if len(loc) <= 2}


def without_locations(raw: dict, locations: set[tuple]) -> dict:
    """``raw`` without the failed fields (a filter's own field, or a whole top-level field)."""
    raw = dict(raw)
    filters = list(raw.get("rejection_sampling") or []) if isinstance(raw.get("rejection_sampling"), list) else None
    for loc in locations:
        if len(loc) == 3 and loc[0] == "rejection_sampling" and filters is not None and isinstance(loc[1], int):
            entry = filters[loc[1]] if loc[1] < len(filters) else None
            if isinstance(entry, dict):
                filters[loc[1]] = {k: v for k, v in entry.items() if k != loc[2]}
                continue
        raw.pop(loc[0], None)
        if loc[0] == "rejection_sampling":
            filters = None
    if filters is not None and "rejection_sampling" in raw:
        raw["rejection_sampling"] = filters
    return raw


def blames(line: str, failed: set[tuple]) -> bool:
    """Whether a line is about a field that was already reported (and left out) on its own.

    A top-level field: any line naming it. A filter's field: its own line, or a line about that
    filter's combinations that names it (a bound left out is no missing bound).
    """
    for loc in failed:
        path = ".".join(str(x) for x in loc)
        if line.startswith(path + ":"):
            return True
        named = re.search(rf"\b{re.escape(str(loc[-1]))}\b", line)
        if len(loc) == 1 and named:
            return True
        if len(loc) == 3 and named and line.startswith(".".join(str(x) for x in loc[:-1]) + ":"):
            return True
    return False


def format_validation_error(exc: ValidationError) -> list[str]:
    lines = []
    for err in _errors(exc):
        loc = ".".join(str(x) for x in err["loc"])
        msg = err["msg"]
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, ") :]
        if err["type"] == "value_error" or not loc:
            # Our own validators already name the fields; keep their lines, prefixed with
            # the list position for rejection filters.
            for line in msg.split("\n"):
                lines.append(f"{loc}: {line}" if loc and not line.startswith(loc) else line)
        elif err["type"] == "extra_forbidden" and len(err["loc"]) == 3 and err["loc"][0] == "rejection_sampling":
            # as a top-level field's: the field named, a close one suggested (pydantic: "Extra inputs ...")
            key = str(err["loc"][-1])
            fields = current_filter_fields()
            guess = difflib.get_close_matches(key, sorted(fields), n=1, cutoff=0.6)
            hint = f"did you mean {guess[0]!r}? " if guess else ""
            lines.append(f"{loc}: unknown field of a rejection_sampling stage; {hint}(fields: {', '.join(fields)})")
        elif err["type"] in ("union_tag_not_found", "union_tag_invalid"):
            # the stage's kind is read from its level: name the field as pydantic's literal check would
            level = err.get("input", {}).get("level") if isinstance(err.get("input"), Mapping) else None
            got = f"got {shown(level)}" if err["type"] == "union_tag_invalid" else "missing"
            lines.append(f"{loc}.level: {got}; allowed: {' or '.join(FILTER_KINDS)} (which kind of stage this is)")
        elif err["loc"] == ("rejection_sampling",) and err["type"] in ("tuple_type", "list_type"):
            lines.append(
                f"{loc}: got {err.get('input')!r}; allowed: a list of stages (in YAML, start each stage "
                "with '- ', e.g. '- {level: sequence, agg: mean, lower: 0.99, upper: 1.01}')"
            )
        else:
            lines.append(f"{loc}: got {err.get('input')!r}; {msg}")
    return lines
