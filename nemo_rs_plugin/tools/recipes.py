"""The shipped recipes and how they are placed next to a NeMo-RL checkout.

The recipes follow NeMo-RL's layout: they inherit ``defaults: ../../<base>.yaml``, which
resolves when the file sits in ``<NeMo-RL>/examples/configs/recipes/llm/`` (NeMo-RL resolves
``defaults`` relative to the recipe file). :func:`export_recipes` copies them anywhere,
rewriting those paths to absolute paths in a given checkout.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path
from typing import Optional, Union

from nemo_rs_plugin.tools.report import EXIT_INVALID

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


def exported_text(src: Union[str, Path], nemo_rl_root: Optional[str] = None) -> str:
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


def export_recipe(src: Union[str, Path], out_dir: Union[str, Path], nemo_rl_root: Optional[str] = None) -> Path:
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


# ---------------------------------------------------------------------------- the command
HELP = "list the shipped recipes, or export them"


def add_arguments(r: argparse.ArgumentParser) -> None:
    """``nemo-rs recipes``' options."""
    r.add_argument("--out", metavar="DIR", help="copy the recipes into DIR")
    r.add_argument("--nemo-rl", metavar="PATH", help="rewrite their defaults to this NeMo-RL checkout (with --out)")
    r.add_argument("--force", action="store_true", help="overwrite exported recipes that differ (e.g. edited) in DIR")


def _note_unresolved_defaults(paths: list, nemo_rl: Optional[str]) -> None:
    """Say so when the exported recipes' ``defaults`` do not resolve where they were written."""
    import yaml

    from nemo_rs_plugin.nemo_rl.recipe_defaults import parent_paths

    parents: set[str] = set()
    for path in paths:
        with open(path) as fh:
            parents.update(os.path.normpath(p) for p in parent_paths(str(path), yaml.safe_load(fh)))
    missing = sorted(p for p in parents if not os.path.isfile(p))
    if missing:
        hint = "" if nemo_rl else "; pass --nemo-rl PATH (your NeMo-RL checkout) to point them there"
        print(
            f"note: the exported recipes' defaults ({', '.join(missing)}) do not exist there{hint}, or export into "
            "<NeMo-RL>/examples/configs/recipes/llm",
            file=sys.stderr,
        )


def run(args: argparse.Namespace) -> int:
    """List the shipped recipes, or export them into ``--out``."""
    if args.out == "":
        print("error: --out: got an empty path; name a directory", file=sys.stderr)
        return EXIT_INVALID
    if args.force and not args.out:
        print("error: --force: without --out it has nothing to overwrite; add --out DIR", file=sys.stderr)
        return EXIT_INVALID
    if args.nemo_rl and not args.out:
        print(
            f"error: --nemo-rl: got {args.nemo_rl} without --out; it rewrites exported recipes: "
            "add --out DIR (or drop --nemo-rl to list the recipes)",
            file=sys.stderr,
        )
        return EXIT_INVALID
    if args.out:
        problems = export_problems(args.out, args.nemo_rl, args.force)
        for line in problems:
            print(f"error: {line}", file=sys.stderr)
        if problems:
            return EXIT_INVALID
        try:
            paths = export_recipes(args.out, args.nemo_rl)
        except OSError as exc:  # checked above; what remains is e.g. a full disk
            print(f"error: --out: {exc.filename or args.out}: {exc.strerror or exc}", file=sys.stderr)
            return EXIT_INVALID
        for path in paths:
            print(path)
        _note_unresolved_defaults(paths, args.nemo_rl)
        return 0
    for path in list_recipes():  # the path, then the recipe's own first line (a shell comment)
        description = recipe_description(path)
        print(f"{path}  # {description}" if description else path)
    return 0
