"""The sharded input path inside NeMo-RL's real Megatron loss machinery (gloo, CPU).

For each NeMo-RL checkout (v0.6.0, v0.7.0, main in CI), a world of 4 processes runs the real
megatron-core ``parallel_state``, ``forward_step``/``backward_step`` and NeMo-RL's
``LossPostProcessor`` over CP2, CP4, TP2xCP2 and TP2, packed and unpacked, fp32 and bf16
logits, and compares ``sharded_logits_input: true`` with NeMo-RL's default gathered path:
logits gradients (1e-5 relative in fp32), every reported metric and the loss value. What is
real and what is a stand-in: see ``tests/support/real_megatron_cases.py``.

The newest checkout runs all 16 (layout, packing, dtype) runs; a released one a cover of them
(``real_megatron_cases.RELEASE_COVER``: each layout, packing and dtype, and every pairing of packing
and dtype; ``NEMO_RS_FULL_HOST_MATRIX=1`` runs all 16 everywhere): the comparison checks the
plugin's sharded arithmetic, the same code at every checkout, while what a checkout changes,
NeMo-RL's post-processing around the loss, every run of the cover exercises.
"""

import importlib.util

import pytest

from tests.support import real_megatron_cases as cases
from tests.support.distributed_harness import run_world
from tests.support.nemo_rl_hosts import host_label, nemo_rl_hosts, no_hosts_mark, skip_or_fail

HOSTS = nemo_rl_hosts()
pytestmark = [pytest.mark.distributed, no_hosts_mark()]


@pytest.fixture(autouse=True)
def _megatron_core():
    if importlib.util.find_spec("megatron.core") is None:
        skip_or_fail("megatron-core is not installed (pip install megatron-core)")


@pytest.mark.slow  # 30-60 s per host: a gloo world inside NeMo-RL's Megatron post-processing
@pytest.mark.parametrize("host", HOSTS, ids=host_label)
def test_sharded_path_equals_nemo_rl_gathered_path(host):
    """Also checks the premise: the gathered path sends rank r the whole dL/dz_r."""
    run_world(4, cases.check_real_megatron, host, timeout=600)


def test_the_release_cover_holds_each_layout_packing_and_dtype():
    every, cover = cases.runs(True), cases.runs(False)
    assert len(every) == 16 and set(cover) <= set(every)
    assert sorted(layout for layout, _, _ in cover) == sorted(cases.LAYOUTS)
    assert {(packed, dtype) for _, packed, dtype in cover} == {(p, d) for _, p, d in every}
