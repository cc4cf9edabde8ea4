"""Behaviours the docs promise about interpolations that no other test held (issue 51, item 10 b, c).

(b) docs/cli.md: a ``${...}`` whose key may come from ``defaults`` that were not found is one
``not checked:`` line, never an error (exit 3). (c) A list holding an unresolvable ``${...}``
before another interpolated entry: that entry's value lands where it belongs, the later entries
after it, with the unresolvable one left out.
"""

import sys

import pytest

from nemo_rs_plugin.cli import EXIT_UNCHECKED, main
from nemo_rs_plugin.tools.recipe_interpolations import resolve_interpolations


@pytest.fixture(autouse=True)
def no_nemo_rl(monkeypatch):
    for k in [k for k in sys.modules if k == "nemo_rl" or k.startswith("nemo_rl.")]:
        monkeypatch.delitem(sys.modules, k)
    monkeypatch.setitem(sys.modules, "nemo_rl", None)


RECIPE = (
    "defaults: missing-parent.yaml\ngrpo: {}\nloss_fn:\n  name: rs_clipped_pg\n"
    "  use_importance_sampling_correction: true\n  is_correction_level: sequence_mean\n  rejection_sampling:\n"
    '    - {level: sequence, statistic: ratio, agg: mean, lower: 0.99, upper: "${grpo.band_hi}"}\n'
)


def test_a_key_that_may_come_from_defaults_not_found_is_unchecked_never_an_error(tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(RECIPE)
    code = main(["check", str(recipe)])
    out, err = capsys.readouterr()
    assert code == EXIT_UNCHECKED and "error:" not in err, err
    [line] = [line for line in err.splitlines() if "band_hi" in line]
    assert line.startswith("not checked: loss_fn.rejection_sampling.0.upper: the interpolation ${grpo.band_hi}"), line
    assert "it may come from the defaults that were not found" in line, line


def test_the_same_key_in_a_whole_recipe_is_an_error(tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(RECIPE.replace("defaults: missing-parent.yaml\n", ""))
    code = main(["check", str(recipe)])
    _, err = capsys.readouterr()
    assert code != EXIT_UNCHECKED and "error: loss_fn.rejection_sampling.0.upper" in err, err


@pytest.mark.parametrize("complete", [True, False])
def test_entries_after_an_unresolvable_one_resolve_in_place(complete):
    cfg = {"grpo": {"hi": 1.01, "lo": 0.99}, "x": ["${mul:2,3}", "${grpo.hi}", 7, "${grpo.lo}"], "y": "${grpo.lo}"}
    [left_out] = resolve_interpolations(cfg, complete)
    assert left_out.path == ("x", 0) and left_out.interpolation == "${mul:2,3}"
    assert left_out.reason.needs_nemo_rl and not left_out.reason.error
    assert cfg["x"] == [1.01, 7, 0.99] and cfg["y"] == 0.99


def test_mappings_in_a_list_keep_their_place_when_an_earlier_field_does_not_resolve():
    cfg = {
        "grpo": {"hi": 1.01},
        "stages": [{"upper": "${mul:2,3}", "lower": 0.5}, {"upper": "${grpo.hi}"}, {"upper": "${grpo.hi}"}],
    }
    [left_out] = resolve_interpolations(cfg, True)
    assert left_out.path == ("stages", 0, "upper")
    assert cfg["stages"] == [{"lower": 0.5}, {"upper": 1.01}, {"upper": 1.01}]
