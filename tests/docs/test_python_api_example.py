"""The Python-API example of docs/guide.md runs exactly as written (the code block of its
"## Python API" section, extracted from the page, not a copy; the README links it)."""

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def python_api_snippet() -> str:
    guide = (REPO / "docs" / "guide.md").read_text()
    section = guide.split("\n## Python API\n", 1)[1].split("\n## ", 1)[0]
    [code] = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    return code


def test_the_guides_python_api_example_runs_as_written(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-c", python_api_snippet()], capture_output=True, text=True, cwd=tmp_path, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr == "", proc.stderr  # no warning either
    [line] = proc.stdout.splitlines()
    assert re.fullmatch(r"loss -?\d+\.\d{4}, IS weight \d\.\d{4}, rejected 0\.\d\d", line), line
