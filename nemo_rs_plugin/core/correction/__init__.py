"""Off-policy correction: IS weights at a chosen level, truncation, and rejection sampling.

Problem: the log-probs reported by the inference engine (``gen``) differ from the training
engine's (``prev``): kernel and precision mismatch, MoE routing, staleness in async runs.
With ``d = prev - gen`` per token, the IS weight ``pi_prev / pi_gen`` corrects the policy
gradient; truncation bounds its variance; rejection sampling drops tokens or sequences whose
mismatch is too large to correct.

Entry points (all pure torch; no NeMo-RL, no Megatron, no ``.item()``):

* :func:`token_filter_statistic`, :func:`filter_log_ratio`: token-level building blocks
  (:mod:`.filters`).
* the pipeline, in three visible steps (:mod:`.pipeline`; the loss calls them in order;
  :func:`compute_correction` chains them): :func:`plan_correction` computes every local
  decision and every partial per-sequence statistic; :meth:`CorrectionPlan.reduce` passes all
  of them through **one** call of
  :func:`~nemo_rs_plugin.core.distributed.reduce_sequence_statistics` (one SUM and one MAX
  all-reduce when sequences are sharded); :func:`apply_correction` derives masks, weights and
  metrics from the reduced statistics only.
* :class:`SequenceStatistics` (:mod:`.statistics`): the per-sequence statistics, typed fields.
* :func:`is_weights`, :func:`truncate_weights` (:mod:`.weights`), and
  :func:`batch_normalize_weights`: IS weights over their batch mean (one more SUM of two
  numbers, over the data-parallel group too when asked; in :mod:`.statistics` with the other
  collective).

IS weights and masks are detached: they change the measure the gradient is estimated under,
not the objective being differentiated.
See: docs/guide.md#is-correction-level, docs/guide.md#rejection-sampling, docs/guide.md#filter-statistics
and docs/guide.md#batch-normalisation.
"""

from __future__ import annotations

from nemo_rs_plugin.core.correction.filters import (
    PROBABILITY_CLAMP,
    PolicyLogProbs,
    filter_log_ratio,
    token_filter_statistic,
)
from nemo_rs_plugin.core.correction.pipeline import (
    CorrectionPlan,
    CorrectionResult,
    RatioTokens,
    SequenceCounts,
    apply_correction,
    compute_correction,
    needs_sequence_statistics,
    plan_correction,
)
from nemo_rs_plugin.core.correction.statistics import BATCH_MEAN_FLOOR, SequenceStatistics, batch_normalize_weights
from nemo_rs_plugin.core.correction.weights import is_weights, truncate_weights
from nemo_rs_plugin.core.masking import finite_exp

__all__ = [
    "BATCH_MEAN_FLOOR",
    "CorrectionPlan",
    "CorrectionResult",
    "PolicyLogProbs",
    "PROBABILITY_CLAMP",
    "RatioTokens",
    "SequenceCounts",
    "SequenceStatistics",
    "apply_correction",
    "batch_normalize_weights",
    "compute_correction",
    "filter_log_ratio",
    "finite_exp",
    "is_weights",
    "needs_sequence_statistics",
    "plan_correction",
    "token_filter_statistic",
    "truncate_weights",
]
