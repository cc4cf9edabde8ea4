"""Guards ``core/registries/truncation.py``: NeMo-RL's truncation types stated once, and every reader follows them.

The registry's keys are the config's ``TruncationType``; each entry's ``truncate`` equals a
formula written out here independently; its flags (zeroes units, per sequence, needs a lower
bound) are what the loss, the configuration's checks and ``nemo-rs check`` do; and no module
of the package compares a type's name outside the registry.
"""

import ast
import math
import typing
from pathlib import Path

import pytest
import torch

from nemo_rs_plugin.core.correction.pipeline import needs_sequence_statistics
from nemo_rs_plugin.core.correction.weights import truncate_weights
from nemo_rs_plugin.core.registries.truncation import TRUNCATIONS, truncation
from nemo_rs_plugin.core.settings.config import RSClippedPGLossConfig, TruncationType
from nemo_rs_plugin.tools.describe import describe_pipeline

REPO = Path(__file__).resolve().parents[2]
LOWER, UPPER = 0.5, 2.0
RAW = torch.tensor([[0.2, 1.0, 3.0], [0.9, 1.1, 1.5]], dtype=torch.float64)  # [B, T] token weights
SEQ_MEAN_LOG_RATIO = torch.tensor([math.log(0.3), math.log(1.2)], dtype=torch.float64)  # [B]


def _reference(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Each type's weight and out-of-bounds mask, written out from NeMo-RL's definitions."""
    if name == "tis":  # clamp to [min, max]
        return RAW.clamp(LOWER, UPPER), ((RAW < LOWER) | (RAW > UPPER)).double()
    if name == "icepop":  # zero outside [min, max]
        outside = (RAW < LOWER) | (RAW > UPPER)
        return torch.where(outside, 0.0, RAW), outside.double()
    if name == "seq-mask-tis":  # zero the sequences whose geometric mean is outside [min, max]
        g = SEQ_MEAN_LOG_RATIO.exp()
        outside = (g < LOWER) | (g > UPPER)
        return torch.where(outside[:, None], 0.0, RAW), outside.double()
    raise AssertionError(f"no reference formula for {name!r}: add one with the entry")


def _config(name: str, **extra) -> RSClippedPGLossConfig:
    return RSClippedPGLossConfig(
        use_importance_sampling_correction=True,
        truncated_importance_sampling_type=name,
        truncated_importance_sampling_ratio=UPPER,
        truncated_importance_sampling_ratio_min=LOWER,
        **extra,
    )


def test_the_registry_names_exactly_the_configs_types():
    assert tuple(TRUNCATIONS) == typing.get_args(TruncationType)


@pytest.mark.parametrize("name", list(TRUNCATIONS))
def test_each_type_truncates_as_its_reference_formula(name):
    weight, oob = truncate_weights(RAW, name, LOWER, UPPER, SEQ_MEAN_LOG_RATIO)
    expected_weight, expected_oob = _reference(name)
    torch.testing.assert_close(weight, expected_weight)
    torch.testing.assert_close(oob, expected_oob)


@pytest.mark.parametrize("name", list(TRUNCATIONS))
def test_each_entrys_flags_are_what_the_code_does(name):
    entry = TRUNCATIONS[name]
    weight, oob = truncate_weights(RAW, name, LOWER, UPPER, SEQ_MEAN_LOG_RATIO)
    outside_weights = weight[(oob > 0).expand_as(RAW) if oob.dim() == 2 else (oob > 0)[:, None].expand_as(RAW)]
    assert bool((outside_weights == 0).all()) == entry.zeroes_units, name
    assert (oob.dim() == 1) == entry.per_sequence, name  # one decision per sequence
    # a per-sequence type reads the reduced per-sequence statistics, even at the token level alone
    assert needs_sequence_statistics(_config(name, token_level_loss=True)) == entry.per_sequence, name
    if entry.requires_lower:
        with pytest.raises(ValueError, match=f"truncated_importance_sampling_type '{name}'; set a lower bound"):
            RSClippedPGLossConfig(
                use_importance_sampling_correction=True,
                truncated_importance_sampling_type=name,
                truncated_importance_sampling_ratio=UPPER,
            )
        assert entry.reference_lower is not None
    else:
        RSClippedPGLossConfig(
            use_importance_sampling_correction=True,
            truncated_importance_sampling_type=name,
            truncated_importance_sampling_ratio=UPPER,
        )


@pytest.mark.parametrize("name", list(TRUNCATIONS))
def test_the_formula_and_the_wording_are_read_off_the_entry(name):
    entry = TRUNCATIONS[name]
    description = RSClippedPGLossConfig.model_fields["truncated_importance_sampling_type"].description
    assert f"``{name}`` {entry.summary}: ``{entry.formula}``" in description
    reference = " ".join((REPO / "docs" / "configuration-reference.md").read_text().split())
    assert f"``{name}`` {entry.summary}: ``{entry.formula}``" in reference, "regenerate: nemo-rs reference"
    lines = [x.split(". ", 1)[1] for x in describe_pipeline(_config(name))]  # "3. truncation: ..."
    assert entry.describe(LOWER, UPPER) in lines and f"({entry.label})" in entry.describe(LOWER, UPPER)


def test_an_unknown_type_is_an_error_naming_the_allowed_ones():
    with pytest.raises(ValueError, match="got 'clip'; allowed: 'tis', 'icepop', 'seq-mask-tis'"):
        truncation("clip")
    with pytest.raises(ValueError, match="allowed: 'tis'"):
        truncate_weights(RAW, "clip", LOWER, UPPER)


def test_no_module_compares_a_truncation_types_name_outside_the_registry():
    """``x == "seq-mask-tis"`` or ``x in ("icepop", ...)`` anywhere but core/registries/truncation.py is a
    second statement of what a type does; read the entry's flags instead. (Presets and the lab's
    arms may *set* a type: that is configuration, not a rule.)"""
    names = set(TRUNCATIONS)
    found = []
    for path in sorted((REPO / "nemo_rs_plugin").rglob("*.py")):
        if path.name == "truncation.py" and path.parent.name == "core":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Compare):
                continue
            constants = [c for c in ast.walk(node) if isinstance(c, ast.Constant) and c.value in names]
            found += [f"{path.relative_to(REPO)}:{c.lineno}: {c.value!r}" for c in constants]
    assert not found, found
