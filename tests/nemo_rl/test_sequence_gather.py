"""``SequenceGather``: the per-sequence wrapper's calls kept until the last, then one microbatch.

What NeMo-RL's real wrapper does with it is tested in ``test_packing.py`` (every configuration,
every host); here, without NeMo-RL, what it must refuse and how it stacks.
"""

import pytest
import torch

from nemo_rs_plugin.nemo_rl.packing import SequenceGather, WrapperCall

LENGTHS = (5, 3, 4)  # data columns per sequence; the microbatch is 5 wide


def _microbatch():
    mask = torch.zeros(len(LENGTHS), max(LENGTHS), dtype=torch.long)
    for i, n in enumerate(LENGTHS):
        mask[i, 1:n] = 1
    return {
        "token_mask": mask,
        "sample_mask": torch.ones(len(LENGTHS)),
        "generation_logprobs": -mask.double(),
    }


def _sequence(full, i, extra=False):
    n = LENGTHS[i]
    one = {k: (v[i : i + 1, :n] if v.dim() > 1 else v[i : i + 1]) for k, v in full.items()}
    if extra:  # what NeMo-RL's preparation adds per sequence under training-time top-k/top-p
        one["curr_logprobs_unfiltered"] = torch.full((1, n - 1), -float(i + 1), dtype=torch.float64)
    return one


def _logprobs(i):
    return torch.full((1, LENGTHS[i] - 1), -0.1 * (i + 1), dtype=torch.float64, requires_grad=True)


def test_the_last_call_returns_the_rows_stacked_and_padded_with_their_gradients():
    full, gather = _microbatch(), SequenceGather()
    leaves = [_logprobs(i) for i in range(3)]
    for i in range(2):
        assert gather.add(WrapperCall(7, 3, full, i), leaves[i], _sequence(full, i, extra=True)) is None
    logprobs, data = gather.add(WrapperCall(7, 3, full, 2), leaves[2], _sequence(full, 2, extra=True))
    assert logprobs.shape == (3, 4)
    assert logprobs[1].tolist() == [-0.2, -0.2, 0.0, 0.0]  # its two positions, then padding
    assert data["token_mask"] is full["token_mask"]  # the wrapper's own microbatch, not a copy
    assert data["curr_logprobs_unfiltered"][2].tolist() == [-3.0, -3.0, -3.0, 0.0]
    (logprobs * torch.arange(1.0, 5.0, dtype=torch.float64)).sum().backward()
    assert leaves[1].grad.tolist() == [[1.0, 2.0]]


def test_without_added_keys_the_wrapper_data_itself_is_passed():
    full, gather = _microbatch(), SequenceGather()
    out = None
    for i in range(3):
        out = gather.add(WrapperCall(1, 3, full, i), _logprobs(i), _sequence(full, i))
    assert out[1] is full


@pytest.mark.parametrize(
    "before, call",
    [([], (1, 1)), ([(1, 0)], (2, 1))],
    ids=["no-call-0-before", "call-1-from-another-wrapper-call"],
)
def test_calls_out_of_the_wrapper_order_are_refused(before, call):
    full, gather = _microbatch(), SequenceGather()
    for frame, i in before:
        gather.add(WrapperCall(frame, 3, full, i), _logprobs(i), _sequence(full, i))
    frame, i = call
    with pytest.raises(RuntimeError, match=f"sequence {i} of 3 out of order"):
        gather.add(WrapperCall(frame, 3, full, i), _logprobs(i), _sequence(full, i))


def test_a_call_0_starts_over_after_a_wrapper_call_that_stopped_part_way():
    full, gather = _microbatch(), SequenceGather()
    gather.add(WrapperCall(1, 3, full, 0), _logprobs(0), _sequence(full, 0))
    gather.add(WrapperCall(1, 3, full, 1), _logprobs(1), _sequence(full, 1))  # ... and the wrapper raised
    for i in range(2):
        assert gather.add(WrapperCall(2, 3, full, i), _logprobs(i), _sequence(full, i)) is None
    assert gather.add(WrapperCall(2, 3, full, 2), _logprobs(2), _sequence(full, 2)) is not None


def test_the_same_sequence_twice_and_another_microbatch_are_refused():
    full, gather = _microbatch(), SequenceGather()
    gather.add(WrapperCall(1, 3, full, 0), _logprobs(0), _sequence(full, 0))
    gather.add(WrapperCall(1, 3, full, 1), _logprobs(1), _sequence(full, 1))
    with pytest.raises(RuntimeError, match="sequence 1 of 3 out of order"):
        gather.add(WrapperCall(1, 3, full, 1), _logprobs(1), _sequence(full, 1))
    gather.add(WrapperCall(1, 3, full, 0), _logprobs(0), _sequence(full, 0))
    with pytest.raises(RuntimeError, match="out of order"):
        gather.add(WrapperCall(1, 3, _microbatch(), 1), _logprobs(1), _sequence(full, 1))


def test_log_probs_that_do_not_fit_their_sequence_are_a_clear_error():
    full, gather = _microbatch(), SequenceGather()
    wrong = torch.zeros(1, LENGTHS[0], dtype=torch.float64)  # one column too many
    with pytest.raises(ValueError, match=r"shape \(1, 5\) for 5 token_mask columns; expected \(1, 4\)"):
        gather.add(WrapperCall(1, 3, full, 0), wrong, _sequence(full, 0))


def test_added_data_that_is_not_per_token_is_a_clear_error():
    full, gather = _microbatch(), SequenceGather()
    for i in range(2):
        gather.add(WrapperCall(1, 3, full, i), _logprobs(i), {**_sequence(full, i), "extra": torch.zeros(1, 9)})
    with pytest.raises(ValueError, match=r"'extra', added to the packed sequences' data .* is \(1, 9\)"):
        gather.add(WrapperCall(1, 3, full, 2), _logprobs(2), {**_sequence(full, 2), "extra": torch.zeros(1, 9)})


def _inputs(i, with_reference=True):
    """Sequence ``i``'s ``LossInputs`` as the sharded path makes them per call (``[1, L_i - 1]``)."""
    from nemo_rs_plugin.core.batch.inputs import LossInputs

    n = LENGTHS[i] - 1
    return LossInputs(
        curr=_logprobs(i),
        prev=torch.full((1, n), -0.5, dtype=torch.float64),
        generation=torch.full((1, n), -0.5, dtype=torch.float64),
        reference=torch.full((1, n), -0.7, dtype=torch.float64) if with_reference else None,
        advantages=torch.ones(1, n, dtype=torch.float64),
        token_mask=torch.ones(1, n, dtype=torch.float64),
        sample_mask=torch.ones(1, dtype=torch.float64),
    )


def test_logit_input_calls_are_kept_and_the_last_returns_their_inputs_stacked():
    full, gather = _microbatch(), SequenceGather()
    parts = [_inputs(i) for i in range(3)]
    for i in range(2):
        assert gather.add_inputs(WrapperCall(4, 3, full, i), parts[i]) is None
    stacked = gather.add_inputs(WrapperCall(4, 3, full, 2), parts[2])
    assert stacked.curr.shape == stacked.reference.shape == stacked.token_mask.shape == (3, 4)
    assert stacked.token_mask[1].tolist() == [1.0, 1.0, 0.0, 0.0]  # sequence 1's two positions, then padding
    assert stacked.reference[1].tolist() == [-0.7, -0.7, 0.0, 0.0]
    assert stacked.sample_mask.shape == (3,) and stacked.rewards is None
    (stacked.curr * torch.arange(1.0, 5.0, dtype=torch.float64)).sum().backward()
    assert parts[1].curr.grad.tolist() == [[1.0, 2.0]]


def test_logit_input_calls_out_of_order_are_refused_and_a_call_0_starts_over():
    full, gather = _microbatch(), SequenceGather()
    with pytest.raises(RuntimeError, match="sequence 1 of 3 out of order"):
        gather.add_inputs(WrapperCall(1, 3, full, 1), _inputs(1))
    gather.add_inputs(WrapperCall(1, 3, full, 0), _inputs(0))  # ... and that wrapper call stopped here
    for i in range(2):
        assert gather.add_inputs(WrapperCall(2, 3, full, i), _inputs(i)) is None
    assert gather.add_inputs(WrapperCall(2, 3, full, 2), _inputs(2)) is not None
