"""The loss's inputs: ``LossInputs`` from NeMo-RL's data dict, their shape and dtype checks, global counts.

Everything here runs before the loss math: slicing NeMo-RL's ``[B, S]`` data dict to the
next-token positions and checking shapes and dtypes (:class:`LossInputs`); the global counts
(:func:`global_counts`). Replacing non-finite entries by 0 and building the token masks is
:mod:`nemo_rs_plugin.core.batch.sanitizing`; the checks decided on the host, with the one transfer of
the metrics, are in :mod:`nemo_rs_plugin.core.batch.input_checks`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence, overload

import torch
import torch.nn.functional as F

from nemo_rs_plugin.core.reporting.metrics import GlobalCounts

__all__ = ["LossInputs", "compute_dtype", "global_counts", "stack_padded"]


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
    #: ``[B]``: per sequence, the positions whose logits held a NaN or +inf (the logits input path,
    #: :mod:`nemo_rs_plugin.parallel.sharded`, counts every position; ``None`` for log-prob input).
    nonfinite_logit_rows: Optional[torch.Tensor] = None

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
        # One loop, no helper per field: it runs on every call.
        sliced: dict[str, torch.Tensor] = {}
        for key in _per_token_keys(need_prev, need_reference):
            t = data[key] if key in data else None
            if not isinstance(t, torch.Tensor) or t.dim() != 2 or (key == "advantages" and t.shape[1] == 1):
                _check_field(data, key, lp_shape)  # raises the field's error (not a tensor: always)
                assert isinstance(t, torch.Tensor)
            sliced[key] = t[:, 1:]
        sample_mask = data["sample_mask"] if "sample_mask" in data else None
        if not isinstance(sample_mask, torch.Tensor):
            sample_mask = _required(data, "sample_mask")  # raises
        return cls(
            curr=next_token_logprobs,
            prev=sliced.get("prev_logprobs"),
            generation=sliced["generation_logprobs"],
            reference=sliced.get("reference_policy_logprobs"),
            advantages=sliced["advantages"],
            token_mask=sliced["token_mask"],
            sample_mask=sample_mask,
            rewards=data.get("rewards"),
            curr_unfiltered=data.get("curr_logprobs_unfiltered") if need_reference else None,
        )

    @staticmethod
    def dtype_from_nemo_rl(
        next_token_logprobs: torch.Tensor, data: Mapping[str, Any], need_prev: bool, need_reference: bool
    ) -> torch.dtype:
        """``from_nemo_rl(...).compute_dtype()`` without building the inputs: the dtypes of the same fields.

        For the per-sequence packing calls before a microbatch's last, which return a zero in the
        loss's dtype (nemo_rs_plugin.nemo_rl.loss_fn): slicing and checking five fields there cost
        more than the rest of such a call. The last call checks the whole microbatch's fields.
        """
        keys = _per_token_keys(need_prev, need_reference)
        if need_reference:
            keys.append("curr_logprobs_unfiltered")  # read as given by from_nemo_rl, never sliced
        return compute_dtype(next_token_logprobs, *[data.get(k) for k in keys])

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
                ``curr_unfiltered``, ``nonfinite_logit_rows``) present in some parts only.
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
            nonfinite_logit_rows=rows("nonfinite_logit_rows", False),
        )

    def compute_dtype(self) -> torch.dtype:
        """The dtype the loss runs in for these inputs (:func:`compute_dtype`)."""
        return compute_dtype(
            self.curr,
            self.prev,
            self.generation,
            self.reference,
            self.advantages,
            self.token_mask,
            self.curr_unfiltered,
        )

    def to_dtype(self, dtype: torch.dtype) -> "LossInputs":
        """Float tensors cast to ``dtype`` (differentiably; a no-op for those already in it).

        Integer and boolean masks stay as they are; ``rewards`` is only compared with 0. These
        inputs themselves where nothing needs a cast (the common case, on every call).
        """
        for name in _CAST_FIELDS:  # a loop, not any(...): no generator frame per field
            t = getattr(self, name)
            if t is not None and t.dtype != dtype and t.is_floating_point():  # what _cast casts
                break
        else:
            return self
        return dataclasses.replace(self, **{name: _cast(getattr(self, name), dtype) for name in _CAST_FIELDS})

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


#: The fields ``to_dtype`` casts: every one but ``rewards`` (only compared with 0).
_CAST_FIELDS = tuple(f.name for f in dataclasses.fields(LossInputs) if f.name != "rewards")


@overload
def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor: ...


@overload
def _cast(t: Optional[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]: ...


def _cast(t: Optional[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
    """A float tensor in ``dtype`` (differentiably); integer and boolean masks, and ``None``, as they are."""
    if t is None or not t.is_floating_point() or t.dtype == dtype:
        return t
    return t.to(dtype)


def compute_dtype(*inputs: Any) -> torch.dtype:
    """float32, or float64 when any float input is float64: the dtype the loss runs in.

    bf16 and fp16 cannot hold the sensitive steps: an fp16 ``exp`` overflows from a
    log-ratio of 11.1 (the +-20 clamp allows exp(20) = 4.9e8), and a bf16 count of
    global tokens rounds to 8 significant bits. ``None`` and non-tensor inputs are skipped.
    """
    # Python-side dtype logic (torch.promote_types would dispatch an operator per input), a plain
    # loop: it runs in every per-sequence packing call.
    for t in inputs:
        if isinstance(t, torch.Tensor) and t.dtype == torch.float64:
            return torch.float64
    return torch.float32


def _per_token_keys(need_prev: bool, need_reference: bool) -> list[str]:
    """The ``[B, S]`` fields of NeMo-RL's data dict a call slices, in the order their errors are raised."""
    keys = ["prev_logprobs"] if need_prev else []
    keys.append("generation_logprobs")
    if need_reference:
        keys.append("reference_policy_logprobs")
    return keys + ["advantages", "token_mask"]


def _required(data: Mapping[str, Any], key: str) -> torch.Tensor:
    if key not in data:
        raise KeyError(f"data[{key!r}] is missing; the rs_clipped_pg loss needs it")
    t = data[key]
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"data[{key!r}]: got {type(t).__name__}; expected a torch.Tensor")
    return t


def _check_field(data: Mapping[str, Any], key: str, lp_shape: tuple) -> None:
    """Raise the error of a per-token field that is missing, not a tensor, or not ``[B, S]`` (else nothing)."""
    t = _required(data, key)
    want = f"({lp_shape[0]}, {lp_shape[1] + 1})" if len(lp_shape) == 2 else "[B, S]"
    # [B, 1]: one advantage per sequence, which slicing would leave [B, 0]
    per_sequence = key == "advantages" and t.dim() == 2 and t.shape[1] == 1 and lp_shape[1:] != (0,)
    if t.dim() != 2 or per_sequence:
        hint = ""
        if key == "advantages" and t.dim() == 1:
            hint = (
                "; one advantage per token, as NeMo-RL's GRPO stores them: broadcast a "
                "per-sequence advantage with advantages.unsqueeze(-1).expand(-1, S)"
            )
        if per_sequence:
            hint = (
                "; one advantage per token, as NeMo-RL's GRPO stores them: broadcast a "
                "per-sequence advantage with advantages.expand(-1, S)"
            )
        raise ValueError(
            f"data[{key!r}]: got shape {tuple(t.shape)}; expected [B, S] = {want}, "
            f"position 0 dropped to align with next_token_logprobs {lp_shape}{hint}"
        )


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
