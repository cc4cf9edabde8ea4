"""What a loss call on part of a microbatch needs from the whole of it: :class:`MicrobatchTotals`.

NeMo-RL calls the loss once per microbatch, except with sequence packing through
``SequencePackingLossWrapper`` (Megatron without ``sequence_packing.fuse_loss``, the DTensor
worker, automodel), which calls it once per sequence (``B = 1``) and sums the losses and the
metrics. Everything in the loss that reads one sequence at a time, or divides by NeMo-RL's
global counts, sums to the same value over those calls. Three settings read the whole
microbatch instead, and would silently change meaning per sequence:

* ``is_batch_normalization``: weights divided by their mean over the microbatch
  (``data_parallel``: and the other ranks'); per sequence every sequence-level weight
  becomes 1;
* ``rejection_denominator: kept``: the denominators shrink by the microbatch's kept
  fraction; per sequence each sequence's own fraction (0 or 1) is used instead;
* ``positive_example_nll_weight``: the NLL is a mean over the microbatch's tokens of correct
  samples; per sequence each correct sample is averaged alone.

Where the wrapper's position is read (NeMo-RL v0.6.0 to main), the NeMo-RL glue gathers its calls
into one call on the whole microbatch, log-probs or logits as input
(:mod:`nemo_rs_plugin.nemo_rl.packing`), and none of this is needed. Where each call computes its
own sequence (a wrapper whose position cannot be read), the totals are: their inputs
(``prev_logprobs``, ``generation_logprobs``, the masks, the rewards) exist before the forward
pass, so they are computed once from the whole microbatch
(:meth:`CorrectedPGLoss.microbatch_totals <nemo_rs_plugin.core.loss.CorrectedPGLoss.microbatch_totals>`)
and handed to every per-sequence call. Only where a total would need the *current* policy's
log-probs of the other sequences (:func:`current_policy_problems`) is that impossible; the
NeMo-RL glue then refuses the configuration under the per-sequence wrapper.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from nemo_rs_plugin.core.settings.config import RSClippedPGLossConfig

__all__ = ["MicrobatchTotals", "current_policy_problems", "missing_totals", "needs_microbatch_totals"]


class MicrobatchTotals(NamedTuple):
    """Microbatch-level quantities, each a detached 0-dim tensor (``None`` where the config needs none).

    A ``NamedTuple`` (not a dataclass): an argument of the optionally compiled core, which
    torch.compile wraps as a tuple (see ``SequenceGroups``).

    Attributes:
        kept_token_fraction: kept valid tokens / valid tokens (``rejection_denominator: kept``).
        kept_sequence_fraction: kept sequences / valid sequences with a valid token (likewise).
        batch_norm_factor: the mean the IS weights are divided by (``is_batch_normalization``).
        correct_token_count: valid tokens of samples with reward > 0 (the VAPO NLL's denominator).
    """

    kept_token_fraction: Optional[torch.Tensor] = None
    kept_sequence_fraction: Optional[torch.Tensor] = None
    batch_norm_factor: Optional[torch.Tensor] = None
    correct_token_count: Optional[torch.Tensor] = None


def needs_microbatch_totals(cfg: RSClippedPGLossConfig) -> bool:
    """Whether any part of the loss reads a total over the whole microbatch (see the module docstring)."""
    return (
        cfg.is_batch_normalization is not None
        or cfg.denominator_entry.counts_kept
        or cfg.positive_example_nll_weight > 0
    )


def missing_totals(cfg: RSClippedPGLossConfig, totals: MicrobatchTotals) -> list[str]:
    """The fields of ``totals`` that ``cfg`` reads and that are ``None`` (a partial totals tuple is an error)."""
    needed = []
    if cfg.is_batch_normalization is not None:
        needed.append("batch_norm_factor")
    if cfg.denominator_entry.counts_kept:
        needed += ["kept_token_fraction", "kept_sequence_fraction"]
    if cfg.positive_example_nll_weight > 0:
        needed.append("correct_token_count")
    return [name for name in needed if getattr(totals, name) is None]


def current_policy_problems(cfg: RSClippedPGLossConfig) -> list[str]:
    """Microbatch totals of ``cfg`` that need the current policy's log-probs of every sequence.

    Those exist only in the call that computes them, one sequence at a time under NeMo-RL's
    per-sequence packing wrapper. One line per field, naming it and why.
    """
    problems = []
    if cfg.is_batch_normalization is not None and cfg.force_on_policy_ratio:
        problems.append(
            f"is_batch_normalization: {cfg.is_batch_normalization!r} with force_on_policy_ratio: true normalises "
            "weights built from the current policy's log-probs"
        )
    if cfg.denominator_entry.counts_kept:
        on_current = [f.label for f in cfg.rejection_sampling if f.log_ratio_entry.reads_current_policy]
        if cfg.force_on_policy_ratio and cfg.rejection_sampling:
            on_current = [f.label for f in cfg.rejection_sampling]
        if on_current:
            problems.append(
                "rejection_denominator: 'kept' counts what filters on the current policy's log-probs keep "
                f"({', '.join(on_current)})"
            )
    return problems
