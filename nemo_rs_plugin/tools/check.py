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

This module loads the recipe and assembles the report: which loss the recipe selects, its section
validated (NeMo-RL's version rules and ``MasterConfig`` where NeMo-RL is found), then the checks of
:mod:`~nemo_rs_plugin.tools.grpo_setup`, :mod:`~nemo_rs_plugin.tools.policy_setup` (backend, sharded
logits, log-prob chunks, packing) and :mod:`~nemo_rs_plugin.tools.correction_warnings` (the
correction at the recipe's response length).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional, Sequence

from nemo_rs_plugin.core.settings.config import (
    PLUGIN_FIELDS,
    ConfigError,
    ConfigWarning,
    RSClippedPGLossConfig,
    own_loss_problems,
)
from nemo_rs_plugin.core.settings.presets import PLUGIN_LOSS_NAME, selects_nemo_rl_loss
from nemo_rs_plugin.tools.correction_warnings import warn_about_correction
from nemo_rs_plugin.tools.grpo_setup import grpo_setup_problems
from nemo_rs_plugin.tools.policy_setup import packing_problems, parallelism_problems
from nemo_rs_plugin.tools.recipe_loading import (
    HOW_TO_CHECK,
    INHERITED_NOT_FOUND,
    flatten,
    load_recipe,
    one_line,
)

__all__ = ["CheckReport", "check_recipe", "load_recipe"]

#: Sections of NeMo-RL's other algorithms' configs (examples/configs/{sft,dpo,rm,distillation}*.yaml).
OTHER_ALGORITHMS = ("sft", "dpo", "rm", "distillation")


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
    report.errors.extend(parallelism_problems(cfg, config, report))
    report.errors.extend(packing_problems(cfg, config, report, name))
    if report.nemo_rl:
        report.errors.extend(_master_config_problems(cfg, report))
    grpo_setup_problems(cfg, loss, report)
    report.config = config
    if unresolved:  # a pipeline or a rejection estimate without those fields would not be the recipe's
        return
    report.pipeline = _describe(config)
    warn_about_correction(report, cfg, config, mismatch, response_tokens)


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
    """``NEMO_RS_PLUGIN_DISABLE`` set here: the run refuses a recipe naming a plugin loss (``PluginDisabledError``).

    Set to a value that leaves the plugin on: a note saying so, a warning where the value is not
    one the plugin reads (``disabled``, ``2``: it stays on).
    """
    from nemo_rs_plugin.nemo_rl.activation import hook

    if not hook.disabled():
        if hook.unrecognised_setting() is not None:  # on, though the variable was likely meant to switch it off
            report.warnings.append(hook.state())
        elif os.environ.get(hook.DISABLE_ENV) is not None:
            report.notes.append(hook.state())
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
