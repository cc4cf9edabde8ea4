"""Guards ``nemo-rs calibrate`` (tools/calibrate.py) and the rejection estimate of ``nemo-rs check``.

calibrate: on a dump with a known spread, the band it proposes rejects the target share
and the pasted section loads as a loss config; every bad input is one ``error:`` line, rc 2.
check: the estimate runs at the recipe's own response length (no cap) and warns at the
unhealthy share the docs and the run-time warning use (core/reporting/health.py), not only above half.
"""

from __future__ import annotations

import json

import pytest
import yaml

from nemo_rs_plugin.cli import main
from nemo_rs_plugin.core.reporting.health import UNHEALTHY_SEQ_REJECTION
from nemo_rs_plugin.tools.check import check_recipe


@pytest.fixture
def dump(tmp_path):
    """64 sequences of 50 tokens; sequence i's prev - gen is the constant (i - 31.5) / 100."""
    path = tmp_path / "dump.jsonl"
    with open(path, "w") as fh:
        for i in range(64):
            gen = [-1.0 - 0.01 * t for t in range(50)]
            prev = [g + (i - 31.5) / 100 for g in gen]
            fh.write(json.dumps({"prev_logprobs": prev, "generation_logprobs": gen}) + "\n")
    return path


def test_calibrate_proposes_a_band_rejecting_the_target(dump, tmp_path, capsys):
    out_json = tmp_path / "band.json"
    assert main(["calibrate", "--from", str(dump), "--target", "0.125", "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    # As written, [0.99, 1.01] keeps only the two sequences with |mean d| = 0.005.
    assert "as written [0.99, 1.01]: rejects 96.9% of the sequences" in out
    assert "rejects 12.5% of the sequences" in out  # 4 of 64 on each side
    result = json.loads(out_json.read_text())
    (stage,) = result["stages"]
    assert stage["rejected_frac_calibrated"] == pytest.approx(0.125)
    assert stage["calibrated"]["lower"] < 1.0 < stage["calibrated"]["upper"]
    # The printed section is a loss config the plugin accepts, with the calibrated numbers.
    section = yaml.safe_load(out[out.index("loss_fn:") :])
    from nemo_rs_plugin import CorrectedPGLoss

    loss = CorrectedPGLoss({**section["loss_fn"], "use_importance_sampling_correction": True})
    assert loss.cfg.rejection_sampling[0].upper == pytest.approx(stage["calibrated"]["upper"], rel=1e-5)


def test_calibrate_reads_a_recipes_stages(dump, capsys):
    recipe = "recipes/grpo-qwen3-30ba3b-4n8g-megatron-tp4ep8-32k-rs.yaml"
    assert main(["calibrate", "--from", str(dump), "--recipe", recipe]) == 0
    out = capsys.readouterr().out
    assert "stage 0 (sequence_ratio_mean" in out and "stage 1 (sequence_ratio_any" in out


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--target", "1.5"], "--target: got 1.5; allowed: 0 <= target < 1"),
        (["--target", "nan"], "--target: got nan"),
        (["--filters", "geo", "token-mis"], "--filters: unknown geo; allowed: geo-rs, token-mis, outlier-veto"),
        (["--from-missing"], "--from: "),
    ],
)
def test_calibrate_bad_input_is_one_line(dump, tmp_path, capsys, args, needle):
    if args == ["--from-missing"]:
        argv = ["calibrate", "--from", str(tmp_path / "nope.jsonl")]
    else:
        argv = ["calibrate", "--from", str(dump), *args]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err
    assert all(line.startswith("error: ") for line in err.strip().splitlines()), err


def test_calibrate_refuses_what_a_dump_cannot_calibrate(dump, tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"loss_fn": {"name": "rs_clipped_pg"}}))
    assert main(["calibrate", "--from", str(dump), "--recipe", str(recipe)]) == 2
    assert "has no loss_fn.rejection_sampling" in capsys.readouterr().err
    opsm = {"level": "sequence", "statistic": "ratio", "upper": 2.0, "log_ratio": "curr-prev"}
    recipe.write_text(yaml.safe_dump({"loss_fn": {"name": "rs_clipped_pg", "rejection_sampling": [opsm]}}))
    assert main(["calibrate", "--from", str(dump), "--recipe", str(recipe)]) == 2
    assert "reads the current policy" in capsys.readouterr().err


def _recipe(tmp_path, band, tokens, agg="mean"):
    path = tmp_path / "r.yaml"
    stage = {"level": "sequence", "statistic": "ratio", "agg": agg, "lower": band[0], "upper": band[1]}
    path.write_text(
        yaml.safe_dump(
            {
                "policy": {"generation": {"max_new_tokens": tokens}},
                "loss_fn": {
                    "name": "rs_clipped_pg",
                    "use_importance_sampling_correction": True,
                    "rejection_sampling": [stage],
                },
            }
        )
    )
    return str(path)


def test_check_warns_at_the_unhealthy_share_not_only_above_half(tmp_path):
    assert UNHEALTHY_SEQ_REJECTION == 0.2
    # ~28% rejected at 1000 tokens and 0.02 per-token mismatch: unhealthy, though under half.
    report = check_recipe(_recipe(tmp_path, (0.9991, 1.0009), 1000))
    (warning,) = [w for w in report.warnings if "would reject" in w]
    assert "~28%" in warning and "more than 20% is unhealthy" in warning and "nemo-rs calibrate" in warning
    report = check_recipe(_recipe(tmp_path, (0.99, 1.01), 1000))  # Geo-RS as shipped: healthy here
    assert not [w for w in report.warnings if "would reject" in w]


def test_check_estimates_at_the_recipes_own_length(tmp_path):
    report = check_recipe(_recipe(tmp_path, (0.5, 2.0), 30720, agg="sum"))
    (warning,) = [w for w in report.warnings if "would reject" in w]
    assert "up to 30720 tokens" in warning  # not capped at 4096


def test_check_notes_an_async_sequence_band_but_not_a_veto(tmp_path):
    path = _recipe(tmp_path, (0.99, 1.01), 1000)
    with open(path) as fh:
        cfg = yaml.safe_load(fh)
    cfg["grpo"] = {"async_grpo": {"enabled": True}}
    with open(path, "w") as fh:
        fh.write(yaml.safe_dump(cfg))
    assert [n for n in check_recipe(path).notes if "nemo-rs calibrate" in n]
    cfg["loss_fn"]["rejection_sampling"][0]["agg"] = "any"
    with open(path, "w") as fh:
        fh.write(yaml.safe_dump(cfg))
    assert not [n for n in check_recipe(path).notes if "nemo-rs calibrate" in n]


def test_a_band_kept_because_the_datas_is_narrower_says_so(tmp_path, capsys):
    """Widen-only keeps the template where the data's band is narrower: not "calibrated" (issue 51, item 5)."""
    path = tmp_path / "tight.jsonl"
    with open(path, "w") as fh:
        for i in range(64):  # mean log-ratio within +-0.0032: a band far inside [0.99, 1.01]
            gen = [-1.0 - 0.01 * t for t in range(50)]
            fh.write(json.dumps({"prev_logprobs": [g + (i - 31.5) / 10000 for g in gen], "generation_logprobs": gen}))
            fh.write("\n")
    assert main(["calibrate", "--from", str(path)]) == 0
    out = capsys.readouterr().out
    assert "calibrated [" not in out
    assert "kept as written [0.99, 1.01]: rejects 0.0% of the sequences" in out
    line = next(line for line in out.splitlines() if "the data's band" in line)
    assert "is narrower on the lower and upper side" in line and "--allow-tighter uses the data's band" in line
    lower, upper = (float(x) for x in line.split("[")[1].split("]")[0].split(", "))
    assert 0.99 < lower < 1.0 < upper < 1.01
    assert main(["calibrate", "--from", str(path), "--allow-tighter"]) == 0
    out = capsys.readouterr().out
    assert f"calibrated [{lower:.6g}, {upper:.6g}]" in out and "the data's band" not in out
