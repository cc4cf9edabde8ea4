"""Every metric the loss returns: one entry each, read without running the loss.

An entry says the metric's name (or its pattern, ``rs/<filter>/...`` for each filter's label),
its normalization (the global count its per-microbatch value is divided by, so that a sum over
microbatches is the step's value) and its reduction over the ranks that split a sequence (both
may follow the IS level's unit or the loss's), whether it holds for one call alone, what it
means, whether NeMo-RL's own loss returns it too, and when it is emitted (a predicate of the
configuration). :func:`metric_specs` resolves the catalog for one configuration: the loss's
metric set checks every metric it declares against it (name, normalization, reduction,
per-call), :meth:`~nemo_rs_plugin.core.loss.CorrectedPGLoss.metric_normalizations` reads it
(what NeMo-RL's ``MetricNormalizer`` gets), and ``nemo-rs reference --metrics`` renders the
guide's table from it. Names that start with ``_`` are the loss's internal values (checks,
counts for the run-time warning): never returned, not catalogued.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal, NamedTuple, Union

from nemo_rs_plugin.core.metrics import Normalization, Reduction

#: A reduction, or ``derived``: computed on the host from the reduced values.
Reduced = Union[Reduction, Literal["derived"]]

__all__ = [
    "METRIC_CATALOG",
    "NONFINITE_LOGIT_ROWS",
    "WEIGHT_TAIL",
    "MetricEntry",
    "MetricSpec",
    "catalog_entry",
    "metric_specs",
]

#: ``is_level``: the IS level's unit (``tokens``, summed over ranks, per token; ``sequences``,
#: replicated, per sequence). ``loss``: the loss's (``tokens`` with ``token_level_loss``, else
#: ``sequences``), reduced by sum.
UnitOf = Literal["is_level", "loss", "truncation"]
FILTER = "<filter>"  # a filter's label in a pattern

#: The tail fractions' factor ``C``: ``is_weight_raw_low_frac`` counts the units whose raw weight is
#: below ``1 / C``, ``is_weight_raw_high_frac`` those above ``C``. Sums over units divided by
#: NeMo-RL's global counts, so that they add up over calls, microbatches and ranks (an extreme
#: does not: NeMo-RL sums it too). ``C = 2``, the same number as the usual TIS cap
#: (``presets.TIS_CAP``) but not tied to it: a metric's threshold does not follow a preset.
WEIGHT_TAIL = 2.0

#: The logits input path's count of positions with a NaN or +inf logit (summed over CP ranks).
NONFINITE_LOGIT_ROWS = "nonfinite_logit_rows_count"


class MetricSpec(NamedTuple):
    """A metric as one configuration declares it."""

    normalization: Normalization
    reduction: Reduced
    per_call: bool


@dataclass(frozen=True)
class MetricEntry:
    """One metric (or one per filter, with :data:`FILTER` in the name).

    Attributes:
        name: the key in the metrics dict; ``rs/<filter>/...`` stands for each filter's label.
        meaning: what it is, as the guide's table says it.
        normalization: a fixed normalization, or whose unit it follows (:data:`UnitOf`).
        reduction: over the ranks that split a sequence; ignored where ``normalization`` follows a unit.
        per_call: holds for one call alone (an extreme, a ratio of sums): no sum over calls combines it,
            so the NeMo-RL loss does not return it.
        emitted: when the configuration (``RSClippedPGLossConfig``) returns it; for a filter pattern,
            ``(config, filter) -> bool``.
        nemo_rl: NeMo-RL's own ``ClippedPGLossFn`` returns it too, with the same meaning.
    """

    name: str
    meaning: str
    normalization: Union[Normalization, UnitOf]
    reduction: Reduced = "sum"
    per_call: bool = False
    emitted: Callable[..., bool] = lambda cfg: True  # noqa: E731 - always
    nemo_rl: bool = False

    @property
    def per_filter(self) -> bool:
        """One metric per filter (the name holds :data:`FILTER`)."""
        return FILTER in self.name

    def spec(self, cfg: Any) -> MetricSpec:
        """Its normalization, reduction and per-call flag under ``cfg``."""
        if self.normalization == "is_level":
            per_token = cfg.is_level_entry.per_token
            return MetricSpec(
                "tokens" if per_token else "sequences", "sum" if per_token else "replicated", self.per_call
            )
        if self.normalization == "truncation":  # the units the truncation decides on
            per_sequence = cfg.truncation_entry is not None and cfg.truncation_entry.per_sequence
            return MetricSpec(*(("sequences", "replicated") if per_sequence else ("tokens", "sum")), self.per_call)
        if self.normalization == "loss":
            return MetricSpec("tokens" if cfg.token_level_loss else "sequences", "sum", self.per_call)
        return MetricSpec(self.normalization, self.reduction, self.per_call)


def _filters(cfg: Any) -> bool:
    return len(cfg.rejection_sampling) > 0


_TAILS = (
    f"share of the units whose weight before truncation is below 1/{WEIGHT_TAIL:g}, above {WEIGHT_TAIL:g} "
    "(a sequence-level weight collapsing with length shows in the first; valid tokens with finite inputs "
    "at the token level)"
)
_EXTREMES = "extremes of the weight before truncation, and of the weight applied (non-zero, kept units)"
_NONFINITE = "valid tokens whose reference log-prob or advantage was NaN or infinite ([below](#non-finite-inputs))"
_ALL_FILTERS = "all filters together"
_NEMO_RL = "NeMo-RL's metric of the same name and meaning"

#: Every returned metric, in the order the loss declares them.
METRIC_CATALOG: tuple[MetricEntry, ...] = (
    MetricEntry(
        "nonfinite_curr_logprobs_count",
        "valid tokens whose current log-prob was NaN or infinite ([below](#non-finite-inputs))",
        "none",
    ),
    MetricEntry("nonfinite_log_ratio_count", "valid tokens whose `prev - gen` was NaN or infinite", "none"),
    MetricEntry("nonfinite_reference_logprobs_count", _NONFINITE, "none"),
    MetricEntry("nonfinite_advantages_count", _NONFINITE, "none"),
    MetricEntry(
        NONFINITE_LOGIT_ROWS,
        "positions whose logits held a NaN or +inf, or only -inf, any position (prompt, masked, last) "
        "([below](#non-finite-inputs)); `sharded_logits_input` only",
        "none",
        emitted=lambda cfg: cfg.sharded_logits_input,
    ),
    # ---- rejection sampling, per filter (in the filters' order) and all together
    MetricEntry(
        f"rs/{FILTER}/seq_rejected_frac",
        "sequences a sequence filter rejected",
        "sequences",
        "replicated",
        emitted=lambda cfg, f: f.level_entry.whole_sequences,
    ),
    MetricEntry(
        f"rs/{FILTER}/token_rejected_frac",
        "tokens this stage rejected",
        "tokens",
        "replicated",
        emitted=lambda cfg, f: True,
    ),
    MetricEntry(
        f"rs/{FILTER}/seq_touched_frac",
        "sequences in which a token filter rejected a token",
        "sequences",
        "replicated",
        emitted=lambda cfg, f: not f.level_entry.whole_sequences,
    ),
    MetricEntry("rs_token_rejected_frac", _ALL_FILTERS, "tokens", "replicated", emitted=_filters),
    MetricEntry("rs_seq_rejected_frac", _ALL_FILTERS, "sequences", "replicated", emitted=_filters),
    # ---- IS weights: truncation, batch normalisation, the weights' statistics
    MetricEntry(
        "is_oob_ratio",
        "NeMo-RL's share of the units outside the truncation band: tokens (tis, icepop), sequences (seq-mask-tis)",
        "truncation",
        emitted=lambda cfg: cfg.truncation_entry is not None,
        nemo_rl=True,
    ),
    MetricEntry(
        "is_batch_norm_factor",
        "the batch mean the weights were divided by ([above](#batch-normalisation)); 1 when it was <= 1e-8",
        "none",
        "replicated",
        per_call=True,
        emitted=lambda cfg: cfg.is_batch_normalization is not None,
    ),
    MetricEntry("is_weight_raw_mean", "IS weight before truncation and rejection", "is_level"),
    MetricEntry(
        "is_weight_mean",
        "weight applied (after truncation and batch normalisation; rejected units count 0)",
        "is_level",
    ),
    MetricEntry(
        "is_weight_sq_mean",
        "mean squared applied weight; the step's ESS is `is_weight_mean^2 / is_weight_sq_mean` (divide by "
        "the kept share when filters reject units)",
        "is_level",
    ),
    MetricEntry("is_weight_raw_low_frac", _TAILS, "is_level"),
    MetricEntry("is_weight_raw_high_frac", _TAILS, "is_level"),
    MetricEntry("is_weight_raw_min", _EXTREMES, "none", "min", per_call=True),
    MetricEntry("is_weight_raw_max", _EXTREMES, "none", "max", per_call=True),
    MetricEntry("is_weight_min", _EXTREMES, "none", "min", per_call=True),
    MetricEntry("is_weight_max", _EXTREMES, "none", "max", per_call=True),
    MetricEntry("is_ess", "`(sum w)^2 / (n sum w^2)` of the applied weights", "none", "derived", per_call=True),
    # ---- NeMo-RL's own metrics (ClippedPGLossFn), same names and meanings
    MetricEntry("loss", _NEMO_RL, "loss", nemo_rl=True),
    MetricEntry("probs_ratio", _NEMO_RL, "tokens", nemo_rl=True),
    MetricEntry("probs_ratio_clamped", _NEMO_RL, "tokens", nemo_rl=True),
    MetricEntry("token_mult_prob_error", _NEMO_RL, "tokens", nemo_rl=True),
    MetricEntry("gen_kl_error", _NEMO_RL, "tokens", nemo_rl=True),
    MetricEntry("policy_kl_error", _NEMO_RL, "tokens", nemo_rl=True),
    MetricEntry("js_divergence_error", _NEMO_RL, "tokens", nemo_rl=True),
    MetricEntry("approx_entropy", _NEMO_RL, "tokens", nemo_rl=True),
    # the mean IS weight: over tokens, or over sequences for a per-sequence level
    MetricEntry("sampling_importance_ratio", _NEMO_RL, "is_level", nemo_rl=True),
    # NeMo-RL's extremes: its wrappers and driver combine them by min and max (not per call)
    MetricEntry("probs_ratio_min", _NEMO_RL, "none", "min", nemo_rl=True),
    MetricEntry("probs_ratio_max", _NEMO_RL, "none", "max", nemo_rl=True),
    # the clamp is monotonic: clip(the extremes of the ratio), on the host
    MetricEntry("probs_ratio_clamped_min", _NEMO_RL, "none", "derived", nemo_rl=True),
    MetricEntry("probs_ratio_clamped_max", _NEMO_RL, "none", "derived", nemo_rl=True),
    MetricEntry("kl_penalty", _NEMO_RL, "loss", nemo_rl=True),
    MetricEntry("num_valid_samples", _NEMO_RL, "none", "replicated", nemo_rl=True),
    MetricEntry(
        "sampler_kl_penalty",
        "mean `(curr - gen)^2` of the penalty toward the sampler, without its coefficient (with "
        "`sampler_kl_penalty` > 0)",
        "loss",
        emitted=lambda cfg: cfg.sampler_kl_penalty > 0,
    ),
    MetricEntry("positive_nll_loss", _NEMO_RL, "none", nemo_rl=True),
)

_BY_NAME = {e.name: e for e in METRIC_CATALOG}
_BY_SUFFIX = {e.name.rsplit("/", 1)[1]: e for e in METRIC_CATALOG if e.per_filter}


def catalog_entry(name: str) -> MetricEntry:
    """The entry of a metric name (``rs/<label>/...`` by its suffix); a name not in the catalog is an error."""
    entry = _BY_NAME.get(name)
    if entry is None and name.startswith("rs/") and name.count("/") == 2:
        entry = _BY_SUFFIX.get(name.rsplit("/", 1)[1])
    if entry is None:
        raise KeyError(f"metric {name!r} is not in the catalog (core/metric_catalog.py): add its entry")
    return entry


def metric_specs(cfg: Any) -> dict[str, MetricSpec]:
    """Every metric ``cfg`` returns (filters' patterns expanded with their labels), in declaration order.

    The per-filter metrics stand where the catalog's first per-filter entry does, filter by
    filter (each filter's in the catalog's order), as the filters declare them stage by stage.
    """
    out: dict[str, MetricSpec] = {}
    per_filter = [e for e in METRIC_CATALOG if e.per_filter]
    for entry in METRIC_CATALOG:
        if not entry.per_filter:
            if entry.emitted(cfg):
                out[entry.name] = entry.spec(cfg)
        elif entry is per_filter[0]:
            for f in cfg.rejection_sampling:
                for e in per_filter:
                    if e.emitted(cfg, f):
                        out[e.name.replace(FILTER, f.label)] = e.spec(cfg)
    return out
