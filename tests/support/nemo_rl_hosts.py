"""Where the real NeMo-RL checkouts are, for the tests that run against the real host.

``$NEMO_RS_NEMO_RL_CHECKOUTS`` lists checkout roots (``os.pathsep``-separated; ``.ci/run``
extracts NeMo-RL v0.6.0, v0.7.0 and main from ``../shared/nemo-rl/`` and sets it). Without it,
an importable ``nemo_rl`` counts as one host (``""``: nothing to add to the path). None at
all: those tests skip, as on a user's machine without NeMo-RL, unless
``$NEMO_RS_REQUIRE_REAL_HOST=1`` (CI sets it), which turns every such skip into a failure.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

REQUIRE_ENV = "NEMO_RS_REQUIRE_REAL_HOST"


def real_host_required() -> bool:
    return os.environ.get(REQUIRE_ENV, "") not in ("", "0")


def nemo_rl_hosts() -> list[str]:
    env = os.environ.get("NEMO_RS_NEMO_RL_CHECKOUTS")
    if env:
        return [p for p in env.split(os.pathsep) if p]
    return [""] if importlib.util.find_spec("nemo_rl") is not None else []


def host_label(host: str) -> str:
    """``v0.7.0`` for ``.../nemo-rl-v0.7.0``; the folder name otherwise."""
    name = os.path.basename(os.path.normpath(host)) if host else "installed"
    return name.removeprefix("nemo-rl-")


#: Set to 1 to run the host matrices whole at every checkout, not only the newest (``whole_matrix``).
FULL_MATRIX_ENV = "NEMO_RS_FULL_HOST_MATRIX"
#: Released checkouts: fixed code, each already run through the whole matrix when it was the newest.
RELEASES = ("v0.6.0", "v0.7.0")


def whole_matrix(host: str) -> bool:
    """Whether the host's matrices run whole at ``host``, or a cover of them.

    Read by the DTensor training step (a cover of each kind of split), the Megatron training step
    (all splits but the short packing length), the real Megatron post-processing (each layout,
    packing and dtype), the live parity (every pair of options), the packing wrappers (all
    but the one-filter field cases) and the seam's worker without the start-up hook (a new ``-S``
    interpreter at the newest, a fork server's process with the hook's finder removed at a release).
    A matrix (microbatch sizes, packing lengths, data-parallel shapes, option products) checks the
    plugin's own arithmetic, which is the same code at every checkout; what a checkout changes is
    NeMo-RL's code around the loss, and every case of a cover exercises that. So the newest
    NeMo-RL (``main``, or an installed one) runs the whole matrix and a released checkout
    (:data:`RELEASES`) the cover, unless ``$NEMO_RS_FULL_HOST_MATRIX=1`` (a release's first run,
    or a change to a step's glue) asks for the whole matrix everywhere.
    """
    return os.environ.get(FULL_MATRIX_ENV, "") not in ("", "0") or host_label(host) not in RELEASES


def skip_or_fail(reason: str) -> None:
    """Skip, or fail where the real host is required (CI)."""
    if real_host_required():
        pytest.fail(f"{reason} (and {REQUIRE_ENV}=1 forbids skipping)")
    pytest.skip(reason)


def no_hosts_mark():
    """A ``skipif`` for modules whose every test needs a NeMo-RL host."""
    hosts = nemo_rl_hosts()
    if not hosts and real_host_required():
        raise RuntimeError(f"{REQUIRE_ENV}=1 but no NeMo-RL host: set NEMO_RS_NEMO_RL_CHECKOUTS")
    return pytest.mark.skipif(not hosts, reason="NeMo-RL is not importable (set NEMO_RS_NEMO_RL_CHECKOUTS)")


#: Source of ``run_cli(arg_lists)`` for scripts run in a host's interpreter: each argument list
#: through ``nemo-rs``'s ``main`` in that process, its exit code and captured stdout and stderr.
RUN_CLI_SOURCE = r"""
import contextlib, io


def run_cli(arg_lists):
    from nemo_rs_plugin.cli import main

    results = []
    for args in arg_lists:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(args)
        results.append({"code": code, "out": out.getvalue(), "err": err.getvalue()})
    return results
"""
