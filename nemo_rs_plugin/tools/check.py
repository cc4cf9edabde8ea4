"""``nemo-rs check``: validate a recipe's loss section and explain the correction it runs.

Loading follows NeMo-RL: with NeMo-RL importable (``--nemo-rl PATH`` puts a checkout on the
path) the recipe goes through NeMo-RL's own ``load_config`` (``defaults`` inheritance),
Hydra-style overrides, ``MasterConfig`` where it is a pydantic model, and the loss rules of
the NeMo-RL version found (v0.6.0 reads ``truncated_importance_sampling_type`` only with a
ratio, as :mod:`nemo_rs_plugin.nemo_rl.loss_fn` does). Without NeMo-RL the plugin resolves
``defaults`` itself where the files exist. Whatever could not be checked is listed in
:attr:`CheckReport.unchecked` (what, why, how to check it), and the command then exits 3,
never 0. Problems are one line each with the YAML path; nothing raises.
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Any, Optional

import yaml

from nemo_rs_plugin.core.config import PLUGIN_FIELDS, ConfigError, RSClippedPGLossConfig, own_loss_problems
from nemo_rs_plugin.nemo_rl.host import fused_sharded_problem, training_time_filtering_problem
from nemo_rs_plugin.nemo_rl.recipe_defaults import defaults_of, parent_paths

__all__ = ["CheckReport", "check_recipe", "load_recipe"]

LONG_RESPONSE_TOKENS = 2048
REJECT_WARN_FRACTION = 0.5
HOW_TO_CHECK = (
    "to check it, run nemo-rs check in NeMo-RL's own environment (where `import "
    "nemo_rl.algorithms.grpo` works, e.g. `uv run nemo-rs check ...` in the NeMo-RL checkout "
    "with nemo-rs-plugin installed there)"
)


@dataclass
class CheckReport:
    """Outcome of :func:`check_recipe`: errors make the command exit 2, ``unchecked`` 3."""

    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    pipeline: list[str] = field(default_factory=list)
    #: What could not be checked, one line each: what, why, and how to check it.
    unchecked: list[str] = field(default_factory=list)
    config: Optional[RSClippedPGLossConfig] = None
    #: Whether NeMo-RL was importable (its loader, MasterConfig and version rules applied).
    nemo_rl: bool = False


def _one_line(exc: BaseException, strip: str = "") -> str:
    """``Type: message`` on one line (Hydra and pydantic messages span several)."""
    text = str(exc)
    if strip and text.startswith(strip):
        text = text[len(strip) :]
    parts = [line.strip() for line in text.splitlines()]
    parts = [p for p in parts if p and set(p) != {"^"} and not p.startswith("See https://")]
    return f"{type(exc).__name__}: {' '.join(parts)}" if parts else type(exc).__name__


def _with_cause(exc: BaseException, strip: str = "") -> str:
    """:func:`_one_line` plus the first line of the innermost cause (Hydra hides it)."""
    text = _one_line(exc, strip)
    inner, seen = exc, 0
    while (inner.__cause__ or inner.__context__) is not None and seen < 10:
        inner, seen = inner.__cause__ or inner.__context__, seen + 1
    first = next((line.strip() for line in str(inner).splitlines() if line.strip()), "")
    if inner is not exc and first and first not in text:
        text += f" ({first})"
    return text


def _flatten(line: str) -> str:
    return " ".join(part.strip() for part in str(line).splitlines() if part.strip())


def _find_nemo_rl(nemo_rl_path: Optional[str], report: CheckReport) -> tuple[bool, Optional[str]]:
    """``(importable, checkout root)``; a bad ``--nemo-rl`` is an error, an import failure unchecked."""
    root = None
    if nemo_rl_path:
        root = os.path.abspath(os.path.expanduser(nemo_rl_path))
        if not os.path.isfile(os.path.join(root, "nemo_rl", "__init__.py")):
            what = "no such directory" if not os.path.isdir(root) else "no nemo_rl/__init__.py in it"
            report.errors.append(f"--nemo-rl {nemo_rl_path}: not a NeMo-RL checkout ({what})")
            return False, None
        if root not in sys.path:
            sys.path.insert(0, root)
    why = None
    try:
        installed = importlib.util.find_spec("nemo_rl") is not None
    except (ImportError, ValueError):
        installed = False
    if not installed:
        why = "NeMo-RL is not installed in this environment"
    else:
        try:
            import nemo_rl.utils.config  # noqa: F401
        except Exception as exc:  # noqa: BLE001 - any import failure: reported as not checked
            where = f"NeMo-RL at {nemo_rl_path}" if nemo_rl_path else "NeMo-RL"
            why = f"{where} does not import here ({_one_line(exc)})"
    if why is not None:
        report.unchecked.append(
            "NeMo-RL's config loading (defaults, interpolations, overrides), its MasterConfig and "
            f"its version's loss rules: {why}; {HOW_TO_CHECK}"
        )
        return False, root
    import nemo_rl

    found = os.path.dirname(os.path.dirname(os.path.realpath(nemo_rl.__file__)))
    if root and found != os.path.realpath(root):
        report.errors.append(f"--nemo-rl {nemo_rl_path}: this process already imported NeMo-RL from {found}")
        return False, None
    if root is None and os.path.isdir(os.path.join(found, "examples", "configs")):
        root = found
    return True, root


def _defaults_resolve(path: str) -> bool:
    try:
        raw = _read_yaml(path)
    except (yaml.YAMLError, OSError, UnicodeDecodeError):
        return True
    return all(os.path.isfile(p) for p in parent_paths(path, raw))


class OverrideError(ValueError):
    """An override that does not fit the recipe; the message names the override."""


def _override_key(override: str) -> tuple[str, str, Optional[str]]:
    """``(kind, dotted key, value)`` of ``key=value`` / ``+key=value`` / ``++key=value`` / ``~key``."""
    if override.startswith("~"):
        kind, rest = "~", override[1:]
        key, _, value = rest.partition("=")
        value = value or None
    else:
        kind = "++" if override.startswith("++") else "+" if override.startswith("+") else ""
        key, sep, value = override[len(kind) :].partition("=")
        if not sep:
            raise OverrideError(f"override {override!r}: expected key=value")
    parts = key.split(".")
    if not key or any(not p.strip() or p != p.strip() for p in parts):
        raise OverrideError(f"override {override!r}: {key!r} is not a dotted key (e.g. loss_fn.ratio_clip_max)")
    return kind, key, value


def _child(node: Any, key: str, where: str, override: str, create: bool) -> Any:
    if isinstance(node, dict):
        if key not in node:
            if not create:
                raise OverrideError(f"override {override!r}: {where or 'the recipe'} has no key {key!r}")
            node[key] = {}
        return node[key]
    if isinstance(node, list):
        return node[_index(node, key, where, override)]
    raise OverrideError(
        f"override {override!r}: {where} is a {type(node).__name__} ({node!r}), not a mapping or a list"
    )


def _index(node: list, key: str, where: str, override: str) -> int:
    try:
        i = int(key)
    except ValueError:
        raise OverrideError(f"override {override!r}: {where} is a list; {key!r} is not an index") from None
    if not 0 <= i < len(node):
        raise OverrideError(f"override {override!r}: {where} has {len(node)} entries; index {i} is out of range")
    return i


def _apply_override(cfg: dict, override: str) -> None:
    """``a.b.c=value`` / ``+a.b=value`` (value parsed as YAML) / ``~a.b`` (delete), in place.

    Raises:
        OverrideError: one line naming the override and what does not fit.
    """
    kind, key, value = _override_key(override)
    parts = key.split(".")
    node: Any = cfg
    for depth, k in enumerate(parts[:-1]):
        node = _child(node, k, ".".join(parts[:depth]), override, create=kind != "~")
    where, last = ".".join(parts[:-1]), parts[-1]
    if kind == "~":
        if isinstance(node, dict) and last in node:
            del node[last]
        elif isinstance(node, list):
            del node[_index(node, last, where, override)]
        else:
            raise OverrideError(f"override {override!r}: nothing to delete at {key}")
        return
    try:
        parsed = yaml.safe_load(value)
    except yaml.YAMLError as exc:
        raise OverrideError(f"override {override!r}: the value is not valid YAML ({_one_line(exc)})") from None
    if isinstance(node, dict):
        node[last] = parsed
    elif isinstance(node, list):
        node[_index(node, last, where, override)] = parsed
    else:
        raise OverrideError(
            f"override {override!r}: {where} is a {type(node).__name__} ({node!r}), not a mapping or a list"
        )


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


def _load_plain(path: str, missing: list[str]) -> dict:
    """Resolve ``defaults`` relative to each file, as NeMo-RL does, where the files exist."""
    raw = _read_yaml(path)
    parents = zip(defaults_of(raw), parent_paths(path, raw))
    raw.pop("defaults", None)
    merged: dict = {}
    for parent, parent_path in parents:
        if not os.path.isfile(parent_path):
            missing.append(parent)
            continue
        merged = _merge(merged, _load_plain(parent_path, missing))
    return _merge(merged, raw)


def _inherited_loss_mapping(path: str) -> Optional[str]:
    """The parent (from ``defaults``) that defines a ``loss_fn`` mapping, if any."""
    raw = _read_yaml(path)
    for parent, parent_path in zip(defaults_of(raw), parent_paths(path, raw)):
        try:
            inherited = _load_plain(parent_path, []) if os.path.isfile(parent_path) else {}
        except (yaml.YAMLError, OSError, UnicodeDecodeError):
            continue  # reported by the loader that follows
        if isinstance(inherited.get("loss_fn"), dict):
            return parent
    return None


def load_recipe(path: str, overrides: list[str], nemo_rl_path: Optional[str], report: CheckReport) -> Optional[dict]:
    """The resolved recipe as plain data, or ``None`` with ``report.errors`` filled.

    Sets ``report.nemo_rl`` and adds to ``report.unchecked`` what could not be loaded the way
    NeMo-RL loads it. Temporary files (a shipped recipe placed in a checkout) are removed.
    """
    if not os.path.isfile(path):
        report.errors.append(f"{path}: no such file")
        return None
    try:
        raw = _read_yaml(path)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f":{mark.line + 1}:{mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        report.errors.append(f"{path}{where}: invalid YAML: {problem}")
        return None
    except (OSError, UnicodeDecodeError) as exc:
        report.errors.append(f"{path}: cannot read it ({_one_line(exc)})")
        return None
    for o in overrides:
        try:
            _override_key(o)
        except OverrideError as exc:
            report.errors.append(str(exc))
    have_nemo_rl, root = _find_nemo_rl(nemo_rl_path, report)
    report.nemo_rl = have_nemo_rl
    if report.errors:
        return None
    with tempfile.TemporaryDirectory(prefix="nemo-rs-check-") as tmp:
        load_path = path
        if root and defaults_of(raw) and not _defaults_resolve(path):
            # A shipped recipe outside a checkout: resolve its defaults as if it sat in
            # <NeMo-RL>/examples/configs/recipes/llm/ (where `nemo-rs recipes` puts it).
            from nemo_rs_plugin.tools.recipes import export_recipe

            load_path = str(export_recipe(path, tmp, root))
            report.notes.append(f"defaults resolved against {root}")
        if isinstance(raw.get("loss_fn"), str):
            parent = _inherited_loss_mapping(load_path)
            if parent is not None:
                report.errors.append(
                    f"loss_fn: the shorthand `loss_fn: {raw['loss_fn']}` would replace the loss_fn "
                    f"mapping inherited from {parent} (dropping its settings); write the mapping "
                    f"form, loss_fn: {{name: {raw['loss_fn']}, ...}}"
                )
                return None
        if have_nemo_rl:
            return _load_with_nemo_rl(load_path, path, overrides, report)
        return _load_without_nemo_rl(load_path, path, overrides, report)


def _load_with_nemo_rl(load_path: str, path: str, overrides: list[str], report: CheckReport) -> Optional[dict]:
    from nemo_rl.utils import config as host_config

    if hasattr(host_config, "register_omegaconf_resolvers"):
        try:
            host_config.register_omegaconf_resolvers()
        except ValueError:
            pass  # already registered in this process
    try:
        cfg = host_config.load_config(load_path)
    except ConfigError as exc:
        report.errors.extend(exc.problems)
        return None
    except Exception as exc:  # noqa: BLE001 - reported as a line, never a traceback
        report.errors.append(f"{path}: NeMo-RL's load_config rejects it: {_with_cause(exc)}")
        return None
    for o in overrides:
        try:
            cfg = host_config.parse_hydra_overrides(cfg, [o])
        except Exception as exc:  # noqa: BLE001
            report.errors.append(f"override {o!r}: {_with_cause(exc, strip='Failed to parse Hydra overrides: ')}")
    if report.errors:
        return None
    if isinstance(cfg, dict):
        resolved = cfg
    else:
        try:
            from omegaconf import OmegaConf

            resolved = OmegaConf.to_container(cfg, resolve=True)
        except Exception as exc:  # noqa: BLE001
            report.errors.append(f"{path}: NeMo-RL's config does not resolve: {_one_line(exc)}")
            return None
    report.notes.append("loaded with NeMo-RL's load_config")
    return resolved


def _load_without_nemo_rl(load_path: str, path: str, overrides: list[str], report: CheckReport) -> Optional[dict]:
    missing: list[str] = []
    try:
        cfg = _load_plain(load_path, missing)
    except (yaml.YAMLError, OSError, UnicodeDecodeError) as exc:
        report.errors.append(f"{path}: a file it inherits through defaults does not load ({_one_line(exc)})")
        return None
    for parent in dict.fromkeys(missing):
        report.unchecked.append(
            f"fields inherited through defaults: {parent} not found next to the recipe; pass "
            "--nemo-rl PATH (a NeMo-RL checkout), or check the recipe where it sits in one"
        )
    for o in overrides:
        try:
            _apply_override(cfg, o)
        except OverrideError as exc:
            report.errors.append(str(exc))
    return None if report.errors else cfg


def _get(cfg: dict, dotted: str, default: Any = None) -> Any:
    node: Any = cfg
    for k in dotted.split("."):
        if not isinstance(node, dict) or k not in node:
            return default
        node = node[k]
    return node


def _master_config_problems(cfg: dict, report: CheckReport) -> list[str]:
    """NeMo-RL's ``MasterConfig`` on the resolved recipe; an import failure is ``unchecked``."""
    try:
        from nemo_rl.algorithms.grpo import MasterConfig
    except Exception as exc:  # noqa: BLE001 - e.g. NeMo-RL >= 0.7 on Python < 3.12
        report.unchecked.append(
            f"NeMo-RL's MasterConfig: nemo_rl.algorithms.grpo does not import here ({_one_line(exc)}); " + HOW_TO_CHECK
        )
        return []
    if not hasattr(MasterConfig, "model_validate"):
        report.notes.append("NeMo-RL's MasterConfig is a TypedDict here (v0.6.0): NeMo-RL does not validate it")
        return []
    try:
        from pydantic import ValidationError

        MasterConfig(**cfg)
    except ValidationError as exc:
        return [f"{'.'.join(str(x) for x in e['loc'])}: {e['msg']} (NeMo-RL MasterConfig)" for e in exc.errors()]
    except Exception as exc:  # noqa: BLE001
        return [f"MasterConfig: {_one_line(exc)}"]
    report.notes.append("validated with NeMo-RL's MasterConfig")
    return []


def _host_loss_section(loss: dict, report: CheckReport) -> dict:
    """The loss section as the NeMo-RL version found reads it (the run's own rules)."""
    from nemo_rs_plugin.nemo_rl import host

    try:
        api = host.host_api()
    except host.UnsupportedHostError as exc:
        report.errors.append(_flatten(str(exc)))
        return loss
    except Exception as exc:  # noqa: BLE001
        report.unchecked.append(
            f"the loss rules of this NeMo-RL version: nemo_rl.algorithms.loss does not import here "
            f"({_one_line(exc)}); " + HOW_TO_CHECK
        )
        return loss
    if api != "typeddict":
        return loss
    read = host.v06_semantics(loss)
    if read != loss:
        report.notes.append(
            "NeMo-RL v0.6.0 semantics: truncated_importance_sampling_type is ignored without "
            "truncated_importance_sampling_ratio, so truncation is off"
        )
    return dict(read)


def _parallelism_problems(cfg: dict, config: RSClippedPGLossConfig, report: CheckReport) -> list[str]:
    """Combinations docs/parallelism.md#sharded-input calls invalid."""
    if not config.sharded_logits_input:
        return []
    problems = []
    megatron = _get(cfg, "policy.megatron_cfg.enabled")
    dtensor = _get(cfg, "policy.dtensor_cfg.enabled")
    if megatron is not True and (megatron is False or dtensor is True):
        problems.append(
            "loss_fn.sharded_logits_input: got true with the DTensor backend (policy.megatron_cfg.enabled "
            "is not true); local logits shards need the Megatron backend: set sharded_logits_input: false "
            "or policy.megatron_cfg.enabled: true"
        )
    elif megatron is not True:
        report.warnings.append(
            "loss_fn.sharded_logits_input needs the Megatron backend, and policy.megatron_cfg.enabled is not set here"
        )
    fused = fused_sharded_problem(megatron is True, _get(cfg, "policy.megatron_cfg.use_fused_linear_logprobs"))
    filtering = training_time_filtering_problem(
        _get(cfg, "policy.generation.top_k"), _get(cfg, "policy.generation.top_p")
    )
    problems += [f"loss_fn.{p}" for p in (fused, filtering) if p is not None]
    return problems


def check_recipe(
    path: str,
    overrides: list[str] = (),
    nemo_rl_path: Optional[str] = None,
    mismatch: float = 0.02,
    response_tokens: Optional[int] = None,
) -> CheckReport:
    """Validate ``path`` and describe its correction; see the module docstring."""
    report = CheckReport()
    try:
        _check(report, path, list(overrides), nemo_rl_path, mismatch, response_tokens)
    finally:
        # One line per problem, whatever a message from NeMo-RL or pydantic looked like.
        report.errors = [_flatten(e) for e in report.errors]
        report.unchecked = [_flatten(u) for u in report.unchecked]
    return report


def _check(
    report: CheckReport,
    path: str,
    overrides: list[str],
    nemo_rl_path: Optional[str],
    mismatch: float,
    response_tokens: Optional[int],
) -> None:
    cfg = load_recipe(path, overrides, nemo_rl_path, report)
    if cfg is None:
        return
    loss = cfg.get("loss_fn")
    if loss is None:
        report.errors.append(
            "loss_fn: missing; add a loss_fn section, e.g. loss_fn: {name: rs_clipped_pg, "
            "use_importance_sampling_correction: true, is_correction_level: sequence_mean}"
        )
        return
    if isinstance(loss, str):
        loss = {"name": loss}
    if not isinstance(loss, dict):
        report.errors.append(f"loss_fn: got a {type(loss).__name__}; expected a mapping")
        return
    name = loss.get("name")
    if name is None or name == "clipped_pg":
        # The run's own rule (the adapter's selector refuses the same sections).
        report.errors.extend(f"loss_fn.{p}" for p in own_loss_problems(loss, name))
        report.notes.append(
            f"loss_fn {'has no name' if name is None else 'names clipped_pg'}: NeMo-RL's own ClippedPGLossFn is used"
        )
    elif name != "rs_clipped_pg":
        from nemo_rs_plugin.nemo_rl.registry import LossRegistryError, get_loss_class

        try:
            get_loss_class(name)
        except (LossRegistryError, ImportError) as exc:
            report.errors.append(str(exc))
    if report.nemo_rl:
        loss = _host_loss_section(loss, report)
    try:
        own = name is None or name == "clipped_pg"
        config = RSClippedPGLossConfig.from_any({k: v for k, v in loss.items() if not (own and k in PLUGIN_FIELDS)})
    except ConfigError as exc:
        report.errors.extend(exc.problems)
        return
    report.errors.extend(_parallelism_problems(cfg, config, report))
    if report.nemo_rl:
        report.errors.extend(_master_config_problems(cfg, report))
    report.config = config
    report.pipeline = _describe(config)
    _warn(report, cfg, config, mismatch, response_tokens)


def _describe(config: RSClippedPGLossConfig) -> list[str]:
    from nemo_rs_plugin.tools.describe import describe_pipeline

    return describe_pipeline(config)


def _warn(
    report: CheckReport, cfg: dict, config: RSClippedPGLossConfig, mismatch: float, response_tokens: Optional[int]
) -> None:
    if _get(cfg, "grpo.async_grpo.enabled", False) and not config.use_importance_sampling_correction:
        report.warnings.append(
            "grpo.async_grpo.enabled is true but loss_fn.use_importance_sampling_correction is "
            "false: stale rollouts are trained on without correction (NeMo-RL requires it for "
            "async GRPO)"
        )
    tokens = (
        response_tokens
        or _get(cfg, "policy.generation.max_new_tokens")
        or _get(cfg, "policy.max_total_sequence_length")
    )
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
    from nemo_rs_plugin.tools.simulate import MismatchModel, _metrics_of, synthetic_batch

    model = MismatchModel(responses=64, length=max(16, min(tokens, 4096)), mismatch=mismatch, seed=1)
    fields = config.model_dump()
    fields.update(name=None, reference_policy_kl_penalty=0.0, sharded_logits_input=False)
    metrics, _ = _metrics_of(fields, synthetic_batch(model))
    stages = [
        (f"rejection stage {i}", metrics.get(f"rs/{f.label}/seq_rejected_frac", 0.0))
        for i, f in enumerate(config.rejection_sampling, 1)
        if f.level == "sequence"
    ]
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
            f"the filters together would reject ~{total:.0%} of sequences at {mismatch:g} per-token mismatch"
        )
