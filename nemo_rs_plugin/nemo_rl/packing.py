"""The loss under NeMo-RL's per-sequence packing wrapper: its calls gathered into the unpacked call.

With ``policy.sequence_packing.enabled`` NeMo-RL's ``SequencePackingLossWrapper`` (Megatron
without ``fuse_loss``, the DTensor worker, automodel) calls the loss once per packed sequence:
for ``i`` in ``0 .. n - 1`` it slices sequence ``i`` out of the packed logits and out of the
microbatch (``data``), prepares its next-token log-probs, calls the loss on them (``B = 1``)
and sums the returned losses and metrics (``SPEC.md``, "How NeMo-RL calls the loss").

How the loss knows: :mod:`nemo_rs_plugin.nemo_rl.seam` puts the plugin's subclass of that
wrapper in NeMo-RL's place. For a plugin loss its ``__call__`` opens a :class:`HostCall`
(the wrapper's whole microbatch ``data``, its sequence count ``len(cu_seqlens_q) - 1`` and the
keywords NeMo-RL bound into its ``prepare_fn``) on the loss (``RSClippedPGLossFn.nemo_rl_call``)
and runs NeMo-RL's own loop inside it, unchanged; each call of the loss takes its position
from the :class:`HostCall` (:meth:`HostCall.next_call`: ``0, 1, ..., n - 1``, one per call, as
NeMo-RL's loop calls it), and the wrapper checks, when its loop returns, that the loss was
called exactly ``n`` times. No frame of the caller is read.

Log-prob input (the default): :class:`SequenceGather`. Calls ``0 .. n - 2`` only keep their
sequence's log-probs (and anything the preparation added to its data) and return a zero
loss and no metrics; call ``n - 1`` pads the ``n`` rows to the microbatch's width, stacks
them and runs the loss once on the whole microbatch, the wrapper's own ``data``:

    sum_i loss_i = 0 + ... + 0 + loss(stack_i logprobs_i, data) = the unpacked call's loss,

and likewise every metric and, through the stack, the gradient of every sequence's
log-probs. Batch-level settings therefore mean what they mean unpacked, and the loss's
fixed cost per call (checks, metric bookkeeping, the one host transfer) is paid once per
microbatch instead of once per sequence. Calls out of order are an error.

Logit input (``sharded_logits_input``): each call turns its own sequence's local logits
shard into its CP-local inputs (the vocab-parallel log-softmax, its TP all-reduce issued once
per sequence on every rank of the group, all holding the same sequences), which
:meth:`SequenceGather.add_inputs` keeps; the last call stacks them
(``LossInputs.stack_rows``) and the sharded loss runs once on the microbatch, as above. The
logits themselves are never copied.

A per-sequence wrapper that hands its microbatch but cannot promise NeMo-RL's order (a
:class:`HostCall` with ``positions=False``, for a wrapper other than NeMo-RL's): each call is
computed on its own sequence, with the microbatch totals of :mod:`nemo_rs_plugin.core.batch.microbatch`
read from the wrapper's ``data`` (:class:`TotalsCache`); the settings whose totals need the
current policy of other sequences are refused there. A loss called with no :class:`HostCall`
(directly, or by a wrapper that opens none) computes the call it is given, as an unpacked call.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Mapping, NamedTuple, Optional

import torch

from nemo_rs_plugin.core.batch.inputs import LossInputs, stack_padded
from nemo_rs_plugin.core.batch.microbatch import MicrobatchTotals

__all__ = [
    "PER_SEQUENCE_WRAPPER",
    "HostCall",
    "SequenceGather",
    "TotalsCache",
    "WrapperCall",
]

#: The NeMo-RL wrapper that calls the loss once per sequence (all supported versions).
PER_SEQUENCE_WRAPPER = "SequencePackingLossWrapper"


class WrapperCall(NamedTuple):
    """One call of the loss by the per-sequence wrapper, as its :class:`HostCall` hands it.

    Attributes:
        call_id: identifies one wrapper call (one microbatch): the :class:`HostCall`'s ``id``.
        sequences: the wrapper's sequence count (``len(cu_seqlens_q) - 1``).
        microbatch: the wrapper's ``data``: the whole microbatch, unpacked and padded.
        sequence_index: which sequence this call is, ``None`` where not known.
    """

    call_id: int
    sequences: int
    microbatch: Any
    sequence_index: Optional[int]  # not `index`: a NamedTuple field would hide tuple.index


class HostCall:
    """What NeMo-RL's wrapper holds that the loss's arguments do not carry, for one wrapper call.

    Opened by :mod:`nemo_rs_plugin.nemo_rl.seam`'s wrappers around NeMo-RL's own call and handed
    to the loss (``RSClippedPGLossFn.nemo_rl_call``); the loss reads it while it is open.

    Args:
        prepare_keywords: the keywords NeMo-RL bound into the wrapper's ``prepare_fn`` (a
            ``functools.partial`` of its ``prepare_loss_input``): ``sampling_params`` and, from
            v0.7.0, ``chunk_size`` (``policy.logprob_chunk_size``); ``{}`` where none.
        microbatch: the per-sequence wrapper's ``data`` (the whole microbatch); ``None`` for a
            wrapper that calls the loss once (unpacked, fused).
        sequences: the per-sequence wrapper's sequence count (``len(cu_seqlens_q) - 1``).
        positions: whether the wrapper calls the loss once per sequence in order (NeMo-RL's
            does); ``False``: each call is computed on its own sequence (:class:`TotalsCache`).
    """

    def __init__(
        self,
        prepare_keywords: Optional[Mapping[str, Any]] = None,
        microbatch: Any = None,
        sequences: Optional[int] = None,
        positions: bool = True,
    ) -> None:
        self.prepare_keywords: Mapping[str, Any] = dict(prepare_keywords or {})
        self.microbatch = microbatch
        self.sequences = sequences
        self.positions = positions
        self.calls = 0
        # A call's position is read only where the whole microbatch is what it should be; the
        # wrapper's data is the same object for all its calls, so this is decided once.
        self._readable = positions and sequences is not None and is_microbatch(microbatch, sequences)

    def next_call(self) -> Optional[WrapperCall]:
        """The loss's next call under this wrapper call (``None``: not a per-sequence wrapper).

        Raises:
            RuntimeError: more calls than the wrapper has sequences.
        """
        if self.sequences is None:
            return None
        index = self.calls
        self.calls += 1
        if index >= self.sequences:
            raise RuntimeError(
                f"rs_clipped_pg: {PER_SEQUENCE_WRAPPER} called the loss {self.calls} times for "
                f"{self.sequences} sequences (its cu_seqlens_q): expected one call per sequence"
            )
        return WrapperCall(id(self), self.sequences, self.microbatch, index if self._readable else None)

    def check_complete(self) -> None:
        """After the wrapper's loop: every sequence was a call (else a microbatch would go uncounted).

        Raises:
            RuntimeError: fewer calls than sequences.
        """
        if self.sequences is not None and self.positions and self.calls != self.sequences:
            raise RuntimeError(
                f"rs_clipped_pg: {PER_SEQUENCE_WRAPPER} called the loss {self.calls} times for "
                f"{self.sequences} sequences (its cu_seqlens_q): expected one call per sequence"
            )


def is_microbatch(data: Any, sequences: int) -> bool:
    """Whether ``data`` looks like the wrapper's whole microbatch: a row per sequence."""
    try:
        return all(data[k].shape[0] == sequences for k in ("token_mask", "sample_mask", "generation_logprobs"))
    except (KeyError, TypeError, AttributeError, IndexError):
        return False


class _Pending(NamedTuple):
    call_id: int
    microbatch: Any
    rows: list  # per sequence: (log-probs, data), or its LossInputs (logit input)


class SequenceGather:
    """Keeps the per-sequence wrapper's calls of one microbatch; the last returns the whole microbatch."""

    def __init__(self) -> None:
        self._pending: Optional[_Pending] = None

    def clear(self) -> None:
        """Forget a microbatch whose calls stopped part-way (the wrapper raised)."""
        self._pending = None

    def add(self, call: WrapperCall, logprobs: torch.Tensor, data: Mapping[str, Any]) -> Optional[tuple]:
        """Keep call ``call.sequence_index``'s inputs; on the last, ``(logprobs [n, T - 1], data)`` of the microbatch.

        ``None`` for every call before the last (its caller returns a zero loss, no metrics).

        Raises:
            RuntimeError: a call for a sequence out of the wrapper's order (no call 0 for this
                wrapper call, or the same sequence twice).
            ValueError: a sequence's log-probs are not ``[1, L - 1]`` for its ``L`` data columns.
        """
        pending = self._admit(call)
        width = data["token_mask"].shape[-1]
        if logprobs.dim() != 2 or logprobs.shape[0] != 1 or logprobs.shape[1] != width - 1:
            self._pending = None
            raise ValueError(
                f"rs_clipped_pg: sequence {call.sequence_index} of the packed microbatch has next_token_logprobs of "
                f"shape {tuple(logprobs.shape)} for {width} token_mask columns; expected (1, {width - 1})"
            )
        return self._keep(call, pending, (logprobs, data), _stacked)

    def add_inputs(self, call: WrapperCall, inputs: LossInputs) -> Optional[LossInputs]:
        """Keep call ``call.sequence_index``'s inputs (logit input: its sequence's CP-local ``LossInputs``).

        On the last call the microbatch's, stacked (``LossInputs.stack_rows``); ``None`` before.
        Raises ``RuntimeError`` for a call out of the wrapper's order, as :meth:`add`.
        """
        pending = self._admit(call)
        return self._keep(call, pending, inputs, lambda done: LossInputs.stack_rows(done.rows))

    def _admit(self, call: WrapperCall) -> _Pending:
        """The microbatch ``call`` belongs to: new at sequence 0, else the one its earlier calls began."""
        assert call.sequence_index is not None
        if call.sequence_index == 0:
            self._pending = _Pending(call.call_id, call.microbatch, [None] * call.sequences)
        pending = self._pending
        if (
            pending is None
            or pending.call_id != call.call_id
            or pending.microbatch is not call.microbatch
            or pending.rows[call.sequence_index] is not None
        ):
            self._pending = None
            raise RuntimeError(
                f"rs_clipped_pg: SequencePackingLossWrapper called the loss for sequence {call.sequence_index} of "
                f"{call.sequences} out of order (expected 0, 1, ..., {call.sequences - 1} within one wrapper call)"
            )
        return pending

    def _keep(self, call: WrapperCall, pending: _Pending, row: Any, stack: Callable[[_Pending], Any]) -> Any:
        assert call.sequence_index is not None
        pending.rows[call.sequence_index] = row
        if call.sequence_index < call.sequences - 1:
            return None
        self._pending = None
        return stack(pending)


def _stacked(pending: _Pending) -> tuple[torch.Tensor, Mapping[str, Any]]:
    """The microbatch's ``[n, T - 1]`` log-probs and its data, as the unpacked call receives them.

    A row's positions past its sequence are padding (``token_mask`` 0 there); they hold 0.
    Data the preparation added per sequence (e.g. ``curr_logprobs_unfiltered`` under
    training-time top-k/top-p) is stacked the same way; the rest is the wrapper's ``data``.
    """
    full = pending.microbatch
    width = full["token_mask"].shape[-1]
    kept_logprobs = [logprobs for logprobs, _ in pending.rows]
    kept_data = [data for _, data in pending.rows]

    def stack(rows: list[torch.Tensor], row_width: Callable[[torch.Tensor, int], int]) -> torch.Tensor:
        return stack_padded(rows, [row_width(r, i) for i, r in enumerate(rows)])

    logprobs = stack(kept_logprobs, lambda r, i: width - 1)
    added = {
        k: stack(
            [_per_token(d, k) for d in kept_data],
            # as long as the sequence's token_mask is short of the microbatch's
            lambda r, i: r.shape[-1] + width - kept_data[i]["token_mask"].shape[-1],
        )
        for k, v in kept_data[-1].items()
        if k not in full and isinstance(v, torch.Tensor) and v.dim() == 2
    }
    return logprobs, ({**full, **added} if added else full)


def _per_token(data: Mapping[str, Any], key: str) -> torch.Tensor:
    """``data[key]``, checked to be one row per token (``S`` or ``S - 1`` wide, as ``token_mask`` is ``S``)."""
    width = data["token_mask"].shape[-1]
    value = data.get(key)
    if not isinstance(value, torch.Tensor) or value.dim() != 2 or value.shape[-1] not in (width, width - 1):
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(
            f"rs_clipped_pg: {key!r}, added to the packed sequences' data by NeMo-RL's preparation, is {shape} "
            f"in a sequence whose token_mask has {width} columns: expected (1, {width}) or (1, {width - 1}) "
            "in every sequence, to be stacked into the microbatch"
        )
    return value


def microbatch_key(data: Any) -> tuple:
    """What cached totals were computed from: the tensors' storage and in-place version counters."""
    keys = ("token_mask", "sample_mask", "prev_logprobs", "generation_logprobs", "rewards")
    return tuple((data[k].data_ptr(), data[k]._version) for k in keys if k in data)


class TotalsCache:
    """The last microbatch's totals, kept while the wrapper passes the same (unchanged) ``data``."""

    def __init__(self) -> None:
        self._entry: Optional[tuple[Any, tuple, MicrobatchTotals]] = None

    def get(self, full: Any, compute: Callable[[], MicrobatchTotals]) -> MicrobatchTotals:
        """The totals of ``full``: cached by weak reference and :func:`microbatch_key`, else ``compute()``."""
        key = microbatch_key(full)
        entry = self._entry
        if entry is not None and entry[0]() is full and entry[1] == key:
            return entry[2]
        totals = compute()
        try:
            self._entry = (weakref.ref(full), key, totals)
        except TypeError:  # a data dict without weak references: not cached (computed again per call)
            self._entry = None
        return totals
