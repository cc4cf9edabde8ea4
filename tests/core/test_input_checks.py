"""Guards ``core/batch/input_checks.py``: a ``token_mask`` that is not 0/1, and a ``global_valid_toks`` smaller than the
microbatch's own valid tokens, are errors naming the input and the value; positive log-probs
(probabilities passed as log-probs) are a warning naming the input. All are decided on the one
host transfer of the metrics (no extra sync: tests/core/test_cuda_sync.py counts them on a GPU)."""

import warnings

import pytest
import torch

from nemo_rs_plugin import CorrectedPGLoss
from nemo_rs_plugin.core.batch.input_checks import InputWarning
from tests.conftest import make_batch, random_batch
from tests.core.test_inputs import FULL


def batch(B=4, T=8):
    torch.manual_seed(0)
    return random_batch(B, T)


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


@pytest.mark.parametrize(
    "value, shown", [(0.99999988, "(0.9999999)"), (1.0000001, "(1.0000001)"), (1e-9, "(1e-09)"), (0.5, "(0.5)")]
)
def test_a_token_mask_entry_near_0_or_1_is_shown_with_the_digits_that_tell_it_apart(value, shown):
    lp, data, gvs, gvt = batch()
    data["token_mask"] = data["token_mask"].float()
    data["token_mask"][1, 3] = value
    with pytest.raises(ValueError) as info:
        CorrectedPGLoss({})(lp, data, gvs, gvt)
    assert str(info.value).startswith(f"token_mask: got 1 entry other than 0 and 1 {shown}; "), str(info.value)


@pytest.mark.parametrize("shape", [(4,), (4, 1)])
def test_per_sequence_advantages_get_the_broadcast_that_fixes_them(shape):
    lp, data, gvs, gvt = batch()
    data["advantages"] = torch.randn(*shape)
    with pytest.raises(ValueError) as info:
        CorrectedPGLoss({})(lp, data, gvs, gvt)
    msg = str(info.value)
    assert msg.startswith(f"data['advantages']: got shape {shape}; expected [B, S] = (4, 9)"), msg
    assert "one advantage per token, as NeMo-RL's GRPO stores them: broadcast a per-sequence advantage" in msg, msg


@pytest.mark.parametrize("batched", [False, True], ids=["cpu-form", "gpu-form"])
@pytest.mark.parametrize(
    "values, found",
    [((2,), "(largest entry 2)"), ((-1,), "(smallest entry -1)"), ((-1, 3), "(smallest entry -1, largest entry 3)")],
)
def test_integer_token_mask_other_than_zero_one_is_an_error(values, found, batched):
    """An integer mask is checked by its extremes (no [B, T] temporary): the message names them."""
    lp, data, gvs, gvt = batch()
    for column, value in enumerate(values, start=2):
        data["token_mask"][1, column] = value
    with pytest.raises(ValueError) as info:
        CorrectedPGLoss(FULL, batched_metrics=batched)(lp, data, gvs, gvt)
    assert str(info.value) == (
        f"token_mask: got entries other than 0 and 1 {found}; allowed: 0 and 1 only (1: a response token the loss "
        "trains on); another value scales that token's loss but counts it as one token: weight whole sequences "
        "with sample_mask"
    )


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


@pytest.fixture
def placeholder_unsaid(monkeypatch):
    """The split API's placeholder is said once per process: as if not said yet."""
    from nemo_rs_plugin.core.batch import input_checks

    monkeypatch.setattr(input_checks, "_SAID_ONCE", set())


def test_the_split_api_placeholder_one_passes_and_is_said_once(placeholder_unsaid):
    # NeMo-RL main's split API passes 1 for both counts and rescales the summed metrics at the end
    # (its own test_split_rescale_matches_sync_normalization runs with the plugin substituted).
    # Any other caller passing 1 and 1 gets a loss 32x too large here: said, once per process.
    lp, data, gvs, gvt = batch()
    with pytest.warns(InputWarning) as caught:
        loss_one, _ = CorrectedPGLoss({})(lp, data, torch.tensor(1.0), torch.tensor(1.0))
        CorrectedPGLoss({})(lp, data, 1, 1)
    [warning] = caught
    message = str(warning.message)
    assert message.startswith(
        "global_valid_seqs and global_valid_toks: got 1 and 1 while this microbatch has 4 valid sequences and "
        "32 valid tokens: taken as the placeholder of NeMo-RL's split API"
    ), message
    assert "32x (token-level loss) or 4x (sequence-level) too large" in message, message
    loss_own, _ = CorrectedPGLoss({})(lp, data, gvs, gvt)
    assert loss_one.item() == pytest.approx(loss_own.item() * gvt.item(), rel=1e-5)


@pytest.mark.parametrize("counts, name", [((1, 32), "global_valid_seqs"), ((4, 1), "global_valid_toks")])
def test_one_count_of_1_beside_a_real_count_is_not_the_placeholder(counts, name):
    """The split API passes 1 for both counts; 1 for one alone is a count below the microbatch's own."""
    lp, data, gvs, gvt = batch()
    with pytest.raises(ValueError, match=f"^{name}: got 1 while this microbatch has"):
        CorrectedPGLoss({"token_level_loss": name == "global_valid_toks"})(lp, data, *counts)


def test_the_placeholder_is_not_said_where_the_microbatch_holds_one_token(placeholder_unsaid, recwarn):
    lp, data, gvs, gvt = batch(B=1, T=2)
    data["token_mask"][:] = torch.tensor([[0, 0, 1]])  # one valid token: 1 and 1 are its true counts
    CorrectedPGLoss({})(lp, data, 1, 1)
    assert not [w for w in recwarn.list if issubclass(w.category, InputWarning)]


def logprob_batch(B=4, T=8):
    """Log-probs well below 0 (at most -0.5 before noise): none positive by chance."""
    torch.manual_seed(0)
    prev = -0.5 - torch.rand(B, T)
    token_mask = torch.ones(B, T)
    token_mask[2, 5:] = 0
    return make_batch(
        prev + 0.05 * torch.randn(B, T),
        prev,
        prev + 0.1 * torch.randn(B, T),
        advantages=torch.randn(B, T),
        token_mask=token_mask,
    )


def positive_logprob_warnings(cfg, batched=False, **replace):
    lp, data, gvs, gvt = logprob_batch()
    for key, value in replace.items():
        if key == "next_token_logprobs":
            lp = value(lp)
        else:
            data[key] = value(data[key])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        CorrectedPGLoss(cfg, batched_metrics=batched)(lp, data, gvs, gvt)
    return [str(w.message) for w in caught if issubclass(w.category, InputWarning)]


@pytest.mark.parametrize("batched", [False, True], ids=["cpu-form", "gpu-form"])
@pytest.mark.parametrize(
    "key", ["next_token_logprobs", "prev_logprobs", "generation_logprobs", "reference_policy_logprobs"]
)
def test_probabilities_passed_as_logprobs_warn_naming_the_input(key, batched):
    messages = positive_logprob_warnings(FULL, batched, **{key: torch.exp})  # p = exp(log p) in (0, 1]
    assert len(messages) == 1 and messages[0].startswith(f"{key}: log-probs above 0 on valid tokens"), messages


@pytest.mark.parametrize("batched", [False, True], ids=["cpu-form", "gpu-form"])
def test_logprobs_at_most_zero_or_positive_only_where_masked_do_not_warn(batched):
    """Positive advantages and log-ratios are no mistake (the GPU form counts every stacked row)."""
    lp, data, gvs, gvt = logprob_batch()
    assert positive_logprob_warnings(FULL, batched) == []
    masked = data["token_mask"] == 0
    assert masked.any()

    def positive_where_masked(t):
        return torch.where(masked, torch.ones_like(t), t)

    assert positive_logprob_warnings(FULL, batched, generation_logprobs=positive_where_masked) == []
    # rounding of a fused log-softmax (log p = +1e-6 for p = 1) is not a mistake
    assert positive_logprob_warnings(FULL, batched, prev_logprobs=lambda t: torch.full_like(t, 1e-6)) == []


@pytest.mark.parametrize("batched", [False, True], ids=["cpu-form", "gpu-form"])
def test_forced_on_policy_warns_once_for_the_current_logprobs(batched):
    messages = positive_logprob_warnings({"force_on_policy_ratio": True}, batched, next_token_logprobs=torch.exp)
    assert [m.split(":")[0] for m in messages] == ["next_token_logprobs"], messages


def test_data_on_another_device_names_the_input():
    """torch's own error ("not on the expected device meta!") names no input."""
    lp, data, gvs, gvt = logprob_batch()
    with pytest.raises(ValueError, match=r"prev_logprobs: on cpu, next_token_logprobs on meta"):
        CorrectedPGLoss({})(lp.to("meta"), data, gvs, gvt)


def test_log_probs_with_position_zero_kept_say_what_shape_is_expected():
    lp, data, gvs, gvt = logprob_batch()
    full = torch.cat([lp[:, :1], lp], dim=1)  # [B, S]: position 0 not dropped
    with pytest.raises(ValueError, match=r"next_token_logprobs is \[B, S - 1\]"):
        CorrectedPGLoss({})(full, data, gvs, gvt)
