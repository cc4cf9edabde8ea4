"""Guards the guide's metric table (tools/reference.py's METRIC_ROWS, docs/guide.md#metrics).

The table on the page is what ``nemo-rs reference --metrics`` prints, its normalization
column read off the loss's own declarations; and every metric the loss declares beyond
NeMo-RL's own (the metric names of NeMo-RL's recorded outputs, tests/data/) has a row, so a
new metric without documentation fails here.
"""

from pathlib import Path

import torch

from nemo_rs_plugin.cli import main
from nemo_rs_plugin.tools.reference import (
    METRIC_ROWS,
    declared_metrics,
    render_metrics_table,
    render_statistics_table,
)

REPO = Path(__file__).resolve().parents[2]


def test_the_guide_holds_the_generated_table(capsys):
    assert render_metrics_table() in (REPO / "docs" / "guide.md").read_text()
    assert main(["reference", "--metrics"]) == 0
    assert capsys.readouterr().out == render_metrics_table() + "\n"


def test_every_added_metric_has_a_row():
    recorded = torch.load(REPO / "tests" / "data" / "upstream_clipped_pg_public.pt", weights_only=False)
    upstream = set().union(*(case["metrics"] for case in recorded["cases"]))
    covered = {name for names, _ in METRIC_ROWS for name in names}
    added = set().union(*(set(d) for d in declared_metrics())) - upstream
    assert added - covered == set(), "metrics without a row in METRIC_ROWS"
    assert covered - added == set(), "rows for metrics the loss does not declare"


def test_the_guides_filter_statistics_table_is_the_registry(capsys):
    """docs/guide.md's table of filter statistics is rendered from the registry, one row per entry."""
    from nemo_rs_plugin.cli import main
    from nemo_rs_plugin.core.filter_statistics import FILTER_STATISTICS

    table = render_statistics_table()
    assert table in (REPO / "docs" / "guide.md").read_text()
    assert main(["reference", "--statistics"]) == 0
    assert capsys.readouterr().out == table + "\n"
    assert [line.split("`")[1] for line in table.splitlines()[3:-1]] == list(FILTER_STATISTICS)
