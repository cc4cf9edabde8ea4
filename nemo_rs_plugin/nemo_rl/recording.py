"""The loss records what ``nemo-rs calibrate --from DIR`` reads (loss fields ``record_logprobs``, ...).

NeMo-RL hands the loss, on every call, the sampler's log-probs (``generation_logprobs``), the
trainer's before the update (``prev_logprobs``), the masks and the advantages: everything
calibration needs. With ``record_logprobs: true`` the loss saves them, every ``record_every``
optimizer steps, as one torch file per microbatch in NeMo-RL's ``train_data`` layout (the
format ``--from`` reads, :func:`nemo_rs_plugin.tools.batch_formats.load_batch`), in the run's
own folder (:mod:`nemo_rs_plugin.nemo_rl.record_format`)::

    <record_dir>/<run id>/step000010-dp003-mb002.pt   # step 10, data-parallel rank 3, its 3rd microbatch

* **Runs**: the run id is drawn when the loss is built (NeMo-RL's driver builds it once per job
  and sends it to every worker); a resumed or retried job is a new run, in its own folder, so
  two runs sharing a ``record_dir`` never overwrite each other and calibrate reads one of them.
* **Steps**: an optimizer step is a global batch; NeMo-RL passes its global counts as one
  tensor to every microbatch of the step, so a new ``global_valid_toks`` object starts a new
  step, counted from 0 per worker process and run (NeMo-RL re-sends the loss every training
  step: the count lives in the process, not the loss object; the ranks see the same global batches).
* **Who writes**: one rank per copy of the data: on Megatron the ranks with tensor- and
  context-parallel rank 0, named by their data-parallel rank; elsewhere every rank, named by
  its global rank (under the DTensor backend with tensor parallelism the TP ranks write the
  same microbatch twice: calibrate reads identical copies of a step once).
* **Failures never stop training**: the folder is checked when the loss is built (a
  ``ConfigError`` naming it and the cause); a write that fails later (a full disk, a folder
  gone) is caught: one warning on the ``nemo_rs_plugin`` logger naming the file, the cause and
  what is lost, recording stops on that rank, and the metric ``record_write_failures`` counts
  the records it did not write. Nothing of it touches a collective, so the other ranks go on
  in step. A record is written under a temporary name and renamed: a file under a record's name
  is never partial.
* **Cost**: off, nothing runs. On, a step that does not record costs a few Python
  comparisons, no operator and no host sync; a recording step copies the five fields to the
  host (a blocking copy each) and writes about 13 bytes per token (float32 log-probs and
  advantages, an int8 token mask): measured in docs/performance.md#recording.
* **Packing**: the whole microbatch is recorded once, also when NeMo-RL's per-sequence wrapper
  calls the loss once per sequence (the caller passes the wrapper's microbatch).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

import torch

from nemo_rs_plugin.core.reporting.health import LOGGER
from nemo_rs_plugin.core.settings.config import ConfigError
from nemo_rs_plugin.nemo_rl.record_format import (
    FORMAT,
    MANIFEST,
    META,
    RECORDED_FIELDS,
    fields_digest,
    new_run_id,
    record_name,
)

__all__ = ["FAILURES_METRIC", "RECORDED_FIELDS", "LogprobRecorder", "megatron_writer", "record_name"]

#: The metric the NeMo-RL loss returns with ``record_logprobs: true``: records not written because
#: a write failed (not normalized: NeMo-RL sums it over microbatches and ranks, a count of records).
FAILURES_METRIC = "record_write_failures"
#: The token mask is 0/1 (the loss refuses any other value): stored as int8. ``sample_mask`` may be
#: fractional (a weight): stored as float32, as the log-probs.
_INT8_FIELDS = ("token_mask",)


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
    """What a process has recorded into one run's folder at one interval (outlives the loss objects)."""

    step: int = -1
    step_counts: Any = None  # the step's global_valid_toks (weak reference), or a number
    microbatch: int = 0
    last: Any = None  # the last recorded microbatch's token_mask (weak reference)
    who: Optional[tuple[bool, int]] = None
    written: list = field(default_factory=list)
    manifest: bool = False  # this process made sure the run's manifest exists
    failure: Optional[str] = None  # the warning of the write that failed: recording stopped
    lost: int = 0  # records not written since the metric last took the count


#: Per process, per ``(run folder, record_every)``: NeMo-RL sends the loss to its workers with every
#: ``policy.train`` call, so each GRPO step unpickles a new loss; the count must not restart with it.
_PROGRESS: dict[tuple[str, int], _Progress] = {}


class LogprobRecorder:
    """Saves the microbatches of every ``every``-th optimizer step under ``directory`` (module docstring).

    The step count lives in this process (:data:`_PROGRESS`), not in the recorder, which NeMo-RL
    pickles to its workers again with every training step.

    Args:
        directory: the ``record_dir``; the records go to its subfolder :attr:`run_id` (created).
        every: record steps ``0, every, 2 * every, ...`` of this process.
        writer: ``() -> (writes, rank)``: whether this process writes, and the rank in its
            files' names; read once per process, on the first recording step (default:
            megatron-core's data-parallel rank on TP/CP rank 0, else the global rank).
        run_id: the run's id (default: a new one, :func:`~nemo_rs_plugin.nemo_rl.record_format.new_run_id`);
            recorders given one id write one run (e.g. the ranks of a loop outside NeMo-RL).
    """

    def __init__(
        self,
        directory: str,
        every: int,
        writer: Callable[[], tuple[bool, int]] = _default_writer,
        run_id: Optional[str] = None,
    ):
        self.directory, self.every = directory, every
        self.run_id = run_id or new_run_id()
        self._writer: Callable[[], tuple[bool, int]] = writer

    @property
    def run_dir(self) -> str:
        """The run's folder: ``<directory>/<run_id>``."""
        return os.path.join(self.directory, self.run_id)

    def check(self) -> None:
        """Create the run's folder and write its manifest now (where the loss is built).

        Raises:
            ConfigError: naming ``directory``, the path that failed and the cause (errno), before
                any training step.
        """
        try:
            _write_manifest(self.run_dir, self.run_id, self.every)
        except OSError as exc:
            raise ConfigError(
                [
                    f"record_dir: got {self.directory!r}, where records cannot be written ({_cause(exc)}); "
                    "name a folder every training worker can create and write (an absolute path on shared "
                    "storage), or set record_logprobs: false"
                ]
            ) from None
        self._progress.manifest = True

    @property
    def _progress(self) -> _Progress:
        return _PROGRESS.setdefault((os.path.abspath(self.run_dir), self.every), _Progress())

    @property
    def step(self) -> int:
        """The optimizer step this process is in (0 from its first call), counted across loss objects."""
        return self._progress.step

    @property
    def written(self) -> list:
        """The files this process wrote into the run's folder at this interval."""
        return self._progress.written

    def take_failures(self) -> int:
        """Records not written (a write failed, or recording had stopped) since the last call: the metric."""
        state = self._progress
        lost, state.lost = state.lost, 0
        return lost

    def observe(self, global_valid_toks: Any, microbatch: Mapping[str, Any]) -> Optional[str]:
        """One loss call on ``microbatch`` (the whole microbatch); the file written, if any.

        Never raises for a write that fails (module docstring): it warns once and stops recording.
        """
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
        if state.failure is not None:  # recording stopped on this rank at its first failure
            state.lost += 1
            return None
        path = os.path.join(self.run_dir, record_name(state.step, rank, index))
        try:
            record: dict[str, Any] = _host_copy(microbatch)
            meta = {"format": FORMAT, "run_id": self.run_id, "step": state.step, "rank": rank, "microbatch": index}
            record[META] = {**meta, "sha256": fields_digest(record)}
            if not state.manifest:  # a worker whose folder the driver's check did not create
                _write_manifest(self.run_dir, self.run_id, self.every)
                state.manifest = True
            _write_atomically(path, lambda fh: torch.save(record, fh))
        except Exception as exc:  # noqa: BLE001 - a diagnostic never stops training
            state.lost += 1
            state.failure = (
                f"rs_clipped_pg: recording stopped on this rank: writing {path} failed ({_cause(exc)}); "
                f"this rank records nothing more in run {self.run_id} from step {state.step}, microbatch {index} "
                f"on (their log-probs are lost for nemo-rs calibrate); training goes on. The metric "
                f"{FAILURES_METRIC} counts the records lost; calibrate reads those written so far "
                f"(nemo-rs calibrate --from {self.directory})"
            )
            LOGGER.warning(state.failure)
            return None
        state.written.append(path)
        return path


def _cause(exc: BaseException) -> str:
    """An exception as ``ENOSPC (No space left on device) at PATH``, or its type and first line."""
    if isinstance(exc, OSError) and exc.errno is not None:
        code = errno.errorcode.get(exc.errno, str(exc.errno))
        named = getattr(exc, "filename2", None) or exc.filename  # a rename's target, else the file
        where = f" at {named}" if named else ""
        return f"{code} ({exc.strerror or os.strerror(exc.errno)}){where}"
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def _write_atomically(path: str, write: Callable[[Any], Any]) -> None:
    """``write(file)`` to a temporary name in ``path``'s folder, then renamed: ``path`` is whole or absent.

    The file is Python's (not torch's own writer): a failure is an ``OSError`` with its errno.
    """
    folder, name = os.path.split(path)
    temporary = os.path.join(folder, f".{name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(temporary, "wb") as fh:
            write(fh)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def _write_manifest(run_dir: str, run_id: str, every: int) -> None:
    """Create ``run_dir`` and its manifest where it is missing (raises ``OSError``)."""
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, MANIFEST)
    if os.path.isfile(path):
        return
    now = time.time()
    manifest = {
        "format": FORMAT,
        "run_id": run_id,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)),
        "created_unix": now,
        "record_every": every,
    }
    text = (json.dumps(manifest, indent=1) + "\n").encode()
    _write_atomically(path, lambda fh: fh.write(text))


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
        out[key] = value.to("cpu", torch.int8) if key in _INT8_FIELDS else value.to("cpu", torch.float32)
    return out
