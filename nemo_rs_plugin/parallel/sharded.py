"""The sharded input path: the loss on a rank's local logits shard, with no all-gather.

NeMo-RL all-gathers CP-sharded log-probs before its loss. This path instead takes the local
logits ``[B, S/cp, V/tp]``, computes next-token log-probs with a vocab-parallel log-softmax
over the TP group, cuts the (full-sequence) data tensors to the same CP layout, and lets the
loss all-reduce only its O(batch) per-sequence statistics.

Gradient flow, and why it equals NeMo-RL's gathered path under its Megatron loop:
NeMo-RL's default path all-gathers the CP shards of the log-probs (``AllGatherCPTensor``) and
evaluates the full loss ``L`` on every CP rank. Its backward SUM-all-reduces ``dL/dlogprobs``
over the CP group before each rank keeps its own chunk, so every rank receives ``cp`` times
its share of the gradient; ``LossPostProcessor``'s ``cp_normalize`` divides the loss by ``cp``
(the extra ``* num_microbatches / cp`` only cancels megatron-core's own ``* cp /
num_microbatches`` in ``forward_step``), and rank ``r`` back-propagates exactly
``dL/dz_r`` into its logits ``z_r``.
Here rank ``r`` first computes a *share* ``L_r`` of the loss with ``sum_r L_r = L`` (token
terms: the sum over local tokens divided by ``global_valid_toks``; replicated sequence-level
terms divided by ``cp``), every cross-rank statistic passing through a SUM all-reduce whose
backward sums the gradients. It then returns ``L = all_reduce_sum(L_r)`` with the same
autograd rule: the value is the full loss on every rank (the number the gathered path
returns), and in backward each rank's ``1/cp`` is summed over the ``cp`` ranks, so rank ``r``
receives ``d(sum_r' L_r')/dz_r = dL/dz_r``, as on the gathered path. Returning the bare share
instead gives ``dL/dz_r / cp``: that was the case before this was measured against NeMo-RL's
real ``LossPostProcessor``, megatron-core's ``forward_step``/``backward_step`` and
``parallel_state`` on gloo (``tests/parallel/test_real_megatron.py``: ratio 0.5 at CP2, 0.25 at CP4).
The *metrics* are reduced over the CP group, so every rank reports the full-batch values.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch
import torch.distributed as dist

from nemo_rs_plugin.core.batch.inputs import LossInputs
from nemo_rs_plugin.core.batch.microbatch import MicrobatchTotals
from nemo_rs_plugin.core.distributed import (
    SequenceGroups,
    agree_before_collectives,
    all_reduce_sum_with_grad,
    group_is_active,
)
from nemo_rs_plugin.core.loss import CorrectedPGLoss
from nemo_rs_plugin.parallel.layout import cp_shard, shift_left
from nemo_rs_plugin.parallel.vocab_parallel import chunk_size_problem, target_logprobs_and_nonfinite_rows

__all__ = ["sharded_loss", "sharded_loss_inputs", "sharded_loss_of_inputs"]

_ALIGNED_KEYS = {
    "prev": "prev_logprobs",
    "generation": "generation_logprobs",
    "reference": "reference_policy_logprobs",
    "advantages": "advantages",
    "token_mask": "token_mask",
}


def _size_rank(group: Any) -> tuple[int, int]:
    if not group_is_active(group):
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def sharded_loss_inputs(
    logits: torch.Tensor,
    data: Mapping[str, Any],
    *,
    cp_group: Any = None,
    tp_group: Any = None,
    pad_to_shard: bool = False,
    chunk_size: Optional[int] = None,
) -> LossInputs:
    """Aligned local inputs from a logits shard and NeMo-RL's full-sequence data dict.

    Args:
        logits: ``[B, S/cp, V/tp]`` in Megatron's CP layout (with sequence packing NeMo-RL's
            ``SequencePackingLossWrapper`` passes one padded sequence at a time, ``B = 1``).
        data: NeMo-RL's data dict with ``[B, S]`` tensors, identical on every rank.
        cp_group: the context-parallel group (or ``None``).
        tp_group: the tensor-parallel group, over which the vocabulary is split (or ``None``).
        pad_to_shard: zero-pad (mask) the data to ``S/cp * cp`` positions when it is
            shorter, as when NeMo-RL's packing wrapper passes one padded sequence's logits
            with that sequence's unpadded data.
        chunk_size: positions per chunk of the log-prob computation (NeMo-RL's
            ``policy.logprob_chunk_size``; ``None``: the default of
            :func:`~nemo_rs_plugin.parallel.vocab_parallel.target_logprobs`).

    Position ``t`` of every returned tensor holds the prediction of token ``t + 1`` of the
    full sequence (data shifted left *before* sharding); the last position of each sequence
    has ``token_mask = 0``.

    Before the first collective (the vocabulary all-gather over ``tp_group``) the ranks of
    ``tp_group`` and ``cp_group`` agree that each holds well-formed inputs of the same shapes
    (:func:`~nemo_rs_plugin.core.distributed.agree_before_collectives`): a problem one rank sees
    makes every rank raise the same ``ValueError`` instead of leaving its peers waiting.
    """
    cp, cp_rank = _size_rank(cp_group)
    shapes: list = []
    try:  # every problem this rank can see alone, before the first collective (the TP all-gather)
        shapes = _call_shapes(logits, data)
        _check_local_inputs(logits, data, cp, chunk_size)
        if pad_to_shard:
            data = _pad_sequences(data, logits.shape[1] * cp)
        B, S = data["input_ids"].shape
        _check_layout(logits, B, S, cp)
        problem = None
    except Exception as exc:  # noqa: BLE001 - whatever it is, the peers must hear of it, not wait
        problem = exc
    agree_before_collectives(
        problem,
        shapes or [(name, None) for name in _SHAPE_NAMES],
        (("tensor-parallel", tp_group), ("context-parallel", cp_group)),
        getattr(logits, "device", torch.device("cpu")),
    )
    targets = shift_left(data["input_ids"])
    aligned = {name: shift_left(data[key]) for name, key in _ALIGNED_KEYS.items() if key in data}

    def shard(x: torch.Tensor) -> torch.Tensor:
        return cp_shard(x, cp, cp_rank)

    curr, nonfinite_rows = target_logprobs_and_nonfinite_rows(logits, shard(targets), tp_group, chunk_size)
    parts = {name: shard(t) for name, t in aligned.items()}
    return LossInputs(
        curr=curr,
        prev=parts.get("prev"),
        generation=parts["generation"],
        reference=parts.get("reference"),
        advantages=parts["advantages"],
        token_mask=parts["token_mask"],
        sample_mask=data["sample_mask"],
        rewards=data.get("rewards"),
        nonfinite_logit_rows=nonfinite_rows.sum(-1, dtype=torch.float32),
    )


#: The data dict's tensors every rank of a TP or CP group holds alike (the whole microbatch).
_SHARED_KEYS = ("input_ids", *_ALIGNED_KEYS.values(), "sample_mask")
#: The header's tensor names, in order (the same on every rank, whatever its inputs).
_SHAPE_NAMES = ("logits", *(f"data[{key!r}]" for key in _SHARED_KEYS))


def _call_shapes(logits: Any, data: Mapping[str, Any]) -> list[tuple[str, Optional[tuple[int, ...]]]]:
    """The shapes the ranks of a TP or CP group must agree on: the logits shard's and the data's."""

    def shape(value: Any) -> Optional[tuple[int, ...]]:
        return tuple(value.shape) if isinstance(value, torch.Tensor) else None

    values = [logits, *(data.get(key) for key in _SHARED_KEYS)]
    return [(name, shape(value)) for name, value in zip(_SHAPE_NAMES, values)]


def _check_local_inputs(logits: Any, data: Mapping[str, Any], cp: int, chunk_size: Optional[int]) -> None:
    """Raise on what this rank can judge alone: settings, the logits' rank, the data's shapes."""
    if "curr_logprobs_unfiltered" in data:
        raise ValueError(
            "curr_logprobs_unfiltered: training-time top-k/top-p filtering is not supported with "
            "sharded_logits_input; disable the filtering or the sharded input"
        )
    problem = chunk_size_problem(chunk_size, field="chunk_size")
    if problem is not None:
        raise ValueError(problem)
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3:
        raise ValueError(f"logits: got shape {tuple(getattr(logits, 'shape', ()))}; expected [B, S/cp, V/tp]")
    required = ("input_ids", "sample_mask", "generation_logprobs", "advantages", "token_mask")
    for key in (*required, *(k for k in _ALIGNED_KEYS.values() if k in data)):
        if key not in data or not isinstance(data[key], torch.Tensor):
            raise KeyError(f"data[{key!r}] is missing or not a tensor; the sharded loss path needs it")
    input_ids = data["input_ids"]
    if input_ids.dim() != 2:
        raise ValueError(f"data['input_ids']: got shape {tuple(input_ids.shape)}; expected [B, S]")
    for key in _ALIGNED_KEYS.values():
        if key in data and tuple(data[key].shape) != tuple(input_ids.shape):
            raise ValueError(
                f"data[{key!r}]: shape {tuple(data[key].shape)} does not match input_ids "
                f"{tuple(input_ids.shape)}; every per-token field of the data dict is [B, S]"
            )
    if tuple(data["sample_mask"].shape) != tuple(input_ids.shape[:1]):
        raise ValueError(
            f"data['sample_mask']: shape {tuple(data['sample_mask'].shape)} does not match batch size "
            f"{input_ids.shape[0]}"
        )


def _check_layout(logits: torch.Tensor, B: int, S: int, cp: int) -> None:
    """Raise when ``S`` cannot be cut into Megatron's CP layout or the logits shard is not ``[B, S/cp]``."""
    if S % (2 * cp) != 0:
        raise ValueError(
            f"input_ids: sequence length {S} is not divisible by 2 * cp = {2 * cp}; "
            "pad sequences to a multiple of 2 * cp for the sharded loss path"
        )
    if logits.shape[:2] != (B, S // cp):
        raise ValueError(
            f"logits shard {tuple(logits.shape)} does not match [B, S/cp] = [{B}, {S // cp}] "
            f"for sequences of {S} tokens on a CP group of {cp} ranks"
        )


def _pad_sequences(data: Mapping[str, Any], length: int) -> dict:
    """Zero-pad every ``[B, S]`` tensor of ``data`` to ``length`` positions (masked out)."""
    S = data["input_ids"].shape[1]
    if S >= length:
        return dict(data)
    out = {}
    for key, value in data.items():
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == S:
            # One operator per field (this runs per sequence under packing), not a zeros and a cat;
            # F.pad's widths run from the last dimension back: the trailing ones unpadded.
            out[key] = torch.nn.functional.pad(value, (0, 0) * (value.dim() - 2) + (0, length - S))
        else:
            out[key] = value
    return out


# 10 parameters: NeMo-RL's loss call (logits, data, two global counts) plus the keyword-only
# process groups, padding flag and chunk size its callers (nemo_rl.loss_fn, the tests) pass by name.
def sharded_loss(
    loss_fn: CorrectedPGLoss,
    logits: torch.Tensor,
    data: Mapping[str, Any],
    global_valid_seqs: Any,
    global_valid_toks: Any,
    *,
    cp_group: Any = None,
    tp_group: Any = None,
    pad_to_shard: bool = False,
    data_parallel_group: Any = None,
    microbatch: Optional[MicrobatchTotals] = None,
    chunk_size: Optional[int] = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The full loss on every rank (gradients summed over the ranks) and the group-identical metrics.

    See the module docstring for why NeMo-RL's ``/ cp`` then gives its gathered path's gradients.
    ``data_parallel_group`` is read only by ``is_batch_normalization: data_parallel``;
    ``microbatch`` as in :meth:`CorrectedPGLoss.compute` (``data`` one sequence of it);
    ``chunk_size`` as in :func:`sharded_loss_inputs`.
    """
    inputs = sharded_loss_inputs(
        logits, data, cp_group=cp_group, tp_group=tp_group, pad_to_shard=pad_to_shard, chunk_size=chunk_size
    )
    return sharded_loss_of_inputs(
        loss_fn,
        inputs,
        global_valid_seqs,
        global_valid_toks,
        cp_group=cp_group,
        data_parallel_group=data_parallel_group,
        microbatch=microbatch,
    )


def sharded_loss_of_inputs(
    loss_fn: CorrectedPGLoss,
    inputs: LossInputs,
    global_valid_seqs: Any,
    global_valid_toks: Any,
    *,
    cp_group: Any = None,
    data_parallel_group: Any = None,
    microbatch: Optional[MicrobatchTotals] = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """:func:`sharded_loss` from inputs :func:`sharded_loss_inputs` already made (CP-local rows).

    For NeMo-RL's per-sequence packing wrapper the glue makes each sequence's inputs in its own
    call and computes the stacked rows (``LossInputs.stack_rows``) once, in the last call: the
    per-sequence statistics are masked row sums, so the CP SUM of stacked rows is each
    sequence's, and the one CP all-reduce of the loss share sums over the same ranks.
    """
    # Only CP splits a sequence's tokens here: TP splits the vocabulary, and Megatron gathers
    # sequence-parallel activations before the output layer.
    groups = SequenceGroups.of(cp_group, data_parallel=data_parallel_group)
    share, metrics = loss_fn.compute(inputs, global_valid_seqs, global_valid_toks, groups, microbatch)
    return all_reduce_sum_with_grad(share, groups), metrics
