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
  silently with NeMo-RL's loss.
* ``nemo_rl.utils.config``: ``load_config`` gets the ``loss_fn: <name>`` shorthand, and refuses
  a recipe naming a plugin loss when the selector could not be installed.

``NEMO_RS_PLUGIN_DISABLE=1`` switches the plugin off: nothing of the package is imported and
NeMo-RL builds its own loss. The hook then only guards: a recipe that still names a plugin
loss (``loss_fn.name`` other than ``clipped_pg``) is refused when ``load_config`` reads it or
when NeMo-RL's ``ClippedPGLossFn`` is built from it, instead of training with a loss the recipe
did not ask for.
"""

import os
import sys

DISABLE_ENV = "NEMO_RS_PLUGIN_DISABLE"
WORKER_PATH_ENV = "NEMO_RS_PLUGIN_WORKER_PATH"
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
LINK_NAME = "nemo_rs_plugin"


class PluginDisabledError(RuntimeError):
    """A recipe names a plugin loss while ``NEMO_RS_PLUGIN_DISABLE`` switches the plugin off."""


def disabled():
    """Whether ``NEMO_RS_PLUGIN_DISABLE`` switches the plugin off in this process."""
    return os.environ.get(DISABLE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


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
    if disabled():
        _guard_disabled(fullname, module)
        return
    # The heavy imports (torch, pydantic, NeMo-RL's loss) happen here, after NeMo-RL itself
    # imported them; errors propagate so a broken install is reported where it happens.
    from nemo_rs_plugin import nemo_rl_adapter

    if fullname == CONFIG_MODULE:
        nemo_rl_adapter.patch_config_loader(module)
    elif fullname == HOST_LOSS_MODULE:
        if hasattr(nemo_rl_adapter, "guard_host_loss"):
            nemo_rl_adapter.guard_host_loss(module)
        # else the adapter is being imported and imported NeMo-RL's loss first: it guards the
        # class itself once it is complete (the end of nemo_rl_adapter).
    else:
        if not nemo_rl_adapter.install_into(module):
            import warnings

            warnings.warn(nemo_rl_adapter.install_failure(module), RuntimeWarning, stacklevel=2)
        expose_to_workers()


# ----------------------------------------------------------------------------- disabled
def _disabled_message(name, where):
    return (
        f"loss_fn.name is {name!r} ({where}), but nemo-rs-plugin is switched off by "
        f"{DISABLE_ENV}={os.environ.get(DISABLE_ENV)}: NeMo-RL would train with its own loss and "
        f"ignore the recipe's correction settings. Unset {DISABLE_ENV} to use the plugin, or "
        "remove loss_fn.name (and the plugin's fields) to train with NeMo-RL's own loss."
    )


def _name_of(loss):
    if loss is None or isinstance(loss, str):
        return loss
    getter = getattr(loss, "get", None)
    if getter is not None:
        try:
            return getter("name")
        except Exception:  # noqa: BLE001 - a mapping that refuses unknown keys
            return None
    return getattr(loss, "name", None)


def _refuse_if_named(loss, where):
    name = _name_of(loss)
    if name is not None and name not in HOST_LOSS_NAMES:
        raise PluginDisabledError(_disabled_message(name, where))


def _guard_disabled(fullname, module):
    """With the plugin off: refuse, at the two places NeMo-RL reads the loss section."""
    if fullname == CONFIG_MODULE:
        load = getattr(module, "load_config", None)
        if load is None or getattr(load, "_nemo_rs_guard", False):
            return

        def load_config(config_path, *args, **kwargs):
            config = load(config_path, *args, **kwargs)
            getter = getattr(config, "get", None)
            if getter is not None:
                _refuse_if_named(getter("loss_fn"), f"in {config_path}")
            return config

        load_config._nemo_rs_guard = True
        load_config.__doc__ = load.__doc__
        load_config.__wrapped__ = load
        module.load_config = load_config
    elif fullname == HOST_LOSS_MODULE:
        cls = getattr(module, "ClippedPGLossFn", None)
        init = getattr(cls, "__init__", None)
        if not isinstance(cls, type) or getattr(init, "_nemo_rs_guard", False):
            return

        def __init__(self, cfg, *args, **kwargs):
            if type(self) is cls:
                _refuse_if_named(cfg, "the config NeMo-RL's ClippedPGLossFn was built from")
            init(self, cfg, *args, **kwargs)

        __init__._nemo_rs_guard = True
        __init__.__wrapped__ = init
        __init__.__doc__ = init.__doc__
        cls.__init__ = __init__


# ----------------------------------------------------------------------------- workers
def worker_path_base():
    """The directory holding the worker-path links (``NEMO_RS_PLUGIN_WORKER_PATH``)."""
    return os.environ.get(WORKER_PATH_ENV) or os.path.join(
        os.path.expanduser("~"), ".cache", "nemo_rs_plugin", "worker-path"
    )


def dangling_links(base=None):
    """Worker-path directories under ``base`` whose link points nowhere (a removed install)."""
    base = base or worker_path_base()
    try:
        entries = sorted(os.listdir(base))
    except OSError:
        return []
    out = []
    for entry in entries:
        link = os.path.join(base, entry, LINK_NAME)
        if os.path.islink(link) and not os.path.exists(link):
            out.append(os.path.join(base, entry))
    return out


def prune_dangling_links(base=None):
    """Remove the directories :func:`dangling_links` finds; returns those removed."""
    removed = []
    for shim in dangling_links(base):
        try:
            os.unlink(os.path.join(shim, LINK_NAME))
            os.rmdir(shim)
        except OSError:
            continue
        removed.append(shim)
    return removed


def expose_to_workers():
    """Put a directory holding only a link to this package on ``PYTHONPATH``.

    NeMo-RL passes the driver's environment to its Ray workers, whose virtual environments
    are built from NeMo-RL's lockfile and lack the plugin unless it is a dependency there;
    with this they can unpickle the loss without a rebuild. The directory must be visible to
    every node (as NeMo-RL's own ``NEMO_RL_VENV_DIR`` must): set
    ``NEMO_RS_PLUGIN_WORKER_PATH`` to choose it. Links left dangling by an uninstalled copy
    are removed, and other worker-path directories are taken off ``PYTHONPATH``.

    Returns the directory, or ``None`` when the package location is unknown or the link
    cannot be made (a warning then says what the workers will lack).
    """
    import importlib.util
    import zlib  # a stable name per install location (hash() is salted per process)

    spec = importlib.util.find_spec("nemo_rs_plugin")
    if spec is None or not spec.submodule_search_locations:
        return None
    package_dir = os.path.realpath(list(spec.submodule_search_locations)[0])
    base = worker_path_base()
    shim = os.path.join(base, format(zlib.crc32(package_dir.encode()), "08x"))
    link = os.path.join(shim, LINK_NAME)
    try:
        os.makedirs(shim, exist_ok=True)
        if os.path.realpath(link) != package_dir:
            tmp = f"{link}.{os.getpid()}.tmp"
            os.symlink(package_dir, tmp)
            os.replace(tmp, link)
    except OSError as exc:
        import warnings

        warnings.warn(
            f"nemo-rs-plugin: cannot link the package into {shim} ({exc}). Ray workers that "
            "run in NeMo-RL's worker virtual environments will fail to unpickle the loss "
            "(ModuleNotFoundError: No module named 'nemo_rs_plugin') unless the plugin is a "
            f"dependency of NeMo-RL there (see README: uv add). Set {WORKER_PATH_ENV} to a "
            "writable directory that every node sees.",
            RuntimeWarning,
            stacklevel=2,
        )
        return None
    prune_dangling_links(base)
    prefix = os.path.join(os.path.realpath(base), "")
    parts = [
        p
        for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
        if p and (p == shim or not os.path.realpath(p).startswith(prefix))
    ]
    if shim not in parts:
        parts.append(shim)
    os.environ["PYTHONPATH"] = os.pathsep.join(parts)
    return shim


def installed():
    """Whether the import hook is registered in this interpreter."""
    return any(isinstance(f, _Finder) for f in sys.meta_path)


def install():
    """Register the import hook once per interpreter (idempotent).

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


install()
