"""Guards ``core/settings/config_problems.py`` (and ``RSClippedPGLossConfig.from_any``, which runs it).

A setting that silently does nothing (or the wrong thing) is an error
naming the field, the value and what is allowed, or a warning where it is harmless; strings are
never coerced; every problem of a section is reported at once, in one ``ConfigError``."""

import warnings

import pytest
import yaml

from nemo_rs_plugin import ConfigError, CorrectedPGLoss, RSClippedPGLossConfig
from nemo_rs_plugin.core.settings.config import ConfigWarning
from tests.conftest import make_batch

IS_ON = {"use_importance_sampling_correction": True}


def problems_of(cfg) -> list[str]:
    with pytest.raises(ConfigError) as info:
        RSClippedPGLossConfig.from_any(cfg)
    return info.value.problems


def warnings_of(cfg) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        RSClippedPGLossConfig.from_any(cfg)
    return [str(w.message) for w in caught if issubclass(w.category, ConfigWarning)]


# --------------------------------------------------------------------------- item 5: errors
@pytest.mark.parametrize(
    "cfg, line",
    [
        ({"ratio_clip_min": -0.1}, "loss_fn.ratio_clip_min: got -0.1; allowed: a number >= 0"),
        ({"ratio_clip_max": -0.1}, "loss_fn.ratio_clip_max: got -0.1; allowed: a number >= 0"),
        (
            {"reference_policy_kl_penalty": -0.01},
            "loss_fn.reference_policy_kl_penalty: got -0.01; allowed: a finite number >= 0",
        ),
        (
            {"positive_example_nll_weight": -1},
            "loss_fn.positive_example_nll_weight: got -1.0; allowed: a finite number >= 0",
        ),
        ({"kl_input_clamp_value": -5}, "loss_fn.kl_input_clamp_value: got -5.0; allowed: a number > 0, or null"),
        ({"kl_output_clamp_value": 0}, "loss_fn.kl_output_clamp_value: got 0.0; allowed: a number > 0, or null"),
    ],
)
def test_out_of_range_numbers_are_errors(cfg, line):
    problems = problems_of(cfg)
    assert any(p.startswith(line) for p in problems), problems


@pytest.mark.parametrize(
    "cfg, start, needles",
    [
        ({"negative_advantages_only": "no"}, "loss_fn.rejection_sampling.0.negative_advantages_only: got 'no'", []),
        ({"lower": "0.99"}, "loss_fn.rejection_sampling.0.lower: got '0.99'", ["a number"]),
    ],
)
def test_strings_in_a_filter_are_not_coerced(cfg, start, needles):
    flt = {"level": "sequence", "upper": 1.01, **cfg}
    problems = problems_of({"rejection_sampling": [flt]})
    [line] = [p for p in problems if p.startswith(start)]
    assert "string" in line and all(n in line for n in needles), line


@pytest.mark.parametrize(
    "cfg, start, allowed",
    [
        ({"ratio_clip_max": "0.28"}, "loss_fn.ratio_clip_max: got '0.28'", "a number"),
        (
            {"use_importance_sampling_correction": "true"},
            "loss_fn.use_importance_sampling_correction: got 'true'",
            "true or false",
        ),
        ({"token_level_loss": "no"}, "loss_fn.token_level_loss: got 'no'", "true or false"),
        ({"ratio_clip_c": "3"}, "loss_fn.ratio_clip_c: got '3'", "a number"),
        ({"ratio_clip_max": True}, "loss_fn.ratio_clip_max: got true", "a number"),
    ],
)
def test_strings_and_booleans_are_not_coerced(cfg, start, allowed):
    [line] = problems_of(cfg)
    assert line.startswith(start) and allowed in line, line


def test_a_yaml_float_without_a_dot_gets_a_hint():
    # PyYAML reads 1e-4 as a string: the error says how to write it.
    [line] = problems_of({"ratio_clip_min": "1e-4"})
    assert line.startswith("loss_fn.ratio_clip_min: got '1e-4'") and "1.0e-4" in line, line
    # and the hint is itself a number to PyYAML: its exponent needs a sign (1.0e4 is a string too)
    [line] = problems_of({"ratio_clip_max": "1e4"})
    hint = line.rsplit("write ", 1)[1]
    assert hint == "1.0e+4" and yaml.safe_load(f"x: {hint}") == {"x": 1.0e4}, line


def test_curr_prev_filter_with_a_forced_on_policy_ratio_is_an_error():
    flt = {"level": "sequence", "upper": 1.01, "log_ratio": "curr-prev"}
    problems = problems_of({"force_on_policy_ratio": True, "rejection_sampling": [flt]})
    [line] = [p for p in problems if "curr-prev" in p]
    assert line.startswith("loss_fn.rejection_sampling.0.log_ratio: got 'curr-prev' with force_on_policy_ratio: true")
    assert "prev-gen" in line, line


# --------------------------------------------------------------------------- item 5: warnings
@pytest.mark.parametrize(
    "flt, start",
    [
        ({"level": "token", "statistic": "total_variation", "upper": -0.1}, "upper: got -0.1"),
        ({"level": "sequence", "statistic": "mult_prob_error", "agg": "mean", "upper": 0.9}, "upper: got 0.9"),
        ({"level": "token", "statistic": "total_variation", "lower": 1.5}, "lower: got 1.5"),
        # an unreached end of the range (the registry's `reaches`): the clamp keeps a total variation below 1
        ({"level": "token", "statistic": "total_variation", "lower": 1.0}, "lower: got 1.0"),
        # infinite bounds: nothing is on the kept side (a sum's range has no upper end)
        ({"level": "sequence", "statistic": "total_variation", "agg": "sum", "lower": float("inf")}, "lower: got inf"),
        ({"level": "token", "statistic": "kl_k1", "upper": float("-inf")}, "upper: got -inf"),
    ],
)
def test_a_bound_that_rejects_everything_warns(flt, start):
    # Legal (the loss is 0, its metrics finite: tests/core/test_properties.py draws such bounds),
    # but the run would train on nothing.
    [w] = warnings_of({"rejection_sampling": [flt]})
    assert w.startswith(f"loss_fn.rejection_sampling.0: {start}") and "rejects every unit" in w, w


def test_a_bound_at_a_reached_end_of_the_range_rejects_something():
    """The ends a statistic reaches are kept by such a bound (bounds are inclusive): a total variation
    or k3 of 0, a probability error of 1, a prob_diff of -1 or 1 (exp rounds a probability to 0 or 1)."""
    for flt in (
        {"level": "token", "statistic": "total_variation", "upper": 0.0},
        {"level": "token", "statistic": "prob_diff", "lower": 1.0},
        {"level": "token", "statistic": "prob_diff", "upper": -1.0},
        {"level": "token", "statistic": "kl_k3", "upper": 0.0},
        {"level": "sequence", "statistic": "mult_prob_error", "agg": "max", "upper": 1.0},
    ):
        assert not [w for w in warnings_of({"rejection_sampling": [flt]}) if "rejects every unit" in w], flt


@pytest.mark.parametrize(
    "flt",
    [
        {"level": "token", "statistic": "prob_diff", "lower": -1.0},
        {"level": "token", "statistic": "kl_k3", "lower": 0.0},  # inclusive: a k3 of 0 is kept
        {"level": "sequence", "statistic": "mult_prob_error", "agg": "mean", "lower": 1.0},
    ],
)
def test_a_lower_bound_at_the_lowest_value_never_rejects(flt):
    [w] = warnings_of({"rejection_sampling": [flt]})
    assert w.startswith(
        f"loss_fn.rejection_sampling.0.lower: got {flt['lower']} with statistic {flt['statistic']!r}"
    ), w
    assert "never rejects" in w, w


def test_ratio_clip_min_above_one_warns():
    [w] = warnings_of({"ratio_clip_min": 1.5})
    assert w.startswith("loss_fn.ratio_clip_min: got 1.5;") and "no lower clipping" in w, w


def test_is_correction_level_without_correction_warns():
    [w] = warnings_of({"is_correction_level": "sequence_mean"})
    assert w.startswith(
        "loss_fn.is_correction_level: got 'sequence_mean' with use_importance_sampling_correction: false"
    )
    assert not warnings_of({**IS_ON, "is_correction_level": "sequence_mean"})


def test_total_variation_upper_above_its_maximum_warns():
    [w] = warnings_of({"rejection_sampling": [{"level": "token", "statistic": "total_variation", "upper": 5}]})
    assert (
        w.startswith("loss_fn.rejection_sampling.0.upper: got 5.0 with statistic 'total_variation'")
        and "at most 1" in w
    )
    # summed over a sequence the statistic has no upper limit: nothing to say
    assert not warnings_of(
        {"rejection_sampling": [{"level": "sequence", "statistic": "total_variation", "agg": "sum", "upper": 5}]}
    )


def test_kept_denominator_without_rejection_warns():
    [w] = warnings_of({"rejection_denominator": "kept"})
    assert w.startswith("loss_fn.rejection_denominator: got 'kept'") and "rejection_sampling" in w
    assert not warnings_of({"rejection_denominator": "kept", "rejection_sampling": [{"level": "token", "upper": 2}]})
    seq_mask = {
        **IS_ON,
        "truncated_importance_sampling_type": "seq-mask-tis",
        "truncated_importance_sampling_ratio": 1.01,
        "truncated_importance_sampling_ratio_min": 0.99,
    }
    assert not warnings_of({**seq_mask, "rejection_denominator": "kept"})


def test_the_loss_warns_at_construction():
    with pytest.warns(ConfigWarning, match="is_correction_level"):
        CorrectedPGLoss({"is_correction_level": "token"})


def test_valid_configurations_do_not_warn():
    for cfg in (
        {},
        {**IS_ON, "is_correction_level": "sequence_mean"},
        {
            "rejection_sampling": [
                {"level": "sequence", "statistic": "ratio", "agg": "mean", "lower": 0.0, "upper": 1.01}
            ]
        },
        {"rejection_sampling": [{"level": "token", "statistic": "total_variation", "upper": 0.3}]},
    ):
        assert warnings_of(cfg) == [], cfg


# --------------------------------------------------------------------------- item 9: all at once
def test_five_mistakes_are_five_lines_at_once():
    problems = problems_of(
        {
            "ratio_clip_c": 0.5,
            "reference_policy_kl_type": "k9",
            "ratio_clip_max": "0.28",
            "is_corection_level": "token",
            "rejection_sampling": [{"level": "sequence", "agg": "median", "lower": 2.0, "upper": 1.0}],
        }
    )
    for start in (
        "loss_fn.is_corection_level: unknown field; did you mean 'is_correction_level'?",
        "loss_fn.reference_policy_kl_type: got 'k9'",
        "loss_fn.ratio_clip_max: got '0.28'",
        "loss_fn.ratio_clip_c: got 0.5; allowed: a number > 1, or null",
        "loss_fn.rejection_sampling.0.agg: got 'median'",
    ):
        assert sum(p.startswith(start) for p in problems) == 1, (start, problems)
    assert any("lower > upper" in p for p in problems), problems


def test_combination_checks_skip_fields_that_failed_on_their_own():
    # A bad type is one line; no second line blaming the ratio for the type it could not read.
    problems = problems_of(
        {**IS_ON, "truncated_importance_sampling_type": "clip", "truncated_importance_sampling_ratio": 2.0}
    )
    assert len(problems) == 1 and problems[0].startswith("loss_fn.truncated_importance_sampling_type: got 'clip'")


def test_a_failing_filter_does_not_hide_another_filter_s_problem():
    problems = problems_of(
        {
            "force_on_policy_ratio": True,
            "rejection_sampling": [
                {"level": "sequence", "agg": "median", "upper": 1.1},
                {"level": "sequence", "upper": 1.1, "log_ratio": "curr-prev"},
            ],
        }
    )
    assert any(p.startswith("loss_fn.rejection_sampling.0.agg: got 'median'") for p in problems), problems
    assert any(p.startswith("loss_fn.rejection_sampling.1.log_ratio: got 'curr-prev'") for p in problems), problems


def test_a_name_other_than_the_plugins_warns_in_the_python_api():
    """The name selects a loss only in a recipe; built directly, ``name: clipped_pg`` would
    still be this loss, so the user who expected NeMo-RL's plain loss is told."""
    with pytest.warns(ConfigWarning, match=r"name: got 'clipped_pg'; this configuration is the rs_clipped_pg loss"):
        CorrectedPGLoss({"name": "clipped_pg"})
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)
        CorrectedPGLoss({"name": "rs_clipped_pg"})
        CorrectedPGLoss({})


def test_tis_at_an_infinite_ratio_is_warned_about():
    with pytest.warns(ConfigWarning, match="truncated_importance_sampling_ratio: got inf with"):
        CorrectedPGLoss(
            {
                "use_importance_sampling_correction": True,
                "truncated_importance_sampling_type": "tis",
                "truncated_importance_sampling_ratio": float("inf"),
            }
        )


# --------------------------------------------------------------------------- issue 51, item 8
@pytest.mark.parametrize(
    "typo, guess", [("lowr", "lower"), ("uper", "upper"), ("statistc", "statistic"), ("lvl", None)]
)
def test_a_typo_in_a_filter_field_gets_a_did_you_mean(typo, guess):
    stage = {"level": "sequence", "agg": "mean", "lower": 0.99, "upper": 1.01}
    stage.pop(guess, None)
    [line] = problems_of({**IS_ON, "rejection_sampling": [{**stage, typo: 0.5}]})
    assert line.startswith(f"loss_fn.rejection_sampling.0.{typo}: unknown field of a rejection_sampling stage; "), line
    assert "Extra inputs" not in line and "(fields: level, " in line, line
    assert (f"did you mean {guess!r}?" in line) == (guess is not None), line


def test_a_filter_s_old_metric_field_is_read_as_its_statistic_and_warned_about():
    """One name per concept: ``metric`` (which also names what the loss logs) is ``statistic``'s old spelling."""
    import torch

    old = {"level": "sequence", "metric": "kl_k3", "agg": "mean", "upper": 0.01}
    new = {"level": "sequence", "statistic": "kl_k3", "agg": "mean", "upper": 0.01}
    assert warnings_of({**IS_ON, "rejection_sampling": [new]}) == []
    assert warnings_of({**IS_ON, "rejection_sampling": [old]}) == [
        "loss_fn.rejection_sampling.0.metric: deprecated; write statistic: kl_k3 instead (the same filter, "
        "the same metric names)"
    ]
    with pytest.warns(ConfigWarning, match="deprecated"):
        read_old = RSClippedPGLossConfig.from_any({**IS_ON, "rejection_sampling": [old]})
    read_new = RSClippedPGLossConfig.from_any({**IS_ON, "rejection_sampling": [new]})
    assert read_old.rejection_sampling[0].statistic == "kl_k3"
    assert read_old.rejection_sampling[0].label == read_new.rejection_sampling[0].label == "sequence_kl_k3_mean"
    # The same loss: a batch where the band rejects one of two sequences.
    g = torch.Generator().manual_seed(3)
    curr = -torch.rand(2, 6, generator=g)
    gen = curr + torch.tensor([[0.0], [0.3]]) * torch.randn(2, 6, generator=g)
    batch = make_batch(curr, curr, gen, advantages=torch.randn(2, 6, generator=g))
    with pytest.warns(ConfigWarning, match="deprecated"):
        loss_old, m_old = CorrectedPGLoss({**IS_ON, "rejection_sampling": [old]})(*batch)
    loss_new, m_new = CorrectedPGLoss({**IS_ON, "rejection_sampling": [new]})(*batch)
    assert m_new["rs_seq_rejected_frac"] == 0.5 and torch.equal(loss_old, loss_new) and m_old == m_new


def test_a_dump_names_each_concept_once_and_reads_back_as_the_same_filter_without_a_warning():
    """The old spellings are read into their one name and left out of ``model_dump`` (what ``simulate``,
    ``check`` and the lab re-validate and print): the dump reads back as the same filter, silently."""
    old = {"level": "token", "metric": "kl_k3", "upper": 0.5, "negative_advantages_only": True}
    with pytest.warns(ConfigWarning, match="deprecated"):
        read = RSClippedPGLossConfig.from_any({**IS_ON, "rejection_sampling": [old]})
    dumped = read.model_dump()
    [stage] = dumped["rejection_sampling"]
    assert "metric" not in stage and "negative_advantages_only" not in stage
    assert (stage["statistic"], stage["advantage_sign"]) == ("kl_k3", "negative")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = RSClippedPGLossConfig.from_any(dumped)
    assert again.rejection_sampling[0].label == read.rejection_sampling[0].label
    assert again.model_dump() == dumped
    assert "metric" not in read.model_dump_json() and "negative_advantages_only" not in read.model_dump_json()


def test_a_filter_s_metric_and_statistic_that_disagree_are_refused_by_name():
    [line] = problems_of(
        {"rejection_sampling": [{"level": "token", "metric": "kl_k3", "statistic": "ratio", "upper": 1}]}
    )
    assert line == (
        "loss_fn.rejection_sampling.0: metric: got 'kl_k3' with statistic 'ratio'; metric is the deprecated "
        "spelling of statistic: remove metric"
    ), line


@pytest.mark.parametrize("typo", ["metrc", "negative_advantage_only"])
def test_a_deprecated_filter_field_is_never_suggested_for_a_typo(typo):
    [line] = problems_of({"rejection_sampling": [{"level": "token", "upper": 2.0, typo: 1}]})
    assert "did you mean 'metric'" not in line and "did you mean 'negative_advantages_only'" not in line, line
    assert "metric" not in line.split("(fields: ")[1] and "negative_advantages_only" not in line.split("(fields: ")[1]


def test_an_infinite_upper_bound_is_not_said_to_be_at_most_inf():
    stage = {"level": "sequence", "agg": "mean", "lower": 0.99, "upper": float("inf")}
    [line] = warnings_of({**IS_ON, "rejection_sampling": [stage]})
    assert line == (
        "loss_fn.rejection_sampling.0.upper: got inf with statistic 'ratio': an infinite upper bound never rejects; "
        "remove it (no upper bound means the same)"
    ), line
