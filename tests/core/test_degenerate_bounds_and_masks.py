"""Corner cases of the tensor math that each hid a wrong branch from every other test.

Each test below was written against a deliberate break of the code it guards, and failed
there: the ``sequence_mean`` denominator under a fractional ``sample_mask``, a ratio band
whose lower bound is 0, masked tokens with log-ratios far beyond ``exp``'s range, and
``icepop`` without its lower bound.
"""

import math

import pytest
import torch

from nemo_rs_plugin import ConfigError, CorrectedPGLoss
from tests.conftest import make_batch

IS = {"use_importance_sampling_correction": True}


def _batch(d, token_mask=None, sample_mask=None):
    gen = torch.full(d.shape, -2.0)
    prev = gen + d
    return make_batch(prev.clone(), prev, gen, token_mask=token_mask, sample_mask=sample_mask)


def test_sequence_mean_weight_averages_over_the_valid_tokens_whatever_the_sample_weight():
    """``w_i = exp(sum_t m_it d_it / n_i)`` with ``m = token_mask * sample_mask`` in both sums.

    A fractional sample weight scales numerator and denominator alike, so the geometric mean
    is the same as with weight 1; dividing by the token count instead would shrink the
    exponent by the sample weight.
    """
    d = torch.tensor([[0.3, -0.1, 0.4, 9.0], [0.2, 0.2, 0.2, 0.2]])
    token_mask = [[1, 1, 1, 0], [1, 1, 1, 1]]
    want = [math.exp(0.6 / 3), math.exp(0.2)]
    loss_fn = CorrectedPGLoss({**IS, "is_correction_level": "sequence_mean"})
    for sample_mask in ([1.0, 1.0], [0.25, 0.5], [0.5, 1.0]):
        _, metrics = loss_fn(*_batch(d, token_mask, sample_mask))
        assert metrics["is_weight_min"] == pytest.approx(min(want), rel=1e-6), sample_mask
        assert metrics["is_weight_max"] == pytest.approx(max(want), rel=1e-6), sample_mask


@pytest.mark.parametrize("level, agg", [("token", None), ("sequence", "min"), ("sequence", "mean")])
def test_a_ratio_band_with_lower_bound_zero_has_no_lower_bound(level, agg):
    """``lower: 0`` on a ratio is ``log 0 = -inf``: open below, not a bound at ratio 1."""
    d = torch.tensor([[-0.7, -1.5, -0.2], [-3.0, -2.0, -4.0]])  # every ratio below 1, none above 2
    spec = {"level": level, "statistic": "ratio", "lower": 0, "upper": 2.0, **({"agg": agg} if agg else {})}
    _, metrics = CorrectedPGLoss({**IS, "rejection_sampling": [spec]})(*_batch(d))
    assert metrics["rs_token_rejected_frac"] == 0.0
    assert metrics["rs_seq_rejected_frac"] == 0.0


CONFIGS_READING_THE_LOG_RATIO = {
    "plain": {},
    "token-is": IS,
    "sequence-is": {**IS, "is_correction_level": "sequence"},
    "kl-k3": {"reference_policy_kl_penalty": 0.1, "reference_policy_kl_type": "k3"},
    "mult_prob_error-filters": {
        **IS,
        "rejection_sampling": [
            {"level": "sequence", "statistic": "mult_prob_error", "agg": "max", "upper": 3.0},
            {"level": "token", "statistic": "mult_prob_error", "upper": 3.0},
            {"level": "sequence", "statistic": "kl_k3", "agg": "sum", "upper": 3.0},
        ],
    },
}


@pytest.mark.parametrize("cfg", list(CONFIGS_READING_THE_LOG_RATIO.values()), ids=list(CONFIGS_READING_THE_LOG_RATIO))
@pytest.mark.parametrize("extreme", [1000.0, -1000.0])
def test_masked_tokens_with_extreme_log_ratios_leave_every_metric_finite(cfg, extreme):
    """A masked position may hold any finite log-prob (engines pad with -1e4, say).

    ``exp`` of its log-ratio overflows to ``inf``, and ``inf * 0`` in a masked sum is NaN: a
    masked token must never reach ``exp`` unmasked. It also must not reject its sequence.
    """
    d = torch.tensor([[0.1, -0.2, extreme], [0.05, 0.0, 0.1]])
    token_mask = [[1, 1, 0], [1, 1, 1]]
    batch = _batch(d, token_mask)
    loss, metrics = CorrectedPGLoss(cfg)(*batch)
    bad = {k: v for k, v in metrics.items() if not math.isfinite(v)}
    assert math.isfinite(loss.item()) and not bad, bad
    assert metrics["token_mult_prob_error"] == pytest.approx(
        sum(math.exp(abs(x)) for x in (0.1, -0.2, 0.05, 0.0, 0.1)) / 5, rel=1e-6
    )
    if "rejection_sampling" in cfg:
        assert metrics["rs_seq_rejected_frac"] == 0.0 and metrics["rs_token_rejected_frac"] == 0.0


def test_icepop_without_its_lower_bound_is_refused_as_nemo_rl_refuses_it():
    with pytest.raises(ConfigError) as err:
        CorrectedPGLoss(
            {**IS, "truncated_importance_sampling_type": "icepop", "truncated_importance_sampling_ratio": 2.0}
        )
    assert "truncated_importance_sampling_ratio_min: got null" in str(err.value)
    assert "icepop" in str(err.value)
