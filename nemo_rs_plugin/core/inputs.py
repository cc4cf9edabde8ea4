"""The loss's inputs: ``LossInputs`` from NeMo-RL's data dict, their checks, sanitising, global counts.

Everything here runs before the loss math: slicing NeMo-RL's ``[B, S]`` data dict to the
next-token positions and checking shapes and dtypes (:class:`LossInputs`); replacing
non-finite entries by 0 and building the token masks (:func:`sanitize_inputs`); the global
counts (:func:`global_counts`). The checks decided on the host, with the one transfer of the
metrics, are in :mod:`nemo_rs_plugin.core.input_checks`. See: docs/guide.md#non-finite-inputs
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, NamedTuple, Optional, Sequence, Union, overload

import torch
import torch.nn.functional as F

from nemo_rs_plugin.core.masking import TokenMasks, nonfinite, sanitize
from nemo_rs_plugin.core.metrics import GlobalCounts, MetricSet

__all__ = [
    "KLInputs",
    "LossInputs",
    "SanitizedInputs",
    "global_counts",
    "nonfinite_metrics",
    "sanitize_inputs",
    "stack_padded",
]


#: Where each checked input is not finite: ``None`` (all finite), a ``[K, B, T]`` 0/1 tensor (the
#: batched form) or a list of ``K`` ``[B, T]`` ones (the CPU form).
NonFinite = Union[None, torch.Tensor, list[torch.Tensor]]


@dataclass
class LossInputs:
    """Aligned per-token inputs of one microbatch (position t predicts token t + 1).

    All ``[B, T]`` tensors share one shape; ``sample_mask`` and ``rewards`` are ``[B]``.
    Under context parallelism each holds the local shard of every sequence.
    """

    curr: torch.Tensor
    prev: Optional[torch.Tensor]
    generation: torch.Tensor
    reference: Optional[torch.Tensor]
    advantages: torch.Tensor
    token_mask: torch.Tensor
    sample_mask: torch.Tensor
    rewards: Optional[torch.Tensor] = None
    curr_unfiltered: Optional[torch.Tensor] = None

    @classmethod
    def from_nemo_rl(
        cls,
        next_token_logprobs: torch.Tensor,
        data: Mapping[str, Any],
        need_prev: bool,
        need_reference: bool,
    ) -> "LossInputs":
        """Slice NeMo-RL's ``[B, S]`` data dict to the ``[B, S-1]`` next-token positions.

        Every per-token field must be ``[B, S]``, like NeMo-RL's: a ``[B]`` ``advantages`` is
        an error, as in NeMo-RL's ``ClippedPGLossFn`` (which slices ``[:, 1:]`` too), not
        broadcast.
        """
        if not (hasattr(data, "keys") and hasattr(data, "__getitem__")):
            raise TypeError(
                f"data: got {type(data).__name__}; expected NeMo-RL's data dict (a mapping of [B, S] tensors: "
                "advantages, prev_logprobs, generation_logprobs, token_mask, sample_mask, ...)"
            )
        lp_shape = tuple(getattr(next_token_logprobs, "shape", ()))
        want = f"({lp_shape[0]}, {lp_shape[1] + 1})" if len(lp_shape) == 2 else "[B, S]"

        def col(key: str) -> torch.Tensor:
            t = _required(data, key)
            if t.dim() != 2:
                hint = ""
                if key == "advantages" and t.dim() == 1:
                    hint = (
                        "; one advantage per token, as NeMo-RL's GRPO stores them: broadcast a "
                        "per-sequence advantage with advantages.unsqueeze(-1).expand(-1, S)"
                    )
                raise ValueError(
                    f"data[{key!r}]: got shape {tuple(t.shape)}; expected [B, S] = {want}, "
                    f"position 0 dropped to align with next_token_logprobs {lp_shape}{hint}"
                )
            return t[:, 1:]

        unfiltered = data.get("curr_logprobs_unfiltered") if need_reference else None
        return cls(
            curr=next_token_logprobs,
            prev=col("prev_logprobs") if need_prev else None,
            generation=col("generation_logprobs"),
            reference=col("reference_policy_logprobs") if need_reference else None,
            advantages=col("advantages"),
            token_mask=col("token_mask"),
            sample_mask=_required(data, "sample_mask"),
            rewards=data.get("rewards"),
            curr_unfiltered=unfiltered,
        )

    @classmethod
    def stack_rows(cls, parts: Sequence["LossInputs"]) -> "LossInputs":
        """One microbatch from the inputs of its sequences (NeMo-RL's per-sequence packing calls).

        Part ``i`` holds ``[b_i, T_i]`` per-token fields; the result ``[sum b_i, max T_i]``, each
        part's fields zero-padded on the right, so a padding position has ``token_mask`` 0 and
        reads as no token: every per-sequence statistic (a masked sum over a row) and every
        token term is the parts' own. ``sample_mask`` and ``rewards`` are concatenated. Padding
        and concatenation are differentiable: ``curr``'s gradient reaches each part's tensor.

        Raises:
            ValueError: no part, or an optional field (``prev``, ``reference``, ``rewards``,
                ``curr_unfiltered``) present in some parts only.
        """
        if not parts:
            raise ValueError("LossInputs.stack_rows: no part to stack")
        width = max(part.token_mask.shape[-1] for part in parts)

        def rows(name: str, per_token: bool) -> Optional[torch.Tensor]:
            values = [getattr(part, name) for part in parts]
            if all(v is None for v in values):
                return None
            if any(v is None for v in values):
                raise ValueError(f"LossInputs.stack_rows: {name} is given for some parts only")
            return stack_padded(values, [width] * len(values) if per_token else None)

        def required(name: str, per_token: bool = True) -> torch.Tensor:
            value = rows(name, per_token)
            assert value is not None  # a required field of every part
            return value

        return cls(
            curr=required("curr"),
            prev=rows("prev", True),
            generation=required("generation"),
            reference=rows("reference", True),
            advantages=required("advantages"),
            token_mask=required("token_mask"),
            sample_mask=required("sample_mask", per_token=False),
            rewards=rows("rewards", False),
            curr_unfiltered=rows("curr_unfiltered", True),
        )

    def compute_dtype(self) -> torch.dtype:
        """float32, or float64 when any float input is float64: the dtype the loss runs in.

        bf16 and fp16 cannot hold the sensitive steps: an fp16 ``exp`` overflows from a
        log-ratio of 11.1 (the +-20 clamp allows exp(20) = 4.9e8), and a bf16 count of
        global tokens rounds to 8 significant bits.
        """
        inputs = (
            self.curr,
            self.prev,
            self.generation,
            self.reference,
            self.advantages,
            self.token_mask,
            self.curr_unfiltered,
        )
        # Python-side dtype logic: torch.promote_types would dispatch an operator per input.
        wide = any(t is not None and t.dtype == torch.float64 for t in inputs)
        return torch.float64 if wide else torch.float32

    def to_dtype(self, dtype: torch.dtype) -> "LossInputs":
        """Float tensors cast to ``dtype`` (differentiably; a no-op for those already in it).

        Integer and boolean masks stay as they are; ``rewards`` is only compared with 0.
        """
        return LossInputs(
            curr=_cast(self.curr, dtype),
            prev=_cast(self.prev, dtype),
            generation=_cast(self.generation, dtype),
            reference=_cast(self.reference, dtype),
            advantages=_cast(self.advantages, dtype),
            token_mask=_cast(self.token_mask, dtype),
            sample_mask=_cast(self.sample_mask, dtype),
            rewards=self.rewards,
            curr_unfiltered=_cast(self.curr_unfiltered, dtype),
        )

    def validate(self) -> None:
        """Raise a clear error on shape or dtype mismatches (mixed float dtypes are fine)."""
        for name, required in (("next_token_logprobs", self.curr), ("sample_mask", self.sample_mask)):
            if not isinstance(required, torch.Tensor):
                raise TypeError(f"{name}: got {type(required).__name__}; expected a torch.Tensor")
        if self.curr.dim() != 2:
            raise ValueError(f"next_token_logprobs: expected [B, T], got shape {tuple(self.curr.shape)}")
        if not self.curr.is_floating_point():
            raise TypeError(f"next_token_logprobs: expected a float tensor, got {self.curr.dtype}")
        shape = self.curr.shape
        named: dict[str, Optional[torch.Tensor]] = {
            "prev_logprobs": self.prev,
            "generation_logprobs": self.generation,
            "reference_policy_logprobs": self.reference,
            "advantages": self.advantages,
            "token_mask": self.token_mask,
            "curr_logprobs_unfiltered": self.curr_unfiltered,
        }
        for name, t in named.items():
            if t is None:
                continue
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name}: got {type(t).__name__}; expected a torch.Tensor")
            if t.shape != shape:
                sliced = "" if name == "curr_logprobs_unfiltered" else " (after dropping position 0)"
                hint = ""
                if sliced and t.dim() == 2 and t.shape[0] == shape[0] and t.shape[1] + 1 == shape[1]:
                    hint = "; next_token_logprobs is [B, S - 1]: the log-probs of tokens 1..S-1 (drop position 0)"
                raise ValueError(
                    f"{name}: shape {tuple(t.shape)}{sliced} does not match next_token_logprobs {tuple(shape)}{hint}"
                )
            if name != "token_mask" and not t.is_floating_point():
                raise TypeError(f"{name}: expected a float tensor, got {t.dtype}")
        # rewards left out: read only by the NLL term, and a host may keep them elsewhere otherwise
        for name, given in (*named.items(), ("sample_mask", self.sample_mask)):
            if isinstance(given, torch.Tensor) and given.device != self.curr.device:  # else torch's error names none
                raise ValueError(
                    f"{name}: on {given.device}, next_token_logprobs on {self.curr.device}; move the data dict to the "
                    "log-probs' device (data.to(device))"
                )
        if self.sample_mask.shape != shape[:1]:
            raise ValueError(f"sample_mask: shape {tuple(self.sample_mask.shape)} does not match batch size {shape[0]}")
        if self.rewards is not None and self.rewards.shape[:1] != shape[:1]:
            raise ValueError(f"rewards: shape {tuple(self.rewards.shape)} does not match batch size {shape[0]}")


def stack_padded(rows: Sequence[torch.Tensor], widths: Optional[Sequence[int]] = None) -> torch.Tensor:
    """``rows`` concatenated along dim 0, row ``i`` first zero-padded on the right to ``widths[i]``.

    The one rule for stacking a packed microbatch's sequences into rows (padding reads as
    masked: 0). ``widths=None``: concatenated as they are (``[b_i]`` per-sequence fields). A
    single row that needs no padding is returned as it is; both steps are differentiable.
    """
    if widths is not None:
        rows = [r if r.shape[-1] == w else F.pad(r, (0, w - r.shape[-1])) for r, w in zip(rows, widths)]
    return rows[0] if len(rows) == 1 else torch.cat(list(rows), 0)


@overload
def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor: ...


@overload
def _cast(t: Optional[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]: ...


def _cast(t: Optional[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
    """A float tensor in ``dtype`` (differentiably); integer and boolean masks, and ``None``, as they are."""
    if t is None or not t.is_floating_point() or t.dtype == dtype:
        return t
    return t.to(dtype)


def _required(data: Mapping[str, Any], key: str) -> torch.Tensor:
    if key not in data:
        raise KeyError(f"data[{key!r}] is missing; the rs_clipped_pg loss needs it")
    t = data[key]
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"data[{key!r}]: got {type(t).__name__}; expected a torch.Tensor")
    return t


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
    x: LossInputs, force_on_policy: bool, with_reference: bool, batched: bool, host_reads: bool = False
) -> SanitizedInputs:
    """One pass over every input: sanitised copies, non-finite masks, the token masks.

    The detached inputs are stacked, so replacing and detecting non-finite entries costs two
    kernels whatever their number; ``curr`` is sanitised on its own (it carries the gradient).
    With ``host_reads`` (eager CPU) and every input finite, read on the host from one sum per
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
    checked = tuple(rows) if batched else tuple(name for name in rows if name not in ("prev", "gen"))
    # host_reads: where every input reads finite they are used as given (no copy, no mask).
    as_given = host_reads and _finite_on_host([rows[name] for name in checked])
    clean_of = _as_given if as_given else sanitize
    curr = clean_of(x.curr)
    if as_given:
        form = _used_as_given(rows, x, curr.dtype)
    elif batched:
        form = _sanitized_stacked(rows, x, n_logprob)
    else:
        form = _sanitized_per_input(rows, x, n_logprob, checked)
    kl = None
    if with_reference:
        unfiltered = clean_of(x.curr_unfiltered) if x.curr_unfiltered is not None else curr
        kl = KLInputs(reference=form.clean["reference"], curr_unfiltered=unfiltered)
    return SanitizedInputs(
        curr=curr,
        prev=curr.detach() if force_on_policy else form.clean["prev"],
        prev_raw=prev_raw,
        gen=form.clean["gen"],
        kl=kl,
        advantages=form.clean["advantages"],
        d=form.clean["d"],
        masks=form.masks,
        nonfinite=form.nonfinite,
        input_names=checked,
        stacked=form.stacked,
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
    stacked = torch.stack([t.detach() for t in rows.values()])  # [K, B, T]
    sanitized = sanitize(stacked)
    bad = nonfinite(stacked)  # [K, B, T] 0/1
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
    """The token masks from where ``d`` and where any log-prob input is not finite (``any_bad``, consumed)."""
    d_finite = 1.0 - d_bad
    inputs_finite = any_bad.neg_().add_(1.0)  # 1 - any_bad, in place: any_bad is a fresh tensor
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
            metrics.add_zero(_NONFINITE_COUNTS["curr"], "none")
        else:
            either = torch.maximum(nonfinite[0], nonfinite[inputs.index("curr_unfiltered")])
            metrics.add_masked_total(_NONFINITE_COUNTS["curr"], either, masks.valid_bin, "none", "sum")
    if nonfinite is None:
        for name in names:
            metrics.add_zero(name, "none")
    else:
        metrics.add_masked_totals(names, nonfinite, masks.valid_bin, "none", "sum")
    if "reference" not in inputs:
        metrics.add_zero(_NONFINITE_COUNTS["reference"], "none")


def _global_count(name: str, value: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A global count as a 0-dim ``dtype`` tensor on ``device``; a clear error if it is none."""
    try:
        count = torch.as_tensor(value, dtype=dtype, device=device)
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(
            f"{name}: got {type(value).__name__} {value!r}; expected a number or a 0-dim tensor "
            "(the global count NeMo-RL passes)"
        ) from None
    if count.numel() != 1:
        raise ValueError(
            f"{name}: got a tensor of shape {tuple(count.shape)}; expected one count (a number or a 0-dim tensor)"
        )
    return count.reshape(())


def global_counts(
    global_valid_seqs: Any, global_valid_toks: Any, dtype: torch.dtype, device: torch.device
) -> GlobalCounts:
    """NeMo-RL's two global counts as 0-dim ``dtype`` tensors on ``device`` (see :func:`check_global_counts`)."""
    return GlobalCounts(
        tokens=_global_count("global_valid_toks", global_valid_toks, dtype, device),
        sequences=_global_count("global_valid_seqs", global_valid_seqs, dtype, device),
    )
