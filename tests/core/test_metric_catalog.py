"""Guards ``core/reporting/metric_catalog.py``: the catalog is exactly what the loss returns, in every configuration.

The loss declares each metric by its name alone and takes its normalization, reduction and
per-call flag from the catalog (a name the configuration lacks is refused); here every
configuration of a grid (IS levels, truncation types, filter levels and aggregations, batch
normalisation, the sampler penalty, the loss's unit, the NLL term) runs once and must return
exactly the catalog's metrics, so an entry whose ``emitted`` predicate is wrong fails in either
direction.
"""

import itertools

import pytest
import torch

from nemo_rs_plugin.core.loss import CorrectedPGLoss
from nemo_rs_plugin.core.reporting.metric_catalog import METRIC_CATALOG, catalog_entry, declared_specs, metric_specs
from nemo_rs_plugin.core.reporting.metrics import GlobalCounts, MetricSet

B, S = 3, 6
TRUNCATIONS = [
    {},
    {"truncated_importance_sampling_type": "tis", "truncated_importance_sampling_ratio": 2.0},
    {
        "truncated_importance_sampling_type": "seq-mask-tis",
        "truncated_importance_sampling_ratio": 1.01,
        "truncated_importance_sampling_ratio_min": 0.99,
    },
]
FILTERS = [
    [],
    [{"level": "token", "statistic": "ratio", "lower": 0.5, "upper": 2.0}],
    [
        {"level": "sequence", "statistic": "ratio", "agg": "any", "lower": 1e-4, "upper": 1e4},
        {"level": "sequence", "statistic": "kl_k3", "agg": "max", "upper": 5.0, "advantage_sign": "negative"},
        {"level": "token", "statistic": "prob_diff", "lower": -0.2, "upper": 0.2, "applies_to": "policy_gradient"},
    ],
]


def _grid():
    for level, truncation, filters, extras in itertools.product(
        ["token", "sequence", "sequence_mean"],
        TRUNCATIONS,
        FILTERS,
        [
            {},
            {"is_batch_normalization": "microbatch", "sampler_kl_penalty": 0.01},
            {"token_level_loss": False, "positive_example_nll_weight": 0.1, "reference_policy_kl_penalty": 0.0},
        ],
    ):
        if truncation.get("truncated_importance_sampling_type") == "seq-mask-tis" and level == "sequence":
            continue  # allowed, but the product at seq-mask-tis adds nothing to the grid
        yield {
            "use_importance_sampling_correction": True,
            "is_correction_level": level,
            "rejection_sampling": filters,
            **truncation,
            **extras,
        }
    yield {}  # NeMo-RL's defaults
    yield {"sequence_level_importance_ratios": True, "token_level_loss": False}  # GSPO
    yield {"sharded_logits_input": True}  # the logits input path's count (0 here: log-probs given)


def _data():
    g = torch.Generator().manual_seed(0)
    prev = -torch.rand(B, S, generator=g)
    return {
        "input_ids": torch.zeros(B, S, dtype=torch.long),
        "advantages": torch.randn(B, 1, generator=g).expand(B, S).clone(),
        "prev_logprobs": prev,
        "generation_logprobs": prev + 0.05 * torch.randn(B, S, generator=g),
        "reference_policy_logprobs": prev,
        "token_mask": torch.ones(B, S),
        "sample_mask": torch.ones(B),
        "rewards": torch.ones(B),
    }


@pytest.mark.parametrize("per_call", [True, False])
@pytest.mark.parametrize("cfg", list(_grid()), ids=lambda c: str(len(str(c))))
def test_the_loss_returns_exactly_the_catalogs_metrics(cfg, per_call):
    loss = CorrectedPGLoss(cfg, per_call_metrics=per_call)
    data = _data()
    _, metrics = loss(data["prev_logprobs"][:, 1:].clone(), data, torch.tensor(float(B)), torch.tensor(B * 5.0))
    specs = metric_specs(loss.cfg)
    expected = {name for name, spec in specs.items() if per_call or not spec.per_call}
    assert set(metrics) == expected, set(metrics) ^ expected
    assert loss.metric_normalizations() == {name: specs[name].normalization for name in expected}


def test_every_entry_is_emitted_by_some_configuration_of_the_grid():
    seen = set()
    for cfg in _grid():
        names = metric_specs(CorrectedPGLoss(cfg).cfg)
        seen |= {catalog_entry(name).name for name in names}
    assert seen == {e.name for e in METRIC_CATALOG}, {e.name for e in METRIC_CATALOG} - seen


def test_a_declaration_the_catalog_does_not_hold_is_an_error():
    """A declaration names its entry and nothing else: a name this configuration lacks (a metric
    another configuration has, a hidden value not in DIAGNOSTIC_CATALOG) is refused where declared."""
    specs = declared_specs(CorrectedPGLoss({}).cfg)
    with pytest.raises(KeyError, match="'is_weight_median' is not in the catalog"):
        MetricSet(specs).add("is_weight_median", torch.tensor(1.0))
    with pytest.raises(KeyError, match="'is_batch_norm_factor' is not in the catalog for this configuration"):
        MetricSet(specs).add("is_batch_norm_factor", torch.tensor(1.0))
    with pytest.raises(KeyError, match="'_internal' is not in the catalog .*DIAGNOSTIC_CATALOG"):
        MetricSet(specs).add("_internal", torch.tensor(1.0))
    with pytest.raises(KeyError, match="not in the catalog \\(core/reporting/metric_catalog.py\\): add its entry"):
        catalog_entry("rs/x/seq_kept_frac")
    MetricSet(specs).add("_global_valid_toks", torch.tensor(1.0))  # a diagnostic: declared, never returned


def test_the_metric_set_reads_normalization_reduction_and_per_call_from_the_catalog():
    """Declared once: the same declaration is divided by the count its configuration's entry names
    (the IS level's unit here), reduced as the entry says, and left out where per-call metrics are."""
    token, sequence = (
        {"use_importance_sampling_correction": True, "is_correction_level": lv} for lv in ("token", "sequence")
    )
    counts = GlobalCounts(tokens=torch.tensor(8.0), sequences=torch.tensor(2.0))
    for cfg, count in ((token, 8.0), (sequence, 2.0)):
        specs = declared_specs(CorrectedPGLoss(cfg).cfg)
        metrics = MetricSet(specs, counts=counts)
        metrics.add_total("is_weight_raw_mean", torch.tensor(4.0))
        metrics.add_masked_extrema("is_weight_raw_min", "is_weight_raw_max", torch.ones(2, 3), torch.zeros(2, 3))
        assert metrics.finalize() == pytest.approx(
            {"is_weight_raw_mean": 4.0 / count, "is_weight_raw_min": 1.0, "is_weight_raw_max": 1.0}
        )
        assert metrics.normalizations()["is_weight_raw_mean"] == specs["is_weight_raw_mean"].normalization
        without_per_call = MetricSet(specs, counts=counts, compute_per_call=False)
        without_per_call.add_masked_extrema(
            "is_weight_raw_min", "is_weight_raw_max", torch.ones(2, 3), torch.zeros(2, 3)
        )
        assert without_per_call.finalize() == {}
