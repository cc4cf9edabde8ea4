"""How a NeMo-RL recipe names its parents: ``defaults``, resolved against the recipe's folder.

Read by the run (the ``loss_fn`` shorthand must not replace an inherited mapping) and by the
tools (``nemo-rs check`` loads the chain, ``nemo-rs recipes`` rewrites it).
"""

import os

__all__ = ["defaults_of", "parent_paths"]


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
