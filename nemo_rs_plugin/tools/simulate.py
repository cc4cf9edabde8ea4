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
README.md states what it shows, for which seeds (tests/docs/test_cli_docs.py reruns those commands).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from nemo_rs_plugin.core.loss import CorrectedPGLoss
from nemo_rs_plugin.core.masking import log_ratio
from nemo_rs_plugin.core.registries.truncation import truncation
from nemo_rs_plugin.core.settings import presets
from nemo_rs_plugin.tools import report
from nemo_rs_plugin.tools.batch_formats import BatchFormatError, load_batch

__all__ = [
    "MismatchModel",
    "DEFAULT_CONFIGS",
    "synthetic_batch",
    "load_batch",
    "loss_metrics",
    "run",
    "BatchFormatError",
    "format_table",
    "write_csv",
    "write_json",
    "write_plot",
    "plot_figure",
    "recipe_row",
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


#: The synthetic batch's size limit in tokens: 64M is ~256 MiB per float32 copy, and the loss holds
#: several copies at once (``simulate`` and ``check``'s estimate refuse more, before allocating).
MAX_SYNTHETIC_TOKENS = 1 << 26


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


#: Generator seed of a step: ``seed * SEED_STRIDE + step``.
SEED_STRIDE = 100003
#: Seeds whose generator seed fits torch's 64-bit seed (steps < 2**20).
MAX_SEED = (2**63 - 2**20) // SEED_STRIDE


def synthetic_batch(m: MismatchModel, step: int = 0) -> dict[str, torch.Tensor]:
    """A NeMo-RL-shaped batch (``[B, S]`` tensors, position 0 a dummy prompt token)."""
    g = torch.Generator().manual_seed(m.seed * SEED_STRIDE + step)
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
    # gen = prev - d is a log-prob too (<= 0): where d would push it above 0, lower prev to d.
    # The log-ratio d, so every weight and ratio statistic, stays as drawn.
    prev = torch.minimum(prev, d)
    mask = token_mask.long()
    return {
        "prev_logprobs": prev * mask,
        "generation_logprobs": (prev - d) * mask,
        "token_mask": mask,
        "sample_mask": torch.ones(B),
        "advantages": torch.randn(B, 1, generator=g).expand(B, S).contiguous(),
    }


def loss_metrics(cfg: dict, batch: dict[str, torch.Tensor]) -> tuple[dict, torch.Tensor]:
    """The real loss's metrics on ``batch``, and the norm of its gradient.

    One forward and backward of :class:`~nemo_rs_plugin.core.loss.CorrectedPGLoss` with the
    loss section ``cfg``, on an on-policy snapshot: the current policy's log-probs are
    ``prev_logprobs``, so the PPO ratio is 1 and the gradient is the advantage-weighted score,
    scaled by what the correction applies.

    Args:
        cfg: a loss section (anything ``CorrectedPGLoss`` accepts).
        batch: a batch in the layout of :func:`synthetic_batch` (or :func:`load_batch`'s).

    Returns:
        ``(metrics, gradient norm)``: the loss's metrics dict (``rs_seq_rejected_frac``,
        ``is_oob_ratio``, ``rs/<filter>/seq_rejected_frac``, ...) and the gradient's norm.
    """
    B, S = batch["prev_logprobs"].shape
    data = dict(batch)
    data.setdefault("input_ids", torch.zeros(B, S, dtype=torch.long))
    data.setdefault("reference_policy_logprobs", batch["prev_logprobs"])
    valid = batch["token_mask"][:, 1:].float() * batch["sample_mask"][:, None]
    lp = torch.nan_to_num(batch["prev_logprobs"][:, 1:].clone()).requires_grad_(True)
    loss, metrics = CorrectedPGLoss(cfg)(lp, data, batch["sample_mask"].sum(), valid.sum())
    loss.backward()
    assert lp.grad is not None  # lp is a leaf that requires grad, and the loss depends on it
    return metrics, lp.grad.norm()


def _applied_weights(cfg: dict, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per-unit IS weights the loss applies, from the loss's own correction function.

    Computed in the batch's dtype (float32), as the loss computes them: a weight whose
    ``exp`` overflows float32 is 0 there (:func:`~nemo_rs_plugin.core.masking.finite_exp`), so it
    is 0 here too. Returned as float64 for the statistics (``w**2`` of a large float32
    weight must not overflow).
    """
    from nemo_rs_plugin.core.correction import compute_correction
    from nemo_rs_plugin.core.masking import TokenMasks
    from nemo_rs_plugin.core.reporting.metrics import GlobalCounts
    from nemo_rs_plugin.core.settings.config import RSClippedPGLossConfig

    c = RSClippedPGLossConfig.from_any(cfg)
    dtype = batch["prev_logprobs"].dtype
    d, d_finite = log_ratio(batch["prev_logprobs"][:, 1:], batch["generation_logprobs"][:, 1:])
    tm = batch["token_mask"][:, 1:].to(dtype)
    sm = batch["sample_mask"].to(dtype)
    valid = tm * sm[:, None]
    masks = TokenMasks.build(tm, sm, d_finite, d_finite, valid=valid)
    out = compute_correction(c, d, masks, counts=GlobalCounts(tokens=valid.sum(), sequences=sm.sum()))
    if c.is_level_entry.per_token:
        # A token with a non-finite log-ratio leaves the loss (docs/guide.md#non-finite-inputs):
        # no weight is applied to it, so it is no unit here (a 0 would pull the mean below the min).
        units = (valid != 0) & (d_finite != 0)
        return (out.is_weight * out.keep)[units].double()
    kept_rows = (out.keep * valid).sum(-1) > 0
    units = (sm != 0) & (valid.sum(-1) > 0)
    return (out.is_weight.squeeze(-1) * kept_rows)[units].double()


def _config_row(cfg: dict, batch: dict[str, torch.Tensor], base_norm: torch.Tensor) -> dict[str, float]:
    """One configuration's statistics on one batch (the values of :data:`COLUMNS`)."""
    m, norm = loss_metrics(cfg, batch)
    # Without IS correction the loss applies weight 1 (its metrics still report the
    # weights it would have used).
    if cfg.get("use_importance_sampling_correction", False):
        w = _applied_weights(cfg, batch)
    else:
        w = torch.ones(1, dtype=torch.float64)
    kept = w[w > 0]
    # A per-sequence truncation (seq-mask-tis) zeroes whole sequences: reported with the rejected ones.
    kind = cfg.get("truncated_importance_sampling_type")
    seq_masked = m.get("is_oob_ratio", 0.0) if kind is not None and truncation(kind).per_sequence else 0.0
    return {
        "is_weight_mean": float(w.mean()),
        "is_weight_std": float(w.std(unbiased=False)),
        "is_weight_min": float(kept.min()) if kept.numel() else 0.0,
        "ess": float(w.sum() ** 2 / (w.numel() * (w**2).sum())) if (w**2).sum() > 0 else 0.0,
        "seq_rejected": m.get("rs_seq_rejected_frac", 0.0) + seq_masked,
        "tok_rejected": m.get("rs_token_rejected_frac", 0.0),
        "grad_norm_ratio": float(norm / base_norm) if base_norm > 0 else float("nan"),
    }


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
        _, base_norm = loss_metrics(DEFAULT_CONFIGS["uncorrected"], batch)
        for name, cfg in configs.items():
            for k, v in _config_row(cfg, batch, base_norm).items():
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


def format_table(rows: list[dict[str, Any]], columns: tuple[str, ...] = COLUMNS) -> str:
    """A fixed-width table of :func:`run`'s rows, with a legend (a recipe's file name may be long)."""
    label_width = max([22, *(len(str(r["config"])) + 2 for r in rows)])
    lines = report.fixed_width_table(rows, "config", columns, label_width=label_width, width=16, spec=".4g")
    return "\n".join([*lines, LEGEND])


NO_GRADIENT = (
    "no gradient: every advantage on a valid token is 0, so every configuration's gradient is 0 and "
    "grad_norm_ratio is not defined (left out of the table; nan in --csv and --json); the other columns do not "
    "depend on the advantages"
)


def no_gradient(batches: list[dict[str, torch.Tensor]]) -> bool:
    """Whether every advantage on a valid token of every batch is 0 (the loss has no gradient at all)."""
    for b in batches:
        valid = (b["token_mask"][:, 1:] * b["sample_mask"][:, None]) != 0
        if bool((b["advantages"][:, 1:][valid] != 0).any()):  # [B, S], as the batches are built
            return False
    return True


def write_csv(rows: list[dict[str, Any]], path: str) -> None:
    """The table as CSV (non-finite values as ``nan`` / ``inf``, as Python prints them)."""
    report.write_csv(rows, path, ["config", *COLUMNS])


def write_json(rows: list[dict[str, Any]], source: str, path: str) -> None:
    """``{"source": ..., "rows": [...]}`` in strict JSON (RFC 8259 has no NaN or Infinity).

    A non-finite value is written as the string ``"NaN"``, ``"Infinity"`` or
    ``"-Infinity"``, which Python's ``float()`` and JavaScript's ``Number()`` both read back.
    """
    report.write_strict_json({"source": source, "rows": rows}, "rows", path)


PLOT_HELP = "--plot needs matplotlib: pip install matplotlib (or: uv add matplotlib)"


def plot_problems(path: str) -> list[str]:
    """Why ``--plot path`` cannot be drawn (matplotlib missing, format unknown), before a run."""
    try:
        plt = report.pyplot(PLOT_HELP)
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
    plt = report.pyplot(PLOT_HELP)
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
    report.pyplot(PLOT_HELP).close(fig)


@dataclass
class RecipeRow:
    """A recipe's loss section as a row of the table (:func:`recipe_row`)."""

    label: str = ""
    config: Optional[dict] = None
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def recipe_row(path: str, overrides: list[str], taken: tuple[str, ...] = ()) -> RecipeRow:
    """The loss section of the recipe at ``path`` (with Hydra-style ``overrides``), ready to simulate.

    Loaded as ``nemo-rs check`` and ``calibrate --recipe`` load it
    (:func:`~nemo_rs_plugin.tools.recipe_loading.load_recipe`: ``defaults``, overrides,
    interpolations) and validated with the config's own rules. The row is labelled by the
    file name (``taken``: labels already in the table, which it must not replace). As every
    built-in row, it runs without the reference KL penalty (the snapshot is on-policy, so its
    gradient is 0) and never records log-probs. Problems (no loss section, an invalid one, an
    override that does not fit) are one line each in ``problems``; nothing raises.
    """
    import warnings

    from nemo_rs_plugin.core.settings.config import ConfigError, ConfigWarning, RSClippedPGLossConfig, own_loss_problems
    from nemo_rs_plugin.core.settings.presets import PLUGIN_LOSS_NAME, selects_nemo_rl_loss
    from nemo_rs_plugin.tools.recipe_loading import (
        INHERITED_NOT_FOUND,
        LoadedRecipe,
        flatten,
        load_recipe,
        unresolved_problems,
    )

    label = os.path.basename(path) or path
    if label in taken:
        label = f"{label} (recipe)"
    row = RecipeRow(label=label)
    loaded = LoadedRecipe()
    cfg = load_recipe(path, list(overrides), None, loaded)
    if cfg is None:
        row.problems = [f"--recipe: {flatten(e)}" for e in loaded.errors or [f"{path}: could not be read"]]
        return row
    inherited = [flatten(u) for u in loaded.unchecked if u.startswith(INHERITED_NOT_FOUND)]
    row.problems += unresolved_problems(f"--recipe {path}", loaded.unresolved, "simulate", under="loss_fn")
    if row.problems:
        return row
    loss = cfg.get("loss_fn")
    if loss is None:
        where = f" (it may come from defaults that were not found: {'; '.join(inherited)})" if inherited else ""
        row.problems.append(
            f"--recipe {path}: no loss_fn section{where}; simulate runs a recipe's loss section: add one, e.g. "
            f"loss_fn: {{name: {PLUGIN_LOSS_NAME}, use_importance_sampling_correction: true, "
            "is_correction_level: sequence_mean}"
        )
        return row
    if isinstance(loss, str):
        loss = {"name": loss}
    if not isinstance(loss, dict):
        row.problems.append(f"--recipe {path}: loss_fn: got a {type(loss).__name__}; expected a mapping")
        return row
    name = loss.get("name")
    if selects_nemo_rl_loss(name):  # NeMo-RL's own loss: the plugin's fields would be ignored
        row.problems += [f"--recipe {path}: loss_fn.{p}" for p in own_loss_problems(loss, name)]
    elif name != PLUGIN_LOSS_NAME:
        row.problems.append(
            f"--recipe {path}: loss_fn.name: got {name!r}; simulate runs {PLUGIN_LOSS_NAME} or NeMo-RL's clipped_pg"
        )
    if row.problems:
        return row
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ConfigWarning)
        try:
            config = RSClippedPGLossConfig.from_any({k: v for k, v in loss.items() if k != "name"})
        except ConfigError as exc:
            row.problems += [f"--recipe {path}: {flatten(p)}" for p in exc.problems]
            return row
    said = [str(w.message) for w in caught if issubclass(w.category, ConfigWarning)]
    row.warnings += [f"--recipe {path}: {w}" for i, w in enumerate(said) if w not in said[:i]]
    row.warnings += [f"--recipe {path}: {line}; the loss section is simulated without them" for line in inherited]
    fields = config.model_dump()
    fields.update(name=None, reference_policy_kl_penalty=0.0, sharded_logits_input=False, record_logprobs=False)
    row.config = fields
    return row
