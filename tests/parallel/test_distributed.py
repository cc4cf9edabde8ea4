"""Tensor/context parallelism on CPU with gloo: sharded results equal unsharded ones.

World size 2 is CP2; world size 4 is TP2 x CP2 (vocab-parallel logits). Each rank compares
its loss share (summed over CP), metrics, logits and log-prob gradients, rejection masks and
IS weights with the single-process computation on the full batch (rel 1e-5).

These test the plugin's own contracts with itself. The claim "equals NeMo-RL's gathered path
under its Megatron loop" is tested against NeMo-RL's and megatron-core's real code in
``tests/parallel/test_real_megatron.py``.
"""

import pytest
import torch

from nemo_rs_plugin.core.distributed import SequenceGroups, reduce_sequence_statistics
from nemo_rs_plugin.parallel.layout import cp_shard
from tests.support import distributed_cases as cases
from tests.support.cp_layout import cp_unshard
from tests.support.distributed_harness import run_world_cases

pytestmark = pytest.mark.distributed


WORLDS = {
    2: [
        ("cp2-sharded-equals-unsharded", cases.check_sharded_equals_unsharded, (1,)),
        ("statistic-reduced-before-masking", cases.check_statistic_reduced_before_masking, ()),
        ("collective-budget", cases.check_collective_budget, ()),
        ("bad-groups", cases.check_bad_groups, ()),
        ("bad-global-count", cases.check_bad_global_count_raises_on_every_rank, ()),
        ("sharded-loss-gradient-scale", cases.check_sharded_loss_gradient_scale, ()),
    ],
    4: [
        ("tp2-cp2-sharded-equals-unsharded", cases.check_sharded_equals_unsharded, (2,)),
        ("dp2-cp2-batch-normalization", cases.check_data_parallel_batch_normalization, ()),
    ],
}
_RESULTS: dict = {}


def failures_of(world_size: int, name: str) -> list:
    """The failures of one case; each world size runs all its cases once, in one world."""
    if world_size not in _RESULTS:
        _RESULTS[world_size] = run_world_cases(world_size, WORLDS[world_size])
    return _RESULTS[world_size][name]


def check(world_size: int, name: str) -> None:
    failures = failures_of(world_size, name)
    assert not failures, "\n".join(failures[:40])


def test_cp2_sharded_equals_unsharded():
    check(2, "cp2-sharded-equals-unsharded")


def test_tp2_cp2_sharded_equals_unsharded():
    check(4, "tp2-cp2-sharded-equals-unsharded")


def test_data_parallel_batch_normalization_dp2_cp2():
    check(4, "dp2-cp2-batch-normalization")


def test_sharded_loss_gives_the_unsharded_gradient_under_the_cp_normalisation():
    check(2, "sharded-loss-gradient-scale")


def test_statistic_is_reduced_before_any_mask():
    check(2, "statistic-reduced-before-masking")


def test_statistics_cost_one_sum_and_one_max_and_no_all_gather():
    check(2, "collective-budget")


def test_bad_groups_and_shapes_fail_clearly():
    check(2, "bad-groups")


def test_bad_global_count_raises_on_every_rank():
    check(2, "bad-global-count")


def test_cp_layout_roundtrip_and_chunk_order():
    x = torch.arange(16).reshape(1, 16)
    shards = [cp_shard(x, 2, r) for r in range(2)]
    assert shards[0].tolist() == [[0, 1, 2, 3, 12, 13, 14, 15]]  # chunks 0 and 3
    assert shards[1].tolist() == [[4, 5, 6, 7, 8, 9, 10, 11]]  # chunks 1 and 2
    assert torch.equal(cp_unshard(shards), x)
    with pytest.raises(ValueError, match="not divisible by 2 \\* cp = 4"):
        cp_shard(torch.zeros(1, 10), 2, 0)


def test_no_collective_without_groups(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("a collective was issued without a group")

    monkeypatch.setattr(torch.distributed, "all_reduce", fail)
    sums, maxima = reduce_sequence_statistics(torch.ones(3, 2), torch.ones(1, 2), SequenceGroups())
    assert sums.sum() == 6
    from nemo_rs_plugin import CorrectedPGLoss
    from tests.core.test_inputs import FULL, batch

    loss, _ = CorrectedPGLoss(FULL)(*batch())
    loss.backward()
