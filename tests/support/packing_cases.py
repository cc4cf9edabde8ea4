"""Loss sections for the packing tests, derived from the configuration's own fields and presets.

Not a hand-picked few: every value of every ``Literal`` field of :class:`RSClippedPGLossConfig`,
every boolean of NeMo-RL's fields switched on, every filter statistic with every aggregation it
allows at both levels, every ``log_ratio``, advantage condition and scope, every truncation type
at every IS level, and every preset of :mod:`nemo_rs_plugin.core.settings.presets`. A section the
configuration refuses is left out (:func:`packing_cases` counts them). Each section carries
``name: rs_clipped_pg``; the controls, NeMo-RL's own loss, carry ``name: clipped_pg``.
"""

from __future__ import annotations

import typing
from typing import Any

from nemo_rs_plugin.core.settings import presets
from nemo_rs_plugin.core.settings.config import ConfigError, NeMoRLLossFields, RSClippedPGLossConfig
from nemo_rs_plugin.core.settings.rejection_filter import AGGS_FOR_STATISTIC, RejectionFilter

#: Bounds per filter statistic that reject some of the test batch's units and keep others.
_BOUNDS: dict[str, dict[str, float]] = {
    "ratio": {"lower": 0.5, "upper": 2.0},
    "prob_diff": {"lower": -0.05, "upper": 0.05},
    "mult_prob_error": {"upper": 1.05},
}
_DEFAULT_BOUNDS = {"upper": 0.02}
#: Truncation bounds per type (NeMo-RL needs a lower bound for icepop and seq-mask-tis).
_TRUNCATION_BOUNDS: dict[str, dict[str, float]] = {
    "tis": {"truncated_importance_sampling_ratio": 2.0},
    "icepop": {"truncated_importance_sampling_ratio_min": 0.5, "truncated_importance_sampling_ratio": 2.0},
    "seq-mask-tis": {"truncated_importance_sampling_ratio_min": 0.9, "truncated_importance_sampling_ratio": 1.1},
}
#: Active filters of both levels, so that denominators and normalisations have something to do.
_BOTH_LEVELS = [presets.OUTLIER_VETO, {**presets.TOKEN_MIS}]
_BASE = {**presets.tis("sequence_mean"), "rejection_sampling": _BOTH_LEVELS}


def _literal_values(annotation: Any) -> list[Any]:
    """The values of a ``Literal`` (inside ``Optional`` too), else ``[]``."""
    if typing.get_origin(annotation) is typing.Literal:
        return list(typing.get_args(annotation))
    return [v for arg in typing.get_args(annotation) for v in _literal_values(arg)]


def _filter_field_cases() -> dict[str, dict[str, Any]]:
    cases: dict[str, dict[str, Any]] = {}
    fields = RejectionFilter.model_fields
    for metric, aggs in AGGS_FOR_STATISTIC.items():
        bounds = _BOUNDS.get(metric, _DEFAULT_BOUNDS)
        cases[f"filter/token_{metric}"] = {"rejection_sampling": [{"level": "token", "statistic": metric, **bounds}]}
        for agg in aggs:
            cases[f"filter/sequence_{metric}_{agg}"] = {
                "rejection_sampling": [{"level": "sequence", "statistic": metric, "agg": agg, **bounds}]
            }
    for log_ratio in _literal_values(fields["log_ratio"].annotation):
        for level in ("token", "sequence"):
            cases[f"filter/{level}_ratio_{log_ratio}"] = {
                "rejection_sampling": [
                    {"level": level, "statistic": "ratio", "log_ratio": log_ratio, **_BOUNDS["ratio"]}
                ]
            }
    for sign in _literal_values(fields["advantage_sign"].annotation):
        cases[f"filter/token_ratio_{sign}_advantages"] = {
            "rejection_sampling": [{**presets.TOKEN_MIS, "advantage_sign": sign}]
        }
    cases["filter/sequence_negative_advantage_sign"] = {
        "rejection_sampling": [{**presets.OUTLIER_VETO, "advantage_sign": "negative"}]
    }
    for scope in _literal_values(fields["applies_to"].annotation):
        cases[f"filter/token_ratio_applies_to_{scope}"] = {
            "rejection_sampling": [{**presets.TOKEN_MIS, "applies_to": scope}]
        }
    # two stages in both orders (a token filter before a sequence filter changes what it aggregates)
    cases["filter/token_then_sequence"] = {"rejection_sampling": [presets.TOKEN_MIS, presets.GEO_RS]}
    cases["filter/sequence_then_token"] = {"rejection_sampling": [presets.GEO_RS, presets.TOKEN_MIS]}
    return cases


def _field_cases() -> dict[str, dict[str, Any]]:
    cases: dict[str, dict[str, Any]] = {}
    for name, field in RSClippedPGLossConfig.model_fields.items():
        if name in ("name", "compile"):  # compile: the same math, compiled (tests/core/test_compile.py)
            continue
        for value in _literal_values(field.annotation):
            if name == "truncated_importance_sampling_type":
                for level in _literal_values(RSClippedPGLossConfig.model_fields["is_correction_level"].annotation):
                    cases[f"{name}={value}/{level}"] = {
                        **presets.is_level(level),
                        name: value,
                        **_TRUNCATION_BOUNDS[value],
                    }
                continue
            cases[f"{name}={value}"] = {**_BASE, name: value}
            if name == "is_batch_normalization":
                cases[f"{name}={value}/token"] = {**presets.tis("token"), name: value}
    for name, field in NeMoRLLossFields.model_fields.items():  # NeMo-RL's switches, one at a time, on the base
        if field.annotation is bool and field.default is False:
            extra = {"token_level_loss": False} if name == "sequence_level_importance_ratios" else {}
            cases[f"{name}=true"] = {**_BASE, **extra, name: True}
    for name in ("sharded_logits_input",):  # the plugin's switches (compile aside, above)
        cases[f"{name}=true"] = {**_BASE, name: True}
        cases[f"{name}=true/microbatch_totals"] = {
            **_BASE,
            name: True,
            "is_batch_normalization": "microbatch",
            "rejection_denominator": "kept",
        }
    cases["token_level_loss=false"] = {**_BASE, "token_level_loss": False}
    cases["ratio_clip_c=3"] = {**_BASE, "ratio_clip_c": 3.0}
    cases["positive_example_nll_weight=0.5"] = {**_BASE, "positive_example_nll_weight": 0.5}
    # the NLL's token count is a microbatch total: with logits as input it is computed, not only refused
    cases["sharded_logits_input=true/positive_example_nll_weight=0.5"] = {
        **_BASE,
        "sharded_logits_input": True,
        "positive_example_nll_weight": 0.5,
    }
    cases["sampler_kl_penalty=0.01"] = {**_BASE, "sampler_kl_penalty": 0.01}
    cases["rejection_denominator=kept/token_level_loss=false"] = {
        **_BASE,
        "token_level_loss": False,
        "rejection_denominator": "kept",
    }
    cases["rejection_denominator=kept/curr-gen"] = {
        "rejection_sampling": [{**presets.TOKEN_MIS, "log_ratio": "curr-gen"}],
        "rejection_denominator": "kept",
    }
    cases["is_batch_normalization=microbatch/force_on_policy_ratio"] = {
        **presets.tis("token"),
        "is_batch_normalization": "microbatch",
        "force_on_policy_ratio": True,
    }
    # the two above with logits as input: gathered per sequence too (refused only where a wrapper's position is unread)
    for name in ("rejection_denominator=kept/curr-gen", "is_batch_normalization=microbatch/force_on_policy_ratio"):
        cases[f"sharded_logits_input=true/{name}"] = {**cases[name], "sharded_logits_input": True}
    return cases


def _preset_cases() -> dict[str, dict[str, Any]]:
    cases: dict[str, dict[str, Any]] = {"preset/none": {}}
    for level in _literal_values(RSClippedPGLossConfig.model_fields["is_correction_level"].annotation):
        cases[f"preset/is_level({level})"] = presets.is_level(level)
        cases[f"preset/tis({level})"] = presets.tis(level)
    for label, flt in presets.FILTERS.items():
        cases[f"preset/{label}"] = {**presets.is_level("sequence_mean"), "rejection_sampling": [flt]}
    cases["preset/geo-rs+outlier-veto"] = {
        **presets.is_level("sequence_mean"),
        "rejection_sampling": [presets.GEO_RS, presets.OUTLIER_VETO],
    }
    cases["preset/dppo"] = presets.dppo()
    cases["preset/ipo"] = presets.ipo()
    return cases


#: Configurations of NeMo-RL's own fields only, also run through NeMo-RL's own loss (the controls).
UPSTREAM_ONLY: dict[str, dict[str, Any]] = {
    "upstream/default": {},
    "upstream/dual_clip": {"ratio_clip_c": 3.0},
    "upstream/token_tis": {
        **presets.IS_ON,
        "truncated_importance_sampling_type": "tis",
        "truncated_importance_sampling_ratio": 2.0,
    },
    "upstream/gspo": {**presets.IS_ON, "sequence_level_importance_ratios": True, "token_level_loss": False},
    "upstream/nll": {"positive_example_nll_weight": 0.5},
}


def packing_cases() -> tuple[dict[str, dict[str, Any]], list[str]]:
    """``(cases, refused)``: the valid loss sections by name, and the names the configuration refused."""
    raw = {**_preset_cases(), **_field_cases(), **_filter_field_cases(), **UPSTREAM_ONLY}
    cases, refused = {}, []
    for name, section in raw.items():
        try:
            RSClippedPGLossConfig.from_any(section)
        except ConfigError:
            refused.append(name)
            continue
        cases[name] = {"name": presets.PLUGIN_LOSS_NAME, **section}
    for name, section in UPSTREAM_ONLY.items():
        cases[f"control/{name}"] = {**section, "name": "clipped_pg"}
    return cases, refused


__all__ = ["UPSTREAM_ONLY", "packing_cases"]
