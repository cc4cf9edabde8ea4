"""Guards ``core/registries/filter_options.py``: ``applies_to``, ``log_ratio``, ``advantage_sign`` and
``rejection_denominator`` stated once, and every reader follows them.

Each registry's keys are its field's ``Literal``; each entry's flags are what the loss does with
the value (checked on the loss itself below); and no module compares one of these values' names
outside the registry.
"""

import ast
import typing
from pathlib import Path

import pytest
import torch

from nemo_rs_plugin.core.correction.filters import PolicyLogProbs, filter_log_ratio
from nemo_rs_plugin.core.loss import CorrectedPGLoss
from nemo_rs_plugin.core.registries.filter_options import ADVANTAGE_SIGNS, DENOMINATORS, LOG_RATIOS, SCOPES
from nemo_rs_plugin.core.settings.config import RejectionFilter, RSClippedPGLossConfig
from nemo_rs_plugin.core.settings.rejection_filter import FilterAdvantageSign, FilterLogRatio, FilterScope

REPO = Path(__file__).resolve().parents[2]
#: What the loss implements per value, written out (each registry must say the same).
LEAVES_LOSS = {"loss": True, "policy_gradient": False}
SIGN = {"positive": 1.0, "negative": -1.0}
COUNTS_KEPT = {"original": False, "kept": True}
#: log_ratio -> (target, behaviour, the loss's own d, reads curr, 0 when prev = curr)
LOG_RATIO_FLAGS = {
    "prev-gen": ("prev", "gen", True, False, False),
    "gen-prev": ("gen", "prev", False, False, False),
    "curr-gen": ("curr", "gen", False, True, False),
    "curr-prev": ("curr", "prev", False, True, True),
}
#: field name -> its registry (what the AST check below looks for)
REGISTRIES = {
    "applies_to": SCOPES,
    "log_ratio": LOG_RATIOS,
    "advantage_sign": ADVANTAGE_SIGNS,
    "rejection_denominator": DENOMINATORS,
}


def test_each_registry_names_exactly_its_fields_values():
    assert tuple(SCOPES) == typing.get_args(FilterScope)
    assert tuple(LOG_RATIOS) == typing.get_args(FilterLogRatio)
    assert tuple(ADVANTAGE_SIGNS) == typing.get_args(FilterAdvantageSign)
    denominator = RSClippedPGLossConfig.model_fields["rejection_denominator"].annotation
    assert tuple(DENOMINATORS) == typing.get_args(denominator)
    assert {n: e.leaves_loss for n, e in SCOPES.items()} == LEAVES_LOSS
    assert {n: e.sign for n, e in ADVANTAGE_SIGNS.items()} == SIGN
    assert {n: e.counts_kept for n, e in DENOMINATORS.items()} == COUNTS_KEPT
    assert {
        n: (e.target, e.behaviour, e.is_loss_log_ratio, e.reads_current_policy, e.zero_on_policy)
        for n, e in LOG_RATIOS.items()
    } == LOG_RATIO_FLAGS


@pytest.mark.parametrize("name", list(LOG_RATIOS))
def test_each_log_ratio_is_its_target_minus_its_behaviour(name):
    entry = LOG_RATIOS[name]
    target, behaviour, is_loss_log_ratio = LOG_RATIO_FLAGS[name][:3]
    g = torch.Generator().manual_seed(0)
    log_probs = PolicyLogProbs(*(-torch.rand(2, 3, generator=g, dtype=torch.float64) for _ in range(3)))
    d = log_probs.prev - log_probs.gen
    got, finite, _, _ = filter_log_ratio(entry, d, torch.ones_like(d), log_probs, False)
    want = getattr(log_probs, target) - getattr(log_probs, behaviour)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert is_loss_log_ratio == (got is d)  # the loss's own d, reused as it is


def test_a_filters_label_adds_what_its_entries_say():
    base = dict(level="token", statistic="ratio", lower=0.5, upper=2.0)
    assert RejectionFilter(**base).label == "token_ratio"
    assert RejectionFilter(**base, log_ratio="curr-gen").label == "token_ratio_curr-gen"
    assert RejectionFilter(**base, advantage_sign="positive").label == "token_ratio_positive_advantages"
    assert RejectionFilter(**base, applies_to="policy_gradient").label == "token_ratio_policy_gradient"


def _call(cfg, advantages):
    """One loss call on 2 sequences x 4 tokens; token 2 of row 0 has ratio e^3."""
    B, T = 2, 4
    prev = torch.zeros(B, T + 1)
    gen = prev.clone()
    gen[0, 2] = -3.0
    data = {
        "advantages": torch.as_tensor(advantages, dtype=torch.float32).reshape(B, 1).expand(B, T + 1).clone(),
        "prev_logprobs": prev,
        "generation_logprobs": gen,
        "reference_policy_logprobs": prev,
        "token_mask": torch.ones(B, T + 1),
        "sample_mask": torch.ones(B),
    }
    cfg = RSClippedPGLossConfig(**cfg, reference_policy_kl_penalty=0.0)
    curr = prev[:, 1:].clone().requires_grad_(True)
    loss, metrics = CorrectedPGLoss(cfg)(curr, data, torch.tensor(float(B)), torch.tensor(float(B * T)))
    loss.backward()
    return metrics, curr.grad


@pytest.mark.parametrize("sign", list(ADVANTAGE_SIGNS))
def test_a_sign_condition_rejects_only_units_of_its_sign(sign):
    f = dict(level="token", statistic="ratio", lower=0.5, upper=2.0, advantage_sign=sign)
    for advantage in (1.0, -1.0):
        metrics, _ = _call({"rejection_sampling": [f]}, [advantage, advantage])
        rejected = metrics["rs_token_rejected_frac"] * 8
        assert rejected == pytest.approx(1.0 if advantage * SIGN[sign] > 0 else 0.0), (sign, advantage)


@pytest.mark.parametrize("scope", list(SCOPES))
def test_a_scope_that_leaves_the_loss_removes_the_token_else_only_its_policy_gradient(scope):
    """With a k1 penalty toward the sampler on: a token that leaves the loss loses its penalty's gradient too."""
    f = dict(level="token", statistic="ratio", lower=0.5, upper=2.0, applies_to=scope)
    _, grad = _call({"rejection_sampling": [f], "sampler_kl_penalty": 1.0}, [0.0, 0.0])  # only the penalty trains
    assert (grad[0, 1] == 0) == LEAVES_LOSS[scope], scope


@pytest.mark.parametrize("name", list(DENOMINATORS))
def test_a_denominator_that_counts_kept_units_divides_by_them(name):
    f = dict(level="sequence", statistic="ratio", agg="any", lower=0.5, upper=2.0)
    metrics, grad = _call({"rejection_sampling": [f], "rejection_denominator": name}, [1.0, 1.0])
    # row 1's 4 tokens are kept; the PPO slope of each is -A / N with N = 8 (original) or 4 (kept)
    n = 4.0 if COUNTS_KEPT[name] else 8.0
    torch.testing.assert_close(grad[1], torch.full((4,), -1.0 / n), rtol=1e-6, atol=0)
    assert metrics["rs_seq_rejected_frac"] == pytest.approx(0.5)


def test_no_module_compares_an_options_name_outside_its_registry():
    """``f.applies_to == "policy_gradient"`` anywhere is a second statement of what the value does;
    read its entry (``f.scope_entry``, ``f.log_ratio_entry``, ``f.sign_entry``, ``cfg.denominator_entry``)."""
    found = []
    for path in sorted((REPO / "nemo_rs_plugin").rglob("*.py")):
        if path.name == "filter_options.py" or "lab" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Compare):
                continue
            operands = [node.left, *node.comparators]
            fields = {o.attr for o in operands if isinstance(o, ast.Attribute) and o.attr in REGISTRIES}
            constants = {c.value for o in operands for c in ast.walk(o) if isinstance(c, ast.Constant)}
            if any(constants & set(REGISTRIES[field]) for field in fields):
                found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not found, found
