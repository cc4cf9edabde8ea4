"""Smoke test of ``nemo-rs lab --quick``: it completes, is deterministic, every metric is finite.

No assertion about which correction learns better: the experiment reports, it is not tuned.
"""

import csv
import math

import pytest

pytest.importorskip("transformers")

from nemo_rs_plugin.tools import lab  # noqa: E402


def test_quick_mode_completes_deterministic_and_finite(tmp_path):
    out = tmp_path / "lab"
    assert lab.main(["--quick", "--out", str(out), "--workers", "1"]) == 0
    for name in ("lab_steps.csv", "lab_summary.csv", "lab_summary.md", "lab_settings.json", "lab.png"):
        assert (out / name).is_file(), name

    s = lab.settings_from(lab.build_parser().parse_args(["--quick"]))
    with open(out / "lab_steps.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == len(s.configs) * len(s.seeds) * s.steps
    for r in rows:
        for k in lab._METRICS:
            assert math.isfinite(float(r[k])), (r["config"], r["step"], k, r[k])
        assert 0.0 <= float(r["reward"]) <= 1.0

    # The same configuration and seed again, in this process: the same numbers (wall time aside).
    name, seed = s.configs[-1], s.seeds[0]
    again = lab.run_one(name, seed, s)
    first = [r for r in rows if r["config"] == name and r["seed"] == str(seed)]
    for a, b in zip(first, again):
        for k in lab._METRICS:
            if k != "wall_s":
                assert a[k] == f"{b[k]:.6g}", (k, a[k], b[k])


def test_every_published_configuration_is_a_valid_loss_config():
    from nemo_rs_plugin import CorrectedPGLoss

    for name, cfg in lab.CONFIGS.items():
        CorrectedPGLoss({**lab._BASE_LOSS, **cfg})
