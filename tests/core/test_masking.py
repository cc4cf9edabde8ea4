"""Guards ``core/masking.py`` on its own: the masks of a microbatch and the masked reductions.

Each test calls the module's functions on small hand-built tensors and compares them with the
rule its docstring states (``valid = token_mask * sample_mask``, the inclusive bound check, the
finite-entry replacements, the extrema penalty), written out here.
"""

import math

import torch

from nemo_rs_plugin.core.masking import (
    TokenMasks,
    extrema_penalty,
    finite_exp,
    log_ratio,
    masked_sum,
    nonfinite,
    out_of_bounds,
    row_dot,
    sanitize,
)

F64 = torch.float64
BIG = torch.finfo(F64).max
TOKEN_MASK = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 1]])  # integer, as NeMo-RL's
SAMPLE_MASK = torch.tensor([1.0, 0.5, 0.0])  # a weighted sample and a masked-out one
D_FINITE = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0], [0.0, 1.0, 1.0]], dtype=F64)
INPUTS_FINITE = torch.tensor([[1.0, 0.0, 1.0], [1.0, 0.0, 1.0], [1.0, 1.0, 1.0]], dtype=F64)


def _masks() -> TokenMasks:
    return TokenMasks.build(TOKEN_MASK, SAMPLE_MASK, D_FINITE, INPUTS_FINITE)


def test_valid_is_token_mask_times_sample_mask_and_valid_bin_is_where_it_is_nonzero():
    masks = _masks()
    expected_valid = torch.tensor([[1.0, 1.0, 0.0], [0.5, 0.5, 0.5], [0.0, 0.0, 0.0]], dtype=F64)
    assert masks.valid.dtype == F64 and masks.sample_mask.dtype == F64  # d_finite's dtype
    torch.testing.assert_close(masks.valid, expected_valid, rtol=0, atol=0)
    torch.testing.assert_close(masks.valid_bin, (expected_valid != 0).to(F64), rtol=0, atol=0)
    assert masks.valid_total.item() == 3.5 and masks.sample_total.item() == 1.5


def test_usable_tokens_are_valid_with_finite_inputs_and_the_penalty_excludes_the_others():
    masks = _masks()
    expected_usable = torch.tensor([[1.0, 0.0, 0.0], [1.0, 0.0, 1.0], [0.0, 0.0, 0.0]], dtype=F64)
    torch.testing.assert_close(masks.usable_bin, expected_usable, rtol=0, atol=0)
    torch.testing.assert_close(masks.usable_penalty, (1.0 - expected_usable) * BIG, rtol=0, atol=0)
    x = torch.tensor([[5.0, -9.0, 9.0], [2.0, 7.0, 3.0], [-8.0, 8.0, 0.0]], dtype=F64)
    assert masks.where_inputs_finite(x).tolist() == (x * INPUTS_FINITE).tolist()


def test_nonfinite_log_ratios_per_sequence_count_valid_tokens_only():
    # Row 0: position 1 is valid and not finite (position 2 is masked out); row 2: no valid token.
    assert _masks().nonfinite_d_per_sequence().tolist() == [1.0, 0.0, 0.0]


def test_all_finite_masks_are_the_general_ones_with_every_input_finite():
    ones = torch.ones(3, 3, dtype=F64)
    general = TokenMasks.build(TOKEN_MASK, SAMPLE_MASK, ones, ones)
    fast = TokenMasks.build_all_finite(TOKEN_MASK, SAMPLE_MASK, F64)
    assert fast.all_finite and not general.all_finite
    for name in ("valid", "valid_bin", "d_finite", "inputs_finite", "usable_bin", "usable_penalty"):
        torch.testing.assert_close(getattr(fast, name), getattr(general, name), rtol=0, atol=0, msg=name)
    x = torch.arange(9.0, dtype=F64).reshape(3, 3)
    assert fast.where_inputs_finite(x) is x  # nothing to mask: no multiply
    assert fast.nonfinite_d_per_sequence().tolist() == [0.0, 0.0, 0.0]


def test_out_of_bounds_is_inclusive_a_none_bound_is_open_and_nan_is_outside():
    x = torch.tensor([0.49, 0.5, 1.0, 2.0, 2.01, math.nan], dtype=F64)
    assert out_of_bounds(x, 0.5, 2.0).tolist() == [True, False, False, False, True, True]
    assert out_of_bounds(x, None, 2.0).tolist() == [False, False, False, False, True, True]
    assert out_of_bounds(x, 0.5, None).tolist() == [True, False, False, False, False, True]
    assert out_of_bounds(x, None, None).tolist() == [False] * 5 + [True]
    # the caller's clamp (token TIS keeps it as the weight) is read, not recomputed
    for lower, upper in ((0.5, 2.0), (None, 2.0), (0.5, None)):
        given = out_of_bounds(x, lower, upper, x.clamp(lower, upper))
        assert given.tolist() == out_of_bounds(x, lower, upper).tolist()
    assert out_of_bounds(x, 0.5, 2.0, torch.zeros_like(x)).all()  # read: every entry differs from it


def test_nonfinite_entries_become_zero_and_pass_no_gradient():
    raw = torch.tensor([0.5, math.nan, math.inf, -math.inf, 1000.0], dtype=F64, requires_grad=True)
    assert nonfinite(raw).tolist() == [0.0, 1.0, 1.0, 1.0, 0.0]
    clean = sanitize(raw)
    assert clean.tolist() == [0.5, 0.0, 0.0, 0.0, 1000.0]
    clean.sum().backward()
    assert raw.grad.tolist() == [1.0, 0.0, 0.0, 0.0, 1.0]
    # exp overflows at 1000: weight 0, as NeMo-RL's nan_to_num gives it
    assert finite_exp(raw.detach()).tolist() == [math.exp(0.5), 0.0, 0.0, 0.0, 0.0]


def test_log_ratio_is_prev_minus_gen_sanitised_with_its_finite_mask():
    prev = torch.tensor([[-1.0, -math.inf, -0.5]], dtype=F64, requires_grad=True)
    gen = torch.tensor([[-1.5, -2.0, math.nan]], dtype=F64)
    d, d_finite = log_ratio(prev, gen)
    assert d.tolist() == [[0.5, 0.0, 0.0]] and d_finite.tolist() == [[1.0, 0.0, 0.0]]
    assert not d.requires_grad


def test_masked_sums_are_the_sums_of_the_products():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], dtype=F64)
    mask = torch.tensor([[1.0, 0.0, 0.5], [0.0, 1.0, 1.0]], dtype=F64)
    assert masked_sum(values, mask).item() == 1.0 + 1.5 + 5.0 + 6.0  # same shape: one dot product
    assert masked_sum(values, mask[:, :1]).item() == 1.0 + 2.0 + 3.0  # broadcast mask
    assert row_dot(values, mask).tolist() == [2.5, 11.0]


def test_the_extrema_penalty_makes_amin_and_amax_range_over_the_mask_only():
    x = torch.tensor([[3.0, -7.0, 1.0], [4.0, 9.0, -2.0]], dtype=F64)
    mask = torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 0.0]], dtype=F64)
    penalty = extrema_penalty(mask)
    assert penalty.tolist() == [[0.0, BIG, 0.0], [BIG, BIG, BIG]]
    assert (x + penalty).amin(-1).tolist() == [1.0, BIG]  # an empty row gives the sentinel
    assert (x - penalty).amax(-1).tolist() == [3.0, -BIG]
