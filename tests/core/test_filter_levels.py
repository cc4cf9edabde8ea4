"""Guards ``core/registries/filter_levels.py``: a rejection filter's levels stated once, and every reader follows them.

The registry's keys are the filter's ``FilterLevel``; each entry's flags are what the filter
accepts and what the loss does with it (a whole-sequence level takes ``agg`` and rejects rows;
the others reject tokens); and no module compares a level's name outside the registry.
"""

import ast
import typing
from pathlib import Path

import pytest
import torch

from nemo_rs_plugin.core.loss import CorrectedPGLoss
from nemo_rs_plugin.core.registries.filter_levels import FILTER_LEVELS, rejection_level
from nemo_rs_plugin.core.settings.config import RejectionFilter, RSClippedPGLossConfig
from nemo_rs_plugin.core.settings.rejection_filter import FilterAdvantageSign as AdvantageSign
from nemo_rs_plugin.core.settings.rejection_filter import FilterLevel, FilterScope

REPO = Path(__file__).resolve().parents[2]
#: What the loss implements per level, written out (the registry must say the same): a sequence
#: decision conditioned on a sign drops the row's negative-advantage tokens only (OPSM), and
#: cannot remove policy-gradient terms alone.
IMPLEMENTED = {
    "token": {"signs": {"negative", "positive"}, "scopes": {"loss", "policy_gradient"}, "agg": False},
    "sequence": {"signs": {"negative"}, "scopes": {"loss"}, "agg": True},
}


def test_the_registry_names_exactly_the_filters_levels():
    assert tuple(FILTER_LEVELS) == typing.get_args(FilterLevel)
    for name, entry in FILTER_LEVELS.items():
        expected = IMPLEMENTED[name]
        assert set(entry.advantage_signs) == expected["signs"], name
        assert set(entry.scopes) == expected["scopes"], name
        assert entry.whole_sequences == expected["agg"], name
    for entry in FILTER_LEVELS.values():
        assert set(entry.advantage_signs) <= set(typing.get_args(AdvantageSign))
        assert set(entry.scopes) <= set(typing.get_args(FilterScope)) and "loss" in entry.scopes


@pytest.mark.parametrize("name", list(FILTER_LEVELS))
def test_each_level_accepts_exactly_what_its_entry_allows(name):
    entry = FILTER_LEVELS[name]
    base = dict(level=name, statistic="ratio", lower=0.5, upper=2.0)
    for sign in typing.get_args(AdvantageSign):
        if sign in entry.advantage_signs:
            RejectionFilter(**base, advantage_sign=sign)
        else:
            with pytest.raises(ValueError, match=f"advantage_sign: got '{sign}' on a {name} filter"):
                RejectionFilter(**base, advantage_sign=sign)
    for scope in typing.get_args(FilterScope):
        if scope in entry.scopes:
            RejectionFilter(**base, applies_to=scope)
        else:
            with pytest.raises(ValueError, match=f"applies_to: got '{scope}' on a {name} filter"):
                RejectionFilter(**base, applies_to=scope)
    if entry.whole_sequences:
        assert RejectionFilter(**base, agg="max").aggregation == "max"
    else:
        assert RejectionFilter(**base).aggregation is None
        with pytest.raises(ValueError, match=f"agg\\n  Value error, got 'max' on a {name} filter"):
            RejectionFilter(**base, agg="max")


@pytest.mark.parametrize("name", list(FILTER_LEVELS))
def test_a_whole_sequence_level_rejects_rows_and_the_others_tokens(name):
    """One token far outside the band: a whole-sequence level (agg any) drops its row, a token level the token."""
    entry = FILTER_LEVELS[name]
    B, T = 2, 4
    prev = torch.zeros(B, T + 1)
    gen = prev.clone()
    gen[0, 2] = -3.0  # prev - gen = 3: ratio e^3 at one token of row 0
    data = {
        "advantages": torch.ones(B, T + 1),
        "prev_logprobs": prev,
        "generation_logprobs": gen,
        "reference_policy_logprobs": prev,
        "token_mask": torch.ones(B, T + 1),
        "sample_mask": torch.ones(B),
        "input_ids": torch.zeros(B, T + 1, dtype=torch.long),
    }
    f = dict(level=name, statistic="ratio", lower=0.5, upper=2.0) | ({"agg": "any"} if entry.whole_sequences else {})
    cfg = RSClippedPGLossConfig(rejection_sampling=[f], reference_policy_kl_penalty=0.0)
    _, m = CorrectedPGLoss(cfg)(prev[:, 1:].clone(), data, torch.tensor(float(B)), torch.tensor(float(B * T)))
    rejected_tokens = m["rs_token_rejected_frac"] * B * T
    assert rejected_tokens == pytest.approx(T if entry.whole_sequences else 1), name
    assert (m["rs_seq_rejected_frac"] > 0) == entry.whole_sequences, name


def test_an_unknown_level_is_an_error_naming_the_allowed_ones():
    with pytest.raises(ValueError, match="level: got 'group'; allowed: 'token', 'sequence'"):
        rejection_level("group")


def test_no_module_compares_a_levels_name_outside_the_registry():
    """``f.level == "token"`` anywhere is a second statement of what a level does; read the entry
    (``f.level_entry``: ``whole_sequences``, ``units``, ``advantage_signs``, ``scopes``) instead."""
    found = []
    for path in sorted((REPO / "nemo_rs_plugin").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Compare):
                continue
            operands = [node.left, *node.comparators]
            reads_level = any(
                (isinstance(o, ast.Attribute) and o.attr == "level")
                or (isinstance(o, ast.Subscript) and isinstance(o.slice, ast.Constant) and o.slice.value == "level")
                or (isinstance(o, ast.Call) and any(isinstance(a, ast.Constant) and a.value == "level" for a in o.args))
                for o in operands
            )
            constants = {c.value for o in operands for c in ast.walk(o) if isinstance(c, ast.Constant)}
            if reads_level and constants & set(FILTER_LEVELS):
                found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not found, found
