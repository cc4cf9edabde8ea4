"""Bad inputs give a clear error (shapes, dtypes, missing keys), and the metric contract
(names, normalizations, shapes, one host transfer) holds."""

import math

import pytest
import torch
from torch.overrides import TorchFunctionMode

from nemo_rs_plugin import CorrectedPGLoss, metric_normalizations
from nemo_rs_plugin.core.distributed import NO_GROUPS
from nemo_rs_plugin.core.evaluation import EvaluationForm
from nemo_rs_plugin.core.settings import presets
from tests.conftest import make_batch, random_batch
from tests.support.logprobs import at_most_zero

FULL = {
    "use_importance_sampling_correction": True,
    "is_correction_level": "sequence_mean",
    "truncated_importance_sampling_type": "seq-mask-tis",
    "truncated_importance_sampling_ratio": 1.5,
    "truncated_importance_sampling_ratio_min": 0.5,
    "positive_example_nll_weight": 0.1,
    "rejection_sampling": [
        {"level": "sequence", "agg": "mean", "lower": 0.5, "upper": 2.0},
        {"level": "sequence", "agg": "any", "lower": 1e-4, "upper": 100},
        {"level": "token", "statistic": "kl_k3", "upper": 0.5},
    ],
}


GSPO = {"sequence_level_importance_ratios": True, "token_level_loss": False, "use_importance_sampling_correction": True}


def batch(B=3, T=6):
    return random_batch(B, T, rewards=torch.tensor([1.0, -1.0, 0.5])[:B])


def test_shape_mismatch_names_the_tensor():
    lp, data, gvs, gvt = batch()
    data["generation_logprobs"] = data["generation_logprobs"][:, :-1]
    with pytest.raises(ValueError, match=r"generation_logprobs: shape \(3, 5\).*next_token_logprobs \(3, 6\)"):
        CorrectedPGLoss(FULL)(lp, data, gvs, gvt)


def test_sample_mask_and_dtype_mismatch():
    lp, data, gvs, gvt = batch()
    data["sample_mask"] = torch.ones(2)
    with pytest.raises(ValueError, match="sample_mask: shape"):
        CorrectedPGLoss(FULL)(lp, data, gvs, gvt)
    lp, data, gvs, gvt = batch()
    data["prev_logprobs"] = data["prev_logprobs"].long()
    with pytest.raises(TypeError, match="prev_logprobs: expected a float tensor"):
        CorrectedPGLoss(FULL)(lp, data, gvs, gvt)
    with pytest.raises(ValueError, match=r"expected \[B, T\]"):
        CorrectedPGLoss(FULL)(lp[0], data, gvs, gvt)


def test_per_sequence_advantages_are_an_error_naming_the_expected_shape():
    # NeMo-RL's ClippedPGLossFn slices advantages[:, 1:] as well (an IndexError on [B]).
    lp, data, gvs, gvt = batch()
    data["advantages"] = torch.randn(3)
    with pytest.raises(
        ValueError,
        match=r"data\['advantages'\]: got shape \(3,\); expected \[B, S\] = \(3, 7\)"
        r".*next_token_logprobs \(3, 6\).*unsqueeze\(-1\)\.expand\(-1, S\)",
    ):
        CorrectedPGLoss(FULL)(lp, data, gvs, gvt)
    lp, data, gvs, gvt = batch()
    data["token_mask"] = torch.ones(3, 7, 1)
    with pytest.raises(ValueError, match=r"data\['token_mask'\]: got shape \(3, 7, 1\); expected \[B, S\]"):
        CorrectedPGLoss(FULL)(lp, data, gvs, gvt)
    lp, data, gvs, gvt = batch()
    data["advantages"] = data["advantages"].tolist()
    with pytest.raises(TypeError, match=r"data\['advantages'\]: got list; expected a torch.Tensor"):
        CorrectedPGLoss(FULL)(lp, data, gvs, gvt)


SEQUENCE_FILTERS = [
    {"level": "sequence", "agg": agg, "lower": 0.5, "upper": 2.0} for agg in ("mean", "sum", "max", "min", "any")
]


@pytest.mark.parametrize(
    "cfg",
    [
        FULL,
        {"rejection_sampling": SEQUENCE_FILTERS},
        {
            **GSPO,
            "is_correction_level": "sequence_mean",
            "rejection_sampling": SEQUENCE_FILTERS,
            "rejection_denominator": "kept",
        },
    ],
    ids=["full", "every-agg", "gspo-kept"],
)
def test_empty_sequence_dimension_is_a_fully_masked_batch(cfg):
    # T = 0 (prompts without a response, or an empty shard): no token, so loss 0 and no
    # gradient, as without filters; `amax` over the empty dimension used to raise.
    empty = torch.zeros(3, 0)
    lp, data, gvs, gvt = make_batch(empty, empty, empty, rewards=torch.ones(3))
    loss, metrics = CorrectedPGLoss(cfg)(lp, data, gvs, gvt)
    loss.backward()
    assert loss.item() == 0.0 and lp.grad.shape == (3, 0)
    assert metrics["num_valid_samples"] == 3.0
    assert not any(v != v for v in metrics.values())
    assert metrics["rs_seq_rejected_frac"] == 0.0


def test_missing_key_is_named():
    lp, data, gvs, gvt = batch()
    del data["generation_logprobs"]
    with pytest.raises(KeyError, match="generation_logprobs"):
        CorrectedPGLoss(FULL)(lp, data, gvs, gvt)


@pytest.mark.parametrize(
    "cfg",
    [
        {},
        FULL,
        {
            "sequence_level_importance_ratios": True,
            "token_level_loss": False,
            "use_importance_sampling_correction": True,
            "truncated_importance_sampling_type": "tis",
            "truncated_importance_sampling_ratio": 2.0,
        },
    ],
)
def test_metric_normalizations_list_exactly_the_returned_metrics(cfg):
    loss_fn = CorrectedPGLoss(cfg)
    _, metrics = loss_fn(*batch())
    assert set(metrics) == set(metric_normalizations(loss_fn.cfg))
    assert all(isinstance(v, float) for v in metrics.values())


def test_sequence_level_metric_is_a_per_sequence_mean_not_a_broadcast():
    # B = 2, sequence weights w = [exp(0.1 * 5), exp(-0.1 * 5)]: mean over 2 sequences.
    prev = torch.full((2, 5), -1.0)  # log-probs <= 0: gen = prev + 0.1 on row 1
    gen = prev - torch.tensor([[0.1], [-0.1]])
    lp, data, gvs, gvt = make_batch(prev, prev, gen)
    _, m = CorrectedPGLoss(
        {
            "use_importance_sampling_correction": True,
            "is_correction_level": "sequence",
            "sequence_level_importance_ratios": True,
            "token_level_loss": False,
        }
    )(lp, data, gvs, gvt)
    want = (torch.exp(torch.tensor(0.5)) + torch.exp(torch.tensor(-0.5))).item() / 2
    assert m["sampling_importance_ratio"] == pytest.approx(want, rel=1e-6)


def test_sequence_level_metric_leaves_out_masked_samples():
    # Row 1 is sample-masked: its weight exp(2.0) must not enter the mean over 2 sequences.
    prev = torch.full((3, 4), -1.0)  # log-probs <= 0: gen = prev + 0.125 on row 2
    gen = prev - torch.tensor([[0.5], [2.0], [-0.5]]) / 4  # sequence log-ratios 0.5, 2.0, -0.5
    lp, data, gvs, gvt = make_batch(prev, prev, gen, sample_mask=[1.0, 0.0, 1.0])
    for gspo in (False, True):
        cfg = {
            "use_importance_sampling_correction": True,
            "is_correction_level": "sequence",
            "sequence_level_importance_ratios": gspo,
            "token_level_loss": not gspo,
        }
        _, m = CorrectedPGLoss(cfg)(lp, data, gvs, gvt)
        want = (math.exp(0.5) + math.exp(-0.5)) / 2
        assert m["sampling_importance_ratio"] == pytest.approx(want, rel=1e-6), gspo
        assert m["is_weight_mean"] == pytest.approx(want, rel=1e-6), gspo


NORMALIZATION_CASES = {
    "token-IS+filters+tis": {
        **FULL,
        "is_correction_level": "token",
        "truncated_importance_sampling_type": "tis",
        "truncated_importance_sampling_ratio": 1.02,
        "truncated_importance_sampling_ratio_min": 0.99,
        "rejection_sampling": FULL["rejection_sampling"][:1] + [{"level": "token", "lower": 0.95, "upper": 1.05}],
    },
    "sequence_mean+filters+seq-mask-tis": {
        **FULL,
        "truncated_importance_sampling_ratio": 1.03,
        "truncated_importance_sampling_ratio_min": 0.98,
    },
    "gspo-sequence+icepop": {
        "use_importance_sampling_correction": True,
        "sequence_level_importance_ratios": True,
        "token_level_loss": False,
        "truncated_importance_sampling_type": "icepop",
        "truncated_importance_sampling_ratio": 1.2,
        "truncated_importance_sampling_ratio_min": 0.9,
        "rejection_sampling": [{"level": "sequence", "agg": "sum", "lower": 0.8, "upper": 1.2}],
    },
}


@pytest.mark.parametrize("name", sorted(NORMALIZATION_CASES))
def test_each_metric_is_divided_by_the_denominator_it_declares(name):
    # NeMo-RL sums normalized metrics over microbatches, so a metric declared "tokens" must be
    # divided by global_valid_toks (and not by global_valid_seqs), "sequences" the converse,
    # and "none" by neither. Doubling one global count must scale exactly those metrics.
    # (Without the VAPO NLL term: NeMo-RL divides it by the microbatch's own token count.)
    cfg = {**NORMALIZATION_CASES[name], "positive_example_nll_weight": 0.0}
    torch.manual_seed(3)
    B, T = 4, 6
    prev = -torch.rand(B, T, dtype=torch.float64)
    gen = prev + 0.05 * torch.randn(B, T, dtype=torch.float64)
    curr = prev + 0.1 * torch.randn(B, T, dtype=torch.float64)
    prev, gen, curr = at_most_zero(prev, gen, curr)
    loss_fn = CorrectedPGLoss(cfg)

    def metrics(seq_scale, tok_scale):
        advantages = torch.randn(B, T, generator=torch.Generator().manual_seed(1))
        lp, data, gvs, gvt = make_batch(curr, prev, gen, advantages=advantages)
        data = {k: v.double() if v.is_floating_point() else v for k, v in data.items()}
        lp = lp.detach().double().requires_grad_(True)
        return loss_fn(lp, data, gvs.double() * seq_scale, gvt.double() * tok_scale)[1]

    base, seqs2, toks2 = metrics(1, 1), metrics(2, 1), metrics(1, 2)
    norms = loss_fn.metric_normalizations()
    assert set(norms) == set(base)
    moved = {"tokens": 0, "sequences": 0}
    for key, norm in norms.items():  # rel 1e-7: NeMo-RL's "+ 1e-8" in every denominator
        by_seqs = 0.5 if norm == "sequences" else 1.0
        by_toks = 0.5 if norm == "tokens" else 1.0
        assert seqs2[key] == pytest.approx(base[key] * by_seqs, rel=1e-7, abs=1e-15), (key, norm, "global_valid_seqs")
        assert toks2[key] == pytest.approx(base[key] * by_toks, rel=1e-7, abs=1e-15), (key, norm, "global_valid_toks")
        if norm in moved and base[key] != 0:
            moved[norm] += 1
    assert moved["tokens"] and moved["sequences"], f"test data too tame: {moved}"


def test_ess_is_one_for_uniform_weights_and_drops_with_spread():
    prev = torch.zeros(2, 4)
    lp, data, gvs, gvt = make_batch(prev, prev, prev)
    _, m = CorrectedPGLoss({"use_importance_sampling_correction": True})(lp, data, gvs, gvt)
    assert m["is_ess"] == pytest.approx(1.0)
    gen = prev - torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    lp, data, gvs, gvt = make_batch(prev, prev, gen)
    _, m = CorrectedPGLoss({"use_importance_sampling_correction": True})(lp, data, gvs, gvt)
    w = torch.tensor([2.718281828] + [1.0] * 7)
    assert m["is_ess"] == pytest.approx((w.sum() ** 2 / (8 * (w**2).sum())).item(), rel=1e-5)


@pytest.mark.parametrize("cfg", [{}, FULL, GSPO], ids=["default", "full", "gspo"])
@pytest.mark.parametrize("as_tensor", [False, True], ids=["number", "tensor"])
def test_zero_global_count_with_valid_units_is_an_error(cfg, as_tensor):
    # NeMo-RL divides by 0 + 1e-8 and returns a loss of order 1e9.
    zero = torch.tensor(0.0) if as_tensor else 0
    lp, data, gvs, gvt = batch()
    with pytest.raises(ValueError, match=r"global_valid_toks: got 0 while this microbatch has 18 valid tokens"):
        CorrectedPGLoss(cfg)(lp, data, gvs, zero)
    with pytest.raises(ValueError, match=r"global_valid_seqs: got 0 while this microbatch has 3 valid sequences"):
        CorrectedPGLoss(cfg)(lp, data, zero, gvt)


@pytest.mark.parametrize("value, shown", [(-5.0, "-5"), (float("nan"), "nan"), (float("inf"), "inf")])
def test_negative_or_nonfinite_global_count_is_an_error(value, shown):
    lp, data, gvs, gvt = batch()
    with pytest.raises(ValueError, match=rf"global_valid_toks: got {shown} while"):
        CorrectedPGLoss({})(lp, data, gvs, torch.tensor(value))
    data["sample_mask"] = torch.zeros(3)  # even for a fully masked batch
    with pytest.raises(ValueError, match=rf"global_valid_seqs: got {shown} while"):
        CorrectedPGLoss({})(lp, data, value, 0)


def test_global_count_must_be_one_number():
    lp, data, gvs, gvt = batch()
    with pytest.raises(ValueError, match=r"global_valid_toks: got a tensor of shape \(2,\); expected one count"):
        CorrectedPGLoss({})(lp, data, gvs, torch.tensor([18.0, 18.0]))
    with pytest.raises(TypeError, match=r"global_valid_seqs: got NoneType None; expected a number"):
        CorrectedPGLoss({})(lp, data, None, gvt)


@pytest.mark.parametrize(
    "cfg", [{}, FULL, GSPO, {**FULL, "rejection_denominator": "kept"}], ids=["default", "full", "gspo", "kept"]
)
@pytest.mark.parametrize("masked", ["samples", "tokens"])
def test_fully_masked_global_batch_gives_zero_loss_and_gradient(cfg, masked):
    lp, data, _, _ = batch()
    if masked == "samples":
        data["sample_mask"] = torch.zeros(3)
        gvs = 0
    else:  # valid samples without a single valid token
        data["token_mask"] = torch.zeros_like(data["token_mask"])
        gvs = 3
    loss, metrics = CorrectedPGLoss(cfg)(lp, data, gvs, torch.tensor(0.0))
    loss.backward()
    assert loss.item() == 0.0
    assert torch.all(lp.grad == 0)
    for key, value in metrics.items():
        if key.endswith("_min"):
            assert value == float("inf"), key  # NeMo-RL's "no token" sentinel
        elif key.endswith("_max"):
            assert value == float("-inf"), key
        else:
            assert value == value and abs(value) < float("inf"), key


def test_nonfinite_inputs_are_counted_per_kind():
    # NeMo-RL returns NaN on any of these; the plugin zeroes them and counts valid tokens
    # with a non-finite input, one metric per kind. Row 2 is a masked sample; position
    # (0, 5) a masked token: neither counts.
    nan, inf = float("nan"), float("inf")
    B, T = 3, 6
    prev = -torch.rand(B, T)
    curr, gen, ref, adv = prev + 0.01, prev - 0.01, prev - 0.02, torch.randn(B, T)
    token_mask = torch.ones(B, T)
    token_mask[0, 5] = 0
    curr[0, 0], curr[0, 5], curr[2, 0] = nan, nan, inf  # 1 valid
    prev[1, 1], gen[1, 2], gen[2, 3] = -inf, nan, nan  # 2 valid log-ratios
    ref[0, 1], ref[1, 3], ref[2, 1] = inf, nan, nan  # 2 valid
    adv[0, 2], adv[1, 4], adv[2, 2] = inf, nan, nan  # 2 valid
    unfiltered = curr.clone()
    unfiltered[1, 5] = -inf  # read by the KL term only
    lp, data, gvs, gvt = make_batch(
        curr, prev, gen, ref=ref, advantages=adv, token_mask=token_mask, sample_mask=[1.0, 1.0, 0.0]
    )
    data["curr_logprobs_unfiltered"] = unfiltered
    loss, m = CorrectedPGLoss({"reference_policy_kl_penalty": 0.1})(lp, data, gvs, gvt)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(lp.grad).all()
    assert m["nonfinite_curr_logprobs_count"] == 2.0  # curr (0, 0), unfiltered (1, 5)
    assert m["nonfinite_log_ratio_count"] == 2.0
    assert m["nonfinite_reference_logprobs_count"] == 2.0
    assert m["nonfinite_advantages_count"] == 2.0
    # Without the KL term neither the reference nor the unfiltered log-probs are read.
    lp.grad = None
    _, m = CorrectedPGLoss({"reference_policy_kl_penalty": 0.0})(lp, data, gvs, gvt)
    assert m["nonfinite_curr_logprobs_count"] == 1.0
    assert m["nonfinite_reference_logprobs_count"] == 0.0
    assert m["nonfinite_advantages_count"] == 2.0


class HostSyncCounter(TorchFunctionMode):
    """Counts tensor -> host conversions: item/tolist/bool/float/int, nonzero, boolean indexing."""

    SYNCS = {"item", "tolist", "__bool__", "__float__", "__int__", "__index__", "nonzero", "cpu", "numpy"}

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in self.SYNCS:
            self.calls.append(name)
        if name == "__getitem__" and len(args) > 1:
            idx = args[1] if isinstance(args[1], tuple) else (args[1],)
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in idx):
                self.calls.append("boolean-index")
        return func(*args, **(kwargs or {}))


# prime-rl's DPPO mapping (docs/guide.md#prime-rl-dppo) plus a sequence prob_diff filter: the
# signed, policy-gradient-only and per-sequence statistics of issue 20 on the same one transfer.
DPPO = {
    **presets.dppo(),
    "rejection_sampling": [
        *presets.dppo()["rejection_sampling"],
        {
            "level": "sequence",
            "statistic": "prob_diff",
            "agg": "mean",
            "log_ratio": "curr-gen",
            "lower": -0.5,
            "upper": 0.5,
        },
    ],
}


@pytest.mark.parametrize("cfg", [{}, FULL, DPPO], ids=["default", "full", "dppo"])
def test_one_host_transfer_per_call(cfg):
    """The accelerator's form, run here on the CPU, reads the host once: the metrics vector
    (test_cuda_sync.py counts the syncs on a GPU, where the form is picked by device)."""
    loss_fn = CorrectedPGLoss(cfg, batched_metrics=True)
    args = batch()
    with HostSyncCounter() as counter:
        loss, _ = loss_fn(*args)
        loss.backward()
    assert counter.calls == ["tolist"]


@pytest.mark.parametrize("cfg", [{}, FULL, DPPO], ids=["default", "full", "dppo"])
def test_eager_cpu_reads_the_host_only_for_checks_that_skip_work(cfg):
    """On the CPU a read is no device sync: the eager CPU form reads whether every input is finite
    and each log-prob input's largest entry, then the metrics; nothing per token or per sequence."""
    with HostSyncCounter() as counter:
        loss, _ = CorrectedPGLoss(cfg)(*batch())
        loss.backward()
    assert counter.calls == ["__bool__", "tolist", "tolist"]


def test_kl_uses_unfiltered_current_logprobs_when_given():
    # With top-k/top-p filtering NeMo-RL passes curr_logprobs_unfiltered for the KL term.
    B, T = 2, 4
    prev = -torch.rand(B, T)
    ref = prev - 0.3
    unfiltered = prev - 0.1
    lp, data, gvs, gvt = make_batch(prev, prev, prev, ref=ref)
    data["curr_logprobs_unfiltered"] = unfiltered  # aligned like next_token_logprobs, as NeMo-RL's
    cfg = {"reference_policy_kl_penalty": 0.1, "reference_policy_kl_type": "k1"}
    _, m = CorrectedPGLoss(cfg)(lp, data, gvs, gvt)
    # k1 of KL(curr || ref) per token = -(ref - curr_unfiltered) = 0.2 (not 0.3 from curr)
    assert m["kl_penalty"] == pytest.approx(0.2, rel=1e-5)
    del data["curr_logprobs_unfiltered"]
    _, m = CorrectedPGLoss(cfg)(lp, data, gvs, gvt)
    assert m["kl_penalty"] == pytest.approx(0.3, rel=1e-5)


@pytest.mark.parametrize("batched", [False, True], ids=["cpu-form", "gpu-form"])
def test_input_counts_read_valid_tokens_only_in_both_forms(batched):
    """The non-finite counts and the positive-log-prob warning count valid tokens only: a NaN
    or a positive value at a masked position (padding may hold anything) is neither counted nor
    warned about; the same at a valid position is. Both evaluation forms (the GPU form reduces
    the stacked inputs where they are, one matrix-vector product per stacked group)."""
    import warnings

    from nemo_rs_plugin.core.batch.input_checks import InputWarning

    B, T = 2, 5
    prev = -torch.rand(B, T) - 0.1
    token_mask = torch.ones(B, T)
    token_mask[1, 3:] = 0

    def run(position):
        p, g, c = prev.clone(), prev.clone() - 0.01, prev.clone()
        p[position] = float("nan")  # a non-finite prev
        g[position] = 0.5  # a "log-prob" above 0
        c[position] = 0.5
        lp, data, gvs, gvt = make_batch(c, p, g, token_mask=token_mask)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _, metrics = CorrectedPGLoss({}, batched_metrics=batched)(lp, data, gvs, gvt)
        warned = sorted(str(w.message).split(":")[0] for w in caught if issubclass(w.category, InputWarning))
        return metrics["nonfinite_log_ratio_count"], warned

    assert run((1, 4)) == (0.0, [])  # masked: nothing
    assert run((0, 2)) == (1.0, ["generation_logprobs", "next_token_logprobs"])


def _loss_inputs(lp, data, with_reference=True):
    from nemo_rs_plugin.core.loss import LossInputs

    return LossInputs.from_nemo_rl(lp, data, need_prev=True, need_reference=with_reference)


def test_finite_inputs_are_used_as_given_where_the_host_can_read():
    """Eager CPU, every input finite: no sanitised copy, no non-finite mask; one NaN anywhere (a
    masked position included) takes the general path; so does a finite input whose sum
    overflows (its values are exact either way)."""
    from nemo_rs_plugin.core.batch.sanitizing import sanitize_inputs

    READS = EvaluationForm(host_reads=True)  # eager CPU, unsharded
    lp, data, _, _ = batch()
    x = _loss_inputs(lp, data)
    clean = sanitize_inputs(x, False, True, READS)
    assert clean.nonfinite is None and clean.curr is x.curr and clean.masks.all_finite
    assert sanitize_inputs(x, False, True, EvaluationForm()).nonfinite is not None
    for key, value in (("reference_policy_logprobs", math.nan), ("advantages", math.inf)):
        broken = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in data.items()}
        broken["token_mask"][0, -1] = 0
        broken[key][0, -1] = value  # a masked position
        clean = sanitize_inputs(_loss_inputs(lp, broken), False, True, READS)
        assert clean.nonfinite is not None and not clean.masks.all_finite, key
    huge = {**data, "advantages": torch.full_like(data["advantages"], 3e38)}  # finite; its sum is inf
    clean = sanitize_inputs(_loss_inputs(lp, huge), False, True, READS)
    assert clean.nonfinite is not None and torch.equal(clean.advantages, huge["advantages"][:, 1:])


def _part(T, seed, with_rewards=True):
    from nemo_rs_plugin.core.batch.inputs import LossInputs

    g = torch.Generator().manual_seed(seed)

    def lp():
        return -torch.rand(1, T, generator=g, dtype=torch.float64)

    return LossInputs(
        curr=lp().requires_grad_(True),
        prev=lp(),
        generation=lp(),
        reference=None,
        advantages=torch.randn(1, T, generator=g, dtype=torch.float64),
        token_mask=torch.ones(1, T, dtype=torch.float64),
        sample_mask=torch.ones(1, dtype=torch.float64),
        rewards=torch.ones(1, dtype=torch.float64) if with_rewards else None,
    )


def test_stacked_sequences_give_the_loss_of_one_call_on_the_microbatch():
    """``LossInputs.stack_rows`` (the sharded path's per-sequence packing calls, gathered): rows of
    different lengths padded with masked zeros give the loss, gradient and metrics of the same rows
    laid out in one [B, T] batch by hand."""
    from nemo_rs_plugin.core.batch.inputs import LossInputs

    # batch-level quantities included: the batch-normalised weights and the kept denominator
    loss_fn = CorrectedPGLoss(
        {
            "use_importance_sampling_correction": True,
            "is_correction_level": "sequence_mean",
            "is_batch_normalization": "microbatch",
            "rejection_sampling": [{"level": "token", "statistic": "ratio", "lower": 0.9, "upper": 1.1}],
            "rejection_denominator": "kept",
            "reference_policy_kl_penalty": 0.0,
        }
    )
    parts = [_part(T, seed) for seed, T in enumerate((5, 9, 3))]
    stacked = LossInputs.stack_rows(parts)
    assert stacked.curr.shape == (3, 9) and stacked.sample_mask.shape == (3,) and stacked.reference is None
    assert stacked.token_mask[2, 3:].eq(0).all() and stacked.token_mask[2, :3].eq(1).all()

    def by_hand(name):
        rows = [getattr(p, name).detach() for p in parts]
        return torch.stack([torch.nn.functional.pad(r[0], (0, 9 - r.shape[-1])) for r in rows])

    leaf = by_hand("curr").requires_grad_(True)
    manual = LossInputs(
        curr=leaf,
        prev=by_hand("prev"),
        generation=by_hand("generation"),
        reference=None,
        advantages=by_hand("advantages"),
        token_mask=by_hand("token_mask"),
        sample_mask=torch.ones(3, dtype=torch.float64),
        rewards=torch.ones(3, dtype=torch.float64),
    )
    counts = torch.tensor(3.0, dtype=torch.float64), torch.tensor(17.0, dtype=torch.float64)
    loss, metrics = loss_fn.compute(stacked, *counts, NO_GROUPS)
    want_loss, want_metrics = loss_fn.compute(manual, *counts, NO_GROUPS)
    loss.backward()
    want_loss.backward()
    torch.testing.assert_close(loss, want_loss)
    for row, part in enumerate(parts):  # each part's own curr gets its row of the gradient
        T = part.curr.shape[-1]
        torch.testing.assert_close(part.curr.grad[0], leaf.grad[row, :T])
    assert metrics == pytest.approx(want_metrics)


def test_stacking_refuses_an_optional_field_some_parts_lack():
    from nemo_rs_plugin.core.batch.inputs import LossInputs

    with pytest.raises(ValueError, match="rewards is given for some parts only"):
        LossInputs.stack_rows([_part(4, 0), _part(4, 1, with_rewards=False)])
    with pytest.raises(ValueError, match="no part to stack"):
        LossInputs.stack_rows([])


@pytest.mark.parametrize(
    "cfg",
    [{}, {"force_on_policy_ratio": True}, {"reference_policy_kl_penalty": 0.0}],
    ids=["default", "on-policy", "no-kl"],
)
def test_the_loss_dtype_is_read_without_building_the_inputs(cfg, monkeypatch):
    """``loss_dtype`` (what a per-sequence packing call before the last returns its zero in) is the
    dtype the full call computes in, read from the fields' dtypes alone: no field sliced or checked
    (that cost more than the rest of such a call: benchmarks/bench_packing.py)."""
    from nemo_rs_plugin.core.batch.inputs import LossInputs

    loss = CorrectedPGLoss(cfg)
    lp, data, _, _ = random_batch(2, 6)
    fields = ["prev_logprobs", "generation_logprobs", "reference_policy_logprobs", "advantages", "sample_mask"]
    cases = [(lp, data)] + [(lp.double(), data)]
    for key in fields:
        cases.append((lp, {**data, key: data[key].double()}))
    cases.append((lp, {**data, "curr_logprobs_unfiltered": lp.detach().double()}))
    cases.append((lp, {**data, "token_mask": data["token_mask"].double()}))
    expected = [loss.inputs_from_nemo_rl(x, d).compute_dtype() for x, d in cases]
    assert torch.float64 in expected and torch.float32 in expected

    def not_built(*args, **kwargs):
        raise AssertionError("loss_dtype built the inputs")

    monkeypatch.setattr(LossInputs, "from_nemo_rl", not_built)
    assert [loss.loss_dtype(x, d) for x, d in cases] == expected


def test_inputs_already_in_the_loss_dtype_are_not_rebuilt_and_the_others_are_cast():
    """``to_dtype`` runs on every call: inputs with nothing to cast are returned as they are (no
    object or cast per field); one float field in another dtype casts that field, differentiably."""
    lp, data, _, _ = random_batch(2, 6)
    x = CorrectedPGLoss({}).inputs_from_nemo_rl(lp.requires_grad_(True), data)
    assert x.to_dtype(torch.float32) is x  # the masks are integer: never cast
    y = x.to_dtype(torch.float64)
    assert y is not x and y.curr.dtype == y.advantages.dtype == y.sample_mask.dtype == torch.float64
    assert y.token_mask.dtype == x.token_mask.dtype  # an integer mask stays as it is
    y.curr.sum().backward()
    assert lp.grad is not None and lp.grad.dtype == torch.float32
    half = type(x)(**{**x.__dict__, "advantages": x.advantages.half()})
    z = half.to_dtype(torch.float32)
    assert z is not half and z.advantages.dtype == torch.float32 and z.curr is half.curr
