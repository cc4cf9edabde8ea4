"""Rejection sampling (docs/guide.md#rejection-sampling): stage order, denominators, and every peer mode.

Most tests call the pure correction function and compare the effective per-token weight
(IS weight x rejection mask) with values computed by hand from the formula.
"""

import math

import pytest
import torch

from nemo_rs_plugin import CorrectedPGLoss, RSClippedPGLossConfig
from nemo_rs_plugin.core.correction import compute_correction
from nemo_rs_plugin.core.masking import TokenMasks
from nemo_rs_plugin.core.reporting.metrics import GlobalCounts
from tests.conftest import make_batch

e = math.exp

# d = prev - gen, three sequences of four tokens (row 2 has one masked position).
#   row 0: near on-policy        d = [ 0.01, -0.01, 0.02,  0.00]   mean 0.005, sum 0.02
#   row 1: one outlier token     d = [ 0.00,  0.01, 1.20, -0.01]   mean 0.30,  sum 1.20
#   row 2: steady drift          d = [-0.30, -0.30, -0.30,  ---]   mean -0.30, sum -0.90
D = torch.tensor(
    [
        [0.01, -0.01, 0.02, 0.00],
        [0.00, 0.01, 1.20, -0.01],
        [-0.30, -0.30, -0.30, 0.0],
    ]
)
MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.float32)
R = D.exp()


def correction(cfg: dict, d=D, mask=MASK, metrics=None):
    c = RSClippedPGLossConfig.from_any(cfg)
    B = d.shape[0]
    out = compute_correction(
        c,
        d,
        TokenMasks.build(mask, torch.ones(B, dtype=d.dtype), torch.isfinite(d).to(d.dtype), torch.ones_like(d)),
        counts=GlobalCounts(tokens=mask.sum(), sequences=torch.tensor(float(B))),
    )
    if metrics is not None:
        metrics.update(out.metrics.finalize())
    w = out.is_weight.expand_as(d) if c.use_importance_sampling_correction else torch.ones_like(d)
    return (w * out.keep * mask), out.keep * mask


def rows(*keep_rows):
    """Mask with whole rows kept (1) or rejected (0)."""
    return MASK * torch.tensor(keep_rows, dtype=torch.float32)[:, None]


def token_w(r_fn):
    return torch.tensor([[r_fn(float(v)) for v in row] for row in R]) * MASK


def seq_w(values):
    return MASK * torch.tensor(values)[:, None]


GEO = [e(0.005), e(0.30), e(-0.30)]
PROD = [e(0.02), e(1.20), e(-0.90)]
IS = {"use_importance_sampling_correction": True}
TOKEN_IS = {**IS, "is_correction_level": "token"}


def k3(d):  # VERL's k3 of KL(gen || prev) per token
    return math.expm1(d) - d


PEER_MODES = {
    # ---- NeMo-RL ----
    "nemo_rl/tis": (
        {**IS, "truncated_importance_sampling_type": "tis", "truncated_importance_sampling_ratio": 2.0},
        token_w(lambda r: min(r, 2.0)),
        MASK,
    ),
    "nemo_rl/icepop": (
        {
            **IS,
            "truncated_importance_sampling_type": "icepop",
            "truncated_importance_sampling_ratio": 2.0,
            "truncated_importance_sampling_ratio_min": 0.5,
        },
        token_w(lambda r: r if 0.5 <= r <= 2.0 else 0.0),
        MASK,
    ),
    # seq-mask-tis [0.99, 1.01]: only row 0 (geo 1.005) survives, with raw token weights.
    "nemo_rl/seq-mask-tis": (
        {
            **IS,
            "truncated_importance_sampling_type": "seq-mask-tis",
            "truncated_importance_sampling_ratio": 1.01,
            "truncated_importance_sampling_ratio_min": 0.99,
        },
        token_w(lambda r: r) * rows(1, 0, 0),
        MASK,
    ),
    "nemo_rl/gspo-sequence-weight": (
        {**IS, "sequence_level_importance_ratios": True, "token_level_loss": False},
        seq_w(PROD),
        MASK,
    ),
    # ---- NeMo-RL PR #2269 ----
    "nemo_rl_2269/sequence_mean": ({**IS, "is_correction_level": "sequence_mean"}, seq_w(GEO), MASK),
    "nemo_rl_2269/sequence": ({**IS, "is_correction_level": "sequence"}, seq_w(PROD), MASK),
    # ---- AReaL #1088: level x action x metric x agg ----
    "areal/token-mask-ratio-upper5": (
        {**TOKEN_IS, "rejection_sampling": [{"level": "token", "upper": 5.0}]},
        token_w(lambda r: r),
        MASK,
    ),
    "areal/token-clamp-ratio": (
        {**TOKEN_IS, "truncated_importance_sampling_type": "tis", "truncated_importance_sampling_ratio": 1.1},
        token_w(lambda r: min(r, 1.1)),
        MASK,
    ),
    "areal/seq-mask-ratio-mean": (
        {
            **IS,
            "is_correction_level": "sequence_mean",
            "rejection_sampling": [{"level": "sequence", "agg": "mean", "lower": 0.9, "upper": 1.1}],
        },
        seq_w(GEO) * rows(1, 0, 0),
        rows(1, 0, 0),
    ),
    # AReaL #1088 sequence agg=sum decides on the product, weights survivors by the geo-mean.
    "areal/seq-mask-ratio-sum": (
        {
            **IS,
            "is_correction_level": "sequence_mean",
            "rejection_sampling": [{"level": "sequence", "agg": "sum", "lower": 0.4, "upper": 2.0}],
        },
        seq_w(GEO) * rows(1, 0, 1),
        rows(1, 0, 1),
    ),
    "areal/seq-mask-ratio-max": (
        {**TOKEN_IS, "rejection_sampling": [{"level": "sequence", "agg": "max", "upper": 2.0}]},
        token_w(lambda r: r) * rows(1, 0, 1),
        rows(1, 0, 1),
    ),
    # kl_k1 mean in [-0.01, 0.01] == Geo-RS band [e^-0.01, e^0.01] on gen/prev: row 0 (mean k1 -0.005).
    "areal/seq-mask-kl_k1-mean": (
        {
            **TOKEN_IS,
            "rejection_sampling": [
                {"level": "sequence", "statistic": "kl_k1", "agg": "mean", "lower": -0.01, "upper": 0.01}
            ],
        },
        token_w(lambda r: r) * rows(1, 0, 0),
        rows(1, 0, 0),
    ),
    # mean k2: row0 ~5e-5, row1 0.18, row2 0.045 -> upper 0.05 keeps rows 0 and 2.
    "areal/seq-mask-kl_k2-mean": (
        {"rejection_sampling": [{"level": "sequence", "statistic": "kl_k2", "agg": "mean", "upper": 0.05}]},
        rows(1, 0, 1),
        rows(1, 0, 1),
    ),
    # sum k3: row0 ~2e-4, row1 k3(1.2)=1.12, row2 3*k3(-0.3)=0.12 -> upper 0.5 keeps rows 0 and 2.
    "areal/seq-mask-kl_k3-sum": (
        {"rejection_sampling": [{"level": "sequence", "statistic": "kl_k3", "agg": "sum", "upper": 0.5}]},
        rows(1, 0, 1),
        rows(1, 0, 1),
    ),
    # max k3: row1 1.12 > 1.0 rejected; row2 0.0408 kept.
    "areal/seq-mask-kl_k3-max": (
        {"rejection_sampling": [{"level": "sequence", "statistic": "kl_k3", "agg": "max", "upper": 1.0}]},
        rows(1, 0, 1),
        rows(1, 0, 1),
    ),
    # ---- AReaL #1218: two-stage ----
    "areal_1218/geo-rs+token-mis": (
        {
            **TOKEN_IS,
            "rejection_sampling": [
                {"level": "sequence", "agg": "mean", "lower": 0.7, "upper": 1.1},  # rejects row 1 (geo 1.35)
                {"level": "token", "lower": 0.5, "upper": 2.0},
            ],
        },
        token_w(lambda r: r) * rows(1, 0, 1),
        rows(1, 0, 1),
    ),
    "areal_1218/geo-rs+token-tis": (
        {
            **TOKEN_IS,
            "truncated_importance_sampling_type": "tis",
            "truncated_importance_sampling_ratio": 1.005,
            "rejection_sampling": [{"level": "sequence", "agg": "mean", "lower": 0.7, "upper": 1.1}],
        },
        token_w(lambda r: min(r, 1.005)) * rows(1, 0, 1),
        rows(1, 0, 1),
    ),
    # ---- SkyRL #849 ----
    "skyrl/tis-token": (
        {**TOKEN_IS, "truncated_importance_sampling_type": "tis", "truncated_importance_sampling_ratio": 2.0},
        token_w(lambda r: min(r, 2.0)),
        MASK,
    ),
    "skyrl/tis-sequence-cap5": (
        {
            **IS,
            "is_correction_level": "sequence",
            "truncated_importance_sampling_type": "tis",
            "truncated_importance_sampling_ratio": 2.0,
        },
        seq_w([min(p, 2.0) for p in PROD]),
        MASK,
    ),
    "skyrl/geometric-mask": (
        {"rejection_sampling": [{"level": "sequence", "agg": "mean", "lower": 0.99, "upper": 1.01}]},
        rows(1, 0, 0),
        rows(1, 0, 0),
    ),
    # product: row 1 e^1.2 = 3.32 > 2 and row 2 e^-0.9 = 0.41 < 0.5 are both rejected.
    "skyrl/product-mask": (
        {"rejection_sampling": [{"level": "sequence", "agg": "sum", "lower": 0.5, "upper": 2.0}]},
        rows(1, 0, 0),
        rows(1, 0, 0),
    ),
    "skyrl/outlier-veto": (
        {"rejection_sampling": [{"level": "sequence", "agg": "any", "lower": 0.5, "upper": 3.0}]},
        rows(1, 0, 1),
        rows(1, 0, 1),
    ),
    # SkyRL order: token mask first, then the geo-mean over the *remaining* tokens -> row 1
    # (outlier masked, remaining mean 0.0) survives the [0.99, 1.01] geo mask.
    "skyrl/token-mask-then-geo": (
        {
            "rejection_sampling": [
                {"level": "token", "lower": 0.5, "upper": 2.0},
                {"level": "sequence", "agg": "mean", "lower": 0.99, "upper": 1.01},
            ]
        },
        torch.tensor([[1, 1, 1, 1], [1, 1, 0, 1], [0, 0, 0, 0]], dtype=torch.float32),
        torch.tensor([[1, 1, 1, 1], [1, 1, 0, 1], [0, 0, 0, 0]], dtype=torch.float32),
    ),
    # ---- VERL rollout correction ----
    "verl/token-is": (
        {**TOKEN_IS, "truncated_importance_sampling_type": "tis", "truncated_importance_sampling_ratio": 2.0},
        token_w(lambda r: min(r, 2.0)),
        MASK,
    ),
    "verl/seq-is": (
        {
            **IS,
            "is_correction_level": "sequence",
            "truncated_importance_sampling_type": "tis",
            "truncated_importance_sampling_ratio": 2.0,
        },
        seq_w([min(p, 2.0) for p in PROD]),
        MASK,
    ),
    # VERL geo_rs with the stage order of the list: geo-mean over all tokens -> row 1 rejected.
    "verl/geo-rs-then-token-k1": (
        {
            "rejection_sampling": [
                {"level": "sequence", "agg": "mean", "lower": 0.99, "upper": 1.01},
                {"level": "token", "statistic": "kl_k1", "lower": math.log(0.5), "upper": math.log(2.0)},
            ]
        },
        rows(1, 0, 0),
        rows(1, 0, 0),
    ),
    "verl/seq_mean_k3": (
        {"rejection_sampling": [{"level": "sequence", "statistic": "kl_k3", "agg": "mean", "upper": 0.01}]},
        rows(1, 0, 0),
        rows(1, 0, 0),
    ),
    "verl/token_k2": (
        {"rejection_sampling": [{"level": "token", "statistic": "kl_k2", "upper": 0.1}]},
        token_w(lambda r: 1.0 if math.log(r) ** 2 / 2 <= 0.1 else 0.0),
        token_w(lambda r: 1.0 if math.log(r) ** 2 / 2 <= 0.1 else 0.0),
    ),
    "verl/catastrophic-veto": ({"rejection_sampling": [{"level": "sequence", "agg": "min", "lower": 0.5}]}, MASK, MASK),
    # min token ratios: row 0 e^-0.01, row 1 e^-0.01, row 2 e^-0.3 = 0.74 < 0.8 -> row 2 rejected.
    "verl/catastrophic-veto-rejects": (
        {"rejection_sampling": [{"level": "sequence", "agg": "min", "lower": 0.8}]},
        rows(1, 1, 0),
        rows(1, 1, 0),
    ),
    # A low-side-only outlier: row 2's tokens (0.74) are all below 0.8, none above 100.
    "skyrl/outlier-veto-low-side": (
        {"rejection_sampling": [{"level": "sequence", "agg": "any", "lower": 0.8, "upper": 100.0}]},
        rows(1, 1, 0),
        rows(1, 1, 0),
    ),
}


@pytest.mark.parametrize("mode", sorted(PEER_MODES))
def test_peer_mode(mode):
    cfg, want_weight, want_keep = PEER_MODES[mode]
    weight, keep = correction(cfg)
    torch.testing.assert_close(keep, want_keep, rtol=0, atol=0, msg=lambda m: f"{mode} keep: {m}")
    torch.testing.assert_close(weight, want_weight, rtol=1e-5, atol=1e-6, msg=lambda m: f"{mode} weight: {m}")


def test_verl_k1_band_maps_to_the_inverted_ratio_band():
    # VERL's k1 = log(gen/prev): a band [L, U] on gen/prev keeps 1/U <= r <= 1/L.
    L, U = 0.8, 3.0
    via_k1 = correction(
        {"rejection_sampling": [{"level": "token", "statistic": "kl_k1", "lower": math.log(L), "upper": math.log(U)}]}
    )[1]
    via_ratio = correction({"rejection_sampling": [{"level": "token", "lower": 1 / U, "upper": 1 / L}]})[1]
    torch.testing.assert_close(via_k1, via_ratio)
    assert via_k1[1, 2] == 0 and via_k1[2, 0] == 1  # r = e^1.2 > 1.25 rejected, r = e^-0.3 > 1/3 kept


def test_k3_direction_is_kl_gen_prev():
    # Row 2 has r = e^-0.3: VERL's k3 = r - 1 - log r = 0.0408; AReaL's (1/r) gives 0.0499.
    keep = correction({"rejection_sampling": [{"level": "token", "statistic": "kl_k3", "upper": 0.045}]})[1]
    assert keep[2, 0] == 1
    assert k3(-0.3) < 0.045 < e(0.3) - 1 - 0.3


# -------------------------------------------------------------------------- loss level
def reinforce_grad(cfg, d=D, mask=MASK):
    """REINFORCE makes pg_t = -A curr_t, so d loss / d curr_t = -(w_t k_t) / N: the weights."""
    prev = torch.full_like(d, -1.0)
    lp, data, gvs, gvt = make_batch(prev, prev, prev - d, token_mask=mask)
    full = {"disable_ppo_ratio": True, "reference_policy_kl_penalty": 0.0, **cfg}
    loss, metrics = CorrectedPGLoss(full)(lp, data, gvs, gvt)
    loss.backward()
    return lp.grad, gvt, loss, metrics


def test_two_stage_geo_rs_token_mis_gives_per_token_weights_on_survivors():
    cfg, want, _ = PEER_MODES["areal_1218/geo-rs+token-mis"]
    grad, gvt, _, _ = reinforce_grad(cfg)
    torch.testing.assert_close(-grad * gvt, want, rtol=1e-5, atol=1e-6)
    # Not the sequence weight broadcast: row 0's token weights differ from each other.
    assert len({round(float(v), 6) for v in -grad[0] * gvt}) == 4


def test_two_stage_geo_rs_token_tis_gives_per_token_weights_on_survivors():
    cfg, want, _ = PEER_MODES["areal_1218/geo-rs+token-tis"]
    grad, gvt, _, _ = reinforce_grad(cfg)
    torch.testing.assert_close(-grad * gvt, want, rtol=1e-5, atol=1e-6)


def test_rejection_changes_no_denominator_and_rejected_units_get_zero_gradient():
    cfg = {
        "rejection_sampling": [
            {"level": "sequence", "agg": "mean", "lower": 0.7, "upper": 1.1},
            {"level": "token", "lower": 0.5, "upper": 1.015},
        ]
    }
    grad, gvt, loss, metrics = reinforce_grad(cfg)
    keep = correction(cfg)[1]
    # Row 1 rejected whole; row 0 token 2 (r = e^0.02 > 1.015) rejected.
    assert keep.tolist() == [[1, 1, 0, 1], [0, 0, 0, 0], [1, 1, 1, 0]]
    assert gvt.item() == 11  # the original count
    assert torch.equal(grad[keep == 0], torch.zeros(int((keep == 0).sum())))
    torch.testing.assert_close(-grad * gvt, keep)
    # pg_t = -A * curr_t = 1 on every kept token: the loss is (kept tokens) / (all 11).
    assert loss.item() == pytest.approx(6 / 11, rel=1e-6)
    assert metrics["rs/sequence_ratio_mean/seq_rejected_frac"] == pytest.approx(1 / 3)
    assert metrics["rs/sequence_ratio_mean/token_rejected_frac"] == pytest.approx(4 / 11)
    assert metrics["rs/token_ratio/token_rejected_frac"] == pytest.approx(1 / 11)
    assert metrics["rs/token_ratio/seq_touched_frac"] == pytest.approx(1 / 3)
    assert metrics["rs_token_rejected_frac"] == pytest.approx(5 / 11)
    assert metrics["rs_seq_rejected_frac"] == pytest.approx(1 / 3)


def test_rejection_also_zeroes_kl_and_nll_terms():
    prev = torch.full_like(D, -1.0)
    ref = prev - 0.5
    cfg = {
        "rejection_sampling": [{"level": "sequence", "agg": "max", "upper": 2.0}],
        "positive_example_nll_weight": 0.5,
        "reference_policy_kl_penalty": 0.1,
    }
    lp, data, gvs, gvt = make_batch(prev, prev, prev - D, token_mask=MASK, ref=ref, rewards=[1.0, 1.0, 1.0])
    loss, _ = CorrectedPGLoss(cfg)(lp, data, gvs, gvt)
    loss.backward()
    assert torch.all(lp.grad[1] == 0)  # row 1 (outlier token) rejected everywhere
    assert torch.all(lp.grad[0] != 0)


# A statistic exactly on a bound, for every filter kind: (level, metric, agg, row d, bound).
# Each value is exact in float64 (sums of log 2 / 0.25 / 0.5 and zeros, no rounding), and
# the mean is taken where it is 0, so NeMo-RL's "/ (n + 1e-8)" cannot move it.
L2, LH = math.log(2.0), math.log(0.5)
ON_THE_BOUND = [
    ("token", "ratio", None, [L2, 0.0, 0.0], 2.0),
    ("token", "kl_k1", None, [-0.25, 0.0, 0.0], 0.25),
    ("token", "kl_k2", None, [0.5, 0.0, 0.0], 0.125),
    ("token", "kl_k3", None, [0.0, 0.0, 0.0], 0.0),
    ("sequence", "ratio", "mean", [0.0, 0.0, 0.0], 1.0),
    ("sequence", "ratio", "sum", [L2, 0.0, 0.0], 2.0),
    ("sequence", "ratio", "max", [L2, -0.5, 0.0], 2.0),
    ("sequence", "ratio", "min", [LH, 0.5, 0.0], 0.5),
    ("sequence", "ratio", "any", [L2, L2, L2], 2.0),
    ("sequence", "kl_k1", "mean", [0.0, 0.0, 0.0], 0.0),
    ("sequence", "kl_k1", "sum", [-0.25, 0.0, 0.0], 0.25),
    ("sequence", "kl_k1", "max", [-0.25, 0.5, 0.0], 0.25),
    ("sequence", "kl_k2", "mean", [0.0, 0.0, 0.0], 0.0),
    ("sequence", "kl_k2", "sum", [0.5, 0.0, 0.0], 0.125),
    ("sequence", "kl_k2", "max", [0.5, -0.25, 0.0], 0.125),
    ("sequence", "kl_k3", "mean", [0.0, 0.0, 0.0], 0.0),
    ("sequence", "kl_k3", "sum", [0.0, 0.0, 0.0], 0.0),
    ("sequence", "kl_k3", "max", [0.0, 0.0, 0.0], 0.0),
]


# A lower bound of 0 on kl_k2 / kl_k3 sits at the statistic's lowest value: the ConfigWarning that it
# never rejects is right, and a side effect here (the subject is that the bound keeps the unit on it).
@pytest.mark.filterwarnings(
    r"ignore:loss_fn\.rejection_sampling\.0\.lower. got 0\.0 with statistic 'kl_k[23]', which is never below 0"
    ":nemo_rs_plugin.core.settings.config.ConfigWarning"
)
@pytest.mark.parametrize("side", ["lower", "upper", "both"])
@pytest.mark.parametrize(
    "level, metric, agg, row, bound", ON_THE_BOUND, ids=["-".join(str(x) for x in c[:3] if x) for c in ON_THE_BOUND]
)
def test_bounds_are_inclusive(level, metric, agg, row, bound, side):
    # docs/guide.md: a filter keeps a unit iff lower <= statistic <= upper.
    f = {"level": level, "statistic": metric, **({"agg": agg} if agg else {})}
    if side in ("lower", "both"):
        f["lower"] = bound
    if side in ("upper", "both"):
        f["upper"] = bound
    d = torch.tensor([row], dtype=torch.float64)
    mask = torch.ones_like(d)
    _, keep = correction({"rejection_sampling": [f]}, d=d, mask=mask)
    assert keep[0, 0] == 1, f"statistic on the {side} bound rejected: {f}"


def test_truncation_bounds_are_inclusive():
    # d = 0: token weight, sequence weight and geometric mean are exactly 1, on the max bound.
    d, mask = torch.zeros(1, 3, dtype=torch.float64), torch.ones(1, 3, dtype=torch.float64)
    for t, level in (("icepop", "token"), ("icepop", "sequence_mean"), ("seq-mask-tis", "sequence_mean")):
        cfg = {
            **IS,
            "is_correction_level": level,
            "truncated_importance_sampling_type": t,
            "truncated_importance_sampling_ratio": 1.0,
            "truncated_importance_sampling_ratio_min": 0.5,
        }
        weight, _ = correction(cfg, d=d, mask=mask)
        assert weight.tolist() == [[1.0, 1.0, 1.0]], (t, level)


def seq_level_loss(cfg, mask, sample_mask):
    """REINFORCE with curr = -1, A = 1: every token's pg is 1; sequence-level loss."""
    d = torch.zeros_like(mask)
    d[: D.shape[0]] = D
    prev = torch.full_like(d, -1.0)
    lp, data, gvs, gvt = make_batch(prev, prev, prev - d, token_mask=mask, sample_mask=sample_mask)
    full = {"disable_ppo_ratio": True, "reference_policy_kl_penalty": 0.0, "token_level_loss": False, **cfg}
    loss, _ = CorrectedPGLoss(full)(lp, data, gvs, gvt)
    return loss.item()


def test_kept_denominator_of_a_sequence_level_loss_counts_kept_sequences():
    # Row 1 (outlier token) is rejected; rows 0 and 2 have per-row means 4/4 and 3/3.
    cfg = {"rejection_sampling": [{"level": "sequence", "agg": "max", "upper": 2.0}]}
    # original: (1 + 0 + 1) / 3 sequences
    assert seq_level_loss(cfg, MASK, [1.0, 1.0, 1.0]) == pytest.approx(2 / 3, rel=1e-6)
    # kept: 3 sequences x 2/3 kept = 2 -> 2 / 2 (not 3 x 7/11 kept tokens -> 22/21)
    kept = {**cfg, "rejection_denominator": "kept"}
    assert seq_level_loss(kept, MASK, [1.0, 1.0, 1.0]) == pytest.approx(1.0, rel=1e-6)
    # A fourth, empty sequence counts in global_valid_seqs (4) but is neither kept nor
    # rejected: 4 x 2/3 -> 2 / (8/3) = 0.75 (counting it as kept would give 4 x 3/3 -> 0.5).
    mask4 = torch.cat([MASK, torch.zeros(1, 4)])
    got = seq_level_loss(kept, mask4, [1.0, 1.0, 1.0, 1.0])
    assert got == pytest.approx(0.75, rel=1e-6)


def test_kept_denominator_divides_by_the_kept_count():
    cfg = {"rejection_sampling": [{"level": "sequence", "agg": "max", "upper": 2.0}]}
    g_orig, gvt, _, _ = reinforce_grad(cfg)
    g_kept, _, _, _ = reinforce_grad({**cfg, "rejection_denominator": "kept"})
    # 11 valid tokens, 7 kept (rows 0 and 2): gradients grow by 11/7.
    torch.testing.assert_close(g_kept, g_orig * 11 / 7)


def test_empty_sequence_is_never_rejected_and_never_nan():
    mask = MASK.clone()
    mask[1] = 0
    m = {}
    _, keep = correction(
        {"rejection_sampling": [{"level": "sequence", "agg": "mean", "lower": 0.99, "upper": 1.01}]},
        mask=mask,
        metrics=m,
    )
    weight, _ = correction({**IS, "is_correction_level": "sequence_mean"}, mask=mask)
    assert torch.isfinite(weight).all()
    assert keep[0].sum() == 4
    # Only row 2 (geo-mean e^-0.3) is rejected; the empty row 1 is not (it would read 2/3).
    assert m["rs_seq_rejected_frac"] == pytest.approx(1 / 3)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_log_ratio_rejects_its_sequence_or_token(bad):
    d = D.clone()
    d[0, 1] = bad
    seq_keep = correction(
        {"rejection_sampling": [{"level": "sequence", "agg": "mean", "lower": 0.5, "upper": 2.0}]}, d=d
    )[1]
    assert seq_keep[0].sum() == 0 and seq_keep[2].sum() == 3
    tok_keep = correction({"rejection_sampling": [{"level": "token", "lower": 0.1, "upper": 10.0}]}, d=d)[1]
    assert tok_keep[0].tolist() == [1, 0, 1, 1]
    seq_w_, _ = correction({**IS, "is_correction_level": "sequence_mean"}, d=d)
    assert seq_w_[0].sum() == 0 and torch.isfinite(seq_w_).all()


def test_the_one_bound_check_is_inclusive_and_puts_nan_outside():
    """masking.out_of_bounds decides every filter, truncation and sequence decision."""
    from nemo_rs_plugin.core.masking import out_of_bounds

    x = torch.tensor([math.nan, -math.inf, 0.5, 1.0, 2.0, 2.5, math.inf])
    assert out_of_bounds(x, 1.0, 2.0).tolist() == [True, True, True, False, False, True, True]
    assert out_of_bounds(x, None, 2.0).tolist() == [True, False, False, False, False, True, True]
    assert out_of_bounds(x, 1.0, None).tolist() == [True, True, True, False, False, False, False]
    assert out_of_bounds(x, None, None).tolist() == [True, False, False, False, False, False, False]


def test_positive_advantage_filter_leaves_zero_advantage_tokens_and_counts_only_positive_ones():
    """``advantage_sign: positive``: a token with A = 0 outside the band is kept (it keeps its KL
    gradient), and the rejected fraction counts only the A > 0 tokens outside the band."""
    from tests.conftest import make_batch

    prev = torch.full((1, 6), -1.0)
    d = torch.tensor([[0.0, 1.0, 1.0, 1.0, 0.0, -1.0]])  # ratio e^d: tokens 1, 2, 3 and 5 outside [0.9, 1.1]
    advantages = torch.tensor([[1.0, 1.0, 0.0, -1.0, 0.0, 0.0]])
    lp, data, gvs, gvt = make_batch(prev.clone(), prev, prev - d, advantages=advantages, ref=prev - 0.3)
    band = {"level": "token", "statistic": "ratio", "lower": 0.9, "upper": 1.1, "advantage_sign": "positive"}
    lp = lp.detach().requires_grad_(True)
    loss, metrics = CorrectedPGLoss({"reference_policy_kl_penalty": 0.1, "rejection_sampling": [band]})(
        lp, data, gvs, gvt
    )
    loss.backward()
    assert metrics["rs/token_ratio_positive_advantages/token_rejected_frac"] == pytest.approx(1 / 6)
    assert metrics["rs_token_rejected_frac"] == pytest.approx(1 / 6)
    grad = lp.grad[0]
    assert grad[1] == 0  # A > 0 outside the band: rejected, KL term included
    assert (grad[[2, 3, 5]] != 0).all()  # A = 0 and A < 0 outside the band: kept


@pytest.mark.parametrize(
    "agg, bounds, reject",
    [
        # per-rank extremes in log space: rank 0 -0.4 / +0.4, rank 1 -0.5 / +0.5; their sums (-0.9,
        # +0.9) are outside the bounds, the true extremes (-0.5, +0.5) inside
        ("min", {"lower": 0.5}, False),
        ("max", {"upper": 2.0}, False),
        ("any", {"lower": 0.5, "upper": 2.0}, False),
        # the true extreme outside: rank 1's token at -0.8 (ratio 0.45) rejects the sequence
        ("min", {"lower": 0.5, "_rank1_low": -0.8}, True),
        ("any", {"lower": 0.5, "upper": 2.0, "_rank1_low": -0.8}, True),
    ],
)
def test_sequence_extremes_under_cp_come_from_the_cross_rank_extreme_not_a_sum(agg, bounds, reject, monkeypatch):
    """A sequence split over two (emulated) CP ranks is decided on MIN / MAX of the ranks' row
    extremes; summing them, as the sums of the other statistics are, would put it on the other side."""
    from nemo_rs_plugin.core.batch.inputs import LossInputs
    from nemo_rs_plugin.core.distributed import SequenceGroups
    from tests.support.threaded_world import ThreadGroup, run_ranks

    bounds = dict(bounds)
    rank1_low = bounds.pop("_rank1_low", -0.5)
    d = torch.tensor([[-0.4, 0.4, rank1_low, 0.5]], dtype=torch.float64)  # prev - gen, tokens 0-1 on rank 0
    prev = torch.full((1, 4), -1.0, dtype=torch.float64)
    band = {"level": "sequence", "statistic": "ratio", "agg": agg, **bounds}
    loss_fn = CorrectedPGLoss({"rejection_sampling": [band], "reference_policy_kl_penalty": 0.0})
    group = ThreadGroup([0, 1])
    count = torch.tensor(4.0, dtype=torch.float64)

    def rank_fn(rank):
        cols = slice(2 * rank, 2 * rank + 2)
        inputs = LossInputs(
            curr=prev[:, cols].clone(),
            prev=prev[:, cols],
            generation=(prev - d)[:, cols],
            reference=None,
            advantages=torch.ones(1, 2, dtype=torch.float64),
            token_mask=torch.ones(1, 2, dtype=torch.float64),
            sample_mask=torch.ones(1, dtype=torch.float64),
        )
        return loss_fn.compute(inputs, torch.tensor(1.0, dtype=torch.float64), count, SequenceGroups((group,)))[1]

    results = run_ranks(2, rank_fn, [group], monkeypatch)
    for metrics, _ in results:
        assert metrics["rs_seq_rejected_frac"] == pytest.approx(1.0 if reject else 0.0), metrics
    unsharded = loss_fn(*make_batch(prev, prev, prev - d, advantages=torch.ones(1, 4)))[1]
    assert unsharded["rs_seq_rejected_frac"] == pytest.approx(1.0 if reject else 0.0)
