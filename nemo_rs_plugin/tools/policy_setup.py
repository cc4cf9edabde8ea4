"""What the recipe's policy settings mean for the loss: backend, sharded logits, log-prob chunks, packing.

Read by ``nemo-rs check`` (:mod:`~nemo_rs_plugin.tools.check`) once the loss section is valid:
:func:`parallelism_problems` checks ``loss_fn.sharded_logits_input`` against the backend
(docs/parallelism.md#sharded-input) and says what the log-prob chunks cost;
:func:`packing_problems` says which of NeMo-RL's packing wrappers the recipe takes and what that
wrapper cannot run (docs/guide.md#sequence-packing). Both return the errors, one line each, and
write warnings and notes to the report.
"""

from __future__ import annotations

from typing import Optional

from nemo_rs_plugin.core.settings.config import RSClippedPGLossConfig
from nemo_rs_plugin.core.settings.presets import PLUGIN_LOSS_NAME
from nemo_rs_plugin.nemo_rl.refusals import recipe_refusals
from nemo_rs_plugin.parallel.vocab_parallel import DEFAULT_LOGPROB_CHUNK_SIZE, chunk_size_problem
from nemo_rs_plugin.tools.grpo_setup import SetupReport
from nemo_rs_plugin.tools.recipe_loading import recipe_value

__all__ = ["ONE_SEQUENCE_CALL_COST", "QWEN3_VOCABULARY", "packing_problems", "parallelism_problems"]

#: A lone B = 1 call against NeMo-RL's loss (benchmarks/bench_packing.py --compiled; docs/performance.md).
ONE_SEQUENCE_CALL_COST = (
    "1.29-1.37x NeMo-RL's loss per call eager, 0.54-0.67x with loss_fn.compile: true (forward + backward, "
    "512 tokens, one CPU thread); on an H200 1.1-1.2x eager, 0.35x compiled (host time per call)"
)

#: Qwen3's vocabulary (the shipped recipes' models): what ``check`` sizes a log-prob chunk's buffer by.
QWEN3_VOCABULARY = 151_936


def parallelism_problems(cfg: dict, config: RSClippedPGLossConfig, report: SetupReport) -> list[str]:
    """Combinations docs/parallelism.md#sharded-input calls invalid, and every run-time refusal of the loss.

    The loss's refusals that depend on the recipe come from the one list the loss reads,
    :data:`~nemo_rs_plugin.nemo_rl.refusals.RUN_TIME_REFUSALS`.
    """
    refused, warnings = recipe_refusals(cfg, config)
    report.warnings.extend(warnings)
    if not config.sharded_logits_input:
        return refused
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
    if chunk_size_problem(recipe_value(cfg, "policy.logprob_chunk_size")) is None:  # else among `refused`
        _logprob_chunk_notes(cfg, report)
    return problems + refused


def _logprob_chunk_notes(cfg: dict, report: SetupReport) -> None:
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


def packing_problems(
    cfg: dict, config: RSClippedPGLossConfig, report: SetupReport, loss_name: Optional[str]
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
    cfg: dict, config: RSClippedPGLossConfig, report: SetupReport, loss_name: Optional[str]
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
