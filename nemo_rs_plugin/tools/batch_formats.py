"""``nemo-rs simulate --from``: per-token log-probs saved from a real run, as a batch.

Two formats, both read into the layout of :func:`~nemo_rs_plugin.tools.simulate.synthetic_batch`
(NeMo-RL's ``[B, S]`` tensors, position 0 a dummy position): JSONL (one sequence per line)
and a torch file in NeMo-RL's ``train_data`` layout. Every malformed input is one
:class:`BatchFormatError` line naming the file, the record and the field.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Optional

import torch

from nemo_rs_plugin.core.batch.input_checks import POSITIVE_LOGPROB_SLACK
from nemo_rs_plugin.tools.torch_batch import (
    REQUIRED_FIELDS,
    TORCH_SUFFIXES,
    BatchFormatError,
    read_torch,
    torch_batch,
)

__all__ = ["BatchFormatError", "TORCH_SUFFIXES", "check_values", "load_batch", "read_torch", "torch_batch"]

_JSONL_FIELDS = ("prev_logprobs", "generation_logprobs", "token_mask", "advantage")


def load_batch(path: str, newest_steps: Optional[int] = None) -> dict[str, torch.Tensor]:
    """:func:`load_with_records`'s batch (a folder: its newest run, every record verified)."""
    return load_with_records(path, newest_steps)[0]


def load_with_records(
    path: str, newest_steps: Optional[int] = None, run: Optional[str] = None, skip_bad: bool = False
) -> tuple[dict[str, torch.Tensor], Any]:
    """Per-token log-probs saved from a real run: JSONL (one sequence per line), torch, or a records folder.

    JSONL (any suffix but ``.pt``/``.pth``/``.torch``), one JSON object per line, blank lines
    skipped::

        {"prev_logprobs": [...], "generation_logprobs": [...], "token_mask": [...], "advantage": 0.5}

    Each list holds one entry per response token, in order, and every entry is used (no
    leading position is dropped); the three lists of a record have equal lengths (records
    may differ). ``token_mask`` (0/1, default all 1) and ``advantage`` (a finite number,
    default 1) are optional; ``null`` in a log-prob list marks a non-finite value. Other
    fields are an error (a misspelt ``advantages`` would otherwise be ignored).

    Torch file (``.pt``/``.pth``/``.torch``): a dict of tensors in NeMo-RL's ``train_data``
    layout: ``prev_logprobs`` and ``generation_logprobs`` ``[B, S]`` (real dtype),
    optional ``token_mask`` ``[B, S]`` (0/1), ``advantages`` ``[B]``, ``[B, 1]`` or
    ``[B, S]``, ``sample_mask`` ``[B]`` (0/1; in the loss's records a weight >= 0, kept as it
    is); other keys are ignored. As in NeMo-RL's loss, position 0 is dropped (its log-prob
    belongs to no predicted token), so ``S >= 2``.

    A folder: the records the loss writes with ``record_logprobs: true`` (``record_dir``, or one
    run's folder in it): one run's (the newest), of its ``newest_steps`` newest recorded steps
    (``None``: every step), every rank and microbatch, each verified against its digest and read
    once however many ranks wrote a copy, in one batch (rows padded to the longest,
    ``token_mask`` 0 there): :func:`nemo_rs_plugin.tools.records.read_records`, which also says
    which run it read.

    Returns a batch in the layout of :func:`~nemo_rs_plugin.tools.simulate.synthetic_batch`
    (position 0 a dummy position), and for a folder what was read
    (:class:`~nemo_rs_plugin.tools.records.RecordsRead`; ``None`` for a file).

    Raises:
        BatchFormatError: one line naming the file, the record (line) and the field.
    """
    p = Path(path)
    read: Any = None
    lines: Optional[list[int]] = None
    if p.is_dir():
        from nemo_rs_plugin.tools.records import read_records

        batch, read = read_records(p, newest_steps, run, skip_bad)
        p = p / "*"
    elif not p.is_file():
        raise BatchFormatError(f"{path}: no such file")
    elif p.suffix in TORCH_SUFFIXES:
        batch = _load_torch(p)
    else:
        batch, lines = _load_jsonl(p)
    valid = batch["token_mask"][:, 1:] * batch["sample_mask"][:, None]
    if not bool((valid != 0).any()):
        raise BatchFormatError(f"{p}: no valid token in any sequence (every one is empty or masked)")
    check_values(p, batch, valid != 0, lines)
    return batch, read


def check_values(p: Path, batch: dict, valid: torch.Tensor, lines: Optional[list[int]]) -> None:
    """Values on valid tokens that would make the simulation meaningless: one line, the first found.

    A log-prob field with no finite value (all null or NaN) gives NaN results; a positive
    log-prob is no log-prob (probabilities, or a sign flipped) and gives weights like e^T; a
    non-finite advantage is refused, as in JSONL. ``lines``: the JSONL line of each sequence
    (None for a torch file).
    """

    def at(key: str, i: int, t: int, value: float) -> str:
        if lines is not None:
            return f"{p}:{lines[i]}: field {key!r} value {t} is {value:.6g}"
        return f"{p}: field {key!r} is {value:.6g} at sequence {i}, token {t + 1}"

    finite_both = torch.ones_like(valid)
    for key in REQUIRED_FIELDS:
        values = batch[key][:, 1:]
        finite = torch.isfinite(values) & valid
        finite_both &= finite
        if not bool(finite.any()):
            raise BatchFormatError(
                f"{p}: field {key!r} has no finite value on any valid token (every one is null, NaN or "
                "infinite); nothing to simulate"
            )
        positive = finite & (values > POSITIVE_LOGPROB_SLACK)
        if bool(positive.any()):
            i, t = (int(x) for x in positive.nonzero()[0])
            raise BatchFormatError(
                f"{at(key, i, t, values[i, t].item())}; log-probs are <= 0 (field {key!r} is positive there: "
                "were probabilities or negated log-probs saved?)"
            )
    if not bool(finite_both.any()):
        raise BatchFormatError(
            f"{p}: no valid token has both prev_logprobs and generation_logprobs finite; nothing to simulate"
        )
    bad = valid & ~torch.isfinite(batch["advantages"][:, 1:])
    if bool(bad.any()):
        i, t = (int(x) for x in bad.nonzero()[0])
        value = batch["advantages"][i, t + 1].item()
        raise BatchFormatError(f"{p}: field 'advantages' is {value} at sequence {i}; expected a finite number")


def _load_torch(p: Path) -> dict[str, torch.Tensor]:
    return torch_batch(p, read_torch(p))


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


class _RepeatedKey(ValueError):
    """A JSON object that gives one key twice (``json.loads`` would keep the last silently)."""


def _unique_keys(pairs: list) -> dict:
    """``object_pairs_hook`` for :func:`json.loads`: refuse a key given twice."""
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise _RepeatedKey(key)
        out[key] = value
    return out


def _jsonl_record(p: Path, lineno: int, line: str) -> tuple[dict, int, float]:
    """One validated JSONL record: ``(record, number of tokens, advantage)``."""
    where = f"{p}:{lineno}"
    try:
        rec = json.loads(line, object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as exc:
        raise BatchFormatError(f"{where}: record is not valid JSON ({exc.msg})") from None
    except _RepeatedKey as exc:
        raise BatchFormatError(
            f"{where}: field {exc.args[0]!r} is given twice (JSON would keep only the last); keep one"
        ) from None
    if not isinstance(rec, dict):
        raise BatchFormatError(f"{where}: record must be a JSON object")
    unknown = [k for k in rec if k not in _JSONL_FIELDS]
    if unknown:
        raise BatchFormatError(f"{where}: field {unknown[0]!r} is unknown (fields: {', '.join(_JSONL_FIELDS)})")
    n = None
    for key in REQUIRED_FIELDS + ("token_mask",):
        if key not in rec:
            if key == "token_mask":
                continue
            raise BatchFormatError(f"{where}: field {key!r} is missing")
        value = rec[key]
        if not isinstance(value, list):
            raise BatchFormatError(f"{where}: field {key!r} must be a list of numbers")
        for j, v in enumerate(value):
            if key == "token_mask" and not (_is_number(v) and v in (0, 1)):
                raise BatchFormatError(f"{where}: field 'token_mask' value {j} is {json.dumps(v)}; expected 0 or 1")
            if key != "token_mask" and not (v is None or _is_number(v)):
                raise BatchFormatError(
                    f"{where}: field {key!r} value {j} is {json.dumps(v)}; expected a number or null"
                )
        if n is None:
            n = len(value)
        elif len(value) != n:
            raise BatchFormatError(f"{where}: field {key!r} has {len(value)} values, expected {n}")
    adv = rec.get("advantage", 1.0)
    if not _is_number(adv) or not math.isfinite(adv):
        raise BatchFormatError(f"{where}: field 'advantage' is {json.dumps(adv)}; expected a finite number")
    return rec, n or 0, float(adv)


def _load_jsonl(p: Path) -> tuple[dict[str, torch.Tensor], list[int]]:
    """The batch, and each sequence's line number."""
    records, lines = [], []
    try:
        with open(p, encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if line.strip():
                    records.append(_jsonl_record(p, lineno, line))
                    lines.append(lineno)
    except UnicodeDecodeError:
        raise BatchFormatError(
            f"{p}: not a UTF-8 JSONL file (a torch file needs the suffix {', '.join(TORCH_SUFFIXES)})"
        ) from None
    if not records:
        raise BatchFormatError(f"{p}: no records")
    # Position 0 is a dummy (NeMo-RL's layout, dropped by the loss): every listed token counts.
    B, S = len(records), 1 + max(n for _, n, _ in records)

    def column(key: str) -> torch.Tensor:
        out = torch.zeros(B, S)
        for i, (rec, n, _) in enumerate(records):
            if n:
                out[i, 1 : n + 1] = torch.tensor([float("nan") if v is None else float(v) for v in rec[key]])
        return out

    mask = torch.zeros(B, S, dtype=torch.long)
    for i, (rec, n, _) in enumerate(records):
        if n:
            mask[i, 1 : n + 1] = torch.tensor(rec["token_mask"], dtype=torch.long) if "token_mask" in rec else 1
    adv = torch.tensor([a for _, _, a in records]).reshape(B, 1).expand(B, S).contiguous()
    batch = {
        "prev_logprobs": column("prev_logprobs"),
        "generation_logprobs": column("generation_logprobs"),
        "token_mask": mask,
        "sample_mask": torch.ones(B),
        "advantages": adv,
    }
    return batch, lines
