"""Start-up hook of nemo-rs-plugin (run from ``nemo_rs_plugin.pth``; standard library only).

It runs in every interpreter of the environment, so at start-up it imports nothing (``os``
and ``sys`` are loaded already), registers an import hook and returns. Only when NeMo-RL's
own modules are imported does anything happen:

* ``nemo_rl.algorithms.grpo``, ``nemo_rl.algorithms.ppo`` and
  ``nemo_rl.algorithms.single_controller_utils.setup``: the name ``ClippedPGLossFn`` there is
  replaced by a selector that builds the loss named by ``loss_fn.name`` (NeMo-RL's own loss
  when there is no name), and the plugin is put on ``PYTHONPATH`` (through a directory holding
  only a link to the package) so that Ray workers in NeMo-RL's per-worker virtual
  environments can unpickle the loss. A module without that name (a NeMo-RL that builds its
  loss another way) is reported at once, and recipes naming a plugin loss are then refused.
* ``nemo_rl.algorithms.loss``: NeMo-RL's own ``ClippedPGLossFn`` refuses a config that names a
  plugin loss, so a construction site the selector does not cover fails instead of training
  silently with NeMo-RL's loss; and NeMo-RL's loss wrappers there are replaced by the plugin's
  versions, which hand a plugin loss their context (``nemo_rs_plugin.nemo_rl.seam``).
* ``nemo_rl.utils.config``: ``load_config`` gets the ``loss_fn: <name>`` shorthand, and refuses
  a recipe naming a plugin loss when the selector could not be installed.

``NEMO_RS_PLUGIN_DISABLE=1`` (or ``true``, ``yes``, ``on``) switches the plugin off; unset,
empty, ``0``, ``false``, ``no`` and ``off`` leave it on, and any other value leaves it on with a
warning naming the value (:class:`PluginDisableWarning`, when NeMo-RL's modules load; ``nemo-rs
check`` and ``doctor`` say it too). Off, nothing of the package is imported and
NeMo-RL builds its own loss. The hook then only guards: a recipe that still names a plugin
loss (``loss_fn.name`` other than ``clipped_pg``) is refused when ``load_config`` reads it or
when NeMo-RL's ``ClippedPGLossFn`` is built from it, instead of training with a loss the recipe
did not ask for.

Layering: this module is the ground the NeMo-RL glue stands on. It holds the names of the
watched NeMo-RL modules, the loss-name reader and two generic wrappers (a guard on a class's
``__init__`` and a post-processor of ``load_config``), used both by the disabled guard here and
by :mod:`nemo_rs_plugin.nemo_rl.activation`, which imports them. It imports nothing of the
package: when NeMo-RL's modules load it resolves the activation by name (``ACTIVATION``, as an
entry point is resolved) and hands it the module.
"""

import os
import sys

DISABLE_ENV = "NEMO_RS_PLUGIN_DISABLE"
#: Values of ``NEMO_RS_PLUGIN_DISABLE`` (stripped, lower case) that switch the plugin off, and that leave it on.
OFF_VALUES = ("1", "true", "yes", "on")
ON_VALUES = ("", "0", "false", "no", "off")
#: NeMo-RL's setup modules that build the loss as ``ClippedPGLossFn(cfg, ...)``.
LOSS_MODULES = (
    "nemo_rl.algorithms.grpo",
    "nemo_rl.algorithms.ppo",
    "nemo_rl.algorithms.single_controller_utils.setup",
)
HOST_LOSS_MODULE = "nemo_rl.algorithms.loss"
CONFIG_MODULE = "nemo_rl.utils.config"
WATCHED = LOSS_MODULES + (HOST_LOSS_MODULE, CONFIG_MODULE)
#: ``loss_fn.name`` values that mean NeMo-RL's own loss (no name means it too).
HOST_LOSS_NAMES = ("clipped_pg",)
#: What runs when a watched module is imported with the plugin on: ``activate(fullname, module)``.
ACTIVATION = "nemo_rs_plugin.nemo_rl.activation"
#: Marks a wrapper this hook made, so that no function is wrapped twice.
WRAPPED = "_nemo_rs_guard"


class PluginDisabledError(RuntimeError):
    """A recipe names a plugin loss while ``NEMO_RS_PLUGIN_DISABLE`` switches the plugin off."""


class PluginDisableWarning(UserWarning):
    """``NEMO_RS_PLUGIN_DISABLE`` holds a value that is neither an on nor an off spelling: the plugin stays on."""


def disabled():
    """Whether ``NEMO_RS_PLUGIN_DISABLE`` switches the plugin off in this process."""
    return os.environ.get(DISABLE_ENV, "").strip().lower() in OFF_VALUES


def unrecognised_setting():
    """``NEMO_RS_PLUGIN_DISABLE``'s value where it is neither an off nor an on spelling (it stays on), else None."""
    value = os.environ.get(DISABLE_ENV)
    if value is None or value.strip().lower() in OFF_VALUES + ON_VALUES:
        return None
    return value


def state():
    """Which state the plugin is in here, and why: one line (``nemo-rs check`` and ``doctor`` print it)."""
    value = os.environ.get(DISABLE_ENV)
    if value is None:
        return f"nemo-rs-plugin is on ({DISABLE_ENV} is not set)"
    if disabled():
        return f"nemo-rs-plugin is off ({DISABLE_ENV}={value})"
    if unrecognised_setting() is None:
        return f"nemo-rs-plugin is on ({DISABLE_ENV}={value})"
    return (
        f"nemo-rs-plugin is on: {DISABLE_ENV}={value!r} is not a value it reads (off: "
        f"{', '.join(OFF_VALUES)}; on: unset, empty, {', '.join(v for v in ON_VALUES if v)}), so it does not switch "
        "the plugin off"
    )


_warned: list = []  # the values warned about in this process


def warn_unrecognised():
    """Warn once per process about an unrecognised ``NEMO_RS_PLUGIN_DISABLE`` (:class:`PluginDisableWarning`)."""
    value = unrecognised_setting()
    if value is None or value in _warned:
        return
    _warned.append(value)
    import warnings

    warnings.warn(state(), PluginDisableWarning, stacklevel=2)


def loss_name_of(loss):
    """``loss_fn.name`` of a loss section: a string (the shorthand), a mapping or an object; else None."""
    if loss is None or isinstance(loss, str):
        return loss
    getter = getattr(loss, "get", None)
    if getter is not None:
        try:
            return getter("name")
        except Exception:  # noqa: BLE001 - a mapping that refuses unknown keys
            return None
    return getattr(loss, "name", None)


# ----------------------------------------------------------------------------- generic wrappers
def guard_init(cls, check):
    """Make ``cls(cfg, ...)`` call ``check(cfg)`` first; subclasses are not affected.

    Returns whether the guard was installed now (``False``: no class, or guarded already).
    """
    init = getattr(cls, "__init__", None)
    if not isinstance(cls, type) or getattr(init, WRAPPED, False):
        return False

    def __init__(self, cfg, *args, **kwargs):
        if type(self) is cls:
            check(cfg)
        init(self, cfg, *args, **kwargs)

    _mark(__init__, init)
    cls.__init__ = __init__
    return True


def wrap_load_config(module, after_load):
    """Replace ``module.load_config`` by ``after_load(path, config, load)`` applied to its result.

    ``load`` is the original function (``after_load`` may load parent recipes with it).
    Returns whether the wrapper was installed now.
    """
    load = getattr(module, "load_config", None)
    if load is None or getattr(load, WRAPPED, False):
        return False

    def load_config(config_path, *args, **kwargs):
        return after_load(config_path, load(config_path, *args, **kwargs), load)

    _mark(load_config, load)
    module.load_config = load_config
    return True


def _mark(wrapper, wrapped):
    setattr(wrapper, WRAPPED, True)
    wrapper.__wrapped__ = wrapped
    wrapper.__doc__ = wrapped.__doc__


# ----------------------------------------------------------------------------- import hook
# Plain classes, not importlib.abc subclasses: importing importlib.abc at start-up pulls in
# ~60 modules (importlib.resources, pathlib, typing, tempfile, ...) in every interpreter.
class _PatchingLoader:
    """Delegates to the real loader, then patches the freshly executed module."""

    def __init__(self, loader, fullname):
        self._loader = loader
        self._fullname = fullname

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        _patch(self._fullname, module)

    def __getattr__(self, name):  # get_source, is_package, get_code, ...
        return getattr(self._loader, name)


class _Finder:
    """Finds nothing itself: wraps the loader of the NeMo-RL modules named in ``WATCHED``."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in WATCHED:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None:
            return None
        spec.loader = _PatchingLoader(spec.loader, fullname)
        return spec


def _patch(fullname, module):
    warn_unrecognised()
    if disabled():
        _guard_disabled(fullname, module)
        return
    # The heavy imports (torch, pydantic) happen here, after NeMo-RL itself imported them;
    # errors propagate so a broken install is reported where it happens.
    import importlib

    importlib.import_module(ACTIVATION).activate(fullname, module)


# ----------------------------------------------------------------------------- disabled
def _refuse_if_named(loss, where):
    name = loss_name_of(loss)
    if name is not None and name not in HOST_LOSS_NAMES:
        raise PluginDisabledError(
            f"loss_fn.name is {name!r} ({where}), but nemo-rs-plugin is switched off by "
            f"{DISABLE_ENV}={os.environ.get(DISABLE_ENV)}: NeMo-RL would train with its own loss and "
            f"ignore the recipe's correction settings. Unset {DISABLE_ENV} to use the plugin, or "
            "remove loss_fn.name (and the plugin's fields) to train with NeMo-RL's own loss."
        )


def _refuse_named_recipe(config_path, config, load):
    getter = getattr(config, "get", None)
    if getter is not None:
        _refuse_if_named(getter("loss_fn"), f"in {config_path}")
    return config


def _refuse_named_config(cfg):
    _refuse_if_named(cfg, "the config NeMo-RL's ClippedPGLossFn was built from")


def _guard_disabled(fullname, module):
    """With the plugin off: refuse, at the two places NeMo-RL reads the loss section."""
    if fullname == CONFIG_MODULE:
        wrap_load_config(module, _refuse_named_recipe)
    elif fullname == HOST_LOSS_MODULE:
        guard_init(getattr(module, "ClippedPGLossFn", None), _refuse_named_config)


def installed():
    """Whether the import hook is registered in this interpreter."""
    return any(isinstance(f, _Finder) for f in sys.meta_path)


def install():
    """Register the import hook once per interpreter (idempotent); ``nemo_rs_plugin.pth`` calls it.

    Returns ``"enabled"``, ``"disabled"`` (guard only) or ``None`` when already registered.
    """
    if installed():
        return None
    sys.meta_path.insert(0, _Finder())
    # NeMo-RL imported before the hook (an unusual start-up order): patch in place. The
    # loss class first, so a setup module patched after it finds the guard in place.
    for name in (HOST_LOSS_MODULE, CONFIG_MODULE) + LOSS_MODULES:
        if name in sys.modules:
            _patch(name, sys.modules[name])
    return "disabled" if disabled() else "enabled"
