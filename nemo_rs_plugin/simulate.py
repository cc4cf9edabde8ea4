"""Training/inference mismatch simulator: run correction configs through the real loss.

A synthetic batch models what a practitioner sees on MoE long-sequence GRPO:

* per-token log-prob noise ``d_t = prev_t - gen_t ~ N(-s^2/2, s^2)`` (``--mismatch s``; the
  ``-s^2/2`` makes ``E[exp(d)] = 1``, as for a true likelihood ratio);
* response lengths uniform in ``[length/2, length]``;
* rare MoE-routing outlier tokens (``--outlier-rate``) with ``|d|`` of several nats;
* staleness: a per-sequence shift of ``d`` of scale ``--staleness`` (async / off-policy).

Or real per-token log-probs (:func:`load_batch`, ``--from``). For every configuration the
real :class:`~nemo_rs_plugin.loss.RSClippedPGLoss` runs forward and backward; the report has
the IS weight mean / std / min, effective sample size, fraction of sequences and tokens
rejected, and the gradient norm relative to the uncorrected loss.

The default reproduces NeMo-RL PR #2269: ~9k-token responses at ~2% per-token mismatch, where
``sequence`` weights collapse and ``sequence_mean`` stays near 1.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from nemo_rs_plugin.loss import RSClippedPGLoss
from nemo_rs_plugin.masking import log_ratio

__all__ = ["MismatchModel", "DEFAULT_CONFIGS", "synthetic_batch", "load_batch", "run", "BatchFormatError"]

_IS = {"use_importance_sampling_correction": True, "reference_policy_kl_penalty": 0.0}
DEFAULT_CONFIGS: dict[str, dict] = {
    "uncorrected": {"reference_policy_kl_penalty": 0.0},
    "token": {**_IS, "is_correction_level": "token"},
    "token+tis2": {**_IS, "is_correction_level": "token", "truncated_importance_sampling_type": "tis",
                   "truncated_importance_sampling_ratio": 2.0},
    "sequence": {**_IS, "is_correction_level": "sequence"},
    "sequence+tis2": {**_IS, "is_correction_level": "sequence", "truncated_importance_sampling_type": "tis",
                      "truncated_importance_sampling_ratio": 2.0},
    "sequence_mean": {**_IS, "is_correction_level": "sequence_mean"},
    "seqmean+geo-rs+veto": {**_IS, "is_correction_level": "sequence_mean", "rejection_sampling": [
        {"level": "sequence", "agg": "mean", "lower": 0.99, "upper": 1.01},
        {"level": "sequence", "agg": "any", "lower": 1e-4, "upper": 1e4}]},
    "geo-rs+token-mis": {**_IS, "is_correction_level": "token", "rejection_sampling": [
        {"level": "sequence", "agg": "mean", "lower": 0.99, "upper": 1.01},
        {"level": "token", "lower": 0.5, "upper": 2.0}]},
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


def load_batch(path: str) -> dict[str, torch.Tensor]:
    """Per-token log-probs saved from a real run: JSONL (one sequence per line) or torch.

    JSONL record: ``{"prev_logprobs": [...], "generation_logprobs": [...],
    "token_mask": [...] (optional, default all 1), "advantage": float (optional)}``; lists
    of one record have equal lengths. Torch file: a dict of ``[B, S]`` tensors with the same
    keys (``advantages`` ``[B, S]`` or ``[B]``, optional ``sample_mask`` ``[B]``), e.g. the
    fields of NeMo-RL's ``train_data``. Position 0 is treated as NeMo-RL's first position.

    Raises:
        BatchFormatError: naming the record (line) and the field that is wrong.
    """
    p = Path(path)
    if not p.is_file():
        raise BatchFormatError(f"{path}: no such file")
    if p.suffix in (".pt", ".pth", ".torch"):
        return _load_torch(p)
    return _load_jsonl(p)


def _load_torch(p: Path) -> dict[str, torch.Tensor]:
    try:
        raw = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is a format error
        raise BatchFormatError(f"{p}: not a readable torch file ({exc})") from None
    if not isinstance(raw, dict):
        raise BatchFormatError(f"{p}: expected a dict of tensors, got {type(raw).__name__}")
    for key in _REQUIRED:
        if key not in raw:
            raise BatchFormatError(f"{p}: field {key!r} is missing")
        if not isinstance(raw[key], torch.Tensor) or raw[key].dim() != 2:
            raise BatchFormatError(f"{p}: field {key!r} must be a [B, S] tensor")
    B, S = raw["prev_logprobs"].shape
    out = {k: raw[k].float() for k in _REQUIRED}
    if out["generation_logprobs"].shape != (B, S):
        raise BatchFormatError(f"{p}: field 'generation_logprobs' has shape "
                               f"{tuple(out['generation_logprobs'].shape)}, expected {(B, S)}")
    mask = raw.get("token_mask", torch.ones(B, S))
    if tuple(mask.shape) != (B, S):
        raise BatchFormatError(f"{p}: field 'token_mask' has shape {tuple(mask.shape)}, expected {(B, S)}")
    out["token_mask"] = (mask != 0).long()
    adv = raw.get("advantages", torch.ones(B))
    out["advantages"] = (adv.float().reshape(B, 1).expand(B, S) if adv.dim() == 1 else adv.float()).contiguous()
    out["sample_mask"] = raw.get("sample_mask", torch.ones(B)).float()
    return out


def _load_jsonl(p: Path) -> dict[str, torch.Tensor]:
    records = []
    with open(p) as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise BatchFormatError(f"{p}:{lineno}: record is not valid JSON ({exc.msg})") from None
            if not isinstance(rec, dict):
                raise BatchFormatError(f"{p}:{lineno}: record must be a JSON object")
            n = None
            for key in _REQUIRED + ("token_mask",):
                if key not in rec:
                    if key == "token_mask":
                        continue
                    raise BatchFormatError(f"{p}:{lineno}: field {key!r} is missing")
                value = rec[key]
                if not isinstance(value, list) or not all(isinstance(v, (int, float)) or v is None for v in value):
                    raise BatchFormatError(f"{p}:{lineno}: field {key!r} must be a list of numbers")
                if n is None:
                    n = len(value)
                elif len(value) != n:
                    raise BatchFormatError(f"{p}:{lineno}: field {key!r} has {len(value)} values, expected {n}")
            adv = rec.get("advantage", 1.0)
            if not isinstance(adv, (int, float)):
                raise BatchFormatError(f"{p}:{lineno}: field 'advantage' must be a number")
            records.append((rec, n, float(adv)))
    if not records:
        raise BatchFormatError(f"{p}: no records")
    B, S = len(records), max(n for _, n, _ in records)

    def column(key: str, fill: float) -> torch.Tensor:
        out = torch.full((B, S), fill)
        for i, (rec, n, _) in enumerate(records):
            if key in rec:
                out[i, :n] = torch.tensor([float("nan") if v is None else float(v) for v in rec[key]])
        return out

    mask = torch.zeros(B, S, dtype=torch.long)
    for i, (rec, n, _) in enumerate(records):
        mask[i, :n] = torch.tensor(rec["token_mask"], dtype=torch.long) if "token_mask" in rec else 1
    adv = torch.tensor([a for _, _, a in records]).reshape(B, 1).expand(B, S).contiguous()
    return {"prev_logprobs": column("prev_logprobs", 0.0), "generation_logprobs": column("generation_logprobs", 0.0),
            "token_mask": (mask != 0).long(), "sample_mask": torch.ones(B), "advantages": adv}


def _metrics_of(cfg: dict, batch: dict[str, torch.Tensor]) -> tuple[dict, torch.Tensor]:
    B, S = batch["prev_logprobs"].shape
    data = dict(batch)
    data.setdefault("input_ids", torch.zeros(B, S, dtype=torch.long))
    data.setdefault("reference_policy_logprobs", batch["prev_logprobs"])
    valid = batch["token_mask"][:, 1:].float() * batch["sample_mask"][:, None]
    # On-policy snapshot: the current policy equals prev, so the PPO ratio is 1 and the
    # gradient is the advantage-weighted score, scaled by what the correction applies.
    lp = torch.nan_to_num(batch["prev_logprobs"][:, 1:].clone()).requires_grad_(True)
    loss, metrics = RSClippedPGLoss(cfg)(lp, data, batch["sample_mask"].sum(), valid.sum())
    loss.backward()
    return metrics, lp.grad.norm()


def _applied_weights(cfg: dict, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per-unit IS weights the loss applies (float64, the loss's own correction function)."""
    from nemo_rs_plugin.config import RSClippedPGLossConfig
    from nemo_rs_plugin.correction import compute_correction

    c = RSClippedPGLossConfig.from_any(cfg)
    _, d, d_finite = log_ratio(batch["prev_logprobs"][:, 1:].double(), batch["generation_logprobs"][:, 1:].double())
    tm = batch["token_mask"][:, 1:].double()
    sm = batch["sample_mask"].double()
    valid = tm * sm[:, None]
    out = compute_correction(d, d_finite, valid, tm, sm, d_finite, c, sm.sum(), valid.sum())
    if c.effective_is_level == "token":
        units = valid != 0
        return (out.is_weight * out.keep)[units]
    kept_rows = (out.keep * valid).sum(-1) > 0
    units = (sm != 0) & ((valid.sum(-1) > 0))
    return (out.is_weight.squeeze(-1) * kept_rows)[units]


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
    import csv

    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=["config", *COLUMNS])
        writer.writeheader()
        writer.writerows(rows)


def write_plot(rows: list[dict[str, Any]], path: str) -> None:
    """Bar charts of the IS weight mean, ESS and rejected fraction (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError("--plot needs matplotlib: pip install 'nemo-rs-plugin[plot]'") from exc
    names = [r["config"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    for ax, (key, title) in zip(axes, (("is_weight_mean", "mean IS weight (1 = no LR shrink)"),
                                       ("ess", "effective sample size"),
                                       ("seq_rejected", "fraction of sequences rejected"))):
        values = [r[key] for r in rows]
        ax.barh(names, values, color="#4c72b0")
        ax.set_title(title, fontsize=10)
        ax.set_xlim(0, max(1.05, 1.05 * max(values)))  # fractions and ESS live in [0, 1]
        ax.invert_yaxis()
    for ax in axes[1:]:
        ax.set_yticklabels([])
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def progress_bar(done: int, total: int, stream=sys.stderr) -> None:
    """A one-line text progress bar (only drawn on a terminal)."""
    if not stream.isatty():
        return
    width = 30
    filled = int(width * done / max(total, 1))
    stream.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total}")
    if done == total:
        stream.write("\n")
    stream.flush()
