"""The rules that depend on the NeMo-RL version running the loss: one place for the run and ``check``.

NeMo-RL is imported inside the functions, never at import time, so ``nemo-rs check`` can read
these rules where NeMo-RL is absent and ask the host only when one is found.

* :func:`host_api`: ``"pydantic"`` (v0.7.0, main) or ``"typeddict"`` (v0.6.0) config API;
  :class:`UnsupportedHostError` for any other NeMo-RL.
* :func:`v06_semantics`: a v0.6.0 loss section read the way v0.6.0 reads it.
* :func:`host_field_problems` and :func:`host_config`: the host's own fields (passed through at their
  default, refused when set), NeMo-RL's fields this host lacks (refused when set), and the config
  handed to NeMo-RL's ``__init__``.
* :func:`fused_sharded_problem` and :func:`training_time_filtering_problem`: the two
  combinations the sharded input path cannot honour, with one wording for the run and ``check``.
"""

from __future__ import annotations

import inspect
import numbers
from typing import Any, Mapping, Optional

from nemo_rs_plugin.core.settings.config import UPSTREAM_FIELDS, RSClippedPGLossConfig
from nemo_rs_plugin.core.settings.config_errors import shown

__all__ = [
    "SUPPORTED_NEMO_RL",
    "UnsupportedHostError",
    "host_api",
    "host_version",
    "host_accepts_fused_flag",
    "host_config_fields",
    "host_field_problems",
    "per_sequence_packing_problem",
    "missing_host_fields",
    "host_config",
    "v06_semantics",
    "fused_sharded_problem",
    "training_time_filtering_problem",
]

SUPPORTED_NEMO_RL = "NeMo-RL v0.6.0, v0.7.0 and main"
#: A v0.6.0 (TypedDict) config field has a name but no default.
NO_DEFAULT = object()


class UnsupportedHostError(ImportError):
    """NeMo-RL is importable, but its loss API is not one the plugin supports."""


def _host_loss_module() -> Any:
    from nemo_rl.algorithms import loss

    return loss


def host_version() -> str:
    """NeMo-RL's ``__version__``, or ``"unknown"``."""
    try:
        import nemo_rl

        return str(getattr(nemo_rl, "__version__", "unknown"))
    except Exception:  # noqa: BLE001 - a version string only, for messages
        return "unknown"


def host_api() -> str:
    """``"pydantic"`` (v0.7.0, main) or ``"typeddict"`` (v0.6.0) config API of the host.

    Raises:
        ImportError: NeMo-RL's loss module does not import here.
        UnsupportedHostError: the host's loss API is not one of the supported ones.
    """
    host_loss = _host_loss_module()
    cfg_cls = getattr(host_loss, "ClippedPGLossConfig", None)
    params = list(inspect.signature(host_loss.ClippedPGLossFn.__call__).parameters)
    if cfg_cls is None or params[1:2] != ["next_token_logprobs"]:
        raise UnsupportedHostError(
            f"NeMo-RL {host_version()} is not supported by nemo-rs-plugin: its ClippedPGLossFn does "
            f"not take next-token log-probs. Supported: {SUPPORTED_NEMO_RL}."
        )
    from pydantic import BaseModel

    if isinstance(cfg_cls, type) and issubclass(cfg_cls, BaseModel):
        return "pydantic"
    if isinstance(cfg_cls, type) and issubclass(cfg_cls, dict):
        return "typeddict"
    raise UnsupportedHostError(
        f"NeMo-RL {host_version()}: unrecognised ClippedPGLossConfig ({cfg_cls!r}). Supported: {SUPPORTED_NEMO_RL}."
    )


def host_accepts_fused_flag() -> bool:
    """Whether NeMo-RL's ``ClippedPGLossFn.__init__`` takes ``use_fused_linear_logprobs``."""
    init = _host_loss_module().ClippedPGLossFn.__init__
    return "use_fused_linear_logprobs" in inspect.signature(init).parameters


def host_config_fields() -> dict[str, Any]:
    """Fields of the running NeMo-RL's ``ClippedPGLossConfig`` and their defaults.

    Read from the host at run time (pydantic ``model_fields``; a v0.6.0 TypedDict has names
    only, marked ``NO_DEFAULT``), so a field NeMo-RL adds later is known without a release of
    the plugin.
    """
    config_class = _host_loss_module().ClippedPGLossConfig
    model_fields = getattr(config_class, "model_fields", None)
    if model_fields is not None:
        return {
            name: (f.default if f.default_factory is None else f.default_factory()) for name, f in model_fields.items()
        }
    return {name: NO_DEFAULT for name in getattr(config_class, "__annotations__", {})}


def v06_semantics(cfg: Any) -> Any:
    """Read a v0.6.0 loss section the way NeMo-RL v0.6.0 does.

    v0.6.0 enables truncation only when ``truncated_importance_sampling_ratio`` is set (its
    recipes carry ``truncated_importance_sampling_type: tis`` with a null ratio, and it
    ignores the type then); later versions reject that combination.
    """
    if not isinstance(cfg, Mapping):
        return cfg
    if cfg.get("truncated_importance_sampling_ratio") is None and (
        cfg.get("truncated_importance_sampling_type") is not None
        or cfg.get("truncated_importance_sampling_ratio_min") is not None
    ):
        cfg = dict(cfg)
        cfg["truncated_importance_sampling_type"] = None
        cfg["truncated_importance_sampling_ratio_min"] = None
    return cfg


def missing_host_fields(raw: Mapping) -> list[str]:
    """NeMo-RL loss fields set away from their default that the running NeMo-RL does not have.

    Read from the host's own ``ClippedPGLossConfig`` (pydantic fields, or a TypedDict's
    annotations), never listed here: ``use_cispo`` and ``positive_example_nll_weight`` on
    v0.6.0. A config class that declares no field tells nothing: then none is missing.
    """
    host_fields = host_config_fields()
    if not host_fields:
        return []
    own = RSClippedPGLossConfig.model_fields
    return [k for k in UPSTREAM_FIELDS if k in raw and k not in host_fields and raw[k] != own[k].default]


def host_field_problems(raw: dict, own_loss: bool = False) -> tuple[dict[str, Any], list[str]]:
    """The loss section against the running NeMo-RL's own fields: one rule for the run and ``check``.

    * A field the host has and the plugin does not implement is removed from ``raw`` and
      returned (at the host's default it passes through to NeMo-RL's own ``__init__``); set,
      it is refused: the plugin's loss would silently ignore it.
    * With ``own_loss`` (the section builds NeMo-RL's own ``ClippedPGLossFn``), a NeMo-RL field
      this host does not have (:func:`missing_host_fields`) set is refused: NeMo-RL's loss there
      ignores it and would train something else than the recipe says (``use_cispo: true`` on
      v0.6.0 trains plain PPO). The plugin's loss computes those fields itself on every host
      (on v0.6.0, the loss of v0.7.0: docs/install.md#versions), so for it they are no problem.

    Each problem names the field, the value and the NeMo-RL version (without ``loss_fn.``).

    Returns:
        ``(passthrough, problems)``: the host-only fields to hand to NeMo-RL, one line per problem.
    """
    host_fields = host_config_fields()
    own = RSClippedPGLossConfig.model_fields
    passthrough, problems = {}, []
    for key in [k for k in raw if k in host_fields and k not in own]:
        value = raw.pop(key)
        default = host_fields[key]
        if default is NO_DEFAULT or value == default:
            passthrough[key] = value
        else:
            problems.append(
                f"{key}: got {value!r}; NeMo-RL {host_version()} has this option but nemo-rs-plugin "
                f"does not implement it: leave it at NeMo-RL's default ({default!r}) or use "
                "NeMo-RL's own loss (no loss_fn.name)"
            )
    if own_loss:
        problems += missing_field_problems(raw)
    return passthrough, problems


def missing_field_problems(raw: Mapping) -> list[str]:
    """One line per NeMo-RL field set in ``raw`` that this NeMo-RL's own loss does not have.

    The run refuses them when the section builds NeMo-RL's own loss (``nemo_rl/activation.py``),
    ``nemo-rs check`` through :func:`host_field_problems`.
    """
    own = RSClippedPGLossConfig.model_fields
    return [
        f"{key}: got {shown(raw[key])}; NeMo-RL {host_version()} has no {key} (its ClippedPGLossConfig "
        f"does not declare it), so its own loss would ignore it and train without it; allowed on this "
        f"NeMo-RL: {shown(own[key].default)} (the default), or name: rs_clipped_pg (the plugin computes "
        "it), or a NeMo-RL that has it"
        for key in missing_host_fields(raw)
    ]


def host_config(config: RSClippedPGLossConfig, api: str, host_only: Optional[dict] = None) -> Any:
    """The host's config for ``super().__init__``: NeMo-RL's fields, truncation off.

    Truncation is off because the host's asserts reject some of the decoupled IS levels'
    combinations; the plugin applies the real values itself.
    """
    host_fields = host_config_fields()
    fields = {k: getattr(config, k) for k in UPSTREAM_FIELDS if k in host_fields}
    fields.update(host_only or {})
    fields.update(
        truncated_importance_sampling_type=None,
        truncated_importance_sampling_ratio=None,
        truncated_importance_sampling_ratio_min=None,
    )
    if api == "pydantic":
        return _host_loss_module().ClippedPGLossConfig(**fields)
    return fields


def fused_sharded_problem(sharded_logits_input: Any, use_fused_linear_logprobs: Any) -> Optional[str]:
    """The sharded input path with Megatron's fused linear log-probs: one cannot feed the other.

    See: docs/parallelism.md#sharded-input
    """
    if sharded_logits_input is True and use_fused_linear_logprobs is True:
        return (
            "sharded_logits_input: got true with policy.megatron_cfg.use_fused_linear_logprobs true; "
            "the fused path returns gathered log-probs, set one of them to false"
        )
    return None


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def training_time_filtering_problem(top_k: Any, top_p: Any) -> Optional[str]:
    """Training-time top-k/top-p filtering with the sharded input path, which cannot honour it.

    NeMo-RL filters log-probs at training time only for losses that take log-probs; the
    sharded path takes logits and would train on unfiltered log-probs against the sampler's
    filtered ones. ``top_k`` filters when it is a number above 0, ``top_p`` when it is a
    number other than 1.
    """
    filters_k = _is_number(top_k) and top_k > 0
    filters_p = _is_number(top_p) and top_p != 1.0
    if not (filters_k or filters_p):
        return None
    return (
        f"sharded_logits_input: got true with training-time top-k/top-p filtering (top_k: {top_k}, "
        f"top_p: {top_p}); NeMo-RL filters log-probs only for losses that take log-probs, so the sharded "
        "path would train on unfiltered log-probs against the sampler's filtered ones: set "
        "sharded_logits_input: false, or top_k: null and top_p: 1.0 (policy.generation)"
    )


def per_sequence_packing_problem(problems: list[str], *, logits_input: bool) -> str:
    """The one message for a configuration that NeMo-RL's per-sequence packing wrapper would change.

    Read by the loss on the wrapper's first call, where the wrapper does not say which sequence
    a call is (no ``seq_idx``): each call is then computed on its own sequence instead of being
    gathered. ``logits_input``: the way out cannot be NeMo-RL's fused packing alone, which takes
    log-probs only.
    """
    why = "this wrapper does not say which sequence a call is (no seq_idx), so each call computes its own"
    fixes = "policy.sequence_packing.fuse_loss: true (Megatron backend: one call per microbatch)"
    if logits_input:
        fixes = f"sharded_logits_input: false with {fixes}"
    return (
        "policy.sequence_packing: enabled without fuse_loss, so NeMo-RL calls this loss once per sequence "
        f"(SequencePackingLossWrapper), {why}, and "
        + "; ".join(problems)
        + f": those exist only one sequence at a time there. Set {fixes}, or policy.sequence_packing.enabled: "
        "false, or remove the setting"
    )
