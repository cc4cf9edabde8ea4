"""The loss's input checks that are decided on the host, on the one transfer of the metrics.

Values the loss cannot judge without reading tensors: the global counts against the
microbatch's own, a ``token_mask`` other than 0/1 (errors), and positive log-probs (a warning:
probabilities passed where log-probs go). Two steps, both called by the loss, in order:
:func:`count_global_counts` and :func:`count_positive_logprobs` count on the device, as hidden
(``_``-prefixed) entries of the :class:`~nemo_rs_plugin.core.reporting.metrics.MetricSet`; after its one
``tolist()`` the loss hands their typed record (``metric_catalog.Diagnostics``) to
:func:`judge_inputs`, which raises or warns. No
extra sync (tests/core/test_cuda_sync.py counts them on a GPU), and the metric set calls nothing
here. See: docs/troubleshooting.md#input-errors
"""

from __future__ import annotations

import math
import warnings
from typing import Iterable, Mapping, Optional

import torch

from nemo_rs_plugin.core.batch.sanitizing import SanitizedInputs
from nemo_rs_plugin.core.masking import TokenMasks
from nemo_rs_plugin.core.reporting.metric_catalog import NONFINITE_LOGIT_ROWS, Diagnostics
from nemo_rs_plugin.core.reporting.metrics import GlobalCounts, MetricSet

__all__ = [
    "POSITIVE_LOGPROB_SLACK",
    "SPLIT_API_PLACEHOLDER",
    "InputWarning",
    "count_global_counts",
    "count_positive_logprobs",
    "judge_inputs",
    "warn_nonfinite_logits",
]

#: Log-probs above this are not log-probs (rounding of a fused log-softmax stays far below it).
POSITIVE_LOGPROB_SLACK = 1e-3
# SanitizedInputs field -> the data-dict key (or argument) it came from, for the warning.
_LOGPROB_SOURCES = (
    ("curr", "next_token_logprobs"),
    ("prev", "prev_logprobs"),
    ("gen", "generation_logprobs"),
    ("reference", "reference_policy_logprobs"),
)


class InputWarning(UserWarning):
    """Inputs the loss accepts (NeMo-RL's loss does too) that are almost surely a caller's mistake."""


def count_positive_logprobs(metrics: MetricSet, clean: SanitizedInputs, force_on_policy: bool) -> None:
    """Count, per log-prob input, the valid tokens where it is positive (beyond ``POSITIVE_LOGPROB_SLACK``).

    ``log p <= 0``: a positive value is a probability passed as a log-prob, or a flipped sign,
    and the weights ``exp(d)`` it feeds are then meaningless without any error. Counted on the
    device (one masked total per input, ``_positive_<key>_count``), warned about by
    :func:`judge_inputs` on the host, after the one metrics transfer.
    A warning, not an error: NeMo-RL's loss accepts any real number (its own tests feed
    ``randn`` log-probs), and this loss stays a drop-in for it. Shown once per input and place
    (Python's default warning filter; the text names the input, not the count).
    """
    skip = ("prev",) if force_on_policy else ()  # prev is curr then: one warning, for the input given
    sources = {field: key for field, key in _LOGPROB_SOURCES if field not in skip}
    dtype = clean.masks.valid_bin.dtype
    rows: Iterable[torch.Tensor]
    if clean.stacked is not None:  # GPU form: one comparison over the stacked inputs, one matvec
        names = [
            f"_positive_{sources[row]}_count" if row in sources else f"_positive_{row}" for row in clean.input_names
        ]
        rows = (clean.stacked > POSITIVE_LOGPROB_SLACK).to(dtype)  # [K, B, T]; d, advantages: unread counts
    else:
        present = [(key, t) for field, key in sources.items() if (t := getattr(clean, field)) is not None]
        names = [f"_positive_{key}_count" for key, _ in present]
        if metrics.form.host_reads and present and clean.curr.numel():
            # An input nowhere above the slack (its largest entry, read on the host) has no
            # positive valid token: its count is 0 without a [B, T] comparison.
            largest = torch.stack([t.detach().amax() for _, t in present]).tolist()
            for name, value in zip(names, largest):
                if value <= POSITIVE_LOGPROB_SLACK:
                    metrics.add_zero(name)
            above = [i for i, value in enumerate(largest) if value > POSITIVE_LOGPROB_SLACK]
            present, names = [present[i] for i in above], [names[i] for i in above]
        rows = ((t.detach() > POSITIVE_LOGPROB_SLACK).to(dtype) for _, t in present)  # one at a time
    metrics.add_masked_totals(names, rows, clean.masks.valid_bin)


def _positive_input_message(key: str) -> str:
    return (
        f"{key}: log-probs above 0 on valid tokens; log-probs are <= 0 (were probabilities or negated "
        "log-probs passed?): the importance weights and ratios built from them are meaningless"
    )


#: Relative slack of "global count >= the microbatch's own" (sums of fractional sample masks round).
_COUNT_SLACK = 1e-5
#: The global count NeMo-RL's split API passes (raw sums, rescaled by the caller at the end).
SPLIT_API_PLACEHOLDER = 1.0


def count_global_counts(metrics: MetricSet, counts: GlobalCounts, masks: TokenMasks) -> None:
    """Declare what :func:`judge_inputs` reads of the counts and the token mask (hidden entries, no sync).

    A global count is wrong when it is negative or not finite, or below the microbatch's own
    count of the units it counts (0 included while this microbatch has one), unless it is
    exactly 1 for both counts: the global count covers every microbatch and data-parallel rank,
    so it is never smaller, and a smaller one scales the loss up without a word (3 for 32 valid
    tokens: a loss about 10x too large). 1 for both is the placeholder of NeMo-RL's split API
    (its Megatron worker passes 1 for both and rescales the summed fragments by the true counts at
    the end), so it passes, with one :class:`InputWarning` per process where the microbatch's own
    counts exceed it (a caller other than the split API gets a loss that many times too large).
    ``token_mask`` must hold 0 and 1 only (a 2 counts a token twice; weight samples with
    ``sample_mask``). The counts, the microbatch's own (summed over the ranks that split its
    tokens) and the mask's non-0/1 entries ride on the one host transfer of the metrics, so
    there is no extra sync, whether the counts are Python numbers or device tensors, and the
    error comes at the end of the call. What stays undetected: a global count at least the
    microbatch's own but smaller than the true global batch's (e.g. one data-parallel rank's
    count passed as the global one); only the caller knows the global batch (docs/troubleshooting.md).
    """
    metrics.add("_global_valid_toks", counts.tokens)
    metrics.add("_global_valid_seqs", counts.sequences)
    metrics.add("_local_valid_toks", masks.valid_total)
    metrics.add("_local_valid_seqs", masks.sample_total)
    _count_token_mask_entries(metrics, masks.token_mask, masks.valid.dtype)


_VALID_TOKENS = "valid tokens (token_mask * sample_mask)"


def judge_inputs(found: Diagnostics) -> None:
    """Raise the first input error, then warn of suspicious inputs, from the transferred values.

    ``found``: the metric set's diagnostics after its one host transfer (``MetricSet.diagnostics``),
    reduced over the ranks that split the sequences, so every rank of a group decides alike.
    Each check runs where its counts were declared (:func:`count_global_counts`,
    :func:`count_positive_logprobs`): the token mask, then the two counts, then one warning per
    log-prob input that is positive somewhere.
    """
    if found.token_mask_min is not None and found.token_mask_max is not None:
        if found.token_mask_min < 0 or found.token_mask_max > 1:
            raise _integer_mask_error(found.token_mask_min, found.token_mask_max)
    if found.token_mask_other:  # a count of entries other than 0 and 1
        raise _float_mask_error(found.token_mask_other, found.token_mask_other_min, found.token_mask_other_max)
    placeholder = found.global_valid_toks == SPLIT_API_PLACEHOLDER and found.global_valid_seqs == SPLIT_API_PLACEHOLDER
    for name, count, own, unit in (
        ("global_valid_toks", found.global_valid_toks, found.local_valid_toks, _VALID_TOKENS),
        ("global_valid_seqs", found.global_valid_seqs, found.local_valid_seqs, "valid sequences (sample_mask)"),
    ):
        if count is not None and own is not None and _count_failed(count, own, placeholder):
            raise _count_error(name, count, own, unit)
    toks, seqs = found.local_valid_toks, found.local_valid_seqs
    # The split API's placeholder where the microbatch's own counts exceed it (any other caller: a wrong count).
    if placeholder and toks is not None and seqs is not None and max(toks, seqs) > SPLIT_API_PLACEHOLDER:
        _warn_placeholder_once(toks, seqs)
    for key, count in found.positive_logprobs.items():
        if count > 0:
            # stacklevel: judge_inputs, CorrectedPGLoss.compute, its caller
            warnings.warn(_positive_input_message(key), InputWarning, stacklevel=3)


def _count_failed(count: float, own: float, placeholder: bool) -> bool:
    """A global count that is not finite, negative, or below the microbatch's own (1 and 1: the split API's)."""
    below_own = own > 0 and count < own * (1 - _COUNT_SLACK) and not placeholder
    return not math.isfinite(count) or count < 0 or below_own


#: The once-per-process warnings this process has given (NeMo-RL unpickles a new loss every step,
#: and Python's own once-per-place filter is reset by any ``catch_warnings``).
_SAID_ONCE: set = set()


def _warn_once(key: str, message: str, stacklevel: int) -> bool:
    """``message`` as an :class:`InputWarning` the first time ``key`` is warned of in this process."""
    if key in _SAID_ONCE:
        return False
    _SAID_ONCE.add(key)
    warnings.warn(message, InputWarning, stacklevel=stacklevel + 1)
    return True


def _warn_placeholder_once(toks: float, seqs: float) -> None:
    # stacklevel: _warn_placeholder_once, judge_inputs, CorrectedPGLoss.compute, its caller
    _warn_once(
        "split-api-placeholder",
        f"global_valid_seqs and global_valid_toks: got 1 and 1 while this microbatch has {seqs:g} valid sequences "
        f"and {toks:g} valid tokens: taken as the placeholder of NeMo-RL's split API (begin_train_step/"
        "finish_train_step), whose caller rescales the summed loss and metrics by the true counts. Any other "
        f"caller gets a loss, gradient and mean metrics (is_weight_mean) {toks:g}x (token-level loss) or "
        f"{seqs:g}x (sequence-level) too large: pass the counts of the whole global batch. Said once per process "
        "(docs/troubleshooting.md#input-errors)",
        stacklevel=4,
    )


def _count_error(name: str, count: float, own: float, unit: str) -> ValueError:
    return ValueError(
        f"{name}: got {count:g} while this microbatch has {own:g} {unit}; expected the count of {unit} over "
        "the whole global batch (all microbatches and data-parallel ranks): a finite number, at least "
        "the microbatch's own (0 only for a fully masked global batch; 1 for both counts as the split "
        "API's placeholder)"
    )


def _count_token_mask_entries(metrics: MetricSet, token_mask: torch.Tensor, dtype: torch.dtype) -> None:
    """``token_mask`` entries other than 0 and 1: found on the device, refused on the host (:func:`judge_inputs`).

    A bool mask holds nothing else. An integer mask holds 0 and 1 only when its smallest entry
    is at least 0 and its largest at most 1: one ``amin`` and one ``amax``, no ``[B, T]`` temporary. A float
    mask may also hold fractions in between, so its other entries are counted elementwise.
    """
    if token_mask.dtype == torch.bool or not token_mask.numel():
        return
    if not token_mask.is_floating_point():
        # amin and amax, not aminmax: aminmax of the whole view NeMo-RL passes (token_mask[:, 1:],
        # not contiguous) first copies it, a [B, T] int64 temporary; these read it where it is.
        # Integers: MetricSet.stack promotes them.
        metrics.add("_token_mask_min", token_mask.amin())
        metrics.add("_token_mask_max", token_mask.amax())
        return
    mask = token_mask if token_mask.dtype == dtype else token_mask.to(dtype)
    other = (mask != 0) & (mask != 1)
    metrics.add("_token_mask_other", other.sum())
    # the smallest and largest of those entries, for the message
    metrics.add("_token_mask_other_min", torch.where(other, mask, math.inf).amin())
    metrics.add("_token_mask_other_max", torch.where(other, mask, -math.inf).amax())


def _integer_mask_error(lo: float, hi: float) -> ValueError:
    extremes = [f"smallest entry {lo:g}"] * (lo < 0) + [f"largest entry {hi:g}"] * (hi > 1)
    return _token_mask_error(f"got entries other than 0 and 1 ({', '.join(extremes)})")


def _float_mask_error(count: float, lo: Optional[float], hi: Optional[float]) -> ValueError:
    n = int(count)
    values = _not_0_or_1(lo) if lo == hi else f"from {_not_0_or_1(lo)} to {_not_0_or_1(hi)}"
    return _token_mask_error(f"got {n} {'entry' if n == 1 else 'entries'} other than 0 and 1 ({values})")


def _not_0_or_1(value: Optional[float]) -> str:
    """``value`` with the digits that tell it from 0 and 1 (``:g`` shows 0.99999988 as ``1``)."""
    if value is None:  # declared with the count: never None beside a non-zero count
        return "?"
    for digits in range(6, 18):
        shown = f"{value:.{digits}g}"
        if float(shown) not in (0.0, 1.0):
            return shown
    return repr(value)


def _token_mask_error(found: str) -> ValueError:
    return ValueError(
        f"token_mask: {found}; allowed: 0 and 1 only (1: a response token the loss trains on); another value "
        "scales that token's loss but counts it as one token: weight whole sequences with sample_mask"
    )


#: The warning of a call whose logits held a NaN or +inf (given once per process: :func:`_warn_once`).
NONFINITE_LOGITS_MESSAGE = (
    "logits: NaN or +inf (or only -inf) at some positions; those positions get no gradient and count as non-finite "
    f"current log-probs where they are valid tokens ({NONFINITE_LOGIT_ROWS} counts every such position; "
    "docs/guide.md#non-finite-inputs): a numerical problem in the model's forward pass (bf16/fp16 overflow, "
    "a NaN weight or activation)"
)


def warn_nonfinite_logits(reported: Mapping[str, float], found: Diagnostics) -> bool:
    """An :class:`InputWarning`, once per process, when the logits input held a NaN or +inf.

    ``reported``/``found``: the metric set's metrics and diagnostics after its one transfer, where
    :func:`~nemo_rs_plugin.core.batch.sanitizing.nonfinite_logit_metric` declared the count (the count
    goes on in the metric every call). No extra sync. Returns whether it warned.
    """
    count = reported.get(NONFINITE_LOGIT_ROWS, found.nonfinite_logit_rows or 0.0)
    # stacklevel: warn_nonfinite_logits, CorrectedPGLoss.compute, its caller
    return count > 0 and _warn_once("nonfinite-logits", NONFINITE_LOGITS_MESSAGE, stacklevel=3)
