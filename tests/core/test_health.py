"""Guards core/reporting/health.py: the run-time warning when rejection eats the batch.

The monitor's windows, threshold and rate limit on constructed counts; then the loss itself:
a band far too tight for the batch warns once, on the ``nemo_rs_plugin`` logger, and a healthy
band never does. The counts ride on the metrics' one host transfer (private entries).
"""

from __future__ import annotations

import logging

import pytest
import torch

from nemo_rs_plugin.core.loss import CorrectedPGLoss
from nemo_rs_plugin.core.reporting.health import UNHEALTHY_SEQ_REJECTION, RejectionMonitor
from nemo_rs_plugin.core.settings import presets
from tests.support.logprobs import at_most_zero


def test_window_threshold_and_rate_limit():
    m = RejectionMonitor(threshold=0.2, window=100)
    assert m.observe(90, 99) is None  # the window is not full yet
    text = m.observe(0, 1)  # 90 of 100 dropped
    assert text is not None and "90%" in text and "100 sequences" in text
    assert m.observe(20, 100) is None  # exactly at the threshold: healthy
    # Unhealthy windows 2..9 are counted but silent; the 10th is reported, then the 100th.
    reported = [m.observe(50, 100) for _ in range(2, 101)]
    said = [i + 2 for i, r in enumerate(reported) if r is not None]
    assert said == [10, 100]
    assert m.unhealthy_windows == 100
    assert "100 such window(s)" in reported[-1]


def test_just_above_the_threshold_is_unhealthy():
    """21% of a window is more than 20%: it warns (not only at some larger share)."""
    assert RejectionMonitor(threshold=0.2, window=100).observe(21, 100) is not None
    assert RejectionMonitor(threshold=0.2, window=100).observe(20, 100) is None


def test_default_threshold_is_the_documented_one():
    assert RejectionMonitor().threshold == UNHEALTHY_SEQ_REJECTION == 0.2


def _batch(B=32, T=16, shift=0.3, seed=0):
    g = torch.Generator().manual_seed(seed)
    gen = -torch.rand(B, T, generator=g) * 2
    prev = gen + shift * torch.randn(B, 1, generator=g)  # whole sequences shifted: staleness
    gen, prev = at_most_zero(gen, prev)  # log-probs <= 0, the log-ratios unchanged
    pad = torch.zeros(B, 1)
    data = {
        "advantages": torch.randn(B, 1, generator=g).expand(B, T + 1).contiguous(),
        "prev_logprobs": torch.cat([pad, prev], 1),
        "generation_logprobs": torch.cat([pad, gen], 1),
        "token_mask": torch.ones(B, T + 1),
        "sample_mask": torch.ones(B),
        "input_ids": torch.zeros(B, T + 1, dtype=torch.long),
    }
    return prev, data


def _run(loss_fn, calls):
    for i in range(calls):
        prev, data = _batch(seed=i)
        B, T = prev.shape
        loss_fn(prev.clone(), data, torch.tensor(float(B)), torch.tensor(float(B * T)))


def test_a_band_too_tight_for_the_mismatch_warns_once(caplog):
    loss_fn = CorrectedPGLoss({"rejection_sampling": [presets.GEO_RS], "reference_policy_kl_penalty": 0.0})
    with caplog.at_level(logging.WARNING, logger="nemo_rs_plugin"):
        _run(loss_fn, 16)  # 16 x 32 sequences: two windows of 256, both unhealthy
    warnings = [r for r in caplog.records if "rejection sampling dropped" in r.getMessage()]
    assert len(warnings) == 1  # the second unhealthy window is counted, not repeated
    assert loss_fn.rejection_monitor.unhealthy_windows == 2


@pytest.mark.parametrize("section", [{"rejection_sampling": [{**presets.GEO_RS, "lower": 0.01, "upper": 100}]}, {}])
def test_a_healthy_band_or_no_filter_never_warns(caplog, section):
    loss_fn = CorrectedPGLoss({**section, "reference_policy_kl_penalty": 0.0})
    with caplog.at_level(logging.WARNING, logger="nemo_rs_plugin"):
        _run(loss_fn, 16)
    assert not [r for r in caplog.records if "rejection sampling dropped" in r.getMessage()]
    if section:
        assert loss_fn.rejection_monitor.unhealthy_windows == 0
    else:
        assert loss_fn.rejection_monitor is None
