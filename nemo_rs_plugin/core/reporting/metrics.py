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
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Literal, Mapping, NamedTuple, NoReturn, Optional

import torch

from nemo_rs_plugin.core.distributed import NO_GROUPS, SequenceGroups
from nemo_rs_plugin.core.evaluation import ROW_BY_ROW, EvaluationForm
from nemo_rs_plugin.core.masking import EPS
from nemo_rs_plugin.core.reporting.metric_catalog import Diagnostics, MetricSpec, Normalization
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
        catalog: Mapping[str, MetricSpec],
        *,
        counts: Optional[GlobalCounts] = None,
        form: EvaluationForm = ROW_BY_ROW,
        compute_per_call: bool = True,
    ) -> None:
        """A metric set reading each declaration's spec from ``catalog``.

        ``catalog``: every name that may be declared, with its spec (``metric_catalog.declared_specs``
        of the configuration); a name not in it is a ``KeyError`` where it is declared.

        ``counts``: the global denominators (``None`` where the metrics are dropped unevaluated).

        ``form``: the call's :class:`~nemo_rs_plugin.core.evaluation.EvaluationForm`: rows reduced
        stacked (``batched``, the accelerator's) or one by one, each at once (the CPU's); whether
        checks may read a value on the host to skip work (``host_reads``). Decided once, outside
        any compiled region, so that a compiled core specialises on plain bools.

        ``compute_per_call=False``: per-call metrics are declared (their names and normalizations are
        known) but neither computed nor returned, for a caller that would drop them (the
        NeMo-RL loss).
        """
        self.counts = counts
        self.catalog = catalog
        self.form = form
        self.computes_per_call = compute_per_call
        self._declared: dict[str, MetricSpec] = {}  # name -> its catalog spec, in declaration order
        # The values on the device by what stack() divides them by: final values (``add``, and
        # sums whose normalization is ``none``) and the sums per global count. Names and values
        # side by side; in the CPU form every value is a 0-dim tensor, stacked once by stack().
        self._names: dict[_Bucket, list[str]] = {"final": [], "tokens": [], "sequences": []}
        self._parts: dict[_Bucket, list[torch.Tensor]] = {"final": [], "tokens": [], "sequences": []}
        self._flat_masks: list[tuple[torch.Tensor, torch.dtype, torch.Tensor]] = []  # CPU form: mask, dtype, flat cast
        self._masked: list[tuple[torch.Tensor, _Bucket, list]] = []  # GPU form: (mask, bucket, [(names, rows)])
        self._extrema: list[list[_Extreme]] = []  # GPU form: extremes of one penalty, rank and dtype together
        self._derived: list[tuple[str, HostFormula]] = []  # name -> its formula over the transferred values
        self._stacked: Optional[tuple[list[str], torch.Tensor]] = None
        self.diagnostics = Diagnostics()  # the ``_``-prefixed entries, set by finalize()

    # ------------------------------------------------------------------ declaring
    def _declare(self, names: Iterable[str], computed: bool = True) -> Optional[_Bucket]:
        """Record each name once; where their sums wait for :meth:`stack`, ``None`` where they are left uncomputed.

        The bucket is the global count the names' shared normalization divides by, or ``final``
        for ``none`` (a value :meth:`add` records is final whatever its normalization).

        ``computed``: their values are computed on the device (not derived on the host). Names
        declared together share one normalization and per-call flag. One loop, no nested call:
        it runs for every metric of every call.
        """
        if self._stacked is not None:
            raise RuntimeError(f"metrics {list(names)} declared after MetricSet.stack()")
        catalog, declared = self.catalog, self._declared
        shared: Optional[tuple[Normalization, bool]] = None
        for name in names:
            if name in declared:
                raise KeyError(f"metric {name!r} declared twice")
            spec = catalog.get(name)
            if spec is None:
                raise KeyError(f"metric {name!r} is not in the catalog for this configuration ({_CATALOGS})")
            if computed and spec.reduction == "derived":
                raise ValueError(f"metric {name!r} is derived on the host (its catalog entry): declare it by derive()")
            here = (spec.normalization, spec.per_call and not self.computes_per_call)
            if shared is None:
                shared = here
            elif here != shared:
                raise ValueError(f"metrics {list(names)} declared together differ in normalization or per-call flag")
            declared[name] = spec
        if shared is None or shared[1]:
            return None
        return "final" if shared[0] == "none" else shared[0]

    def add(self, name: str, value: torch.Tensor) -> None:
        """Record a final 0-dim value (never synced here, never divided by a count).

        ``min``/``max`` entries may hold ``+-finfo.max`` for "no unit" (see
        :func:`~nemo_rs_plugin.core.masking.extrema_penalty`); :meth:`finalize` reports them as
        ``+-inf``, as NeMo-RL does. Held as given until :meth:`stack`, which stacks every value
        once, without gradient (no ``detach`` or reshape per value).
        """
        if self._declare((name,)) is not None:
            self._names["final"].append(name)
            self._parts["final"].append(value if value.dim() == 0 else value.reshape(()))

    def add_total(self, name: str, total: torch.Tensor) -> None:
        """Record a 0-dim sum; its value is ``total / (count + 1e-8)`` for the count of its normalization."""
        bucket = self._declare((name,))
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
            bucket = self._declare(names)  # after the count: a refused call leaves the names free
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
            bucket = self._declare(names)
            if bucket is not None:
                self._names[bucket] += names
                self._parts[bucket] += totals
            return
        count = len(rows) if isinstance(rows, (list, tuple)) else rows.shape[0]
        if count != len(names):
            _row_count_mismatch(names, count)
        bucket = self._declare(names)
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
        if self._declare((min_name, max_name)) is None:
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

    def derive(self, name: str, formula: HostFormula) -> None:
        """Declare a metric :meth:`finalize` computes on the host from the reduced values.

        ``formula`` is data (:data:`~nemo_rs_plugin.core.reporting.metric_kernels.HostFormula`), not a
        callback: the metric set evaluates it itself. Checks of the inputs that read the
        transferred values are not the metric set's either: the loss runs them on
        :attr:`diagnostics` after :meth:`finalize` (:func:`~nemo_rs_plugin.core.batch.input_checks.judge_inputs`).
        """
        if self._declare((name,), computed=False) is not None:
            self._derived.append((name, formula))

    def add_zero(self, name: str) -> None:
        """Declare a metric that is 0 by construction (a term that is off, a count known to be 0): no tensor."""
        if self._declare((name,), computed=False) is not None:
            self._derived.append((name, _ZERO))

    def normalizations(self, per_call: bool = True) -> dict[str, str]:
        """Public metric name -> the normalization declared with it (what NeMo-RL's ``MetricNormalizer`` reads).

        ``per_call=False`` leaves out the per-call metrics, as :meth:`finalize` does.
        """
        return {name: self._declared[name].normalization for name in self._public_and_private(per_call)[0]}

    def per_call_names(self) -> list[str]:
        """The public per-call metrics, in declaration order."""
        return [name for name, spec in self._declared.items() if spec.per_call and not name.startswith("_")]

    def _public_and_private(self, per_call: bool) -> tuple[list[str], list[str]]:
        """The declared names reported (``per_call=False``: per-call ones left out) and the ``_``-prefixed ones.

        Each in declaration order; one pass, as :meth:`finalize` runs on every loss call.
        """
        public, private = [], []
        for name, spec in self._declared.items():
            if name.startswith("_"):
                private.append(name)
            elif per_call or not spec.per_call:
                public.append(name)
        return public, private

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
        return self._stacked

    def finalize(self, groups: SequenceGroups = NO_GROUPS, per_call: Optional[bool] = None) -> dict[str, float]:
        """Reduce over ``groups``, transfer once, derive; public metrics in declaration order.

        ``per_call=False`` leaves out the per-call metrics (see the module docstring); ``None``:
        included where they were computed.
        """
        if per_call is None or not self.computes_per_call:
            per_call = self.computes_per_call
        names, values = self.stack()
        reductions = [self._declared[n].reduction for n in names]
        if groups.active and names:
            values = reduce_over_ranks(values, reductions, groups)
        host = values.tolist() if names else []  # the one host transfer of the loss call
        out = dict(zip(names, host))
        # Extremes over no unit hold +-finfo.max of their dtype; float32's half range flags
        # them whatever dtype the vector was promoted to.
        half = torch.finfo(torch.float32).max / 2
        for name, red in zip(names, reductions):
            if red == "min" and out[name] >= half:
                out[name] = float("inf")  # no unit: NeMo-RL's sentinel
            elif red == "max" and out[name] <= -half:
                out[name] = float("-inf")
        for name, formula in self._derived:
            out[name] = formula.value if type(formula) is Constant else host_value(formula, out)
        # Private entries (``_name``) ride on the same transfer for the loss's own bookkeeping
        # (its input checks, the run-time rejection warning); NeMo-RL never sees them.
        public, private = self._public_and_private(per_call)
        self.diagnostics = Diagnostics.from_values({n: out[n] for n in private})
        return {n: out[n] for n in public}


def _row_count_mismatch(names: list[str], count: int) -> NoReturn:
    """The one error for a row count that differs from the names' (called only when it does: no call per row)."""
    raise ValueError(f"add_masked_totals: {len(names)} names for {count} rows")


def _joined(parts: list[torch.Tensor], as_views: bool) -> torch.Tensor:
    """One vector of the parts: 0-dim values and ``[k]`` ones (the GPU form's products).

    ``as_views``: one ``cat`` of views (an accelerator's or a compiled graph's: no kernel per
    value); else one ``stack`` where every part is 0-dim (the eager CPU form). One part is a view.
    A half-precision part is widened to float32 first: stacked with an integer count, it would
    round the count to half precision before the metric vector is promoted (the loss computes in
    float32 or float64, so only a direct caller meets this).
    """
    stacked = not as_views
    for i, p in enumerate(parts):
        if p.dtype == torch.bfloat16 or p.dtype == torch.float16:
            parts[i] = p.float()
        if p.dim() != 0:
            stacked = False
    if len(parts) == 1:
        return parts[0].reshape(-1)  # a view: no kernel for one part
    if stacked:
        return torch.stack(parts)
    return torch.cat([q.reshape(1) if q.dim() == 0 else q for q in parts])
