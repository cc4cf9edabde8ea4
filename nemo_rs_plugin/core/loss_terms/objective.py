"""The objective: the loss's terms per token and how each becomes one number.

``L = sum_t k_t [ g_t * w_t * pg_t + beta * kl_t + tau * (curr_t - gen_t)^2 ] / N  +  mu * NLL_correct``
(``k`` the rejection mask, ``g`` the mask of the filters with ``applies_to: policy_gradient``,
``w`` the IS weight, ``pg`` the clipped objective of
:func:`~nemo_rs_plugin.core.policy_loss.clipped_objective`, ``N`` NeMo-RL's ``global_valid_toks``
or, with ``rejection_denominator: kept``, its kept share); with ``token_level_loss: false`` the
mean over sequences (``/ global_valid_seqs``) of per-sequence token means, each row over its
whole ``token_mask`` as NeMo-RL's.

:class:`Objective` holds what the configuration fixes (the ratio and KL options, the KL
coefficient, the loss's unit); :meth:`Objective.aggregation` the mask and denominators of this
call, :meth:`Objective.terms` the terms and their sum, :meth:`Objective.totals_of` the
microbatch totals the denominators and the NLL term read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from nemo_rs_plugin.core.batch.microbatch import MicrobatchTotals
from nemo_rs_plugin.core.batch.sanitizing import SanitizedInputs
from nemo_rs_plugin.core.correction import CorrectionResult, SequenceCounts
from nemo_rs_plugin.core.distributed import SequenceGroups, all_reduce_sum_with_grad
from nemo_rs_plugin.core.masking import EPS, TokenMasks, masked_sum
from nemo_rs_plugin.core.policy_loss import (
    KLOptions,
    RatioOptions,
    clipped_objective,
    kl_penalty_per_token,
    policy_ratios,
    positive_example_nll,
)
from nemo_rs_plugin.core.reporting.metrics import GlobalCounts
from nemo_rs_plugin.core.settings.config import RSClippedPGLossConfig

__all__ = ["Aggregation", "LossTerms", "Objective", "sequence_counts_of"]


class Objective:
    """The loss's terms and their aggregation, as a configuration fixes them."""

    def __init__(self, cfg: RSClippedPGLossConfig) -> None:
        """What ``cfg`` fixes for every call: the options of the ratio and of the KL penalty, its coefficient."""
        self.cfg = cfg
        self.token_level_loss = cfg.token_level_loss
        # use_kl_in_reward moves the KL into the reward: the loss has no KL term then.
        self.kl_coef = 0.0 if cfg.use_kl_in_reward else cfg.reference_policy_kl_penalty
        self.ratio_options = RatioOptions(
            force_on_policy=cfg.force_on_policy_ratio,
            disable_ppo_ratio=cfg.disable_ppo_ratio,
            sequence_level=cfg.sequence_level_importance_ratios,
            clip_min=cfg.ratio_clip_min,
            clip_max=cfg.ratio_clip_max,
        )
        self.kl_options = KLOptions(
            kl_type=cfg.reference_policy_kl_type,
            input_clamp=cfg.kl_input_clamp_value,
            output_clamp=cfg.kl_output_clamp_value,
            on_policy_approximation=cfg.use_on_policy_kl_approximation,
        )

    def totals_of(self, corr: CorrectionResult, masks: TokenMasks, rewards: Optional[torch.Tensor]) -> MicrobatchTotals:
        """This call's own microbatch totals (only those the configuration reads; see :class:`MicrobatchTotals`)."""
        cfg = self.cfg
        kept_tokens = kept_seqs = correct_count = None
        if cfg.denominator_entry.counts_kept:
            seqs = sequence_counts_of(corr)
            if seqs.kept_tokens is None or seqs.kept_sequences is None:
                raise RuntimeError("rejection_denominator: kept reads kept counts the correction did not compute")
            n_valid = seqs.token_count.sum()
            n_seqs = masks.sample_mask @ torch.sign(seqs.token_count)
            kept_tokens = seqs.kept_tokens / n_valid.clamp_min(EPS)
            kept_seqs = seqs.kept_sequences / n_seqs.clamp_min(EPS)
        if cfg.positive_example_nll_weight > 0 and rewards is not None:
            token_count = sequence_counts_of(corr).token_count
            correct_count = token_count @ (rewards > 0).to(token_count.dtype)
        return MicrobatchTotals(kept_tokens, kept_seqs, corr.batch_norm_factor, correct_count)

    def aggregation(
        self,
        counts: GlobalCounts,
        corr: CorrectionResult,
        masks: TokenMasks,
        groups: SequenceGroups,
        totals: MicrobatchTotals,
    ) -> Aggregation:
        """The mask and the denominators every loss term is averaged with."""
        keep = corr.keep  # [B, T]
        loss_tokens = corr.loss_tokens  # [B, T] tokens that contribute to the loss
        token_mask, sample_mask = masks.token_mask, masks.sample_mask
        # NeMo-RL's sequence-level aggregation averages each row over token_mask.
        agg_mask = loss_tokens if self.token_level_loss else token_mask * keep
        # The one global count the loss divides by: valid tokens (token-level loss) or valid
        # sequences, + 1e-8, shared with the metrics (one operator for both).
        kept_tokens, kept_seqs = totals.kept_token_fraction, totals.kept_sequence_fraction
        if kept_tokens is not None and kept_seqs is not None:  # set exactly with rejection_denominator: kept
            # VERL's decoupled semantics: shrink the global denominators by the kept fraction
            # of this microbatch (over all ranks that split its sequences).
            kept = counts.tokens * kept_tokens if self.token_level_loss else counts.sequences * kept_seqs
            divisor = kept + EPS
        else:
            divisor = counts.divisor("tokens" if self.token_level_loss else "sequences")
        return Aggregation(
            mask=agg_mask,
            sample_mask=sample_mask,
            seq_mask_count=None if self.token_level_loss else sequence_counts_of(corr).mask_count,
            divisor=divisor,
            groups=groups,
        )

    def terms(
        self,
        clean: SanitizedInputs,
        corr: CorrectionResult,
        agg: Aggregation,
        rewards: Optional[torch.Tensor],
        totals: MicrobatchTotals,
    ) -> LossTerms:
        """The policy-gradient term (IS-weighted), the KL penalty and the VAPO NLL, and their sum."""
        cfg = self.cfg
        # ---- policy-gradient term ----
        # Tokens with a non-finite input take no part in the GSPO sequence ratio either.
        ratio = corr.ratio  # the GSPO ratio's tokens, set exactly with sequence_level_importance_ratios
        ratio_mask = ratio.mask if ratio is not None else clean.masks.token_mask
        ratios, ratios_clamped = policy_ratios(
            clean.curr,
            clean.prev,
            ratio_mask,
            self.ratio_options,
            groups=agg.groups,
            row_count=ratio.count if ratio is not None else None,
        )
        pg = clipped_objective(
            clean.advantages,
            ratios,
            ratios_clamped,
            clean.curr,
            use_cispo=cfg.use_cispo,
            dual_clip_c=cfg.ratio_clip_c,
        )
        weight = corr.is_weight if cfg.use_importance_sampling_correction else None
        pg_weighted = pg * weight if weight is not None else pg
        if corr.policy_gradient_keep is not None:  # filters that remove the policy-gradient term only
            pg_weighted = pg_weighted * corr.policy_gradient_keep
        loss = self.aggregate(pg_weighted, agg)

        # ---- penalty toward the sampler (prime-rl's kl_tau term): tau * (curr - gen)^2 ----
        sampler_kl = None
        if cfg.sampler_kl_penalty > 0:
            # Masked before squaring: a masked position may hold any finite log-prob, and a huge
            # one squared is inf, which the mask's 0 would turn into NaN.
            diff = torch.where(agg.mask > 0, clean.curr - clean.gen, 0.0)
            sampler_kl = self.aggregate(diff.square(), agg)
            loss = loss + cfg.sampler_kl_penalty * sampler_kl

        # ---- KL penalty ----
        kl = None
        if clean.kl is not None:  # sanitised exactly when the KL term is on (kl_coef != 0)
            kl_tok = self.kl_coef * kl_penalty_per_token(
                clean.kl.curr_unfiltered, clean.kl.reference, clean.gen, self.kl_options
            )
            kl = self.aggregate(kl_tok, agg)
            loss = loss + kl

        # ---- VAPO positive-example NLL ----
        nll = None
        correct_count = totals.correct_token_count  # set exactly when the NLL term is on and rewards given
        if cfg.positive_example_nll_weight > 0 and rewards is not None and correct_count is not None:
            correct = (rewards > 0).to(clean.curr.dtype)  # [B]
            # valid tokens of correct samples in the whole microbatch (also when this call holds one sequence)
            nll = positive_example_nll(clean.curr, corr.loss_tokens, correct, correct_count)
            loss = loss + cfg.positive_example_nll_weight * nll
        return LossTerms(loss, kl, nll, ratios, ratios_clamped, sampler_kl)

    def aggregate(
        self,
        per_token: torch.Tensor,  # [B, T] finite (inputs sanitized, log-ratios clamped)
        agg: Aggregation,
    ) -> torch.Tensor:
        """Token mean over ``global_valid_toks``, or mean over sequences of per-row means.

        Rejected tokens are zero in the numerators only; the per-row denominator is the
        row's full ``token_mask`` count (reduced over ``groups``), as NeMo-RL's.
        """
        if agg.seq_mask_count is None:  # token-level loss
            return masked_sum(per_token, agg.mask.to(per_token.dtype)) / agg.divisor
        row_sum = all_reduce_sum_with_grad((per_token * agg.mask).sum(-1), agg.groups)  # [B]
        row_mean = row_sum / (agg.seq_mask_count + EPS)
        loss = (row_mean * agg.sample_mask).sum() / agg.divisor
        if agg.groups.active:
            # Every rank now holds the whole value; return its share so that the shares
            # summed over the ranks (the data-parallel gradient reduction) are the loss.
            for g in agg.groups.groups:
                loss = loss / torch.distributed.get_world_size(g)
        return loss


def sequence_counts_of(corr: CorrectionResult) -> SequenceCounts:
    """``corr``'s per-sequence counts, for a term the configuration turns on that reads them.

    :func:`~nemo_rs_plugin.core.correction.needs_sequence_statistics` holds for every such
    configuration, so the correction computed them; a reader it forgot fails here, by name.
    """
    if corr.sequences is None:
        raise RuntimeError(
            "the loss reads per-sequence counts the correction did not compute: "
            "needs_sequence_statistics(cfg) must hold for this configuration"
        )
    return corr.sequences


@dataclass
class Aggregation:
    """How a per-token loss term becomes a number: its mask and denominators."""

    mask: torch.Tensor  # [B, T] valid (token-level) or token_mask (sequence-level), kept
    sample_mask: torch.Tensor  # [B]
    seq_mask_count: Optional[torch.Tensor]  # [B] token_mask count per row, all ranks (None: token-level loss)
    # global_valid_toks (token-level loss) or global_valid_seqs, or its kept share, + 1e-8
    divisor: torch.Tensor
    groups: SequenceGroups


@dataclass
class LossTerms:
    """The loss and the terms its metrics report."""

    total: torch.Tensor
    kl: Optional[torch.Tensor]  # None without the KL term
    nll: Optional[torch.Tensor]  # None without the NLL term
    ratios: torch.Tensor  # [B, T] policy ratio
    ratios_clamped: torch.Tensor  # [B, T] its clamp
    sampler_kl: Optional[torch.Tensor] = None  # mean (curr - gen)^2 of the sampler penalty; None when off
