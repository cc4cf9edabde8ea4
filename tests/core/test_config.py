"""Config validation: every invalid value or combination raises at construction, naming the
field, the value and what is allowed."""

from types import SimpleNamespace

import pytest
from pydantic import BaseModel, ConfigDict

from nemo_rs_plugin import ConfigError, CorrectedPGLoss, RSClippedPGLossConfig
from nemo_rs_plugin.core.registries.filter_statistics import FILTER_STATISTICS

IS_ON = {"use_importance_sampling_correction": True}


def error_of(cfg) -> str:
    with pytest.raises(ConfigError) as info:
        RSClippedPGLossConfig.from_any(cfg)
    return str(info.value)


def test_defaults_equal_nemo_rl_defaults():
    c = RSClippedPGLossConfig.from_any({})
    assert (c.ratio_clip_min, c.ratio_clip_max, c.ratio_clip_c) == (0.2, 0.2, None)
    assert (c.reference_policy_kl_penalty, c.reference_policy_kl_type) == (0.01, "k3")
    assert (c.kl_input_clamp_value, c.kl_output_clamp_value) == (20.0, 10.0)
    assert c.token_level_loss and not c.use_importance_sampling_correction
    assert c.is_correction_level is None and c.rejection_sampling == ()
    assert c.effective_is_level == "token"


@pytest.mark.parametrize(
    "cfg, needles",
    [
        ({"sequence_level_importance_ratios": True}, ["sequence_level_importance_ratios", "token_level_loss"]),
        ({"use_cispo": True, "disable_ppo_ratio": True}, ["disable_ppo_ratio: got true", "use_cispo"]),
        ({"use_cispo": True, "ratio_clip_c": 3.0}, ["ratio_clip_c: got 3.0", "null"]),
        ({"use_cispo": True, "token_level_loss": False}, ["token_level_loss: got false"]),
        ({"ratio_clip_c": 0.5}, ["ratio_clip_c: got 0.5", "> 1"]),
        (
            {"truncated_importance_sampling_type": "tis", "truncated_importance_sampling_ratio": 2.0},
            ["use_importance_sampling_correction: false"],
        ),
        (
            {**IS_ON, "truncated_importance_sampling_type": "tis"},
            ["truncated_importance_sampling_ratio: got None", "> 0"],
        ),
        (
            {
                **IS_ON,
                "truncated_importance_sampling_type": "seq-mask-tis",
                "truncated_importance_sampling_ratio": 1.002,
            },
            ["truncated_importance_sampling_ratio_min: got null", "seq-mask-tis"],
        ),
        (
            {
                **IS_ON,
                "truncated_importance_sampling_type": "icepop",
                "truncated_importance_sampling_ratio": 2.0,
                "truncated_importance_sampling_ratio_min": 3.0,
            },
            ["3.0 > ", "must be <= truncated_importance_sampling_ratio"],
        ),
        (
            {**IS_ON, "truncated_importance_sampling_type": "clip", "truncated_importance_sampling_ratio": 2.0},
            ["truncated_importance_sampling_type: got 'clip'", "'tis', 'icepop' or 'seq-mask-tis'"],
        ),
        ({"truncated_importance_sampling_ratio": 2.0}, ["truncated_importance_sampling_type: null"]),
        ({"reference_policy_kl_type": "k4"}, ["reference_policy_kl_type: got 'k4'", "'k1', 'k2' or 'k3'"]),
        ({"is_correction_level": "seq"}, ["is_correction_level: got 'seq'", "'token', 'sequence' or 'sequence_mean'"]),
        ({"rejection_denominator": "new"}, ["rejection_denominator: got 'new'", "'original' or 'kept'"]),
        (
            {
                **IS_ON,
                "sequence_level_importance_ratios": True,
                "token_level_loss": False,
                "truncated_importance_sampling_type": "seq-mask-tis",
                "truncated_importance_sampling_ratio": 1.002,
                "truncated_importance_sampling_ratio_min": 0.999,
            },
            ["seq-mask-tis", "set is_correction_level"],
        ),
    ],
)
def test_invalid_upstream_combinations(cfg, needles):
    msg = error_of(cfg)
    for needle in needles:
        assert needle in msg, (needle, msg)
    assert msg.count("\n  loss_fn.") >= 1


@pytest.mark.parametrize(
    "flt, needles",
    [
        (
            {"level": "sequence", "statistic": "ratio", "lower": 2.0, "upper": 1.0},
            ["rejection_sampling.0", "lower > upper", "lower=2.0, upper=1.0"],
        ),
        ({"level": "sequence", "statistic": "ratio"}, ["rejection_sampling.0", "at least one bound"]),
        (
            {"level": "sequence", "statistic": "kl_k4", "upper": 1.0},
            ["rejection_sampling.0.statistic: got 'kl_k4'", "'kl_k3'"],
        ),
        ({"level": "sequence", "agg": "median", "upper": 1.0}, ["rejection_sampling.0.agg: got 'median'", "'any'"]),
        ({"level": "token", "agg": "mean", "upper": 2.0}, ["agg: got 'mean' on a token filter", "level: sequence"]),
        (
            {"level": "sequence", "statistic": "kl_k3", "agg": "any", "upper": 0.5},
            ["agg: got 'any' with statistic 'kl_k3'", "mean, sum, max"],
        ),
        ({"level": "sequence", "statistic": "kl_k2", "agg": "min", "upper": 0.5}, ["agg: got 'min'"]),
        ({"level": "token", "statistic": "ratio", "lower": -1.0, "upper": 2.0}, ["lower: got -1.0", ">= 0"]),
        ({"level": "tokens", "upper": 2.0}, ["rejection_sampling.0.level: got 'tokens'", "allowed: token or sequence"]),
        (
            {"level": "token", "upper": 2.0, "threshold": 3},
            ["rejection_sampling.0.threshold: unknown field of a rejection_sampling stage; (fields: level, "],
        ),
    ],
)
def test_invalid_filters(flt, needles):
    msg = error_of({"rejection_sampling": [{"level": "token", "upper": 2.0}, flt][1:]})
    for needle in needles:
        assert needle in msg, (needle, msg)


def test_every_problem_is_reported_at_once():
    msg = error_of(
        {
            "rejection_sampling": [{"level": "sequence"}, {"level": "token", "agg": "max", "upper": 2}],
        }
    )
    assert "rejection_sampling.0" in msg and "rejection_sampling.1" in msg


def test_misspelled_field_suggests_the_right_name():
    msg = error_of({"is_corection_level": "token"})
    assert "is_corection_level: unknown field; did you mean 'is_correction_level'?" in msg


def test_accepts_dict_object_and_pydantic():
    fields = {
        "use_importance_sampling_correction": True,
        "is_correction_level": "sequence_mean",
        "rejection_sampling": [{"level": "sequence", "agg": "mean", "lower": 0.99, "upper": 1.01}],
    }
    from_dict = RSClippedPGLossConfig.from_any(fields)
    from_obj = RSClippedPGLossConfig.from_any(SimpleNamespace(**fields))

    class HostConfig(BaseModel):  # stands in for NeMo-RL's pydantic config (extra="allow")
        model_config = ConfigDict(extra="allow")
        use_importance_sampling_correction: bool = False

    from_pydantic = RSClippedPGLossConfig.from_any(HostConfig(**fields))
    assert from_dict == from_obj == from_pydantic
    assert from_dict.rejection_sampling[0].label == "sequence_ratio_mean"
    assert CorrectedPGLoss(fields).cfg == from_dict


def test_loss_construction_validates():
    with pytest.raises(ConfigError, match="ratio_clip_c"):
        CorrectedPGLoss({"ratio_clip_c": 1.0})


def test_name_field_is_accepted():
    assert RSClippedPGLossConfig.from_any({"name": "rs_clipped_pg"}).name == "rs_clipped_pg"


def test_the_filter_statistics_registry_is_the_metric_type_and_the_references_dispatch():
    """One entry per ``FilterStatisticName`` value; the naive reference writes each formula again."""
    from typing import get_args

    from nemo_rs_plugin.core.registries.filter_statistics import FILTER_STATISTICS, filter_statistic_entry
    from nemo_rs_plugin.core.settings.rejection_filter import AGGS_FOR_STATISTIC, FilterStatisticName
    from tests.support.naive_reference import TOKEN_STATISTICS

    metrics = list(get_args(FilterStatisticName))
    assert list(FILTER_STATISTICS) == metrics and list(AGGS_FOR_STATISTIC) == metrics
    assert set(TOKEN_STATISTICS) == set(metrics)
    with pytest.raises(ValueError, match="statistic: got 'kl_k4'; allowed: ratio, kl_k1"):
        filter_statistic_entry("kl_k4")  # an unknown name is an error, never a default


@pytest.mark.parametrize("metric", list(FILTER_STATISTICS))
def test_each_statistic_equals_the_references_formula_and_lies_in_its_range(metric):
    """The registry's token function against the reference's, on log-probs far apart and close."""
    import math

    import torch

    from nemo_rs_plugin.core.correction.filters import token_filter_statistic
    from nemo_rs_plugin.core.registries.filter_statistics import FILTER_STATISTICS
    from tests.support.naive_reference import token_statistic

    entry = FILTER_STATISTICS[metric]
    target = torch.tensor([-0.01, -0.7, -3.0, -1e-9, -12.0], dtype=torch.float64)
    behaviour = torch.tensor([-0.02, -0.1, -5.0, -20.0, -1e-9], dtype=torch.float64)
    d = target - behaviour
    got = token_filter_statistic(d, metric, target=target, behaviour=behaviour)
    want = [token_statistic(metric, float(x), float(a), float(b)) for x, a, b in zip(d, target, behaviour)]
    if entry.log_space:
        got = got.exp()  # the ratio is computed as its log
    assert got.tolist() == pytest.approx(want, rel=1e-12, abs=1e-15)
    lo, hi = entry.value_range
    assert all(lo <= v <= hi for v in want) and all(map(math.isfinite, want))


def test_no_default_filter_label_is_one_nemo_rl_leaves_undivided():
    """NeMo-RL's workers divide every metric by the number of global batches except names containing
    ``_min`` or ``_max`` (tests/nemo_rl/test_training_step.py runs that loop): no default label may."""
    import itertools
    import typing

    from nemo_rs_plugin.core.settings.rejection_filter import NEMO_RL_UNDIVIDED_MARKERS, RejectionFilter

    fields = RejectionFilter.model_fields
    log_ratios = typing.get_args(fields["log_ratio"].annotation)
    labels = set()
    for metric, log_ratio, negative in itertools.product(FILTER_STATISTICS, log_ratios, (False, True)):
        entry = FILTER_STATISTICS[metric]
        for level, agg in [("token", None)] + [("sequence", a) for a in entry.aggregations]:
            f = RejectionFilter(
                level=level,
                statistic=metric,
                agg=agg,
                log_ratio=log_ratio,
                advantage_sign="negative" if negative else None,
                upper=2.0,
            )
            labels.add(f.label)
    assert not [label for label in labels if any(m in label for m in NEMO_RL_UNDIVIDED_MARKERS)]
    assert {"sequence_ratio_largest", "sequence_ratio_smallest", "sequence_ratio_mean"} <= labels


@pytest.mark.parametrize("name", ["ratio_max", "seq_min_guard"])
def test_a_filter_name_nemo_rl_would_not_divide_is_warned_about(name):
    from nemo_rs_plugin.core.settings.config import ConfigWarning

    with pytest.warns(ConfigWarning, match=rf"rejection_sampling\.0\.name: got '{name}'.*too large"):
        RSClippedPGLossConfig.from_any(
            {"rejection_sampling": [{"level": "sequence", "agg": "max", "upper": 2.0, "name": name}]}
        )
