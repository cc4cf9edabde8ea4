"""``nemo-rs simulate --from``: per-token log-probs saved from a real run, as a batch.

Two formats, both read into the layout of :func:`~nemo_rs_plugin.tools.simulate.synthetic_batch`
(NeMo-RL's ``[B, S]`` tensors, position 0 a dummy position): JSONL (one sequence per line)
and a torch file in NeMo-RL's ``train_data`` layout. Every malformed input is one
:class:`BatchFormatError` line naming the file, the record and the field.
"""

from __future__ import annotations

import difflib
import json
import math
import re
import warnings
from pathlib import Path
from typing import Any, Optional

import torch

from nemo_rs_plugin.core.input_checks import POSITIVE_LOGPROB_SLACK

__all__ = ["BatchFormatError", "TORCH_SUFFIXES", "check_values", "load_batch", "read_torch", "torch_batch"]


class BatchFormatError(ValueError):
    """A malformed ``--from`` file; the message names the record and the field."""


_REQUIRED = ("prev_logprobs", "generation_logprobs")
_JSONL_FIELDS = ("prev_logprobs", "generation_logprobs", "token_mask", "advantage")
TORCH_SUFFIXES = (".pt", ".pth", ".torch")
# The fields a torch file's dict is read for (NeMo-RL's train_data names).
_TORCH_FIELDS = ("prev_logprobs", "generation_logprobs", "token_mask", "advantages", "sample_mask")


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
    for key in _REQUIRED:
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


def _real_tensor(p: Path, raw: dict, key: str, shapes: tuple[tuple[int, ...], ...]) -> torch.Tensor:
    t = raw[key]
    if not isinstance(t, torch.Tensor):
        raise BatchFormatError(f"{p}: field {key!r} must be a tensor, got {type(t).__name__}")
    if t.is_complex() or (t.dtype == torch.bool and key not in ("token_mask", "sample_mask")):
        raise BatchFormatError(f"{p}: field {key!r} must hold real numbers, got dtype {t.dtype}")
    if tuple(t.shape) not in shapes:
        expected = " or ".join(str(list(s)) for s in shapes)
        raise BatchFormatError(f"{p}: field {key!r} has shape {list(t.shape)}, expected {expected}")
    return t


def _zero_one(p: Path, key: str, t: torch.Tensor) -> torch.Tensor:
    t = t.float()
    if not bool(((t == 0) | (t == 1)).all()):
        raise BatchFormatError(f"{p}: field {key!r} must hold 0 or 1 only")
    return t


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_SAVE_HINT = "save a dict of torch tensors: torch.save({k: torch.as_tensor(v) for k, v in batch.items()}, path)"


def _not_torch(p: Path) -> str:
    """What a file that is not a torch file is, from its first bytes, or "" when it may be one."""
    with open(p, "rb") as fh:
        head = fh.read(512)
    if head.startswith(b"PK\x03\x04") or head.startswith(b"\x80"):  # torch's zip format, a pickle
        return ""
    if head.startswith(b"\x93NUMPY"):
        return f"a NumPy .npy file, not a torch file; {_SAVE_HINT}"
    try:
        head.decode("utf-8")
        text = bool(head) and all(ch.isprintable() or ch in "\t\r\n" for ch in head.decode("utf-8"))
    except UnicodeDecodeError:
        text = False
    if text:
        return (
            "a text file, not a torch file (torch's files are binary); a JSONL batch needs a suffix other "
            f"than {', '.join(TORCH_SUFFIXES)}"
        )
    return f"not a torch file (neither torch's zip format nor a pickle); {_SAVE_HINT}"


def _load_torch(p: Path) -> dict[str, torch.Tensor]:
    return torch_batch(p, read_torch(p))


def read_torch(p: Path) -> dict:
    """A torch file's dict as saved (``torch.load(weights_only=True)``), or one :class:`BatchFormatError` line."""
    what = _not_torch(p)
    if what:
        raise BatchFormatError(f"{p}: {what}")
    try:
        with warnings.catch_warnings():  # e.g. torch's note on the pickle protocol: the error says it all
            warnings.simplefilter("ignore")
            raw = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is a format error
        message = _ANSI.sub("", str(exc))
        with open(p, "rb") as fh:
            names_numpy = b"numpy" in fh.read(1 << 16)  # a pickle names the modules of its classes
        if names_numpy or "numpy" in message.lower():
            raise BatchFormatError(
                f"{p}: holds NumPy arrays, which torch.load(weights_only=True) refuses; {_SAVE_HINT}"
            ) from None
        if "weights only load failed" in message.lower() or "weights_only" in message:
            raise BatchFormatError(
                f"{p}: holds Python objects other than tensors, which torch.load(weights_only=True) "
                f"refuses; {_SAVE_HINT}"
            ) from None
        first = message.strip().splitlines()[0] if message.strip() else type(exc).__name__
        raise BatchFormatError(f"{p}: not a readable torch file ({first})") from None
    if not isinstance(raw, dict):
        raise BatchFormatError(f"{p}: expected a dict of tensors, got {type(raw).__name__}")
    return raw


def torch_batch(p: Path, raw: dict, weighted_samples: bool = False) -> dict[str, torch.Tensor]:
    """A torch file's dict (:func:`read_torch`) validated into the batch layout (see :func:`load_batch`).

    ``weighted_samples``: ``sample_mask`` may hold any finite weight >= 0, kept as it is (the loss's
    records: NeMo-RL's ``sample_mask`` is a per-sequence weight); else 0/1 only.
    """
    for key in raw:  # other keys are ignored (train_data holds many), but not a misspelt one we read
        close = difflib.get_close_matches(str(key), _TORCH_FIELDS, n=1, cutoff=0.85)
        if close and key not in _TORCH_FIELDS:
            raise BatchFormatError(f"{p}: field {key!r} is not read; did you mean {close[0]!r}?")
    for key in _REQUIRED:
        if key not in raw:
            raise BatchFormatError(f"{p}: field {key!r} is missing")
        if not isinstance(raw[key], torch.Tensor) or raw[key].dim() != 2:
            shape = list(raw[key].shape) if isinstance(raw[key], torch.Tensor) else type(raw[key]).__name__
            raise BatchFormatError(f"{p}: field {key!r} must be a [B, S] tensor, got {shape}")
    B, S = raw["prev_logprobs"].shape
    if B == 0:
        raise BatchFormatError(f"{p}: field 'prev_logprobs' holds no sequence (B = 0)")
    if S < 2:
        raise BatchFormatError(
            f"{p}: field 'prev_logprobs' has S = {S}; position 0 is dropped as in NeMo-RL's "
            "loss, so S must be at least 2"
        )
    out = {}
    for key in _REQUIRED:
        t = _real_tensor(p, raw, key, ((B, S),))
        if not t.is_floating_point():
            raise BatchFormatError(f"{p}: field {key!r} must hold floating-point log-probs, got dtype {t.dtype}")
        out[key] = t.float()
    mask = _real_tensor(p, raw, "token_mask", ((B, S),)) if "token_mask" in raw else torch.ones(B, S)
    out["token_mask"] = _zero_one(p, "token_mask", mask).long()
    if "advantages" in raw:
        adv = _real_tensor(p, raw, "advantages", ((B,), (B, 1), (B, S))).float()
    else:
        adv = torch.ones(B)
    out["advantages"] = (adv.reshape(B, 1).expand(B, S) if adv.numel() == B else adv).contiguous()
    sample = _real_tensor(p, raw, "sample_mask", ((B,),)) if "sample_mask" in raw else torch.ones(B)
    if not weighted_samples:
        out["sample_mask"] = _zero_one(p, "sample_mask", sample)
    elif bool((torch.isfinite(sample.float()) & (sample.float() >= 0)).all()):
        out["sample_mask"] = sample.float()  # a weight: a fractional value is kept
    else:
        raise BatchFormatError(f"{p}: field 'sample_mask' must hold finite numbers >= 0 (0/1, or a weight)")
    return out


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
    for key in _REQUIRED + ("token_mask",):
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
