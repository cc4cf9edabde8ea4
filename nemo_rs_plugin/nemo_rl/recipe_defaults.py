"""How a NeMo-RL recipe names its parents: ``defaults``, resolved against the recipe's folder.

Read by the run (the ``loss_fn`` shorthand must not replace an inherited mapping) and by the
tools (``nemo-rs check`` loads the chain, ``nemo-rs recipes`` rewrites it). Also the two small
rules the run's refusals and the tools share about a recipe and a checkout: a dotted key's value,
and whether a path is a NeMo-RL checkout. Standard library only (the doctor imports it).
"""

import os
from typing import Any, Optional

__all__ = ["defaults_of", "dotted_value", "nemo_rl_checkout_problem", "parent_paths"]


def dotted_value(cfg: Any, dotted: str, default: Any = None) -> Any:
    """``cfg["a"]["b"]`` for ``"a.b"``, or ``default`` where a key on the way is missing."""
    node: Any = cfg
    for key in dotted.split("."):
        if not isinstance(node, dict) or key not in node:
            return default
        node = node[key]
    return node


def nemo_rl_checkout_problem(root: str) -> Optional[str]:
    """Why the folder ``root`` is not a NeMo-RL checkout (``--nemo-rl PATH``), or ``None``."""
    if os.path.isfile(os.path.join(root, "nemo_rl", "__init__.py")):
        return None
    if os.path.isfile(root):
        return "it is a file (an archive?): extract it and name the folder"
    return "no such directory" if not os.path.isdir(root) else "no nemo_rl/__init__.py in it"


def defaults_of(raw: object) -> list[str]:
    """The parents a recipe names in ``defaults`` (a string or a list), in order."""
    defaults = raw.get("defaults") if isinstance(raw, dict) else None
    if not defaults:
        return []
    return [str(d) for d in ([defaults] if isinstance(defaults, str) else defaults)]


def parent_paths(recipe_path: str, raw: object) -> list[str]:
    """Paths of the recipe's ``defaults``, resolved against the recipe's folder as NeMo-RL does."""
    base = os.path.dirname(os.path.abspath(str(recipe_path)))
    return [p if os.path.isabs(p) else os.path.join(base, p) for p in defaults_of(raw)]
