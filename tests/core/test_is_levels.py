"""The IS correction level (docs/guide.md#is-correction-level), decoupled from GSPO's policy ratio.

Batch (aligned positions; d = prev - gen):
  row 0: d = [0.1, -0.2, 0.3], all valid      sum 0.2, mean 0.2/3
  row 1: d = [0.5,  0.5, ---], last masked    sum 1.0, mean 0.5
curr == prev and A = 1, so the PPO/GSPO ratio is 1 and the loss is -(weighted mean of w).
"""

import math

import pytest
import torch

from nemo_rs_plugin import CorrectedPGLoss
from tests.conftest import make_batch

D = torch.tensor([[0.1, -0.2, 0.3], [0.5, 0.5, 0.0]])
TOKEN_MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
PREV = torch.full((2, 3), -1.0)
GEN = PREV - D

e = math.exp
TOKEN_W = [[e(0.1), e(-0.2), e(0.3)], [e(0.5), e(0.5)]]
SEQ_W = [e(0.2), e(1.0)]  # 1.2214, 2.7183
SEQ_MEAN_W = [e(0.2 / 3), e(0.5)]  # 1.0689, 1.6487
N_TOK = 5
N_SEQ = 2


def expected_loss(level: str, gspo: bool) -> float:
    # Token-level loss: -sum_t w_t / 5. GSPO (sequence-level loss): -mean_i mean_t w_it.
    if level == "token":
        rows = TOKEN_W
    else:
        w = SEQ_W if level == "sequence" else SEQ_MEAN_W
        rows = [[w[0]] * 3, [w[1]] * 2]
    if not gspo:
        return -sum(sum(r) for r in rows) / N_TOK
    return -sum(sum(r) / len(r) for r in rows) / N_SEQ


@pytest.mark.parametrize("gspo", [False, True], ids=["ppo-ratio", "gspo-ratio"])
@pytest.mark.parametrize("level", ["token", "sequence", "sequence_mean"])
def test_level_times_ratio(level, gspo):
    cfg = {
        "use_importance_sampling_correction": True,
        "is_correction_level": level,
        "sequence_level_importance_ratios": gspo,
        "token_level_loss": not gspo,
        "reference_policy_kl_penalty": 0.0,
    }
    lp, data, gvs, gvt = make_batch(PREV, PREV, GEN, token_mask=TOKEN_MASK)
    loss, metrics = CorrectedPGLoss(cfg)(lp, data, gvs, gvt)
    assert loss.item() == pytest.approx(expected_loss(level, gspo), rel=1e-5)
    # The metric follows the IS level: per token for token, per sequence otherwise.
    if level == "token":
        want = sum(sum(r) for r in TOKEN_W) / N_TOK
    else:
        want = sum(SEQ_W if level == "sequence" else SEQ_MEAN_W) / N_SEQ
    assert metrics["sampling_importance_ratio"] == pytest.approx(want, rel=1e-5)
    assert metrics["is_weight_mean"] == pytest.approx(want, rel=1e-5)
    # The second moment (for the global ESS), per token or per sequence like the mean.
    if level == "token":
        sq = sum(w * w for r in TOKEN_W for w in r) / N_TOK
    else:
        sq = sum(w * w for w in (SEQ_W if level == "sequence" else SEQ_MEAN_W)) / N_SEQ
    assert metrics["is_weight_sq_mean"] == pytest.approx(sq, rel=1e-5)
    # ... and each is declared with the denominator it was divided by (docs/guide.md#metrics).
    unit = "tokens" if level == "token" else "sequences"
    norms = CorrectedPGLoss(cfg).metric_normalizations()
    for key in ("is_weight_raw_mean", "is_weight_mean", "is_weight_sq_mean", "sampling_importance_ratio"):
        assert norms[key] == unit, key


def test_unset_level_follows_the_gspo_flag():
    base = {"use_importance_sampling_correction": True, "reference_policy_kl_penalty": 0.0}
    lp, data, gvs, gvt = make_batch(PREV, PREV, GEN, token_mask=TOKEN_MASK)
    loss, _ = CorrectedPGLoss(base)(lp, data, gvs, gvt)
    assert loss.item() == pytest.approx(expected_loss("token", False), rel=1e-5)
    gspo = {**base, "sequence_level_importance_ratios": True, "token_level_loss": False}
    lp, data, gvs, gvt = make_batch(PREV, PREV, GEN, token_mask=TOKEN_MASK)
    loss, _ = CorrectedPGLoss(gspo)(lp, data, gvs, gvt)
    assert loss.item() == pytest.approx(expected_loss("sequence", True), rel=1e-5)


@pytest.mark.parametrize("level", ["token", "sequence", "sequence_mean"])
def test_gspo_ratio_is_independent_of_the_is_level(level):
    # curr - prev = [0.1, 0.1, 0.4] and [0.2, -0.2, (masked)]: GSPO ratios exp(0.2), exp(0).
    curr = PREV + torch.tensor([[0.1, 0.1, 0.4], [0.2, -0.2, 5.0]])
    cfg = {
        "is_correction_level": level,
        "use_importance_sampling_correction": True,
        "sequence_level_importance_ratios": True,
        "token_level_loss": False,
        "ratio_clip_min": 1.0,  # 1 - 1 = 0: no lower clipping (10 says the same with a ConfigWarning)
        "ratio_clip_max": 10.0,
        "reference_policy_kl_penalty": 0.0,
    }
    lp, data, gvs, gvt = make_batch(curr, PREV, GEN, token_mask=TOKEN_MASK)
    _, metrics = CorrectedPGLoss(cfg)(lp, data, gvs, gvt)
    assert metrics["probs_ratio"] == pytest.approx((3 * e(0.2) + 2 * 1.0) / 5, rel=1e-5)
    assert metrics["probs_ratio_max"] == pytest.approx(e(0.2), rel=1e-6)


def test_sequence_mean_stays_near_one_where_sequence_collapses():
    # 9000 tokens with a 2% per-token mismatch of one sign: exp(sum) collapses, exp(mean) not.
    T = 9000
    prev = torch.full((1, T), -1.0)
    gen = prev + 0.02 * (0.5 + torch.rand(1, T))  # d ~ -0.02 on average
    weights = {}
    for level in ("sequence", "sequence_mean"):
        lp, data, gvs, gvt = make_batch(prev, prev, gen)
        _, m = CorrectedPGLoss({"use_importance_sampling_correction": True, "is_correction_level": level})(
            lp, data, gvs, gvt
        )
        weights[level] = m["is_weight_mean"]
    assert weights["sequence"] < 1e-50
    assert 0.97 < weights["sequence_mean"] < 0.99


def test_the_is_level_formulas_are_stated_once_and_everywhere_alike():
    """``is_levels.IS_LEVELS`` is the one statement of the levels; the config's field description
    (and so the configuration reference), ``nemo-rs check``'s wording and the guide's table are
    read off it or checked against it, and the weights the loss computes follow its entries."""
    import typing
    from pathlib import Path

    from nemo_rs_plugin.core.correction import weights
    from nemo_rs_plugin.core.registries.is_levels import IS_LEVELS
    from nemo_rs_plugin.core.settings.config import ISCorrectionLevel, RSClippedPGLossConfig
    from nemo_rs_plugin.tools.describe import describe_pipeline

    assert tuple(IS_LEVELS) == typing.get_args(ISCorrectionLevel)  # the config names the registry's levels
    docs = Path(__file__).resolve().parents[2] / "docs"
    places = {
        "config field": RSClippedPGLossConfig.model_fields["is_correction_level"].description,
        "configuration reference": (docs / "configuration-reference.md").read_text(),
    }
    guide = (docs / "guide.md").read_text()
    for level, entry in IS_LEVELS.items():
        for where, text in places.items():  # each level next to its own formula, not just somewhere
            assert f"``{level}``: ``{entry.formula}``" in " ".join(text.split()), (level, where)
        assert f"| `{level}` | `{entry.formula}` |" in guide, level
        cfg = RSClippedPGLossConfig(use_importance_sampling_correction=True, is_correction_level=level)
        assert any(f"{level}, {entry.formula} {entry.unit}" in line for line in describe_pipeline(cfg)), level
    # and the math they describe: the weight of row 0 (d = [0.1, -0.2, 0.3], n = 3)
    d, n = D[0], 3
    expected = {"token": d.exp(), "sequence": d.sum().exp(), "sequence_mean": (d.sum() / n).exp()}
    for level, w in expected.items():
        got = weights.is_weights(level, D, torch.ones_like(D), _statistics())
        torch.testing.assert_close(got[0].expand_as(d), w.expand_as(d))


def test_an_unknown_is_level_is_an_error_not_a_default():
    from nemo_rs_plugin.core.correction import weights

    with pytest.raises(ValueError, match="is_correction_level: got 'geometric'; allowed: 'token', 'sequence'"):
        weights.is_weights("geometric", D, None, _statistics())


def test_a_per_sequence_level_without_statistics_is_an_error():
    from nemo_rs_plugin.core.correction import weights

    with pytest.raises(ValueError, match="'sequence_mean': a per-sequence weight needs the reduced per-sequence"):
        weights.is_weights("sequence_mean", D, None, None)


def _statistics():
    """The reduced per-sequence statistics of ``D`` (3 and 2 valid tokens, all finite)."""
    from nemo_rs_plugin.core.correction import SequenceStatistics

    valid = torch.tensor([3.0, 2.0])
    return SequenceStatistics(d_sum=D.sum(1), valid=valid, token_mask=valid, nonfinite=torch.zeros(2), kept=valid)
