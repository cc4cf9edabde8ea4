"""``nemo-rs check``: validate a recipe's loss section and explain the correction it runs.

Loading follows NeMo-RL: with NeMo-RL importable (``--nemo-rl PATH`` puts a checkout on the
path) the recipe goes through NeMo-RL's own ``load_config`` (``defaults`` inheritance),
Hydra-style overrides and, where it is a pydantic model, ``MasterConfig``. Without NeMo-RL
the plugin resolves ``defaults`` itself where the files exist and says what it could not
check. Problems are returned as one line each with the YAML path; nothing raises.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Optional

import yaml

from nemo_rs_plugin.config import PLUGIN_FIELDS, ConfigError, RSClippedPGLossConfig

__all__ = ["CheckReport", "check_recipe", "load_recipe"]

LONG_RESPONSE_TOKENS = 2048
REJECT_WARN_FRACTION = 0.5


@dataclass
class CheckReport:
    """Outcome of :func:`check_recipe`: errors make the command exit 2."""

    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    pipeline: list[str] = field(default_factory=list)
    config: Optional[RSClippedPGLossConfig] = None


def _use_nemo_rl(nemo_rl_path: Optional[str]) -> bool:
    if nemo_rl_path:
        sys.path.insert(0, os.path.abspath(nemo_rl_path))
    try:
        import nemo_rl.utils.config  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return False
    return True


def _nemo_rl_checkout() -> Optional[str]:
    import nemo_rl

    root = os.path.dirname(os.path.dirname(os.path.abspath(nemo_rl.__file__)))
    return root if os.path.isdir(os.path.join(root, "examples", "configs")) else None


def _defaults_resolve(path: str) -> bool:
    try:
        raw = _read_yaml(path)
    except (yaml.YAMLError, OSError):
        return True
    defaults = raw.get("defaults")
    if not defaults:
        return True
    base = os.path.dirname(os.path.abspath(path))
    parents = [defaults] if isinstance(defaults, str) else defaults
    return all(os.path.isfile(os.path.join(base, str(d))) for d in parents)


def _apply_override(cfg: dict, override: str) -> None:
    """``a.b.c=value`` / ``++a.b=value`` (value parsed as YAML) / ``~a.b`` (delete)."""
    if override.startswith("~"):
        keys = override[1:].split("=")[0].split(".")
        node = cfg
        for k in keys[:-1]:
            node = node.get(k, {})
        if isinstance(node, dict):
            node.pop(keys[-1], None)
        return
    key, sep, value = override.lstrip("+").partition("=")
    if not sep:
        raise ValueError(f"override {override!r}: expected key=value")
    node = cfg
    parts = key.split(".")
    for k in parts[:-1]:
        if isinstance(node, list):
            node = node[int(k)]
            continue
        node = node.setdefault(k, {})
    last = parts[-1]
    parsed = yaml.safe_load(value)
    if isinstance(node, list):
        node[int(last)] = parsed
    else:
        node[last] = parsed


def _merge(base: Any, override: Any) -> Any:
    if isinstance(base, dict) and isinstance(override, dict):
        out = dict(base)
        for k, v in override.items():
            out[k] = _merge(base[k], v) if k in base else v
        return out
    return override


def _read_yaml(path: str) -> dict:
    with open(path) as fh:
        data = yaml.safe_load(fh)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise yaml.YAMLError(f"top level is a {type(data).__name__}, expected a mapping")
    return data


def _load_plain(path: str, notes: list[str]) -> dict:
    """Resolve ``defaults`` relative to each file, as NeMo-RL does, where the files exist."""
    raw = _read_yaml(path)
    defaults = raw.pop("defaults", None)
    if not defaults:
        return raw
    merged: dict = {}
    for parent in [defaults] if isinstance(defaults, str) else defaults:
        parent_path = os.path.join(os.path.dirname(os.path.abspath(path)), str(parent))
        if not os.path.isfile(parent_path):
            notes.append(
                f"defaults: {parent} not found next to the recipe; inherited fields were not "
                "checked (pass --nemo-rl PATH, or check the recipe inside a NeMo-RL checkout)"
            )
            continue
        merged = _merge(merged, _load_plain(parent_path, notes))
    return _merge(merged, raw)


def load_recipe(path: str, overrides: list[str], nemo_rl_path: Optional[str], report: CheckReport) -> Optional[dict]:
    """The resolved recipe as plain data, or ``None`` with ``report.errors`` filled."""
    if not os.path.isfile(path):
        report.errors.append(f"{path}: no such file")
        return None
    try:
        _read_yaml(path)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f":{mark.line + 1}:{mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        report.errors.append(f"{path}{where}: invalid YAML: {problem}")
        return None
    have_nemo_rl = _use_nemo_rl(nemo_rl_path)
    root = nemo_rl_path or (_nemo_rl_checkout() if have_nemo_rl else None)
    if root and not _defaults_resolve(path):
        # A shipped recipe outside a checkout: resolve its defaults as if it sat in
        # <NeMo-RL>/examples/configs/recipes/llm/ (where `nemo-rs recipes` puts it).
        import tempfile

        from nemo_rs_plugin.recipes import export_recipe

        path = str(export_recipe(path, tempfile.mkdtemp(prefix="nemo-rs-check-"), root))
        report.notes.append(f"defaults resolved against {root}")
    if have_nemo_rl:
        try:
            from nemo_rl.utils import config as host_config
            from omegaconf import OmegaConf

            if hasattr(host_config, "register_omegaconf_resolvers"):
                try:
                    host_config.register_omegaconf_resolvers()
                except ValueError:
                    pass  # already registered in this process
            cfg = host_config.load_config(path)
            if overrides:
                cfg = host_config.parse_hydra_overrides(cfg, list(overrides))
            resolved = OmegaConf.to_container(cfg, resolve=True)
            report.notes.append("loaded with NeMo-RL's load_config")
            return resolved
        except ConfigError as exc:
            report.errors.extend(exc.problems)
            return None
        except Exception as exc:  # noqa: BLE001 - reported as a line, never a traceback
            report.errors.append(f"{path}: NeMo-RL could not load it: {type(exc).__name__}: {exc}")
            return None
    report.notes.append("NeMo-RL not importable: defaults resolved by nemo-rs itself")
    try:
        cfg = _load_plain(path, report.notes)
        for o in overrides:
            _apply_override(cfg, o)
    except (yaml.YAMLError, ValueError, OSError, IndexError, AttributeError) as exc:
        report.errors.append(f"{path}: {exc}")
        return None
    return cfg


def _get(cfg: dict, dotted: str, default: Any = None) -> Any:
    node: Any = cfg
    for k in dotted.split("."):
        if not isinstance(node, dict) or k not in node:
            return default
        node = node[k]
    return node


def _master_config_problems(cfg: dict) -> list[str]:
    try:
        from nemo_rl.algorithms.grpo import MasterConfig
    except Exception:  # noqa: BLE001
        return []
    if not hasattr(MasterConfig, "model_validate"):
        return []  # NeMo-RL v0.6.0: a TypedDict, nothing to validate
    try:
        from pydantic import ValidationError

        MasterConfig(**cfg)
    except ValidationError as exc:
        return [f"{'.'.join(str(x) for x in e['loc'])}: {e['msg']} (NeMo-RL MasterConfig)" for e in exc.errors()]
    except Exception as exc:  # noqa: BLE001
        return [f"MasterConfig: {type(exc).__name__}: {exc}"]
    return []


def check_recipe(
    path: str,
    overrides: list[str] = (),
    nemo_rl_path: Optional[str] = None,
    mismatch: float = 0.02,
    response_tokens: Optional[int] = None,
) -> CheckReport:
    """Validate ``path`` and describe its correction; see the module docstring."""
    report = CheckReport()
    cfg = load_recipe(path, list(overrides), nemo_rl_path, report)
    if cfg is None:
        return report
    loss = cfg.get("loss_fn")
    if loss is None:
        report.errors.append(
            "loss_fn: missing; add a loss_fn section, e.g. loss_fn: {name: rs_clipped_pg, "
            "use_importance_sampling_correction: true, is_correction_level: sequence_mean}"
        )
        return report
    if isinstance(loss, str):
        loss = {"name": loss}
    if not isinstance(loss, dict):
        report.errors.append(f"loss_fn: got a {type(loss).__name__}; expected a mapping")
        return report
    name = loss.get("name")
    if name is None:
        stray = [k for k in loss if k in PLUGIN_FIELDS]
        for k in stray:
            report.errors.append(
                f"loss_fn.{k}: a nemo-rs-plugin field under NeMo-RL's own loss; add name: rs_clipped_pg"
            )
        report.notes.append("loss_fn has no name: NeMo-RL's own ClippedPGLossFn is used")
    elif name not in ("rs_clipped_pg", "clipped_pg"):
        from nemo_rs_plugin.registry import LossRegistryError, get_loss_class

        try:
            get_loss_class(name)
        except (LossRegistryError, ImportError) as exc:
            report.errors.append(str(exc))
    try:
        config = RSClippedPGLossConfig.from_any({k: v for k, v in loss.items() if name or k not in PLUGIN_FIELDS})
    except ConfigError as exc:
        report.errors.extend(exc.problems)
        return report
    report.errors.extend(_master_config_problems(cfg))
    report.config = config
    report.pipeline = _describe(config)
    _warn(report, cfg, config, mismatch, response_tokens)
    return report


def _describe(config: RSClippedPGLossConfig) -> list[str]:
    from nemo_rs_plugin.describe import describe_pipeline

    return describe_pipeline(config)


def _warn(report: CheckReport, cfg: dict, config: RSClippedPGLossConfig, mismatch: float,
          response_tokens: Optional[int]) -> None:
    if _get(cfg, "grpo.async_grpo.enabled", False) and not config.use_importance_sampling_correction:
        report.warnings.append(
            "grpo.async_grpo.enabled is true but loss_fn.use_importance_sampling_correction is "
            "false: stale rollouts are trained on without correction (NeMo-RL requires it for "
            "async GRPO)"
        )
    tokens = response_tokens or _get(cfg, "policy.generation.max_new_tokens") or _get(
        cfg, "policy.max_total_sequence_length")
    if (
        config.use_importance_sampling_correction
        and config.effective_is_level == "sequence"
        and isinstance(tokens, int)
        and tokens > LONG_RESPONSE_TOKENS
    ):
        spread = mismatch * math.sqrt(tokens)
        report.warnings.append(
            f"is_correction_level is sequence (exp of the summed log-ratio) with responses up to "
            f"{tokens} tokens: at {mismatch:g} per-token mismatch the log-weight spreads by "
            f"~{spread:.2g} nats, so most weights collapse towards 0 and the learning rate "
            "shrinks silently; use is_correction_level: sequence_mean"
        )
    if config.rejection_sampling or config.truncated_importance_sampling_type == "seq-mask-tis":
        _warn_rejection(report, config, mismatch, tokens if isinstance(tokens, int) else 4096)


def _warn_rejection(report: CheckReport, config: RSClippedPGLossConfig, mismatch: float, tokens: int) -> None:
    from nemo_rs_plugin.simulate import MismatchModel, _metrics_of, synthetic_batch

    model = MismatchModel(responses=64, length=max(16, min(tokens, 4096)), mismatch=mismatch, seed=1)
    fields = config.model_dump()
    fields.update(name=None, reference_policy_kl_penalty=0.0, sharded_logits_input=False)
    metrics, _ = _metrics_of(fields, synthetic_batch(model))
    stages = [(f"rejection stage {i}", metrics.get(f"rs/{f.label}/seq_rejected_frac", 0.0))
              for i, f in enumerate(config.rejection_sampling, 1) if f.level == "sequence"]
    if config.truncated_importance_sampling_type == "seq-mask-tis":
        stages.append(("seq-mask-tis", metrics.get("is_oob_ratio", 0.0)))
    total = metrics.get("rs_seq_rejected_frac", 0.0)
    for label, frac in stages:
        if frac > REJECT_WARN_FRACTION:
            report.warnings.append(
                f"{label} would reject ~{frac:.0%} of sequences at {mismatch:g} per-token "
                f"mismatch over {model.length}-token responses: the bounds are likely too tight "
                "(widen them, or state your mismatch with --mismatch)"
            )
    if total > REJECT_WARN_FRACTION and not any(frac > REJECT_WARN_FRACTION for _, frac in stages):
        report.warnings.append(
            f"the filters together would reject ~{total:.0%} of sequences at {mismatch:g} "
            "per-token mismatch"
        )
