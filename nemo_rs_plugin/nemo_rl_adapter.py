"""The thin NeMo-RL adapter: ``RSClippedPGLossFn`` and the seam that lets recipes select it.

* :class:`RSClippedPGLossFn` subclasses NeMo-RL's ``ClippedPGLossFn`` (``isinstance``,
  ``loss_type``, ``input_type``, ``metric_normalizations``, ``use_fused_linear_logprobs``,
  pickling) and forwards ``__call__`` to the host-independent :class:`~nemo_rs_plugin.loss.
  CorrectedPGLoss`.
* :class:`ClippedPGLossSelector` stands in for the name ``ClippedPGLossFn`` inside NeMo-RL's
  GRPO, PPO and single-controller setup modules (installed by :func:`install_into` when those
  modules are imported; see ``_nemo_rs_plugin_hook``). ``ClippedPGLossFn(loss_config, ...)``
  there builds the class named by ``loss_config.name``; without a name it builds NeMo-RL's
  own loss, exactly as before.
* :func:`patch_config_loader` adds the shorthand ``loss_fn: rs_clipped_pg`` to NeMo-RL's
  ``load_config``.

Supported hosts: NeMo-RL v0.6.0 (TypedDict config), v0.7.0 and main (pydantic config), all
with the loss in ``nemo_rl.algorithms.loss`` taking next-token log-probs.
"""

from __future__ import annotations

import inspect
from typing import Any, Mapping, Optional

try:
    from nemo_rl.algorithms.loss import ClippedPGLossFn
    from nemo_rl.algorithms.loss.interfaces import LossInputType
except ImportError as exc:  # pragma: no cover - exercised where NeMo-RL is absent
    raise ImportError(
        "RSClippedPGLossFn needs NeMo-RL, which is not importable here "
        f"({exc}). NeMo-RL is not on PyPI: install it from its git repository "
        "(git clone https://github.com/NVIDIA-NeMo/RL && uv sync, or use its container), "
        "or point PYTHONPATH at a checkout. The core loss, nemo_rs_plugin.CorrectedPGLoss, "
        "works without it."
    ) from exc

from nemo_rs_plugin.config import (
    UPSTREAM_FIELDS,
    ConfigError,
    RSClippedPGLossConfig,
    as_plain_dict,
    own_loss_problems,
)
from nemo_rs_plugin.distributed import SequenceGroups
from nemo_rs_plugin.loss import CorrectedPGLoss, metric_normalizations
from nemo_rs_plugin.registry import get_loss_class

__all__ = [
    "RSClippedPGLossFn",
    "ClippedPGLossSelector",
    "SUPPORTED_NEMO_RL",
    "host_api",
    "install_into",
    "patch_config_loader",
]

SUPPORTED_NEMO_RL = "NeMo-RL v0.6.0, v0.7.0 and main"

try:  # v0.7.0 has no MetricNormalizer; main does
    from nemo_rl.algorithms.loss.interfaces import MetricNormalizer
except ImportError:  # pragma: no cover - depends on the host version
    MetricNormalizer = None  # type: ignore[assignment,misc]


def host_api() -> str:
    """``"pydantic"`` (v0.7.0, main) or ``"typeddict"`` (v0.6.0) config API of the host.

    Raises:
        ImportError: the host's loss API is not one of the supported ones.
    """
    from nemo_rl.algorithms import loss as host_loss

    cfg_cls = getattr(host_loss, "ClippedPGLossConfig", None)
    params = list(inspect.signature(ClippedPGLossFn.__call__).parameters)
    version = _host_version()
    if cfg_cls is None or params[1:2] != ["next_token_logprobs"]:
        raise ImportError(
            f"NeMo-RL {version} is not supported by nemo-rs-plugin: its ClippedPGLossFn does "
            f"not take next-token log-probs. Supported: {SUPPORTED_NEMO_RL}."
        )
    try:
        from pydantic import BaseModel

        if isinstance(cfg_cls, type) and issubclass(cfg_cls, BaseModel):
            return "pydantic"
    except ImportError:  # pragma: no cover
        pass
    if isinstance(cfg_cls, type) and issubclass(cfg_cls, dict):
        return "typeddict"
    raise ImportError(
        f"NeMo-RL {version}: unrecognised ClippedPGLossConfig ({cfg_cls!r}). Supported: {SUPPORTED_NEMO_RL}."
    )


def _host_version() -> str:
    try:
        import nemo_rl

        return str(getattr(nemo_rl, "__version__", "unknown"))
    except Exception:  # pragma: no cover
        return "unknown"


def _host_accepts_fused_flag() -> bool:
    return "use_fused_linear_logprobs" in inspect.signature(ClippedPGLossFn.__init__).parameters


class RSClippedPGLossFn(ClippedPGLossFn):
    """NeMo-RL's clipped PG loss with decoupled IS level and composable rejection sampling.

    Formula, fields and metrics: :mod:`nemo_rs_plugin.loss` and ``docs/guide.md``. With no
    plugin field set every output equals NeMo-RL's ``ClippedPGLossFn`` on the same inputs.

    Args:
        cfg: ``loss_fn`` section (NeMo-RL's pydantic config, a dict, or any mapping);
            validated here, at construction.
        use_fused_linear_logprobs: as NeMo-RL's (``prepare_loss_input`` reads it).
    """

    def __init__(self, cfg: Any, use_fused_linear_logprobs: bool = False):
        api = host_api()
        if api == "typeddict":
            cfg = _v06_semantics(cfg)
        raw = as_plain_dict(cfg)
        host_only = _host_only_fields(raw)
        config = RSClippedPGLossConfig.from_any(raw)
        host_cfg = _host_config(config, api, host_only)
        if _host_accepts_fused_flag():
            super().__init__(host_cfg, use_fused_linear_logprobs=use_fused_linear_logprobs)
        else:
            super().__init__(host_cfg)
        self.use_fused_linear_logprobs = use_fused_linear_logprobs
        # The host saw truncation disabled (its asserts reject some decoupled-level
        # combinations); expose the real values to code that reads these attributes.
        self.truncated_importance_sampling_type = config.truncated_importance_sampling_type
        self.truncated_importance_sampling_ratio = config.truncated_importance_sampling_ratio
        self.truncated_importance_sampling_ratio_min = config.truncated_importance_sampling_ratio_min
        self.rs_config = config
        self.core = CorrectedPGLoss(config)
        if config.sharded_logits_input and use_fused_linear_logprobs:
            raise ConfigError(
                [
                    "sharded_logits_input: got true with policy.megatron_cfg.use_fused_linear_logprobs"
                    " true; the fused path returns gathered log-probs, set one of them to false"
                ]
            )
        # See: docs/parallelism.md#sharded-input
        self.input_type = LossInputType.LOGIT if config.sharded_logits_input else LossInputType.LOGPROB
        if MetricNormalizer is not None:
            self.metric_normalizations = {k: MetricNormalizer(v) for k, v in metric_normalizations(config).items()}

    def __call__(
        self,
        next_token_logprobs: Any = None,
        data: Optional[Mapping[str, Any]] = None,
        global_valid_seqs: Any = None,
        global_valid_toks: Any = None,
        logits: Any = None,
    ) -> tuple[Any, dict]:
        """NeMo-RL's ``ClippedPGLossFn.__call__``; with ``sharded_logits_input``, ``logits``.

        The sharded path reads the TP and CP groups from megatron-core's ``parallel_state``
        (NeMo-RL's Megatron worker initialises it) and returns this rank's loss share; see
        :mod:`nemo_rs_plugin.sharded` for why NeMo-RL's ``/ cp`` post-processing then gives the
        gathered path's gradients.
        """
        if data is None:
            raise TypeError("rs_clipped_pg: the data dict is required")
        dp_group = batch_data_parallel_group(self.rs_config)
        if not self.rs_config.sharded_logits_input:
            if next_token_logprobs is None:
                raise TypeError(
                    "rs_clipped_pg: next_token_logprobs is required (input_type LOGPROB); set "
                    "sharded_logits_input: true to pass logits"
                )
            return self.core(
                next_token_logprobs,
                data,
                global_valid_seqs,
                global_valid_toks,
                SequenceGroups.of(data_parallel=dp_group),
            )
        if logits is None:
            raise TypeError("rs_clipped_pg with sharded_logits_input: logits are required")
        _refuse_training_time_filtering(_callers_sampling_params())
        from nemo_rs_plugin.sharded import sharded_loss

        tp_group, cp_group = megatron_groups()
        return sharded_loss(
            self.core,
            logits,
            data,
            global_valid_seqs,
            global_valid_toks,
            cp_group=cp_group,
            tp_group=tp_group,
            pad_to_shard=True,
            data_parallel_group=dp_group,
        )


def _callers_sampling_params(max_depth: int = 4) -> Any:
    """The ``sampling_params`` NeMo-RL bound into the ``prepare_fn`` that is calling the loss.

    NeMo-RL hands a LOGIT-input loss the raw logits and applies its training-time top-k/top-p
    filtering only to LOGPROB-input losses, so the loss never sees those settings. They are
    bound (``functools.partial``) into the ``prepare_fn`` of the wrapper that calls the loss
    (``wrap_loss_fn_with_input_preparation``'s argument, ``SequencePackingLossWrapper.
    prepare_fn``): read them from the calling frames. ``tests/test_real_megatron.py`` checks,
    at every supported NeMo-RL, that this finds them.
    """
    import functools
    import sys

    frame = sys._getframe(2)
    for _ in range(max_depth):
        if frame is None:
            return None
        local = frame.f_locals
        candidate = local.get("prepare_fn")
        if candidate is None and "self" in local:
            candidate = getattr(local["self"], "prepare_fn", None)
        if isinstance(candidate, functools.partial) and "sampling_params" in candidate.keywords:
            return candidate.keywords["sampling_params"]
        frame = frame.f_back
    return None


def _refuse_training_time_filtering(params: Any) -> None:
    """Top-k/top-p training-time filtering cannot be honoured from logits: refuse it."""
    if params is None:
        return
    top_k = getattr(params, "top_k", None)
    top_p = getattr(params, "top_p", 1.0)
    if (top_k is not None and top_k > 0) or (top_p is not None and top_p != 1.0):
        raise ConfigError(
            [
                f"sharded_logits_input: got true with training-time top_k={top_k}, top_p={top_p}; "
                "NeMo-RL filters log-probs only for losses that take log-probs, so the sharded path "
                "would train on unfiltered log-probs against the sampler's filtered ones. Set "
                "loss_fn.sharded_logits_input: false (or sample without top-k/top-p)"
            ]
        )


def megatron_groups() -> tuple[Any, Any]:
    """``(tp_group, cp_group)`` from megatron-core's ``parallel_state``.

    ``(None, None)`` when megatron-core is absent or not initialised (single process,
    DTensor backend).
    """
    try:
        from megatron.core import parallel_state
    except ImportError:
        return None, None
    if not parallel_state.model_parallel_is_initialized():
        return None, None
    return (
        parallel_state.get_tensor_model_parallel_group(),
        parallel_state.get_context_parallel_group(),
    )


def batch_data_parallel_group(config: RSClippedPGLossConfig) -> Any:
    """The data-parallel group ``is_batch_normalization: data_parallel`` reduces over, or None.

    Megatron backend: megatron-core's ``get_data_parallel_group()`` (without CP: on NeMo-RL's
    gathered path every CP rank holds whole copies of the same sequences, and the sharded
    path sums the CP split through its sequence groups). A single process needs none.
    NeMo-RL's DTensor worker keeps its device mesh to itself, so with several ranks and no
    megatron-core the group is unknown: a ``ConfigError`` rather than a silent per-rank mean.
    See: docs/guide.md#batch-normalisation
    """
    if config.is_batch_normalization != "data_parallel":
        return None
    try:
        from megatron.core import parallel_state
    except ImportError:
        parallel_state = None
    if parallel_state is not None and parallel_state.model_parallel_is_initialized():
        return parallel_state.get_data_parallel_group()
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise ConfigError(
            [
                "is_batch_normalization: got 'data_parallel', but no data-parallel group is known "
                "here (megatron-core's parallel_state is not initialised, as under NeMo-RL's DTensor "
                "backend); allowed here: 'microbatch', or call the core loss with "
                "SequenceGroups(data_parallel=...)"
            ]
        )
    return None


def _v06_semantics(cfg: Any) -> Any:
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


_NO_DEFAULT = object()


def host_config_fields() -> dict[str, Any]:
    """Fields of the running NeMo-RL's ``ClippedPGLossConfig`` and their defaults.

    Read from the host at run time (pydantic ``model_fields``; a v0.6.0 TypedDict has names
    only, marked ``_NO_DEFAULT``), so a field NeMo-RL adds later is known without a release of
    the plugin.
    """
    from nemo_rl.algorithms.loss import ClippedPGLossConfig

    model_fields = getattr(ClippedPGLossConfig, "model_fields", None)
    if model_fields is not None:
        return {
            name: (f.default if f.default_factory is None else f.default_factory()) for name, f in model_fields.items()
        }
    return {name: _NO_DEFAULT for name in getattr(ClippedPGLossConfig, "__annotations__", {})}


def _host_only_fields(raw: dict) -> dict[str, Any]:
    """Remove and return the fields the host has and the plugin does not implement.

    Left at the host's default they pass through to NeMo-RL's own ``__init__``; set to
    anything else they are refused, naming the field and the NeMo-RL version, since the
    plugin's loss would silently ignore them.
    """
    host_fields = host_config_fields()
    own = set(RSClippedPGLossConfig.model_fields)
    passthrough, problems = {}, []
    for key in [k for k in raw if k in host_fields and k not in own]:
        value = raw.pop(key)
        default = host_fields[key]
        if default is _NO_DEFAULT or value == default:
            passthrough[key] = value
        else:
            problems.append(
                f"{key}: got {value!r}; NeMo-RL {_host_version()} has this option but nemo-rs-plugin "
                f"does not implement it: leave it at NeMo-RL's default ({default!r}) or use "
                "NeMo-RL's own loss (no loss_fn.name)"
            )
    if problems:
        raise ConfigError(problems)
    return passthrough


def _host_config(config: RSClippedPGLossConfig, api: str, host_only: Optional[dict] = None) -> Any:
    """The host's config for ``super().__init__``: NeMo-RL's fields, truncation off."""
    host_fields = host_config_fields()
    fields = {k: getattr(config, k) for k in UPSTREAM_FIELDS if k in host_fields}
    fields.update(host_only or {})
    fields.update(
        truncated_importance_sampling_type=None,
        truncated_importance_sampling_ratio=None,
        truncated_importance_sampling_ratio_min=None,
    )
    if api == "pydantic":
        from nemo_rl.algorithms.loss import ClippedPGLossConfig

        return ClippedPGLossConfig(**fields)
    return fields


# ----------------------------------------------------------------------------- selection
def loss_name_of(cfg: Any) -> Optional[str]:
    """``loss_fn.name`` from a pydantic config, a mapping or an object; ``None`` if unset."""
    if isinstance(cfg, str):
        return cfg
    if isinstance(cfg, Mapping):
        return cfg.get("name")
    return getattr(cfg, "name", None)


def _keys_of(cfg: Any) -> list[str]:
    if isinstance(cfg, Mapping):
        return [str(k) for k in cfg]
    extra = getattr(cfg, "model_extra", None) or {}
    return list(extra)


class PluginNotActiveError(RuntimeError):
    """A recipe names a plugin loss where the plugin cannot build it.

    Raised instead of letting NeMo-RL train with its own loss: the selector is missing from
    a NeMo-RL setup module, or NeMo-RL's own class is being built from such a config.
    """


def check_host_loss_config(cfg: Any, name: Optional[str] = None) -> None:
    """Refuse plugin fields (or near-misspellings) under NeMo-RL's own loss.

    The rule is :func:`~nemo_rs_plugin.config.own_loss_problems`, shared with ``nemo-rs check``.
    """
    problems = own_loss_problems(_keys_of(cfg), name)
    if problems:
        raise ConfigError(problems)


class ClippedPGLossSelector:
    """Stands in for ``ClippedPGLossFn`` in NeMo-RL's setup modules.

    Calling it builds the loss named by ``cfg.name`` (via the registry), or NeMo-RL's own
    class when no name is set. ``isinstance``/``issubclass`` checks and attribute access
    behave as with NeMo-RL's class.
    """

    def __init__(self, original: type):
        self.original = original

    def __call__(self, cfg: Any, *args: Any, **kwargs: Any) -> Any:
        name = loss_name_of(cfg)
        target = self.original if name is None else get_loss_class(name)
        if target is self.original:
            # NeMo-RL's own loss ignores the plugin's fields: refuse them, named or not.
            check_host_loss_config(cfg, name)
            if not _host_accepts_fused_flag():
                kwargs.pop("use_fused_linear_logprobs", None)
        return target(cfg, *args, **kwargs)

    def __instancecheck__(self, obj: Any) -> bool:
        return isinstance(obj, self.original)

    def __subclasscheck__(self, cls: type) -> bool:
        return issubclass(cls, self.original)

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.original, attr)

    def __repr__(self) -> str:
        return f"<nemo-rs-plugin selector for {self.original.__module__}.ClippedPGLossFn>"


def install_into(module: Any) -> bool:
    """Put a selector in place of ``module.ClippedPGLossFn``.

    Returns whether the selector is in place afterwards (installed now or before); ``False``
    means the module has no ``ClippedPGLossFn`` to replace: that NeMo-RL builds its loss some
    other way, and :func:`install_failure` says so.
    """
    current = getattr(module, "ClippedPGLossFn", None)
    if isinstance(current, ClippedPGLossSelector):
        return True
    if not isinstance(current, type):
        return False
    module.ClippedPGLossFn = ClippedPGLossSelector(current)
    return True


def install_failure(module: Any) -> str:
    """The message for a setup module :func:`install_into` could not patch."""
    return (
        f"nemo-rs-plugin: {module.__name__} has no class ClippedPGLossFn to replace, so the "
        f"plugin cannot select the loss there: NeMo-RL {_host_version()} builds its loss some "
        f"other way (supported: {SUPPORTED_NEMO_RL}). Recipes that name a plugin loss "
        "(loss_fn.name: rs_clipped_pg) will be refused rather than trained with NeMo-RL's own "
        "loss; check with `python -m nemo_rs_plugin.doctor`."
    )


def selector_problems() -> list[str]:
    """One message per imported NeMo-RL setup module whose ``ClippedPGLossFn`` is not a selector."""
    import sys

    from _nemo_rs_plugin_hook import LOSS_MODULES

    return [
        install_failure(sys.modules[name])
        for name in LOSS_MODULES
        if name in sys.modules
        and not isinstance(getattr(sys.modules[name], "ClippedPGLossFn", None), ClippedPGLossSelector)
    ]


def names_plugin_loss(cfg: Any) -> Optional[str]:
    """``loss_fn.name`` when it asks for something other than NeMo-RL's own loss, else ``None``."""
    name = loss_name_of(cfg)
    if name is None:
        return None
    try:
        return None if get_loss_class(name) is ClippedPGLossFn else name
    except (ImportError, ValueError):
        return name  # unknown or broken: certainly not NeMo-RL's own loss


def guard_host_loss(module: Any) -> bool:
    """Make NeMo-RL's own ``ClippedPGLossFn`` (in ``module``) refuse configs naming another loss.

    The selector covers the construction sites it is installed in; this covers every other
    one (``loss_lib.ClippedPGLossFn(cfg)``, a new setup module): a config that names a plugin
    loss must never be built by NeMo-RL's class. Subclasses (``RSClippedPGLossFn`` calls
    ``super().__init__`` with NeMo-RL's own fields) are not affected. Returns whether the guard
    was installed now.
    """
    import functools

    cls = getattr(module, "ClippedPGLossFn", None)
    init = getattr(cls, "__init__", None)
    if not isinstance(cls, type) or getattr(init, "_nemo_rs_guard", False):
        return False

    @functools.wraps(init)
    def __init__(self: Any, cfg: Any, *args: Any, **kwargs: Any) -> None:
        if type(self) is cls:
            name = names_plugin_loss(cfg)
            if name is not None:
                raise PluginNotActiveError(
                    f"loss_fn.name is {name!r}, but NeMo-RL's own ClippedPGLossFn is being built "
                    "from this config, not through nemo-rs-plugin's selector: this NeMo-RL "
                    f"({_host_version()}) constructs its loss somewhere the plugin does not patch, "
                    f"and would train with its own loss. Supported: {SUPPORTED_NEMO_RL}. "
                    "Run `python -m nemo_rs_plugin.doctor` for details."
                )
            check_host_loss_config(cfg, loss_name_of(cfg))
        init(self, cfg, *args, **kwargs)

    __init__._nemo_rs_guard = True  # type: ignore[attr-defined]
    cls.__init__ = __init__  # type: ignore[method-assign]
    return True


# ----------------------------------------------------------------------------- shorthand
SHORTHAND_HELP = (
    "loss_fn: write the mapping form,\n"
    "  loss_fn:\n"
    "    name: rs_clipped_pg\n"
    "    # ...plugin fields (is_correction_level, rejection_sampling)\n"
    "the shorthand `loss_fn: rs_clipped_pg` cannot be merged with a loss_fn mapping "
    "inherited through `defaults`."
)


def patch_config_loader(module: Any) -> bool:
    """Wrap ``module.load_config``: the ``loss_fn: <name>`` shorthand, and an early refusal.

    ``loss_fn: <name>`` becomes ``loss_fn: {name: <name>}``. A recipe naming a plugin loss is
    refused here, before any worker starts, when the selector is missing from an imported
    NeMo-RL setup module (:func:`selector_problems`).
    """
    original = getattr(module, "load_config", None)
    if original is None or getattr(original, "_nemo_rs_wrapped", False):
        return False

    def load_config(config_path: Any, *args: Any, **kwargs: Any) -> Any:
        config = original(config_path, *args, **kwargs)
        loss = config.get("loss_fn") if hasattr(config, "get") else None
        if isinstance(loss, str):
            # OmegaConf lets a string replace an inherited mapping silently, which would
            # drop the parent's loss settings: refuse, and show the mapping form.
            if _inherits_loss_mapping(config_path, original):
                raise ConfigError([SHORTHAND_HELP])
            config["loss_fn"] = {"name": loss}
            loss = config["loss_fn"]
        name = names_plugin_loss(loss) if loss is not None else None
        if name is not None:
            problems = selector_problems()
            if problems:
                raise PluginNotActiveError(
                    f"{config_path}: loss_fn.name is {name!r}, but NeMo-RL would train with its "
                    "own loss:\n  " + "\n  ".join(problems)
                )
        return config

    load_config._nemo_rs_wrapped = True  # type: ignore[attr-defined]
    load_config.__doc__ = original.__doc__
    load_config.__wrapped__ = original  # type: ignore[attr-defined]
    module.load_config = load_config
    return True


def _inherits_loss_mapping(config_path: Any, load: Any) -> bool:
    """Whether any recipe named in ``defaults`` of ``config_path`` defines a loss_fn mapping."""
    import yaml

    from nemo_rs_plugin.recipes import parent_paths

    with open(config_path) as fh:
        raw = yaml.safe_load(fh) or {}
    return any(hasattr(load(path).get("loss_fn"), "keys") for path in parent_paths(config_path, raw))


def _guard_when_imported_first() -> None:
    # Importing this module may be what first imports NeMo-RL's loss module; the start-up
    # hook then finds this module incomplete and leaves the guard to it.
    import sys

    hook = sys.modules.get("_nemo_rs_plugin_hook")
    if hook is not None and hook.installed() and not hook.disabled():
        guard_host_loss(sys.modules[ClippedPGLossFn.__module__])


_guard_when_imported_first()
