"""How a recipe's ``loss_fn.name`` reaches the plugin inside NeMo-RL, with NeMo-RL's code unchanged.

The start-up hook (``_nemo_rs_plugin_hook``) calls :func:`activate` when NeMo-RL imports one
of the modules it watches:

* the GRPO, PPO and single-controller setup modules: :func:`install_into` puts a
  :class:`ClippedPGLossSelector` in place of the name ``ClippedPGLossFn``, which builds the
  class named by ``loss_fn.name`` (NeMo-RL's own without a name), and the package is exposed
  to Ray workers (:mod:`nemo_rs_plugin.nemo_rl.workers`);
* ``nemo_rl.algorithms.loss``: :func:`guard_host_loss` makes NeMo-RL's own class refuse a
  config that names a plugin loss, so a construction site the selector misses fails instead of
  training with NeMo-RL's loss; and :func:`nemo_rs_plugin.nemo_rl.seam.install` puts the
  plugin's versions of NeMo-RL's loss wrappers (``SequencePackingLossWrapper``,
  ``SequencePackingFusionLossWrapper``, ``wrap_loss_fn_with_input_preparation``) in place of
  NeMo-RL's there, before NeMo-RL's worker code imports them: the one seam through which a
  plugin loss receives what those wrappers hold and its arguments do not carry (the keywords
  of their ``prepare_fn``, the per-sequence wrapper's microbatch). The loss installs the seam
  again where it is built or unpickled (Ray workers may lack the start-up hook); a NeMo-RL
  without those names gets a warning here and the loss refuses to be built;
* ``nemo_rl.utils.config``: :func:`patch_config_loader` adds the ``loss_fn: <name>`` shorthand
  and refuses a plugin recipe early when a selector could not be installed.

NeMo-RL itself is imported only inside functions: importing this module is what the hook
does while NeMo-RL's modules are still loading.
"""

from __future__ import annotations

import warnings
from typing import Any, Mapping, Optional

import yaml

import _nemo_rs_plugin_hook as hook
from nemo_rs_plugin.core.settings.config import ConfigError, as_plain_dict, own_loss_problems
from nemo_rs_plugin.nemo_rl import seam, workers
from nemo_rs_plugin.nemo_rl.host import SUPPORTED_NEMO_RL, host_accepts_fused_flag, host_version, missing_field_problems
from nemo_rs_plugin.nemo_rl.recipe_defaults import parent_paths
from nemo_rs_plugin.nemo_rl.registry import get_loss_class

__all__ = [
    "ClippedPGLossSelector",
    "PluginNotActiveError",
    "activate",
    "check_host_loss_config",
    "guard_host_loss",
    "install_failure",
    "install_into",
    "names_plugin_loss",
    "patch_config_loader",
    "selector_problems",
]


class PluginNotActiveError(RuntimeError):
    """A recipe names a plugin loss where the plugin cannot build it.

    Raised instead of letting NeMo-RL train with its own loss: the selector is missing from
    a NeMo-RL setup module, or NeMo-RL's own class is being built from such a config.
    """


def activate(fullname: str, module: Any) -> None:
    """What the start-up hook runs when NeMo-RL's module ``fullname`` has just been executed."""
    if fullname == hook.CONFIG_MODULE:
        patch_config_loader(module)
    elif fullname == hook.HOST_LOSS_MODULE:
        guard_host_loss(module)
        problems = seam.install(module)
        if problems:
            warnings.warn(
                "nemo-rs-plugin: " + "; ".join(problems) + f" (NeMo-RL {host_version()}; supported: "
                f"{SUPPORTED_NEMO_RL}). A plugin loss will refuse to be built.",
                RuntimeWarning,
                stacklevel=3,
            )
    else:
        if not install_into(module):
            warnings.warn(install_failure(module), RuntimeWarning, stacklevel=3)
        workers.expose_to_workers()


# ----------------------------------------------------------------------------- selection
def _keys_of(cfg: Any) -> list[str]:
    if isinstance(cfg, Mapping):
        return [str(k) for k in cfg]
    extra = getattr(cfg, "model_extra", None) or {}
    return list(extra)


def check_host_loss_config(cfg: Any, name: Optional[str] = None) -> None:
    """Refuse what NeMo-RL's own loss would ignore.

    Plugin fields (or near-misspellings), and NeMo-RL fields this NeMo-RL does not have
    (``use_cispo: true`` on v0.6.0 trains plain PPO). The rules are
    :func:`~nemo_rs_plugin.core.settings.config.own_loss_problems` and
    :func:`~nemo_rs_plugin.nemo_rl.host.missing_field_problems`, shared with ``nemo-rs check``.
    """
    problems = own_loss_problems(_keys_of(cfg), name)
    try:
        raw = dict(as_plain_dict(cfg))
    except (TypeError, ValueError):  # not a mapping: own_loss_problems has said what it could
        raw = {}
    problems += missing_field_problems(raw)
    if problems:
        raise ConfigError(problems)


class ClippedPGLossSelector:
    """Stands in for ``ClippedPGLossFn`` in NeMo-RL's setup modules.

    Calling it builds the loss named by ``cfg.name`` (via the registry), or NeMo-RL's own
    class when no name is set. ``isinstance``/``issubclass`` checks and attribute access
    behave as with NeMo-RL's class.
    """

    def __init__(self, original: type):
        self.original = original

    def __call__(self, cfg: Any, *args: Any, **kwargs: Any) -> Any:
        name = hook.loss_name_of(cfg)
        target = self.original if name is None else get_loss_class(name)
        if target is self.original:
            # NeMo-RL's own loss ignores the plugin's fields: refuse them, named or not.
            check_host_loss_config(cfg, name)
            if not host_accepts_fused_flag():
                kwargs.pop("use_fused_linear_logprobs", None)
        return target(cfg, *args, **kwargs)

    def __instancecheck__(self, obj: Any) -> bool:
        return isinstance(obj, self.original)

    def __subclasscheck__(self, cls: type) -> bool:
        return issubclass(cls, self.original)

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.original, attr)

    def __repr__(self) -> str:
        return f"<nemo-rs-plugin selector for {self.original.__module__}.ClippedPGLossFn>"


def install_into(module: Any) -> bool:
    """Put a selector in place of ``module.ClippedPGLossFn``.

    Returns whether the selector is in place afterwards (installed now or before); ``False``
    means the module has no ``ClippedPGLossFn`` to replace: that NeMo-RL builds its loss some
    other way, and :func:`install_failure` says so.
    """
    current = getattr(module, "ClippedPGLossFn", None)
    if isinstance(current, ClippedPGLossSelector):
        return True
    if not isinstance(current, type):
        return False
    module.ClippedPGLossFn = ClippedPGLossSelector(current)
    return True


def install_failure(module: Any) -> str:
    """The message for a setup module :func:`install_into` could not patch."""
    return (
        f"nemo-rs-plugin: {module.__name__} has no class ClippedPGLossFn to replace, so the "
        f"plugin cannot select the loss there: NeMo-RL {host_version()} builds its loss some "
        f"other way (supported: {SUPPORTED_NEMO_RL}). Recipes that name a plugin loss "
        "(loss_fn.name: rs_clipped_pg) will be refused rather than trained with NeMo-RL's own "
        "loss; check with `nemo-rs doctor`."
    )


def selector_problems() -> list[str]:
    """One message per imported NeMo-RL setup module whose ``ClippedPGLossFn`` is not a selector."""
    import sys

    return [
        install_failure(sys.modules[name])
        for name in hook.LOSS_MODULES
        if name in sys.modules
        and not isinstance(getattr(sys.modules[name], "ClippedPGLossFn", None), ClippedPGLossSelector)
    ]


def names_plugin_loss(cfg: Any) -> Optional[str]:
    """``loss_fn.name`` when it asks for something other than NeMo-RL's own loss, else ``None``."""
    name = hook.loss_name_of(cfg)
    if name is None:
        return None
    try:
        from nemo_rl.algorithms.loss import ClippedPGLossFn

        return None if get_loss_class(name) is ClippedPGLossFn else name
    except (ImportError, ValueError):
        return name  # unknown or broken: certainly not NeMo-RL's own loss


# ----------------------------------------------------------------------------- the guard
def _refuse_plugin_config(cfg: Any) -> None:
    name = names_plugin_loss(cfg)
    if name is not None:
        raise PluginNotActiveError(
            f"loss_fn.name is {name!r}, but NeMo-RL's own ClippedPGLossFn is being built "
            "from this config, not through nemo-rs-plugin's selector: this NeMo-RL "
            f"({host_version()}) constructs its loss somewhere the plugin does not patch, "
            f"and would train with its own loss. Supported: {SUPPORTED_NEMO_RL}. "
            "Run `nemo-rs doctor` for details."
        )
    check_host_loss_config(cfg, hook.loss_name_of(cfg))


def guard_host_loss(module: Any) -> bool:
    """Make NeMo-RL's own ``ClippedPGLossFn`` (in ``module``) refuse configs naming another loss.

    The selector covers the construction sites it is installed in; this covers every other
    one (``loss_lib.ClippedPGLossFn(cfg)``, a new setup module): a config that names a plugin
    loss must never be built by NeMo-RL's class. Subclasses (``RSClippedPGLossFn`` calls
    ``super().__init__`` with NeMo-RL's own fields) are not affected. Returns whether the guard
    was installed now.
    """
    return hook.guard_init(getattr(module, "ClippedPGLossFn", None), _refuse_plugin_config)


# ----------------------------------------------------------------------------- shorthand
SHORTHAND_HELP = (
    "loss_fn: write the mapping form,\n"
    "  loss_fn:\n"
    "    name: rs_clipped_pg\n"
    "    # ...plugin fields (is_correction_level, rejection_sampling)\n"
    "the shorthand `loss_fn: rs_clipped_pg` cannot be merged with a loss_fn mapping "
    "inherited through `defaults`."
)


def _after_load(config_path: Any, config: Any, load: Any) -> Any:
    loss = config.get("loss_fn") if hasattr(config, "get") else None
    if isinstance(loss, str):
        # OmegaConf lets a string replace an inherited mapping silently, which would
        # drop the parent's loss settings: refuse, and show the mapping form.
        if _inherits_loss_mapping(config_path, load):
            raise ConfigError([SHORTHAND_HELP])
        config["loss_fn"] = {"name": loss}
        loss = config["loss_fn"]
    name = names_plugin_loss(loss) if loss is not None else None
    if name is not None:
        problems = selector_problems()
        if problems:
            raise PluginNotActiveError(
                f"{config_path}: loss_fn.name is {name!r}, but NeMo-RL would train with its "
                "own loss:\n  " + "\n  ".join(problems)
            )
    return config


def patch_config_loader(module: Any) -> bool:
    """Wrap ``module.load_config``: the ``loss_fn: <name>`` shorthand, and an early refusal.

    ``loss_fn: <name>`` becomes ``loss_fn: {name: <name>}``. A recipe naming a plugin loss is
    refused here, before any worker starts, when the selector is missing from an imported
    NeMo-RL setup module (:func:`selector_problems`).
    """
    return hook.wrap_load_config(module, _after_load)


def _inherits_loss_mapping(config_path: Any, load: Any) -> bool:
    """Whether any recipe named in ``defaults`` of ``config_path`` defines a loss_fn mapping."""
    with open(config_path) as fh:
        raw = yaml.safe_load(fh) or {}
    return any(hasattr(load(path).get("loss_fn"), "keys") for path in parent_paths(config_path, raw))
