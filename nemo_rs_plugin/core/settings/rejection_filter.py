"""One stage of rejection sampling: :class:`TokenFilter` or :class:`SequenceFilter`, keyed on ``level``.

A stage is one of two kinds, a union discriminated by its ``level`` (prime-rl's config unions
are the model): a :class:`TokenFilter` keeps or rejects single tokens; a :class:`SequenceFilter`
keeps or rejects whole sequences and alone has ``agg``, how it aggregates its tokens' values.
:class:`RejectionFilter` is what both share (the fields, the checks, the label) and the type
code that takes either kind names; ``RejectionFilter(level=..., ...)`` builds the kind its
``level`` names, and :data:`AnyRejectionFilter` is the union the loss configuration parses
``rejection_sampling`` entries with. Which advantage signs and scopes each level allows is its
:data:`~nemo_rs_plugin.core.registries.filter_levels.FILTER_LEVELS` entry (one definition).

Part of the loss configuration (:mod:`nemo_rs_plugin.core.settings.config` re-exports it); the
tensor side of a filter is :mod:`nemo_rs_plugin.core.correction.filters`.

References:
    - Geo-RS: Liu, Li et al., "When Speed Kills Stability: Demystifying RL Collapse from the
      Training-Inference Mismatch", https://yingru.notion.site/When-Speed-Kills-Stability-Demystifying-RL-Collapse-from-the-Training-Inference-Mismatch-271211a558b7808d8b12d403fd15edda
    - Token-MIS: IcePop (Ant Group's Ling team), https://ringtech.notion.site/icepop; the Ring-1T
      report, https://arxiv.org/abs/2510.18855
    - Filter fields (level, metric (here: statistic), agg, bounds), denominators unchanged: AReaL PR #1088,
      https://github.com/inclusionAI/AReaL/pull/1088
    - Stage order, Geo-RS then Token-MIS: AReaL PR #1218, https://github.com/inclusionAI/AReaL/pull/1218
    - Product and geometric masks, outlier-token veto (``agg: any``): SkyRL PR #849,
      https://github.com/NovaSky-AI/SkyRL/pull/849
    - OPSM (``advantage_sign: negative``): DeepSeek-AI, "DeepSeek-V3.2: Pushing the Frontier of Open
      Large Language Models", https://arxiv.org/abs/2512.02556
    - DPPO (``prob_diff`` per ``advantage_sign``, ``applies_to: policy_gradient``): Qi et al., "Rethinking
      the Trust Region in LLM Reinforcement Learning", https://arxiv.org/abs/2602.04879; prime-rl's default
      loss, https://docs.primeintellect.ai/prime-rl/algorithms
    - IPO (two-sided ``prob_diff``): prime-rl, https://docs.primeintellect.ai/prime-rl/ipo.md
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator

from nemo_rs_plugin.core.registries.aggregations import (
    DEFAULT_AGGREGATION,
    SEQUENCE_AGGREGATIONS,
    SequenceAggregation,
)
from nemo_rs_plugin.core.registries.filter_levels import FILTER_LEVELS, RejectionLevel, rejection_level
from nemo_rs_plugin.core.registries.filter_options import (
    ADVANTAGE_SIGNS,
    LOG_RATIOS,
    SCOPES,
    AdvantageSign,
    LogRatio,
    Scope,
)
from nemo_rs_plugin.core.registries.filter_statistics import (
    FILTER_STATISTICS,
    FilterStatistic,
    filter_statistics_text,
)

__all__ = [
    "AGGS_FOR_STATISTIC",
    "DEPRECATED_FILTER_FIELDS",
    "AnyRejectionFilter",
    "FilterStage",
    "RejectionFilter",
    "SequenceFilter",
    "StageSettings",
    "TokenFilter",
    "resolved_stages",
    "current_filter_fields",
    "filter_field",
    "parse_filter",
]

FilterLevel = Literal["token", "sequence"]
FilterStatisticName = Literal[
    "ratio", "kl_k1", "kl_k2", "kl_k3", "mult_prob_error", "chi2", "binary_kl", "total_variation", "prob_diff"
]
FilterAgg = Literal["mean", "sum", "max", "min", "any"]
FilterLogRatio = Literal["prev-gen", "gen-prev", "curr-gen", "curr-prev"]
FilterAdvantageSign = Literal["positive", "negative"]
FilterScope = Literal["loss", "policy_gradient"]

# Aggregations allowed per statistic (the registry's): ratios aggregate in log space, so
# min/max/any are well defined; every other statistic aggregates arithmetically (mean, sum,
# max), as in VERL/AReaL/OpenRLHF/NeMo-RL.
AGGS_FOR_STATISTIC: dict[str, tuple[str, ...]] = {name: s.aggregations for name, s in FILTER_STATISTICS.items()}


#: A filter's old spellings and the field each is read as: accepted, warned about
#: (``setting_warnings``), never suggested for a misspelled key.
DEPRECATED_FILTER_FIELDS: dict[str, str] = {"metric": "statistic", "negative_advantages_only": "advantage_sign"}


#: Metric names NeMo-RL's workers leave undivided by the number of global batches per step (they
#: take them for extremes): ``"_min" in name or "_max" in name`` in every supported NeMo-RL's
#: DTensor, Megatron and automodel training loops. A filter's shares are sums, so its label must
#: not contain them: the default label spells these aggregations out (their entries' ``label``:
#: ``largest``, ``smallest``), and a ``name`` that
#: contains them is warned about (``setting_warnings``).
NEMO_RL_UNDIVIDED_MARKERS = ("_min", "_max")


class RejectionFilter(BaseModel):
    """One stage of rejection sampling: what :class:`TokenFilter` and :class:`SequenceFilter` share.

    A filter computes a statistic from the per-token log-ratio ``d = log pi_a - log pi_b``
    chosen by ``log_ratio`` (default ``prev-gen``: ``d = prev_logprobs -
    generation_logprobs``) and keeps a token (``level: token``) or a whole sequence
    (``level: sequence``) iff ``lower <= statistic <= upper`` (a missing bound is open).
    Rejected units get weight 0 in the whole loss (policy-gradient, KL and NLL terms);
    denominators do not change.

    Statistics: one entry each in :data:`~nemo_rs_plugin.core.registries.filter_statistics.FILTER_STATISTICS`
    (its per-token formula, aggregations and range; the ``statistic`` field's description lists them).
    ``ratio`` is compared in log space: a sequence's ``mean`` is ``exp(sum_t m d / n)`` (the geometric
    mean, "Geo-RS"), ``sum`` = ``exp(sum_t m d)`` (product), ``max``/``min`` the extreme token ratio,
    ``any`` rejects when any valid token ratio is outside the bounds (outlier-token veto).

    Every other statistic aggregates arithmetically by ``mean``, ``sum`` or ``max``.
    With ``advantage_sign: negative`` the filter rejects
    only tokens whose advantage is negative (TRL's and slime's off-policy sequence masking,
    OPSM); with ``advantage_sign: positive`` (token filters) only tokens whose advantage is
    positive. With ``applies_to: policy_gradient`` (token filters) a rejected token loses
    its policy-gradient term only and keeps its KL penalties (prime-rl's DPPO / IPO mask).

    ``RejectionFilter(level="token", ...)`` builds a :class:`TokenFilter`, ``level="sequence"`` a
    :class:`SequenceFilter` (and ``RejectionFilter.model_validate`` parses either): the level
    names the kind, as in a recipe.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    def __new__(cls, *args: Any, **data: Any) -> "RejectionFilter":
        # ``RejectionFilter(level=...)`` is the kind the level names; the subclass's own
        # __init__ then validates (Python calls the __init__ of the object __new__ returns).
        # Without a known level the base validates, and refuses with pydantic's message.
        if cls is RejectionFilter and data.get("level") in FILTER_KINDS:
            cls = FILTER_KINDS[data["level"]]
        return super().__new__(cls)

    @classmethod
    def model_validate(cls, obj: Any, **kwargs: Any) -> "RejectionFilter":
        """Parse one stage: on :class:`RejectionFilter`, the kind its ``level`` names (:func:`parse_filter`)."""
        if cls is RejectionFilter:
            return _FILTER_ADAPTER.validate_python(obj, **kwargs)
        return super().model_validate(obj, **kwargs)

    @classmethod
    def model_validate_json(cls, json_data: Any, **kwargs: Any) -> "RejectionFilter":
        """:meth:`model_validate` from JSON."""
        if cls is RejectionFilter:
            return _FILTER_ADAPTER.validate_json(json_data, **kwargs)
        return super().model_validate_json(json_data, **kwargs)

    @classmethod
    def model_validate_strings(cls, obj: Any, **kwargs: Any) -> "RejectionFilter":
        """:meth:`model_validate` from strings."""
        if cls is RejectionFilter:
            return _FILTER_ADAPTER.validate_strings(obj, **kwargs)
        return super().model_validate_strings(obj, **kwargs)

    @classmethod
    def model_construct(cls, _fields_set: Optional[set[str]] = None, **values: Any) -> "RejectionFilter":
        """Unvalidated, as pydantic's; on :class:`RejectionFilter`, the kind ``level`` names."""
        if cls is RejectionFilter and values.get("level") in FILTER_KINDS:
            cls = FILTER_KINDS[values["level"]]
        return super(RejectionFilter, cls).model_construct(_fields_set, **values)

    def model_copy(self, *, update: Optional[Mapping[str, Any]] = None, deep: bool = False) -> "RejectionFilter":
        """A copy, as pydantic's (unvalidated); a new ``level`` is refused: it names another kind of stage."""
        if update and "level" in update and update["level"] != self.level:
            raise ValueError(
                f"level: got {update['level']!r} in model_copy of a {self.level} filter; the level names the kind "
                "of stage: build a new one, RejectionFilter(**{**f.model_dump(), 'level': ...})"
            )
        return super().model_copy(update=update, deep=deep)

    level: FilterLevel
    """``token`` rejects single tokens; ``sequence`` rejects whole sequences (and alone has ``agg``)."""
    statistic: FilterStatisticName = Field(
        default="ratio",
        description=(
            "Statistic compared with the bounds, per token from ``d = log pi_a - log pi_b`` (``log_ratio``; "
            f"``p = exp(log pi)``): {filter_statistics_text()}."
        ),
    )
    # The deprecated spellings are read into their one name (the validators below) and left out of a
    # dump (model_dump, what tools re-validate and print), which names each concept once.
    metric: Optional[FilterStatisticName] = Field(default=None, exclude=True)
    """Deprecated spelling of ``statistic`` (accepted, warned about: ``nemo-rs check`` says how to
    update); the name collided with the logged metrics."""
    lower: Optional[float] = None
    """Inclusive lower bound; ``None`` leaves the low side open."""
    upper: Optional[float] = None
    """Inclusive upper bound; ``None`` leaves the high side open."""
    log_ratio: FilterLogRatio = "prev-gen"
    """The log-ratio ``d = log pi_a - log pi_b`` the statistic reads: ``prev-gen``
    (default; trainer before the update over the inference engine), ``gen-prev`` (the
    reverse: AReaL's KL direction, VERL's k1 band on gen/prev), ``curr-gen`` or
    ``curr-prev`` (the detached current policy: TRL's and slime's OPSM)."""
    negative_advantages_only: bool = Field(default=False, exclude=True)
    """Deprecated spelling of ``advantage_sign: negative`` (accepted, warned about: ``nemo-rs check``
    says how to update). TRL ``off_policy_mask_threshold``, slime ``use_opsm``."""
    advantage_sign: Optional[FilterAdvantageSign] = None
    """Reject only tokens whose advantage has this sign: ``negative`` (A < 0; a rejected sequence
    loses its negative-advantage tokens; with one advantage per sequence, as in GRPO, the whole
    sequence iff its advantage is negative: TRL's and slime's off-policy sequence masking, OPSM;
    token and sequence filters) or ``positive``
    (A > 0; token filters only). A sign-conditioned filter never rejects a token with A = 0
    (as prime-rl's mask, which reads the sign). Two token filters, one per sign, give prime-rl's DPPO mask, with its
    separate ``dppo_mask_high`` / ``dppo_mask_low`` bounds. ``None``: every token."""
    applies_to: FilterScope = "loss"
    """What a rejection removes: ``loss`` (default) the token's whole loss (policy-gradient,
    KL penalties and NLL terms); ``policy_gradient`` (token filters only) only its
    policy-gradient term, so the KL penalties still see every valid token (prime-rl, whose
    DPPO / IPO mask drops only ``-A * ratio``). Such a filter removes nothing from what the
    later filters see and does not change ``rs_token_rejected_frac``, the denominators or
    the tokens the GSPO ratio averages over; its own ``rs/<label>/token_rejected_frac``
    counts the tokens whose policy-gradient term it removed."""
    name: Optional[str] = None
    """Label used in metric names; default
    ``<level>_<statistic>[_<agg>][_<log_ratio>][_<sign>_advantages][_policy_gradient]`` (the
    last three only when not at their defaults; ``agg`` ``max`` and ``min`` read ``largest`` and
    ``smallest``, which NeMo-RL's workers scale as sums). Labels must be unique within ``rejection_sampling``."""

    @model_validator(mode="before")
    @classmethod
    def _one_name_for_the_statistic(cls, data: Any) -> Any:
        """``metric: kl_k3`` is read as ``statistic: kl_k3`` (its one name).

        The old field stays set, so the deprecation is warned about (``setting_warnings``) and a
        contradiction with ``statistic`` is still refused by name; a value that is no statistic is left
        to the old field's own check, so the error names the field the user wrote.
        """
        if isinstance(data, dict) and data.get("metric") in FILTER_STATISTICS and data.get("statistic") is None:
            data = {**data, "statistic": data["metric"]}
        return data

    @model_validator(mode="before")
    @classmethod
    def _one_name_for_the_advantage_sign(cls, data: Any) -> Any:
        """``negative_advantages_only: true`` is read as ``advantage_sign: negative`` (its one name).

        The old field stays set, so the deprecation is warned about (``setting_warnings``) and a
        contradiction with ``advantage_sign: positive`` is still refused by name.
        """
        if (
            isinstance(data, dict)
            and data.get("negative_advantages_only") is True
            and data.get("advantage_sign") is None
        ):
            data = {**data, "advantage_sign": "negative"}
        return data

    @model_validator(mode="wrap")
    @classmethod
    def _check(cls, data: Any, handler: Any) -> Any:
        """Every problem of the stage at once: its fields, its values together, and fields of another level.

        ``agg`` on a token filter is located at ``agg`` and named as such (pydantic would call it
        an extra input); the stage is validated without it, so its other problems, each at its
        own location, come with it. A stage of the shared base with a known level (a field or
        adapter typed ``RejectionFilter`` instead of :data:`AnyRejectionFilter`) is refused: it
        would be neither kind.
        """
        if cls is RejectionFilter:
            handler(data)  # pydantic's own errors first (an unknown or missing level)
            raise ValueError(
                "a stage must be the kind its level names: type the field AnyRejectionFilter (or TokenFilter, "
                "SequenceFilter), or build it with RejectionFilter(...) / RejectionFilter.model_validate(...)"
            )
        foreign: dict[Any, str] = {}  # a field of another level's stages, given a value -> its message
        given = data
        if isinstance(data, Mapping):
            level = data.get("level", cls.model_fields["level"].default)  # TokenFilter(...) needs no level
            elsewhere = [k for k in data if _of_another_level(level, k)]
            # ``agg: null`` on a token filter says nothing: dropped, as the old single class read it
            foreign = {k: _another_levels_field(level, str(k), data[k]) for k in elsewhere if data[k] is not None}
            if elsewhere:
                data = {k: v for k, v in data.items() if k not in elsewhere}
        try:
            stage = handler(data)
        except ValidationError as exc:
            if not foreign:
                raise
            errors = [_init_error(err) for err in exc.errors()]
        else:
            problems = stage._problems()
            if problems and not foreign:
                raise ValueError("; ".join(problems))
            errors = [_located("; ".join(problems), (), data)] if problems else []
        if foreign:
            errors += [_located(line, (name,), given[name]) for name, line in foreign.items()]
            raise ValidationError.from_exception_data(cls.__name__, errors)
        return stage

    def _problems(self) -> list[str]:
        """What is wrong with this stage's values together (a kind adds its own)."""
        return _filter_problems(self)

    @property
    def level_entry(self) -> RejectionLevel:
        """The :data:`~nemo_rs_plugin.core.registries.filter_levels.FILTER_LEVELS` entry of :attr:`level`."""
        return rejection_level(self.level)

    @property
    def scope_entry(self) -> Scope:
        """The :data:`~nemo_rs_plugin.core.registries.filter_options.SCOPES` entry of :attr:`applies_to`."""
        return SCOPES[self.applies_to]

    @property
    def log_ratio_entry(self) -> LogRatio:
        """The :data:`~nemo_rs_plugin.core.registries.filter_options.LOG_RATIOS` entry of :attr:`log_ratio`."""
        return LOG_RATIOS[self.log_ratio]

    @property
    def sign_entry(self) -> Optional[AdvantageSign]:
        """The :data:`~nemo_rs_plugin.core.registries.filter_options.ADVANTAGE_SIGNS` entry of :attr:`advantage_sign`.

        ``None``: no sign condition (every unit may be rejected).
        """
        return None if self.advantage_sign is None else ADVANTAGE_SIGNS[self.advantage_sign]

    @property
    def aggregation(self) -> Optional[str]:
        """The effective aggregation (``mean`` when a sequence filter leaves it unset); ``None`` per token."""
        entry = self.aggregation_entry
        return None if entry is None else entry.name

    @property
    def aggregation_entry(self) -> Optional[SequenceAggregation]:
        """How the stage aggregates its tokens' values: ``None`` for a token filter (a sequence filter has one)."""
        return None

    def resolved(self) -> FilterStage:
        """This stage's :class:`FilterStage`: its entries looked up once, each by the property of its name."""
        return FilterStage(**{field.name: getattr(self, field.name) for field in dataclasses.fields(FilterStage)})

    @property
    def statistic_entry(self) -> FilterStatistic:
        """The :data:`~nemo_rs_plugin.core.registries.filter_statistics.FILTER_STATISTICS` entry of the statistic."""
        return FILTER_STATISTICS[self.statistic]

    @property
    def bounds(self) -> tuple[Optional[float], Optional[float]]:
        """``(lower, upper)`` in the space the statistic lives in: their logs for a ratio (``log 0 = -inf``)."""
        if self.statistic_entry.log_space:
            return _log_bound(self.lower), _log_bound(self.upper)
        return self.lower, self.upper

    @property
    def label(self) -> str:
        """Name used in metric keys, e.g. ``sequence_ratio_mean``, ``sequence_ratio_largest`` (``agg: max``)."""
        if self.name:
            return self.name
        entry = self.aggregation_entry
        parts = [self.level, self.statistic] + ([entry.label] if entry is not None else [])
        sign = f"{self.advantage_sign}_advantages" if self.advantage_sign is not None else ""
        parts += [LOG_RATIOS[self.log_ratio].label_part, sign, SCOPES[self.applies_to].label_part]
        return "_".join([part for part in parts if part])


class TokenFilter(RejectionFilter):
    """A stage that keeps or rejects single tokens (``level: token``): each token's statistic against the bounds."""

    level: Literal["token"] = "token"
    """``token`` rejects single tokens."""


class SequenceFilter(RejectionFilter):
    """A stage that keeps or rejects whole sequences (``level: sequence``) by an aggregate of their tokens."""

    level: Literal["sequence"] = "sequence"
    """``sequence`` rejects whole sequences."""
    agg: Optional[FilterAgg] = None
    """Sequence filters only: how token values are aggregated (default ``mean``)."""

    @property
    def aggregation_entry(self) -> SequenceAggregation:
        """The :data:`~nemo_rs_plugin.core.registries.aggregations.SEQUENCE_AGGREGATIONS` entry of :attr:`aggregation`.

        Read on every loss call with a sequence filter: a plain lookup of a validated name (the
        ``Literal`` field holds only registry keys); the one place the default aggregation is
        applied (:attr:`aggregation` reads its name).
        """
        return SEQUENCE_AGGREGATIONS[self.agg or DEFAULT_AGGREGATION]

    def _problems(self) -> list[str]:
        problems = super()._problems()
        allowed = AGGS_FOR_STATISTIC[self.statistic]
        if self.agg is not None and self.agg not in allowed:
            problems.append(f"agg: got {self.agg!r} with statistic {self.statistic!r}; allowed: {', '.join(allowed)}")
        return problems


@dataclass(frozen=True)
class FilterStage:
    """A stage's settings resolved to their registry entries, once: what a loss call reads of it.

    The loss builds one per stage where it is built (:meth:`RejectionFilter.resolved`), so that a
    call reads attributes instead of looking the entries up again on every call (about forty
    Python calls with three filters). Each attribute is the :class:`RejectionFilter` property of
    the same name, so the code of a filter (:mod:`nemo_rs_plugin.core.correction.filters`) takes
    either: tests and tools pass the configuration's stages as they are.
    """

    label: str
    level_entry: RejectionLevel
    scope_entry: Scope
    statistic_entry: FilterStatistic
    log_ratio_entry: LogRatio
    sign_entry: Optional[AdvantageSign]
    aggregation_entry: Optional[SequenceAggregation]
    bounds: tuple[Optional[float], Optional[float]]


def resolved_stages(filters: "tuple[RejectionFilter, ...]") -> tuple[FilterStage, ...]:
    """Each stage of ``filters`` (a configuration's ``rejection_sampling``), :meth:`RejectionFilter.resolved`."""
    return tuple(f.resolved() for f in filters)


#: What the code of a filter reads a stage from: its configuration or its resolved settings.
StageSettings = Union["RejectionFilter", FilterStage]

#: Each level's kind of stage (the union's members, keyed as the discriminator reads them).
FILTER_KINDS: dict[str, type[RejectionFilter]] = {"token": TokenFilter, "sequence": SequenceFilter}

#: One ``rejection_sampling`` entry as the loss configuration parses it: the kind its ``level`` names.
AnyRejectionFilter = Annotated[Union[TokenFilter, SequenceFilter], Field(discriminator="level")]

_FILTER_ADAPTER: TypeAdapter[RejectionFilter] = TypeAdapter(AnyRejectionFilter)


def _log_bound(v: Optional[float]) -> Optional[float]:
    if v is None:
        return None
    return -math.inf if v == 0 else math.log(v)


def parse_filter(entry: Any) -> RejectionFilter:
    """One stage from a mapping (or a stage): the kind its ``level`` names, validated."""
    return _FILTER_ADAPTER.validate_python(entry)


def filter_field(name: str) -> Any:
    """The pydantic field ``name`` of whichever kind of stage has it (``None`` if none has)."""
    for kind in FILTER_KINDS.values():
        if name in kind.model_fields:
            return kind.model_fields[name]
    return None


def _init_error(err: Any) -> Any:
    """One of pydantic's reported errors as an error to raise again, at its location."""
    raised = {"type": err["type"], "loc": err["loc"], "input": err["input"]}
    if "ctx" in err:
        raised["ctx"] = err["ctx"]
    return raised


def _located(message: str, loc: tuple, value: Any) -> Any:
    """Our own message as a ``value_error`` at ``loc``, as a validator raising ``ValueError`` there gives."""
    return {"type": "value_error", "loc": loc, "input": value, "ctx": {"error": ValueError(message)}}


def _of_another_level(level: Any, name: Any) -> bool:
    """Whether ``name`` is no field of ``level``'s kind of stage but one of another's (``agg`` on a token filter)."""
    here = FILTER_KINDS.get(str(level))
    return here is not None and str(name) not in here.model_fields and filter_field(str(name)) is not None


def _another_levels_field(level: Any, name: str, value: Any) -> str:
    """The message at a field another level's stages have: where it belongs (pydantic would call it extra).

    It goes at the field's location, so it does not repeat the field's name first.
    """
    elsewhere = [lvl for lvl, kind in FILTER_KINDS.items() if name in kind.model_fields]
    return f"got {value!r} on a {level} filter; {name} is only allowed with level: {' or '.join(elsewhere)}"


def _filter_problems(f: RejectionFilter) -> list[str]:
    problems: list[str] = []
    if f.lower is None and f.upper is None:
        problems.append(
            "a filter needs at least one bound: set lower, upper or both "
            f"(got lower=None, upper=None for level={f.level!r}, statistic={f.statistic!r})"
        )
    for side, v in (("lower", f.lower), ("upper", f.upper)):
        if v is not None and math.isnan(v):
            problems.append(f"{side}: got nan; allowed: a number")
    if f.lower is not None and f.upper is not None and f.lower > f.upper:
        problems.append(f"lower > upper: got lower={f.lower}, upper={f.upper}; need lower <= upper")
    if FILTER_STATISTICS[f.statistic].log_space:
        for side, v in (("lower", f.lower), ("upper", f.upper)):
            if v is not None and v < 0:
                problems.append(f"{side}: got {v}; a ratio bound must be >= 0")
        if f.upper is not None and f.upper <= 0:
            problems.append(f"upper: got {f.upper}; a ratio upper bound must be > 0")
    if f.metric is not None and f.metric != f.statistic:
        problems.append(
            f"metric: got {f.metric!r} with statistic {f.statistic!r}; metric is the deprecated spelling of "
            "statistic: remove metric"
        )
    if f.negative_advantages_only and f.sign_entry is not None and f.sign_entry.sign > 0:
        problems.append(
            "advantage_sign: got 'positive' with negative_advantages_only: true, which rejects only "
            "negative-advantage tokens; allowed: negative or null (or negative_advantages_only: false)"
        )
    level = f.level_entry
    if f.advantage_sign is not None and f.advantage_sign not in level.advantage_signs:
        elsewhere = " or ".join(n for n, e in FILTER_LEVELS.items() if f.advantage_sign in e.advantage_signs)
        problems.append(
            f"advantage_sign: got {f.advantage_sign!r} on a {level.name} filter; allowed there: "
            f"{' or '.join(level.advantage_signs)} or null (a {f.advantage_sign}-advantage condition works on "
            f"{elsewhere} filters)"
        )
    if f.applies_to not in level.scopes:
        elsewhere = " or ".join(n for n, e in FILTER_LEVELS.items() if f.applies_to in e.scopes)
        what = f"applies_to {f.applies_to}" if f.scope_entry.leaves_loss else "a policy-gradient-only rejection"
        problems.append(
            f"applies_to: got {f.applies_to!r} on a {level.name} filter; allowed there: {', '.join(level.scopes)} "
            f"({what} works on {elsewhere} filters)"
        )
    return problems


def current_filter_fields() -> list[str]:
    """A stage's fields, of either kind, by their current names (what a misspelled key is compared with)."""
    names = dict.fromkeys(name for kind in FILTER_KINDS.values() for name in kind.model_fields)
    return [name for name in names if name not in DEPRECATED_FILTER_FIELDS]
