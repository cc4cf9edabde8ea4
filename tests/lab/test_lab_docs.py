"""Guards docs/lab.md against its data: every table on the page is what the lab prints for the
published runs.

The per-step rows of each published run are committed (docs/lab/lab_steps.csv and
docs/lab/lab_lag0_steps.csv, with their settings); the outcome tables and the comparisons are
recomputed from them with the lab's own reporting code and must appear on the page verbatim.
Editing a number on the page, or the reporting code, without rerunning the lab fails here.

The dose-response run (``nemo-rs lab --lags``) is published as its per-seed outcomes
(docs/lab/lab_dose_seeds.csv); the page embeds its tables between ``<!-- lab:NAME:begin -->`` and
``<!-- lab:NAME:end -->`` markers, and each block must be what the lab renders from that CSV
(``nemo-rs lab --report docs/lab/lab_dose_seeds.csv`` prints them). Until the run is published
(neither the CSV nor a block) that check is skipped.

The confirmation, its power plan and the length study are published the same way (their
per-seed CSVs, their blocks); and every paired interval the advice quotes (README, the guide,
troubleshooting, the recipes' comments, ``nemo-rs check``'s notes, the presets' docstring)
must be one of those runs' own numbers: the exploration's are not advice.
"""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import pytest

from nemo_rs_plugin.lab.confirm import confirm, format_confirmation, format_power_plan, power_plan
from nemo_rs_plugin.lab.dose import read_seed_csv
from nemo_rs_plugin.lab.dose_report import BLOCKS, doc_block_mismatch, marked_block
from nemo_rs_plugin.lab.experiment import LabSettings
from nemo_rs_plugin.lab.length import format_length_study, length_comparisons, read_length_csv
from nemo_rs_plugin.lab.run_report import (
    compare,
    default_pairs,
    format_comparisons,
    format_table,
    seed_outcomes,
    summarize,
)

DOCS = Path(__file__).resolve().parents[2] / "docs"
LAB_FILES = DOCS / "lab"  # the published runs' files
RUNS = [("lab_steps.csv", "lab_settings.json"), ("lab_lag0_steps.csv", "lab_lag0_settings.json")]
DOSE_SEEDS = LAB_FILES / "lab_dose_seeds.csv"
REQUIRED_BLOCKS = ("dose-response",)  # once the run is published; the others are checked where embedded


def _load(steps: str, settings: str):
    raw = json.loads((LAB_FILES / settings).read_text())
    s = LabSettings(**{k: v for k, v in raw.items() if k in LabSettings.__dataclass_fields__})
    rows = []
    with open(LAB_FILES / steps) as fh:
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
        pytest.skip("no dose-response run published yet (docs/lab/lab_dose_seeds.csv and its block in docs/lab.md)")
    assert DOSE_SEEDS.exists(), f"docs/lab.md embeds a dose-response block but {DOSE_SEEDS.name} is not in docs/lab/"
    if not embedded:
        assert block not in REQUIRED_BLOCKS, f"docs/lab.md has no <!-- lab:{block}:begin --> ... end block"
        pytest.skip(f"docs/lab.md does not embed the {block} block")
    mismatch = doc_block_mismatch(DOCS / "lab.md", DOSE_SEEDS, block)
    assert mismatch is None, mismatch


# ---------------------------------------------------------------------------- the confirmation
REPO = DOCS.parent
CONFIRM_SEEDS = LAB_FILES / "lab_confirm_seeds.csv"
PLAN_SEEDS = LAB_FILES / "lab_explore_primary_seeds.csv"
LENGTH_SEEDS = LAB_FILES / "lab_length_seeds.csv"
#: Where advice is given: every paired interval quoted there is a published confirmation's.
ADVICE = [
    REPO / "README.md",
    DOCS / "guide.md",
    DOCS / "troubleshooting.md",
    *sorted((REPO / "recipes").glob("*.yaml")),
    REPO / "nemo_rs_plugin" / "tools" / "correction_warnings.py",
    REPO / "nemo_rs_plugin" / "core" / "presets.py",
    REPO / "nemo_rs_plugin" / "core" / "health.py",
]
INTERVAL = re.compile(r"[+-]\d\.\d{3} \[[+-]\d\.\d{3}, [+-]\d\.\d{3}\]")


@pytest.mark.parametrize(
    "block, csv_path, render",
    [
        ("power-plan", PLAN_SEEDS, lambda p: format_power_plan(power_plan(read_seed_csv(p)))),
        ("confirmation", CONFIRM_SEEDS, lambda p: format_confirmation(read_seed_csv(p))),
        ("length", LENGTH_SEEDS, lambda p: format_length_study(read_length_csv(p))),
    ],
)
def test_the_pages_confirmation_blocks_are_what_the_lab_renders(block, csv_path, render):
    assert csv_path.exists(), f"docs/lab.md's {block} block needs {csv_path.name}"
    assert marked_block((DOCS / "lab.md").read_text(), block) == render(csv_path)


def _published_intervals() -> set[str]:
    def interval(diff: float, low: float, high: float) -> str:
        return f"{diff:+.3f} [{low:+.3f}, {high:+.3f}]"

    found = set()
    for r in confirm(read_seed_csv(CONFIRM_SEEDS)):
        found.add(interval(r["diff"], r["low"], r["high"]))
    for r in length_comparisons(read_length_csv(LENGTH_SEEDS)):
        if r["seeds"] and r["diff"] == r["diff"]:  # not NaN: an arm against none
            found.add(interval(r["diff"], r["low"], r["high"]))
    return found


@pytest.mark.parametrize("path", ADVICE, ids=lambda p: str(p.relative_to(REPO)))
def test_advice_quotes_only_the_confirmation_and_the_length_study(path):
    published = _published_intervals()
    quoted = INTERVAL.findall(path.read_text())
    stray = [q for q in quoted if q not in published]
    assert not stray, f"{path.name} quotes intervals no confirmation run published: {stray}"
