"""Guards the lab (lab/): the quick run CI uses, the outcomes, the tests of separation.

The quick run must complete, be deterministic and finite, and calibrate its band after the
pilot steps; a run of every kind with one seed keeps its CSVs and succeeds. The outcome rules
(spike, collapse, at chance, warned) and the two tests of separation are checked on constructed
rows with known answers. No assertion about which correction learns better: the experiment
reports, it is not tuned.

Only the tests that train need transformers (the ``[lab]`` extra; the ``[test]`` extra brings
it too): each skips alone without it, the rest run.
"""

import csv
import math
import sys

import pytest

from nemo_rs_plugin.lab.experiment import BASE_LOSS, CONFIGS, STEP_METRICS, LabSettings, run_one
from nemo_rs_plugin.lab.run_report import compare, format_comparisons, format_table, seed_outcomes, summarize
from nemo_rs_plugin.lab.stats import fisher_exact, permutation_p

_MAY_BE_NAN = ("eval_reward", "band_lower", "band_upper")  # set only at evaluations / after calibration


@pytest.mark.slow  # 15-40 s on 2 cores: 2 arms x 2 seeds x 4 steps of training, then one run again
def test_quick_mode_completes_deterministic_finite_and_calibrates(tmp_path):
    pytest.importorskip("transformers")
    from nemo_rs_plugin.lab import cli as lab

    out = tmp_path / "lab"
    assert lab.main(["--quick", "--out", str(out), "--workers", "1"]) == 0
    for name in (
        "lab_steps.csv",
        "lab_seeds.csv",
        "lab_summary.csv",
        "lab_comparisons.csv",
        "lab_summary.md",
        "lab_settings.json",
        "lab.png",
        "lab_seeds.png",
    ):
        assert (out / name).is_file(), name

    s = lab.settings_from(lab.build_parser().parse_args(["--quick"]))
    with open(out / "lab_steps.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == len(s.configs) * len(s.seeds) * s.steps
    assert {r["lag"] for r in rows} == {str(s.lag)}  # the quick arms are stale (the reference's would be 0)
    for r in rows:
        for k in STEP_METRICS:
            if k not in _MAY_BE_NAN:
                assert math.isfinite(float(r[k])), (r["config"], r["step"], k, r[k])
        assert 0.0 <= float(r["reward"]) <= 1.0
        evaluated = int(r["step"]) % s.eval_every == 0 or int(r["step"]) == s.steps
        assert math.isfinite(float(r["eval_reward"])) == evaluated

    # The calibrated arm runs its pilot without the band, then with a band that holds ratio 1.
    calibrated = [r for r in rows if CONFIGS[r["config"]].calibrated]
    assert calibrated
    for r in calibrated:
        has_band = math.isfinite(float(r["band_lower"]))
        assert has_band == (int(r["step"]) > s.calibration_steps), r["step"]  # set after the pilot's last step
        if has_band:
            assert float(r["band_lower"]) <= 1.0 <= float(r["band_upper"])

    # The same arm and seed again, in this process: the same numbers (wall time aside).
    name, seed = s.configs[-1], s.seeds[0]
    again = run_one(name, seed, s)
    first = [r for r in rows if r["config"] == name and r["seed"] == str(seed)]
    for a, b in zip(first, again):
        for k in STEP_METRICS:
            if k != "wall_s":
                assert a[k] == f"{b[k]:.6g}", (k, a[k], b[k])


def test_every_arm_is_a_valid_loss_config():
    from nemo_rs_plugin import CorrectedPGLoss

    for name, arm in CONFIGS.items():
        CorrectedPGLoss({**BASE_LOSS, **arm.loss})
        for template in arm.calibrated:
            CorrectedPGLoss({**BASE_LOSS, **arm.loss, "rejection_sampling": [template]})


def _rows(config, seed, rewards, norms=None, evals=None, rejected=None, warnings=0):
    n = len(rewards)
    norms = norms or [1.0] * n
    rows = []
    for i, reward in enumerate(rewards):
        rows.append(
            {
                "config": config,
                "seed": seed,
                "step": i + 1,
                "reward": reward,
                "eval_reward": (evals or {}).get(i + 1, math.nan),
                "grad_norm_max": norms[i],
                "grad_spikes": int(norms[i] > 5.0),
                "kl_gen_prev": 0.1 * i,
                "seq_rejected_frac": (rejected or [0.0] * n)[i],
                "token_rejected_frac": 0.0,
                "is_ess": 1.0,
                "mismatch_mean": 0.1,
                "routing_diff_frac": 0.2,
                "band_lower": math.nan,
                "band_upper": math.nan,
                "rejection_warnings": warnings if i == n - 1 else 0,
                "wall_s": float(i),
            }
        )
    return rows


def test_outcomes_on_constructed_runs():
    s = LabSettings(vocab=16, configs=["none"], seeds=[0, 1, 2, 3], steps=20, spike=5.0)
    chance = 1 / 16
    rows = (
        # learns, then collapses: 5-step mean peaks at 0.6, ends at 0.05 (<= half)
        _rows("none", 0, [0.6] * 10 + [0.05] * 10, evals={20: 0.03})
        # learns steadily; one spike of 40 at step 3
        + _rows("none", 1, [0.1 + 0.02 * i for i in range(20)], norms=[1, 1, 40] + [1] * 17, evals={20: 0.5})
        # never learns: at chance, no collapse (the peak never reaches twice chance)
        + _rows("none", 2, [chance] * 20, evals={20: chance})
        # dips to just above half its peak: not a collapse
        + _rows("none", 3, [0.4] * 10 + [0.21] * 10, evals={20: 0.3}, rejected=[0.5] * 20, warnings=2)
    )
    by_seed = {o["seed"]: o for o in seed_outcomes(rows, s)}
    assert [by_seed[i]["collapsed"] for i in range(4)] == [True, False, False, False]
    assert [by_seed[i]["spiked"] for i in range(4)] == [False, True, False, False]
    assert by_seed[1]["max_grad_norm"] == 40 and by_seed[1]["spike_steps"] == 1
    assert [by_seed[i]["at_chance"] for i in range(4)] == [True, False, True, False]
    assert [by_seed[i]["warned"] for i in range(4)] == [False, False, False, True]
    assert by_seed[3]["seq_kept_mean"] == pytest.approx(0.5) and by_seed[3]["seq_kept_min"] == pytest.approx(0.5)
    assert by_seed[0]["eval_final"] == 0.03 and by_seed[0]["max_kl_gen_prev"] == pytest.approx(1.9)
    (summary,) = summarize(seed_outcomes(rows, s), s)
    assert (summary["seeds_spiked"], summary["seeds_collapsed"], summary["seeds_at_chance"]) == (1, 1, 2)


def test_fisher_exact_known_values():
    # scipy.stats.fisher_exact([[0, 4], [4, 0]]) -> 0.02857; [[0, 12], [5, 7]] -> 0.03727
    assert fisher_exact(0, 4, 4, 4) == pytest.approx(0.028571, abs=1e-6)
    assert fisher_exact(0, 12, 5, 12) == pytest.approx(0.037267, abs=1e-6)
    assert fisher_exact(3, 8, 3, 8) == pytest.approx(1.0)
    assert fisher_exact(1, 8, 4, 8) == pytest.approx(0.282051, abs=1e-6)  # scipy: 0.282051
    with pytest.raises(ValueError):
        fisher_exact(5, 4, 0, 4)


def test_permutation_p_separates_only_what_differs():
    a = [0.5 + 0.01 * i for i in range(8)]
    b = [0.1 + 0.01 * i for i in range(8)]
    assert permutation_p(a, b) < 0.001  # every relabelling but the observed one is smaller
    assert permutation_p(a, a) == 1.0
    assert permutation_p(a, b) == permutation_p(a, b)  # seeded: deterministic
    noisy = [0.5, 0.1, 0.4, 0.2]
    assert permutation_p(noisy, [0.45, 0.15, 0.35, 0.25]) > 0.5


def test_compare_reports_only_supported_separations():
    s = LabSettings(configs=["none", "token-tis"], seeds=list(range(6)), steps=10)
    rows = []
    for seed in range(6):  # none: every seed spikes; token-tis: none does; rewards overlap
        rows += _rows("none", seed, [0.3] * 10, norms=[50.0] * 10, evals={10: 0.3 + 0.01 * seed})
        rows += _rows("token-tis", seed, [0.3] * 10, evals={10: 0.305 + 0.01 * seed})
    (row,) = compare(seed_outcomes(rows, s), [("token-tis", "none")])
    assert row["spiked"] == "0/6 vs 6/6" and row["spiked_p"] < 0.01
    assert row["separated"] == ["spiked"]  # not the reward, not collapse


# ---------------------------------------------------------------------------- one seed
def test_a_one_seed_report_says_what_it_cannot_compute():
    """One seed per arm: no sd and no permutation p, each said in words where the number would be; no NaN printed."""
    s = LabSettings(configs=["none", "token-tis"], seeds=[11], steps=10)
    rows = _rows("none", 11, [0.3] * 10, evals={10: 0.3}) + _rows("token-tis", 11, [0.3] * 10, evals={10: 0.4})
    outcomes = seed_outcomes(rows, s)
    summary = summarize(outcomes, s)
    assert all(math.isnan(r["eval_final_sd"]) and math.isnan(r["final_reward_sd"]) for r in summary)
    (row,) = compare(outcomes, [("token-tis", "none")])
    assert row["eval_diff"] == pytest.approx(0.1) and math.isnan(row["eval_p"])
    assert row["spiked_p"] == 1.0 and row["separated"] == []  # Fisher's test is defined at one seed
    text = format_table(summary, s) + "\n" + format_comparisons([row])
    assert "0.400 (no sd: it needs 2 or more seeds, this run has 1)" in text
    assert "+0.100 (no permutation p: it needs 2 or more seeds per arm)" in text
    assert "nan" not in text.lower()


_TINY = ["--quick", "--steps", "2", "--eval-every", "1", "--workers", "1"]


@pytest.mark.parametrize(
    "kind, argv, csvs, said",
    [
        (
            "single",
            ["--seeds", "11", "--length", "4", "--calibration-steps", "1"],
            ("lab_steps.csv", "lab_seeds.csv", "lab_summary.csv", "lab_comparisons.csv"),
            "no permutation p: it needs 2 or more seeds per arm",
        ),
        (
            "dose",
            ["--seeds", "11", "--length", "4", "--lags", "0", "2"],
            ("lab_dose_steps.csv", "lab_dose_seeds.csv", "lab_dose.csv", "lab_dose_comparisons.csv"),
            "no t-test: it needs 2 or more paired seeds",
        ),
        (
            "confirm",
            ["--confirm", "--seeds", "5000", "--length", "4", "--calibration-steps", "1"],
            ("lab_confirm_steps.csv", "lab_confirm_seeds.csv"),
            "no verdict: it needs 2 or more paired seeds",
        ),
        (
            "length",
            ["--seeds", "11", "--lengths", "4"],
            ("lab_length_steps.csv", "lab_length_seeds.csv"),
            "no t-test: it needs 2 or more paired seeds",
        ),
    ],
)
def test_a_one_seed_run_keeps_its_csvs_and_succeeds(kind, argv, csvs, said, tmp_path, capsys):
    """``nemo-rs lab --seeds 11``: every statistic that needs 2 seeds says so; the run's data is kept (issue 49)."""
    pytest.importorskip("transformers")
    from nemo_rs_plugin.lab import cli as lab

    out = tmp_path / kind
    assert lab.main([*_TINY, *argv, "--out", str(out)]) == 0
    for name in csvs:
        with open(out / name) as fh:
            rows = list(csv.DictReader(fh))
        assert rows, name
        assert {r["seed"] for r in rows if "seed" in r} <= {"11", "5000"}, name
    printed = capsys.readouterr().out
    assert said in printed and "nan" not in printed.lower()


def test_lab_without_transformers_names_the_lab_extra(monkeypatch, capsys, tmp_path):
    """The install line names the ``[lab]`` extra, which brings transformers with the figures and statistics."""
    from nemo_rs_plugin.lab import cli as lab

    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` raises ImportError
    assert lab.main(["--quick", "--out", str(tmp_path / "o")]) == lab.EXIT_INVALID
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nemo-rs lab needs transformers" in err
    assert "pip install 'nemo-rs-plugin[lab]'" in err and 'pip install -e ".[lab]"' in err
    assert not (tmp_path / "o").exists()  # refused before anything is created


def test_the_test_extra_brings_what_the_lab_tests_need():
    """``pip install -e ".[test]"`` brings every ``[lab]`` requirement: no lab test skips for want of one (issue 51)."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    from pathlib import Path

    project = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    assert set(extras["lab"]) <= set(extras["test"])
