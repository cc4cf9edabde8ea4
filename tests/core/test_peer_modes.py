"""The peers' modes (docs/guide.md#mapping-from-other-frameworks), each as plugin configuration, checked two ways.

1. Hand-computed cases, written from each peer's formula as its released code states it
   (the arithmetic is in the comments).
2. The peers' own functions, run unchanged outside this repository on one seeded ragged batch
   with outliers: ``tests/data/peer_modes.json`` records each mode's peer, version, function
   and call, and its per-token weights, kept mask and denominator. The plugin must give the
   same weights (1e-6), the same kept mask (exactly) and the same denominator.

Modes: VERL ``rollout_is_batch_normalize``; slime ``tis_batch_normalize`` (its ``mis.yaml``
default pipeline); NeMo-RL ``grpo.seq_logprob_error_threshold``; OpenRLHF ``binary_kl`` /
``tv`` gating (token and sequence); TRL ``off_policy_mask_threshold`` and slime
``use_opsm`` (OPSM); AReaL ``kl_k3`` (token, sequence ``max`` and ``mean``).
"""

import json
import math
from pathlib import Path

import pytest
import torch

from nemo_rs_plugin import CorrectedPGLoss, RSClippedPGLossConfig
from nemo_rs_plugin.core.correction import PolicyLogProbs, compute_correction
from nemo_rs_plugin.core.masking import TokenMasks
from nemo_rs_plugin.core.reporting.metrics import GlobalCounts
from nemo_rs_plugin.core.settings.config import ConfigError

RECORDED = json.loads((Path(__file__).resolve().parents[1] / "data" / "peer_modes.json").read_text())
IS_TOKEN = {"use_importance_sampling_correction": True, "is_correction_level": "token"}
e, log = math.exp, math.log
# VERL's recorded plugin configurations keep rejection_denominator 'kept' with no filter (a no-op
# there): their ConfigWarning is right, and a side effect of running the recording as it is.
RECORDED_VERL_KEPT = pytest.mark.filterwarnings(
    r"ignore:loss_fn\.rejection_denominator. got 'kept' with no rejection_sampling filter"
    ":nemo_rs_plugin.core.settings.config.ConfigWarning"
)


def correction(cfg, prev, gen, mask, curr=None, advantages=None):
    """``(effective weight = w * keep * valid, keep * valid, metrics)`` from the pure layer."""
    c = RSClippedPGLossConfig.from_any(cfg)
    prev, gen, mask = (torch.as_tensor(x, dtype=torch.float64) for x in (prev, gen, mask))
    curr = prev.clone() if curr is None else torch.as_tensor(curr, dtype=torch.float64)
    advantages = torch.ones_like(prev) if advantages is None else torch.as_tensor(advantages, dtype=torch.float64)
    d = prev - gen
    finite = torch.isfinite(d).to(d.dtype)
    B = d.shape[0]
    out = compute_correction(
        c,
        d,
        TokenMasks.build(mask, torch.ones(B, dtype=d.dtype), finite, finite),
        counts=GlobalCounts(tokens=mask.sum(), sequences=torch.tensor(float(B))),
        log_probs=PolicyLogProbs(curr=curr, prev=prev, gen=gen),
        advantages=advantages,
    )
    w = out.is_weight.expand_as(d) if c.use_importance_sampling_correction else torch.ones_like(d)
    metrics = out.metrics.finalize()
    return w * out.keep * mask, out.keep * mask, metrics


def effective_coefficients(cfg, prev, gen, curr, advantages, mask, denominator):
    """REINFORCE (``pg_t = -A_t curr_t``) through the whole loss: ``d loss / d curr_t =
    -A_t w_t k_t / N``, so ``-grad * denominator / A`` is ``w * k`` exactly when the loss
    divides by ``denominator``."""
    B, T = mask.shape
    pad = lambda x: torch.cat([torch.zeros(B, 1, dtype=x.dtype), x], 1)  # noqa: E731
    data = {
        "input_ids": torch.zeros(B, T + 1, dtype=torch.long),
        "advantages": pad(advantages),
        "prev_logprobs": pad(prev),
        "generation_logprobs": pad(gen),
        "reference_policy_logprobs": pad(prev),
        "token_mask": pad(mask.long()),
        "sample_mask": torch.ones(B, dtype=torch.float64),
    }
    lp = curr.clone().requires_grad_(True)
    loss_fn = CorrectedPGLoss({**cfg, "disable_ppo_ratio": True, "reference_policy_kl_penalty": 0.0})
    loss, metrics = loss_fn(lp, data, torch.tensor(float(B), dtype=torch.float64), mask.sum())
    loss.backward()
    return -lp.grad * denominator / advantages, metrics


# ============================================================ recorded runs of the peers
@RECORDED_VERL_KEPT
@pytest.mark.parametrize("mode", RECORDED["modes"], ids=[m["name"] for m in RECORDED["modes"]])
def test_reproduces_the_peers_own_function(mode):
    b = RECORDED["batch"]
    prev, gen, curr, adv = (torch.tensor(b[k], dtype=torch.float64) for k in ("prev", "gen", "curr", "advantages"))
    mask = torch.tensor(b["token_mask"], dtype=torch.float64)
    want_w = torch.tensor(mode["weight"], dtype=torch.float64)
    want_keep = torch.tensor(mode["keep"], dtype=torch.float64)
    cfg = mode["plugin_config"]
    where = f"{mode['name']} ({mode['version']}, {mode['function']})"

    weight, keep, _ = correction(cfg, prev, gen, mask, curr, adv)
    torch.testing.assert_close(keep, want_keep, rtol=0, atol=0, msg=lambda m: f"{where} keep: {m}")
    torch.testing.assert_close(weight, want_w, rtol=1e-6, atol=1e-6, msg=lambda m: f"{where} weight: {m}")
    # The same through the loss, whose gradient also carries the denominator.
    coef, _ = effective_coefficients(cfg, prev, gen, curr, adv, mask, mode["denominator"])
    torch.testing.assert_close(
        coef * mask,
        want_w,
        rtol=1e-6,
        atol=1e-6,
        msg=lambda m: f"{where} weight x denominator {mode['denominator']}: {m}",
    )


def test_recorded_modes_cover_every_mode_of_issue_9():
    peers = {m["name"].split("/")[0] for m in RECORDED["modes"]}
    assert peers == {"verl", "slime", "nemo_rl", "openrlhf", "trl", "areal"}
    # The batch is ragged, has an empty row and outliers on both sides.
    mask = torch.tensor(RECORDED["batch"]["token_mask"])
    assert len(set(mask.sum(-1).tolist())) > 4 and 0 in mask.sum(-1).tolist()
    d = torch.tensor(RECORDED["batch"]["prev"]) - torch.tensor(RECORDED["batch"]["gen"])
    assert (d * mask).max() > 2.9 and (d * mask).min() < -9.9


def test_recorded_modes_are_not_trivial():
    # Every filter mode rejects something and keeps something on the batch.
    for m in RECORDED["modes"]:
        kept, valid = sum(map(sum, m["keep"])), sum(map(sum, RECORDED["batch"]["token_mask"]))
        if "batch_normalize" in m["name"]:
            continue
        assert 0 < kept < valid, m["name"]


# ============================================================ batch normalisation
def test_token_batch_normalisation_divides_by_the_masked_batch_mean():
    # VERL rollout_is=token, threshold 2.0, batch_normalize: w = min(r, 2) / mean over valid tokens.
    # Row 0: r = [1.5, 3, 1] -> [1.5, 2, 1]; row 1: r = [0.5, 1] (third position masked).
    # mean = (1.5 + 2 + 1 + 0.5 + 1) / 5 = 1.2.
    d = [[log(1.5), log(3.0), 0.0], [log(0.5), 0.0, 5.0]]
    mask = [[1, 1, 1], [1, 1, 0]]
    gen = [[-1.0] * 3] * 2
    prev = [[g + x for g, x in zip(gr, dr)] for gr, dr in zip(gen, d)]
    cfg = {
        **IS_TOKEN,
        "truncated_importance_sampling_type": "tis",
        "truncated_importance_sampling_ratio": 2.0,
        "is_batch_normalization": "microbatch",
    }
    weight, _, metrics = correction(cfg, prev, gen, mask)
    want = torch.tensor([[1.5, 2.0, 1.0], [0.5, 1.0, 0.0]], dtype=torch.float64) / 1.2
    torch.testing.assert_close(weight, want, rtol=1e-12, atol=1e-12)
    assert metrics["is_batch_norm_factor"] == pytest.approx(1.2, rel=1e-12)


def test_sequence_batch_normalisation_averages_over_sequences_with_a_token():
    # VERL rollout_is=sequence, threshold 2.0: w_i = min(exp(sum d), 2): row 0 exp(log 4.5) -> 2,
    # row 1 exp(log 0.5) = 0.5; the empty row 2 is not a unit. mean = 1.25 -> [1.6, 0.4].
    prev = [[log(1.5) - 1, log(3.0) - 1], [log(0.5) - 1, -1.0], [-1.0, -1.0]]
    gen = [[-1.0, -1.0]] * 3
    mask = [[1, 1], [1, 0], [0, 0]]
    cfg = {
        "use_importance_sampling_correction": True,
        "is_correction_level": "sequence",
        "truncated_importance_sampling_type": "tis",
        "truncated_importance_sampling_ratio": 2.0,
        "is_batch_normalization": "data_parallel",
    }
    weight, _, metrics = correction(cfg, prev, gen, mask)
    torch.testing.assert_close(weight, torch.tensor([[1.6, 1.6], [0.4, 0.0], [0.0, 0.0]], dtype=torch.float64))
    assert metrics["is_batch_norm_factor"] == pytest.approx(1.25)


def test_rejected_units_count_in_the_batch_mean_and_a_zero_mean_leaves_weights():
    # slime mis.yaml: TIS 2.0, token RS [0.5, 2], veto 1e-4, then normalise over the *original*
    # loss mask: r = [1, 4, 0.25] -> TIS [1, 2, 0.25], mean 3.25 / 3; RS rejects tokens 1, 2.
    gen = [[-1.0, -2.0, -1.0]]
    prev = [[-1.0, -2.0 + log(4.0), -1.0 + log(0.25)]]
    cfg = {
        **IS_TOKEN,
        "truncated_importance_sampling_type": "tis",
        "truncated_importance_sampling_ratio": 2.0,
        "is_batch_normalization": "microbatch",
        "rejection_sampling": [
            {"level": "sequence", "agg": "min", "lower": 1e-4},
            {"level": "token", "lower": 0.5, "upper": 2.0},
        ],
    }
    weight, keep, _ = correction(cfg, prev, gen, [[1, 1, 1]])
    assert keep.tolist() == [[1, 0, 0]]
    torch.testing.assert_close(weight, torch.tensor([[3 / 3.25, 0.0, 0.0]], dtype=torch.float64))
    # Every weight zeroed by icepop: the mean is 0 <= 1e-8 and the weights stay as they are.
    icepop = {
        **IS_TOKEN,
        "truncated_importance_sampling_type": "icepop",
        "truncated_importance_sampling_ratio": 1.5,
        "truncated_importance_sampling_ratio_min": 1.2,
        "is_batch_normalization": "microbatch",
    }
    weight, _, metrics = correction(icepop, prev, gen, [[1, 1, 1]])
    assert weight.abs().sum() == 0 and metrics["is_batch_norm_factor"] == 1.0


def test_slime_veto_must_come_before_the_token_filter():
    # A catastrophic token (r = 1e-5) is also outside the token band: listed after the token
    # filter, the veto's min no longer sees it and the sequence survives. slime vetoes first.
    gen = [[-1.0, -1.0]]
    prev = [[-1.0, -1.0 + log(1e-5)]]
    veto = {"level": "sequence", "agg": "min", "lower": 1e-4}
    band = {"level": "token", "lower": 0.5, "upper": 2.0}
    assert correction({"rejection_sampling": [veto, band]}, prev, gen, [[1, 1]])[1].tolist() == [[0, 0]]
    assert correction({"rejection_sampling": [band, veto]}, prev, gen, [[1, 1]])[1].tolist() == [[1, 0]]


def test_batch_normalisation_needs_importance_sampling():
    with pytest.raises(
        ConfigError, match="is_batch_normalization: got 'microbatch' with use_importance_sampling_correction: false"
    ):
        RSClippedPGLossConfig.from_any({"is_batch_normalization": "microbatch"})
    with pytest.raises(ConfigError, match="is_batch_normalization: got 'global'"):
        RSClippedPGLossConfig.from_any({"use_importance_sampling_correction": True, "is_batch_normalization": "global"})


# ============================================================ NeMo-RL seq_logprob_error_threshold
def test_nemo_rl_sequence_logprob_error_filter():
    # mean_t exp(|gen - prev|): row 0 d = [0.1, -0.1] -> e^0.1 = 1.1052 > 1.1, dropped;
    # row 1 d = [0.05, -0.05, 0] -> (2 e^0.05 + 1) / 3 = 1.0342, kept.
    gen = [[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]]
    prev = [[-0.9, -1.1, -1.0], [-0.95, -1.05, -1.0]]
    mask = [[1, 1, 0], [1, 1, 1]]
    cfg = {
        "rejection_sampling": [{"level": "sequence", "statistic": "mult_prob_error", "agg": "mean", "upper": 1.1}],
        "rejection_denominator": "kept",
    }
    _, keep, metrics = correction(cfg, prev, gen, mask)
    assert keep.tolist() == [[0, 0, 0], [1, 1, 1]]
    assert metrics["rs/sequence_mult_prob_error_mean/seq_rejected_frac"] == pytest.approx(0.5)
    # NeMo-RL rewrites sample_mask before the global counts: the loss divides by 3 kept tokens.
    coef, _ = effective_coefficients(
        cfg,
        *(torch.tensor(x, dtype=torch.float64) for x in (prev, gen, prev)),
        torch.ones(2, 3, dtype=torch.float64),
        torch.tensor(mask, dtype=torch.float64),
        denominator=3.0,
    )
    torch.testing.assert_close(coef * torch.tensor(mask), keep)


# ============================================================ OpenRLHF binary_kl / tv
def test_openrlhf_binary_kl_gate_on_the_sampled_token():
    # OpenRLHF's own test case: token 0 is far off (mu = 1/3, pi = 1), token 1 matches (1/2).
    # binary KL(mu || pi) with pi clamped to 1 - 1e-6: 1/3 log((1/3)/(1 - 1e-6)) + 2/3 log((2/3)/1e-6)
    # = 8.57 > 0.05: rejected; token 1: 0, kept with weight r = pi/mu = 1.
    prev, gen = [[0.0, log(0.5)]], [[-log(3.0), log(0.5)]]
    q = 1 - 1e-6
    bkl0 = (1 / 3) * log((1 / 3) / q) + (2 / 3) * log((2 / 3) / (1 - q))
    assert bkl0 > 8
    token = {**IS_TOKEN, "rejection_sampling": [{"level": "token", "statistic": "binary_kl", "upper": 0.05}]}
    weight, keep, _ = correction(token, prev, gen, [[1, 1]])
    assert keep.tolist() == [[0, 1]] and weight.tolist() == [[0.0, 1.0]]
    # FlashREINFORCE: the sequence mean (bkl0 + 0) / 2 > 3e-3 drops the whole sequence.
    seq = {
        **IS_TOKEN,
        "rejection_sampling": [{"level": "sequence", "statistic": "binary_kl", "agg": "mean", "upper": 3e-3}],
    }
    assert correction(seq, prev, gen, [[1, 1]])[1].tolist() == [[0, 0]]
    # Two-sided: the same pair with the roles swapped is dropped as well.
    assert correction(seq, gen, prev, [[1, 1]])[1].tolist() == [[0, 0]]


def test_openrlhf_total_variation_gate():
    # |p_gen - p_prev|: 0.6 vs 0.5 -> 0.1 > 0.05 rejected; 0.52 vs 0.5 -> 0.02 kept, weight 0.52 / 0.5.
    prev, gen = [[log(0.6), log(0.52)]], [[log(0.5), log(0.5)]]
    cfg = {**IS_TOKEN, "rejection_sampling": [{"level": "token", "statistic": "total_variation", "upper": 0.05}]}
    weight, keep, metrics = correction(cfg, prev, gen, [[1, 1]])
    assert keep.tolist() == [[0, 1]]
    assert weight[0, 1].item() == pytest.approx(0.52 / 0.5, rel=1e-12)
    assert metrics["rs/token_total_variation/token_rejected_frac"] == pytest.approx(0.5)


# ============================================================ OPSM (TRL, slime)
def test_opsm_drops_negative_advantage_tokens_of_off_policy_sequences():
    # TRL: drop iff A < 0 and mean_t (gen - curr) > delta = 0.01.
    #   row 0: gen - curr = 0.02 everywhere, A = -1   -> dropped
    #   row 1: the same mismatch, A = +1              -> kept
    #   row 2: gen - curr = 0.005, A = -1             -> kept (below delta)
    #   row 3: gen - curr = 0.02, A = [+1, -1, +1]    -> only the middle token dropped
    curr = [[-1.0] * 3] * 4
    gen = [[-0.98] * 3, [-0.98] * 3, [-0.995] * 3, [-0.98] * 3]
    prev = [[-1.5] * 3] * 4  # prev plays no part with log_ratio curr-gen
    adv = [[-1.0] * 3, [1.0] * 3, [-1.0] * 3, [1.0, -1.0, 1.0]]
    cfg = {
        "rejection_sampling": [
            {
                "level": "sequence",
                "statistic": "kl_k1",
                "agg": "mean",
                "upper": 0.01,
                "log_ratio": "curr-gen",
                "advantage_sign": "negative",
                "name": "opsm",
            }
        ]
    }
    _, keep, metrics = correction(cfg, prev, gen, [[1] * 3] * 4, curr=curr, advantages=adv)
    assert keep.tolist() == [[0, 0, 0], [1, 1, 1], [1, 1, 1], [1, 0, 1]]
    # Rows 0 and 3 lost tokens (4 of 12); row 1 failed the bound but lost nothing.
    assert metrics["rs/opsm/seq_rejected_frac"] == pytest.approx(2 / 4)
    assert metrics["rs/opsm/token_rejected_frac"] == pytest.approx(4 / 12)
    assert metrics["rs_token_rejected_frac"] == pytest.approx(4 / 12)
    assert metrics["rs_seq_rejected_frac"] == pytest.approx(2 / 4)
    # The original denominator (TRL, slime): rejected tokens count as 0, not as nothing.
    coef, _ = effective_coefficients(
        cfg,
        *(torch.tensor(x, dtype=torch.float64) for x in (prev, gen, curr, adv)),
        torch.ones(4, 3, dtype=torch.float64),
        denominator=12.0,
    )
    torch.testing.assert_close(coef, keep)


def test_advantage_condition_on_a_token_filter_and_on_two_sequence_filters():
    # Token filter, ratio band [0.5, 2] on r = [3, 3, 1] with A = [-1, +1, -1]: only token 0
    # (out of band and negative) leaves.
    gen = [[-1.0, -1.0, -1.0]]
    prev = [[-1.0 + log(3.0), -1.0 + log(3.0), -1.0]]
    adv = [[-1.0, 1.0, -1.0]]
    token = {"rejection_sampling": [{"level": "token", "lower": 0.5, "upper": 2.0, "advantage_sign": "negative"}]}
    _, keep, m = correction(token, prev, gen, [[1, 1, 1]], advantages=adv)
    assert keep.tolist() == [[0, 1, 1]]
    assert m["rs/token_ratio_negative_advantages/token_rejected_frac"] == pytest.approx(1 / 3)
    # Two conditional sequence filters rejecting the same row: the second removes nothing new.
    two = {
        "rejection_sampling": [
            {"level": "sequence", "agg": "max", "upper": 2.0, "advantage_sign": "negative", "name": "first"},
            {"level": "sequence", "agg": "sum", "upper": 2.0, "advantage_sign": "negative", "name": "second"},
        ]
    }
    _, keep, m = correction(two, prev, gen, [[1, 1, 1]], advantages=adv)
    assert keep.tolist() == [[0, 1, 0]]
    assert m["rs/first/token_rejected_frac"] == pytest.approx(2 / 3) and m["rs/first/seq_rejected_frac"] == 1.0
    assert m["rs/second/token_rejected_frac"] == 0.0 and m["rs/second/seq_rejected_frac"] == 0.0
    assert m["rs_token_rejected_frac"] == pytest.approx(2 / 3) and m["rs_seq_rejected_frac"] == 1.0


def test_slime_opsm_reads_the_trainer_log_probs():
    # slime: seq_kl = mean_t (old - curr) with old = the trainer's log-probs (prev): 0.02 > 1e-4.
    curr, prev, gen = [[-1.0, -1.0]], [[-0.98, -0.98]], [[-2.0, -2.0]]
    cfg = {
        "rejection_sampling": [
            {
                "level": "sequence",
                "statistic": "kl_k1",
                "agg": "mean",
                "upper": 1e-4,
                "log_ratio": "curr-prev",
                "advantage_sign": "negative",
            }
        ]
    }
    assert correction(cfg, prev, gen, [[1, 1]], curr=curr, advantages=[[-1.0, -1.0]])[1].tolist() == [[0, 0]]
    assert correction(cfg, prev, gen, [[1, 1]], curr=curr, advantages=[[0.0, 0.0]])[1].tolist() == [[1, 1]]


def test_conditional_and_unconditional_rejections_are_counted_once():
    # An OPSM filter then a token filter rejecting the same negative-advantage token: the token
    # filter is not credited with a token OPSM already removed.
    curr = [[-1.0, -1.0, -1.0]]
    gen = [[-0.9, -0.9, -0.9]]  # gen - curr = 0.1 > 0.01
    prev = [[-0.9, -0.9 + log(3.0), -0.9]]  # token 1: r = 3, outside [0.5, 2]
    adv = [[1.0, -1.0, -1.0]]
    cfg = {
        "rejection_sampling": [
            {
                "level": "sequence",
                "statistic": "kl_k1",
                "agg": "mean",
                "upper": 0.01,
                "log_ratio": "curr-gen",
                "advantage_sign": "negative",
                "name": "opsm",
            },
            {"level": "token", "lower": 0.5, "upper": 2.0, "name": "band"},
        ]
    }
    _, keep, m = correction(cfg, prev, gen, [[1, 1, 1]], curr=curr, advantages=adv)
    assert keep.tolist() == [[1, 0, 0]]
    assert m["rs/opsm/token_rejected_frac"] == pytest.approx(2 / 3)
    assert m["rs/band/token_rejected_frac"] == 0.0
    assert m["rs_token_rejected_frac"] == pytest.approx(2 / 3)


# ============================================================ AReaL's k3 direction
def test_areal_k3_differs_from_verl_k3_token_by_token():
    # AReaL: k3 = exp(-d) - 1 + d (its 1/r); VERL and the default: exp(d) - 1 - d.
    #   d = -0.3: AReaL e^0.3 - 1.3 = 0.0499, VERL e^-0.3 - 0.7 = 0.0408
    #   d = +0.3: AReaL e^-0.3 - 0.7 = 0.0408, VERL e^0.3 - 1.3 = 0.0499
    # With upper 0.045 each rejects the token the other keeps, not only under `max`.
    gen = [[-1.0, -1.0]]
    prev = [[-1.3, -0.7]]
    verl = {"rejection_sampling": [{"level": "token", "statistic": "kl_k3", "upper": 0.045}]}
    areal = {"rejection_sampling": [{"level": "token", "statistic": "kl_k3", "upper": 0.045, "log_ratio": "gen-prev"}]}
    assert correction(verl, prev, gen, [[1, 1]])[1].tolist() == [[1, 0]]
    assert correction(areal, prev, gen, [[1, 1]])[1].tolist() == [[0, 1]]
    # AReaL's kl_k1 is log r: the default's kl_k1 (-d) read on gen - prev.
    k1 = {
        "rejection_sampling": [
            {
                "level": "sequence",
                "statistic": "kl_k1",
                "agg": "mean",
                "lower": -0.01,
                "upper": 0.01,
                "log_ratio": "gen-prev",
            }
        ]
    }
    assert correction(k1, [[-1.0, -1.02]], [[-1.0, -1.0]], [[1, 1]])[1].tolist() == [[1, 1]]  # mean log r = -0.01


# ============================================================ labels
def test_duplicate_labels_are_refused_naming_the_filters():
    geo = {"level": "sequence", "agg": "mean", "lower": 0.99, "upper": 1.01}
    with pytest.raises(ConfigError) as err:
        RSClippedPGLossConfig.from_any(
            {"rejection_sampling": [geo, {"level": "token", "upper": 2.0}, {**geo, "lower": 0.9, "upper": 1.1}]}
        )
    assert "filters 0, 2 share the label 'sequence_ratio_mean'" in str(err.value)
    assert "give each a distinct `name`" in str(err.value)
    with pytest.raises(ConfigError, match="share the label 'geo'"):
        RSClippedPGLossConfig.from_any(
            {"rejection_sampling": [{**geo, "name": "geo"}, {"level": "token", "upper": 2.0, "name": "geo"}]}
        )
    ok = RSClippedPGLossConfig.from_any({"rejection_sampling": [geo, {**geo, "name": "geo_wide"}]})
    assert [f.label for f in ok.rejection_sampling] == ["sequence_ratio_mean", "geo_wide"]


def test_default_labels_name_a_non_default_log_ratio_and_the_advantage_condition():
    cfg = RSClippedPGLossConfig.from_any(
        {
            "rejection_sampling": [
                {"level": "sequence", "statistic": "kl_k1", "agg": "mean", "upper": 0.01},
                {
                    "level": "sequence",
                    "statistic": "kl_k1",
                    "agg": "mean",
                    "upper": 0.01,
                    "log_ratio": "curr-gen",
                    "advantage_sign": "negative",
                },
                {"level": "token", "statistic": "kl_k3", "upper": 0.4, "log_ratio": "gen-prev"},
            ]
        }
    )
    assert [f.label for f in cfg.rejection_sampling] == [
        "sequence_kl_k1_mean",
        "sequence_kl_k1_mean_curr-gen_negative_advantages",
        "token_kl_k3_gen-prev",
    ]


def test_new_metrics_and_log_ratios_are_validated():
    with pytest.raises(ConfigError, match="agg: got 'min' with statistic 'binary_kl'; allowed: mean, sum, max"):
        RSClippedPGLossConfig.from_any(
            {"rejection_sampling": [{"level": "sequence", "statistic": "binary_kl", "agg": "min", "upper": 0.1}]}
        )
    with pytest.raises(ConfigError, match="log_ratio: got 'gen-curr'"):
        RSClippedPGLossConfig.from_any(
            {"rejection_sampling": [{"level": "token", "statistic": "kl_k1", "upper": 0.1, "log_ratio": "gen-curr"}]}
        )


@RECORDED_VERL_KEPT
def test_every_metric_key_is_declared():
    from nemo_rs_plugin.core.loss import metric_normalizations

    b = RECORDED["batch"]
    prev, gen, curr, adv = (torch.tensor(b[k], dtype=torch.float64) for k in ("prev", "gen", "curr", "advantages"))
    mask = torch.tensor(b["token_mask"], dtype=torch.float64)
    for mode in RECORDED["modes"]:
        _, metrics = effective_coefficients(mode["plugin_config"], prev, gen, curr, adv, mask, 1.0)
        cfg = RSClippedPGLossConfig.from_any(
            {**mode["plugin_config"], "disable_ppo_ratio": True, "reference_policy_kl_penalty": 0.0}
        )
        assert set(metrics) == set(metric_normalizations(cfg)), mode["name"]


# ============================================================ batch mean over DP x CP ranks
@RECORDED_VERL_KEPT
@pytest.mark.parametrize("name", ["verl/token_tis_2_batch_normalize", "verl/sequence_tis_2_batch_normalize"])
def test_data_parallel_batch_mean_on_emulated_dp2_cp2_ranks(name, monkeypatch):
    """VERL's mean over the whole batch, with the batch split over two data-parallel ranks
    (rows) and each row's tokens over two CP ranks: every rank reproduces VERL's weights on
    its part, and the totals cost one SUM over CP (token weights only) and one over DP."""
    from nemo_rs_plugin.core.distributed import SequenceGroups
    from nemo_rs_plugin.parallel.layout import cp_shard
    from tests.support.threaded_world import ThreadGroup, run_ranks

    mode = next(m for m in RECORDED["modes"] if m["name"] == name)
    b = RECORDED["batch"]
    prev, gen, curr, adv = (torch.tensor(b[k], dtype=torch.float64) for k in ("prev", "gen", "curr", "advantages"))
    mask = torch.tensor(b["token_mask"], dtype=torch.float64)
    want = torch.tensor(mode["weight"], dtype=torch.float64)
    cfg = RSClippedPGLossConfig.from_any(mode["plugin_config"])
    cp_groups = [ThreadGroup([0, 1]), ThreadGroup([2, 3])]  # rank = 2 * dp_rank + cp_rank
    dp_groups = [ThreadGroup([0, 2]), ThreadGroup([1, 3])]

    def rank_fn(rank):
        dp_rank, cp_rank = divmod(rank, 2)
        rows = slice(4 * dp_rank, 4 * dp_rank + 4)
        part = lambda x: cp_shard(x[rows], 2, cp_rank)  # noqa: E731
        p, g, m = part(prev), part(gen), part(mask)
        d = p - g
        ones = torch.ones_like(d)
        groups = SequenceGroups((cp_groups[dp_rank],), data_parallel=dp_groups[cp_rank])
        out = compute_correction(
            cfg,
            d,
            TokenMasks.build(m, torch.ones(4, dtype=d.dtype), ones, ones),
            groups,
            counts=GlobalCounts(tokens=mask.sum(), sequences=torch.tensor(8.0)),
            log_probs=PolicyLogProbs(curr=part(curr), prev=p, gen=g),
            advantages=part(adv),
        )
        factor = out.metrics.finalize()["is_batch_norm_factor"]  # replicated: no reduction needed
        return out.is_weight.expand_as(d) * out.keep * m, part(want), factor

    results = run_ranks(4, rank_fn, cp_groups + dp_groups, monkeypatch)
    factors = {float(r[0][2]) for r in results}
    assert len(factors) == 1  # one mean on every rank
    token_level = cfg.effective_is_level == "token"
    for rank, ((got, expected, _), log) in enumerate(results):
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6, msg=lambda m: f"rank {rank}: {m}")
        dp_rank, cp_rank = divmod(rank, 2)
        # The one statistics reduction over CP, then the batch totals.
        totals = [grp for _, grp in log[-2:]] if token_level else [grp for _, grp in log[-1:]]
        assert totals == ([cp_groups[dp_rank]] if token_level else []) + [dp_groups[cp_rank]], log
