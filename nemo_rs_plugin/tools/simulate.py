"""Training/inference mismatch simulator: run correction configs through the real loss.

A synthetic batch models what a practitioner sees on MoE long-sequence GRPO:

* per-token log-prob noise ``d_t = prev_t - gen_t ~ N(-s^2/2, s^2)`` (``--mismatch s``; the
  ``-s^2/2`` makes ``E[exp(d)] = 1``, as for a true likelihood ratio);
* response lengths uniform in ``[length/2, length]``;
* rare MoE-routing outlier tokens (``--outlier-rate``) with ``|d|`` of several nats;
* staleness: a per-sequence shift of ``d`` of scale ``--staleness`` (async / off-policy).

Or real per-token log-probs (:func:`load_batch`, ``--from``). For every configuration the
real :class:`~nemo_rs_plugin.core.loss.CorrectedPGLoss` runs forward and backward; the report has
the IS weight mean / std / min, effective sample size, fraction of sequences and tokens
rejected, and the gradient norm relative to the uncorrected loss.

The default is NeMo-RL PR #2269's situation, ~9k-token responses at ~2% per-token mismatch;
README.md states what it shows, for which seeds (tests/tools/test_cli_docs.py reruns those commands).
"""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from nemo_rs_plugin.core import presets
from nemo_rs_plugin.core.loss import CorrectedPGLoss
from nemo_rs_plugin.core.masking import log_ratio

__all__ = [
    "MismatchModel",
    "DEFAULT_CONFIGS",
    "synthetic_batch",
    "load_batch",
    "run",
    "BatchFormatError",
    "format_table",
    "write_csv",
    "write_json",
    "write_plot",
    "plot_figure",
]

_NO_KL = {"reference_policy_kl_penalty": 0.0}
DEFAULT_CONFIGS: dict[str, dict] = {
    "uncorrected": dict(_NO_KL),
    "token": {**_NO_KL, **presets.is_level("token")},
    "token+tis2": {**_NO_KL, **presets.tis("token")},
    "sequence": {**_NO_KL, **presets.is_level("sequence")},
    "sequence+tis2": {**_NO_KL, **presets.tis("sequence")},
    "sequence_mean": {**_NO_KL, **presets.is_level("sequence_mean")},
    "seqmean+geo-rs+veto": {
        **_NO_KL,
        **presets.is_level("sequence_mean"),
        "rejection_sampling": [presets.GEO_RS, presets.OUTLIER_VETO],
    },
    "geo-rs+token-mis": {
        **_NO_KL,
        **presets.is_level("token"),
        "rejection_sampling": [presets.GEO_RS, presets.TOKEN_MIS],
    },
}


class BatchFormatError(ValueError):
    """A malformed ``--from`` file; the message names the record and the field."""


@dataclass
class MismatchModel:
    """Parameters of the synthetic mismatch (defaults: NeMo-RL PR #2269's situation)."""

    responses: int = 16
    length: int = 9000
    mismatch: float = 0.02
    outlier_rate: float = 0.0
    outlier_scale: float = 4.0
    staleness: float = 0.0
    seed: int = 0


def synthetic_batch(m: MismatchModel, step: int = 0) -> dict[str, torch.Tensor]:
    """A NeMo-RL-shaped batch (``[B, S]`` tensors, position 0 a dummy prompt token)."""
    g = torch.Generator().manual_seed(m.seed * 100003 + step)
    B, S = m.responses, m.length + 1
    lengths = torch.randint(max(1, m.length // 2), m.length + 1, (B,), generator=g)
    token_mask = (torch.arange(S).unsqueeze(0) >= 1) & (torch.arange(S).unsqueeze(0) <= lengths.unsqueeze(1))
    d = m.mismatch * torch.randn(B, S, generator=g) - m.mismatch**2 / 2
    if m.outlier_rate > 0:
        outliers = torch.rand(B, S, generator=g) < m.outlier_rate
        d = torch.where(outliers, m.outlier_scale * torch.randn(B, S, generator=g), d)
    if m.staleness > 0:
        d = d + m.staleness * torch.randn(B, 1, generator=g)
    prev = -torch.rand(B, S, generator=g) * 2 - 0.05
    mask = token_mask.long()
    return {
        "prev_logprobs": prev * mask,
        "generation_logprobs": (prev - d) * mask,
        "token_mask": mask,
        "sample_mask": torch.ones(B),
        "advantages": torch.randn(B, 1, generator=g).expand(B, S).contiguous(),
    }


_REQUIRED = ("prev_logprobs", "generation_logprobs")
_JSONL_FIELDS = ("prev_logprobs", "generation_logprobs", "token_mask", "advantage")
TORCH_SUFFIXES = (".pt", ".pth", ".torch")


def load_batch(path: str) -> dict[str, torch.Tensor]:
    """Per-token log-probs saved from a real run: JSONL (one sequence per line) or torch.

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
    ``[B, S]``, ``sample_mask`` ``[B]`` (0/1); other keys are ignored. As in NeMo-RL's
    loss, position 0 is dropped (its log-prob belongs to no predicted token), so ``S >= 2``.

    Returns a batch in the layout of :func:`synthetic_batch` (position 0 a dummy position).

    Raises:
        BatchFormatError: one line naming the file, the record (line) and the field.
    """
    p = Path(path)
    if not p.is_file():
        raise BatchFormatError(f"{path}: no such file")
    if p.suffix in TORCH_SUFFIXES:
        batch = _load_torch(p)
    else:
        batch = _load_jsonl(p)
    valid = batch["token_mask"][:, 1:] * batch["sample_mask"][:, None]
    if not bool((valid != 0).any()):
        raise BatchFormatError(f"{p}: no valid token in any sequence (every one is empty or masked)")
    return batch


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


def _load_torch(p: Path) -> dict[str, torch.Tensor]:
    try:
        raw = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is a format error
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise BatchFormatError(f"{p}: not a readable torch file ({first})") from None
    if not isinstance(raw, dict):
        raise BatchFormatError(f"{p}: expected a dict of tensors, got {type(raw).__name__}")
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
    out = {k: _real_tensor(p, raw, k, ((B, S),)).float() for k in _REQUIRED}
    mask = _real_tensor(p, raw, "token_mask", ((B, S),)) if "token_mask" in raw else torch.ones(B, S)
    out["token_mask"] = _zero_one(p, "token_mask", mask).long()
    if "advantages" in raw:
        adv = _real_tensor(p, raw, "advantages", ((B,), (B, 1), (B, S))).float()
    else:
        adv = torch.ones(B)
    out["advantages"] = (adv.reshape(B, 1).expand(B, S) if adv.numel() == B else adv).contiguous()
    sample = _real_tensor(p, raw, "sample_mask", ((B,),)) if "sample_mask" in raw else torch.ones(B)
    out["sample_mask"] = _zero_one(p, "sample_mask", sample)
    return out


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _jsonl_record(p: Path, lineno: int, line: str) -> tuple[dict, int, float]:
    """One validated JSONL record: ``(record, number of tokens, advantage)``."""
    where = f"{p}:{lineno}"
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as exc:
        raise BatchFormatError(f"{where}: record is not valid JSON ({exc.msg})") from None
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


def _load_jsonl(p: Path) -> dict[str, torch.Tensor]:
    records = []
    try:
        with open(p, encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if line.strip():
                    records.append(_jsonl_record(p, lineno, line))
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
    return {
        "prev_logprobs": column("prev_logprobs"),
        "generation_logprobs": column("generation_logprobs"),
        "token_mask": mask,
        "sample_mask": torch.ones(B),
        "advantages": adv,
    }


def _metrics_of(cfg: dict, batch: dict[str, torch.Tensor]) -> tuple[dict, torch.Tensor]:
    B, S = batch["prev_logprobs"].shape
    data = dict(batch)
    data.setdefault("input_ids", torch.zeros(B, S, dtype=torch.long))
    data.setdefault("reference_policy_logprobs", batch["prev_logprobs"])
    valid = batch["token_mask"][:, 1:].float() * batch["sample_mask"][:, None]
    # On-policy snapshot: the current policy equals prev, so the PPO ratio is 1 and the
    # gradient is the advantage-weighted score, scaled by what the correction applies.
    lp = torch.nan_to_num(batch["prev_logprobs"][:, 1:].clone()).requires_grad_(True)
    loss, metrics = CorrectedPGLoss(cfg)(lp, data, batch["sample_mask"].sum(), valid.sum())
    loss.backward()
    return metrics, lp.grad.norm()


def _applied_weights(cfg: dict, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per-unit IS weights the loss applies, from the loss's own correction function.

    Computed in the batch's dtype (float32), as the loss computes them: a weight whose
    ``exp`` overflows float32 is 0 there (:func:`~nemo_rs_plugin.core.masking.finite_exp`), so it
    is 0 here too. Returned as float64 for the statistics (``w**2`` of a large float32
    weight must not overflow).
    """
    from nemo_rs_plugin.core.config import RSClippedPGLossConfig
    from nemo_rs_plugin.core.correction import compute_correction
    from nemo_rs_plugin.core.masking import TokenMasks
    from nemo_rs_plugin.core.metrics import GlobalCounts

    c = RSClippedPGLossConfig.from_any(cfg)
    dtype = batch["prev_logprobs"].dtype
    _, d, d_finite = log_ratio(batch["prev_logprobs"][:, 1:], batch["generation_logprobs"][:, 1:])
    tm = batch["token_mask"][:, 1:].to(dtype)
    sm = batch["sample_mask"].to(dtype)
    valid = tm * sm[:, None]
    masks = TokenMasks.build(tm, sm, d_finite, d_finite, valid=valid)
    out = compute_correction(c, d, masks, GlobalCounts(tokens=valid.sum(), sequences=sm.sum()))
    if c.effective_is_level == "token":
        units = valid != 0
        return (out.is_weight * out.keep)[units].double()
    kept_rows = (out.keep * valid).sum(-1) > 0
    units = (sm != 0) & (valid.sum(-1) > 0)
    return (out.is_weight.squeeze(-1) * kept_rows)[units].double()


def run(
    configs: dict[str, dict],
    batches: list[dict[str, torch.Tensor]],
    progress: Optional[Callable[[int, int], None]] = None,
) -> list[dict[str, Any]]:
    """Average, over ``batches``, each configuration's statistics; one row per configuration."""
    total = len(configs) * len(batches)
    done = 0
    sums: dict[str, dict[str, float]] = {name: {} for name in configs}
    for batch in batches:
        _, base_norm = _metrics_of(DEFAULT_CONFIGS["uncorrected"], batch)
        for name, cfg in configs.items():
            m, norm = _metrics_of(cfg, batch)
            # Without IS correction the loss applies weight 1 (its metrics still report the
            # weights it would have used).
            if cfg.get("use_importance_sampling_correction", False):
                w = _applied_weights(cfg, batch)
            else:
                w = torch.ones(1, dtype=torch.float64)
            kept = w[w > 0]
            # seq-mask-tis zeroes whole sequences: reported with the rejected ones.
            seq_mask_tis = cfg.get("truncated_importance_sampling_type") == "seq-mask-tis"
            seq_masked = m.get("is_oob_ratio", 0.0) if seq_mask_tis else 0.0
            row = {
                "is_weight_mean": float(w.mean()),
                "is_weight_std": float(w.std(unbiased=False)),
                "is_weight_min": float(kept.min()) if kept.numel() else 0.0,
                "ess": float(w.sum() ** 2 / (w.numel() * (w**2).sum())) if (w**2).sum() > 0 else 0.0,
                "seq_rejected": m.get("rs_seq_rejected_frac", 0.0) + seq_masked,
                "tok_rejected": m.get("rs_token_rejected_frac", 0.0),
                "grad_norm_ratio": float(norm / base_norm) if base_norm > 0 else float("nan"),
            }
            for k, v in row.items():
                sums[name][k] = sums[name].get(k, 0.0) + v / len(batches)
            done += 1
            if progress is not None:
                progress(done, total)
    return [{"config": name, **vals} for name, vals in sums.items()]


COLUMNS = (
    "is_weight_mean",
    "is_weight_std",
    "is_weight_min",
    "ess",
    "seq_rejected",
    "tok_rejected",
    "grad_norm_ratio",
)


LEGEND = (
    "is_weight_*: IS weight the loss applies (mean over tokens for token levels, sequences "
    "otherwise; a mean below 1 shrinks the learning rate); ess: effective sample size "
    "(sum w)^2/(n sum w^2), 1 = every sample counts; *_rejected: fraction rejected; "
    "grad_norm_ratio: gradient norm / uncorrected."
)


def format_table(rows: list[dict[str, Any]]) -> str:
    """A fixed-width table of :func:`run`'s rows, with a legend."""
    head = f"{'config':<22}" + "".join(f"{c:>16}" for c in COLUMNS)
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['config']:<22}" + "".join(f"{r[c]:>16.4g}" for c in COLUMNS))
    lines.append(LEGEND)
    return "\n".join(lines)


def write_csv(rows: list[dict[str, Any]], path: str) -> None:
    """The table as CSV (non-finite values as ``nan`` / ``inf``, as Python prints them)."""
    import csv

    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=["config", *COLUMNS])
        writer.writeheader()
        writer.writerows(rows)


def _strict_json_value(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return "NaN" if math.isnan(v) else ("Infinity" if v > 0 else "-Infinity")
    return v


def write_json(rows: list[dict[str, Any]], source: str, path: str) -> None:
    """``{"source": ..., "rows": [...]}`` in strict JSON (RFC 8259 has no NaN or Infinity).

    A non-finite value is written as the string ``"NaN"``, ``"Infinity"`` or
    ``"-Infinity"``, which Python's ``float()`` and JavaScript's ``Number()`` both read back.
    """
    data = {"source": source, "rows": [{k: _strict_json_value(v) for k, v in r.items()} for r in rows]}
    with open(path, "w") as fh:
        json.dump(data, fh, indent=2, allow_nan=False)
        fh.write("\n")


def output_problems(flag: str, path: str) -> list[str]:
    """Why ``path`` cannot be written (``[]`` if it can), checked before a run."""
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        return [f"{flag} {path}: is a directory"]
    if not os.path.isdir(parent):
        return [f"{flag} {path}: directory {parent} does not exist"]
    if not os.access(parent, os.W_OK):
        return [f"{flag} {path}: directory {parent} is not writable"]
    return []


PLOT_HELP = "--plot needs matplotlib: pip install matplotlib (or: uv add matplotlib)"


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError(PLOT_HELP) from exc
    return plt


def plot_problems(path: str) -> list[str]:
    """Why ``--plot path`` cannot be drawn (matplotlib missing, format unknown), before a run."""
    try:
        plt = _pyplot()
    except ImportError:
        return [PLOT_HELP]
    suffix = os.path.splitext(path)[1].lstrip(".").lower()
    formats = sorted(plt.figure().canvas.get_supported_filetypes())
    plt.close("all")
    if not suffix:
        return [f"--plot {path}: no suffix; name the format ({', '.join(formats)})"]
    if suffix not in formats:
        return [f"--plot {path}: unknown format {suffix!r} (supported: {', '.join(formats)})"]
    return []


# The weight panel's axis: 1 = no change of the learning rate; a bar beyond the axis (a
# weight far above 1) is cut there and labelled with its value instead of squashing the rest.
WEIGHT_AXIS_MAX = 2.0


def plot_figure(rows: list[dict[str, Any]]) -> Any:
    """The matplotlib figure of :func:`write_plot` (needs matplotlib).

    Bar charts of the IS weight mean, ESS and rejected fraction. Every panel has a fixed axis
    starting at 0 (fractions and ESS in [0, 1]; the weight in [0, ``WEIGHT_AXIS_MAX``]), so an
    all-zero panel still reads as zero and one huge weight does not squash the other bars;
    values beyond the axis, and non-finite ones, are written on their bar.
    """
    plt = _pyplot()
    names = [r["config"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    panels = (
        ("is_weight_mean", "mean IS weight (1 = no LR change)", WEIGHT_AXIS_MAX),
        ("ess", "effective sample size", 1.0),
        ("seq_rejected", "fraction of sequences rejected", 1.0),
    )
    for ax, (key, title, top) in zip(axes, panels):
        values = [float(r[key]) for r in rows]
        shown = [min(v, top) if math.isfinite(v) else 0.0 for v in values]
        ax.barh(names, shown, color="#4c72b0")
        ax.set_title(title, fontsize=10)
        ax.set_xlim(0, 1.05 * top)
        if key == "is_weight_mean":
            ax.axvline(1.0, color="#888888", linewidth=0.8, linestyle="--")
        for i, v in enumerate(values):
            if math.isfinite(v) and v > top:
                ax.text(0.98 * top, i, f"{v:.3g}", va="center", ha="right", fontsize=8, color="white")
            elif not math.isfinite(v):
                ax.text(0.02 * top, i, f"{v}", va="center", ha="left", fontsize=8)
        ax.invert_yaxis()
    for ax in axes[1:]:
        ax.set_yticklabels([])
    fig.tight_layout()
    return fig


def write_plot(rows: list[dict[str, Any]], path: str) -> None:
    """:func:`plot_figure` saved to ``path`` (the suffix names the format)."""
    fig = plot_figure(rows)
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)


def progress_bar(done: int, total: int, stream=None) -> None:
    """A one-line text progress bar (only drawn on a terminal)."""
    stream = stream if stream is not None else sys.stderr  # the current one, not the one at import
    if not stream.isatty():
        return
    width = 30
    filled = int(width * done / max(total, 1))
    stream.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total}")
    if done == total:
        stream.write("\n")
    stream.flush()
