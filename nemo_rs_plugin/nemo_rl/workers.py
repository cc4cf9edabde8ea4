"""Ray workers reach the plugin through a directory on ``PYTHONPATH`` (standard library only).

NeMo-RL hands the driver's environment to its Ray workers, whose virtual environments are
built from NeMo-RL's lockfile and lack the plugin unless it is a dependency there. The
activation puts a directory holding only a link to this package on ``PYTHONPATH``; the doctor
reports it and the links an uninstalled copy left dangling.
"""

import os

WORKER_PATH_ENV = "NEMO_RS_PLUGIN_WORKER_PATH"
LINK_NAME = "nemo_rs_plugin"


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
            f"dependency of NeMo-RL there (see docs/install.md: Into NeMo-RL's uv project). Set {WORKER_PATH_ENV} to a "
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
