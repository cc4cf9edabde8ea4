"""What a record is: the layout the loss writes (``recording.py``) and ``nemo-rs calibrate`` reads.

Standard library and torch only (``tools/records.py`` reads it without NeMo-RL)::

    <record_dir>/<run id>/manifest.json                # the run: its id, when it started, record_every
    <record_dir>/<run id>/step000010-dp003-mb002.pt    # step 10 of that run, rank 3, its 3rd microbatch

* **A run** is one construction of the loss (one NeMo-RL job launch: the driver builds the
  loss once and sends it to its workers, which share its id). A resumed or retried job is a
  new run: its records go under its own id, so nothing of another run is overwritten, and
  its steps count from its own start.
* **A record** holds the :data:`RECORDED_FIELDS` tensors and, under :data:`META`, the run id,
  step, rank, microbatch and :func:`fields_digest` of the tensors as written: the reader
  recomputes it, so a record whose bytes changed is refused by name.
* **Format 1** (before run folders): the records directly in ``record_dir``, no manifest and
  no digest; still read, with a note.
"""

from __future__ import annotations

import hashlib
import re
import secrets
import time
from typing import Mapping, Optional

import torch

__all__ = [
    "FORMAT",
    "MANIFEST",
    "META",
    "RECORDED_FIELDS",
    "fields_digest",
    "new_run_id",
    "parse_record_name",
    "record_name",
]

#: The layout this version writes (1: records directly in record_dir, no manifest, no digest).
FORMAT = 2
#: The run's manifest, in its folder: ``{"format", "run_id", "created", "created_unix", "record_every"}``.
MANIFEST = "manifest.json"
#: The key of a record's own description (run id, step, rank, microbatch, digest).
META = "nemo_rs_record"
#: What a record holds, NeMo-RL's ``train_data`` names (what ``--from`` reads from a torch file).
RECORDED_FIELDS = ("prev_logprobs", "generation_logprobs", "token_mask", "advantages", "sample_mask")

_RECORD = re.compile(r"^step(\d+)-dp(\d+)-mb(\d+)\.pt$")


def record_name(step: int, rank: int, microbatch: int) -> str:
    """The file of one recorded microbatch (sorts by step, then rank, then microbatch)."""
    return f"step{step:06d}-dp{rank:03d}-mb{microbatch:03d}.pt"


def parse_record_name(name: str) -> Optional[tuple[int, int, int]]:
    """``(step, rank, microbatch)`` of a record's file name, or ``None`` for any other name."""
    m = _RECORD.match(name)
    return (int(m.group(1)), int(m.group(2)), int(m.group(3))) if m else None


def new_run_id() -> str:
    """A run id: its UTC start time (sorts by age) and 6 random hex digits (two launches in one second)."""
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + secrets.token_hex(3)


def fields_digest(fields: Mapping[str, object]) -> str:
    """SHA-256 over the recorded tensors (name, dtype, shape, bytes), in :data:`RECORDED_FIELDS` order."""
    h = hashlib.sha256()
    for key in RECORDED_FIELDS:
        value = fields.get(key)
        if not isinstance(value, torch.Tensor):
            continue
        value = value.detach().to("cpu").contiguous()
        h.update(f"{key}:{value.dtype}:{tuple(value.shape)};".encode())
        h.update(value.reshape(-1).view(torch.uint8).numpy().data)  # the buffer itself, no copy
    return h.hexdigest()
