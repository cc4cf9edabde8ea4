"""Guards the lab's confirmatory protocol (lab/confirm.py) and its length study (lab/length.py).

The protocol against what it claims to decide (the recipes' corrections, at the staleness the
async recipe allows; seeds disjoint from the exploration's), the power plan against a normal
approximation, the verdicts' words against constructed cases, and the tables against their
CSVs. No assertion about which correction learns better.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import yaml

pytest.importorskip("scipy")
pytest.importorskip("statsmodels")

from nemo_rs_plugin.lab.confirm import (  # noqa: E402
    PROTOCOL,
    Comparison,
    Protocol,
    confirm,
    format_confirmation,
    format_power_plan,
    power_plan,
    protocol_arms,
    protocol_jobs,
    verdict,
)
from nemo_rs_plugin.lab.dose import SEED_FIELDS, read_seed_csv, write_seed_csv  # noqa: E402
from nemo_rs_plugin.lab.experiment import CONFIGS, DOSE  # noqa: E402
from nemo_rs_plugin.lab.length import (  # noqa: E402
    LENGTH_STUDY,
    format_length_study,
    length_comparisons,
    read_length_csv,
    write_length_csv,
)
from nemo_rs_plugin.lab.stats import SIGNIFICANCE, t_interval  # noqa: E402
from nemo_rs_plugin.tools.recipes import recipe_dir  # noqa: E402
from tests.lab.outcomes import seed_outcome  # noqa: E402

OPTIMIZER_STEPS_PER_BATCH = 2  # the lab's minibatches per rollout batch (LabSettings.minibatches)


# ---------------------------------------------------------------------------- the protocol
def test_the_protocol_tests_the_shipped_recipes_at_their_staleness():
    arms = protocol_arms(PROTOCOL)
    assert all(a in CONFIGS and not CONFIGS[a].on_policy for a in arms)
    recipe = yaml.safe_load((recipe_dir() / "grpo-qwen3-30ba3b-4n8g-megatron-async-tokentis.yaml").read_text())
    allowed = recipe["grpo"]["async_grpo"]["max_trajectory_age_steps"] * OPTIMIZER_STEPS_PER_BATCH
    async_ = [c for c in PROTOCOL.primary if c.a == "token-tis+veto"]
    assert [(c.b, c.lag) for c in async_] == [("none", allowed)]
    bands = [c for c in PROTOCOL.primary if c.a == "seqmean+geo-rs+veto"]
    assert [(c.b, c.lag) for c in bands] == [("none", 0)]  # the synchronous recipes' band, synchronous
    assert ("seqmean+calibrated-geo-rs+veto", "seqmean+geo-rs+veto") in {(c.a, c.b) for c in PROTOCOL.primary}
    assert PROTOCOL.outcome in SEED_FIELDS


def test_confirmation_seeds_never_touch_the_exploration():
    assert not set(PROTOCOL.confirmation_seeds) & set(PROTOCOL.exploration_seeds)
    assert set(PROTOCOL.exploration_seeds) == set(DOSE["seeds"])  # the dose-response run explored these
    assert not set(PROTOCOL.confirmation_seeds) & set(range(12))  # nor the earlier single-lag runs'
    assert not set(PROTOCOL.confirmation_seeds) & set(LENGTH_STUDY["seeds"])
    with pytest.raises(ValueError, match="overlap"):
        replace(PROTOCOL, confirmation_seeds=(115, 116))


def test_protocol_jobs_run_each_arm_at_each_needed_lag_once():
    jobs = protocol_jobs(PROTOCOL, [7, 8])
    assert len(jobs) == len(set(jobs))
    pairs = {(arm, lag) for arm, _, lag in jobs}
    assert pairs == {(arm, c.lag) for c in PROTOCOL.primary for arm in (c.a, c.b)}
    assert {seed for _, seed, _ in jobs} == {7, 8}
    assert {seed for _, seed, _ in protocol_jobs(PROTOCOL)} == set(PROTOCOL.confirmation_seeds)


# ---------------------------------------------------------------------------- constructed outcomes
def _o(config, lag, seed, auc, final=None, collapsed=False):
    return seed_outcome(
        config, lag, seed, eval_auc=auc, final_eval=auc if final is None else final, collapsed=collapsed, evals=16
    )


def _outcomes(effects: dict, seeds=range(12), spread=0.02):
    """Every protocol arm at its lags; arm ``a`` of each comparison gets ``effects[(a, b, lag)]`` over b."""
    out = []
    for i in seeds:
        noise = spread * ((5 * i) % 7 - 3) / 3
        base = 0.4 + 0.05 * ((3 * i) % 5)  # seeds differ a lot; the pairing removes it
        values = {}
        for c in PROTOCOL.primary:
            values.setdefault((c.b, c.lag), base)
        for c in PROTOCOL.primary:
            values[(c.a, c.lag)] = values[(c.b, c.lag)] + effects.get((c.a, c.b, c.lag), 0.0) + noise
        out += [_o(arm, lag, i, v) for (arm, lag), v in values.items()]
    return out


def test_verdicts_say_what_the_interval_supports():
    assert verdict(0.2, 0.1, 0.3, 0.001, 0.1, 0.12, 0.28) == "a higher"
    assert verdict(-0.2, -0.3, -0.1, 0.001, 0.1, -0.28, -0.12) == "a lower"
    assert verdict(0.01, -0.05, 0.07, 0.6, 0.1, -0.04, 0.06).endswith("equivalent within ±0.1")
    assert "not shown equivalent" in verdict(0.05, -0.08, 0.18, 0.4, 0.1, -0.05, 0.15)
    assert not verdict(0.05, -0.08, 0.18, 0.4, 0.1, -0.05, 0.15).startswith("a ")


@pytest.mark.parametrize("sign", [1, -1])
def test_a_separated_difference_inside_the_smallest_effect_says_so_at_the_boundary(sign):
    """Issue: a separated gain whose 90% interval lies inside ±delta must not read as a plain "a higher".

    Paired differences scaled so the 90% t interval's far end sits just inside and just outside
    ``delta`` (0.1), with the Holm p far below 0.05 both times: inside, the verdict names a gain
    (or loss) smaller than the smallest effect the advice acts on; outside, the plain words.
    """
    from nemo_rs_plugin.lab.confirm import SMALLER_THAN_DELTA
    from nemo_rs_plugin.lab.stats import t_interval, t_test_p

    pattern = np.array([((7 * i) % 11 - 5) / 5 for i in range(40)])
    pattern = pattern - pattern.mean()

    def judged(far_end: float) -> tuple[str, float]:
        centre = 0.075
        half90 = t_interval(pattern, level=0.90)[1]  # the half-width of the pattern's 90% interval
        d = sign * (centre + pattern * (far_end - centre) / half90)
        low, high = t_interval(d)
        low90, high90 = t_interval(d, level=0.90)
        p = t_test_p(d)
        assert p * len(PROTOCOL.primary) < 0.05  # separated after Holm's strictest step
        assert max(abs(low90), abs(high90)) == pytest.approx(far_end, abs=1e-9)
        return verdict(float(d.mean()), low, high, p * len(PROTOCOL.primary), 0.1, low90, high90), high90

    inside, _ = judged(0.0995)
    outside, _ = judged(0.1005)
    word, change = ("a higher", "gain") if sign > 0 else ("a lower", "loss")
    assert inside == f"{word}: a {change} {SMALLER_THAN_DELTA} (90% interval inside ±0.1)"
    assert outside == word


def test_confirm_holm_corrects_the_primary_family_only():
    c0 = PROTOCOL.primary[0]
    rows = confirm(_outcomes({(c0.a, c0.b, c0.lag): 0.15}))
    assert [(r["a"], r["b"], r["lag"]) for r in rows] == [(c.a, c.b, c.lag) for c in PROTOCOL.primary]
    first = rows[0]
    assert first["diff"] == pytest.approx(0.15 + sum(0.02 * ((5 * i) % 7 - 3) / 3 for i in range(12)) / 12)
    assert first["low"] < first["diff"] < first["high"] and first["verdict"] == "a higher"
    assert first["p_holm"] == pytest.approx(min(1.0, first["p"] * len(PROTOCOL.primary)))
    assert first["better_seeds"] == 12 and first["worse_seeds"] == 0
    for r in rows[1:]:  # no effect, a spread of 0.02: equivalence within ±0.1 shown
        assert r["verdict"] == "no detectable difference; equivalent within ±0.1", r
    noisy = confirm(_outcomes({}, spread=0.4))
    assert all("not shown equivalent" in r["verdict"] for r in noisy)


def test_power_plan_agrees_with_the_normal_approximation():
    c0 = PROTOCOL.primary[0]
    plan = power_plan(_outcomes({(c0.a, c0.b, c0.lag): 0.15}, spread=0.3))
    m = len(PROTOCOL.primary)
    z = {0.05 / 4: 2.4977, 0.8: 0.8416}  # normal quantiles: 1 - 0.0125 / 2, and 0.8
    assert m == 4
    for r in plan:
        normal = ((z[0.05 / 4] + z[0.8]) * r["sd_diff"] / PROTOCOL.delta) ** 2
        assert normal <= r["seeds_needed"] <= normal + 4  # the t distribution asks a few more
    text = format_power_plan(plan)
    assert f"{0.05 / m:.4f}" in text and str(max(r["seeds_needed"] for r in plan)) in text
    with pytest.raises(ValueError, match="no paired eval_auc"):
        power_plan([o for o in _outcomes({}) if o["lag"] != c0.lag])


def test_the_confirmation_table_renders_from_its_csv(tmp_path):
    path = tmp_path / "lab_confirm_seeds.csv"
    write_seed_csv(_outcomes({}, seeds=range(5000, 5012)), path)
    text = format_confirmation(read_seed_csv(path))
    assert text.startswith("12 paired seeds (5000-5011), none of them in the exploration (100-115)")
    assert "Exploratory (unadjusted, not advice)" in text
    assert text.count("| `") == 2 * len(PROTOCOL.primary)


def test_a_protocol_refuses_a_comparison_without_seeds():
    p = Protocol(
        primary=(Comparison("none", "veto", 3, "nothing"),),
        outcome="eval_auc",
        delta=0.1,
        exploration_seeds=(1,),
        confirmation_seeds=(2,),
    )
    with pytest.raises(ValueError, match="no paired seeds"):
        confirm(_outcomes({}), p)


def _tost_boundary_diffs(mean=0.02, seeds=12):
    """Paired differences whose 90% t interval ends just inside +0.1 and whose 95% one ends outside it."""
    from scipy import stats

    z = np.array([(5 * i) % 7 - 3.0 for i in range(seeds)])
    z = (z - z.mean()) / z.std(ddof=1)
    t90, t95 = stats.t.ppf(0.95, seeds - 1), stats.t.ppf(0.975, seeds - 1)
    # the standard error that puts the 90% interval's upper end halfway between +0.1 and where the 95% one crosses it
    se = ((0.1 - mean) / t90 + (0.1 - mean) / t95) / 2
    return (mean + z * se * math.sqrt(seeds)).tolist()


def test_equivalence_is_judged_on_the_90_percent_interval():
    """TOST at 5%: "equivalent within ±0.1" when the 90% interval lies inside, even where the 95% one does not.

    The case sits at the boundary where the two intervals disagree (the reverse cannot happen:
    the 95% interval holds the 90% one). Judged on the 95% interval, its verdict would be "not shown".
    """
    c0 = PROTOCOL.primary[0]
    diffs = _tost_boundary_diffs()
    low90, high90 = t_interval(diffs, level=0.90)
    low95, high95 = t_interval(diffs)
    assert -0.1 < low90 and high90 < 0.1  # inside at 90%
    assert high95 > 0.1 and low95 < 0 < high95  # not inside at 95%; and no detectable difference
    assert high95 - 0.1 > 0.005 and 0.1 - high90 > 0.005  # not a rounding question either way

    runs = {}  # (arm, lag, seed) -> eval_auc: every other comparison without a difference
    for i, d in enumerate(diffs):
        base = 0.4 + 0.05 * ((3 * i) % 5)
        for c in PROTOCOL.primary:
            runs[(c.a, c.lag, 5000 + i)] = runs[(c.b, c.lag, 5000 + i)] = base
        runs[(c0.a, c0.lag, 5000 + i)] = base + d
    outcomes = [_o(arm, lag, seed, auc) for (arm, lag, seed), auc in runs.items()]
    first = confirm(outcomes)[0]
    assert (first["a"], first["b"], first["lag"]) == (c0.a, c0.b, c0.lag)
    assert first["p_holm"] >= SIGNIFICANCE
    assert first["verdict"] == "no detectable difference; equivalent within ±0.1"
    assert (first["low90"], first["high90"]) == pytest.approx((low90, high90))
    assert (first["low"], first["high"]) == pytest.approx((low95, high95))
    # the verdict's own rule, given both intervals: the 90% one decides
    assert verdict(first["diff"], low95, high95, first["p_holm"], 0.1, low90, high90).endswith("within ±0.1")
    assert "not shown" in verdict(first["diff"], low95, high95, first["p_holm"], 0.1, low95, high95)


def test_a_one_seed_confirmation_reports_its_differences_and_says_why_no_verdict(tmp_path):
    """One paired seed: the differences and counts, and for each interval, test and verdict the reason (issue 49)."""
    c0 = PROTOCOL.primary[0]
    path = tmp_path / "lab_confirm_seeds.csv"
    write_seed_csv(_outcomes({(c0.a, c0.b, c0.lag): 0.15}, seeds=[5000]), path)
    rows = confirm(read_seed_csv(path))
    assert rows[0]["diff"] == pytest.approx(0.15) and rows[0]["better_seeds"] == 1
    for r in rows:
        assert all(math.isnan(r[k]) for k in ("low", "high", "low90", "high90", "p", "p_holm", "p_sign_flip"))
        assert r["verdict"] == "no verdict: it needs 2 or more paired seeds" and r["collapsed_p"] == 1.0
    text = format_confirmation(read_seed_csv(path))
    assert text.startswith("1 paired seed (5000), not in the exploration (100-115).")
    assert "With 1 seed there is no interval, t-test, sign-flip test or verdict" in text
    assert "+0.150 [no interval: it needs 2 or more paired seeds]" in text
    assert "| no sign-flip test: it needs 2 or more paired seeds |" in text and "nan" not in text.lower()


# ---------------------------------------------------------------------------- the length study
def test_the_length_study_compares_each_arm_with_none_at_each_length(tmp_path):
    outcomes = []
    for length, product_harm in ((16, 0.0), (256, -0.3)):
        for i in range(8):
            base = 0.3 + 0.02 * (i % 3)
            for config, shift, ess in (
                ("none", 0.0, 1.0),
                ("sequence_mean", 0.01, 0.99),
                ("sequence", product_harm, 0.5),
            ):
                o = _o(config, 2, 6000 + i, base + shift + 0.005 * (i % 2))
                o.update(length=length, is_ess_mean=ess if config != "sequence" or length == 256 else 0.9)
                outcomes.append(o)
    path = tmp_path / "lab_length_seeds.csv"
    write_length_csv(outcomes, path)
    back = read_length_csv(path)
    assert {o["length"] for o in back} == {16, 256} and isinstance(back[0]["length"], int)
    rows = {(r["config"], r["length"]): r for r in length_comparisons(back)}
    assert math.isnan(rows[("none", 16)]["diff"])
    assert rows[("sequence", 256)]["diff"] == pytest.approx(-0.3, abs=0.01) and rows[("sequence", 256)]["p_holm"] < 0.05
    assert rows[("sequence", 16)]["high"] > 0 > rows[("sequence", 16)]["low"] or rows[("sequence", 16)]["diff"] == 0
    assert rows[("sequence", 256)]["is_ess"] == pytest.approx(0.5)
    text = format_length_study(back)
    assert "| arm | 16 tokens | 256 tokens |" in text and "over the study's 4 comparisons" in text
    assert "ESS 0.50" in text


def test_a_one_seed_length_study_says_why_no_interval():
    outcomes = []
    for config, auc in (("none", 0.3), ("sequence_mean", 0.32), ("sequence", 0.1)):
        o = _o(config, 2, 6000, auc)
        o.update(length=64, is_ess_mean=1.0)
        outcomes.append(o)
    rows = {r["config"]: r for r in length_comparisons(outcomes)}
    assert rows["sequence"]["diff"] == pytest.approx(-0.2) and math.isnan(rows["sequence"]["p_holm"])
    text = format_length_study(outcomes)
    assert text.startswith("1 paired seed (6000), lag 2") and "With 1 seed there is no t interval or t-test" in text
    assert "0.100 (-0.200 [no interval: it needs 2 or more paired seeds]); ESS 1.00" in text
    assert "| `sequence` | no t-test: it needs 2 or more paired seeds |" in text and "nan" not in text.lower()


# ---------------------------------------------------------------------------- command line
def _args(*argv, out):
    from nemo_rs_plugin.lab import cli as lab

    args = lab.build_parser().parse_args([*argv, "--out", str(out)])
    return lab, args, lab.settings_from(args)


def test_confirm_and_lengths_defaults(tmp_path):
    _, _, s = _args("--confirm", out=tmp_path)
    assert s.seeds == list(PROTOCOL.confirmation_seeds) and s.configs == protocol_arms(PROTOCOL)
    assert s.steps == DOSE["steps"]
    _, _, quick = _args("--quick", "--confirm", out=tmp_path)
    assert quick.configs == protocol_arms(PROTOCOL) and quick.steps == 6
    _, _, s = _args("--lengths", "16", "64", out=tmp_path)
    assert (s.lag, s.steps, s.seeds, s.configs) == (
        LENGTH_STUDY["lag"],
        LENGTH_STUDY["steps"],
        LENGTH_STUDY["seeds"],
        LENGTH_STUDY["configs"],
    )


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--confirm", "--lags", "0"], "--lags: --confirm runs the protocol's own arms and lags"),
        (["--confirm", "--configs", "none"], "--configs: --confirm runs the protocol's own"),
        (["--confirm", "--seeds", "100", "5000"], "--seeds: 100 belong to the exploration (100..115)"),
        (["--lengths", "16", "--length", "8"], "--length: the length study (--lengths) sets the lengths"),
        (["--lengths", "16", "--lags", "1"], "--lags: the length study"),
        (["--lengths", "0", "16"], "--lengths: got 0; each must be at least 1"),
        (["--lengths", "16", "16"], "--lengths: 16 given more than once"),
    ],
)
def test_confirm_and_lengths_flag_problems(argv, needle, tmp_path):
    lab, args, s = _args(*argv, out=tmp_path / "o")
    problems = lab.settings_problems(s, args)
    assert any(needle in p for p in problems), problems


def test_plan_and_report_read_saved_runs(tmp_path, capsys):
    from nemo_rs_plugin.lab import cli as lab

    c0 = PROTOCOL.primary[0]
    write_seed_csv(
        _outcomes({(c0.a, c0.b, c0.lag): 0.1}, seeds=range(100, 116), spread=0.2), tmp_path / "lab_dose_seeds.csv"
    )
    assert lab.main(["--plan", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip() == format_power_plan(
        power_plan(read_seed_csv(tmp_path / "lab_dose_seeds.csv"))
    )
    assert lab.main(["--plan", str(tmp_path / "missing")]) == lab.EXIT_INVALID
    assert capsys.readouterr().err.count("\n") == 1

    confirmed = tmp_path / "confirmed"
    confirmed.mkdir()
    write_seed_csv(_outcomes({}, seeds=range(5000, 5004)), confirmed / "lab_confirm_seeds.csv")
    assert lab.main(["--report", str(confirmed)]) == 0
    expected = format_confirmation(read_seed_csv(confirmed / "lab_confirm_seeds.csv"))
    assert capsys.readouterr().out.strip() == expected
    # the CSV named itself is read as what its name says, even beside another run's CSV (docs/)
    write_seed_csv(_outcomes({}, seeds=range(100, 104)), confirmed / "lab_dose_seeds.csv")
    assert lab.main(["--report", str(confirmed / "lab_confirm_seeds.csv")]) == 0
    assert capsys.readouterr().out.strip() == expected


@pytest.mark.slow  # 15-40 s on 2 cores: 6 arm-lag runs x 2 seeds, then 2 lengths x 2 arms x 2 seeds
def test_quick_confirmation_and_length_runs(tmp_path):
    """``--quick --confirm`` and ``--quick --lengths``: the whole machinery, in seconds."""
    pytest.importorskip("transformers")
    from nemo_rs_plugin.lab import cli as lab

    out = tmp_path / "confirm"
    assert (
        lab.main(["--quick", "--confirm", "--steps", "4", "--eval-every", "2", "--out", str(out), "--workers", "1"])
        == 0
    )
    outcomes = read_seed_csv(out / "lab_confirm_seeds.csv")
    expected = {(arm, lag) for c in PROTOCOL.primary for arm in (c.a, c.b) for lag in [c.lag]}
    assert {(o["config"], o["lag"]) for o in outcomes} == expected
    assert all(math.isfinite(o["eval_auc"]) and o["evals"] == 2 for o in outcomes)
    block = (out / "lab_confirm.md").read_text()
    assert format_confirmation(outcomes) in block
    settings = yaml.safe_load((out / "lab_confirm_settings.json").read_text())
    assert settings["protocol"]["outcome"] == "eval_auc" and len(settings["protocol"]["primary"]) == 4

    out = tmp_path / "length"
    assert (
        lab.main(
            ["--quick", "--lengths", "4", "8", "--steps", "2", "--eval-every", "1", "--out", str(out), "--workers", "1"]
        )
        == 0
    )
    outcomes = read_length_csv(out / "lab_length_seeds.csv")
    assert {(o["config"], o["length"]) for o in outcomes} == {(c, n) for c in ("none", "sequence") for n in (4, 8)}
    assert all(0 < o["is_ess_mean"] <= 1 for o in outcomes)
    assert format_length_study(outcomes) in (out / "lab_length.md").read_text()
