"""``--from <record_dir>``: one run's records, verified, each sequence once (``nemo-rs calibrate``, ``simulate``).

The layout is :mod:`nemo_rs_plugin.nemo_rl.record_format`'s. A folder holds runs (one subfolder
each, with its manifest) and maybe format-1 records (written before runs had folders, directly
in the folder: read as the run ``legacy``, unverified, with a note). :func:`read_records` reads
one run, the newest unless ``run`` names another, and never mixes runs:

* every record is checked against its digest (and its name against the run, step, rank and
  microbatch it says it holds): a corrupted, truncated or foreign record is an error naming it,
  or, with ``skip_bad``, left out and counted;
* records of one step with the same content (the copies of one microbatch that several ranks
  wrote, e.g. the tensor-parallel ranks of the DTensor backend) are read once.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from nemo_rs_plugin.nemo_rl.record_format import (
    FORMAT,
    MANIFEST,
    META,
    RECORDED_FIELDS,
    fields_digest,
    parse_record_name,
)
from nemo_rs_plugin.tools.torch_batch import BatchFormatError, read_torch, torch_batch

__all__ = ["LEGACY", "RecordsRead", "read_records"]

#: The name of the format-1 records found directly in a folder (``--run legacy``).
LEGACY = "legacy"


@dataclass
class _Run:
    name: str
    folder: Path
    created: float  # the manifest's time, else the newest record's modification time
    records: list[tuple[int, int, int, Path]]  # (step, rank, microbatch, file), sorted
    legacy: bool = False


@dataclass
class RecordsRead:
    """What :func:`read_records` read: the run, its steps, and what it left out (for the command's lines)."""

    folder: Path
    run: str
    runs: list[str]  # every run with records in the folder, newest first
    steps: list[int]  # the steps read
    recorded_steps: int  # the steps the run holds
    records: int = 0  # records read (a rank copy counted once)
    copies: int = 0  # records left out as identical copies of another rank's
    skipped: list[str] = field(default_factory=list)  # bad records left out, each with why
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        """One line: which run, which steps, how many records."""
        others = [r for r in self.runs if r != self.run]
        span = f"step {self.steps[0]}" if len(self.steps) == 1 else f"steps {self.steps[0]}-{self.steps[-1]}"
        line = (
            f"{self.folder}: run {self.run}, {len(self.steps)} of its {self.recorded_steps} recorded steps "
            f"({span}), {self.records} records"
        )
        if self.copies:
            line += f" ({self.copies} identical rank copies read once)"
        if others:
            line += f"; {len(others)} other run(s) here, not read: {', '.join(others)} (--run names one)"
        return line


def read_records(
    folder: Path, newest_steps: Optional[int] = None, run: Optional[str] = None, skip_bad: bool = False
) -> tuple[dict[str, torch.Tensor], RecordsRead]:
    """One run's records in ``folder`` as one batch (rows padded to the longest), and what was read.

    Args:
        folder: a ``record_dir``, or one run's folder in it.
        newest_steps: the newest N recorded steps of the run (``None``: all; fewer recorded: all, and a note).
        run: the run to read (its id, or :data:`LEGACY`); default: the newest with records.
        skip_bad: leave out bad records (counted in ``skipped``) instead of refusing.

    Raises:
        BatchFormatError: no records, an unknown ``run``, a bad record (without ``skip_bad``), or no
            good record left.
    """
    runs = _runs(folder)
    if not runs:
        raise BatchFormatError(
            f"{folder}: a folder without records (stepNNNNNN-dpRRR-mbMMM.pt); record them with the loss's "
            "record_logprobs: true (record_dir names the folder), or name a JSONL or torch file"
        )
    names = [r.name for r in runs]
    if run is None:
        chosen = runs[0]
    else:
        found = [r for r in runs if r.name == run]
        if not found:
            raise BatchFormatError(f"--run {run}: no such run with records in {folder}; runs here: {', '.join(names)}")
        chosen = found[0]
    steps = sorted({step for step, _, _, _ in chosen.records})
    info = RecordsRead(folder, chosen.name, names, steps, len(steps))
    if chosen.legacy:
        info.notes.append(
            f"{folder}: records in the format before runs had their own folders (no run id, no checksum): "
            "read unverified, and runs that shared this folder cannot be told apart; records written by "
            "this version go to a folder per run"
        )
    if newest_steps is not None:
        if newest_steps > len(steps):
            info.notes.append(
                f"--steps {newest_steps}: run {chosen.name} has only {len(steps)} recorded step(s); reading "
                f"those {len(steps)}"
            )
        steps = steps[-newest_steps:]
        info.steps = steps
    parts: list[dict[str, torch.Tensor]] = []
    seen: set[tuple[int, str]] = set()
    for step, rank, microbatch, path in chosen.records:
        if step not in steps:
            continue
        try:
            raw = read_torch(path)
            digest = _verified_digest(path, raw, chosen, (step, rank, microbatch))
            if (step, digest) in seen:  # another rank's copy of a microbatch already read
                info.copies += 1
                continue
            part = torch_batch(path, raw, weighted_samples=True)
        except BatchFormatError as exc:
            if not skip_bad:
                raise BatchFormatError(
                    f"{exc}; the record is refused (calibrating with it would move the band): delete it, or "
                    "pass --skip-bad-records to read the others"
                ) from None
            info.skipped.append(str(exc))
            continue
        seen.add((step, digest))
        parts.append(part)
    info.records = len(parts)
    if not parts:
        raise BatchFormatError(f"{folder}: run {chosen.name}: no readable record ({len(info.skipped)} bad)")
    width = max(part["prev_logprobs"].shape[1] for part in parts)
    batch = {key: torch.cat([_padded(part[key], width) for part in parts]) for key in RECORDED_FIELDS}
    return batch, info


def _verified_digest(path: Path, raw: dict, run: _Run, where: tuple[int, int, int]) -> str:
    """The record's digest, checked against its tensors and its name (format 1: computed, unchecked).

    A record directly in the folder that carries a digest (a run's folder without its manifest)
    has its digest checked too.
    """
    meta = raw.get(META)
    if run.legacy:
        digest = fields_digest(raw)
        if isinstance(meta, dict) and meta.get("sha256", digest) != digest:
            raise BatchFormatError(
                f"{path}: checksum mismatch (its tensors are not the bytes the loss wrote: the file is corrupted)"
            )
        return digest
    if not isinstance(meta, dict) or "sha256" not in meta:
        raise BatchFormatError(f"{path}: no checksum ({META!r} is missing): not a record of this run as written")
    digest = fields_digest(raw)
    if digest != meta["sha256"]:
        raise BatchFormatError(
            f"{path}: checksum mismatch (its tensors are not the bytes the loss wrote: the file is corrupted)"
        )
    said = (meta.get("step"), meta.get("rank"), meta.get("microbatch"))
    if meta.get("run_id") != run.name or said != where:
        raise BatchFormatError(
            f"{path}: holds step {said[0]}, rank {said[1]}, microbatch {said[2]} of run {meta.get('run_id')}, "
            f"not what its name and folder say (run {run.name}): a file copied or renamed"
        )
    return digest


def _records_in(folder: Path) -> list[tuple[int, int, int, Path]]:
    found = []
    for entry in folder.iterdir():
        parsed = parse_record_name(entry.name)
        if parsed is not None and entry.is_file():
            found.append((*parsed, entry))
    return sorted(found)


def _manifest(folder: Path) -> Optional[dict[str, Any]]:
    try:
        with open(folder / MANIFEST) as fh:
            manifest = json.load(fh)
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


def _created(folder: Path, manifest: Optional[dict], records: list) -> float:
    when = manifest.get("created_unix") if manifest else None
    if isinstance(when, (int, float)):
        return float(when)
    return max((os.path.getmtime(path) for *_, path in records), default=os.path.getmtime(folder))


def _runs(folder: Path) -> list[_Run]:
    """The runs with records in ``folder``, newest first (``folder`` itself, when it is one run's)."""
    manifest = _manifest(folder)
    if manifest is not None and manifest.get("format", FORMAT) >= 2:  # a run's own folder
        records = _records_in(folder)
        name = str(manifest.get("run_id", folder.name))
        return [_Run(name, folder, _created(folder, manifest, records), records)] if records else []
    runs = []
    for sub in folder.iterdir():
        if sub.is_dir():
            records = _records_in(sub)
            if records:
                sub_manifest = _manifest(sub)
                runs.append(_Run(sub.name, sub, _created(sub, sub_manifest, records), records))
    legacy = _records_in(folder)
    if legacy:
        runs.append(_Run(LEGACY, folder, _created(folder, None, legacy), legacy, legacy=True))
    return sorted(runs, key=lambda r: (r.created, r.name), reverse=True)


def _padded(t: torch.Tensor, width: int) -> torch.Tensor:
    """A ``[B, S]`` tensor padded with zeros to ``width`` columns (``[B]`` as it is)."""
    return torch.nn.functional.pad(t, (0, width - t.shape[1])) if t.dim() == 2 else t
