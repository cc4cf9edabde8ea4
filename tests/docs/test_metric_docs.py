"""Guards the guide's metric table (rendered from core/reporting/metric_catalog.py, docs/guide.md#metrics).

The table on the page is what ``nemo-rs reference --metrics`` prints from the catalog; the
catalog marks as NeMo-RL's exactly the metric names of NeMo-RL's recorded outputs
(tests/data/), so every metric the plugin adds has a row (tests/core/test_metric_catalog.py
holds the catalog to what the loss declares).
"""

from pathlib import Path

import torch

from nemo_rs_plugin.cli import main
from nemo_rs_plugin.core.reporting.metric_catalog import METRIC_CATALOG
from nemo_rs_plugin.tools.reference import render_metrics_table, render_statistics_table

REPO = Path(__file__).resolve().parents[2]


def test_the_guide_holds_the_generated_table(capsys):
    assert render_metrics_table() in (REPO / "docs" / "guide.md").read_text()
    assert main(["reference", "--metrics"]) == 0
    assert capsys.readouterr().out == render_metrics_table() + "\n"


def test_every_added_metric_has_a_row_and_nemo_rls_own_are_marked():
    recorded = torch.load(REPO / "tests" / "data" / "upstream_clipped_pg_public.pt", weights_only=False)
    upstream = set().union(*(case["metrics"] for case in recorded["cases"]))
    own = {e.name for e in METRIC_CATALOG if e.nemo_rl}
    assert own == upstream, own ^ upstream
    first_cells = " ".join(line.split(" | ")[0] for line in render_metrics_table().splitlines()[3:-1])
    for entry in METRIC_CATALOG:
        assert (f"`{entry.name}`" in first_cells) != entry.nemo_rl, entry.name


def test_the_guides_filter_statistics_table_is_the_registry(capsys):
    """docs/guide.md's table of filter statistics is rendered from the registry, one row per entry."""
    from nemo_rs_plugin.cli import main
    from nemo_rs_plugin.core.registries.filter_statistics import FILTER_STATISTICS

    table = render_statistics_table()
    assert table in (REPO / "docs" / "guide.md").read_text()
    assert main(["reference", "--statistics"]) == 0
    assert capsys.readouterr().out == table + "\n"
    assert [line.split("`")[1] for line in table.splitlines()[3:-1]] == list(FILTER_STATISTICS)
