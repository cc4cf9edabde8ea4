"""Property-based tests: random shapes, ragged masks, empty and fully masked samples, and
NaN / +inf / -inf injected into any log-prob input. The loss and gradients stay finite,
nothing non-finite reaches a kept token, and masks agree with the filter bounds."""

import math

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nemo_rs_plugin import CorrectedPGLoss, RSClippedPGLossConfig
from nemo_rs_plugin.core.correction import compute_correction, token_filter_statistic
from nemo_rs_plugin.core.masking import TokenMasks
from nemo_rs_plugin.core.reporting.metrics import GlobalCounts
from tests.support.config_warnings import DRAWN_CONFIG_WARNINGS
from tests.support.logprobs import at_most_zero
from tests.support.naive_reference import with_unique_labels

BAD = [float("nan"), float("inf"), float("-inf")]

# Every test here draws configurations at random, legal settings that do nothing included (an IS
# level with the correction off, rejection_denominator 'kept' with no filter): their ConfigWarnings
# are a side effect, not the subject.
pytestmark = DRAWN_CONFIG_WARNINGS

filters = st.one_of(
    st.builds(
        lambda lo, hi: {"level": "token", "statistic": "ratio", "lower": lo, "upper": hi},
        st.sampled_from([None, 0.2, 0.5]),
        st.sampled_from([1.5, 2.0, 5.0]),
    ),
    st.builds(
        lambda m, hi: {"level": "token", "statistic": m, "upper": hi},
        st.sampled_from(["kl_k2", "kl_k3"]),
        st.sampled_from([0.05, 0.5]),
    ),
    st.builds(
        lambda agg, lo, hi: {"level": "sequence", "statistic": "ratio", "agg": agg, "lower": lo, "upper": hi},
        st.sampled_from(["mean", "sum", "max", "min", "any"]),
        st.sampled_from([0.3, 0.9, None]),
        st.sampled_from([1.1, 3.0, 100.0]),
    ),
    st.builds(
        lambda m, agg, hi: {"level": "sequence", "statistic": m, "agg": agg, "upper": hi},
        st.sampled_from(["kl_k1", "kl_k2", "kl_k3"]),
        st.sampled_from(["mean", "sum", "max"]),
        st.sampled_from([0.01, 0.3, 2.0]),
    ),
)


# Issue 9's options: probability-space statistics, every log-ratio, the advantage condition.
option_filters = st.builds(
    lambda level, metric, log_ratio, negative, hi: {
        "level": level,
        "statistic": metric,
        "upper": hi,
        "log_ratio": log_ratio,
        **({"advantage_sign": "negative"} if negative else {}),
        **({"agg": "mean"} if level == "sequence" else {}),
    },
    st.sampled_from(["token", "sequence"]),
    st.sampled_from(["mult_prob_error", "binary_kl", "total_variation", "kl_k3"]),
    st.sampled_from(["prev-gen", "gen-prev", "curr-gen", "curr-prev"]),
    st.booleans(),
    st.sampled_from([0.01, 0.5, 2.0]),
)


@st.composite
def configs(draw, with_options=False):
    gspo = draw(st.booleans())
    cfg = {
        "sequence_level_importance_ratios": gspo,
        "token_level_loss": False if gspo else draw(st.booleans()),
        "use_importance_sampling_correction": draw(st.booleans()),
        "is_correction_level": draw(st.sampled_from([None, "token", "sequence", "sequence_mean"])),
        "reference_policy_kl_penalty": draw(st.sampled_from([0.0, 0.05])),
        "reference_policy_kl_type": draw(st.sampled_from(["k1", "k2", "k3"])),
        "use_on_policy_kl_approximation": draw(st.booleans()),
        "positive_example_nll_weight": draw(st.sampled_from([0.0, 0.3])),
        "ratio_clip_c": draw(st.sampled_from([None, 3.0])),
        "disable_ppo_ratio": draw(st.booleans()),
        "rejection_sampling": with_unique_labels(
            draw(st.lists(st.one_of(filters, option_filters) if with_options else filters, max_size=3))
        ),
        "rejection_denominator": draw(st.sampled_from(["original", "kept"])),
    }
    if cfg["use_importance_sampling_correction"]:
        t = draw(st.sampled_from([None, "tis", "icepop", "seq-mask-tis"]))
        if t == "seq-mask-tis" and gspo and cfg["is_correction_level"] is None:
            t = "tis"
        if t is not None:
            cfg["truncated_importance_sampling_type"] = t
            cfg["truncated_importance_sampling_ratio"] = 2.0 if t != "seq-mask-tis" else 1.05
            if t != "tis":
                cfg["truncated_importance_sampling_ratio_min"] = 0.5 if t == "icepop" else 0.95
    return cfg


@st.composite
def batches(draw):
    B = draw(st.integers(1, 4))
    T = draw(st.integers(1, 24))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    prev = -torch.rand(B, T, generator=g) * 3
    gen = prev + torch.randn(B, T, generator=g) * draw(st.sampled_from([0.0, 0.05, 0.5, 3.0]))
    curr = prev + torch.randn(B, T, generator=g) * 0.2
    ref = prev + torch.randn(B, T, generator=g) * 0.3
    curr, prev, gen, ref = at_most_zero(curr, prev, gen, ref)  # log-probs <= 0, log-ratios unchanged
    lengths = [draw(st.integers(0, T)) for _ in range(B)]  # 0 = empty sequence
    starts = [draw(st.integers(0, T)) for _ in range(B)]
    token_mask = torch.zeros(B, T, dtype=torch.long)
    for i, (s, n) in enumerate(zip(starts, lengths)):
        token_mask[i, s : s + n] = 1
    sample_mask = torch.tensor([float(draw(st.booleans()) or i == 0) for i in range(B)])
    if draw(st.booleans()) and B > 1:
        sample_mask[:] = 0  # a fully masked microbatch
    tensors = {"curr": curr, "prev": prev, "gen": gen, "ref": ref}
    for _ in range(draw(st.integers(0, 4))):
        name = draw(st.sampled_from(sorted(tensors)))
        i, t = draw(st.integers(0, B - 1)), draw(st.integers(0, T - 1))
        tensors[name][i, t] = draw(st.sampled_from(BAD))
    advantages = torch.randn(B, T, generator=g)
    rewards = torch.randn(B, generator=g)
    return tensors, token_mask, sample_mask, advantages, rewards


def to_nemo_rl(tensors, token_mask, sample_mask, advantages, rewards):
    B = token_mask.shape[0]

    def pad(x):
        return torch.cat([torch.zeros(B, 1, dtype=x.dtype), x], dim=1)

    data = {
        "advantages": pad(advantages),
        "prev_logprobs": pad(tensors["prev"]),
        "generation_logprobs": pad(tensors["gen"]),
        "reference_policy_logprobs": pad(tensors["ref"]),
        "token_mask": pad(token_mask),
        "sample_mask": sample_mask,
        "rewards": rewards,
    }
    valid = token_mask.float() * sample_mask[:, None]
    return data, sample_mask.sum(), valid.sum()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=configs(), batch=batches())
def test_loss_and_gradients_are_finite(cfg, batch):
    tensors, token_mask, sample_mask, advantages, rewards = batch
    data, gvs, gvt = to_nemo_rl(tensors, token_mask, sample_mask, advantages, rewards)
    lp = tensors["curr"].clone().requires_grad_(True)
    loss, metrics = CorrectedPGLoss(cfg)(lp, data, gvs, gvt)
    loss.backward()
    assert torch.isfinite(loss), (cfg, loss)
    assert torch.isfinite(lp.grad).all(), cfg
    valid = token_mask.bool() & (sample_mask[:, None] > 0)
    # No gradient reaches a padded or masked position, nor a token with a non-finite input.
    used = [n for n in tensors if n != "ref" or cfg["reference_policy_kl_penalty"] != 0]
    finite_inputs = torch.stack([torch.isfinite(tensors[n]) for n in used]).all(0)
    assert torch.all(lp.grad[~valid] == 0)
    assert torch.all(lp.grad[~finite_inputs] == 0)
    # Every non-finite input at a valid token is counted under its kind.
    kl_on = cfg["reference_policy_kl_penalty"] != 0
    expected = {
        "nonfinite_curr_logprobs_count": tensors["curr"],
        "nonfinite_log_ratio_count": tensors["prev"] - tensors["gen"],
        "nonfinite_reference_logprobs_count": tensors["ref"] if kl_on else torch.zeros_like(lp),
    }
    for key, x in expected.items():
        assert metrics[key] == (valid & ~torch.isfinite(x)).sum().item(), (key, cfg)
    assert metrics["nonfinite_advantages_count"] == 0
    for key, value in metrics.items():
        if key.endswith(("_min", "_max")):
            assert not math.isnan(value), key
        else:
            assert math.isfinite(value), (key, value, cfg)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=configs(with_options=True), batch=batches())
def test_issue9_options_keep_loss_gradients_and_metrics_finite(cfg, batch):
    if cfg["use_importance_sampling_correction"]:
        cfg["is_batch_normalization"] = "microbatch"
    tensors, token_mask, sample_mask, advantages, rewards = batch
    data, gvs, gvt = to_nemo_rl(tensors, token_mask, sample_mask, advantages, rewards)
    lp = tensors["curr"].clone().requires_grad_(True)
    loss, metrics = CorrectedPGLoss(cfg)(lp, data, gvs, gvt)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(lp.grad).all(), cfg
    valid = token_mask.bool() & (sample_mask[:, None] > 0)
    assert torch.all(lp.grad[~valid] == 0)
    for key, value in metrics.items():
        assert not math.isnan(value), (key, cfg)
        if not key.endswith(("_min", "_max")):
            assert math.isfinite(value), (key, value, cfg)


@settings(max_examples=300, deadline=None)
@given(cfg=configs(), batch=batches())
def test_masks_are_consistent_with_the_bounds(cfg, batch):
    tensors, token_mask, sample_mask, _, _ = batch
    c = RSClippedPGLossConfig.from_any(cfg)
    raw_d = tensors["prev"] - tensors["gen"]
    d_finite = torch.isfinite(raw_d)
    d = torch.where(d_finite, raw_d, torch.zeros_like(raw_d))
    valid = token_mask.float() * sample_mask[:, None]
    masks = TokenMasks.build(token_mask.float(), sample_mask, d_finite.float(), d_finite.float())
    out = compute_correction(c, d, masks, counts=GlobalCounts(tokens=valid.sum(), sequences=sample_mask.sum()))
    keep = out.keep.bool() & (valid > 0)
    assert torch.isfinite(out.is_weight).all()
    assert not torch.any(keep & ~d_finite), "a non-finite log-ratio reached a kept token"
    for f in c.rejection_sampling:
        if f.level != "token":
            continue
        stat = token_filter_statistic(d, f.statistic)
        lo = (
            -math.inf
            if f.lower is None
            else (
                math.log(f.lower)
                if f.statistic == "ratio" and f.lower > 0
                else (-math.inf if f.statistic == "ratio" else f.lower)
            )
        )
        hi = math.inf if f.upper is None else (math.log(f.upper) if f.statistic == "ratio" else f.upper)
        assert torch.all(stat[keep] >= lo) and torch.all(stat[keep] <= hi), f
    if not c.rejection_sampling:
        assert torch.equal(keep, (valid > 0) & d_finite)
