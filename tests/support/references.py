"""Which tensors an object keeps alive: for tests that pin what outlives a loss call."""

from __future__ import annotations

import gc
import types
from typing import Any

import torch

_LEAVES = (str, bytes, int, float, complex, bool, type(None), types.ModuleType, type, torch.dtype, torch.device)


def tensors_reachable(root: Any) -> list[torch.Tensor]:
    """Every tensor reachable from ``root`` through the references Python's GC knows of.

    Containers, dataclasses, closures (cells), defaults and bound methods are followed; a
    function's globals, modules and classes are not (they lead to the whole program).
    """
    seen: set[int] = set()
    found: list[torch.Tensor] = []
    todo = [root]
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, _LEAVES):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found.append(obj)
        elif isinstance(obj, types.FunctionType):
            cells = [c.cell_contents for c in obj.__closure__ or () if _filled(c)]
            todo += cells + list(obj.__defaults__ or ()) + list((obj.__kwdefaults__ or {}).values())
        else:
            todo += gc.get_referents(obj)
    return found


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # an empty cell
        return False
    return True
