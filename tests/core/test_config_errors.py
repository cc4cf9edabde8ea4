"""Guards ``core/settings/config_errors.py``: how values and pydantic's errors become one line per problem.

The rules themselves are ``config_problems`` (tests/core/test_config_problems.py); here, what the
section's reader does with a value before and after pydantic sees it: the YAML spelling of a
value, the coercions refused (with the YAML 1.1 exponent hint), a failed field left out so that
one mistake is one line, and the union's tag dropped from a stage's error location.
"""

import pytest
from pydantic import ValidationError

from nemo_rs_plugin.core.settings.config import RSClippedPGLossConfig
from nemo_rs_plugin.core.settings.config_errors import (
    blames,
    coercion_problem,
    failed_locations,
    format_validation_error,
    left_out,
    shown,
    without_coercions,
    without_locations,
)


@pytest.mark.parametrize("value, text", [(True, "true"), (False, "false"), (None, "null"), ("a", "'a'"), (0.5, "0.5")])
def test_a_value_is_shown_as_the_recipe_spells_it(value, text):
    assert shown(value) == text


@pytest.mark.parametrize(
    "value, annotation, expected",
    [
        ("1e-4", float, "x: got '1e-4' (a string); allowed: a number: YAML 1.1 reads 1e-4 as a string, write 1.0e-4"),
        ("3e5", float, "write 3.0e+5"),
        ("0.2", float, "x: got '0.2' (a string); allowed: a number, unquoted"),
        (True, float, "x: got true (a boolean); allowed: a number"),
        ("true", bool, "x: got 'true' (a string); allowed: true or false, unquoted"),
    ],
)
def test_a_value_pydantic_would_coerce_is_refused_by_name(value, annotation, expected):
    problem = coercion_problem("x", value, annotation)
    assert problem is not None and expected in problem, problem


@pytest.mark.parametrize("value, annotation", [(0.2, float), (3, float), (True, bool), (None, float), ("token", str)])
def test_a_value_of_the_right_kind_passes(value, annotation):
    assert coercion_problem("x", value, annotation) is None


def test_coercions_are_taken_out_at_the_top_level_and_inside_a_stage():
    raw = {
        "ratio_clip_min": "0.2",
        "rejection_sampling": [{"level": "token", "upper": "2"}, {"level": "sequence", "lower": 0.9}],
    }
    clean, problems, bad = without_coercions(raw, RSClippedPGLossConfig.model_fields)
    assert problems == [
        "ratio_clip_min: got '0.2' (a string); allowed: a number, unquoted",
        "rejection_sampling.0.upper: got '2' (a string); allowed: a number, unquoted",
    ]
    assert bad == {("ratio_clip_min",), ("rejection_sampling", 0, "upper")}
    assert clean == {"rejection_sampling": [{"level": "token"}, {"level": "sequence", "lower": 0.9}]}


def test_a_stage_error_is_located_as_the_recipe_spells_it_without_the_union_tag():
    raw = {"rejection_sampling": [{"level": "sequence", "agg": "median", "upper": 1.0}]}
    with pytest.raises(ValidationError) as info:
        RSClippedPGLossConfig(**raw)
    assert ("rejection_sampling", 0, "sequence", "agg") in {tuple(e["loc"]) for e in info.value.errors()}
    assert failed_locations(info.value) == {("rejection_sampling", 0, "agg")}
    [line] = format_validation_error(info.value)
    assert line.startswith("rejection_sampling.0.agg: got 'median'; Input should be 'mean'"), line


def test_a_failed_field_is_left_out_and_its_consequences_are_not_reported_again():
    failed = {("rejection_sampling", 1, "upper"), ("ratio_clip_min",)}
    assert left_out(failed) == {"ratio_clip_min"}
    raw = {
        "ratio_clip_min": "x",
        "ratio_clip_max": 0.2,
        "rejection_sampling": [{"level": "token", "upper": 2.0}, {"level": "token", "upper": "2"}],
    }
    assert without_locations(raw, failed) == {
        "ratio_clip_max": 0.2,
        "rejection_sampling": [{"level": "token", "upper": 2.0}, {"level": "token"}],
    }
    # the stage without its upper bound has no bound: that line follows from the reported one
    assert blames("rejection_sampling.1: a filter needs at least one bound: set lower, upper or both", failed)
    assert blames("ratio_clip_min: must be below ratio_clip_max", failed)
    assert not blames("rejection_sampling.0: a filter needs at least one bound", failed)
