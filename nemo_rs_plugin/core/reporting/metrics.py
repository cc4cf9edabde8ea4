"""Metric collection: few kernels, one host transfer per loss call.

NeMo-RL's loss calls ``.item()`` about fifteen times per call, each a host-device sync on
GPU. Here every metric stays on the device until :meth:`MetricSet.finalize`, which reduces
them over the sequence groups (so every rank reports identical values) and moves them to the
host in a single ``tolist()``.

Most metrics are masked sums over the same few masks divided by the same global count. So
they are declared, not computed, where they are defined, and :meth:`MetricSet.stack`
evaluates them together, in the form that suits the device (:mod:`nemo_rs_plugin.core.evaluation`): on
a GPU, where each small operator is a kernel launch, per mask one ``stack`` and one
matrix-vector product and the masked extrema of one mask in one ``amin`` and one ``amax`` (a
handful of kernels whatever the number of metrics); on a CPU, where copying rows into a matrix
costs more than it saves, one dot product per row, no copy, each mask cast and flattened once
per call. Rows given as an iterator (built for their metric alone) are reduced as each is built,
in both forms: one product per row, one row alive. Either way every value is held as given until
one join of them all (without gradient: no ``detach``, reshape or cast per metric; in eager mode
each such view costs about a microsecond of host time, as much as the small operator it serves),
and each global count's slice of it is divided once.

Each metric carries, from its entry in the metric catalog (``core/reporting/metric_catalog.py``; a
declaration names the metric and gives its value, nothing else):

* a **normalization** (``tokens``, ``sequences`` or ``none``): the global denominator its
  per-microbatch value was divided by, so that summing over microbatches (as NeMo-RL's
  drivers do) gives the global value; ``none`` marks raw counts and extrema;
* a **reduction** over ranks that split a sequence: ``sum`` (partial sums of local tokens),
  ``replicated`` (already identical on every rank), ``max`` or ``min``;
* whether it is **per call**: a value of this call alone that no sum over calls combines (an
  extreme, a ratio of sums, the batch-normalisation factor). NeMo-RL sums every metric over
  the calls of its per-sequence packing wrapper, its microbatches and its ranks (only its own
  ``probs_ratio_*`` extremes by min/max), so the NeMo-RL loss leaves per-call metrics out of
  what it returns (``finalize(per_call=False)``); the host-independent core keeps them for
  callers that make one call per batch (``nemo-rs simulate``, the tests).

The catalog is resolved once per configuration into a :class:`MetricLayout` (the loss builds it
where it is built): each name's bucket (the count it is divided by, ``final``, uncomputed, or
derived on the host), and, once per sequence of declarations, how a call's names are reported.
A declaration is then one lookup in the call's copy of that table, which it takes its name out
of: a name not in the catalog, declared twice, derived but declared as computed or declared after
:meth:`MetricSet.stack` is refused on the line that declares it, with no call per declaration.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Literal, Mapping, NamedTuple, NoReturn, Optional, Union

import torch

from nemo_rs_plugin.core.distributed import NO_GROUPS, SequenceGroups
from nemo_rs_plugin.core.evaluation import ROW_BY_ROW, EvaluationForm
from nemo_rs_plugin.core.masking import EPS
from nemo_rs_plugin.core.reporting.metric_catalog import Diagnostics, MetricSpec
from nemo_rs_plugin.core.reporting.metric_kernels import (
    Constant,
    HostFormula,
    host_value,
    masked_extrema,
    masked_extremum,
    reduce_over_ranks,
    row_totals,
    stacked_masked_totals,
)

__all__ = ["GlobalCounts", "MetricSet"]


_CATALOGS = (
    "core/reporting/metric_catalog.py: METRIC_CATALOG for a returned metric, DIAGNOSTIC_CATALOG for a _-prefixed one"
)


_COUNTS = "MetricSet(catalog, counts=...)"

#: Where a declared value waits for :meth:`MetricSet.stack`: ``final`` (never divided) or the
#: global count it is divided by.
_Bucket = Literal["final", "tokens", "sequences"]
_ZERO = Constant(0.0)


class _Extreme(NamedTuple):
    """One masked extreme pair awaiting :meth:`MetricSet.stack` (GPU form)."""

    min_name: str
    max_name: str
    values: torch.Tensor
    penalty: torch.Tensor


@dataclass(frozen=True)
class GlobalCounts:
    """NeMo-RL's global denominators: valid tokens and valid sequences of the global batch.

    Each is a 0-dim tensor; normalized values are ``total / (count + 1e-8)``, as NeMo-RL's.
    """

    tokens: torch.Tensor
    sequences: torch.Tensor
    #: ``count + 1e-8`` per normalization, computed once per call on first use: the loss's terms
    #: and the metrics divide by the same one (an operator each time otherwise).
    _divisors: dict = field(default_factory=dict, init=False, compare=False, repr=False)

    def divisor(self, count: Literal["tokens", "sequences"]) -> torch.Tensor:
        """``count + 1e-8``, what a total normalized by ``count`` is divided by."""
        divisor = self._divisors.get(count)
        if divisor is None:
            divisor = self._divisors[count] = (self.tokens if count == "tokens" else self.sequences) + EPS
        return divisor


#: What a name's entry in a layout's table is when no value of it is computed on the device.
_DERIVED = "derived"  # computed on the host (derive(), add_zero()); never a bucket
_DERIVED_UNCOMPUTED = "derived, per call, uncomputed"  # the same, a per-call metric the set does not compute
_REFUSED = "refused"  # not declarable here: not in the catalog, declared already, or after stack()
#: The entries a declaration of a value computed on the device (add, add_total, ...) refuses.
_NOT_ON_DEVICE = frozenset((_DERIVED, _DERIVED_UNCOMPUTED, _REFUSED))


class _Report(NamedTuple):
    """How one sequence of declarations is reported (:meth:`MetricLayout.report`): computed once per sequence."""

    reductions: list  # the reduction of each stacked value, in the vector's order
    mins: list[int]  # positions of the ``min`` extremes (their "no unit" sentinel becomes inf)
    maxes: list[int]  # positions of the ``max`` extremes (-inf)
    public: list[str]  # names returned, in declaration order
    public_per_call_off: list[str]  # the same without the per-call metrics
    private: list[str]  # the ``_``-prefixed names (Diagnostics), in declaration order


class MetricLayout:
    """A configuration's catalog resolved once for every call: where each name's value waits.

    Built where the loss is built (one per loss), read by each call's :class:`MetricSet`: a
    declaration is one lookup in a copy of :attr:`buckets` (the name taken out of it, so that a
    second declaration of it finds nothing), and how the call's names are reported (their
    reductions, which are returned, which are diagnostics) is worked out once per sequence of
    declarations (:meth:`report`), not per call.

    ``buckets[name]``: the global count (``tokens``, ``sequences``) its declared sum is divided
    by, ``final`` (its normalization is ``none``), ``None`` (a per-call metric the set does not
    compute), or ``derived`` (computed on the host: only :meth:`MetricSet.derive` and
    :meth:`MetricSet.add_zero` declare it; a per-call one the set does not compute has a marker
    of its own, refused as computed all the same).
    """

    #: Distinct sequences of declarations whose reports are kept (a configuration makes a few:
    #: finite inputs or not, one microbatch or its parts); past it the kept ones are dropped.
    MAX_REPORTS = 64

    def __init__(self, catalog: Mapping[str, MetricSpec], compute_per_call: bool = True) -> None:
        self.catalog = catalog
        self.computes_per_call = compute_per_call
        self.buckets: dict[str, Optional[str]] = {}
        for name, spec in catalog.items():
            uncomputed = spec.per_call and not compute_per_call
            if spec.reduction == "derived":
                self.buckets[name] = _DERIVED_UNCOMPUTED if uncomputed else _DERIVED
            elif uncomputed:
                self.buckets[name] = None
            else:
                self.buckets[name] = "final" if spec.normalization == "none" else spec.normalization
        self._reports: dict[tuple, _Report] = {}

    def __reduce__(self) -> tuple:
        """Pickled as what builds it (NeMo-RL ships its loss to Ray workers), without its reports.

        The table's markers are compared by identity, and an unpickled string is a copy, not the
        module's constant: rebuilt, the table holds the constants again.
        """
        return (MetricLayout, (self.catalog, self.computes_per_call))

    def report(self, declared: list[str], stacked: list[str]) -> _Report:
        """How the names ``declared`` (in order), whose values ``stacked`` are in the vector, are reported."""
        key = (tuple(declared), tuple(stacked))
        found = self._reports.get(key)
        if found is None:
            if len(self._reports) >= self.MAX_REPORTS:
                self._reports.clear()
            catalog = self.catalog
            reductions = [catalog[name].reduction for name in stacked]
            public = [name for name in declared if not name.startswith("_")]
            found = self._reports[key] = _Report(
                reductions,
                [i for i, reduction in enumerate(reductions) if reduction == "min"],
                [i for i, reduction in enumerate(reductions) if reduction == "max"],
                public,
                [name for name in public if not catalog[name].per_call],
                [name for name in declared if name.startswith("_")],
            )
        return found


class MetricSet:
    """Ordered metrics, each declared by name; its normalization and reduction come from the catalog.

    Declare with :meth:`add` (a final value), :meth:`add_total` (a sum, divided by the global
    count its normalization names), :meth:`add_masked_total` (``sum(values * mask)``, likewise
    divided), :meth:`add_masked_extrema` (min and max of ``values`` where ``mask`` is 1),
    :meth:`derive` (computed on the host) and :meth:`add_zero`. :meth:`stack` evaluates them all
    into one vector (on the device, no sync); :meth:`finalize` reduces it over the groups and
    transfers it once.
    """

    def __init__(
        self,
        catalog: Union[Mapping[str, MetricSpec], MetricLayout],
        *,
        counts: Optional[GlobalCounts] = None,
        form: EvaluationForm = ROW_BY_ROW,
        compute_per_call: Optional[bool] = None,
    ) -> None:
        """A metric set reading each declaration's spec from ``catalog``.

        ``catalog``: every name that may be declared, with its spec (``metric_catalog.declared_specs``
        of the configuration), or its :class:`MetricLayout` (what the loss passes: built once); a
        name not in it is a ``KeyError`` where it is declared.

        ``counts``: the global denominators (``None`` where the metrics are dropped unevaluated).

        ``form``: the call's :class:`~nemo_rs_plugin.core.evaluation.EvaluationForm`: rows reduced
        stacked (``batched``, the accelerator's) or one by one, each at once (the CPU's); whether
        checks may read a value on the host to skip work (``host_reads``). Decided once, outside
        any compiled region, so that a compiled core specialises on plain bools.

        ``compute_per_call=False``: per-call metrics are declared (their names and normalizations are
        known) but neither computed nor returned, for a caller that would drop them (the
        NeMo-RL loss). Default: true, or the layout's.
        """
        if isinstance(catalog, MetricLayout):
            if compute_per_call is not None and compute_per_call != catalog.computes_per_call:
                raise ValueError(
                    f"compute_per_call: got {compute_per_call}, but the layout given was built with "
                    f"{catalog.computes_per_call}; build MetricLayout(catalog, compute_per_call={compute_per_call})"
                )
            layout = catalog
        else:
            layout = MetricLayout(catalog, True if compute_per_call is None else compute_per_call)
        self.layout = layout
        self.counts = counts
        self.form = form
        self.computes_per_call = layout.computes_per_call
        # Names not yet declared -> their bucket: each declaration takes its name out (so a second
        # one finds nothing); emptied by stack(), after which nothing can be declared.
        self._free: dict[str, Optional[str]] = dict(layout.buckets)
        self._order: list[str] = []  # the names declared, in declaration order
        # The values on the device by what stack() divides them by: final values (``add``, and
        # sums whose normalization is ``none``) and the sums per global count. Names and values
        # side by side; in the CPU form every value is a 0-dim tensor, stacked once by stack().
        self._names: dict[str, list[str]] = {"final": [], "tokens": [], "sequences": []}
        self._parts: dict[str, list[torch.Tensor]] = {"final": [], "tokens": [], "sequences": []}
        self._flat_masks: list[tuple[torch.Tensor, torch.dtype, torch.Tensor]] = []  # CPU form: mask, dtype, flat cast
        self._masked: list[tuple[torch.Tensor, str, list]] = []  # GPU form: (mask, bucket, [(names, rows)])
        self._extrema: list[list[_Extreme]] = []  # GPU form: extremes of one penalty, rank and dtype together
        self._derived: list[tuple[str, HostFormula]] = []  # name -> its formula over the transferred values
        self._stacked: Optional[tuple[list[str], torch.Tensor]] = None
        self.diagnostics = Diagnostics()  # the ``_``-prefixed entries, set by finalize()

    # ------------------------------------------------------------------ declaring
    def _declare_all(self, names: list[str]) -> Optional[str]:
        """Declare names computed together (a row group, an extreme pair): their shared bucket.

        Where their sums wait for :meth:`stack` (:attr:`MetricLayout.buckets`), ``None`` where they
        are left uncomputed. They must share one normalization and per-call flag; a name refused
        raises before any is declared.
        """
        if not names:
            return None
        if len(set(names)) < len(names):
            repeated = next(name for i, name in enumerate(names) if name in names[:i])
            raise KeyError(f"metric {repeated!r} declared twice")
        free = self._free
        shared = free.get(names[0], _REFUSED)
        for name in names:  # a loop, not a comprehension: no frame of its own (Python 3.11)
            bucket = free.get(name, _REFUSED)
            if bucket in _NOT_ON_DEVICE:
                self._refuse(name, bucket)
            if bucket != shared:
                raise ValueError(f"metrics {list(names)} declared together differ in normalization or per-call flag")
        for name in names:
            del free[name]
        self._order += names
        return shared

    def _refuse(self, name: str, bucket: Optional[str]) -> NoReturn:
        """The error of a declaration the layout does not take (called only then, not per declaration).

        ``bucket``: what the name's entry held (``derived``: computed on the host, left in place).
        """
        if self._stacked is not None:
            raise RuntimeError(f"metric {name!r} declared after MetricSet.stack()")
        if name in self._order:
            raise KeyError(f"metric {name!r} declared twice")
        if bucket is _DERIVED or bucket is _DERIVED_UNCOMPUTED:
            raise ValueError(f"metric {name!r} is derived on the host (its catalog entry): declare it by derive()")
        raise KeyError(f"metric {name!r} is not in the catalog for this configuration ({_CATALOGS})")

    # Each single declaration below takes its name out of ``_free`` itself (one lookup, no call):
    # it runs for every metric of every call. A value computed on the device refuses the entries
    # of _NOT_ON_DEVICE (derived, or not declarable); derive() refuses only the latter.

    def add(self, name: str, value: torch.Tensor) -> None:
        """Record a final 0-dim value (never synced here, never divided by a count).

        ``min``/``max`` entries may hold ``+-finfo.max`` for "no unit" (see
        :func:`~nemo_rs_plugin.core.masking.extrema_penalty`); :meth:`finalize` reports them as
        ``+-inf``, as NeMo-RL does. Held as given until :meth:`stack`, which stacks every value
        once, without gradient (no ``detach`` or reshape per value).
        """
        bucket = self._free.get(name, _REFUSED)
        if bucket in _NOT_ON_DEVICE:
            self._refuse(name, bucket)
        del self._free[name]
        self._order.append(name)
        if bucket is not None:
            self._names["final"].append(name)
            self._parts["final"].append(value if value.dim() == 0 else value.reshape(()))

    def add_total(self, name: str, total: torch.Tensor) -> None:
        """Record a 0-dim sum; its value is ``total / (count + 1e-8)`` for the count of its normalization."""
        bucket = self._free.get(name, _REFUSED)
        if bucket in _NOT_ON_DEVICE:
            self._refuse(name, bucket)
        del self._free[name]
        self._order.append(name)
        if bucket is not None:
            self._names[bucket].append(name)
            self._parts[bucket].append(total if total.dim() == 0 else total.reshape(()))

    def add_masked_total(self, name: str, values: torch.Tensor, mask: torch.Tensor) -> None:
        """Record ``sum(values * mask)`` (divided as in :meth:`add_total`); ``values`` broadcasts to ``mask``.

        In the GPU form, metrics sharing the same ``mask`` tensor and normalization are
        evaluated together in :meth:`stack` (one ``stack`` and one matrix-vector product per run
        of rows given one by one); in the CPU form each is reduced here, at once.
        """
        self.add_masked_totals([name], [values], mask)

    def add_masked_totals(self, names: list[str], rows: Iterable[torch.Tensor], mask: torch.Tensor) -> None:
        """:meth:`add_masked_total` for each row of ``rows``; the names share one normalization.

        ``rows``: a list or tuple of tensors, a stacked ``[len(names), *mask.shape]`` one, or an
        iterator of tensors (built and reduced one row at a time, in both forms: one row alive).
        In the GPU form a stacked one is reduced here, by its one matrix-vector product, and not
        held; rows given in a list wait for :meth:`stack` with the other rows of their mask.
        """
        if not self.form.batched:
            # CPU form: reduced now, so each [B, T] row can be freed as soon as its caller drops
            # it (rows held until stack() raised the peak memory of an eager call; on the CPU a
            # fresh [B, T] allocation costs far more than the operator on reused memory).
            if isinstance(rows, torch.Tensor):
                rows = rows.unbind(0)
            totals: list[torch.Tensor] = []
            row_totals(rows, mask, self._flat_masks, totals)
            if len(totals) != len(names):
                _row_count_mismatch(names, len(totals))
            bucket = self._declare_all(names)  # after the count: a refused call leaves the names free
            if bucket is not None:  # else per-call metrics left uncomputed
                self._names[bucket] += names
                self._parts[bucket] += totals
            return
        if not isinstance(rows, (list, tuple, torch.Tensor)):
            # An iterator: each row's product as it is built, so that one row is alive at a time
            # (two rows built at once were the GPU form's peak memory: the KL errors both ways).
            with torch.no_grad():
                totals = [stacked_masked_totals([row.unsqueeze(0)], mask) for row in rows]
            if len(totals) != len(names):
                _row_count_mismatch(names, len(totals))
            bucket = self._declare_all(names)
            if bucket is not None:
                self._names[bucket] += names
                self._parts[bucket] += totals
            return
        count = len(rows) if isinstance(rows, (list, tuple)) else rows.shape[0]
        if count != len(names):
            _row_count_mismatch(names, count)
        bucket = self._declare_all(names)
        if bucket is None:
            return
        if isinstance(rows, torch.Tensor) and rows.shape[1:] == mask.shape:
            # Already one [k, *mask.shape] tensor: its one matrix-vector product now, as stack()
            # would run it, so the k [B, T] rows are not held until then (the GPU form's peak
            # memory: the stacked non-finite masks and positive-log-prob rows, 12 [B, T] of them).
            with torch.no_grad():
                self._names[bucket] += names
                self._parts[bucket].append(stacked_masked_totals([rows], mask))
            return
        # Grouped by the mask *object* (identity, not id(): traceable by torch.compile).
        for group_mask, group_bucket, entries in self._masked:
            if group_mask is mask and group_bucket == bucket:
                entries.append((names, rows))
                return
        self._masked.append((mask, bucket, [(names, rows)]))

    def add_masked_extrema(self, min_name: str, max_name: str, values: torch.Tensor, penalty: torch.Tensor) -> None:
        """Record the min and max of finite ``values`` where the mask behind ``penalty`` is 1.

        ``penalty`` is :func:`~nemo_rs_plugin.core.masking.extrema_penalty` of the mask (shared
        between metrics of one mask). With an empty mask the values are the ``+-finfo.max``
        sentinels that :meth:`finalize` reports as ``(inf, -inf)``.
        """
        if self._declare_all([min_name, max_name]) is None:
            return
        if not self.form.batched:  # CPU form: reduced now (see add_masked_totals), final values as add() records them
            self._names["final"] += (min_name, max_name)
            self._parts["final"] += masked_extremum(values, penalty)
            return
        # Extremes of one penalty (one mask: found by identity, traceable by torch.compile),
        # rank and dtype stack together; the penalty broadcasts over them, never stacked (a
        # [B, T] copy per extreme: the GPU form's peak memory). Not the shape itself: hashing a
        # symbolic size would pin it in a compiled graph.
        extreme = _Extreme(min_name, max_name, values.detach(), penalty)
        for group in self._extrema:
            first = group[0]
            if first.penalty is penalty and first.values.dim() == values.dim() and first.values.dtype == values.dtype:
                group.append(extreme)
                return
        self._extrema.append([extreme])

    def derive(self, name: str, formula: HostFormula = _ZERO) -> None:
        """Declare a metric :meth:`finalize` computes on the host from the reduced values (default: 0).

        ``formula`` is data (:data:`~nemo_rs_plugin.core.reporting.metric_kernels.HostFormula`), not a
        callback: the metric set evaluates it itself. Checks of the inputs that read the
        transferred values are not the metric set's either: the loss runs them on
        :attr:`diagnostics` after :meth:`finalize` (:func:`~nemo_rs_plugin.core.batch.input_checks.judge_inputs`).
        """
        bucket = self._free.get(name, _REFUSED)
        if bucket is _REFUSED:
            self._refuse(name, bucket)
        del self._free[name]
        self._order.append(name)
        if bucket is not None and bucket is not _DERIVED_UNCOMPUTED:
            self._derived.append((name, formula))

    #: ``add_zero(name)``: a metric that is 0 by construction (a term that is off, a count known to
    #: be 0), no tensor; :meth:`derive` with its default formula (one call, not two).
    add_zero = derive

    def normalizations(self, per_call: bool = True) -> dict[str, str]:
        """Public metric name -> the normalization declared with it (what NeMo-RL's ``MetricNormalizer`` reads).

        ``per_call=False`` leaves out the per-call metrics, as :meth:`finalize` does.
        """
        catalog = self.layout.catalog
        return {
            name: catalog[name].normalization
            for name in self._order
            if not name.startswith("_") and (per_call or not catalog[name].per_call)
        }

    def per_call_names(self) -> list[str]:
        """The public per-call metrics, in declaration order."""
        catalog = self.layout.catalog
        return [name for name in self._order if catalog[name].per_call and not name.startswith("_")]

    # ------------------------------------------------------------------ evaluating
    def stack(self) -> tuple[list[str], torch.Tensor]:
        """``(names, values)``: every device-side metric in one ``[M]`` tensor (no sync).

        Called at the end of the loss's tensor core (so a compiled core evaluates the metrics
        in its graph); :meth:`finalize` calls it if nobody did. Without gradient: the metrics
        are read, never differentiated, and no value needs a ``detach`` of its own.
        """
        if self._stacked is not None:
            return self._stacked
        names, parts = self._names, self._parts
        with torch.no_grad():
            # The GPU form's rows, one product per mask, then its extremes, one amin and one amax
            # per penalty, rank and dtype: each group let go as soon as it is reduced, so that the [B, T]
            # rows of one group are not alive beside the stack of the next (the call's peak memory).
            masked, self._masked = self._masked, []
            while masked:
                mask, bucket, entries = masked.pop()
                names[bucket] += [n for group, _ in entries for n in group]
                parts[bucket].append(stacked_masked_totals([rows for _, rows in entries], mask))
                del mask, entries
            extrema, self._extrema = self._extrema, []
            while extrema:
                extremes = extrema.pop()
                lows, highs = masked_extrema([e.values for e in extremes], [e.penalty for e in extremes])
                names["final"] += [e.min_name for e in extremes] + [e.max_name for e in extremes]
                parts["final"] += [lows, highs]
                del extremes
            # Every value in one vector, bucket after bucket, by one join: a cat of views on an
            # accelerator and in a compiled graph (a view is free there, a kernel is not), one
            # stack of the 0-dim values eager on the CPU (there each view costs about as much as
            # the small operator it serves). Then each global count's slice divided in place.
            order: list[_Bucket] = [bucket for bucket in ("final", "tokens", "sequences") if parts[bucket]]
            values = [p for bucket in order for p in parts[bucket]]
            if not values:
                self._stacked = ([], torch.zeros(0))
            else:
                vector = _joined(values, self.form.batched or self.form.compiled)
                if vector.dtype != torch.float32 and vector.dtype != torch.float64:
                    # Integer parts only: a fresh tensor in the dtype a division by the count gives
                    # (its divisor's), float32 where nothing is divided.
                    divided = [bucket for bucket in order if bucket != "final"]
                    counts = self.counts
                    dtype = counts.divisor(divided[0]).dtype if divided and counts is not None else torch.float32
                    vector = vector.to(dtype)
                start = 0
                for bucket in order:
                    end = start + len(names[bucket])
                    if bucket != "final":
                        if self.counts is None:
                            raise ValueError(f"metrics normalized by {bucket!r} need the global counts ({_COUNTS})")
                        if len(values) > 1:
                            vector[start:end].div_(self.counts.divisor(bucket))  # the join's own tensor
                        else:  # one value joins as a view of the declared tensor: not divided in place
                            vector = vector / self.counts.divisor(bucket)
                    start = end
                self._stacked = ([n for bucket in order for n in names[bucket]], vector)
        # Drop the [B, T] rows, masks and penalties: only the [M] vector outlives the tensor
        # core (a compiled core would otherwise return every one of them as a graph output).
        # The counts too: views of the caller's tensors, which as outputs of a compiled core
        # are rebuilt as aliases of its inputs after every call.
        self._names, self._parts = (
            {"final": [], "tokens": [], "sequences": []},
            {"final": [], "tokens": [], "sequences": []},
        )
        self._flat_masks, self._masked, self._extrema = [], [], []
        self.counts = None
        self._free = {}  # nothing can be declared after the stack
        return self._stacked

    def finalize(self, groups: SequenceGroups = NO_GROUPS, per_call: Optional[bool] = None) -> dict[str, float]:
        """Reduce over ``groups``, transfer once, derive; public metrics in declaration order.

        ``per_call=False`` leaves out the per-call metrics (see the module docstring); ``None``:
        included where they were computed.
        """
        if per_call is None or not self.computes_per_call:
            per_call = self.computes_per_call
        names, values = self.stack()
        report = self.layout.report(self._order, names)  # worked out once per sequence of declarations
        if groups.active and names:
            values = reduce_over_ranks(values, report.reductions, groups)
        host = values.tolist() if names else []  # the one host transfer of the loss call
        # Extremes over no unit hold +-finfo.max of their dtype; float32's half range flags
        # them whatever dtype the vector was promoted to.
        half = torch.finfo(torch.float32).max / 2
        for i in report.mins:
            if host[i] >= half:
                host[i] = float("inf")  # no unit: NeMo-RL's sentinel
        for i in report.maxes:
            if host[i] <= -half:
                host[i] = float("-inf")
        out = dict(zip(names, host))
        for name, formula in self._derived:
            out[name] = formula.value if type(formula) is Constant else host_value(formula, out)
        # Private entries (``_name``) ride on the same transfer for the loss's own bookkeeping
        # (its input checks, the run-time rejection warning); NeMo-RL never sees them.
        self.diagnostics = Diagnostics.from_values({n: out[n] for n in report.private})
        return {n: out[n] for n in (report.public if per_call else report.public_per_call_off)}


def _row_count_mismatch(names: list[str], count: int) -> NoReturn:
    """The one error for a row count that differs from the names' (called only when it does: no call per row)."""
    raise ValueError(f"add_masked_totals: {len(names)} names for {count} rows")


def _joined(parts: list[torch.Tensor], as_views: bool) -> torch.Tensor:
    """One vector of the parts: 0-dim values and ``[k]`` ones (the GPU form's products).

    ``as_views``: one ``cat`` of views (an accelerator's or a compiled graph's: no kernel per
    value); else one ``stack`` of the 0-dim values (the eager CPU form, where every declaration
    is reduced or reshaped to 0-dim as it is made). One part is a view.

    A half-precision part is widened to float32 first: joined with an integer count, it would
    round the count to half precision before the vector is promoted (the loss computes in float32
    or float64, so only a direct caller meets this). In the CPU form's stack, where a part is
    floating and the dtypes differ, every part is cast first to the dtype the stack would promote
    them to (float64 where one part is, else float32): a stack of mixed dtypes copies every part
    through a slower path (23 us against 6.5 for 30 values; the casts of the loss's four integer
    counts cost 4). The ``cat`` promotes them itself: a cast there is an operator (a kernel on an
    accelerator) per integer part. Integer parts alone are joined as they are (``MetricSet.stack``
    casts the vector to its divisor's dtype). The dtypes are read once per part: each read is a
    Python attribute access, and a few per part cost as much as the stack.
    """
    dtypes = set()
    for p in parts:  # loops, not comprehensions: no frame of their own (Python 3.11)
        dtypes.add(p.dtype)
    if torch.float16 in dtypes or torch.bfloat16 in dtypes:
        parts = [p.float() if p.dtype == torch.float16 or p.dtype == torch.bfloat16 else p for p in parts]
        dtypes = {torch.float32 if d == torch.float16 or d == torch.bfloat16 else d for d in dtypes}
    if len(parts) == 1:
        return parts[0].reshape(-1)  # a view: no kernel for one part
    if as_views:
        return torch.cat([q.reshape(1) if q.dim() == 0 else q for q in parts])
    if len(dtypes) > 1:
        floating = False
        for dtype in dtypes:
            floating = floating or dtype.is_floating_point
        if floating:
            wide = torch.float64 if torch.float64 in dtypes else torch.float32
            parts = [p if p.dtype == wide else p.to(wide) for p in parts]
    return torch.stack(parts)
