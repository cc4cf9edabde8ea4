"""Parity with NeMo-RL's own ClippedPGLossFn on the recorded fixture cases.

Tolerances (from the fixtures' README): loss rtol 1e-4 / atol 1e-5; each metric
|a - b| <= 1e-5 + 1e-4 |b| (or equal, for inf); gradient rtol 1e-4 / atol 1e-4 * max|grad|.
A 1% loss scaling or an ignored sample_mask fails these.

``NEMO_RS_TEST_DEVICE=cuda`` runs every case on that device (inputs moved there, results
compared on the host with the same tolerances); the default is ``cpu``.
"""

import os

import pytest
import torch

from nemo_rs_plugin import CorrectedPGLoss
from tests.conftest import fixtures_path
from tests.support.fixture_metrics import plugin_value_of_recorded

# Shipped in tests/data (or $NEMO_RS_FIXTURES): a missing recording fails, it never skips.
CASES = torch.load(fixtures_path())["cases"]
DEVICE = torch.device(os.environ.get("NEMO_RS_TEST_DEVICE") or "cpu")


def run_case(loss_fn, case, device=DEVICE):
    """Loss, metrics and gradient of one case computed on ``device``; tensors returned on the host."""
    lp = case["next_token_logprobs"].to(device, copy=True).requires_grad_(True)
    data = {k: v.to(device, copy=True) for k, v in case["data"].items()}

    def count(v):
        return v.to(device) if isinstance(v, torch.Tensor) else v

    loss, metrics = loss_fn(lp, data, count(case["global_valid_seqs"]), count(case["global_valid_toks"]))
    loss.backward()
    grad = lp.grad if lp.grad is not None else torch.zeros_like(lp)
    return loss.detach().cpu(), metrics, grad.cpu()


def assert_matches_upstream(case, loss, metrics, grad):
    torch.testing.assert_close(loss, case["loss"], rtol=1e-4, atol=1e-5, msg=lambda m: f"{case['name']}: {m}")
    for key, ref in case["metrics"].items():
        assert key in metrics, (case["name"], key)
        got = metrics[key]
        ref = plugin_value_of_recorded(case, key, ref)  # the one deliberate difference (GSPO's metric)
        if ref is None:
            continue
        assert got == ref or abs(got - ref) <= 1e-5 + 1e-4 * abs(ref), (case["name"], key, got, ref)
    torch.testing.assert_close(
        grad,
        case["grad"],
        rtol=1e-4,
        atol=1e-4 * case["grad"].abs().max().item() + 1e-12,
        msg=lambda m: f"{case['name']}: {m}",
    )


def test_fixture_file_is_complete():
    assert len(CASES) == 120
    axes = {k: {c["axes"][k] for c in CASES} for k in ("level", "ratio", "is", "kl")}
    assert axes["is"] == {"off", "on", "tis", "tis_min", "icepop", "seq_mask"}
    assert axes["ratio"] == {"ppo", "asym", "dual", "cispo", "reinforce", "on_policy"}


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_matches_nemo_rl(case):
    loss_fn = CorrectedPGLoss(case["config"])
    assert_matches_upstream(case, *run_case(loss_fn, case))


# Cases with the correction off name the level too: its ConfigWarning (a level that applies no
# weight) is right and a side effect here.
@pytest.mark.filterwarnings(
    r"ignore:loss_fn\.is_correction_level. got '\w+' with use_importance_sampling_correction. false"
    ":nemo_rs_plugin.core.settings.config.ConfigWarning"
)
@pytest.mark.parametrize("case", CASES[:40], ids=[c["name"] for c in CASES[:40]])
def test_explicit_default_level_is_identical(case):
    """Naming the IS level NeMo-RL would pick changes nothing, the GSPO metric included."""
    cfg = dict(case["config"])
    level = "sequence" if cfg["sequence_level_importance_ratios"] else "token"
    if cfg["truncated_importance_sampling_type"] == "seq-mask-tis" and level == "sequence":
        pytest.skip("seq-mask-tis with the GSPO ratio is rejected by NeMo-RL")
    base = run_case(CorrectedPGLoss(case["config"]), case)
    explicit = run_case(CorrectedPGLoss({**cfg, "is_correction_level": level}), case)
    torch.testing.assert_close(explicit[0], base[0])
    torch.testing.assert_close(explicit[2], base[2])
    for key, value in base[1].items():
        assert explicit[1][key] == pytest.approx(value, rel=1e-6, abs=1e-9), key
