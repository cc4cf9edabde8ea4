"""The loss records what ``nemo-rs calibrate --from DIR`` reads (loss fields ``record_logprobs``, ...).

NeMo-RL hands the loss, on every call, the sampler's log-probs (``generation_logprobs``), the
trainer's before the update (``prev_logprobs``), the masks and the advantages: everything
calibration needs. With ``record_logprobs: true`` the loss saves them, every ``record_every``
optimizer steps, as one torch file per microbatch in NeMo-RL's ``train_data`` layout (the
format ``--from`` reads, :func:`nemo_rs_plugin.tools.batch_formats.load_batch`)::

    <record_dir>/step000010-dp003-mb002.pt   # step 10, data-parallel rank 3, its 3rd microbatch

* **Steps**: an optimizer step is a global batch; NeMo-RL passes its global counts as one
  tensor to every microbatch of the step, so a new ``global_valid_toks`` object starts a new
  step, counted from 0 per worker process (NeMo-RL re-sends the loss every training step: the
  count lives in the process, not the loss object; the ranks see the same global batches). A
  new run counts from 0 again: give each run its own ``record_dir``.
* **Who writes**: one rank per copy of the data: on Megatron the ranks with tensor- and
  context-parallel rank 0, named by their data-parallel rank; elsewhere every rank, named by
  its global rank (under the DTensor backend with tensor parallelism the TP ranks write the
  same microbatch twice: the same quantiles).
* **Cost**: off, nothing runs. On, a step that does not record costs a few Python
  comparisons, no operator and no host sync; a recording step copies the five fields to the
  host (a blocking copy each) and writes about 13 bytes per token (float32 log-probs and
  advantages, an int8 mask): measured in docs/performance.md#recording.
* **Packing**: the whole microbatch is recorded once, also when NeMo-RL's per-sequence wrapper
  calls the loss once per sequence (the caller passes the wrapper's microbatch).
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

import torch

__all__ = ["RECORDED_FIELDS", "LogprobRecorder", "megatron_writer", "record_name"]

#: What a record holds, NeMo-RL's ``train_data`` names (what ``--from`` reads from a torch file).
RECORDED_FIELDS = ("prev_logprobs", "generation_logprobs", "token_mask", "advantages", "sample_mask")
#: Masks are 0/1: stored as int8 (a quarter of float32's bytes).
_MASKS = ("token_mask", "sample_mask")


def record_name(step: int, rank: int, microbatch: int) -> str:
    """The file of one recorded microbatch (sorts by step, then rank, then microbatch)."""
    return f"step{step:06d}-dp{rank:03d}-mb{microbatch:03d}.pt"


def megatron_writer() -> Optional[tuple[bool, int]]:
    """``(writes, rank)`` from megatron-core's ``parallel_state`` where it is initialised, else ``None``."""
    try:
        from megatron.core import parallel_state
    except ImportError:
        return None
    if not parallel_state.model_parallel_is_initialized():
        return None
    first = parallel_state.get_tensor_model_parallel_rank() == 0 and parallel_state.get_context_parallel_rank() == 0
    return first, parallel_state.get_data_parallel_rank()


def _default_writer() -> tuple[bool, int]:
    found = megatron_writer()
    if found is not None:
        return found
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    return True, rank


@dataclass
class _Progress:
    """What a process has recorded into one folder at one interval (outlives the loss objects)."""

    step: int = -1
    step_counts: Any = None  # the step's global_valid_toks (weak reference), or a number
    microbatch: int = 0
    last: Any = None  # the last recorded microbatch's token_mask (weak reference)
    who: Optional[tuple[bool, int]] = None
    written: list = field(default_factory=list)


#: Per process, per ``(record_dir, record_every)``: NeMo-RL sends the loss to its workers with every
#: ``policy.train`` call, so each GRPO step unpickles a new loss; the count must not restart with it.
_PROGRESS: dict[tuple[str, int], _Progress] = {}


class LogprobRecorder:
    """Saves the microbatches of every ``every``-th optimizer step under ``directory`` (module docstring).

    The step count lives in this process (:data:`_PROGRESS`), not in the recorder, which NeMo-RL
    pickles to its workers again with every training step.

    Args:
        directory: where the files go (created on the first write).
        every: record steps ``0, every, 2 * every, ...`` of this process.
        writer: ``() -> (writes, rank)``: whether this process writes, and the rank in its
            files' names; read once per process, on the first recording step (default:
            megatron-core's data-parallel rank on TP/CP rank 0, else the global rank).
    """

    def __init__(self, directory: str, every: int, writer: Callable[[], tuple[bool, int]] = _default_writer):
        self.directory, self.every = directory, every
        self._writer: Callable[[], tuple[bool, int]] = writer

    @property
    def _progress(self) -> _Progress:
        return _PROGRESS.setdefault((os.path.abspath(self.directory), self.every), _Progress())

    @property
    def step(self) -> int:
        """The optimizer step this process is in (0 from its first call), counted across loss objects."""
        return self._progress.step

    @property
    def written(self) -> list:
        """The files this process wrote into ``directory`` at this interval."""
        return self._progress.written

    def observe(self, global_valid_toks: Any, microbatch: Mapping[str, Any]) -> Optional[str]:
        """One loss call on ``microbatch`` (the whole microbatch); the file written, if any."""
        state = self._progress
        if _new_step(state, global_valid_toks):
            state.step += 1
            state.microbatch = 0
        if state.step % self.every:
            return None
        # A microbatch is known by its token_mask tensor (a data dict may be a plain dict, which
        # takes no weak reference): the per-sequence wrapper's calls pass the same one.
        mask = microbatch.get("token_mask")
        if state.last is not None and mask is not None and state.last() is mask:
            return None  # the per-sequence wrapper's microbatch, already recorded
        state.last = weakref.ref(mask) if isinstance(mask, torch.Tensor) else None
        if state.who is None:
            state.who = self._writer()
        writes, rank = state.who
        index = state.microbatch
        state.microbatch += 1
        if not writes:
            return None
        path = os.path.join(self.directory, record_name(state.step, rank, index))
        os.makedirs(self.directory, exist_ok=True)
        torch.save(_host_copy(microbatch), path)
        state.written.append(path)
        return path


def _new_step(state: _Progress, counts: Any) -> bool:
    """Whether ``counts`` (NeMo-RL's ``global_valid_toks``) starts a new optimizer step."""
    if isinstance(counts, torch.Tensor):
        previous = state.step_counts
        if previous is not None and not isinstance(previous, (int, float)) and previous() is counts:
            return False
        state.step_counts = weakref.ref(counts)
        return True
    # A number (no tensor to tell steps apart, e.g. the split API's placeholder): one step per call.
    state.step_counts = counts
    return True


def _host_copy(microbatch: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    out = {}
    for key in RECORDED_FIELDS:
        value = microbatch.get(key)
        if not isinstance(value, torch.Tensor):
            continue  # e.g. no prev_logprobs under force_on_policy_ratio: --from says what is missing
        value = value.detach()
        out[key] = value.to("cpu", torch.int8) if key in _MASKS else value.to("cpu", torch.float32)
    return out
