"""Every metric the loss returns: one entry each, read without running the loss.

An entry says the metric's name (or its pattern, ``rs/<filter>/...`` for each filter's label),
its normalization (the global count its per-microbatch value is divided by, so that a sum over
microbatches is the step's value) and its reduction over the ranks that split a sequence (both
may follow the IS level's unit or the loss's), whether it holds for one call alone, what it
means, whether NeMo-RL's own loss returns it too, and when it is emitted (a predicate of the
configuration). :func:`metric_specs` resolves the catalog for one configuration:
:meth:`~nemo_rs_plugin.core.loss.CorrectedPGLoss.metric_normalizations` reads it (what NeMo-RL's
``MetricNormalizer`` gets), and ``nemo-rs reference --metrics`` renders the guide's table from it.

Declared once: a declaration site names the metric and gives its value
(``metrics.add_total("is_weight_mean", total)``); the metric set reads the normalization, the
reduction and the per-call flag from here (:func:`declared_specs`), and refuses a name this
configuration does not have. Nothing restates them.

The loss's own values (checks of the inputs, counts for the run-time warning) ride on the same
host transfer as ``_``-prefixed entries of :data:`DIAGNOSTIC_CATALOG`; never returned, they come
back as one typed :class:`Diagnostics` record beside the metrics.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Mapping, NamedTuple, Optional, Union

#: The global count a metric's per-microbatch value is divided by (``none``: raw counts, extremes).
Normalization = Literal["tokens", "sequences", "none"]
#: How a metric is reduced over the ranks that split a sequence: ``sum`` (partial sums of local
#: tokens), ``replicated`` (identical on every rank), ``max`` or ``min``.
Reduction = Literal["sum", "replicated", "max", "min"]
#: A reduction, or ``derived``: computed on the host from the reduced values.
Reduced = Union[Reduction, Literal["derived"]]

__all__ = [
    "DIAGNOSTIC_CATALOG",
    "METRIC_CATALOG",
    "NONFINITE_LOGIT_ROWS",
    "WEIGHT_TAIL",
    "DiagnosticEntry",
    "Diagnostics",
    "MetricEntry",
    "MetricSpec",
    "Normalization",
    "Reduced",
    "Reduction",
    "catalog_entry",
    "declared_specs",
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
        return _resolved(self.normalization, self.reduction, self.per_call, cfg)


def _resolved(normalization: Union[Normalization, UnitOf], reduction: Reduced, per_call: bool, cfg: Any) -> MetricSpec:
    """A declaration's spec under ``cfg``: a unit it follows (:data:`UnitOf`) resolved to its count and reduction."""
    if normalization == "is_level":
        per_token = cfg.is_level_entry.per_token
        return MetricSpec("tokens" if per_token else "sequences", "sum" if per_token else "replicated", per_call)
    if normalization == "truncation":  # the units the truncation decides on
        per_sequence = cfg.truncation_entry is not None and cfg.truncation_entry.per_sequence
        return MetricSpec(*(("sequences", "replicated") if per_sequence else ("tokens", "sum")), per_call)
    if normalization == "loss":
        return MetricSpec("tokens" if cfg.token_level_loss else "sequences", "sum", per_call)
    return MetricSpec(normalization, reduction, per_call)


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
        raise KeyError(f"metric {name!r} is not in the catalog (core/reporting/metric_catalog.py): add its entry")
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


# ---------------------------------------------------------------------------------------------
# The loss's own values: declared like metrics, never returned.


class DiagnosticEntry(NamedTuple):
    """One of the loss's own values on the metrics' transfer (``_``-prefixed, never returned).

    Attributes:
        name: its key in the metric set.
        field: the :class:`Diagnostics` attribute it fills (``positive_logprobs``: one entry of that
            mapping, keyed by the input's data-dict key); ``None``: counted with its neighbours in
            one stacked evaluation and read by nobody (e.g. the advantages' row of the GPU form's
            positive-value count).
        meaning: what it counts.
        normalization, reduction: as a :class:`MetricEntry`'s.
    """

    name: str
    field: Optional[str]
    meaning: str
    normalization: Union[Normalization, UnitOf] = "none"
    reduction: Reduced = "sum"

    def spec(self, cfg: Any) -> MetricSpec:
        """Its normalization and reduction under ``cfg`` (never per call: it is read on every call)."""
        return _resolved(self.normalization, self.reduction, False, cfg)


#: The log-prob inputs whose positive values are counted: the data-dict key (the argument for
#: ``next_token_logprobs``) each count is named after.
POSITIVE_LOGPROB_KEYS = ("next_token_logprobs", "prev_logprobs", "generation_logprobs", "reference_policy_logprobs")
_POSITIVE = "valid tokens whose {} is above 0 (beyond the slack): probabilities passed as log-probs"
_UNREAD = "counted with the other rows of the GPU form's stacked evaluation; not read"

#: Every ``_``-prefixed value the loss declares, read by the loss after the one host transfer.
DIAGNOSTIC_CATALOG: tuple[DiagnosticEntry, ...] = (
    # the input checks (core/batch/input_checks.py): the global counts against the microbatch's own
    DiagnosticEntry("_global_valid_toks", "global_valid_toks", "NeMo-RL's global valid tokens", "none", "replicated"),
    DiagnosticEntry("_global_valid_seqs", "global_valid_seqs", "NeMo-RL's global valid seqs", "none", "replicated"),
    DiagnosticEntry("_local_valid_toks", "local_valid_toks", "this microbatch's valid tokens"),
    DiagnosticEntry("_local_valid_seqs", "local_valid_seqs", "this microbatch's valid sequences", "none", "replicated"),
    # a token_mask other than 0/1: an integer mask's extremes, a float mask's other entries
    DiagnosticEntry("_token_mask_min", "token_mask_min", "smallest entry of an integer token_mask", "none", "min"),
    DiagnosticEntry("_token_mask_max", "token_mask_max", "largest entry of an integer token_mask", "none", "max"),
    DiagnosticEntry("_token_mask_other", "token_mask_other", "float token_mask entries other than 0 and 1"),
    DiagnosticEntry("_token_mask_other_min", "token_mask_other_min", "smallest of those entries", "none", "min"),
    DiagnosticEntry("_token_mask_other_max", "token_mask_other_max", "largest of those entries", "none", "max"),
    *(
        DiagnosticEntry(f"_positive_{key}_count", "positive_logprobs", _POSITIVE.format(key))
        for key in POSITIVE_LOGPROB_KEYS
    ),
    *(DiagnosticEntry(f"_positive_{row}", None, _UNREAD) for row in ("d", "advantages", "curr_unfiltered", "prev")),
    # non-finite inputs counted beside the public counts (core/batch/sanitizing.py)
    DiagnosticEntry("_nonfinite_curr_filtered_count", None, _UNREAD),
    DiagnosticEntry("_nonfinite_curr_unfiltered_count", None, _UNREAD),
    DiagnosticEntry("_nonfinite_prev_logprobs_count", None, _UNREAD),
    DiagnosticEntry("_nonfinite_generation_logprobs_count", None, _UNREAD),
    DiagnosticEntry(
        f"_{NONFINITE_LOGIT_ROWS}",
        "nonfinite_logit_rows",
        "positions whose logits held a NaN or +inf, where the metric is not returned",
    ),
    # the units of the effective sample size (is_ess, derived on the host)
    DiagnosticEntry("_ess_units", "ess_units", "units the IS weight is averaged over", "is_level"),
    # the filters' sequences, for the run-time warning when they eat the batch (core/reporting/health.py)
    DiagnosticEntry("_rs_seq_dropped", "dropped_sequences", "sequences the filters dropped", "none", "replicated"),
    DiagnosticEntry("_rs_seq_valid", "valid_sequences", "sequences with a valid token", "none", "replicated"),
)

_DIAGNOSTIC_FIELDS = {e.name: e.field for e in DIAGNOSTIC_CATALOG}


@dataclass(frozen=True)
class Diagnostics:
    """The loss's own values of one call, after the one host transfer (reduced over the sequence groups).

    ``None``: not measured by this call (a bool ``token_mask`` has no extremes, no filter counts
    no sequences). Read by :func:`~nemo_rs_plugin.core.batch.input_checks.judge_inputs`, the run-time
    rejection warning and the non-finite-logits warning.
    """

    global_valid_toks: Optional[float] = None
    global_valid_seqs: Optional[float] = None
    local_valid_toks: Optional[float] = None
    local_valid_seqs: Optional[float] = None
    token_mask_min: Optional[float] = None
    token_mask_max: Optional[float] = None
    token_mask_other: Optional[float] = None
    token_mask_other_min: Optional[float] = None
    token_mask_other_max: Optional[float] = None
    #: input's data-dict key -> its valid tokens above 0 (only the inputs counted by this call)
    positive_logprobs: Mapping[str, float] = field(default_factory=dict)
    nonfinite_logit_rows: Optional[float] = None
    ess_units: Optional[float] = None
    dropped_sequences: Optional[float] = None
    valid_sequences: Optional[float] = None

    @classmethod
    def from_values(cls, values: Mapping[str, float]) -> "Diagnostics":
        """The record of the transferred ``_``-prefixed values (names of :data:`DIAGNOSTIC_CATALOG`)."""
        fields: dict[str, Any] = {}
        positive: dict[str, float] = {}
        for name, value in values.items():
            target = _DIAGNOSTIC_FIELDS[name]
            if target == "positive_logprobs":
                positive[name[len("_positive_") : -len("_count")]] = value
            elif target is not None:
                fields[target] = value
        return cls(positive_logprobs=positive, **fields)


def declared_specs(cfg: Any) -> dict[str, MetricSpec]:
    """Every name the loss may declare under ``cfg``: its metrics (:func:`metric_specs`), then its diagnostics.

    What :class:`~nemo_rs_plugin.core.reporting.metrics.MetricSet` reads each declaration's normalization,
    reduction and per-call flag from.
    """
    return {**metric_specs(cfg), **{e.name: e.spec(cfg) for e in DIAGNOSTIC_CATALOG}}
