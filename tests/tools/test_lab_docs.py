"""Guards docs/lab.md against its data: every table on the page is what the lab prints for the
published runs.

The per-step rows of each published run are committed (docs/lab_steps.csv and
docs/lab_lag0_steps.csv, with their settings); the outcome tables and the comparisons are
recomputed from them with the lab's own reporting code and must appear on the page verbatim.
Editing a number on the page, or the reporting code, without rerunning the lab fails here.

The dose-response run (``nemo-rs lab --lags``) is published as its per-seed outcomes
(docs/lab_dose_seeds.csv); the page embeds its tables between ``<!-- lab:NAME:begin -->`` and
``<!-- lab:NAME:end -->`` markers, and each block must be what the lab renders from that CSV
(``nemo-rs lab --report docs/lab_dose_seeds.csv`` prints them). Until the run is published
(neither the CSV nor a block) that check is skipped.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from nemo_rs_plugin.tools.lab_dose_report import BLOCKS, doc_block_mismatch
from nemo_rs_plugin.tools.lab_experiment import LabSettings
from nemo_rs_plugin.tools.lab_report import (
    compare,
    default_pairs,
    format_comparisons,
    format_table,
    seed_outcomes,
    summarize,
)

DOCS = Path(__file__).resolve().parents[2] / "docs"
RUNS = [("lab_steps.csv", "lab_settings.json"), ("lab_lag0_steps.csv", "lab_lag0_settings.json")]
DOSE_SEEDS = DOCS / "lab_dose_seeds.csv"
REQUIRED_BLOCKS = ("dose-response",)  # once the run is published; the others are checked where embedded


def _load(steps: str, settings: str):
    raw = json.loads((DOCS / settings).read_text())
    s = LabSettings(**{k: v for k, v in raw.items() if k in LabSettings.__dataclass_fields__})
    rows = []
    with open(DOCS / steps) as fh:
        for r in csv.DictReader(fh):
            rows.append(
                {k: v if k == "config" else int(v) if k in ("seed", "step") else float(v) for k, v in r.items()}
            )
    return s, rows


@pytest.mark.parametrize("steps, settings", RUNS)
def test_the_pages_tables_are_what_the_lab_prints(steps, settings):
    s, rows = _load(steps, settings)
    outcomes = seed_outcomes(rows, s)
    assert {o["seed"] for o in outcomes} == set(s.seeds) and len(s.seeds) >= 8
    page = (DOCS / "lab.md").read_text()
    assert format_table(summarize(outcomes, s), s) in page
    comparisons = compare(outcomes, default_pairs(s.configs))
    assert format_comparisons(comparisons) in page


@pytest.mark.parametrize("block", list(BLOCKS))
def test_the_pages_dose_response_blocks_are_what_the_lab_renders(block):
    page = (DOCS / "lab.md").read_text()
    embedded = f"<!-- lab:{block}:begin -->" in page or f"<!-- lab:{block}:end -->" in page
    if not DOSE_SEEDS.exists() and not any(f"<!-- lab:{b}:" in page for b in BLOCKS):
        pytest.skip("no dose-response run published yet (docs/lab_dose_seeds.csv and its block in docs/lab.md)")
    assert DOSE_SEEDS.exists(), f"docs/lab.md embeds a dose-response block but {DOSE_SEEDS.name} is not in docs/"
    if not embedded:
        assert block not in REQUIRED_BLOCKS, f"docs/lab.md has no <!-- lab:{block}:begin --> ... end block"
        pytest.skip(f"docs/lab.md does not embed the {block} block")
    mismatch = doc_block_mismatch(DOCS / "lab.md", DOSE_SEEDS, block)
    assert mismatch is None, mismatch
