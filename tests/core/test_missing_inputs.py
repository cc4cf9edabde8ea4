"""An input the configuration reads but the caller left out: a ``KeyError`` naming it, never a ``TypeError``."""

from __future__ import annotations

import pytest
import torch

from nemo_rs_plugin.core.batch.inputs import LossInputs
from nemo_rs_plugin.core.loss import CorrectedPGLoss


def _inputs(**missing: None) -> LossInputs:
    lp = torch.full((2, 3), -1.0, dtype=torch.float64)
    fields = dict(
        curr=lp.clone().requires_grad_(True),
        prev=lp - 0.1,
        generation=lp - 0.2,
        reference=lp - 0.3,
        advantages=torch.ones_like(lp),
        token_mask=torch.ones_like(lp),
        sample_mask=torch.ones(2, dtype=torch.float64),
    )
    fields.update(missing)
    return LossInputs(**fields)


def _compute(cfg: dict, x: LossInputs):
    count = torch.tensor(6.0, dtype=torch.float64)
    return CorrectedPGLoss(cfg).compute(x, torch.tensor(2.0, dtype=torch.float64), count)


def test_missing_prev_logprobs_names_the_field_and_the_setting():
    with pytest.raises(KeyError, match=r"prev_logprobs.*force_on_policy_ratio is off"):
        _compute({"reference_policy_kl_penalty": 0.0}, _inputs(prev=None))


def test_missing_prev_logprobs_is_fine_under_the_forced_on_policy_ratio():
    loss, _ = _compute({"reference_policy_kl_penalty": 0.0, "force_on_policy_ratio": True}, _inputs(prev=None))
    assert torch.isfinite(loss)


def test_missing_reference_logprobs_names_the_field_when_the_kl_term_is_on():
    with pytest.raises(KeyError, match=r"reference_policy_logprobs.*the KL penalty is on"):
        _compute({"reference_policy_kl_penalty": 0.1}, _inputs(reference=None))
    loss, _ = _compute({"reference_policy_kl_penalty": 0.0}, _inputs(reference=None))  # off: never read
    assert torch.isfinite(loss)


def test_a_reader_of_per_sequence_counts_outside_needs_sequence_statistics_fails_by_name(monkeypatch):
    """The sequence-level loss reads the per-sequence counts: if the correction skipped them, the error says why."""
    import nemo_rs_plugin.core.correction.pipeline as pipeline

    monkeypatch.setattr(pipeline, "needs_sequence_statistics", lambda cfg: False)
    with pytest.raises(RuntimeError, match=r"needs_sequence_statistics\(cfg\) must hold"):
        _compute({"reference_policy_kl_penalty": 0.0, "token_level_loss": False}, _inputs())
