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
