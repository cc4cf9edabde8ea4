"""Guards the published lab runs against the code that ships them (issue: evidence that reproduces).

docs/lab/lab_runs.json names the commit that produced each published per-seed CSV and the arms a
later commit is known to have moved (451a1be: one float32 ulp in the sequence_mean IS weight).
The fast test keeps that manifest honest (every published run named, its commit in the history,
docs/lab.md's Reproducing section naming the stale runs). The slow test reruns one confirmation
seed, every arm, at the checked-out code and compares every published column string for string
(only the confirmation: one seed of it took 4-8 CPU minutes on 2 shared cores, and one seed of the
length study about 15, the exploration's primary arms about 4 more).

A trajectory also depends on the CPU's bfloat16 kernels: on a machine whose kernels differ from
the publisher's, even the uncorrected arm at lag 0 (which no correction code touches) differs, at
the publishing commit as at HEAD (measured on an AMD EPYC without AVX-512). There the comparison
cannot tell a code change from a machine, and the test says so instead of judging the code.

The slow test runs where ``NEMO_RS_LAB_REPRODUCE=1`` is set (before republishing, after a change to
the loss's numerics, on a machine whose kernels match the publisher's): its 4-8 CPU minutes, and
its two lab workers beside the suite's own, were a quarter of CI's time on a machine where it can
only skip.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LAB_FILES = REPO / "docs" / "lab"
MANIFEST = json.loads((LAB_FILES / "lab_runs.json").read_text())
SEED = 5000  # the confirmation's first seed
PROBE = ("none", "0")  # no correction, synchronous: only the machine's bf16 kernels move it
NOT_COMPARED = {"wall_s"}


def _stale(run: str) -> dict[tuple[str, str], str]:
    return {(a, str(lag)): s["since"][:7] for s in MANIFEST["runs"][run]["stale"] for a, lag in s["arms"]}


def test_every_published_run_names_its_commit_and_its_stale_arms():
    published = {p.name for p in LAB_FILES.glob("lab_*_seeds.csv")} - {"lab_dose_seeds.csv"}
    assert published == {r["csv"] for r in MANIFEST["runs"].values()}
    reproducing = (REPO / "docs" / "lab.md").read_text().split("## Reproducing", 1)[1]
    assert "code" in reproducing and "451a1be" in reproducing
    for name, run in MANIFEST["runs"].items():
        assert len(run["commit"]) == 40 and run["commit"][:7] in reproducing, name
        for s in run["stale"]:
            assert s["since"][:7] in reproducing, name
        if "republished" in run:  # the commit a republished run replaced, and what moved, said on the page too
            assert run["republished"]["previous_commit"][:7] in reproducing and run["republished"]["moved"], name
    if not (REPO / ".git").exists():
        pytest.skip("no git history here to find the commits in")
    for run in MANIFEST["runs"].values():
        replaced = [run["republished"]["previous_commit"]] if "republished" in run else []
        for commit in [run["commit"], *(s["since"] for s in run["stale"]), *replaced]:
            got = subprocess.run(["git", "cat-file", "-t", commit], cwd=REPO, capture_output=True, text=True)
            assert got.stdout.strip() == "commit", f"{commit} is not in this repository's history"


def _rows(path: Path, seed: int) -> dict[tuple[str, str], dict[str, str]]:
    with open(path, newline="") as fh:
        return {(r["config"], r["lag"]): r for r in csv.DictReader(fh) if r["seed"] == str(seed)}


@pytest.mark.slow  # 4-8 CPU minutes: the confirmation's 6 arm-lag runs of one seed, 80 steps each
@pytest.mark.skipif(
    os.environ.get("NEMO_RS_LAB_REPRODUCE") != "1",
    reason="NEMO_RS_LAB_REPRODUCE=1 reruns a published confirmation seed (4-8 CPU minutes; docs/lab.md#reproducing)",
)
def test_one_confirmation_seed_reproduces_at_this_code(tmp_path):
    pytest.importorskip("transformers")
    from nemo_rs_plugin.lab import cli as lab

    run = MANIFEST["runs"]["confirmation"]
    assert lab.main(["--confirm", "--seeds", str(SEED), "--out", str(tmp_path), "--workers", "2"]) == 0
    published = _rows(LAB_FILES / run["csv"], SEED)
    here = _rows(tmp_path / run["csv"], SEED)
    assert set(here) == set(published)

    def differences(arm):
        return [
            f"{k}: published {published[arm][k]!r}, here {here[arm][k]!r}"
            for k in published[arm]
            if k not in NOT_COMPARED and published[arm][k] != here[arm][k]
        ]

    if differences(PROBE):
        pytest.skip(
            f"`{PROBE[0]}` at lag {PROBE[1]}, which no correction code touches, differs from the published run "
            f"({differences(PROBE)[0]}): this machine's bfloat16 kernels do not reproduce the publisher's, so "
            "the comparison cannot judge the code; run it where they do"
        )
    stale = _stale("confirmation")
    moved = {arm: differences(arm) for arm in published if arm not in stale and differences(arm)}
    assert not moved, (
        f"published confirmation runs (commit {run['commit'][:7]}) no longer reproduce at this code, seed {SEED}:\n"
        + "\n".join(f"  {a} lag {lag}: {d[0]} (+{len(d) - 1} more)" for (a, lag), d in moved.items())
        + f"\nEither rerun and republish: `{run['command']}`, copy its lab_confirm_seeds.csv and settings into "
        "docs/lab/, re-render docs/lab.md's blocks and set the manifest's commit to this one; or restate the "
        "commit: list these arms in docs/lab/lab_runs.json's stale entries with the commit that moved them and "
        "name it in docs/lab.md#reproducing."
    )
