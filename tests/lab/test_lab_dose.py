"""Guards the lab's dose-response run (lab/dose.py, ``nemo-rs lab --lags``).

The Holm family of the run (the tests themselves: tests/lab/test_lab_stats.py); chance
against exact enumeration of the task; the outcome rules on constructed runs; the arms
against the presets and the recipes they mirror; the tables against their CSV and a page's
marked block; and the quick dose-response run CI uses, end to end. No assertion about which correction learns better.
"""

from __future__ import annotations

import csv
import itertools
import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import yaml

from nemo_rs_plugin.core.settings import presets
from nemo_rs_plugin.lab import cli as lab
from nemo_rs_plugin.lab.dose import (
    SEED_FIELDS,
    dose_comparisons,
    dose_outcomes,
    dose_table,
    planned_tests,
    read_seed_csv,
    run_outcome,
    smallest_p,
    write_seed_csv,
)
from nemo_rs_plugin.lab.dose_report import (
    doc_block_mismatch,
    format_dose_response,
    marked_block,
    render_blocks,
    render_from_csv,
    with_block,
)
from nemo_rs_plugin.lab.experiment import (
    CONFIGS,
    DEFAULT_ARMS,
    DOSE_ARMS,
    DOSE_LAGS,
    SEQ_MASK_TIS_BOUNDS,
    STEP_METRICS,
    LabSettings,
)
from nemo_rs_plugin.lab.model import chance_reward, reward_of
from nemo_rs_plugin.lab.pool import dose_jobs
from nemo_rs_plugin.tools.recipes import recipe_dir
from tests.lab.outcomes import seed_outcome

DOCS = Path(__file__).resolve().parents[2] / "docs"


# ---------------------------------------------------------------------------- chance
@pytest.mark.parametrize("vocab, length", [(1, 1), (2, 3), (3, 2), (2, 4)])
def test_chance_is_the_uniform_samplers_expected_reward_exactly(vocab, length):
    """Every start token and every response over the model's vocabulary (BOS included), enumerated."""
    tokens = range(vocab + 1)
    right, count = 0, 0  # response tokens right, responses
    for start in range(vocab):
        for response in itertools.product(tokens, repeat=length):
            reward = float(reward_of(torch.tensor([response]), torch.tensor([start]), vocab)[0])
            right += round(reward * length)  # reward_of is a float32 mean of whole tokens
            count += 1
    assert chance_reward(vocab, length) == pytest.approx(right / (count * length), abs=1e-15)


def test_chance_of_the_published_task():
    # 17 tokens (16 and BOS), 64 response tokens: (1/17 + 63 * 16/17^2) / 64
    assert chance_reward(16, 64) == pytest.approx((1 / 17 + 63 * 16 / 289) / 64, abs=1e-15)
    assert chance_reward(16, 64) == pytest.approx(0.0554174, abs=1e-7)
    assert chance_reward(16, 1) == pytest.approx(1 / 17)
    with pytest.raises(ValueError):
        chance_reward(0, 4)


def test_chance_counts_the_models_real_vocabulary():
    pytest.importorskip("transformers")
    from nemo_rs_plugin.lab.model import build_model, model_vocab_size

    s = LabSettings(vocab=16, hidden=16, layers=1, experts=2, top_k=1, length=4)
    assert build_model(s).config.vocab_size == model_vocab_size(16) == 17


# ---------------------------------------------------------------------------- the Holm family
def test_the_default_run_can_separate_and_twelve_seeds_could_not():
    tests = planned_tests(DOSE_ARMS, DOSE_LAGS)
    assert tests == (6 * 5 + 7 * 5) * 3  # vs none: 6 arms x 5 lags; vs on-policy: 7 x 5; 3 outcomes each
    # McNemar's floor: a count outcome can be separated with 16 seeds, not with 12
    assert smallest_p(16) == 2 / 2**16 and smallest_p(16) * tests < 0.05
    assert smallest_p(12) * tests > 0.05


# ---------------------------------------------------------------------------- outcomes
def _steps(evals: dict, n: int = 20, norms=None, rejected=0.0) -> list[dict]:
    norms = norms or [1.0] * n
    return [
        {
            "step": i + 1,
            "reward": 0.1,
            "eval_reward": evals.get(i + 1, math.nan),
            "grad_norm": norms[i],
            "grad_norm_max": norms[i],
            "kl_gen_prev": 0.01 * i,
            "is_ess": 1.0 - 0.01 * i,
            "seq_rejected_frac": rejected,
            "rejection_warnings": 0,
            "band_lower": math.nan,
            "band_upper": math.nan,
            "wall_s": float(i),
        }
        for i in range(n)
    ]


def test_run_outcomes_on_constructed_runs():
    chance = 0.05
    # peaks at 0.5 (>= 3x chance), ends at mean(0.2, 0.25, 0.2) = 0.2167 <= 0.25: collapsed
    o = run_outcome(_steps({5: 0.3, 10: 0.5, 15: 0.2, 20: 0.25, 25: 0.2}, n=25), chance)
    assert o["final_eval"] == pytest.approx((0.2 + 0.25 + 0.2) / 3) and o["eval_peak"] == 0.5
    assert o["collapsed"] and not o["at_chance"] and o["evals"] == 5
    # the whole curve: the mean of every evaluation, the collapse costing only the steps it lasts
    assert o["eval_auc"] == pytest.approx((0.3 + 0.5 + 0.2 + 0.25 + 0.2) / 5)
    assert o["is_ess_mean"] == pytest.approx(1.0 - 0.01 * sum(range(25)) / 25)
    # ends just above half its peak: not collapsed
    assert not run_outcome(_steps({5: 0.5, 10: 0.26, 15: 0.26, 20: 0.26}), chance)["collapsed"]
    # never learned (peak 0.14 < 3x chance): not collapsed, and the last 3 <= 2x chance: at chance
    o = run_outcome(_steps({5: 0.14, 10: 0.1, 15: 0.09, 20: 0.1}), chance)
    assert not o["collapsed"] and o["at_chance"]
    # one of the last 3 above 2x chance: not at chance
    assert not run_outcome(_steps({5: 0.1, 10: 0.1, 15: 0.11, 20: 0.1}), chance)["at_chance"]
    # spike: above 10x the run's median norm (steps without a gradient left out of the median)
    norms = [0.0] * 10 + [0.5] * 9 + [5.1]
    o = run_outcome(_steps({20: 0.3}, norms=norms), chance)
    assert o["spiked"] and o["median_grad_norm"] == 0.5 and o["max_grad_norm"] == 5.1
    assert not run_outcome(_steps({20: 0.3}, norms=[0.5] * 19 + [4.9]), chance)["spiked"]
    assert not run_outcome(_steps({20: 0.3}, norms=[0.0] * 20), chance)["spiked"]


def _run_rows(config, lag, seed, evals, n=10):
    return [{"config": config, "lag": lag, "seed": seed, **r} for r in _steps(evals, n=n)]


def test_dose_outcomes_pair_the_reference_by_seed():
    s = LabSettings(vocab=16, length=64, configs=["on-policy", "none"], seeds=[0, 1])
    rows = []
    for seed in (0, 1):
        rows += _run_rows("on-policy", 0, seed, {5: 0.5, 10: 0.6 + 0.1 * seed})
        for lag in (0, 4):
            rows += _run_rows("none", lag, seed, {5: 0.4, 10: 0.3 - 0.1 * lag / 4})
    out = dose_outcomes(list(reversed(rows)), s)  # any row order
    assert [(o["config"], o["lag"], o["seed"]) for o in out] == [
        ("on-policy", 0, 0),
        ("on-policy", 0, 1),
        ("none", 0, 0),
        ("none", 0, 1),
        ("none", 4, 0),
        ("none", 4, 1),
    ]
    by = {(o["config"], o["lag"], o["seed"]): o for o in out}
    assert by[("none", 4, 1)]["final_eval"] == pytest.approx((0.4 + 0.2) / 2)
    assert by[("none", 4, 1)]["regret"] == pytest.approx((0.5 + 0.7) / 2 - 0.3)
    assert by[("on-policy", 0, 0)]["regret"] == 0.0
    assert out[0]["chance"] == chance_reward(16, 64)
    assert list(out[0]) == list(SEED_FIELDS)


def _outcome(config, lag, seed, final_eval, collapsed=False, at_chance=False):
    return seed_outcome(config, lag, seed, final_eval=final_eval, collapsed=collapsed, at_chance=at_chance)


def _synthetic(seeds=16):
    """on-policy 0.6; none 0.5 at lag 0, 0.3 at lag 8 (at chance in every seed at lag 8);
    token-mis 0.5 at lag 0 (noise around none), none + 0.2 at lag 8."""
    out = []
    for i in range(seeds):
        noise = 0.01 * ((5 * i) % 7 - 3)
        out.append(_outcome("on-policy", 0, i, 0.6 + noise))
        out.append(_outcome("none", 0, i, 0.5 + noise))
        out.append(_outcome("none", 8, i, 0.05, at_chance=True))
        out.append(_outcome("token-mis", 0, i, 0.5 + noise + (0.01 if i % 2 else -0.01)))
        out.append(_outcome("token-mis", 8, i, 0.25 + noise, collapsed=i < 3))
    return out


def test_comparisons_are_paired_holm_corrected_and_separate_only_what_differs():
    rows = dose_comparisons(_synthetic())
    keys = [(r["a"], r["b"], r["lag"]) for r in rows]
    assert keys == [
        ("token-mis", "none", 0),
        ("token-mis", "none", 8),
        ("none", "on-policy", 0),
        ("none", "on-policy", 8),
        ("token-mis", "on-policy", 0),
        ("token-mis", "on-policy", 8),
    ]
    by = dict(zip(keys, rows))
    lag0 = by[("token-mis", "none", 0)]
    assert lag0["final_eval_diff"] == pytest.approx(0.0) and lag0["final_eval_p"] == pytest.approx(1.0)
    assert lag0["separated"] == []
    lag8 = by[("token-mis", "none", 8)]
    assert lag8["final_eval_diff"] == pytest.approx(0.2 + sum(0.01 * ((5 * i) % 7 - 3) for i in range(16)) / 16)
    assert lag8["final_eval_p"] < 1e-12  # paired t: +0.2 with a spread of 0.02
    assert lag8["final_eval_low"] < lag8["final_eval_diff"] < lag8["final_eval_high"]
    assert lag8["final_eval_high"] - lag8["final_eval_low"] < 0.05
    assert lag8["final_eval_p_holm"] == pytest.approx(lag8["final_eval_p"] * 18)  # the smallest of 6 x 3 tests
    assert lag8["at_chance"] == "0/16 vs 16/16" and lag8["at_chance_p"] == 2 / 2**16
    assert lag8["collapsed"] == "3/16 vs 0/16" and lag8["collapsed_p"] == 0.25  # 3 discordant: 2/8
    assert lag8["separated"] == ["final_eval", "at_chance"]
    assert by[("none", "on-policy", 0)]["final_eval_diff"] == pytest.approx(-0.1)
    assert len(rows) * 3 == planned_tests(["on-policy", "none", "token-mis"], [0, 8]) == 18
    p_holm = [r[f"{k}_p_holm"] for r in rows for k in ("final_eval", "collapsed", "at_chance")]
    assert all(0 <= p <= 1 for p in p_holm)  # 0: a constant nonzero difference (no spread)

    table = {(r["config"], r["lag"]): r for r in dose_table(_synthetic(), rows)}
    assert table[("on-policy", "")]["seeds"] == 16
    assert table[("token-mis", 8)]["regret"] == pytest.approx(0.35)
    assert table[("token-mis", 8)]["collapsed"] == 3 and table[("none", 8)]["at_chance"] == 16
    assert table[("none", 8)]["regret_low"] <= 0.55 <= table[("none", 8)]["regret_high"]

    # Fewer seeds: the counts are no longer separated once Holm counts every test (McNemar's
    # smallest p at 6 seeds is 2/64, x 18 > 0.05); the final eval's t-test has no such floor.
    few = [o for o in _synthetic() if o["seed"] < 6]
    assert [r["separated"] for r in dose_comparisons(few) if (r["a"], r["lag"]) == ("token-mis", 8)] == [
        ["final_eval"],
        ["final_eval"],
    ]


def test_tables_render_from_the_csv_and_a_pages_block_is_checked(tmp_path):
    path = tmp_path / "lab_dose_seeds.csv"
    write_seed_csv(_synthetic(), path)
    outcomes = read_seed_csv(path)
    assert len(outcomes) == 5 * 16 and outcomes[0]["config"] == "on-policy"
    assert isinstance(outcomes[0]["collapsed"], bool) and isinstance(outcomes[0]["lag"], int)
    text = format_dose_response(outcomes)
    assert render_from_csv(path, "dose-response") == text
    assert "| arm | lag 0 | lag 8 |" in text
    assert "| `token-mis` | 0.499 (+0.000 [" in text
    assert "16 paired seeds (0-15)" in text and "over all 18 tests" in text
    assert "0 / 16 of 16" in text and "3 / 0* of 16" in text  # (collapsed / at chance) at lag 8
    assert render_from_csv(path) == render_blocks(outcomes)

    page = "# Page\n\nintro\n\n<!-- lab:dose-response:begin -->\nstale\n<!-- lab:dose-response:end -->\n\nmore\n"
    doc = tmp_path / "page.md"
    doc.write_text(page)
    assert doc_block_mismatch(doc, path) is not None  # a stale block
    doc.write_text(with_block(page, "dose-response", text))
    assert doc_block_mismatch(doc, path) is None
    assert doc.read_text().startswith("# Page\n\nintro\n\n<!-- lab:dose-response:begin -->\n")
    assert doc.read_text().endswith("<!-- lab:dose-response:end -->\n\nmore\n")
    edited = doc.read_text().replace("0.499 (+0.000", "0.501 (+0.000", 1)  # a number edited by hand
    doc.write_text(edited)
    diff = doc_block_mismatch(doc, path)
    assert diff is not None and "0.501" in diff
    with pytest.raises(ValueError):
        marked_block("no markers", "dose-response")
    with pytest.raises(ValueError):
        marked_block("<!-- lab:x:end --> <!-- lab:x:begin -->", "x")


def test_one_seed_tables_say_which_statistics_need_more_seeds(tmp_path):
    """One paired seed: differences and counts, and in place of each interval, t-test and sd the reason (issue 49)."""
    path = tmp_path / "lab_dose_seeds.csv"
    write_seed_csv(_synthetic(seeds=1), path)
    outcomes = read_seed_csv(path)
    rows = dose_comparisons(outcomes)
    assert len(rows) == 6 and all(r["seeds"] == 1 for r in rows)
    assert all(math.isnan(r[k]) for r in rows for k in ("final_eval_low", "final_eval_high", "final_eval_p"))
    assert all(r["collapsed_p"] == 1.0 and r["separated"] == [] for r in rows)
    table = {(r["config"], r["lag"]): r for r in dose_table(outcomes, rows)}
    assert math.isnan(table[("on-policy", "")]["final_eval_sd"])
    text = render_blocks(outcomes)
    assert "nan" not in text.lower()
    assert "1 paired seed (0);" in text and "over all 12 tests of the run" in text  # the McNemar tests only
    assert "With 1 seed there is no paired t interval or t-test on final eval and no sd over seeds" in text
    assert "final eval 0.570 (no sd: it needs 2 or more seeds, this run has 1)" in text
    assert "| `token-mis` | 0.460 (-0.010 [no interval: it needs 2 or more paired seeds]) |" in text
    assert "| no t-test: it needs 2 or more paired seeds |" in text
    assert render_from_csv(path) == text  # --report says the same


def test_a_csv_written_before_eval_auc_reads_it_as_nan(tmp_path):
    """The exploration (docs/lab/lab_dose_seeds.csv) predates eval_auc: its tables still render."""
    path = tmp_path / "old.csv"
    write_seed_csv(_synthetic(2), path)
    with open(path, newline="") as fh:
        rows = list(csv.DictReader(fh))
    old_fields = [k for k in SEED_FIELDS if k != "eval_auc"]
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, old_fields, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    outcomes = read_seed_csv(path)
    assert all(math.isnan(o["eval_auc"]) for o in outcomes)
    assert outcomes[1]["final_eval"] == pytest.approx(0.5 - 0.03)
    assert "| arm | lag 0 | lag 8 |" in format_dose_response(outcomes)


def test_read_seed_csv_refuses_another_csv(tmp_path):
    other = tmp_path / "lab_seeds.csv"
    other.write_text("config,seed,eval_final\nnone,0,0.5\n")
    with pytest.raises(ValueError, match="missing columns: lag"):
        read_seed_csv(other)


# ---------------------------------------------------------------------------- arms
def _recipe_loss(name: str) -> dict:
    loss = yaml.safe_load((recipe_dir() / name).read_text())["loss_fn"]
    return {k: v for k, v in loss.items() if k != "name"}


def test_token_tis_veto_is_the_async_recipes_correction_exactly():
    recipe = _recipe_loss("grpo-qwen3-30ba3b-4n8g-megatron-async-tokentis.yaml")
    assert CONFIGS["token-tis+veto"].loss == recipe
    assert CONFIGS["token-tis+veto"].loss == {**presets.tis("token"), "rejection_sampling": [presets.OUTLIER_VETO]}


def test_peer_arms_are_the_presets_and_nemo_rls_seq_mask_tis():
    assert CONFIGS["token-mis"].loss == {**presets.is_level("token"), "rejection_sampling": [presets.TOKEN_MIS]}
    assert CONFIGS["veto"].loss == {"rejection_sampling": [presets.OUTLIER_VETO]}
    seq = CONFIGS["seq-mis"].loss
    assert seq["is_correction_level"] == "token" and seq["truncated_importance_sampling_type"] == "seq-mask-tis"
    shipped = _recipe_loss("grpo-qwen3.5-35ba3b-4n8g-megatron-ep16-9k-seqmean.yaml")
    assert shipped["truncated_importance_sampling_type"] == "seq-mask-tis"
    assert SEQ_MASK_TIS_BOUNDS == (
        shipped["truncated_importance_sampling_ratio_min"],
        shipped["truncated_importance_sampling_ratio"],
    )
    assert (seq["truncated_importance_sampling_ratio_min"], seq["truncated_importance_sampling_ratio"]) == (
        SEQ_MASK_TIS_BOUNDS
    )
    assert "rejection_sampling" not in seq


def test_arm_lists():
    assert set(DOSE_ARMS) <= set(CONFIGS) and DOSE_ARMS[:2] == ["on-policy", "none"]
    # the single-lag default is the published run's (docs/lab.md)
    assert DEFAULT_ARMS == json.loads((DOCS / "lab" / "lab_settings.json").read_text())["configs"]
    assert DOSE_LAGS == [0, 1, 2, 4, 8]
    jobs = dose_jobs(["on-policy", "none", "veto"], [3, 4], [0, 2])
    assert jobs == [
        ("on-policy", 3, 0),
        ("on-policy", 4, 0),
        ("none", 3, 0),
        ("none", 4, 0),
        ("none", 3, 2),
        ("none", 4, 2),
        ("veto", 3, 0),
        ("veto", 4, 0),
        ("veto", 3, 2),
        ("veto", 4, 2),
    ]


@pytest.mark.parametrize("name", ["token-tis+veto", "token-mis", "seq-mis", "veto"])
def test_new_arms_train(name):
    pytest.importorskip("transformers")
    from nemo_rs_plugin.lab.experiment import QUICK, run_one

    s = LabSettings(**{**QUICK, "steps": 2, "lag": 8})
    rows = run_one(name, 0, s)
    assert len(rows) == 2 and all(r["lag"] == 8 for r in rows)
    for r in rows:
        for k in STEP_METRICS:
            if k not in ("eval_reward", "band_lower", "band_upper"):
                assert math.isfinite(r[k]), (name, k, r[k])
        assert 0.0 <= r["seq_rejected_frac"] <= 1.0


# ---------------------------------------------------------------------------- command line
def _settings(*argv):
    return lab.settings_from(lab.build_parser().parse_args(list(argv)))


def test_dose_defaults_and_the_single_lag_defaults():
    s = _settings("--lags", "0", "1", "2", "4", "8")
    assert (s.steps, s.configs, s.seeds) == (80, DOSE_ARMS, list(range(100, 116)))
    assert set(s.seeds).isdisjoint(range(12))  # seeds the published runs did not use
    single = _settings()
    assert (single.steps, single.lag, single.configs, single.seeds) == (60, 8, DEFAULT_ARMS, list(range(12)))
    quick = _settings("--quick", "--lags", "0", "2")
    assert (quick.steps, quick.length, quick.seeds) == (6, 16, [0, 1])
    assert quick.configs == ["on-policy", "none", "token-tis+veto"]
    assert _settings("--lags", "0", "--steps", "30", "--seeds", "5", "6").steps == 30


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--lags", "0", "2", "--lag", "4"], "--lag: one lag, or --lags"),
        (["--lags", "0", "-2"], "--lags: got -2; each must be at least 0"),
        (["--lags", "2", "2"], "--lags: 2 given more than once"),
    ],
)
def test_dose_flag_problems(argv, needle, tmp_path):
    args = lab.build_parser().parse_args([*argv, "--out", str(tmp_path / "o")])
    problems = lab.settings_problems(lab.settings_from(args), args)
    assert any(needle in p for p in problems), problems


def test_report_without_a_saved_run_is_one_line(tmp_path, capsys):
    assert lab.main(["--report", str(tmp_path)]) == lab.EXIT_INVALID
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error: --report" in err and "lab_dose_seeds.csv" in err


def test_report_rerenders_a_saved_csv(tmp_path, capsys):
    write_seed_csv(_synthetic(4), tmp_path / "lab_dose_seeds.csv")
    assert lab.main(["--report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out == render_blocks(read_seed_csv(tmp_path / "lab_dose_seeds.csv"))
    assert out.startswith("<!-- lab:dose-response:begin -->") and "<!-- lab:dose-comparisons:end -->" in out


# ---------------------------------------------------------------------------- the quick run (CI)
@pytest.mark.slow  # 15-40 s on 2 cores: 5 arm-lag runs x 2 seeds x 6 steps, then one run again
def test_quick_dose_response_run(tmp_path):
    """``nemo-rs lab --quick --lags 0 2``: the whole machinery, in seconds."""
    pytest.importorskip("transformers")
    from nemo_rs_plugin.lab.experiment import run_one

    out = tmp_path / "dose"
    assert lab.main(["--quick", "--lags", "0", "2", "--out", str(out), "--workers", "1"]) == 0
    for name in (
        "lab_dose_steps.csv",
        "lab_dose_seeds.csv",
        "lab_dose.csv",
        "lab_dose_comparisons.csv",
        "lab_dose.md",
        "lab_dose_settings.json",
    ):
        assert (out / name).is_file(), name
    s = _settings("--quick", "--lags", "0", "2")
    with open(out / "lab_dose_steps.csv") as fh:
        rows = list(csv.DictReader(fh))
    runs = {(r["config"], r["lag"], r["seed"]) for r in rows}
    assert runs == set(
        [("on-policy", "0", str(seed)) for seed in s.seeds]
        + [(c, str(lag), str(seed)) for c in s.configs[1:] for lag in (0, 2) for seed in s.seeds]
    )
    assert len(rows) == len(runs) * s.steps
    settings = json.loads((out / "lab_dose_settings.json").read_text())
    assert settings["lags"] == [0, 2] and settings["steps"] == 6 and "lag" not in settings

    outcomes = read_seed_csv(out / "lab_dose_seeds.csv")
    assert len(outcomes) == len(runs) and all(o["evals"] == 3 for o in outcomes)
    assert all(math.isfinite(o["final_eval"]) and math.isfinite(o["regret"]) for o in outcomes)
    assert (out / "lab_dose.md").read_text() == render_from_csv(out / "lab_dose_seeds.csv")
    comparisons = list(csv.DictReader((out / "lab_dose_comparisons.csv").read_text().splitlines()))
    assert len(comparisons) == 2 + 4  # token-tis+veto vs none at 2 lags; 2 arms vs on-policy at 2 lags

    # A run of the dose-response is the single-lag run at that lag: the same numbers.
    again = run_one("token-tis+veto", s.seeds[1], replace(s, lag=2))
    first = [r for r in rows if r["config"] == "token-tis+veto" and r["lag"] == "2" and r["seed"] == str(s.seeds[1])]
    for a, b in zip(first, again, strict=True):
        for k in STEP_METRICS:
            if k != "wall_s":
                assert a[k] == f"{b[k]:.6g}", (k, a[k], b[k])
