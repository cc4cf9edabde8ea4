"""Guards ``core/settings/rejection_filter.py``: a stage is the kind its ``level`` names.

A token filter (``TokenFilter``) and a sequence filter (``SequenceFilter``) are one
discriminated union keyed on ``level``: the configuration parses each ``rejection_sampling``
entry into its kind, ``RejectionFilter(level=...)`` builds it, and only the sequence filter has
``agg``. A field of the other kind is refused at its location, with the stage's other problems,
each at its own, as one class refused it before the union.
"""

import pickle
import typing

import pytest
from pydantic import BaseModel

from nemo_rs_plugin.core.registries.filter_levels import FILTER_LEVELS
from nemo_rs_plugin.core.settings.config import ConfigError, RejectionFilter, RSClippedPGLossConfig
from nemo_rs_plugin.core.settings.rejection_filter import (
    FILTER_KINDS,
    FilterLevel,
    SequenceFilter,
    TokenFilter,
    current_filter_fields,
    parse_filter,
)


def problems_of(*stages: dict) -> list[str]:
    with pytest.raises(ConfigError) as info:
        RSClippedPGLossConfig.from_any({"rejection_sampling": list(stages)})
    return info.value.problems


def test_one_kind_per_level_and_only_whole_sequence_levels_aggregate():
    assert tuple(FILTER_KINDS) == typing.get_args(FilterLevel) == tuple(FILTER_LEVELS)
    for level, kind in FILTER_KINDS.items():
        assert typing.get_args(kind.model_fields["level"].annotation) == (level,)
        assert ("agg" in kind.model_fields) == FILTER_LEVELS[level].whole_sequences, level
    assert "agg" not in RejectionFilter.model_fields  # the shared base has no level's own field
    assert "agg" in current_filter_fields()  # ... but a misspelled key is still compared with it


@pytest.mark.parametrize(
    "stage, kind, aggregation",
    [
        ({"level": "token", "upper": 2.0}, TokenFilter, None),
        ({"level": "token", "upper": 2.0, "agg": None}, TokenFilter, None),  # null says nothing: accepted
        ({"level": "sequence", "upper": 1.1}, SequenceFilter, "mean"),  # the default aggregation
        ({"level": "sequence", "upper": 1.1, "agg": "max"}, SequenceFilter, "max"),
    ],
)
def test_each_way_of_building_a_stage_gives_the_kind_its_level_names(stage, kind, aggregation):
    built = [
        RejectionFilter(**stage),
        RejectionFilter.model_validate(stage),
        parse_filter(stage),
        RSClippedPGLossConfig.from_any({"rejection_sampling": [stage]}).rejection_sampling[0],
    ]
    for f in built:
        assert type(f) is kind, (stage, type(f))
        assert f.aggregation == aggregation
        assert f == built[0]
        again = pickle.loads(pickle.dumps(f))  # NeMo-RL pickles the loss to its Ray workers
        assert type(again) is kind and again == f


def test_a_kind_built_by_its_own_name_needs_no_level():
    assert TokenFilter(upper=2.0) == RejectionFilter(level="token", upper=2.0)
    assert SequenceFilter(upper=1.1, agg="sum").label == "sequence_ratio_sum"


def test_a_field_of_the_other_level_is_located_there_with_the_stages_other_problems():
    agg = "loss_fn.rejection_sampling.0.agg: got 'mean' on a token filter; agg is only allowed with level: sequence"
    assert problems_of({"level": "token", "agg": "mean", "upper": 2.0}) == [agg]
    assert problems_of({"level": "token", "agg": "mean", "lower": 3.0, "upper": 1.0}) == [
        "loss_fn.rejection_sampling.0: lower > upper: got lower=3.0, upper=1.0; need lower <= upper",
        agg,
    ]
    misspelled, on_agg = problems_of({"level": "token", "agg": "mean", "uper": 2.0, "lower": 0.5})
    assert (
        misspelled.startswith("loss_fn.rejection_sampling.0.uper: unknown field")
        and "did you mean 'upper'" in misspelled
    )
    assert on_agg == agg
    statistic, on_agg = problems_of({"level": "token", "agg": "mean", "statistic": "nope", "upper": 1.0})
    assert statistic.startswith("loss_fn.rejection_sampling.0.statistic: got 'nope'") and on_agg == agg
    with pytest.raises(ValueError, match="got 'max' on a token filter; agg is only allowed with level: sequence"):
        TokenFilter(agg="max", upper=2.0)


def test_every_way_pydantic_builds_a_model_gives_a_kind_never_the_shared_base():
    stage = SequenceFilter(upper=1.1, agg="max")
    assert RejectionFilter.model_validate_json(stage.model_dump_json()) == stage
    assert type(RejectionFilter.model_validate_strings({"level": "token", "upper": "2"})) is TokenFilter
    assert type(RejectionFilter.model_construct(level="sequence", upper=2.0)) is SequenceFilter

    class Holder(BaseModel):
        stage: RejectionFilter  # the base as a field type: it would be neither kind

    with pytest.raises(ValueError, match="a stage must be the kind its level names: type the field AnyRejectionFilter"):
        Holder(stage={"level": "token", "upper": 2.0})
    with pytest.raises(ValueError, match="level: got 'sequence' in model_copy of a token filter"):
        TokenFilter(upper=2.0).model_copy(update={"level": "sequence"})


@pytest.mark.parametrize(
    "stage, expected",
    [
        (
            {"level": "tokens", "upper": 2.0},
            "loss_fn.rejection_sampling.1.level: got 'tokens'; allowed: token or sequence",
        ),
        ({"upper": 2.0}, "loss_fn.rejection_sampling.1.level: missing; allowed: token or sequence"),
    ],
)
def test_a_level_that_names_no_kind_is_one_line_on_the_level(stage, expected):
    # the union's tag error, not pydantic's "Unable to extract tag" or the tag inside the location
    [line] = problems_of({"level": "token", "upper": 2.0}, stage)
    assert line.startswith(expected), line


def test_a_field_error_inside_a_stage_is_located_without_the_kind():
    [line] = problems_of({"level": "sequence", "agg": "median", "upper": 1.0})
    assert line.startswith("loss_fn.rejection_sampling.0.agg: got 'median'"), line


RESOLVED_CASES = [
    {"level": "token", "lower": 0.5, "upper": 2.0},
    {"level": "token", "statistic": "kl_k3", "upper": 0.5, "log_ratio": "curr-gen", "applies_to": "policy_gradient"},
    {"level": "token", "statistic": "prob_diff", "lower": -0.2, "upper": 0.2, "advantage_sign": "positive"},
    {"level": "sequence", "agg": "any", "lower": 0.0, "upper": 4.0},
    {
        "level": "sequence",
        "statistic": "ratio",
        "lower": 0.9,
        "upper": 1.1,
        "advantage_sign": "negative",
        "name": "opsm",
    },
]


@pytest.mark.parametrize("fields", RESOLVED_CASES, ids=lambda f: "-".join(str(v) for v in f.values()))
def test_a_resolved_stage_holds_what_its_filter_reads_and_the_filter_code_reads_it_alike(fields):
    import dataclasses

    import torch

    from nemo_rs_plugin.core.correction.filters import (
        PolicyLogProbs,
        filter_statistic,
        plan_sequence_filter,
        plan_token_filter,
    )
    from nemo_rs_plugin.core.masking import TokenMasks
    from nemo_rs_plugin.core.settings.rejection_filter import FilterStage

    f = RejectionFilter(**fields)
    stage = f.resolved()
    assert isinstance(stage, FilterStage)
    for field in dataclasses.fields(FilterStage):
        assert getattr(stage, field.name) == getattr(f, field.name), field.name
    with pytest.raises(dataclasses.FrozenInstanceError):
        stage.label = "other"  # type: ignore[misc]
    pickle.loads(pickle.dumps(f))  # the configuration stays plain data: nothing resolved is cached on it

    g = torch.Generator().manual_seed(0)
    curr, prev, gen = (-torch.rand(3, 6, generator=g, dtype=torch.float64) for _ in range(3))
    ones = torch.ones(3, 6, dtype=torch.float64)
    masks = TokenMasks.build(torch.ones(3, 6, dtype=torch.long), torch.ones(3, dtype=torch.float64), ones, ones)

    log_probs = PolicyLogProbs(curr=curr, prev=prev, gen=gen)
    signs = torch.tensor([[1.0, -1.0, 1.0, -1.0, 1.0, -1.0]] * 3, dtype=torch.float64)
    negative, positive = (signs < 0).double(), (signs > 0).double()
    results = []
    for settings in (f, stage):
        stat, finite = filter_statistic(settings, prev - gen, masks, log_probs)
        if stage.level_entry.whole_sequences:
            s = plan_sequence_filter(settings, stat, finite, masks.valid_bin, negative, torch.finfo(stat.dtype).max)
            results.append([t for t in dataclasses.astuple(s) if isinstance(t, torch.Tensor)])
        else:
            s, kept = plan_token_filter(settings, stat, finite, masks.valid_bin, negative, positive)
            results.append([kept, s.rejected])
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_a_loss_with_resolved_stages_pickles_and_rebuilds_them():
    """NeMo-RL pickles its loss to the Ray workers: the stages (whose entries hold lambdas) are
    left out and rebuilt from the configuration, and the restored loss computes the same."""
    import torch

    from nemo_rs_plugin import CorrectedPGLoss
    from tests.conftest import random_batch

    loss = CorrectedPGLoss({"rejection_sampling": RESOLVED_CASES[:4]})
    with pytest.raises(Exception):
        pickle.dumps(loss.filter_stages)  # why the loss leaves them out
    restored = pickle.loads(pickle.dumps(loss))
    assert restored.filter_stages == loss.filter_stages and restored.filter_stages is not loss.filter_stages
    lp, data, gvs, gvt = random_batch(3, 8)
    (a, ma), (b, mb) = (fn(lp, data, gvs, gvt) for fn in (loss, restored))
    assert torch.equal(a, b) and ma == mb
