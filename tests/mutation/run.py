"""Mutation testing of the loss math: does the fast test subset notice each one-line mutant?

Usage (from anywhere; takes ~10-20 min on two cores)::

    python tests/mutation/run.py                 # every mutant of tests/mutation/mutants.py
    python tests/mutation/run.py --only 9 34     # some mutants, by number
    python tests/mutation/run.py --list          # the mutants, without running anything
    python tests/mutation/run.py --tests tests/core/test_reference.py   # what one file kills

Each mutant is applied to a fresh temporary copy of the repository (the working tree is
never edited); the subset runs there with the copy first on ``sys.path``, so the copy's
``nemo_rs_plugin`` is the one under test (checked once before the mutants run, together
with an unmutated run that must pass). The subset is ``-m "not slow and not distributed"``
over every test file except those that run the *installed* plugin in another interpreter
(``test_activation.py``, ``test_nemo_rl_host.py``): against a copy they would test the
working tree instead. Reductions over CP/TP ranks are covered in that subset by
``test_reference.py``'s emulated ranks. Files that kill fastest run first, with ``-x``.

A mutant is killed when the subset fails (a timeout or a collection error counts as killed,
and is labelled). A mutant whose old text is missing or ambiguous is an error. The score is
killed / behaviour-changing mutants; an equivalent mutant (argued in its description) is
expected to survive and is flagged if a test kills it. Exit status 0 only when every
behaviour-changing mutant is killed and there is no error.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mutants import MUTANTS, Mutant  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
FIRST = [
    "test_reference.py",
    "test_rejection.py",
    "test_objective.py",
    "test_is_levels.py",
    "test_inputs.py",
    "test_parity.py",
    "test_config.py",
    "test_properties.py",
]
LAST = ["test_cli.py"]  # in-process, but slow (simulations): only survivors and the preflight pay for it
NOT_THE_COPY = {"test_activation.py", "test_nemo_rl_host.py"}  # they import the installed plugin
# It checks each mutant's old text against the tree: in a mutated copy it fails for every mutant,
# a kill that says nothing about the behaviour (it ran before test_packing.py and hid what killed).
NOT_A_KILLER = {"test_mutants_apply.py"}
MARKERS = "not slow and not distributed"
IGNORE = shutil.ignore_patterns(
    ".git", ".venv", "__pycache__", ".hypothesis", ".pytest_cache", "build", "dist", "*.egg-info", ".whl", "*.pyc"
)


def test_files() -> list[str]:
    """Every test file (tests/<layer>/test_*.py and tests/test_*.py), the quick killers first."""
    paths = {p.name: p.relative_to(REPO).as_posix() for p in (REPO / "tests").rglob("test_*.py")}
    names = sorted(n for n in paths if n not in NOT_THE_COPY and n not in NOT_A_KILLER)
    middle = [n for n in names if n not in FIRST and n not in LAST]
    ordered = [n for n in FIRST if n in names] + middle + [n for n in LAST if n in names]
    return [paths[n] for n in ordered]


def copy_repo(dest: Path) -> Path:
    root = dest / "repo"
    shutil.copytree(REPO, root, ignore=IGNORE, symlinks=True)
    return root


def env_for(root: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(root)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # a same-size mutant must never reuse a stale .pyc
    env.pop("NEMO_RS_FIXTURES", None)  # the copy's tests/data
    return env


def check_text(m: Mutant) -> str | None:
    path = REPO / m.file
    if not path.is_file():
        return f"file {m.file} not found"
    count = path.read_text().count(m.old)
    if count == 0:
        return "old text not found"
    if count > 1:
        return f"old text ambiguous ({count} matches)"
    return None


def run_subset(root: Path, files: list[str], timeout: float) -> tuple[str, str, float]:
    """``(outcome, detail, seconds)``; outcome is passed, failed, error or timeout."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-n", "0", "-p", "no:cacheprovider", "-m", MARKERS, *files]
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=root, env=env_for(root), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout", f"no result within {timeout:.0f}s", time.monotonic() - start
    seconds = time.monotonic() - start
    out = proc.stdout + proc.stderr
    if proc.returncode == 0:
        return "passed", "", seconds
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", out, flags=re.M)
    if proc.returncode == 1 and failed:
        return "failed", failed[0], seconds
    tail = [line for line in out.strip().splitlines() if line.strip()][-1:] or ["?"]
    return "error", f"pytest exit {proc.returncode}: {failed[0] if failed else tail[0]}", seconds


def run_mutant(m: Mutant, files: list[str], timeout: float) -> dict:
    problem = check_text(m)
    if problem:
        return {"result": "ERROR", "detail": problem, "seconds": 0.0}
    with tempfile.TemporaryDirectory(prefix="nemo-rs-mutant-") as tmp:
        root = copy_repo(Path(tmp))
        target = root / m.file
        target.write_text(target.read_text().replace(m.old, m.new, 1))
        outcome, detail, seconds = run_subset(root, files, timeout)
    if outcome == "passed":
        result = "survived (equivalent)" if m.equivalent else "SURVIVED"
    else:
        label = {"failed": "killed", "timeout": "killed (timeout)", "error": "killed (error)"}[outcome]
        result = f"{label}: EQUIVALENCE ARGUMENT WRONG" if m.equivalent else label
    return {"result": result, "detail": detail, "seconds": seconds}


def preflight(files: list[str], timeout: float) -> None:
    """The copy's package is the one imported, and the unmutated subset passes."""
    with tempfile.TemporaryDirectory(prefix="nemo-rs-mutant-") as tmp:
        root = copy_repo(Path(tmp))
        probe = subprocess.run(
            [sys.executable, "-c", "import nemo_rs_plugin; print(nemo_rs_plugin.__file__)"],
            cwd=root,
            env=env_for(root),
            capture_output=True,
            text=True,
        )
        where = probe.stdout.strip()
        if probe.returncode != 0 or not Path(where).resolve().is_relative_to(root.resolve()):
            sys.exit(f"preflight: nemo_rs_plugin is imported from {where or probe.stderr[-500:]}, not the copy")
        outcome, detail, seconds = run_subset(root, files, timeout)
        if outcome != "passed":
            sys.exit(f"preflight: the unmutated test subset does not pass ({outcome}: {detail})")
        print(f"preflight: copy imported, unmutated subset passes ({seconds:.0f}s)", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", type=int, nargs="+", metavar="N", help="mutant numbers (1-based) to run")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per test run (default 900)")
    parser.add_argument("--no-preflight", action="store_true", help="skip the unmutated run")
    parser.add_argument("--tests", nargs="+", metavar="PATH", help="test files to run instead of the subset")
    args = parser.parse_args(argv)

    chosen = [(i, m) for i, m in enumerate(MUTANTS, 1) if not args.only or i in args.only]
    if args.list:
        for i, m in chosen:
            print(f"{i:3d}  {m.file:<32} {m.description}{'  [equivalent]' if m.equivalent else ''}")
        return 0
    files = args.tests or test_files()
    print(f"subset: -m {MARKERS!r} -x {' '.join(files)}", flush=True)
    if not args.no_preflight:
        preflight(files, args.timeout)

    rows = []
    for i, m in chosen:
        r = run_mutant(m, files, args.timeout)
        rows.append((i, m, r))
        print(
            f"{i:3d}  {r['result']:<22} {r['seconds']:5.0f}s  {m.file.split('/')[-1]:<15} {m.description}"
            f"{'  <- ' + r['detail'] if r['detail'] else ''}",
            flush=True,
        )

    errors = [row for row in rows if row[2]["result"] == "ERROR"]
    behaviour = [row for row in rows if not row[1].equivalent and row[2]["result"] != "ERROR"]
    killed = [row for row in behaviour if row[2]["result"].startswith("killed")]
    survivors = [row for row in behaviour if row[2]["result"] == "SURVIVED"]
    wrong_equivalent = [row for row in rows if "EQUIVALENCE" in row[2]["result"]]
    print()
    print(
        f"score: {len(killed)}/{len(behaviour)} behaviour-changing mutants killed"
        + (f" ({100 * len(killed) / len(behaviour):.0f}%)" if behaviour else "")
    )
    print(f"equivalent: {sum(1 for r in rows if r[1].equivalent)} (argued), errors: {len(errors)}")
    for label, group in (
        ("survived", survivors),
        ("errors", errors),
        ("killed although argued equivalent", wrong_equivalent),
    ):
        for i, m, r in group:
            print(f"  {label}: #{i} {m.file}: {m.description} ({r['detail'] or r['result']})")
    return 0 if not survivors and not errors and not wrong_equivalent else 1


if __name__ == "__main__":
    sys.exit(main())
