"""Loss registry: the names a recipe writes under ``loss_fn.name``, mapped to loss classes.

Entries are stored as import paths (``"package.module:Class"``) and imported on lookup, so
the registry itself is cheap to import and safe to pickle. Built in:

* ``rs_clipped_pg``: :class:`nemo_rs_plugin.nemo_rl.loss_fn.RSClippedPGLossFn`
* ``clipped_pg``: NeMo-RL's own ``ClippedPGLossFn``

Third parties add names with :func:`register_loss` or through the entry-point group
``nemo_rs_plugin.losses`` (``name = "package.module:Class"``), discovered on the first
lookup. A name registered twice with a different target is an error.
"""

from __future__ import annotations

import importlib
from importlib import metadata
from typing import Any, Union

from nemo_rs_plugin.core.settings.presets import NEMO_RL_LOSS_NAME, PLUGIN_LOSS_NAME  # standard library only

__all__ = [
    "ENTRY_POINT_GROUP",
    "LossRegistryError",
    "register_loss",
    "get_loss_class",
    "list_registered",
]

ENTRY_POINT_GROUP = "nemo_rs_plugin.losses"

_REGISTRY: dict[str, Union[str, type]] = {
    PLUGIN_LOSS_NAME: "nemo_rs_plugin.nemo_rl.loss_fn:RSClippedPGLossFn",
    NEMO_RL_LOSS_NAME: "nemo_rl.algorithms.loss:ClippedPGLossFn",
}
_entry_points_loaded = False


class LossRegistryError(ValueError):
    """Unknown or conflicting loss name."""


def _fqn(target: Union[str, type]) -> str:
    if isinstance(target, str):
        return target
    return f"{target.__module__}:{target.__qualname__}"


def register_loss(name: str, target: Union[str, type, None] = None) -> Any:
    """Register ``target`` (a class or ``"module:Class"``) under ``name``.

    Usable as a decorator (``@register_loss("my_loss")``) or a call. Registering the same
    target again is a no-op; a different target under a taken name raises.
    """

    def decorator(obj: Union[str, type]) -> Union[str, type]:
        key = str(getattr(name, "value", name))
        existing = _REGISTRY.get(key)
        if existing is not None and _fqn(existing) != _fqn(obj):
            raise LossRegistryError(
                f"loss name {key!r} is already registered to {_fqn(existing)}; cannot register {_fqn(obj)}"
            )
        _REGISTRY[key] = obj
        return obj

    if target is not None:
        return decorator(target)
    return decorator


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        register_loss(ep.name, ep.value)


def list_registered() -> list[str]:
    """Every known loss name (built-ins, registrations and entry points), sorted."""
    _load_entry_points()
    return sorted(_REGISTRY)


def get_loss_class(name: str) -> Any:
    """Import and return the class registered under ``name``.

    Raises:
        LossRegistryError: unknown name (the message lists the known names).
        ImportError: the target cannot be imported; the message names the entry.
    """
    _load_entry_points()
    if name not in _REGISTRY:
        raise LossRegistryError(f"loss_fn.name: got {name!r}; known losses: {', '.join(sorted(_REGISTRY))}")
    target = _REGISTRY[name]
    if not isinstance(target, str):
        return target
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ImportError(f"loss {name!r} -> {target}: cannot import {module_name}: {exc}") from exc
    return getattr(module, attr)
