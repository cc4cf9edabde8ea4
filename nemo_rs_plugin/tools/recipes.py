"""The shipped recipes and how they are placed next to a NeMo-RL checkout.

The recipes follow NeMo-RL's layout: they inherit ``defaults: ../../<base>.yaml``, which
resolves when the file sits in ``<NeMo-RL>/examples/configs/recipes/llm/`` (NeMo-RL resolves
``defaults`` relative to the recipe file). :func:`export_recipes` copies them anywhere,
rewriting those paths to absolute paths in a given checkout.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Optional

__all__ = [
    "recipe_dir",
    "list_recipes",
    "export_recipe",
    "export_recipes",
    "NEMO_RL_RECIPE_SUBDIR",
]

NEMO_RL_RECIPE_SUBDIR = os.path.join("examples", "configs", "recipes", "llm")
_DEFAULTS = re.compile(r"^(defaults:\s*)(['\"]?)([^'\"\n#]+?)\2(\s*(#.*)?)$", re.MULTILINE)


def recipe_dir() -> Path:
    """Where the YAMLs are: inside the installed package, or ``recipes/`` of a source tree."""
    package = Path(__file__).resolve().parent.parent  # nemo_rs_plugin/
    for candidate in (package / "recipes", package.parent / "recipes"):
        if any(candidate.glob("*.yaml")):
            return candidate
    raise FileNotFoundError("nemo-rs-plugin's recipes are not installed (no recipes/*.yaml found)")


def list_recipes() -> list[Path]:
    """The shipped recipe files, sorted by name."""
    return sorted(recipe_dir().glob("*.yaml"))


def export_recipe(src: Path, out_dir: Path, nemo_rl_root: Optional[str] = None) -> Path:
    """Copy ``src`` into ``out_dir``; with ``nemo_rl_root``, make ``defaults`` absolute there."""
    text = Path(src).read_text()
    if nemo_rl_root:
        base = Path(nemo_rl_root).resolve() / NEMO_RL_RECIPE_SUBDIR

        def absolute(m: re.Match) -> str:
            target = m.group(3).strip()
            if not os.path.isabs(target):
                target = str((base / target).resolve())
            return f"{m.group(1)}{target}{m.group(4) or ''}"

        text = _DEFAULTS.sub(absolute, text)
    out = Path(out_dir) / Path(src).name
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    return out


def export_recipes(out_dir: str, nemo_rl_root: Optional[str] = None) -> list[Path]:
    """Export every shipped recipe; see :func:`export_recipe`."""
    return [export_recipe(p, Path(out_dir), nemo_rl_root) for p in list_recipes()]
