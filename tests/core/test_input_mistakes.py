"""A ``token_mask`` that is not 0/1, and a ``global_valid_toks`` smaller than the
microbatch's own valid tokens, are errors naming the input and the value, decided on the one host
transfer of the metrics (no extra sync: tests/core/test_cuda_sync.py counts them on a GPU)."""

import pytest
import torch

from nemo_rs_plugin import CorrectedPGLoss
from tests.conftest import make_batch
from tests.core.test_inputs import FULL


def batch(B=4, T=8):
    torch.manual_seed(0)
    prev = -torch.rand(B, T)
    return make_batch(
        prev + 0.05 * torch.randn(B, T), prev, prev + 0.1 * torch.randn(B, T), advantages=torch.randn(B, T)
    )


@pytest.mark.parametrize("value", [2, -1, 0.5])
@pytest.mark.parametrize("cfg", [{}, FULL], ids=["plain", "full"])
def test_token_mask_other_than_zero_one_is_an_error(cfg, value):
    lp, data, gvs, gvt = batch()
    data["token_mask"] = data["token_mask"].float()
    data["token_mask"][1, 3] = value
    with pytest.raises(ValueError) as info:
        CorrectedPGLoss(cfg)(lp, data, gvs, gvt)
    msg = str(info.value)
    assert msg.startswith("token_mask: got 1 entry other than 0 and 1") and f"{value:g}" in msg, msg
    assert "\n" not in msg


@pytest.mark.parametrize("dtype", [torch.bool, torch.long, torch.float32, torch.bfloat16])
def test_zero_one_token_masks_of_any_dtype_pass(dtype):
    lp, data, gvs, gvt = batch()
    data["token_mask"] = data["token_mask"].to(dtype)
    CorrectedPGLoss(FULL)(lp, data, gvs, gvt)


@pytest.mark.parametrize("count", [3, torch.tensor(3.0), torch.tensor(3)], ids=["int", "tensor", "long-tensor"])
def test_global_valid_toks_below_the_microbatch_own_is_an_error(count):
    lp, data, gvs, gvt = batch()
    assert gvt.item() == 32
    with pytest.raises(ValueError) as info:
        CorrectedPGLoss({})(lp, data, gvs, count)
    msg = str(info.value)
    assert msg.startswith("global_valid_toks: got 3 while this microbatch has 32 valid tokens"), msg


def test_global_valid_seqs_below_the_microbatch_own_is_an_error():
    lp, data, gvs, gvt = batch()
    with pytest.raises(ValueError, match="global_valid_seqs: got 2 while this microbatch has 4 valid sequences"):
        CorrectedPGLoss({"token_level_loss": False})(lp, data, 2, gvt)


def test_a_global_count_at_or_above_the_microbatch_own_passes():
    lp, data, gvs, gvt = batch()
    loss_own, _ = CorrectedPGLoss({})(lp, data, gvs, gvt)
    loss_big, _ = CorrectedPGLoss({})(lp, data, gvs * 2, gvt * 2)
    assert loss_big.item() == pytest.approx(loss_own.item() / 2, rel=1e-5)


def test_the_split_api_placeholder_one_passes():
    # NeMo-RL main's split API passes 1 for both counts and rescales the summed metrics at the end
    # (its own test_split_rescale_matches_sync_normalization runs with the plugin substituted).
    lp, data, gvs, gvt = batch()
    loss_one, _ = CorrectedPGLoss({})(lp, data, torch.tensor(1.0), torch.tensor(1.0))
    loss_own, _ = CorrectedPGLoss({})(lp, data, gvs, gvt)
    assert loss_one.item() == pytest.approx(loss_own.item() * gvt.item(), rel=1e-5)
