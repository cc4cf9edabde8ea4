"""``nemo-rs check``: validate a recipe's loss section and explain the correction it runs.

Loading follows NeMo-RL (:mod:`~nemo_rs_plugin.tools.recipe_loading`): with NeMo-RL
importable (``--nemo-rl PATH`` puts a checkout on the path) the recipe goes through NeMo-RL's
own ``load_config`` (``defaults`` inheritance), Hydra-style overrides, ``MasterConfig`` where
it is a pydantic model, and the loss rules of the NeMo-RL version found (v0.6.0 reads
``truncated_importance_sampling_type`` only with a ratio, as :mod:`nemo_rs_plugin.nemo_rl.loss_fn`
does). Without NeMo-RL the plugin resolves ``defaults`` itself where the files exist.
Whatever could not be checked is listed in :attr:`CheckReport.unchecked` (what, why, how to
check it), and the command then exits 3, never 0. Problems are one line each with the YAML path; nothing raises.

What NeMo-RL's GRPO start-up asserts about ``loss_fn`` together with ``grpo`` and ``policy``
fields (:mod:`~nemo_rs_plugin.tools.grpo_setup`) is checked per NeMo-RL version: an error where every version
the run may use refuses the recipe, a warning naming the versions that refuse it where only some
do (the version is not known without ``--nemo-rl``), and a ``not checked`` line where an input is
not resolved.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Optional, Sequence

from nemo_rs_plugin.core.config import (
    PLUGIN_FIELDS,
    ConfigError,
    ConfigWarning,
    RSClippedPGLossConfig,
    own_loss_problems,
)
from nemo_rs_plugin.core.filter_statistics import filter_statistic_entry
from nemo_rs_plugin.core.presets import PLUGIN_LOSS_NAME, selects_nemo_rl_loss
from nemo_rs_plugin.nemo_rl.host import (
    fused_sharded_problem,
    training_time_filtering_problem,
)
from nemo_rs_plugin.parallel.vocab_parallel import DEFAULT_LOGPROB_CHUNK_SIZE, chunk_size_problem
from nemo_rs_plugin.tools.grpo_setup import grpo_setup_problems
from nemo_rs_plugin.tools.recipe_loading import (
    HOW_TO_CHECK,
    INHERITED_NOT_FOUND,
    flatten,
    load_recipe,
    one_line,
    recipe_value,
)

__all__ = ["CheckReport", "check_recipe", "load_recipe"]

LONG_RESPONSE_TOKENS = 2048
#: The response length of the rejection estimate where neither ``--response-tokens`` nor the recipe
#: (``policy.generation.max_new_tokens``, ``policy.max_total_sequence_length``) gives one (docs/cli.md).
FALLBACK_RESPONSE_TOKENS = 4096
#: A lone B = 1 call against NeMo-RL's loss (benchmarks/bench_packing.py --compiled; docs/performance.md).
ONE_SEQUENCE_CALL_COST = (
    "1.5-1.6x NeMo-RL's loss per call eager, 0.54-0.67x with loss_fn.compile: true (forward + backward, "
    "512 tokens, one CPU thread); on an H200 1.1-1.2x eager, 0.35x compiled (host time per call)"
)
#: Sections of NeMo-RL's other algorithms' configs (examples/configs/{sft,dpo,rm,distillation}*.yaml).
OTHER_ALGORITHMS = ("sft", "dpo", "rm", "distillation")
# Sequences in the simulated batch of the rejection estimate (fewer at long lengths: same cost).
_ESTIMATE_RESPONSES, _ESTIMATE_TOKENS = 64, 8192 * 64


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
    #: The NeMo-RL versions the run may use, whose GRPO set-up rules were applied (all without NeMo-RL).
    nemo_rl_versions: tuple[str, ...] = ()
    #: Fields left out because their ``${...}`` does not resolve here (dotted path to why; also in ``unchecked``).
    unresolved: dict[str, str] = field(default_factory=dict)


def _master_config_problems(cfg: dict, report: CheckReport) -> list[str]:
    """NeMo-RL's ``MasterConfig`` on the resolved recipe; an import failure is ``unchecked``."""
    try:
        from nemo_rl.algorithms.grpo import MasterConfig
    except Exception as exc:  # noqa: BLE001 - e.g. NeMo-RL >= 0.7 on Python < 3.12
        report.unchecked.append(
            f"NeMo-RL's MasterConfig: nemo_rl.algorithms.grpo does not import here ({one_line(exc)}); " + HOW_TO_CHECK
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
        return [f"MasterConfig: {one_line(exc)}"]
    report.notes.append("validated with NeMo-RL's MasterConfig")
    return []


def _host_loss_section(loss: dict, report: CheckReport) -> dict:
    """The loss section as the NeMo-RL version found reads it (the run's own rules)."""
    from nemo_rs_plugin.nemo_rl import host

    try:
        api = host.host_api()
    except host.UnsupportedHostError as exc:
        report.errors.append(flatten(str(exc)))
        return loss
    except Exception as exc:  # noqa: BLE001
        report.unchecked.append(
            f"the loss rules of this NeMo-RL version: nemo_rl.algorithms.loss does not import here "
            f"({one_line(exc)}); " + HOW_TO_CHECK
        )
        return loss
    # The run's own rule: fields this NeMo-RL does not have, or has and the plugin does not implement.
    loss = dict(loss)
    own_loss = selects_nemo_rl_loss(loss.get("name"))
    _, problems = host.host_field_problems(loss, own_loss=own_loss)
    report.errors.extend(f"loss_fn.{p}" for p in problems)
    if not own_loss:
        for key in host.missing_host_fields(loss):
            report.notes.append(
                f"loss_fn.{key}: NeMo-RL {host.host_version()} has no such option; rs_clipped_pg computes it "
                "itself (NeMo-RL's own loss there would ignore it)"
            )
    if api != "typeddict":
        return loss
    read = host.v06_semantics(loss)
    if read != loss:
        report.notes.append(
            "NeMo-RL v0.6.0 semantics: truncated_importance_sampling_type is ignored without "
            "truncated_importance_sampling_ratio, so truncation is off"
        )
    return dict(read)


#: Qwen3's vocabulary (the shipped recipes' models): what ``check`` sizes a log-prob chunk's buffer by.
QWEN3_VOCABULARY = 151_936


def _parallelism_problems(cfg: dict, config: RSClippedPGLossConfig, report: CheckReport) -> list[str]:
    """Combinations docs/parallelism.md#sharded-input calls invalid."""
    if not config.sharded_logits_input:
        return []
    problems = []
    megatron = recipe_value(cfg, "policy.megatron_cfg.enabled")
    dtensor = recipe_value(cfg, "policy.dtensor_cfg.enabled")
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
    fused = fused_sharded_problem(megatron is True, recipe_value(cfg, "policy.megatron_cfg.use_fused_linear_logprobs"))
    filtering = training_time_filtering_problem(
        recipe_value(cfg, "policy.generation.top_k"), recipe_value(cfg, "policy.generation.top_p")
    )
    problems += [f"loss_fn.{p}" for p in (fused, filtering) if p is not None]
    chunk_problem = chunk_size_problem(recipe_value(cfg, "policy.logprob_chunk_size"))
    if chunk_problem is not None:
        problems.append(chunk_problem)
    else:
        _logprob_chunk_notes(cfg, report)
    return problems


def _logprob_chunk_notes(cfg: dict, report: CheckReport) -> None:
    """Which chunk size the log-probs from the logits shard take, what it costs, and the logits' dtype.

    Measured in docs/performance.md#log-probs-from-logits-memory.
    """
    chunk = recipe_value(cfg, "policy.logprob_chunk_size")
    tp = recipe_value(cfg, "policy.megatron_cfg.tensor_model_parallel_size")
    tp = tp if isinstance(tp, int) and tp >= 1 else 1
    size = chunk if chunk is not None else DEFAULT_LOGPROB_CHUNK_SIZE
    source = (
        "policy.logprob_chunk_size (NeMo-RL v0.7.0 on passes it to the loss; v0.6.0 does not, and the "
        f"plugin's default, {DEFAULT_LOGPROB_CHUNK_SIZE}, applies there)"
        if chunk is not None
        else "the plugin's default; policy.logprob_chunk_size is unset"
    )
    buffer_mib = size * (QWEN3_VOCABULARY / tp) * 4 / 2**20
    # The chunk spans every sequence of a loss call: one under packing (a call per sequence).
    per_call = recipe_value(cfg, "policy.train_micro_batch_size")
    several = recipe_value(cfg, "policy.sequence_packing.enabled") is not True and isinstance(per_call, int)
    calls = (
        f"; {per_call} sequences per loss call without packing: {per_call * buffer_mib:.0f} MiB"
        if several and per_call > 1
        else ""
    )
    report.notes.append(
        f"log-probs from the logits shard in chunks of {size} positions ({source}): one float32 buffer of "
        f"{size} x V/{tp} x 4 bytes per sequence at a time ({buffer_mib:.0f} MiB for Qwen3's "
        f"{QWEN3_VOCABULARY:,}-token vocabulary{calls}) besides the logits' gradient; nothing of the logits' "
        "size is saved for backward (docs/performance.md#log-probs-from-logits-memory)"
    )
    if recipe_value(cfg, "policy.megatron_cfg.defer_fp32_logits") is not True:
        report.notes.append(
            "policy.megatron_cfg.defer_fp32_logits is not true: NeMo-RL's Megatron worker hands the loss float32 "
            "logits, twice the memory of bf16 ones, and their gradient is float32 too; set it to true (NeMo-RL "
            "requires it with policy.logprob_chunk_size) and the plugin converts one chunk at a time "
            "(docs/performance.md#log-probs-from-logits-memory)"
        )


def _packing_problems(
    cfg: dict, config: RSClippedPGLossConfig, report: CheckReport, loss_name: Optional[str]
) -> list[str]:
    """Which of NeMo-RL's packing wrappers the recipe takes, and what that wrapper cannot run.

    ``policy.sequence_packing.enabled`` without ``fuse_loss`` (or on the DTensor backend, which
    has no fused wrapper): the loss is called once per sequence (docs/guide.md#sequence-packing).
    """
    if recipe_value(cfg, "policy.sequence_packing.enabled") is not True:
        _one_sequence_calls_note(cfg, config, report, loss_name)
        return []
    megatron = recipe_value(cfg, "policy.megatron_cfg.enabled")  # None: not set here (an unresolved `defaults`)
    fuse = recipe_value(cfg, "policy.sequence_packing.fuse_loss") is True
    problems: list[str] = []
    if fuse and megatron is False:
        report.warnings.append(
            "policy.sequence_packing.fuse_loss: true is read by the Megatron backend only; here NeMo-RL calls "
            "the loss once per sequence (SequencePackingLossWrapper)"
        )
    if fuse and megatron is not False:
        if config.sharded_logits_input:
            problems.append(
                "policy.sequence_packing.fuse_loss: got true with loss_fn.sharded_logits_input: true; NeMo-RL's "
                "fused packing (prepare_packed_loss_input) takes log-probs only: set fuse_loss: false or "
                "sharded_logits_input: false"
            )
        if megatron is True:
            report.notes.append("sequence packing, fused: NeMo-RL calls the loss once per microbatch")
            return problems
        report.notes.append(
            "sequence packing with fuse_loss: one loss call per microbatch on the Megatron backend "
            "(policy.megatron_cfg.enabled is not set here; on the DTensor backend one call per sequence)"
        )
    if not fuse or megatron is False:
        report.notes.append(
            "sequence packing without fuse_loss: NeMo-RL calls the loss once per sequence; the loss keeps "
            + (
                "each sequence's log-probs, made from its logits shard in that call,"
                if config.sharded_logits_input
                else "each sequence's log-probs"
            )
            + " and computes the whole microbatch in the last call, as unpacked (docs/guide.md#sequence-packing)"
        )
    return problems


def _one_sequence_calls_note(
    cfg: dict, config: RSClippedPGLossConfig, report: CheckReport, loss_name: Optional[str]
) -> None:
    """Packing off with one sequence per microbatch: every loss call pays the loss's fixed cost.

    Said only where both are known (packing explicitly off: NeMo-RL's base GRPO config turns it
    on, so an unset value may be inherited; no dynamic batching, which sizes microbatches by
    tokens instead) and where ``compile: true`` would help: the plugin's loss, eager,
    unsharded (the sharded path stays eager whatever ``compile`` says).
    """
    if recipe_value(cfg, "policy.sequence_packing.enabled") is not False:
        return
    if recipe_value(cfg, "policy.dynamic_batching.enabled") is True:
        return
    if recipe_value(cfg, "policy.train_micro_batch_size") != 1 or loss_name != PLUGIN_LOSS_NAME:
        return
    if config.compile or config.sharded_logits_input:
        return
    report.notes.append(
        "policy.train_micro_batch_size: 1 without sequence packing: every loss call holds one sequence and "
        f"pays the loss's fixed per-call cost, {ONE_SEQUENCE_CALL_COST}: set loss_fn.compile: true, or turn "
        "policy.sequence_packing on (docs/performance.md#per-call-cost-under-packing)"
    )


def check_recipe(
    path: str,
    overrides: Sequence[str] = (),
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
        report.errors = [flatten(e) for e in report.errors]
        report.unchecked = [flatten(u) for u in report.unchecked]
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
    not_grpo = _not_grpo_problem(path, cfg)
    if not_grpo is not None:
        report.errors.append(not_grpo)
        return
    loss = cfg.get("loss_fn")
    if loss is None:
        _no_loss_section(report, cfg)
        return
    if isinstance(loss, str):
        loss = {"name": loss}
    if not isinstance(loss, dict):
        report.errors.append(f"loss_fn: got a {type(loss).__name__}; expected a mapping")
        return
    if "loss_fn.name" in report.unresolved:  # which loss runs is not known here (listed as not checked)
        return
    name = loss.get("name")
    _plugin_disabled(report, name)
    if selects_nemo_rl_loss(name):
        # The run's own rule (the adapter's selector refuses the same sections).
        report.errors.extend(f"loss_fn.{p}" for p in own_loss_problems(loss, name))
        report.notes.append(
            f"loss_fn {'has no name' if name is None else 'names clipped_pg'}: NeMo-RL's own ClippedPGLossFn is used"
        )
    elif name != PLUGIN_LOSS_NAME:
        from nemo_rs_plugin.nemo_rl.registry import LossRegistryError, get_loss_class

        try:
            get_loss_class(str(name))  # not None: no name selects NeMo-RL's own loss (above)
        except (LossRegistryError, ImportError) as exc:
            report.errors.append(str(exc))
    if report.nemo_rl:
        loss = _host_loss_section(loss, report)
    # NeMo-RL's own loss: its section without the plugin's fields (refused above) and without the
    # name, which chose NeMo-RL's class (the config would warn that it is rs_clipped_pg's whatever the name).
    own = selects_nemo_rl_loss(name)
    section = {k: v for k, v in loss.items() if not (own and (k == "name" or k in PLUGIN_FIELDS))}
    unresolved = [u for u in report.unresolved if u.startswith("loss_fn.")]
    config: Optional[RSClippedPGLossConfig]
    try:
        config = RSClippedPGLossConfig.from_any(section)
    except ConfigError as exc:
        # A field left out for its unresolved interpolation is not the recipe's mistake: what its
        # absence alone makes wrong (a filter without its bound) is not an error.
        problems = [p for p in exc.problems if not _follows_from_unresolved(p, unresolved)]
        config = _without_unresolved_stages(section, unresolved) if not problems else None
        if config is None:
            report.errors.extend(problems)
            if report.nemo_rl:  # every problem at once: the rest of the recipe too (loss_fn is reported above)
                report.errors.extend(p for p in _master_config_problems(cfg, report) if not p.startswith("loss_fn"))
            grpo_setup_problems(cfg, loss, report)
            return
    report.errors.extend(_parallelism_problems(cfg, config, report))
    report.errors.extend(_packing_problems(cfg, config, report, name))
    if report.nemo_rl:
        report.errors.extend(_master_config_problems(cfg, report))
    grpo_setup_problems(cfg, loss, report)
    report.config = config
    if unresolved:  # a pipeline or a rejection estimate without those fields would not be the recipe's
        return
    report.pipeline = _describe(config)
    _warn(report, cfg, config, mismatch, response_tokens)


def _follows_from_unresolved(problem: str, unresolved: list[str]) -> bool:
    """Whether ``problem`` names a field left out as unresolved, or the mapping that held it."""
    where = problem.split(":", 1)[0].strip()
    return any(where == u or where == u.rsplit(".", 1)[0] for u in unresolved)


def _without_unresolved_stages(section: dict, unresolved: list[str]) -> Optional[RSClippedPGLossConfig]:
    """The loss section validated without the stages that lost a field, for the checks after it (or ``None``)."""
    import warnings

    prefix = "loss_fn.rejection_sampling."
    broken = {int(u[len(prefix) :].split(".")[0]) for u in unresolved if u.startswith(prefix)}
    stages = section.get("rejection_sampling")
    if isinstance(stages, list):
        section = {**section, "rejection_sampling": [f for i, f in enumerate(stages) if i not in broken]}
    try:
        with warnings.catch_warnings():  # said once already, by the section as written
            warnings.simplefilter("ignore", ConfigWarning)
            return RSClippedPGLossConfig.from_any(section)
    except ConfigError:
        return None


def _plugin_disabled(report: CheckReport, name: Optional[str]) -> None:
    """``NEMO_RS_PLUGIN_DISABLE`` set here: the run refuses a recipe naming a plugin loss (``PluginDisabledError``)."""
    from nemo_rs_plugin.nemo_rl.activation import hook

    if not hook.disabled():
        return
    setting = f"{hook.DISABLE_ENV}={os.environ.get(hook.DISABLE_ENV)}"
    if selects_nemo_rl_loss(name):
        report.notes.append(
            f"{setting} is set here, which switches nemo-rs-plugin off; this recipe trains with NeMo-RL's own "
            "loss either way"
        )
        return
    report.errors.append(
        f"loss_fn.name: got {name!r}, but {setting} is set here, which switches nemo-rs-plugin off: NeMo-RL "
        f"refuses this recipe when it loads it (PluginDisabledError) instead of training with its own loss; unset "
        f"{hook.DISABLE_ENV} (here and where the run starts), or remove loss_fn.name and the plugin's fields to "
        "train with NeMo-RL's own loss"
    )


def _no_loss_section(report: CheckReport, cfg: dict) -> None:
    """No ``loss_fn``: an error, unless it may come from ``defaults`` that were not found."""
    if "loss_fn" in report.unresolved:  # `loss_fn: ${...}`: listed as not checked, with why
        return
    inherits_unread = any(line.startswith(INHERITED_NOT_FOUND) for line in report.unchecked)
    if inherits_unread and "loss_fn" not in cfg:
        report.unchecked.append("loss_fn: not in this file; it may come from the defaults that were not found")
        return
    report.errors.append(
        f"loss_fn: missing; add a loss_fn section, e.g. loss_fn: {{name: {PLUGIN_LOSS_NAME}, "
        "use_importance_sampling_correction: true, is_correction_level: sequence_mean}"
    )


def _not_grpo_problem(path: str, cfg: dict) -> Optional[str]:
    """The one line for another algorithm's config (SFT, DPO, ...), whose ``loss_fn`` is not GRPO's.

    Only on positive evidence, an other algorithm's section and no ``grpo`` section: a partial
    recipe (or one whose ``defaults`` were not found) is checked as before, and so is one whose
    ``loss_fn`` names a loss, which is checked as that loss.
    """
    if "grpo" in cfg:
        return None
    loss = cfg.get("loss_fn")
    name = loss if isinstance(loss, str) else loss.get("name") if isinstance(loss, dict) else None
    if not selects_nemo_rl_loss(name):
        return None
    found = [s for s in OTHER_ALGORITHMS if s in cfg]
    if not found:
        return None
    return (
        f"{path}: not a GRPO recipe: got {', '.join(f'{s}:' for s in found)} and no grpo: section; the plugin's "
        "loss replaces GRPO's clipped PG loss (loss_fn.name: rs_clipped_pg): check a GRPO recipe"
    )


def _describe(config: RSClippedPGLossConfig) -> list[str]:
    from nemo_rs_plugin.tools.describe import describe_pipeline

    return describe_pipeline(config)


def _warn(
    report: CheckReport, cfg: dict, config: RSClippedPGLossConfig, mismatch: float, response_tokens: Optional[int]
) -> None:
    tokens = (
        response_tokens
        or recipe_value(cfg, "policy.generation.max_new_tokens")
        or recipe_value(cfg, "policy.max_total_sequence_length")
    )
    if (
        config.use_importance_sampling_correction
        and config.is_level_entry.grows_with_length
        and isinstance(tokens, int)
        and tokens > LONG_RESPONSE_TOKENS
    ):
        spread = mismatch * math.sqrt(tokens)
        level = f"{config.effective_is_level} ({config.is_level_entry.formula})"
        report.warnings.append(
            f"is_correction_level is {level} with responses up to {tokens} tokens: at {mismatch:g} "
            f"per-token mismatch the log-weight spreads by ~{spread:.2g} nats, so most weights collapse "
            "towards 0 and the learning rate shrinks silently; use is_correction_level: sequence_mean"
        )
    zeroes_sequences = config.truncation_entry is not None and config.truncation_entry.per_sequence
    if config.rejection_sampling or zeroes_sequences:
        length = tokens if isinstance(tokens, int) else FALLBACK_RESPONSE_TOKENS
        _warn_rejection(report, config, mismatch, length)
    if recipe_value(cfg, "grpo.async_grpo.enabled", False) and any(
        f.aggregation_entry is not None
        and f.aggregation_entry.sums_tokens
        and filter_statistic_entry(f.metric).log_space
        for f in config.rejection_sampling
    ):
        report.notes.append(
            "async GRPO with a sequence ratio band: staleness shifts whole sequences by far more than "
            "precision mismatch (docs/lab.md#confirmation: two batches stale, Geo-RS [0.99, 1.01] kept "
            "25% of the sequences, and a band calibrated from the run beat it by +0.253 [+0.219, +0.287] on the "
            "area under the eval curve, 38 seeds); set the band from your own run's "
            "log-probs (loss_fn.record_logprobs: true for a few steps): nemo-rs calibrate --from <record_dir> "
            "--recipe <this recipe>"
        )


def _warn_rejection(report: CheckReport, config: RSClippedPGLossConfig, mismatch: float, tokens: int) -> None:
    """Estimate the rejection at the recipe's response length; warn above the unhealthy share."""
    from nemo_rs_plugin.core.health import UNHEALTHY_SEQ_REJECTION
    from nemo_rs_plugin.tools.simulate import MAX_SYNTHETIC_TOKENS, MismatchModel, loss_metrics, synthetic_batch

    length = max(16, tokens)
    responses = max(16, min(_ESTIMATE_RESPONSES, _ESTIMATE_TOKENS // length))
    if responses * length > MAX_SYNTHETIC_TOKENS:
        report.warnings.append(
            f"rejection not estimated: responses of up to {length} tokens are too long to simulate here "
            f"(at most {MAX_SYNTHETIC_TOKENS // 16}); pass --response-tokens with a typical length"
        )
        return
    model = MismatchModel(responses=responses, length=length, mismatch=mismatch, seed=1)
    fields = config.model_dump()
    fields.update(name=None, reference_policy_kl_penalty=0.0, sharded_logits_input=False, record_logprobs=False)
    metrics, _ = loss_metrics(fields, synthetic_batch(model))
    stages = [
        (f"rejection stage {i}", metrics.get(f"rs/{f.label}/seq_rejected_frac", 0.0))
        for i, f in enumerate(config.rejection_sampling, 1)
        if f.level_entry.whole_sequences
    ]
    entry = config.truncation_entry
    if entry is not None and entry.per_sequence:  # it zeroes whole sequences, as a sequence filter does
        stages.append((entry.name, metrics.get("is_oob_ratio", 0.0)))
    total = metrics.get("rs_seq_rejected_frac", 0.0)
    limit = UNHEALTHY_SEQ_REJECTION
    advice = (
        f"more than {limit:.0%} is unhealthy (docs/guide.md, 'When rejection eats the batch'): widen the "
        "bounds, set them from your run with nemo-rs calibrate, or state your mismatch with --mismatch"
    )
    for label, frac in stages:
        if frac > limit:
            report.warnings.append(
                f"{label} would reject ~{frac:.0%} of sequences at {mismatch:g} per-token "
                f"mismatch over responses of up to {model.length} tokens; {advice}"
            )
    if total > limit and not any(frac > limit for _, frac in stages):
        report.warnings.append(
            f"the filters together would reject ~{total:.0%} of sequences at {mismatch:g} per-token mismatch "
            f"over responses of up to {model.length} tokens; {advice}"
        )
