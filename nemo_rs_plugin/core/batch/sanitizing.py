"""Sanitising the loss's inputs: non-finite entries replaced by 0, the token masks, their counts.

:func:`sanitize_inputs` returns :class:`SanitizedInputs`: the log-probs and advantages with
every non-finite entry replaced by 0 (so that no NaN reaches a masked sum or a gradient), the
log-ratio ``d = prev - gen``, and the :class:`~nemo_rs_plugin.core.masking.TokenMasks` that
leave those tokens out. Three forms, by where the work is cheapest: used as given (eager CPU,
every input read finite on the host), stacked (accelerators: one kernel per step for all
inputs), one input at a time (the CPU form with a non-finite entry). :func:`nonfinite_metrics`
declares the counts of the tokens left out. See: docs/guide.md#non-finite-inputs
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, NamedTuple, Optional, Union

import torch

from nemo_rs_plugin.core.batch.inputs import LossInputs
from nemo_rs_plugin.core.evaluation import ROW_BY_ROW, EvaluationForm
from nemo_rs_plugin.core.masking import TokenMasks, nonfinite, sanitize, sanitize_
from nemo_rs_plugin.core.reporting.metric_catalog import NONFINITE_LOGIT_ROWS
from nemo_rs_plugin.core.reporting.metrics import MetricSet

__all__ = [
    "KLInputs",
    "NonFinite",
    "SanitizedInputs",
    "nonfinite_logit_metric",
    "nonfinite_metrics",
    "sanitize_inputs",
]

#: Where each checked input is not finite: ``None`` (all finite), a ``[K, B, T]`` 0/1 tensor (the
#: batched form) or a list of ``K`` ``[B, T]`` ones (the CPU form).
NonFinite = Union[None, torch.Tensor, list[torch.Tensor]]


class KLInputs(NamedTuple):
    """The KL penalty's inputs, sanitised: present together, exactly when the KL term is on."""

    reference: torch.Tensor  # [B, T] the reference policy's log-probs
    curr_unfiltered: torch.Tensor  # [B, T] the KL's curr (curr unless the caller passed one)


@dataclass
class SanitizedInputs:
    """The inputs with NaN and +-inf replaced by 0, and where they were not finite.

    Non-finite log-probs are replaced by 0 *before* any arithmetic, so that a token that is
    masked or rejected receives an exact zero gradient, never 0 * NaN.
    """

    curr: torch.Tensor  # [B, T] differentiable
    prev: torch.Tensor  # [B, T] detached (curr's value under a forced on-policy ratio)
    prev_raw: torch.Tensor  # [B, T] as given
    gen: torch.Tensor
    kl: Optional[KLInputs]  # the KL penalty's two inputs (None without the KL term)
    advantages: torch.Tensor
    d: torch.Tensor  # [B, T] prev - gen, 0 where not finite
    masks: TokenMasks
    nonfinite: (
        NonFinite  # [K, B, T] (or K [B, T]) 0/1 non-finite entries of each input (None: all finite), rows named by
    )
    input_names: tuple  # the K input names (keys of _NONFINITE_COUNTS)
    stacked: Optional[torch.Tensor] = None  # [K, B, T] the sanitised inputs, rows input_names (GPU form only)

    @property
    def reference(self) -> Optional[torch.Tensor]:
        """The sanitised reference log-probs (``None`` without the KL term)."""
        return self.kl.reference if self.kl is not None else None


def sanitize_inputs(
    x: LossInputs, force_on_policy: bool, with_reference: bool, form: EvaluationForm = ROW_BY_ROW
) -> SanitizedInputs:
    """One pass over every input: sanitised copies, non-finite masks, the token masks.

    The detached inputs are stacked, so replacing and detecting non-finite entries costs two
    kernels whatever their number; ``curr`` is sanitised on its own (it carries the gradient).
    In the batched ``form`` the inputs are cleaned through one ``[K, B, T]`` stack, else one by one.
    With ``form.host_reads`` (eager CPU) and every input finite, read on the host from one sum per
    input, nothing is copied or masked: the inputs are used as given and ``nonfinite`` is
    ``None`` (every count 0). The values are the same either way.
    """
    prev_raw = x.curr.detach() if force_on_policy else _present(x.prev, "prev_logprobs", "force_on_policy_ratio is off")
    # The first rows are the log-prob inputs a token's loss reads (any non-finite one makes
    # the token unusable); the others are sanitised and counted only. Each row's name is the
    # metric counting its non-finite valid tokens (hidden when another metric covers it).
    rows = {"curr": x.curr, "d": prev_raw - x.generation}
    if with_reference:
        rows["reference"] = _present(x.reference, "reference_policy_logprobs", "the KL penalty is on")
        if x.curr_unfiltered is not None:
            rows["curr_unfiltered"] = x.curr_unfiltered
    n_logprob = len(rows)
    rows.update(prev=prev_raw, gen=x.generation, advantages=x.advantages)
    checked = tuple(rows) if form.batched else tuple(name for name in rows if name not in ("prev", "gen"))
    # host_reads: where every input reads finite they are used as given (no copy, no mask).
    as_given = form.host_reads and _finite_on_host([rows[name] for name in checked])
    clean_of = _as_given if as_given else sanitize
    curr = clean_of(x.curr)
    if as_given:
        cleaned = _used_as_given(rows, x, curr.dtype)
    elif form.batched:
        cleaned = _sanitized_stacked(rows, x, n_logprob)
    else:
        cleaned = _sanitized_per_input(rows, x, n_logprob, checked)
    kl = None
    if with_reference:
        unfiltered = clean_of(x.curr_unfiltered) if x.curr_unfiltered is not None else curr
        kl = KLInputs(reference=cleaned.clean["reference"], curr_unfiltered=unfiltered)
    return SanitizedInputs(
        curr=curr,
        prev=curr.detach() if force_on_policy else cleaned.clean["prev"],
        prev_raw=prev_raw,
        gen=cleaned.clean["gen"],
        kl=kl,
        advantages=cleaned.clean["advantages"],
        d=cleaned.clean["d"],
        masks=cleaned.masks,
        nonfinite=cleaned.nonfinite,
        input_names=checked,
        stacked=cleaned.stacked,
    )


class _CleanForm(NamedTuple):
    """What one form of :func:`sanitize_inputs` gives: the rows cleaned, their non-finite masks, the token masks."""

    clean: dict[str, torch.Tensor]  # every row, detached (sanitised unless used as given)
    nonfinite: NonFinite  # None (every count 0), a [K, B, T] 0/1 tensor or a list of [B, T] ones
    masks: TokenMasks
    stacked: Optional[torch.Tensor]  # the [K, B, T] sanitised stack of the batched form


def _used_as_given(rows: dict[str, torch.Tensor], x: LossInputs, dtype: torch.dtype) -> _CleanForm:
    """Every input read finite on the host (eager CPU): no copy, no mask, every count 0."""
    clean = {name: t.detach() for name, t in rows.items()}
    return _CleanForm(clean, None, TokenMasks.build_all_finite(x.token_mask, x.sample_mask, dtype), None)


def _sanitized_stacked(rows: dict[str, torch.Tensor], x: LossInputs, n_logprob: int) -> _CleanForm:
    """The GPU form (``batched_evaluation``): two kernels for all inputs, through one ``[K, B, T]`` stack."""
    stacked = torch.stack([t.detach() for t in rows.values()])  # [K, B, T], the call's own copy
    bad = nonfinite(stacked)  # [K, B, T] 0/1
    sanitized = sanitize_(stacked)  # in place: no second [K, B, T] beside the first (peak memory)
    any_bad = bad[:n_logprob].amax(0)
    return _CleanForm(dict(zip(rows, sanitized)), bad, _masks(x, bad[1], any_bad), sanitized)


def _sanitized_per_input(
    rows: dict[str, torch.Tensor], x: LossInputs, n_logprob: int, checked: tuple[str, ...]
) -> _CleanForm:
    """The CPU form: per input, no copy into a stack, and only what is read.

    ``curr`` and ``curr_unfiltered`` are sanitised on their own (they carry the gradient); ``prev``
    and ``gen`` reach the loss, and its checks, through ``d``.
    """
    clean = {n: sanitize(t.detach()) for n, t in rows.items() if n not in ("curr", "curr_unfiltered")}
    bad = [nonfinite(rows[name]) for name in checked]
    any_bad = torch.maximum(bad[0], bad[1])  # curr and d come first: n_logprob >= 2
    for row in bad[2:n_logprob]:
        any_bad = torch.maximum(any_bad, row, out=any_bad)  # no new [B, T] per input
    return _CleanForm(clean, bad, _masks(x, bad[1], any_bad), None)


def _masks(x: LossInputs, d_bad: torch.Tensor, any_bad: torch.Tensor) -> TokenMasks:
    """The token masks from where ``d`` and where any log-prob input is not finite (``any_bad``)."""
    d_finite = 1.0 - d_bad
    # 1 - any_bad in one operator (rsub has no in-place form: a [B, T] beside any_bad here, early
    # in the call, below its peak; neg_().add_(1.0) would be two operators)
    inputs_finite = torch.rsub(any_bad, 1.0)
    return TokenMasks.build(x.token_mask, x.sample_mask, d_finite, inputs_finite)


def _present(t: Optional[torch.Tensor], key: str, because: str) -> torch.Tensor:
    """``t``, an input the configuration reads; a clear error when the caller left it out."""
    if t is None:
        raise KeyError(f"data[{key!r}] is missing; the rs_clipped_pg loss reads it ({because})")
    return t


def _finite_on_host(rows: list[torch.Tensor]) -> bool:
    """Whether every entry of ``rows`` is finite, read on the host (one sum per row, no ``[B, T]`` temporary).

    A sum is finite only if every summand is: NaN and +-inf propagate through it. A finite
    row whose sum overflows reads as not finite and takes the general path, exact for it too.
    ``d = prev - gen`` finite implies ``prev`` and ``gen`` finite, so they are not read.
    """
    totals = torch.stack([row.detach().sum() for row in rows])
    return bool(torch.isfinite(totals).all())


def _as_given(x: torch.Tensor) -> torch.Tensor:
    """A differentiable input known to be finite: :func:`sanitize` would copy it unchanged."""
    return x


# Input row of sanitize_inputs -> the metric counting its non-finite valid tokens ("_": hidden,
# covered by another count: prev and gen through the log-ratio).
_NONFINITE_COUNTS = {
    "curr": "nonfinite_curr_logprobs_count",
    "d": "nonfinite_log_ratio_count",
    "reference": "nonfinite_reference_logprobs_count",
    "curr_unfiltered": "_nonfinite_curr_unfiltered_count",
    "prev": "_nonfinite_prev_logprobs_count",
    "gen": "_nonfinite_generation_logprobs_count",
    "advantages": "nonfinite_advantages_count",
}


def nonfinite_metrics(metrics: MetricSet, masks: TokenMasks, nonfinite: NonFinite, inputs: tuple) -> None:
    """Valid tokens with a non-finite input, one count per input kind (summed over CP ranks).

    In the GPU form all counts are one matrix-vector product of the stacked non-finite masks
    (in the CPU form one dot product each, right away). With a separate
    unfiltered ``curr`` (for the KL), ``nonfinite_curr_logprobs_count`` counts tokens where
    either is non-finite. ``nonfinite`` is ``None`` when every input was read finite on the
    host (:func:`sanitize_inputs`): the same metrics, each 0. See: docs/guide.md#non-finite-inputs
    """
    names = [_NONFINITE_COUNTS[row] for row in inputs]
    if "curr_unfiltered" in inputs:
        names[0] = "_nonfinite_curr_filtered_count"
        if nonfinite is None:
            metrics.add_zero(_NONFINITE_COUNTS["curr"])
        else:
            either = torch.maximum(nonfinite[0], nonfinite[inputs.index("curr_unfiltered")])
            metrics.add_masked_total(_NONFINITE_COUNTS["curr"], either, masks.valid_bin)
    if nonfinite is None:
        for name in names:
            metrics.add_zero(name)
    else:
        metrics.add_masked_totals(names, nonfinite, masks.valid_bin)
    if "reference" not in inputs:
        metrics.add_zero(_NONFINITE_COUNTS["reference"])


def nonfinite_logit_metric(metrics: MetricSet, rows: Optional[torch.Tensor], catalog: Mapping[str, object]) -> None:
    """Declare the positions whose logits held a NaN or +inf (``rows``: ``[B]`` per-sequence counts, or ``None``).

    Only the logits input path counts them (``LossInputs.nonfinite_logit_rows``); summed over the
    ranks that split a sequence. Returned as :data:`~nemo_rs_plugin.core.reporting.metric_catalog.NONFINITE_LOGIT_ROWS`
    where the configuration says ``sharded_logits_input`` (the catalog has it), else kept as an
    internal value: :func:`~nemo_rs_plugin.core.batch.input_checks.warn_nonfinite_logits` reads it either way.
    """
    public = NONFINITE_LOGIT_ROWS in catalog
    if rows is None:
        if public:  # log-probs given to a configuration that says logits: nothing to count
            metrics.add_zero(NONFINITE_LOGIT_ROWS)
        return
    metrics.add_total(NONFINITE_LOGIT_ROWS if public else f"_{NONFINITE_LOGIT_ROWS}", rows.sum())
