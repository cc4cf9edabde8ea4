"""Configuration of the ``rs_clipped_pg`` loss, validated once at construction.

One pydantic model, :class:`RSClippedPGLossConfig`, holds every field of NeMo-RL's
``ClippedPGLossConfig`` (same names, same defaults) plus the plugin's fields:

* ``is_correction_level``: the level of the importance-sampling (IS) weight, decoupled from
  ``sequence_level_importance_ratios`` (which keeps choosing the GSPO policy ratio only).
* ``rejection_sampling``: an ordered list of filters (:class:`RejectionFilter`).
* ``rejection_denominator``: what the loss divides by after rejection.
* ``is_batch_normalization``: IS weights divided by their batch mean (VERL, slime).
* ``sampler_kl_penalty``: a penalty ``tau * (log pi_curr - log pi_gen)^2`` toward the
  sampler (prime-rl's ``kl_tau``).

NeMo-RL checks most of its combinations with ``assert`` inside the loss; here every one of
them is a :class:`ConfigError` raised at construction, with a message that names the field,
the value and what is allowed. Build it with :meth:`RSClippedPGLossConfig.from_any`, which
takes a plain dict, an OmegaConf/Hydra mapping, NeMo-RL's pydantic config or any object with
attributes.
"""

from __future__ import annotations

import difflib
import warnings
from collections.abc import Mapping
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from nemo_rs_plugin.core.registries.filter_options import DENOMINATORS, Denominator
from nemo_rs_plugin.core.registries.is_levels import IS_LEVELS, ISLevel, is_levels_text
from nemo_rs_plugin.core.registries.truncation import Truncation, truncation, truncations_text
from nemo_rs_plugin.core.settings.config_errors import (
    blames,
    failed_locations,
    format_validation_error,
    left_out,
    without_coercions,
    without_locations,
)
from nemo_rs_plugin.core.settings.config_problems import (
    batch_normalization_problems,
    duplicate_label_problems,
    filter_problems,
    loss_type_problems,
    range_problems,
    setting_warnings,
    truncation_problems,
    valid_filters,
)
from nemo_rs_plugin.core.settings.rejection_filter import (
    AnyRejectionFilter,
    RejectionFilter,
    SequenceFilter,
    TokenFilter,
)

__all__ = [
    "ConfigError",
    "ConfigWarning",
    "ISCorrectionLevel",
    "RejectionFilter",
    "RSClippedPGLossConfig",
    "SequenceFilter",
    "TokenFilter",
    "UPSTREAM_FIELDS",
    "PLUGIN_FIELDS",
    "own_loss_problems",
]

ISCorrectionLevel = Literal["token", "sequence", "sequence_mean"]
TruncationType = Literal["tis", "icepop", "seq-mask-tis"]
BatchNormalization = Literal["microbatch", "data_parallel"]


class ConfigError(ValueError, AssertionError):
    """An invalid loss configuration; the message has one line per problem.

    A ``ValueError``; also an ``AssertionError`` because NeMo-RL raises that for the same
    invalid combinations, and code written against NeMo-RL may catch it.
    """

    def __init__(self, problems: list[str], prefix: str = "loss_fn"):
        self.problems = [f"{prefix}.{p}" if prefix else p for p in problems]
        super().__init__("invalid loss configuration:\n  " + "\n  ".join(self.problems))


class ConfigWarning(UserWarning):
    """A legal setting that does nothing here (e.g. ``is_correction_level`` with the correction off).

    Issued once per construction, one line naming the field, the value and why it has no effect;
    ``nemo-rs check`` prints it as a ``warning:`` line.
    """


class NeMoRLLossFields(BaseModel):
    """The fields of NeMo-RL's ``ClippedPGLossConfig`` (v0.7.0 / main), with NeMo-RL's defaults.

    The fields declared here are :data:`UPSTREAM_FIELDS`; those :class:`RSClippedPGLossConfig`
    adds are :data:`PLUGIN_FIELDS`: both lists are read off the classes, never written out.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    name: Optional[str] = None
    """Registry name of the loss (``rs_clipped_pg``); ``None`` when built directly."""

    # --- Loss type (NeMo-RL) ---
    disable_ppo_ratio: bool = False
    """REINFORCE: use ``log pi`` instead of the PPO ratio."""
    token_level_loss: bool = True
    """Token-mean loss when true; mean of per-sequence means when false."""
    sequence_level_importance_ratios: bool = False
    """GSPO policy ratio ``exp(mean_t(curr - prev))``; needs ``token_level_loss: false``."""

    # --- Clipping (NeMo-RL) ---
    ratio_clip_min: float = 0.2
    """PPO clip ``1 - ratio_clip_min``."""
    ratio_clip_max: float = 0.2
    """PPO clip ``1 + ratio_clip_max``."""
    ratio_clip_c: Optional[float] = None
    """Dual clip constant (> 1) for negative advantages; ``None`` disables it."""

    # --- KL regularization (NeMo-RL) ---
    reference_policy_kl_penalty: float = 0.01
    """Coefficient of the KL penalty to the reference policy."""
    reference_policy_kl_type: Literal["k1", "k2", "k3"] = "k3"
    """Schulman's KL estimator used for the penalty."""
    kl_input_clamp_value: Optional[float] = 20.0
    """Clamp of the reference log-ratio before the estimator; ``None`` disables it."""
    kl_output_clamp_value: Optional[float] = 10.0
    """Clamp of the per-token KL value; ``None`` disables it."""
    use_kl_in_reward: bool = False
    """Reinforce++: the KL goes into the reward, so the loss has no KL term."""

    # --- Importance sampling correction (NeMo-RL) ---
    use_importance_sampling_correction: bool = False
    """Multiply the policy-gradient term by the IS weight ``pi_prev / pi_gen``."""
    truncated_importance_sampling_type: Optional[TruncationType] = Field(
        default=None,
        description=(
            f"{truncations_text()} (the band ``[min, max]`` is the two ratio bounds below; ``w`` the IS weight "
            "at the chosen level, ``g = exp(sum_t m_t d_t / n)`` the sequence's geometric-mean ratio)."
        ),
    )
    truncated_importance_sampling_ratio: Optional[float] = None
    """Upper truncation bound (> 0)."""
    truncated_importance_sampling_ratio_min: Optional[float] = None
    """Lower truncation bound; required for ``icepop`` and ``seq-mask-tis``."""

    # --- On-policy and variants (NeMo-RL) ---
    use_on_policy_kl_approximation: bool = False
    """Weight the KL penalty by ``pi_curr / pi_gen`` (on-policy KL gradient)."""
    force_on_policy_ratio: bool = False
    """Force the PPO ratio to 1 (one update per rollout); ``prev`` becomes ``curr``."""
    use_cispo: bool = False
    """CISPO: ``-A * sg(clip(r)) * log pi``."""
    positive_example_nll_weight: float = 0.0
    """VAPO: weight of an NLL term on samples with reward > 0."""


class RSClippedPGLossConfig(NeMoRLLossFields):
    """Validated configuration of ``rs_clipped_pg``: NeMo-RL's fields and the plugin's.

    With every plugin field at its default the loss is NeMo-RL's ``ClippedPGLossFn``: same
    loss, gradient and metrics (see ``docs/configuration-reference.md``).
    """

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    # --- Plugin: decoupled IS level ---
    is_correction_level: Optional[ISCorrectionLevel] = Field(
        default=None,
        description=(
            "Level of the IS weight, independent of ``sequence_level_importance_ratios``: "
            f"{is_levels_text()} (``d = prev - gen``, ``m`` the valid tokens of the sequence, ``n`` their "
            "count). ``None``: ``sequence`` if ``sequence_level_importance_ratios`` else ``token`` (NeMo-RL's "
            "behaviour). For responses of thousands of tokens pick ``sequence_mean``."
        ),
    )

    is_batch_normalization: Optional[BatchNormalization] = None
    """Divide the IS weights (after truncation) by their batch mean, so that they average 1
    (VERL ``rollout_is_batch_normalize``, slime ``tis_batch_normalize``). The mean is over
    the IS level's units before rejection: valid tokens (``token``), or sequences with a
    valid token (``sequence``, ``sequence_mean``); weights zeroed by truncation count as 0.
    ``microbatch``: the units of this loss call (slime: one microbatch of one
    data-parallel rank); ``data_parallel``: also those of the other data-parallel ranks'
    microbatches (VERL; SUM over the data-parallel group). A mean <= 1e-8 leaves the
    weights as they are. ``None`` disables it."""

    # --- Plugin: rejection sampling ---
    rejection_sampling: tuple[AnyRejectionFilter, ...] = Field(default_factory=tuple)
    """Ordered filters, each the kind its ``level`` names (``TokenFilter``, ``SequenceFilter``).
    A sequence filter aggregates over the tokens kept by the token
    filters listed before it; a token filter only matters on sequences kept by the
    sequence filters before it."""
    rejection_denominator: Literal["original", "kept"] = "original"
    """``original`` (default; NeMo-RL, AReaL, SkyRL, TRL, slime): rejected units count in
    the denominators. ``kept`` (VERL decoupled): the denominators shrink by the
    microbatch's kept fraction."""

    # --- Plugin: penalty toward the sampler ---
    sampler_kl_penalty: float = 0.0
    """Coefficient ``tau`` of a penalty toward the inference engine's policy: per token
    ``tau * (curr - gen)^2`` (``curr``, ``gen``: log-probs of the sampled token under the
    current and the generating policy), prime-rl's ``kl_tau`` term, with its gradient
    ``2 tau (curr - gen)``. Not IS-weighted; averaged like the other loss terms over the
    tokens in the loss: filters with ``applies_to: loss`` remove it, filters with
    ``applies_to: policy_gradient`` do not. Reported (without ``tau``) as the metric
    ``sampler_kl_penalty``. ``0`` (default) switches it off."""

    # --- Plugin: input path ---
    sharded_logits_input: bool = False
    """Megatron backend: take the local logits shard ``[B, S/cp, V/tp]`` (NeMo-RL's
    ``LossInputType.LOGIT``) instead of all-gathered log-probs; log-probs come from a
    vocab-parallel log-softmax and only O(batch) per-sequence statistics are all-reduced
    over the CP group. See docs/parallelism.md."""

    # --- Plugin: recording for calibration ---
    record_logprobs: bool = False
    """Write what ``nemo-rs calibrate --from DIR`` and ``nemo-rs simulate --from DIR`` read:
    every ``record_every`` optimizer steps, each microbatch's ``prev_logprobs``,
    ``generation_logprobs``, masks and advantages as one torch file under ``record_dir``
    (one writer per copy of the data; off: no cost; see docs/guide.md#calibrate-from-your-run
    and nemo_rs_plugin/nemo_rl/recording.py). Read by the NeMo-RL loss only."""
    record_dir: str = "nemo-rs-records"
    """Folder of the records (created; relative to the worker's working directory)."""
    record_every: int = 10
    """Record optimizer steps ``0, record_every, 2 * record_every, ...`` (at least 1)."""

    # --- Plugin: execution ---
    compile: bool = False
    """``torch.compile`` the loss's tensor math (dynamic shapes: one graph for every microbatch
    size; the sharded TP/CP path stays eager). Opt-in: see docs/performance.md#torchcompile."""

    @model_validator(mode="before")
    @classmethod
    def _refuse_coercions(cls, data: Any) -> Any:
        """Strings (and booleans for numbers) are refused, not coerced (``"0.28"``, ``"no"``)."""
        if isinstance(data, Mapping):
            _, problems, _ = without_coercions(dict(data), cls.model_fields)
            if problems:
                raise ValueError("\n".join(problems))
        return data

    @model_validator(mode="after")
    def _check_combinations(self) -> "RSClippedPGLossConfig":
        problems = self._problems()
        if problems:
            raise ValueError("\n".join(problems))
        for line in self.config_warnings:
            warnings.warn(f"loss_fn.{line}", ConfigWarning, stacklevel=2)
        return self

    def _problems(self) -> list[str]:
        """Every invalid combination, one line each, in the order NeMo-RL's checks meet them."""
        return [
            *range_problems(self),
            *loss_type_problems(self),
            *truncation_problems(self),
            *batch_normalization_problems(self),
            *self._filter_problems(),
            *duplicate_label_problems(self.rejection_sampling),
        ]

    @property
    def config_warnings(self) -> list[str]:
        """Legal settings that do nothing here, one line each (issued as :class:`ConfigWarning`)."""
        return setting_warnings(self)

    def _filter_problems(self) -> list[str]:
        """Filters that cannot work with the rest of the configuration."""
        return filter_problems(enumerate(self.rejection_sampling), self.force_on_policy_ratio)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_any(cls, cfg: Any, prefix: str = "loss_fn") -> "RSClippedPGLossConfig":
        """Build and validate from a dict, a mapping, a pydantic model or an object.

        Raises:
            ConfigError: one line per invalid field or combination, each naming the field,
                the value and what is allowed (with a suggestion for a misspelled key).
        """
        if isinstance(cfg, cls):
            return cfg
        raw = as_plain_dict(cfg)
        problems: list[str] = []
        known = set(cls.model_fields)
        for key in raw:
            if key not in known:
                guess = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
                hint = f"; did you mean {guess[0]!r}?" if guess else ""
                problems.append(f"{key}: unknown field{hint} (fields: see docs/configuration-reference.md)")
        # Every problem at once: unknown fields, refused coercions, then the fields that fail on
        # their own, and the combinations of the fields that did not (validated again without
        # the failed ones, which pydantic's combination checks would otherwise wait for).
        raw, coercions, failed = without_coercions({k: v for k, v in raw.items() if k in known}, cls.model_fields)
        problems += coercions
        as_filters = {k: raw[k] for k in ("rejection_sampling",) if k in raw}
        config = None
        for attempt in range(3):
            try:
                with warnings.catch_warnings():
                    if problems or attempt:  # no warnings from a section refused anyway
                        warnings.simplefilter("ignore", ConfigWarning)
                    config = cls(**raw)
                break
            except ValidationError as exc:
                newly = failed_locations(exc) - failed
                for line in format_validation_error(exc):
                    if line not in problems and not blames(line, failed):
                        problems.append(line)
                if not newly:
                    break
                failed |= newly
                raw = without_locations(raw, newly)
        if "rejection_sampling" in left_out(failed) and "rejection_sampling" in as_filters:
            # A failing filter kept the section's checks from running: run the filter checks on
            # the filters that are valid on their own.
            force = raw.get("force_on_policy_ratio") is True
            problems += [
                p for p in filter_problems(valid_filters(as_filters["rejection_sampling"]), force) if p not in problems
            ]
        if problems or config is None:
            raise ConfigError(problems, prefix)
        return config

    @property
    def effective_is_level(self) -> str:
        """The IS level in force: explicit, or NeMo-RL's tie to the GSPO flag (:attr:`is_level_entry`'s name)."""
        return self.is_level_entry.name

    @property
    def is_level_entry(self) -> ISLevel:
        """The :data:`~nemo_rs_plugin.core.registries.is_levels.IS_LEVELS` entry of the IS level in force.

        ``is_correction_level``, or where it is unset NeMo-RL's tie to the GSPO flag (``sequence``
        with ``sequence_level_importance_ratios``, else ``token``). Validated at construction: a
        plain lookup, on every loss call.
        """
        level = self.is_correction_level
        if level is None:
            level = "sequence" if self.sequence_level_importance_ratios else "token"
        return IS_LEVELS[level]

    @property
    def denominator_entry(self) -> Denominator:
        """The :data:`~nemo_rs_plugin.core.registries.filter_options.DENOMINATORS` entry of the denominator."""
        return DENOMINATORS[self.rejection_denominator]

    @property
    def truncation_entry(self) -> Optional[Truncation]:
        """The :data:`~nemo_rs_plugin.core.registries.truncation.TRUNCATIONS` entry of the type (``None``: none)."""
        t = self.truncated_importance_sampling_type
        return None if t is None else truncation(t)


#: NeMo-RL's loss fields (``name`` aside), in declaration order.
UPSTREAM_FIELDS = tuple(n for n in NeMoRLLossFields.model_fields if n != "name")
#: The fields the plugin adds.
PLUGIN_FIELDS = tuple(n for n in RSClippedPGLossConfig.model_fields if n not in NeMoRLLossFields.model_fields)


def own_loss_problems(keys: Any, name: Optional[str] = None) -> list[str]:
    """Fields of a loss section that selects NeMo-RL's own loss and would be silently ignored.

    ``keys`` are the section's field names; ``name`` is the ``loss_fn.name`` that selected
    NeMo-RL's loss (``None``: no name). A plugin field, or a near-misspelling of one, is a
    problem: NeMo-RL's loss accepts extra fields and would train without the correction. One
    rule for the run (the adapter's selector) and ``nemo-rs check``.
    """
    fix = (
        "add `name: rs_clipped_pg` to loss_fn"
        if name is None
        else f"set `name: rs_clipped_pg` (name {name!r} is NeMo-RL's own loss)"
    )
    problems = []
    for key in (str(k) for k in keys):
        if key in PLUGIN_FIELDS:
            problems.append(f"{key}: a nemo-rs-plugin field under NeMo-RL's own loss, which would ignore it; {fix}")
        elif key not in UPSTREAM_FIELDS and key != "name":
            guess = difflib.get_close_matches(key, PLUGIN_FIELDS, n=1, cutoff=0.75)
            if guess:
                problems.append(f"{key}: unknown field; did you mean {guess[0]!r} (with `name: rs_clipped_pg`)?")
    return problems


def as_plain_dict(cfg: Any) -> dict[str, Any]:
    """A loss section (mapping, pydantic model with its extras, DictConfig, object) as a dict."""
    if cfg is None:
        return {}
    if isinstance(cfg, BaseModel):
        data = cfg.model_dump()
        # pydantic models with extra="allow" (NeMo-RL's) keep extras in model_extra.
        data.update(getattr(cfg, "model_extra", None) or {})
        return _to_builtin(data)
    if isinstance(cfg, Mapping):
        return _to_builtin(dict(cfg))
    try:  # OmegaConf DictConfig without importing omegaconf
        from omegaconf import DictConfig, OmegaConf

        if isinstance(cfg, DictConfig):
            container = OmegaConf.to_container(cfg, resolve=True)  # a DictConfig gives a dict
            if isinstance(container, dict):
                return {str(k): v for k, v in container.items()}
    except ImportError:
        pass
    if hasattr(cfg, "__dict__"):
        return _to_builtin({k: v for k, v in vars(cfg).items() if not k.startswith("_")})
    raise ConfigError([f": got {type(cfg).__name__}; allowed: a mapping or an object"], "loss_fn")


def _to_builtin(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _to_builtin(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_to_builtin(v) for v in value]
    if hasattr(value, "items") and hasattr(value, "keys"):  # DictConfig-like
        return {str(k): _to_builtin(value[k]) for k in value.keys()}
    return value
