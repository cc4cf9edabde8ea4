"""The microbatch totals kept between NeMo-RL's per-sequence packing calls (``TotalsCache``).

Where the packing wrapper's position cannot be read, each per-sequence call is corrected with its
whole microbatch's totals, computed once per microbatch and kept. NeMo-RL may hand the next step
the same dict with tensors changed in place (or swapped): the kept totals must then be computed
again, never reused. Pure Python: no NeMo-RL needed.
"""

import pytest
import torch

from nemo_rs_plugin.nemo_rl.packing import TotalsCache


class Microbatch(dict):
    """NeMo-RL's ``BatchedDataDict`` is a dict subclass (weak references allowed)."""


def microbatch():
    return Microbatch(
        token_mask=torch.ones(2, 5),
        sample_mask=torch.ones(2),
        prev_logprobs=torch.full((2, 5), -1.0),
        generation_logprobs=torch.full((2, 5), -1.1),
        rewards=torch.tensor([1.0, 0.0]),
    )


class Counting:
    def __init__(self):
        self.calls = 0

    def __call__(self):
        self.calls += 1
        return object()  # stands in for MicrobatchTotals: only its identity matters here


def test_the_same_unchanged_microbatch_is_computed_once():
    cache, compute, data = TotalsCache(), Counting(), microbatch()
    first = cache.get(data, compute)
    assert cache.get(data, compute) is first and compute.calls == 1


@pytest.mark.parametrize("key", ["token_mask", "sample_mask", "prev_logprobs", "generation_logprobs", "rewards"])
def test_a_tensor_changed_in_place_is_computed_again(key):
    cache, compute, data = TotalsCache(), Counting(), microbatch()
    first = cache.get(data, compute)
    data[key][0] = 0.5  # the next step's values written into the same storage
    assert cache.get(data, compute) is not first and compute.calls == 2


@pytest.mark.parametrize("key", ["token_mask", "generation_logprobs"])
def test_a_tensor_swapped_for_another_is_computed_again(key):
    cache, compute, data = TotalsCache(), Counting(), microbatch()
    first = cache.get(data, compute)
    data[key] = data[key].clone()
    assert cache.get(data, compute) is not first and compute.calls == 2


def test_another_microbatch_with_the_same_tensors_is_computed_again():
    cache, compute, data = TotalsCache(), Counting(), microbatch()
    first = cache.get(data, compute)
    assert cache.get(Microbatch(data), compute) is not first and compute.calls == 2


def test_a_mapping_without_weak_references_is_computed_per_call():
    cache, compute, data = TotalsCache(), Counting(), dict(microbatch())  # a plain dict: no weakref
    cache.get(data, compute)
    cache.get(data, compute)
    assert compute.calls == 2
