"""MetricSet: metrics declared where they are defined, evaluated together, transferred once."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from nemo_rs_plugin.core.evaluation import EvaluationForm
from nemo_rs_plugin.core.masking import EPS, extrema_penalty
from nemo_rs_plugin.core.reporting.metric_catalog import MetricSpec
from nemo_rs_plugin.core.reporting.metric_kernels import ClippedExtreme, EffectiveSampleSize
from nemo_rs_plugin.core.reporting.metrics import GlobalCounts, MetricLayout, MetricSet
from tests.support.references import tensors_reachable

#: The specs these tests declare under (the loss reads its own from metric_catalog.declared_specs).
RAW = MetricSpec("none", "sum", False)
LOW, HIGH = MetricSpec("none", "min", True), MetricSpec("none", "max", True)
DERIVED = MetricSpec("none", "derived", False)


def _metrics(counts=None, batched=False, **specs: MetricSpec) -> MetricSet:
    """A metric set whose catalog is ``specs`` (every name the test declares)."""
    return MetricSet(specs, counts=counts, form=EvaluationForm(batched=batched))


class EveryOperator(TorchDispatchMode):
    """Counts each aten operator dispatched inside it, by name (``counts``)."""

    def __init__(self):
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket).removeprefix("aten.")
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(5, 3, 7, generator=g)
    mask = (torch.rand(3, 7, generator=g) > 0.3).float()
    return values, mask


def test_masked_totals_equal_their_formulas_and_are_divided_by_their_count():
    values, mask = _batch()
    counts = GlobalCounts(tokens=torch.tensor(40.0), sequences=torch.tensor(3.0))
    tokens = MetricSpec("tokens", "sum", False)
    m = _metrics(
        counts,
        a=tokens,
        b=tokens,
        c=MetricSpec("sequences", "replicated", False),
        d=RAW,
        e=tokens,
        f=HIGH._replace(per_call=False),
    )
    m.add_masked_totals(["a", "b"], values[:2], mask)
    m.add_masked_total("c", values[2], mask)
    m.add_masked_total("d", values[3], mask)
    m.add_total("e", values[4].sum())
    m.add("f", values[4].amax())
    out = m.finalize()
    want = {
        "a": (values[0] * mask).sum() / (40 + EPS),
        "b": (values[1] * mask).sum() / (40 + EPS),
        "c": (values[2] * mask).sum() / (3 + EPS),
        "d": (values[3] * mask).sum(),
        "e": values[4].sum() / (40 + EPS),
        "f": values[4].amax(),
    }
    assert list(out) == list(want)  # declaration order
    for name, value in want.items():
        assert out[name] == pytest.approx(value.item(), rel=1e-6, abs=1e-6), name
    assert m.normalizations() == {
        "a": "tokens",
        "b": "tokens",
        "c": "sequences",
        "d": "none",
        "e": "tokens",
        "f": "none",
    }


def test_a_mask_shared_by_many_metrics_costs_one_product():
    """The GPU form: one matrix-vector product for every metric of a mask (kernel launches dominate)."""
    values, mask = _batch()
    counts = GlobalCounts(tokens=torch.tensor(10.0), sequences=torch.tensor(3.0))
    m = _metrics(counts, True, **{f"m{i}": MetricSpec("tokens", "sum", False) for i in range(5)})
    for i in range(5):
        m.add_masked_total(f"m{i}", values[i], mask)
    from benchmarks.bench_ops import OpCounter

    with OpCounter() as counter:
        m.stack()
    assert counter.counts["mv"] == 1 and counter.counts["dot"] == 0 and counter.counts["div"] == 1, counter.counts


def test_masked_extrema_with_sentinels_for_an_empty_mask():
    values, mask = _batch()
    empty = torch.zeros_like(mask)
    m = _metrics(lo=LOW, hi=HIGH, empty_lo=LOW, empty_hi=HIGH)
    m.add_masked_extrema("lo", "hi", values[0], extrema_penalty(mask))
    m.add_masked_extrema("empty_lo", "empty_hi", values[1], extrema_penalty(empty))
    out = m.finalize()
    kept = values[0][mask.bool()]
    assert out["lo"] == pytest.approx(kept.min().item()) and out["hi"] == pytest.approx(kept.max().item())
    assert out["empty_lo"] == math.inf and out["empty_hi"] == -math.inf


def test_derived_metrics_are_data_evaluated_on_the_transferred_values():
    """Derived metrics are formulas (``metric_kernels.HostFormula``), evaluated by the metric set
    itself on the reduced values, hidden entries included; hidden entries are not returned."""
    hidden = {"mean": RAW, "sq_mean": RAW, "_ess_units": RAW, "_token_mask_min": LOW, "_token_mask_other_min": LOW}
    m = _metrics(**hidden, ess=DERIVED, clipped=DERIVED, clipped_empty=DERIVED, off=RAW)
    m.add("mean", torch.tensor(0.5))
    m.add("sq_mean", torch.tensor(0.5))
    m.add("_ess_units", torch.tensor(2.0))
    m.add("_token_mask_min", torch.tensor(0.25))
    m.add("_token_mask_other_min", torch.tensor(float("inf")))
    m.derive("ess", EffectiveSampleSize("mean", "sq_mean", "_ess_units"))
    m.derive("clipped", ClippedExtreme("_token_mask_min", 0.5, 2.0))
    m.derive("clipped_empty", ClippedExtreme("_token_mask_other_min", 0.5, 2.0))
    m.add_zero("off")
    out = m.finalize()
    # (sum w)^2 / (n sum w^2) = 0.25 / (2 * 0.5); a clipped extreme; a sentinel stays; a constant
    assert out == {"mean": 0.5, "sq_mean": 0.5, "ess": 0.25, "clipped": 0.5, "clipped_empty": math.inf, "off": 0.0}
    # the hidden entries come back as the typed record, not as metrics
    found = m.diagnostics
    assert (found.ess_units, found.token_mask_min, found.token_mask_other_min) == (2.0, 0.25, math.inf)
    no_units = _metrics(mean=RAW, sq_mean=RAW, _ess_units=RAW, ess=DERIVED)
    for name in ("mean", "sq_mean", "_ess_units"):
        no_units.add(name, torch.tensor(0.0))
    no_units.derive("ess", EffectiveSampleSize("mean", "sq_mean", "_ess_units"))
    assert no_units.finalize() == {"mean": 0.0, "sq_mean": 0.0, "ess": 0.0}


def test_declaration_mistakes_are_errors():
    m = _metrics(x=RAW, z=RAW, ess=DERIVED, t=MetricSpec("tokens", "sum", False))
    m.add("x", torch.tensor(1.0))
    with pytest.raises(KeyError, match="declared twice"):
        m.add("x", torch.tensor(2.0))
    with pytest.raises(KeyError, match="not in the catalog"):
        m.add("y", torch.tensor(1.0))
    with pytest.raises(ValueError, match="derived on the host"):
        m.add("ess", torch.tensor(1.0))
    with pytest.raises(ValueError, match="differ in normalization"):
        m.add_masked_totals(["z", "t"], torch.zeros(2, 4), torch.ones(4))
    with pytest.raises(ValueError, match="global counts"):
        bad = _metrics(y=MetricSpec("tokens", "sum", False))
        bad.add_total("y", torch.tensor(1.0))
        bad.stack()
    m.stack()
    with pytest.raises(RuntimeError, match="after MetricSet.stack"):
        m.add("z", torch.tensor(1.0))


@pytest.mark.parametrize(
    "cfg",
    [
        {
            "use_importance_sampling_correction": True,
            "truncated_importance_sampling_type": "tis",
            "truncated_importance_sampling_ratio": 2.0,
        },
        {
            "reference_policy_kl_penalty": 0.01,
            "use_importance_sampling_correction": True,
            "is_correction_level": "sequence_mean",
            "rejection_sampling": [
                {"level": "sequence", "statistic": "ratio", "agg": "mean", "lower": 0.99, "upper": 1.01},
                {"level": "token", "statistic": "kl_k3", "upper": 0.01},
            ],
        },
    ],
    ids=["token-tis", "pipeline"],
)
@pytest.mark.parametrize("finite", [False, True], ids=["nonfinite-inputs", "finite-inputs"])
@pytest.mark.parametrize("kl_type", ["k1", "k2", "k3"])
def test_batched_and_row_by_row_evaluation_agree(cfg, finite, kl_type):
    """The GPU form (rows stacked) and the CPU form (row by row) give the same loss and metrics;
    with finite inputs the eager CPU form uses them as given (no sanitising, every count 0)."""
    from benchmarks.bench_ops import make_inputs
    from nemo_rs_plugin import CorrectedPGLoss

    curr, data, gvs, gvt = make_inputs(3, 40)
    if not finite:
        data["prev_logprobs"][0, 5] = math.nan  # a non-finite input on a valid token
        data["advantages"][1, 7] = math.inf
        data["generation_logprobs"][2, 1] = math.nan  # masked (token_mask 0): counted by neither form
    results = {}
    for form in ("0", "1"):
        lp = curr.clone().requires_grad_(True)
        loss, metrics = CorrectedPGLoss({**cfg, "reference_policy_kl_type": kl_type}, batched_metrics=form == "1")(
            lp, dict(data), gvs, gvt
        )
        loss.backward()
        results[form] = (loss.item(), lp.grad, metrics)
    (loss0, grad0, m0), (loss1, grad1, m1) = results["0"], results["1"]
    assert loss0 == pytest.approx(loss1, rel=1e-6)
    torch.testing.assert_close(grad0, grad1)
    assert list(m0) == list(m1)
    for name in m0:
        assert m0[name] == pytest.approx(m1[name], rel=1e-5, abs=1e-9), name
    assert m0["nonfinite_advantages_count"] == (0 if finite else 1)
    assert m0["nonfinite_log_ratio_count"] == (0 if finite else 1)


def test_only_the_metric_vector_outlives_stack():
    """The [B, T] rows, masks and penalties are released by stack(): a compiled core returns the
    MetricSet, and anything it still held would become a graph output kept alive until finalize."""
    import gc
    import weakref

    values, mask = _batch()
    row = values[0].clone()
    penalty = extrema_penalty(mask)
    counts = GlobalCounts(tokens=torch.tensor(10.0), sequences=torch.tensor(3.0))
    m = _metrics(counts, total=MetricSpec("tokens", "sum", False), lo=LOW, hi=HIGH)
    m.add_masked_total("total", row, mask)
    m.add_masked_extrema("lo", "hi", row, penalty)
    refs = [weakref.ref(row), weakref.ref(penalty)]
    del row, penalty
    m.stack()
    gc.collect()
    assert all(r() is None for r in refs)
    assert set(m.finalize()) == {"total", "lo", "hi"}


def test_sentinels_survive_promotion_to_float64():
    m = _metrics(count=RAW, lo=LOW, hi=HIGH)
    m.add("count", torch.tensor(3.0, dtype=torch.float64))
    empty = torch.zeros(4)
    m.add_masked_extrema("lo", "hi", torch.randn(4), extrema_penalty(empty))
    out = m.finalize()
    assert out == {"count": 3.0, "lo": math.inf, "hi": -math.inf}


def test_names_must_match_rows_and_derived_names_are_declared_once():
    m = _metrics(a=RAW, b=RAW, d=RAW)
    with pytest.raises(ValueError, match="2 names for 3 rows"):
        m.add_masked_totals(["a", "b"], torch.zeros(3, 4), torch.ones(4))
    for batched in (False, True):  # an empty iterator; the names stay free for a correct call
        other = _metrics(batched=batched, a=RAW)
        with pytest.raises(ValueError, match="1 names for 0 rows"):
            other.add_masked_totals(["a"], iter([]), torch.ones(4))
        other.add_masked_total("a", torch.ones(4), torch.ones(4))
        assert other.finalize() == {"a": 4.0}
    m.add_zero("d")
    with pytest.raises(KeyError, match="declared twice"):
        m.add("d", torch.tensor(1.0))


def test_the_cpu_form_reduces_each_row_where_it_is_declared():
    """Row by row (the CPU form), a ``[B, T]`` row is reduced when it is declared and not held: the
    peak memory of an eager call is then one row, not every metric's (on the CPU each fresh
    ``[B, T]`` allocation beyond the retained heap pays page faults; docs/performance.md). An
    iterator of rows is consumed one row at a time. The GPU form holds its rows until ``stack``."""
    import weakref

    values, mask = _batch()
    taken = []

    storages = []  # data pointers of every row given: no tensor the set holds may share one

    def make(i: int) -> torch.Tensor:
        assert all(ref() is None for ref in taken), f"a row is still held when row {i} is asked for"
        row = values[i].clone()
        taken.append(weakref.ref(row))
        storages.append(row.untyped_storage().data_ptr())
        return row

    def held_storages(metric_set: MetricSet) -> set:
        return {t.untyped_storage().data_ptr() for t in tensors_reachable(metric_set)}

    cpu = _metrics(a=RAW, b=RAW, c=RAW, lo=LOW, hi=HIGH)
    cpu.add_masked_totals(["a", "b", "c"], (make(i) for i in range(3)), mask)
    extremum_row = values[3].clone()
    held = weakref.ref(extremum_row)
    storages.append(extremum_row.untyped_storage().data_ptr())
    cpu.add_masked_extrema("lo", "hi", extremum_row, extrema_penalty(mask))
    del extremum_row
    assert held() is None and all(ref() is None for ref in taken)
    assert not held_storages(cpu) & set(storages)  # not even a detached alias of a row
    out = cpu.finalize()
    for i, name in enumerate("abc"):
        assert math.isclose(out[name], float((values[i] * mask).sum()), rel_tol=1e-6)
    assert out["lo"] == float(values[3][mask > 0].min()) and out["hi"] == float(values[3][mask > 0].max())

    gpu = _metrics(batched=True, a=RAW)
    row = values[0].clone()
    kept = weakref.ref(row)
    gpu.add_masked_total("a", row, mask)
    del row
    assert kept() is not None  # stacked with the others at the end
    assert math.isclose(gpu.finalize()["a"], float((values[0] * mask).sum()), rel_tol=1e-6)


def test_the_gpu_form_holds_no_stacked_group_and_lets_each_group_go_once_reduced(monkeypatch):
    """The GPU form's peak memory (issue 52): a group given as one ``[k, B, T]`` tensor (the
    non-finite masks, the positive-log-prob rows) is reduced where it is declared, by the same one
    matrix-vector product ``stack()`` would run, so it is not held beside every later row; and in
    ``stack()`` the rows of a mask are let go once their product is taken, before the extremes are
    stacked (benchmarks/bench_memory.py: 1.80x -> 1.31x NeMo-RL's peak for token TIS, these two alone)."""
    import gc
    import weakref

    from benchmarks.bench_ops import OpCounter
    from nemo_rs_plugin.core.reporting import metrics as metrics_module

    values, mask = _batch()
    m = _metrics(batched=True, a=RAW, b=RAW, c=RAW, lo=LOW, hi=HIGH)
    stacked = values[:2].clone()
    group = weakref.ref(stacked)
    with OpCounter() as counter:
        m.add_masked_totals(["a", "b"], stacked, mask)
    assert counter.counts["mv"] == 1, counter.counts  # reduced here: one product, as stack() ran it
    del stacked
    gc.collect()
    assert group() is None

    loose = values[2].clone()
    loose_ref = weakref.ref(loose)
    m.add_masked_total("c", loose, mask)
    m.add_masked_extrema("lo", "hi", values[3], extrema_penalty(mask))
    del loose
    assert loose_ref() is not None  # a loose row waits for stack(): one product for every row of its mask
    alive_at_extrema = []
    reduce_extrema = metrics_module.masked_extrema

    def observing(vals, penalties):
        gc.collect()
        alive_at_extrema.append(loose_ref() is not None)
        return reduce_extrema(vals, penalties)

    monkeypatch.setattr(metrics_module, "masked_extrema", observing)
    out = m.finalize()
    assert alive_at_extrema == [False]  # the loose row was let go before the extremes were stacked
    for i, name in enumerate("abc"):
        assert math.isclose(out[name], float((values[i] * mask).sum()), rel_tol=1e-6)
    assert out["lo"] == float(values[3][mask > 0].min()) and out["hi"] == float(values[3][mask > 0].max())


def test_the_cpu_form_casts_each_mask_once_and_holds_values_without_a_copy():
    """Row by row, a mask is cast and flattened once per call however many rows it reduces, each
    row costs one dot product, and values are held as given: no ``detach``, reshape or cast per
    metric (in eager mode each is about a microsecond of host time, as much as the small operator
    it serves: docs/performance.md#per-call-cost-under-packing)."""
    values, mask = _batch()
    rows = list(values.double().unbind(0))  # float64 rows over a float32 mask: the mask is cast
    weight = torch.ones((), requires_grad=True)
    with_grad = values[0].sum() * weight  # a value with a gradient: the set must not detach it itself
    counts = GlobalCounts(tokens=torch.tensor(10.0), sequences=torch.tensor(3.0))
    m = _metrics(counts, v=RAW, **{f"r{i}": MetricSpec("tokens", "sum", False) for i in range(5)})
    with EveryOperator() as ops:
        for i, row in enumerate(rows):
            m.add_masked_total(f"r{i}", row, mask)
        m.add("v", with_grad)
        names, vector = m.stack()
    # the mask, once; and the float32 value, once, to the float64 the vector promotes to (a stack of
    # mixed dtypes would copy every part through its slow path)
    assert ops.counts.get("_to_copy", 0) == 2, ops.counts
    assert ops.counts.get("dot", 0) == 5, ops.counts
    assert ops.counts.get("detach", 0) == 0, ops.counts
    assert not vector.requires_grad
    want = {f"r{i}": float((rows[i] * mask.double()).sum() / (10 + EPS)) for i in range(5)}
    want["v"] = float(with_grad.detach())
    assert dict(zip(names, vector.tolist())) == pytest.approx(want)


def test_an_integer_count_beside_a_half_precision_value_keeps_its_digits():
    """The metric vector is float32 (float64 with a float64 part): an integer count stacked beside a
    bfloat16 value must be promoted with the vector, not rounded to bfloat16 on the way."""
    counts = GlobalCounts(tokens=torch.tensor(1.0), sequences=torch.tensor(1.0))
    m = _metrics(counts, count=RAW, half=RAW, total=MetricSpec("tokens", "sum", False))
    m.add("count", torch.tensor(1_000_001))
    m.add("half", torch.tensor(0.5, dtype=torch.bfloat16))
    m.add_total("total", torch.tensor(2.0))
    out = m.finalize()
    assert out["count"] == 1_000_001.0 and out["half"] == 0.5


@pytest.mark.parametrize("batched", [False, True], ids=["cpu-form", "gpu-form"])
def test_integer_parts_are_cast_once_before_the_cpu_forms_stack_and_promoted_by_the_gpu_forms_cat(batched):
    """In the CPU form, integer values beside float ones are cast to the float dtype the stack
    promotes to, one cast each, before one stack (a stack of mixed dtypes copies every part through
    torch's slow path); in the GPU form the one cat promotes them itself (a cast would be a kernel
    per part). The values are those of the promotion either way (float64 where a part is float64)."""
    for wide in (torch.float32, torch.float64):
        m = _metrics(None, batched, **{f"v{i}": RAW for i in range(6)})
        values = [torch.tensor(0.25, dtype=wide), torch.tensor(7), torch.tensor(0.5, dtype=wide), torch.tensor(2**20)]
        values += [torch.tensor(1.5, dtype=wide), torch.tensor(3, dtype=torch.int32)]
        with EveryOperator() as ops:
            for i, value in enumerate(values):
                m.add(f"v{i}", value)
            names, vector = m.stack()
        assert ops.counts.get("_to_copy", 0) == (0 if batched else 3), ops.counts  # CPU: the three integers
        assert ops.counts.get("stack" if not batched else "cat", 0) == 1, ops.counts
        assert vector.dtype == wide
        assert vector.tolist() == [0.25, 7.0, 0.5, float(2**20), 1.5, 3.0]


def test_a_layout_resolves_the_catalog_once_and_reports_each_sequence_of_declarations_once():
    """The loss builds one MetricLayout; each call's set takes its names out of a copy of its table,
    and how a sequence of declarations is reported is worked out on its first call only."""
    counts = GlobalCounts(tokens=torch.tensor(4.0), sequences=torch.tensor(2.0))
    specs = {"a": MetricSpec("tokens", "sum", False), "lo": LOW, "_ess_units": RAW, "z": RAW, "ess": DERIVED}
    layout = MetricLayout(specs)
    assert layout.buckets == {"a": "tokens", "lo": "final", "_ess_units": "final", "z": "final", "ess": "derived"}
    results = []
    for _ in range(3):
        m = MetricSet(layout, counts=counts)
        m.add_total("a", torch.tensor(2.0))
        m.add("lo", torch.tensor(torch.finfo(torch.float32).max))  # no unit: reported as inf
        m.add("_ess_units", torch.tensor(5.0))
        m.add_zero("z")
        results.append((m.finalize(), m.diagnostics))
    assert results[0] == results[1] == results[2]
    assert results[0][0] == {"a": pytest.approx(0.5), "lo": math.inf, "z": 0.0}
    assert results[0][1].ess_units == 5.0  # the hidden entry, as a diagnostic
    assert len(layout._reports) == 1  # one sequence of declarations, reported once
    ((key, first),) = layout._reports.items()
    assert layout.report(*key) is first  # found, not worked out again
    # the per-call flag is the layout's: a set cannot be built against it
    without = MetricLayout(specs, compute_per_call=False)
    assert without.buckets["lo"] is None
    with pytest.raises(ValueError, match="compute_per_call: got True, but the layout given was built with False"):
        MetricSet(without, compute_per_call=True)
    m = MetricSet(without, counts=counts)
    m.add("lo", torch.tensor(1.0))
    assert m.finalize() == {} and m.per_call_names() == ["lo"]
    # the reports kept are bounded
    for i in range(MetricLayout.MAX_REPORTS + 5):
        layout.report(["a"] * (i + 1), [])  # distinct sequences
    assert len(layout._reports) <= MetricLayout.MAX_REPORTS


def test_a_refused_declaration_leaves_the_name_as_it_was():
    """A derived metric declared as computed is refused and stays declarable by derive(); a name
    declared once is refused the second time by every kind of declaration."""
    m = _metrics(ess=DERIVED, x=RAW, pair_a=RAW, pair_b=RAW)
    with pytest.raises(ValueError, match="derived on the host"):
        m.add("ess", torch.tensor(1.0))
    with pytest.raises(ValueError, match="derived on the host"):
        m.add_total("ess", torch.tensor(1.0))
    with pytest.raises(ValueError, match="derived on the host"):
        m.add_masked_totals(["ess"], [torch.ones(2)], torch.ones(2))
    with pytest.raises(ValueError, match="derived on the host"):
        m.add_masked_extrema("x", "ess", torch.ones(2), torch.zeros(2))
    m.derive("ess", EffectiveSampleSize("x", "x", "x"))
    m.add_total("x", torch.tensor(1.0))
    for declare in (
        lambda: m.add("x", torch.tensor(1.0)),
        lambda: m.add_total("x", torch.tensor(1.0)),
        lambda: m.add_zero("x"),
        lambda: m.derive("ess"),
        lambda: m.add_masked_totals(["pair_a", "x"], [torch.ones(2), torch.ones(2)], torch.ones(2)),
    ):
        with pytest.raises(KeyError, match="declared twice"):
            declare()
    # a refused group left its names free
    m.add_masked_totals(["pair_a", "pair_b"], [torch.ones(2), torch.ones(2)], torch.ones(2))


def test_a_name_twice_in_one_group_and_a_derived_per_call_metric_are_refused_without_a_trace():
    """A group naming a metric twice is refused as declared twice and leaves its names free; a
    derived per-call metric is refused as computed also where per-call metrics are not computed
    (the NeMo-RL loss), and derive() declares it without a value."""
    m = _metrics(a=RAW, b=RAW, lo=LOW, hi=HIGH)
    with pytest.raises(KeyError, match="'a' declared twice"):
        m.add_masked_totals(["a", "a"], [torch.ones(2), torch.ones(2)], torch.ones(2))
    with pytest.raises(KeyError, match="'lo' declared twice"):
        m.add_masked_extrema("lo", "lo", torch.ones(2), torch.zeros(2))
    m.add("a", torch.tensor(1.0))
    m.add_masked_extrema("lo", "hi", torch.ones(2), torch.zeros(2))
    assert m.finalize() == {"a": 1.0, "lo": 1.0, "hi": 1.0}
    per_call_derived = DERIVED._replace(per_call=True)
    for computed in (True, False):
        off = MetricSet({"ess": per_call_derived, "x": RAW}, compute_per_call=computed)
        with pytest.raises(ValueError, match="derived on the host"):
            off.add("ess", torch.tensor(1.0))
        with pytest.raises(ValueError, match="derived on the host"):
            off.add_masked_totals(["ess"], [torch.ones(2)], torch.ones(2))
        off.add("x", torch.tensor(2.0))
        off.derive("ess", EffectiveSampleSize("x", "x", "x"))
        assert len(off._derived) == (1 if computed else 0)  # uncomputed: no formula kept to evaluate
        assert off.finalize() == ({"x": 2.0, "ess": 1.0} if computed else {"x": 2.0})


@pytest.mark.parametrize("batched", [False, True], ids=["cpu-form", "gpu-form"])
def test_integer_values_of_several_dtypes_are_divided_in_their_counts_dtype(batched):
    """Integer parts of different dtypes (int64, int32, bool) and no float one are joined as integers
    and cast once to the divisor's dtype, as one integer dtype is: float64 counts keep 2^24 + 1."""
    f64 = torch.float64
    counts = GlobalCounts(tokens=torch.tensor(3.0, dtype=f64), sequences=torch.tensor(1.0, dtype=f64))
    m = _metrics(counts, batched, total=MetricSpec("tokens", "sum", False), small=RAW, flag=RAW)
    m.add_total("total", torch.tensor(3 * (2**24 + 1)))
    m.add("small", torch.tensor(5, dtype=torch.int32))
    m.add("flag", torch.tensor(True))
    names, vector = m.stack()
    assert vector.dtype == f64
    assert dict(zip(names, vector.tolist())) == {"total": 3 * (2**24 + 1) / (3.0 + EPS), "small": 5.0, "flag": 1.0}


def test_a_pickled_layout_refuses_what_the_original_refuses():
    """NeMo-RL pickles its loss into each Ray worker: the layout comes back rebuilt from its catalog
    (its markers are compared by identity), without the reports kept so far."""
    import pickle

    layout = MetricLayout({"ess": DERIVED, "x": RAW}, compute_per_call=False)
    layout.report(["x"], ["x"])
    copy = pickle.loads(pickle.dumps(layout))
    assert copy.buckets == layout.buckets and not copy._reports and copy.computes_per_call is False
    m = MetricSet(copy)
    with pytest.raises(ValueError, match="derived on the host"):
        m.add("ess", torch.tensor(1.0))
    m.add("x", torch.tensor(2.0))
    m.derive("ess", EffectiveSampleSize("x", "x", "x"))
    assert m.finalize() == {"x": 2.0, "ess": 1.0}  # 2^2 / (2 * 2)


@pytest.mark.parametrize("batched", [False, True], ids=["cpu-form", "gpu-form"])
def test_integer_values_only_are_divided_in_their_counts_dtype(batched):
    """A metric vector of integer parts only is cast to the dtype a division by its count gives (the
    divisor's: float64 counts keep 2^24 + 1 exact), float32 where nothing is divided."""
    f64 = torch.float64
    counts = GlobalCounts(tokens=torch.tensor(3.0, dtype=f64), sequences=torch.tensor(1.0, dtype=f64))
    m = _metrics(counts, batched, total=MetricSpec("tokens", "sum", False), raw=RAW)
    m.add_total("total", torch.tensor(3 * (2**24 + 1)))
    m.add("raw", torch.tensor(5))
    names, vector = m.stack()
    assert vector.dtype == f64 and vector[names.index("total")].item() == 3 * (2**24 + 1) / (3.0 + EPS)
    alone = _metrics(counts, batched, raw=RAW)
    alone.add("raw", torch.tensor(2**24 + 1))
    assert alone.stack()[1].dtype == torch.float32  # nothing divided: float32, as before


def test_the_loss_and_the_metrics_divide_by_one_divisor_per_count():
    """``count + 1e-8`` is computed once per call (``GlobalCounts.divisor``) and read by the loss's
    aggregation and the metric vector alike: the same tensor, not a copy per reader."""
    from nemo_rs_plugin import CorrectedPGLoss
    from nemo_rs_plugin.core.batch.inputs import global_counts
    from nemo_rs_plugin.core.loss_terms import objective as objective_module

    counts = GlobalCounts(
        tokens=torch.tensor(7.0, dtype=torch.float64), sequences=torch.tensor(2.0, dtype=torch.float64)
    )
    assert counts.divisor("tokens") is counts.divisor("tokens")
    assert counts.divisor("tokens").item() == 7.0 + EPS and counts.divisor("sequences").item() == 2.0 + EPS

    seen = []
    aggregation = objective_module.Objective.aggregation

    def recording(self, counts, *args):
        agg = aggregation(self, counts, *args)
        seen.append((agg.divisor, counts))
        return agg

    lp = -torch.rand(2, 5, dtype=torch.float64)
    data = {
        "advantages": torch.randn(2, 6, dtype=torch.float64),
        "prev_logprobs": torch.cat([torch.zeros(2, 1, dtype=torch.float64), lp], 1),
        "generation_logprobs": torch.cat([torch.zeros(2, 1, dtype=torch.float64), lp - 0.01], 1),
        "reference_policy_logprobs": torch.cat([torch.zeros(2, 1, dtype=torch.float64), lp], 1),
        "token_mask": torch.ones(2, 6, dtype=torch.long),
        "sample_mask": torch.ones(2, dtype=torch.float64),
    }
    import unittest.mock

    divisor_of = GlobalCounts.divisor
    read: list[tuple[str, torch.Tensor]] = []

    def reading(self, count):
        divisor = divisor_of(self, count)
        read.append((count, divisor))
        return divisor

    for token_level_loss, count in ((True, "tokens"), (False, "sequences")):
        seen.clear(), read.clear()
        loss = CorrectedPGLoss({"token_level_loss": token_level_loss}, batched_metrics=True)
        with unittest.mock.patch.object(objective_module.Objective, "aggregation", recording):
            with unittest.mock.patch.object(GlobalCounts, "divisor", reading):
                loss(lp.clone().requires_grad_(True), data, torch.tensor(2.0), torch.tensor(10.0))
        ((divisor, call_counts),) = seen
        assert divisor is call_counts._divisors[count]
        # every read of a count's divisor is the one tensor; with a token-level loss the loss and
        # the metric vector's division (stack()) both read the tokens' (a sequence-level loss's
        # metrics here are token means only)
        assert all(d is call_counts._divisors[c] for c, d in read)
        assert len([d for c, d in read if c == "tokens"]) >= (2 if token_level_loss else 1)
    assert global_counts(2, 10, torch.float64, torch.device("cpu")).divisor("tokens").item() == 10.0 + EPS
