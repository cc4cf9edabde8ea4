"""The loss's run-time refusals that depend on the recipe: one list, read by the loss and by ``nemo-rs check``.

``RSClippedPGLossFn`` refuses some recipes only when it is built or first called, from values
NeMo-RL hands it there (its fused-log-probs flag, the ``prepare_fn``'s sampling parameters and
chunk size, the process group). Each :class:`RunTimeRefusal` of :data:`RUN_TIME_REFUSALS` holds
the one test (:attr:`~RunTimeRefusal.judge`, on those values, with the one wording), how ``check``
reads the same values from the recipe (:attr:`~RunTimeRefusal.from_recipe`), and a recipe the
loss refuses (:attr:`~RunTimeRefusal.example`). The loss calls ``run_time_refusal(name).judge``;
``check`` walks the list (:func:`recipe_refusals`); ``tests/tools/test_check_run_time_refusals.py``
walks it too and proves ``check`` refuses every example, and that the loss names exactly these.

Nothing here imports NeMo-RL: ``check`` reads the list where NeMo-RL is absent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

from nemo_rs_plugin.core.settings.config import RSClippedPGLossConfig
from nemo_rs_plugin.nemo_rl.host import fused_sharded_problem, training_time_filtering_problem
from nemo_rs_plugin.nemo_rl.recipe_defaults import dotted_value
from nemo_rs_plugin.parallel.vocab_parallel import chunk_size_problem

__all__ = ["RUN_TIME_REFUSALS", "RunTimeRefusal", "Unknown", "recipe_refusals", "run_time_refusal", "training_ranks"]


@dataclass(frozen=True)
class Unknown:
    """A value the judge needs that the recipe does not settle here: ``check`` warns with ``warning``."""

    warning: str


#: What :attr:`RunTimeRefusal.from_recipe` returns: the judge's keywords, ``None`` (the rule does
#: not apply to this recipe) or :class:`Unknown`.
RecipeFacts = Union[dict[str, Any], None, Unknown]


@dataclass(frozen=True)
class RunTimeRefusal:
    """One recipe-dependent refusal of the loss: its test, where the loss applies it, and how ``check`` does."""

    name: str
    #: Where the loss raises the ``ConfigError`` (for the docs and the messages of ``check``).
    raised: str
    #: The test, on the values the loss sees at run time: the problem (one line), or ``None``.
    judge: Callable[..., Optional[str]]
    #: The same values read from the resolved recipe and the validated loss section.
    from_recipe: Callable[[dict, RSClippedPGLossConfig], RecipeFacts]
    #: Hydra-style overrides that make a minimal GRPO recipe one the loss refuses.
    example: tuple[str, ...]


def _positive_int(value: Any) -> Optional[int]:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else None


def training_ranks(cfg: dict) -> Optional[int]:
    """How many ranks train the policy, as NeMo-RL's GRPO set-up sizes its train cluster (``None``: unknown).

    Colocated generation (NeMo-RL's default): every GPU of ``cluster``. Otherwise the inference
    resources are taken away: GPUs of the one node, or whole nodes.
    """
    nodes = _positive_int(dotted_value(cfg, "cluster.num_nodes"))
    gpus = _positive_int(dotted_value(cfg, "cluster.gpus_per_node"))
    if nodes is None or gpus is None:
        return None
    if dotted_value(cfg, "policy.generation.colocated.enabled") is not False:
        return nodes * gpus
    resources = "policy.generation.colocated.resources"
    if nodes == 1:
        inference_gpus = _positive_int(dotted_value(cfg, f"{resources}.gpus_per_node"))
        return gpus - inference_gpus if inference_gpus is not None and gpus > inference_gpus else None
    inference_nodes = _positive_int(dotted_value(cfg, f"{resources}.num_nodes"))
    return (nodes - inference_nodes) * gpus if inference_nodes is not None and nodes > inference_nodes else None


# ----------------------------------------------------------------------------- the judges


def _fused_linear_logprobs(sharded_logits_input: Any, use_fused_linear_logprobs: Any) -> Optional[str]:
    return fused_sharded_problem(sharded_logits_input, use_fused_linear_logprobs)


def _training_time_filtering(sharded_logits_input: bool, top_k: Any, top_p: Any) -> Optional[str]:
    return training_time_filtering_problem(top_k, top_p) if sharded_logits_input else None


def _logprob_chunk_size(sharded_logits_input: bool, chunk_size: Any) -> Optional[str]:
    return chunk_size_problem(chunk_size) if sharded_logits_input else None


def _data_parallel_group(is_batch_normalization: Any, group_known: bool, ranks: int) -> Optional[str]:
    if is_batch_normalization != "data_parallel" or group_known or ranks <= 1:
        return None
    return (
        f"is_batch_normalization: got 'data_parallel' with {ranks} training ranks, but no data-parallel group is "
        "known to the loss (megatron-core's parallel_state is not initialised: NeMo-RL's DTensor backend keeps its "
        "device mesh to itself); allowed here: 'microbatch', or the Megatron backend (policy.megatron_cfg.enabled: "
        "true), or call the core loss with SequenceGroups(data_parallel=...)"
    )


# ----------------------------------------------------------------------------- read from the recipe


def _megatron(cfg: dict) -> bool:
    return dotted_value(cfg, "policy.megatron_cfg.enabled") is True


def _fused_facts(cfg: dict, config: RSClippedPGLossConfig) -> RecipeFacts:
    # NeMo-RL passes use_fused_linear_logprobs to the loss from its Megatron worker only.
    if not (config.sharded_logits_input and _megatron(cfg)):
        return None
    return {
        "sharded_logits_input": True,
        "use_fused_linear_logprobs": dotted_value(cfg, "policy.megatron_cfg.use_fused_linear_logprobs"),
    }


def _filtering_facts(cfg: dict, config: RSClippedPGLossConfig) -> RecipeFacts:
    if not config.sharded_logits_input:
        return None
    return {
        "sharded_logits_input": True,
        "top_k": dotted_value(cfg, "policy.generation.top_k"),
        "top_p": dotted_value(cfg, "policy.generation.top_p"),
    }


def _chunk_facts(cfg: dict, config: RSClippedPGLossConfig) -> RecipeFacts:
    if not config.sharded_logits_input:
        return None
    return {"sharded_logits_input": True, "chunk_size": dotted_value(cfg, "policy.logprob_chunk_size")}


def _data_parallel_facts(cfg: dict, config: RSClippedPGLossConfig) -> RecipeFacts:
    if config.is_batch_normalization != "data_parallel" or _megatron(cfg):
        return None
    ranks = training_ranks(cfg)
    if ranks is None:
        return Unknown(
            "loss_fn.is_batch_normalization: 'data_parallel' without the Megatron backend is refused by the loss at "
            "its first call when more than one rank trains (no data-parallel group is known to it there), and the "
            "number of training ranks (cluster.num_nodes, cluster.gpus_per_node, policy.generation.colocated) is "
            "not set here: use 'microbatch' or the Megatron backend unless the policy trains on one GPU"
        )
    return {"is_batch_normalization": "data_parallel", "group_known": False, "ranks": ranks}


_SHARDED_MEGATRON = ("loss_fn.sharded_logits_input=true", "policy.megatron_cfg.enabled=true")

#: Every recipe-dependent refusal of the loss (``RSClippedPGLossFn``), in the order the loss meets them.
RUN_TIME_REFUSALS: tuple[RunTimeRefusal, ...] = (
    RunTimeRefusal(
        "fused_linear_logprobs",
        "when it is built",
        _fused_linear_logprobs,
        _fused_facts,
        (*_SHARDED_MEGATRON, "policy.megatron_cfg.use_fused_linear_logprobs=true"),
    ),
    RunTimeRefusal(
        "data_parallel_group",
        "at its first call",
        _data_parallel_group,
        _data_parallel_facts,
        (
            "loss_fn.is_batch_normalization=data_parallel",
            "policy.dtensor_cfg.enabled=true",
            "policy.megatron_cfg.enabled=false",
            "cluster.gpus_per_node=2",
            "cluster.num_nodes=1",
        ),
    ),
    RunTimeRefusal(
        "training_time_filtering",
        "at its first call (sharded_logits_input)",
        _training_time_filtering,
        _filtering_facts,
        (*_SHARDED_MEGATRON, "policy.generation.top_k=50"),
    ),
    RunTimeRefusal(
        "logprob_chunk_size",
        "at its first call (sharded_logits_input, NeMo-RL v0.7.0 on)",
        _logprob_chunk_size,
        _chunk_facts,
        (*_SHARDED_MEGATRON, "policy.logprob_chunk_size=0"),
    ),
)

_BY_NAME = {r.name: r for r in RUN_TIME_REFUSALS}


def run_time_refusal(name: str) -> RunTimeRefusal:
    """The refusal named ``name`` (``KeyError`` for a name not in :data:`RUN_TIME_REFUSALS`)."""
    return _BY_NAME[name]


def recipe_refusals(cfg: dict, config: RSClippedPGLossConfig) -> tuple[list[str], list[str]]:
    """``(errors, warnings)``: the refusals of :data:`RUN_TIME_REFUSALS` that the recipe meets, one line each.

    A warning where a value a refusal needs is not settled by the recipe here.
    """
    errors: list[str] = []
    warnings: list[str] = []
    for refusal in RUN_TIME_REFUSALS:
        facts = refusal.from_recipe(cfg, config)
        if facts is None:
            continue
        if isinstance(facts, Unknown):
            warnings.append(facts.warning)
            continue
        problem = refusal.judge(**facts)
        if problem is not None:
            where = problem if problem.startswith("policy.") else f"loss_fn.{problem}"
            errors.append(f"{where} (the loss raises this ConfigError {refusal.raised})")
    return errors, warnings
