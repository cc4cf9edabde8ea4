"""A torch file of per-token log-probs (NeMo-RL's ``train_data`` layout) read into the batch layout.

The lowest layer of ``--from``: :mod:`nemo_rs_plugin.tools.batch_formats` (JSONL and torch files)
and :mod:`nemo_rs_plugin.tools.records` (the loss's records folder) both read torch files here.
Every malformed file is one :class:`BatchFormatError` line naming the file and the field.
"""

from __future__ import annotations

import difflib
import re
import warnings
from pathlib import Path

import torch

__all__ = ["BatchFormatError", "REQUIRED_FIELDS", "TORCH_SUFFIXES", "read_torch", "torch_batch"]


class BatchFormatError(ValueError):
    """A malformed ``--from`` file; the message names the record and the field."""


REQUIRED_FIELDS = ("prev_logprobs", "generation_logprobs")
TORCH_SUFFIXES = (".pt", ".pth", ".torch")
# The fields a torch file's dict is read for (NeMo-RL's train_data names).
_TORCH_FIELDS = ("prev_logprobs", "generation_logprobs", "token_mask", "advantages", "sample_mask")


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
    for key in REQUIRED_FIELDS:
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
    for key in REQUIRED_FIELDS:
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
