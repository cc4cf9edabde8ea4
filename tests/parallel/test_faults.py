"""One fault at a time inside NeMo-RL's real Megatron loss path (gloo, CPU; issue 49).

For the newest NeMo-RL checkout (main in CI; the sharded path's equality with NeMo-RL's gathered path
at every version is ``tests/parallel/test_real_megatron.py``'s) a world of 4 processes runs the sharded
logits path through megatron-core's ``forward_step``/``backward_step`` and NeMo-RL's
``LossPostProcessor`` at TP 2 x CP 2, CP 2 and TP 2 (cases: ``tests/support/fault_cases.py``):

* a NaN or +inf logit at a prompt position, a masked row, the last position or a valid token
  leaves every gradient and the loss finite and is counted in ``nonfinite_logit_rows_count``;
* a shape fault on one rank makes every rank of its groups raise the same error within seconds.

A rank that waits in a collective fails the world's timeout (the test fails, the suite goes on).
"""

import importlib.util

import pytest

from tests.support import fault_cases as cases
from tests.support.distributed_harness import run_world_cases
from tests.support.nemo_rl_hosts import host_label, nemo_rl_hosts, no_hosts_mark, skip_or_fail

HOSTS = nemo_rl_hosts()[-1:]  # the newest: a 4-process world costs about a minute of CI per host
pytestmark = [pytest.mark.distributed, no_hosts_mark()]
_WORLD_TIMEOUT_S = 300.0  # start-up and every case; a hang in a collective would last 30 minutes (gloo)
_results: dict = {}


@pytest.fixture(autouse=True)
def _megatron_core():
    if importlib.util.find_spec("megatron.core") is None:
        skip_or_fail("megatron-core is not installed (pip install megatron-core)")


def _failures(host, name: str) -> list:
    if host not in _results:  # one world per host for both checks
        world = [
            ("shape", cases.check_shape_fault_on_one_rank, (host,)),
            ("nonfinite", cases.check_nonfinite_logits, (host,)),
        ]
        _results[host] = run_world_cases(4, world, timeout=_WORLD_TIMEOUT_S)
    return _results[host][name]


@pytest.mark.slow  # a 4-process world inside NeMo-RL's Megatron post-processing
@pytest.mark.parametrize("host", HOSTS, ids=host_label)
def test_a_shape_fault_on_one_rank_raises_the_same_error_on_every_rank(host):
    failures = _failures(host, "shape")
    assert not failures, "\n".join(failures[:40])


@pytest.mark.slow
@pytest.mark.parametrize("host", HOSTS, ids=host_label)
def test_nonfinite_logits_leave_every_gradient_finite_and_are_counted(host):
    failures = _failures(host, "nonfinite")
    assert not failures, "\n".join(failures[:40])
