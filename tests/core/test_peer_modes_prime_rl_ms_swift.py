"""prime-rl's DPPO and IPO losses and ms-swift's rollout importance sampling, against their own code.

prime-rl (trust region in probability space + penalty toward the sampler), checked two ways:

1. prime-rl's own ``compute_loss`` with ``default_loss_fn`` (DPPO + KL) and ``ipo_loss_fn``
   (IPO + KL), run unchanged outside this repository by ``tests/data/record_peer_modes_prime_rl_ms_swift.py``
   on the shared peer batch (row 6 empty, row 0 a masked sample, outliers):
   ``tests/data/peer_modes_prime_rl_ms_swift.json`` holds per mode the loss, its gradient, the
   policy-gradient mask (read back from the gradient) and prime-rl's per-row metrics. The
   plugin's configuration of each mode must give the same loss and gradient (float64: 1e-9, the
   loss's ``N + 1e-8`` denominator; float32: its rounding), the same mask, and the token-weighted means of prime-rl's
   ``is_masked*`` metrics as its ``rs/<filter>/token_rejected_frac``.
2. Hand-computed cases written from prime-rl's formula:
   ``loss_t = -keep_t * A_t * exp(curr_t - gen_t) + kl_tau * (curr_t - gen_t)^2``, summed over the
   loss tokens and divided by their count.

ms-swift's ``rollout_importance_sampling_mode`` (``token_truncate``, ``token_mask``,
``sequence_truncate``, ``sequence_mask``) at its default threshold 2.0 and at 1.05: its
``GRPOTrainer`` methods, compiled unchanged from the 4.6.0 wheel by the same script, give the
per-token weights (recorded under ``weight_modes``) that the plugin's NeMo-RL truncation
(``tis``, ``icepop``, ``tis`` at ``sequence_mean``, ``seq-mask-tis``, each with lower bound 0)
must give (1e-6), through the correction layer and through the loss's gradient; and the
metrics that have a counterpart: ``clipped_frac`` (``is_oob_ratio``), ``is_weight_mean``,
``k3_kl`` and ``kl`` (``gen_kl_error`` with k3 / k1; ms-swift clamps each token's k3 at 10)
and ``chi2_token`` (``is_weight_sq_mean - 1`` without truncation).
"""

import json
import math
from pathlib import Path

import pytest
import torch
import yaml

from nemo_rs_plugin import CorrectedPGLoss
from nemo_rs_plugin.core.settings import presets
from nemo_rs_plugin.core.settings.config import ConfigError, ConfigWarning, RSClippedPGLossConfig
from tests.core.test_peer_modes import correction, effective_coefficients

RECORDED = json.loads((Path(__file__).resolve().parents[1] / "data" / "peer_modes_prime_rl_ms_swift.json").read_text())
BATCH = RECORDED["batch"]
MODES = {m["name"]: m for m in RECORDED["modes"]}


def run_plugin(cfg, curr, gen, advantages, token_mask, sample_mask, dtype=torch.float64):
    """``(loss, d loss / d curr, metrics)`` of ``CorrectedPGLoss`` on response-position tensors ``[B, T]``."""
    B, T = token_mask.shape
    pad = lambda x: torch.cat([torch.zeros(B, 1, dtype=x.dtype), x], 1)  # noqa: E731
    data = {
        "input_ids": torch.zeros(B, T + 1, dtype=torch.long),
        "advantages": pad(advantages.to(dtype)),
        # prev is whatever the trainer had: force_on_policy_ratio replaces it by curr.
        "prev_logprobs": pad((curr - 0.3).to(dtype)),
        "generation_logprobs": pad(gen.to(dtype)),
        "reference_policy_logprobs": pad((gen - 0.1).to(dtype)),  # read only with a reference KL
        "token_mask": pad(token_mask.long()),
        "sample_mask": sample_mask.to(dtype),
    }
    lp = curr.to(dtype).clone().requires_grad_(True)
    tokens = (token_mask * sample_mask[:, None]).sum().to(dtype)
    loss, metrics = CorrectedPGLoss(cfg)(lp, data, sample_mask.sum().to(dtype), tokens)
    loss.backward()
    return loss.detach(), lp.grad, metrics


def recorded_batch():
    curr, gen, adv, mask = (
        torch.tensor(BATCH[k], dtype=torch.float64) for k in ("curr", "gen", "advantages", "token_mask")
    )
    return curr, gen, adv, mask, torch.tensor(BATCH["sample_mask"], dtype=torch.float64)


def token_weighted(per_row, tokens_per_row):
    """A global token mean from prime-rl's per-row means (each over that row's loss tokens)."""
    total = sum(tokens_per_row)
    return sum(v * n for v, n in zip(per_row, tokens_per_row)) / total


# ============================================================ prime-rl's own functions
@pytest.mark.parametrize("name", sorted(MODES))
def test_reproduces_prime_rl_loss_and_gradient(name):
    mode = MODES[name]
    where = f"{name} ({mode['version']}, {mode['function']}, {mode['call']})"
    curr, gen, adv, mask, sample_mask = recorded_batch()
    loss, grad, metrics = run_plugin(mode["plugin_config"], curr, gen, adv, mask, sample_mask)
    want_grad = torch.tensor(mode["grad"], dtype=torch.float64)
    # rtol 1e-9: the loss divides by N + 1e-8 (NeMo-RL's guard), prime-rl by N.
    torch.testing.assert_close(loss, torch.tensor(mode["loss"], dtype=torch.float64), rtol=1e-9, atol=0, msg=where)
    torch.testing.assert_close(grad, want_grad, rtol=1e-9, atol=1e-15, msg=lambda m: f"{where} grad: {m}")

    # The policy-gradient mask: the plugin's, read off its own gradient without the penalty.
    no_penalty = {**mode["plugin_config"], "sampler_kl_penalty": 0.0}
    _, pg_grad, _ = run_plugin(no_penalty, curr, gen, adv, mask, sample_mask)
    n = float((mask * sample_mask[:, None]).sum())
    keep = -pg_grad * (n + 1e-8) / (adv * torch.exp(curr - gen))
    torch.testing.assert_close(
        keep, torch.tensor(mode["policy_gradient_keep"], dtype=torch.float64), rtol=0, atol=1e-12, msg=where
    )

    # prime-rl's masking metrics, as token means over the loss tokens.
    rows, tokens = mode["per_row_metrics"], mode["loss_tokens_per_row"]
    filters = RSClippedPGLossConfig.from_any(mode["plugin_config"]).rejection_sampling
    labels = {f.advantage_sign: f"rs/{f.label}/token_rejected_frac" for f in filters}
    if "is_masked_high" in rows:  # DPPO: one filter per advantage sign
        assert math.isclose(metrics[labels["positive"]], token_weighted(rows["is_masked_high"], tokens), abs_tol=1e-12)
        assert math.isclose(metrics[labels["negative"]], token_weighted(rows["is_masked_low"], tokens), abs_tol=1e-12)
        # No loss token of this batch has A = 0 (where prime-rl's is_masked also counts the low side).
        assert all(a != 0 for row, m in zip(adv.tolist(), mask.tolist()) for a, mm in zip(row, m) if mm)
    masked_total = sum(metrics[label] for label in labels.values())
    assert math.isclose(masked_total, token_weighted(rows["is_masked"], tokens), abs_tol=1e-12)
    # A policy-gradient-only filter removes no token from the loss.
    assert metrics["rs_token_rejected_frac"] == 0.0


@pytest.mark.parametrize("name", sorted(MODES))
def test_reproduces_prime_rl_in_float32(name):
    mode = MODES[name]
    curr, gen, adv, mask, sample_mask = recorded_batch()
    loss, grad, _ = run_plugin(mode["plugin_config"], curr, gen, adv, mask, sample_mask, dtype=torch.float32)
    want_grad = torch.tensor(mode["grad"], dtype=torch.float32)
    torch.testing.assert_close(loss, torch.tensor(mode["loss"], dtype=torch.float32), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, want_grad, rtol=1e-5, atol=1e-6 * want_grad.abs().max().item())


def test_the_recorded_batch_exercises_every_case():
    curr, gen, adv, mask, sample_mask = recorded_batch()
    loss_mask = mask * sample_mask[:, None]
    assert 0 in mask.sum(-1).tolist()  # an empty response
    assert (mask.sum(-1) * (1 - sample_mask)).max() > 0  # a masked sample with tokens
    assert ((curr - gen) * loss_mask).abs().max() > 2.9  # an outlier token
    assert (adv * loss_mask).max() > 0 > (adv * loss_mask).min()
    for name in ("prime_rl/dppo_tight", "prime_rl/ipo_default", "prime_rl/ipo_tight"):
        kept = torch.tensor(MODES[name]["policy_gradient_keep"])
        assert 0 < kept.sum() < loss_mask.sum(), name
    high = MODES["prime_rl/dppo_tight"]["per_row_metrics"]["is_masked_high"]
    low = MODES["prime_rl/dppo_tight"]["per_row_metrics"]["is_masked_low"]
    assert max(high) > 0 and max(low) > 0


# ============================================================ ms-swift's own functions
SWIFT = {m["name"]: m for m in RECORDED["weight_modes"]}


def swift_batch():
    prev, gen, curr, adv, mask = (
        torch.tensor(BATCH[k], dtype=torch.float64) for k in ("prev", "gen", "curr", "advantages", "token_mask")
    )
    return prev, gen, curr, adv, mask


@pytest.mark.parametrize("name", sorted(SWIFT))
def test_reproduces_ms_swift_weights_and_metrics(name):
    mode = SWIFT[name]
    where = f"{name} ({mode['version']}, {mode['function']}, {mode['call']})"
    prev, gen, curr, adv, mask = swift_batch()
    want = torch.tensor(mode["weight"], dtype=torch.float64)
    weight, _, _ = correction(mode["plugin_config"], prev, gen, mask, curr, adv)
    torch.testing.assert_close(weight, want, rtol=1e-6, atol=1e-6, msg=lambda m: f"{where} weight: {m}")
    coef, metrics = effective_coefficients(mode["plugin_config"], prev, gen, curr, adv, mask, mask.sum())
    torch.testing.assert_close(coef * mask, want, rtol=1e-6, atol=1e-6, msg=lambda m: f"{where} through the loss: {m}")

    theirs = mode["metrics"]
    if "sequence_truncate" not in name:  # there ms-swift counts sequences, the plugin tokens
        assert math.isclose(metrics["is_oob_ratio"], theirs["clipped_frac"], abs_tol=1e-9), where
        assert math.isclose(metrics["is_weight_mean"], theirs["is_weight_mean"], rel_tol=1e-6), where
    # ms-swift clamps each token's k3 at 10 (the plugin's metric, NeMo-RL's, does not): on this
    # batch only the r = e^3 outlier exceeds it (k3 = e^3 - 4 = 16.09).
    k3 = torch.expm1(prev - gen) - (prev - gen)
    excess = ((k3 - k3.clamp(max=10.0)) * mask).sum().item() / mask.sum().item()
    assert excess > 0.05
    assert math.isclose(metrics["gen_kl_error"] - excess, theirs["k3_kl"], rel_tol=1e-6), where
    k1 = {**mode["plugin_config"], "reference_policy_kl_type": "k1"}
    _, k1_metrics = effective_coefficients(k1, prev, gen, curr, adv, mask, 1.0)
    assert math.isclose(k1_metrics["gen_kl_error"], theirs["kl"], rel_tol=1e-6), where
    untruncated = {"use_importance_sampling_correction": True, "is_correction_level": "token"}
    _, plain = effective_coefficients(untruncated, prev, gen, curr, adv, mask, 1.0)
    assert math.isclose(plain["is_weight_sq_mean"] - 1.0, theirs["chi2_token"], rel_tol=1e-6), where


def test_ms_swift_modes_are_not_trivial():
    for name in ("ms_swift/token_mask_1.05", "ms_swift/sequence_mask_1.05", "ms_swift/sequence_truncate_1.05"):
        assert 0 < SWIFT[name]["metrics"]["clipped_frac"] < 1, name


# ============================================================ hand-computed cases
DPPO = presets.dppo(kl_tau=0.1)


def test_the_guides_dppo_block_is_the_preset():
    """docs/guide.md#prime-rl-dppo shows prime-rl's defaults; the preset is what the tests run."""
    guide = (Path(__file__).resolve().parents[2] / "docs" / "guide.md").read_text()
    section = guide[guide.index('<a id="prime-rl-dppo"></a>') :]
    block = yaml.safe_load(section[section.index("```yaml") + 7 : section.index("```", section.index("```yaml") + 7)])
    assert block["loss_fn"] == {"name": "rs_clipped_pg", **presets.dppo()}


def test_dppo_by_hand():
    # One row, three tokens: p_curr = (0.9, 0.3, 0.5), p_gen = (0.6, 0.6, 0.45), A = (+1, -1, -1).
    # p_curr - p_gen = (0.3, -0.3, 0.05): token 0 rises too far for A > 0 (masked), token 1 falls
    # too far for A < 0 (masked), token 2 stays. Policy term: only token 2:
    #   -A r = 1 * 0.5/0.45; penalty 0.1 * sum_t log(p_curr/p_gen)^2; both / 3 tokens.
    pc, pg = torch.tensor([[0.9, 0.3, 0.5]], dtype=torch.float64), torch.tensor([[0.6, 0.6, 0.45]], dtype=torch.float64)
    curr, gen = pc.log().double(), pg.log().double()
    adv = torch.tensor([[1.0, -1.0, -1.0]], dtype=torch.float64)
    loss, grad, metrics = run_plugin(DPPO, curr, gen, adv, torch.ones(1, 3), torch.ones(1))
    d = [math.log(0.9 / 0.6), math.log(0.3 / 0.6), math.log(0.5 / 0.45)]
    want = (0.5 / 0.45 + 0.1 * sum(x * x for x in d)) / 3
    assert math.isclose(loss.item(), want, rel_tol=1e-8)
    # d/dcurr: -keep A r + 2 tau d, over 3.
    want_grad = [(2 * 0.1 * d[0]) / 3, (2 * 0.1 * d[1]) / 3, (0.5 / 0.45 + 2 * 0.1 * d[2]) / 3]
    torch.testing.assert_close(grad, torch.tensor([want_grad], dtype=torch.float64), rtol=1e-8, atol=1e-15)
    assert math.isclose(metrics["sampler_kl_penalty"], sum(x * x for x in d) / 3, rel_tol=1e-8)
    labels = [f"rs/{f.label}/token_rejected_frac" for f in RSClippedPGLossConfig.from_any(DPPO).rejection_sampling]
    assert [metrics[k] for k in labels] == [pytest.approx(1 / 3), pytest.approx(1 / 3)]


def test_ipo_by_hand_masks_both_signs_and_the_penalty_stays():
    # IPO, threshold 0.1: |p_curr - p_gen| = (0.3, 0.3, 0.05) -> tokens 0 and 1 lose the policy term
    # whatever the sign of A; the penalty keeps all three.
    ipo = presets.ipo(threshold=0.1, kl_tau=0.1)
    pc, pg = torch.tensor([[0.9, 0.3, 0.5]], dtype=torch.float64), torch.tensor([[0.6, 0.6, 0.45]], dtype=torch.float64)
    adv = torch.tensor([[-1.0, 1.0, 2.0]], dtype=torch.float64)
    loss, grad, _ = run_plugin(ipo, pc.log().double(), pg.log().double(), adv, torch.ones(1, 3), torch.ones(1))
    d = [math.log(0.9 / 0.6), math.log(0.3 / 0.6), math.log(0.5 / 0.45)]
    want = (-2.0 * 0.5 / 0.45 + 0.1 * sum(x * x for x in d)) / 3
    assert math.isclose(loss.item(), want, rel_tol=1e-8)
    assert grad[0, 0].item() == pytest.approx(2 * 0.1 * d[0] / 3, rel=1e-8)


def test_a_loss_filter_removes_the_penalty_a_policy_gradient_filter_does_not():
    # Same statistic, same bounds: with applies_to: loss the rejected token loses its penalty too.
    pc, pg = torch.tensor([[0.9, 0.5]], dtype=torch.float64), torch.tensor([[0.6, 0.45]], dtype=torch.float64)
    adv = torch.tensor([[1.0, 1.0]], dtype=torch.float64)
    f = {"level": "token", "statistic": "prob_diff", "log_ratio": "curr-gen", "upper": 0.2}
    base = {**DPPO, "rejection_sampling": [f]}
    d0 = math.log(0.9 / 0.6)
    _, g_loss, m_loss = run_plugin(base, pc.log().double(), pg.log().double(), adv, torch.ones(1, 2), torch.ones(1))
    scoped = {**DPPO, "rejection_sampling": [{**f, "applies_to": "policy_gradient"}]}
    _, g_pg, m_pg = run_plugin(scoped, pc.log().double(), pg.log().double(), adv, torch.ones(1, 2), torch.ones(1))
    assert g_loss[0, 0].item() == 0.0
    assert g_pg[0, 0].item() == pytest.approx(2 * 0.1 * d0 / 2, rel=1e-8)
    assert m_loss["rs_token_rejected_frac"] == pytest.approx(0.5) and m_pg["rs_token_rejected_frac"] == 0.0


def test_negative_advantages_only_is_a_deprecated_spelling_of_advantage_sign_negative():
    curr, gen, adv, mask, sample_mask = recorded_batch()
    f = {"level": "token", "statistic": "prob_diff", "log_ratio": "curr-gen", "lower": -0.02}
    one = {**DPPO, "rejection_sampling": [{**f, "advantage_sign": "negative"}]}
    other = {**DPPO, "rejection_sampling": [{**f, "negative_advantages_only": True}]}
    a = run_plugin(one, curr, gen, adv, mask, sample_mask)
    with pytest.warns(ConfigWarning) as said:
        b = run_plugin(other, curr, gen, adv, mask, sample_mask)
    deprecations = [str(w.message) for w in said if "deprecated" in str(w.message)]
    assert deprecations == [
        "loss_fn.rejection_sampling.0.negative_advantages_only: deprecated; write advantage_sign: negative "
        "instead (the same filter, the same metric names)"
    ]
    with pytest.warns(ConfigWarning, match="deprecated"):
        assert RSClippedPGLossConfig.from_any(other).rejection_sampling[0].advantage_sign == "negative"
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and a[2] == b[2]
    # Against the batch itself: the rejected share is the valid tokens with a negative advantage
    # whose probability fell by more than 0.02 (the positive-advantage ones stay).
    valid = (mask * sample_mask[:, None]) > 0
    drop = (curr.exp() - gen.exp() < -0.02) & valid
    assert int((drop & (adv < 0)).sum()) > 0 and int((drop & (adv > 0)).sum()) > 0  # both sides present
    want = float((drop & (adv < 0)).sum() / valid.sum())
    assert a[2]["rs_token_rejected_frac"] == pytest.approx(want, rel=1e-7)  # the count divides by N + 1e-8


def test_the_sampler_penalty_is_not_is_weighted_and_has_its_gradient():
    # No filter, no policy term (A = 0): the loss is tau * mean (curr - gen)^2 whatever the IS weight
    # (1e-8: the loss divides by N + 1e-8).
    curr = torch.tensor([[-0.2, -1.5]], dtype=torch.float64)
    gen = torch.tensor([[-0.9, -0.4]], dtype=torch.float64)
    cfg = {**DPPO, "rejection_sampling": [], "sampler_kl_penalty": 0.5}
    loss, grad, _ = run_plugin(cfg, curr, gen, torch.zeros(1, 2, dtype=torch.float64), torch.ones(1, 2), torch.ones(1))
    d = curr - gen
    assert loss.item() == pytest.approx(0.5 * (d**2).mean().item(), rel=1e-8)
    torch.testing.assert_close(grad, 0.5 * 2 * d / 2, rtol=1e-8, atol=0)


@pytest.mark.parametrize("level", ["token", "sequence"], ids=["token-mean", "sequence-mean"])
def test_the_sampler_penalty_ignores_huge_values_at_masked_positions(level):
    """A masked position may hold any finite log-prob: squared it would be inf, masked NaN."""
    curr = torch.tensor([[-0.2, -1.5, torch.finfo(torch.float32).min]])
    gen = torch.tensor([[-0.9, -0.4, torch.finfo(torch.float32).max]])
    token_mask = torch.tensor([[1.0, 1.0, 0.0]])
    cfg = {**DPPO, "rejection_sampling": [], "sampler_kl_penalty": 0.5, "token_level_loss": level == "token"}
    loss, grad, _ = run_plugin(cfg, curr, gen, torch.zeros(1, 3), token_mask, torch.ones(1), dtype=torch.float32)
    d = (curr - gen)[:, :2]
    assert loss.item() == pytest.approx(0.5 * (d**2).mean().item(), rel=1e-6)
    assert torch.isfinite(grad).all() and grad[0, 2] == 0


# ============================================================ validation
@pytest.mark.parametrize(
    ("cfg", "fragment"),
    [
        ({"sampler_kl_penalty": -0.1}, "sampler_kl_penalty: got -0.1; allowed: a finite number >= 0"),
        ({"sampler_kl_penalty": float("inf")}, "sampler_kl_penalty: got inf; allowed: a finite number >= 0"),
        (
            {"rejection_sampling": [{"level": "token", "upper": 2.0, "advantage_sign": "up"}]},
            "advantage_sign: got 'up'; Input should be 'positive' or 'negative'",
        ),
        (
            {"rejection_sampling": [{"level": "sequence", "upper": 2.0, "advantage_sign": "positive"}]},
            "advantage_sign: got 'positive' on a sequence filter; allowed there: negative or null",
        ),
        (
            {
                "rejection_sampling": [
                    {"level": "token", "upper": 2.0, "advantage_sign": "positive", "negative_advantages_only": True}
                ]
            },
            "advantage_sign: got 'positive' with negative_advantages_only: true",
        ),
        (
            {"rejection_sampling": [{"level": "sequence", "upper": 2.0, "applies_to": "policy_gradient"}]},
            "applies_to: got 'policy_gradient' on a sequence filter; allowed there: loss",
        ),
        (
            {"rejection_sampling": [{"level": "token", "upper": 2.0, "applies_to": "pg"}]},
            "applies_to: got 'pg'; Input should be 'loss' or 'policy_gradient'",
        ),
        (
            {"rejection_sampling": [{"level": "sequence", "statistic": "prob_diff", "agg": "min", "upper": 0.1}]},
            "agg: got 'min' with statistic 'prob_diff'; allowed: mean, sum, max",
        ),
    ],
)
def test_new_fields_are_validated_in_one_line(cfg, fragment):
    with pytest.raises(ConfigError) as err:
        RSClippedPGLossConfig.from_any(cfg)
    assert any(fragment in p for p in err.value.problems), err.value.problems
    assert all("\n" not in p for p in err.value.problems)


def test_every_problem_at_once():
    cfg = {
        "sampler_kl_penalty": -1.0,
        "rejection_sampling": [{"level": "sequence", "upper": 2.0, "applies_to": "policy_gradient"}],
    }
    with pytest.raises(ConfigError) as err:
        RSClippedPGLossConfig.from_any(cfg)
    problems = err.value.problems
    assert len(problems) == 2, problems
    assert "sampler_kl_penalty: got -1.0; allowed: a finite number >= 0" in problems[1]
    assert "applies_to: got 'policy_gradient' on a sequence filter; allowed there: loss" in problems[0]


def test_labels_name_the_sign_and_the_scope():
    cfg = RSClippedPGLossConfig.from_any(DPPO)
    assert [f.label for f in cfg.rejection_sampling] == [
        "token_prob_diff_curr-gen_positive_advantages_policy_gradient",
        "token_prob_diff_curr-gen_negative_advantages_policy_gradient",
    ]
    with pytest.warns(ConfigWarning, match="negative_advantages_only: deprecated"):
        old = RSClippedPGLossConfig.from_any(
            {"rejection_sampling": [{"level": "sequence", "upper": 2.0, "negative_advantages_only": True}]}
        )
    assert old.rejection_sampling[0].label == "sequence_ratio_mean_negative_advantages"


def test_check_describes_the_dppo_mode_in_words():
    from nemo_rs_plugin.tools.describe import describe_pipeline

    lines = "\n".join(describe_pipeline(RSClippedPGLossConfig.from_any(DPPO)))
    assert "probability difference p_curr - p_gen" in lines
    assert "only its tokens with a positive advantage" in lines
    assert "only its tokens with a negative advantage" in lines
    assert "loses only its policy-gradient term" in lines
    assert "penalty toward the sampler: 0.1 x (curr - gen)^2" in lines
    assert "d = curr - gen (prev is curr: force_on_policy_ratio)" in lines


def test_calibration_leaves_the_tokens_of_a_policy_gradient_filter_to_the_later_stages():
    from nemo_rs_plugin.core.correction.calibration import rejected_fractions
    from nemo_rs_plugin.core.settings.rejection_filter import RejectionFilter

    # d = prev - gen = (1, 0, 0, 0): the first filter rejects token 0 (1 of 4 tokens); the second,
    # the same bounds, sees token 0 again when the first removes only its policy-gradient term.
    prev = torch.tensor([[-0.1, -1.0, -1.0, -1.0]], dtype=torch.float64)
    gen = torch.tensor([[-1.1, -1.0, -1.0, -1.0]], dtype=torch.float64)
    band = {"level": "token", "statistic": "ratio", "upper": 2.0}
    second = RejectionFilter(**band, name="second")
    loss_first = [RejectionFilter(**band), second]
    pg_first = [RejectionFilter(**band, applies_to="policy_gradient"), second]
    assert rejected_fractions(loss_first, prev, gen, torch.ones(1, 4)) == [0.25, 0.0]
    assert rejected_fractions(pg_first, prev, gen, torch.ones(1, 4)) == [0.25, 0.25]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["prime_rl/dppo_tight", "prime_rl/ipo_tight", "ms_swift/sequence_mask_1.05"])
def test_single_host_sync_on_cuda(name):
    """The new options keep the loss's one host transfer (the metrics), as tests/core/test_cuda_sync.py checks."""
    from tests.core.test_cuda_sync import cuda_batch, syncs_of_one_call

    cfg = (MODES.get(name) or SWIFT[name])["plugin_config"]
    syncs, _ = syncs_of_one_call(CorrectedPGLoss(cfg), *cuda_batch(torch.float32))
    assert len(syncs) == 1, syncs


# ============================================================ what a policy-gradient-only filter leaves alone
def _random_batch(seed=0, B=4, T=12):
    g = torch.Generator().manual_seed(seed)
    gen = -torch.rand(B, T, generator=g, dtype=torch.float64) * 2 - 0.05
    curr = (gen + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(max=0)
    adv = torch.randn(B, 1, generator=g, dtype=torch.float64).expand(B, T).contiguous()
    mask = torch.ones(B, T, dtype=torch.float64)
    mask[1, 8:] = 0
    return curr, gen, adv, mask, torch.ones(B, dtype=torch.float64)


REJECT_ALL_PG = {"level": "token", "statistic": "prob_diff", "log_ratio": "curr-gen", "lower": 2.0,
                 "applies_to": "policy_gradient"}  # fmt: skip


@pytest.mark.filterwarnings(
    "ignore::nemo_rs_plugin.core.settings.config.ConfigWarning"
)  # rejects every token on purpose
def test_a_policy_gradient_only_filter_leaves_the_kl_nll_and_denominators():
    """Rejecting every token's policy-gradient term leaves exactly the loss with A = 0: the
    reference KL, the NLL and the sampler penalty over the same tokens and denominators."""
    curr, gen, adv, mask, sm = _random_batch()
    base = {"use_importance_sampling_correction": True, "reference_policy_kl_penalty": 0.05,
            "sampler_kl_penalty": 0.1, "rejection_denominator": "kept"}  # fmt: skip
    with_filter = {**base, "rejection_sampling": [REJECT_ALL_PG]}
    loss, grad, metrics = run_plugin(with_filter, curr, gen, adv, mask, sm)
    loss0, grad0, metrics0 = run_plugin(base, curr, gen, torch.zeros_like(adv), mask, sm)
    torch.testing.assert_close(loss, loss0, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(grad, grad0, rtol=1e-12, atol=1e-15)
    assert metrics["rs_token_rejected_frac"] == 0.0  # the loss's own rejection: nothing left the loss
    label = RSClippedPGLossConfig.from_any(with_filter).rejection_sampling[0].label
    assert metrics[f"rs/{label}/token_rejected_frac"] == pytest.approx(1.0)
    assert metrics["kl_penalty"] == pytest.approx(metrics0["kl_penalty"], rel=1e-12)


@pytest.mark.filterwarnings("ignore::nemo_rs_plugin.core.settings.config.ConfigWarning")
def test_later_filters_see_the_tokens_a_policy_gradient_only_filter_rejected():
    """A sequence filter after it reads the same tokens as without it; two such filters count a
    shared token once (the second's rejected fraction is 0)."""
    curr, gen, adv, mask, sm = _random_batch(seed=1)
    geo = {"level": "sequence", "statistic": "ratio", "agg": "mean", "log_ratio": "curr-gen", "lower": 0.9,
           "upper": 1.1}  # fmt: skip
    alone = {"use_importance_sampling_correction": True, "rejection_sampling": [geo]}
    after = {**alone, "rejection_sampling": [REJECT_ALL_PG, {**REJECT_ALL_PG, "name": "again"}, geo]}
    _, _, m_alone = run_plugin(alone, curr, gen, adv, mask, sm)
    _, _, m_after = run_plugin(after, curr, gen, adv, mask, sm)
    geo_label = RSClippedPGLossConfig.from_any(alone).rejection_sampling[0].label
    assert m_after[f"rs/{geo_label}/seq_rejected_frac"] == m_alone[f"rs/{geo_label}/seq_rejected_frac"]
    assert 0 < m_alone[f"rs/{geo_label}/seq_rejected_frac"] < 1  # the batch makes the geo filter decide
    assert m_after["rs/again/token_rejected_frac"] == 0.0
