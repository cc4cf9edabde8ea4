"""Imported once by each pytest process's fork server (:func:`tests.support.fork_server.context`).

It also keeps the server's own start-up ``sys.path`` and ``PYTHONPATH``, from which a forked
process rebuilds the path a fresh interpreter would have (:func:`tests.support.fork_server.run_python`).
"""

import os
import sys

from tests.support.fork_server import preload

SERVER_SYS_PATH = list(sys.path)
SERVER_PYTHONPATH = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]

preload()
