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
    "recipe_description",
    "export_recipe",
    "export_recipes",
    "export_problems",
    "exported_text",
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


def recipe_description(path: Path) -> str:
    """A recipe's one-line description: its own first line, a YAML comment (``# ...``); "" without one."""
    try:
        with open(path, encoding="utf-8") as fh:
            first = fh.readline().strip()
    except (OSError, UnicodeDecodeError):
        return ""
    return first.lstrip("#").strip() if first.startswith("#") else ""


def exported_text(src: Path, nemo_rl_root: Optional[str] = None) -> str:
    """The text :func:`export_recipe` writes for ``src``."""
    text = Path(src).read_text()
    if nemo_rl_root:
        base = Path(nemo_rl_root).resolve() / NEMO_RL_RECIPE_SUBDIR

        def absolute(m: re.Match) -> str:
            target = m.group(3).strip()
            if not os.path.isabs(target):
                target = str((base / target).resolve())
            return f"{m.group(1)}{target}{m.group(4) or ''}"

        text = _DEFAULTS.sub(absolute, text)
    return text


def export_recipe(src: Path, out_dir: Path, nemo_rl_root: Optional[str] = None) -> Path:
    """Copy ``src`` into ``out_dir``; with ``nemo_rl_root``, make ``defaults`` absolute there."""
    text = exported_text(src, nemo_rl_root)
    out = Path(out_dir) / Path(src).name
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    return out


def export_recipes(out_dir: str, nemo_rl_root: Optional[str] = None) -> list[Path]:
    """Export every shipped recipe; see :func:`export_recipe`."""
    return [export_recipe(p, Path(out_dir), nemo_rl_root) for p in list_recipes()]


def export_problems(out_dir: str, nemo_rl_root: Optional[str] = None, force: bool = False) -> list[str]:
    """Why ``nemo-rs recipes --out out_dir [--nemo-rl nemo_rl_root]`` must not write, one line each.

    Checked before anything is written. An exported recipe that differs from what would be
    written (the user edited it) is a problem unless ``force``; an identical one is not.
    """
    problems = []
    if nemo_rl_root:
        root = os.path.expanduser(nemo_rl_root)
        if not os.path.isdir(root):
            what = "no such directory"
        elif not os.path.isdir(os.path.join(root, "examples", "configs")):
            what = "no examples/configs in it"
        else:
            what = None
        if what:
            problems.append(
                f"--nemo-rl: got {nemo_rl_root}; not a NeMo-RL checkout ({what}); name the root of a "
                "NeMo-RL clone (the folder holding examples/configs)"
            )
    out = Path(out_dir)
    # The first existing folder on the way to out_dir must be a folder we can write into.
    existing = next((p for p in (out, *out.absolute().parents) if os.path.lexists(p)), None)
    if existing is not None and not existing.is_dir():
        what = "it is a file" if existing == out else f"{existing} is a file"
        problems.append(f"--out: got {out_dir}; {what}: name a directory (it is created if missing)")
        return problems
    if existing is not None and not os.access(existing, os.W_OK):
        problems.append(f"--out: got {out_dir}; {existing} is not writable: name a directory you can write")
        return problems
    if not out.is_dir():
        return problems
    for src in list_recipes():
        target = out / src.name
        if target.is_dir():
            problems.append(f"--out: {target}: is a directory, where the recipe {src.name} would be written")
        elif not force and target.exists() and _read(target) != exported_text(src, nemo_rl_root):
            problems.append(
                f"--out: {target}: differs from the shipped recipe (edited?); not overwritten: "
                "move it away, or pass --force to overwrite it"
            )
    return problems


def _read(path: Path) -> Optional[str]:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError):
        return None  # unreadable: treated as differing, so it is not overwritten silently
