"""What NeMo-RL's GRPO start-up asserts about ``loss_fn`` with ``grpo`` and ``policy`` fields, per version.

Read by ``nemo-rs check`` (:mod:`~nemo_rs_plugin.tools.check`). Each rule of
:data:`GRPO_SETUP_RULES` reads the recipe and returns a :class:`_Refusal` (what, which NeMo-RL
versions refuse it, the fix) or ``None``; :func:`grpo_setup_problems` turns them into an error
where every version the run may use refuses the recipe, a warning naming the versions where only
some do (the version is not known without ``--nemo-rl``), and a ``not checked`` line where an
input is not resolved. The line numbers in the docstrings are those of each version's
``nemo_rl/algorithms/grpo.py`` (docs/cli.md lists them); ``tests/tools/test_check_grpo_setup.py``
runs NeMo-RL's own statements on the same recipes.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol

from nemo_rs_plugin.tools.recipe_loading import HOW_TO_CHECK, LoadReport, recipe_value

__all__ = ["GRPO_SETUP_RULES", "NEMO_RL_VERSIONS", "SetupReport", "grpo_setup_problems"]


class SetupReport(LoadReport, Protocol):
    """What the rules write to (:class:`~nemo_rs_plugin.tools.check.CheckReport` is one)."""

    warnings: list[str]
    nemo_rl_versions: tuple[str, ...]


# --------------------------------------------------------------------------- NeMo-RL's GRPO set-up
#: The NeMo-RL versions whose GRPO set-up rules ``check`` applies (each read from that version's
#: nemo_rl/algorithms/grpo.py; docs/cli.md lists the lines).
NEMO_RL_VERSIONS = ("v0.6.0", "v0.7.0", "main")
_MISSING = object()


@dataclass(frozen=True)
class _Refusal:
    """A recipe NeMo-RL's GRPO start-up refuses, and which versions refuse it.

    The error is ``problem`` (fields and values), the versions that refuse it, then ``fix``.
    """

    problem: str
    fix: str
    refused_by: tuple[str, ...] = NEMO_RL_VERSIONS
    #: Versions that do not have what the rule is about (left out of the verdict).
    not_applicable: tuple[str, ...] = ()
    #: What a version that starts anyway does with it, where that is worth a warning.
    accepted: dict[str, str] = field(default_factory=dict)


def _host_versions(report: SetupReport) -> tuple[str, ...]:
    """The supported NeMo-RL versions the run may use: all of them unless NeMo-RL is importable here.

    v0.6.0 is the TypedDict config API; main has ``_validate_use_kl_in_reward_compat`` in its GRPO
    module and v0.7.0 does not (both report version 0.x in ``__version__``, main 0.6.0: not usable).
    """
    if not report.nemo_rl:
        return NEMO_RL_VERSIONS
    from nemo_rs_plugin.nemo_rl import host

    try:
        api = host.host_api()
    except Exception:  # noqa: BLE001 - reported by the host loss rules already
        return NEMO_RL_VERSIONS
    if api == "typeddict":
        return ("v0.6.0",)
    try:
        from nemo_rl.algorithms import grpo
    except Exception:  # noqa: BLE001 - e.g. NeMo-RL >= 0.7 on Python < 3.12 (reported as not checked)
        return ("v0.7.0", "main")
    return ("main",) if hasattr(grpo, "_validate_use_kl_in_reward_compat") else ("v0.7.0",)


def _named(versions: list[str]) -> str:
    return versions[0] if len(versions) == 1 else ", ".join(versions[:-1]) + " and " + versions[-1]


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _unresolved(report: SetupReport, rule: str, fields: list[str]) -> None:
    verb = "is" if len(fields) == 1 else "are"
    report.unchecked.append(
        f"{rule}: {', '.join(fields)} {verb} not set here (not in the recipe, or in defaults that were not "
        f"found), so NeMo-RL's GRPO start-up rule on it was not checked; set it in the recipe, or {HOW_TO_CHECK}"
    )


def _force_on_policy_ratio_batch(cfg: dict, loss: dict, report: SetupReport) -> Optional[_Refusal]:
    """One optimizer step per rollout batch (grpo.py setup: v0.6.0 :380-388, v0.7.0 :428-436, main :699-706)."""
    if loss.get("force_on_policy_ratio") is not True:
        return None
    names = ("grpo.num_prompts_per_step", "grpo.num_generations_per_prompt", "policy.train_global_batch_size")
    values = [recipe_value(cfg, n, _MISSING) for n in names]
    missing = [n for n, v in zip(names, values) if v is _MISSING or v is None]
    if missing:
        _unresolved(report, "loss_fn.force_on_policy_ratio: true", missing)
        return None
    prompts, generations, batch = values
    if not all(_is_count(v) for v in values) or prompts * generations == batch:
        return None  # a value of the wrong type is MasterConfig's to report
    return _Refusal(
        problem=(
            f"loss_fn.force_on_policy_ratio: got true with policy.train_global_batch_size: {batch}, but "
            f"grpo.num_prompts_per_step * grpo.num_generations_per_prompt is {prompts} * {generations} = "
            f"{prompts * generations}; the forced ratio of 1 holds only with one optimizer step per rollout batch"
        ),
        fix=(
            f"set policy.train_global_batch_size: {prompts * generations} (one step per rollout batch), "
            "or loss_fn.force_on_policy_ratio: false"
        ),
    )


def _async_needs_importance_sampling(cfg: dict, loss: dict, report: SetupReport) -> Optional[_Refusal]:
    """Async GRPO trains on stale rollouts (async_grpo_train: v0.6.0 :2402, v0.7.0 :3371, main :4127)."""
    if recipe_value(cfg, "grpo.async_grpo.enabled") is not True:
        return None
    is_on = loss.get("use_importance_sampling_correction", _MISSING)
    if is_on is _MISSING:
        report.warnings.append(
            "grpo.async_grpo.enabled is true but loss_fn.use_importance_sampling_correction is false (not set "
            "here, the loss's default): stale rollouts would be trained on without correction, and NeMo-RL "
            "refuses async GRPO without it; set loss_fn.use_importance_sampling_correction: true"
        )
        _unresolved(report, "grpo.async_grpo.enabled: true", ["loss_fn.use_importance_sampling_correction"])
        return None
    if is_on is not False:
        return None
    return _Refusal(
        problem=(
            "loss_fn.use_importance_sampling_correction: got false with grpo.async_grpo.enabled: true; async "
            "GRPO trains on rollouts sampled by older weights, which need the importance-sampling correction"
        ),
        fix="set loss_fn.use_importance_sampling_correction: true (or grpo.async_grpo.enabled: false)",
    )


def _skip_reference_needs_no_kl(cfg: dict, loss: dict, report: SetupReport) -> Optional[_Refusal]:
    """No reference log-probs, no KL penalty (v0.6.0 grpo_train :1339-1340; setup v0.7.0 :440-445, main :710-715).

    v0.6.0 checks it in ``grpo_train`` only: its ``async_grpo_train`` ignores the flag and computes
    the reference log-probs (:2794).
    """
    if recipe_value(cfg, "grpo.skip_reference_policy_logprobs_calculation") is not True:
        return None
    kl = loss.get("reference_policy_kl_penalty", _MISSING)
    if kl is _MISSING:
        _unresolved(
            report, "grpo.skip_reference_policy_logprobs_calculation: true", ["loss_fn.reference_policy_kl_penalty"]
        )
        return None
    if not _is_number(kl) or kl == 0:
        return None
    is_async = recipe_value(cfg, "grpo.async_grpo.enabled") is True
    return _Refusal(
        problem=(
            f"grpo.skip_reference_policy_logprobs_calculation: got true with loss_fn.reference_policy_kl_penalty: "
            f"{kl:g}; without the reference policy's log-probs there is no KL penalty to compute"
        ),
        fix=(
            "set loss_fn.reference_policy_kl_penalty: 0 (no KL penalty), or "
            "grpo.skip_reference_policy_logprobs_calculation: false"
        ),
        refused_by=("v0.7.0", "main") if is_async else NEMO_RL_VERSIONS,
        accepted={
            "v0.6.0": "v0.6.0's async GRPO ignores grpo.skip_reference_policy_logprobs_calculation and computes "
            "the reference log-probs anyway, so the flag does nothing there"
        },
    )


def _prev_logprobs_skipped(cfg: dict, loss: dict, report: SetupReport, rule: str) -> Optional[bool]:
    """Whether force_on_policy_ratio leaves prev_logprobs at zeros (v0.7.0 opd.py:110-120, main opd.py:115-123).

    ``None``: ``grpo.seq_logprob_error_threshold`` (a threshold makes NeMo-RL compute them) is not set here.
    """
    if loss.get("force_on_policy_ratio") is not True:
        return False
    threshold = recipe_value(cfg, "grpo.seq_logprob_error_threshold", _MISSING)
    if threshold is _MISSING:
        _unresolved(report, rule, ["grpo.seq_logprob_error_threshold"])
        return None
    return threshold is None


def _kl_in_reward_needs_prev_logprobs(cfg: dict, loss: dict, report: SetupReport) -> Optional[_Refusal]:
    """The reward's KL against zeros (main: setup :720, ``_validate_use_kl_in_reward_compat`` :2468-2486).

    v0.7.0 has no such check and starts: its training loop passes zeros as prev_logprobs
    under force_on_policy_ratio (grpo.py:2580-2637) to the advantage estimator; v0.6.0 always
    computes prev_logprobs (grpo.py:1747).
    """
    if loss.get("use_kl_in_reward") is not True or loss.get("force_on_policy_ratio") is not True:
        return None
    kl = loss.get("reference_policy_kl_penalty", _MISSING)
    if kl is _MISSING:
        _unresolved(report, "loss_fn.use_kl_in_reward: true", ["loss_fn.reference_policy_kl_penalty"])
        return None
    if not _is_number(kl) or kl == 0:
        return None
    if not _prev_logprobs_skipped(cfg, loss, report, "loss_fn.use_kl_in_reward: true"):
        return None
    return _Refusal(
        problem=(
            f"loss_fn.use_kl_in_reward: got true with reference_policy_kl_penalty: {kl:g} and "
            "force_on_policy_ratio: true, grpo.seq_logprob_error_threshold null; force_on_policy_ratio "
            "skips the prev_logprobs pass and leaves zeros, so the KL added to the reward would be "
            "computed against zeros"
        ),
        fix=(
            "set loss_fn.use_kl_in_reward: false, or reference_policy_kl_penalty: 0, or "
            "force_on_policy_ratio: false, or grpo.seq_logprob_error_threshold (then prev_logprobs are computed)"
        ),
        refused_by=("main",),
        accepted={"v0.7.0": "v0.7.0 starts and its advantage estimator computes the reward's KL against the zeros"},
    )


def _opd_needs_prev_logprobs(cfg: dict, loss: dict, report: SetupReport) -> Optional[_Refusal]:
    """On-policy distillation's advantage reads prev_logprobs; v0.6.0 has no on-policy distillation.

    Refused when the advantage estimator is built, as training starts: v0.7.0 grpo.py:1810-1811 and
    opd.py:123-134, main grpo.py:2273-2274 and opd.py:126-137.
    """
    if (
        recipe_value(cfg, "grpo.adv_estimator.name") != "opd"
        or recipe_value(cfg, "on_policy_distillation.enabled") is not True
    ):
        return None
    if not _prev_logprobs_skipped(cfg, loss, report, "grpo.adv_estimator.name: opd"):
        return None
    return _Refusal(
        problem=(
            "loss_fn.force_on_policy_ratio: got true with on-policy distillation (grpo.adv_estimator.name: opd, "
            "on_policy_distillation.enabled: true) and grpo.seq_logprob_error_threshold null; the opd advantage "
            "is the teacher's minus the prev log-probs, which force_on_policy_ratio leaves at zeros"
        ),
        fix=(
            "set loss_fn.force_on_policy_ratio: false, or grpo.seq_logprob_error_threshold (then prev_logprobs "
            "are computed)"
        ),
        refused_by=("v0.7.0", "main"),
        not_applicable=("v0.6.0",),
    )


def _fp8_generation_needs_importance_sampling(cfg: dict, loss: dict, report: SetupReport) -> Optional[_Refusal]:
    """FP8 generation on vLLM (setup, vLLM backend: v0.6.0 :661-664, v0.7.0 :999-1002, main :1321-1324)."""
    if recipe_value(cfg, "policy.generation.vllm_cfg.precision") != "fp8":
        return None
    is_on = loss.get("use_importance_sampling_correction", _MISSING)
    backend = recipe_value(cfg, "policy.generation.backend", _MISSING)
    if is_on is True or backend not in ("vllm", _MISSING):
        return None
    inputs = {"loss_fn.use_importance_sampling_correction": is_on, "policy.generation.backend": backend}
    missing = [name for name, value in inputs.items() if value is _MISSING]
    if missing:
        _unresolved(report, "policy.generation.vllm_cfg.precision: fp8", missing)
        return None
    if is_on is not False:
        return None
    return _Refusal(
        problem=(
            "loss_fn.use_importance_sampling_correction: got false with vLLM FP8 generation "
            "(policy.generation.vllm_cfg.precision: fp8); FP8 sampling widens the gap between the sampler's "
            "and the trainer's log-probs, which needs the importance-sampling correction"
        ),
        fix="set loss_fn.use_importance_sampling_correction: true (or policy.generation.vllm_cfg.precision: bfloat16)",
    )


#: What NeMo-RL's GRPO start-up asserts about ``loss_fn`` with ``grpo`` and ``policy`` fields, one
#: function each; each docstring names the lines of nemo_rl/algorithms/grpo.py per version.
GRPO_SETUP_RULES: tuple[Callable[[dict, dict, SetupReport], Optional[_Refusal]], ...] = (
    _force_on_policy_ratio_batch,
    _async_needs_importance_sampling,
    _skip_reference_needs_no_kl,
    _kl_in_reward_needs_prev_logprobs,
    _opd_needs_prev_logprobs,
    _fp8_generation_needs_importance_sampling,
)


def grpo_setup_problems(cfg: dict, loss: dict, report: SetupReport) -> None:
    """Apply :data:`GRPO_SETUP_RULES` for the NeMo-RL versions the run may use.

    Every version that has the rule's subject refuses: an error. Only some (the version is not
    known here): a warning naming them. None, but one starts and does something unexpected: a warning.
    """
    versions = report.nemo_rl_versions = _host_versions(report)
    for rule in GRPO_SETUP_RULES:
        refusal = rule(cfg, loss, report)
        if refusal is None:
            continue
        candidates = [v for v in versions if v not in refusal.not_applicable]
        refusing = [v for v in candidates if v in refusal.refused_by]
        starting = [v for v in candidates if v not in refusal.refused_by]
        verb = "refuses" if len(refusing) == 1 else "refuse"
        if refusing and not starting:
            report.errors.append(f"{refusal.problem}; NeMo-RL {_named(refusing)} {verb} it at start-up: {refusal.fix}")
        elif refusing:
            what = "; ".join(refusal.accepted[v] for v in starting if v in refusal.accepted)
            report.warnings.append(
                f"{refusal.problem}; NeMo-RL {_named(refusing)} {verb} it at start-up, {_named(starting)} "
                f"{'does' if len(starting) == 1 else 'do'} not{f' ({what})' if what else ''}, and which NeMo-RL "
                f"runs is not known here (pass --nemo-rl PATH): {refusal.fix}"
            )
        else:
            for v in starting:
                if v in refusal.accepted:
                    report.warnings.append(f"{refusal.problem}; {refusal.accepted[v]}: {refusal.fix}")
