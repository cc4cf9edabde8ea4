"""Render ``docs/configuration-reference.md`` from the config models, so it cannot drift.

Regenerate with ``nemo-rs reference > docs/configuration-reference.md``; a test fails when
the file differs from what this module renders.
"""

from __future__ import annotations

import typing
from typing import Any

from pydantic import BaseModel

from nemo_rs_plugin.core.config import PLUGIN_FIELDS, RejectionFilter, RSClippedPGLossConfig

__all__ = ["render_reference"]


def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Literal:
        return " \\| ".join(repr(a).replace("'", "`") for a in args)
    if origin is typing.Union:
        parts = [a for a in args if a is not type(None)]
        inner = " \\| ".join(_type_name(a) for a in parts)
        return f"{inner} \\| null" if len(parts) < len(args) else inner
    if origin in (tuple, list):
        return f"list of {_type_name(args[0])}"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return f"[{annotation.__name__}](#{annotation.__name__.lower()})"
    return getattr(annotation, "__name__", str(annotation))


def _default(field: Any) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
    else:
        value = field.default
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if value == ():
        return "[]"
    if hasattr(value, "__origin__"):
        return "required"
    return f"`{value}`" if not isinstance(value, type(...)) else "required"


def _rows(model: type[BaseModel], only: tuple[str, ...] = ()) -> list[str]:
    rows = ["| field | type | default | meaning |", "| --- | --- | --- | --- |"]
    for name, field in model.model_fields.items():
        if only and name not in only:
            continue
        desc = " ".join((field.description or "").split()).replace("|", "\\|")
        default = "required" if field.is_required() else _default(field)
        rows.append(f"| `{name}` | {_type_name(field.annotation)} | {default} | {desc} |")
    return rows


def render_reference() -> str:
    """The whole reference page as Markdown."""
    upstream = tuple(n for n in RSClippedPGLossConfig.model_fields if n not in PLUGIN_FIELDS)
    lines = [
        "# Configuration reference",
        "",
        "Generated from `nemo_rs_plugin/core/config.py` by `nemo-rs reference`; do not edit by hand.",
        "Everything goes under `loss_fn:` in a NeMo-RL recipe, with `name: rs_clipped_pg`.",
        "Invalid values and combinations are rejected when the loss is built, one line per",
        "problem naming the field, the value and what is allowed.",
        "",
        "## Plugin fields",
        "",
        *_rows(RSClippedPGLossConfig, PLUGIN_FIELDS),
        "",
        "## RejectionFilter",
        "",
        "One entry of `rejection_sampling`.",
        "",
        *_rows(RejectionFilter),
        "",
        "Allowed `agg` per `metric`: `ratio`: mean, sum, max, min, any; `kl_k1`, `kl_k2`,",
        "`kl_k3`, `mult_prob_error`, `binary_kl`, `total_variation`: mean, sum, max. Ratio",
        "bounds are >= 0. Labels (`name`, or the default) must be unique. Formulas:",
        "[guide](guide.md#rejection-sampling).",
        "",
        "## NeMo-RL's fields",
        "",
        "Same names, defaults and rules as NeMo-RL's `ClippedPGLossConfig`.",
        "",
        *_rows(RSClippedPGLossConfig, upstream),
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    print(render_reference(), end="")
