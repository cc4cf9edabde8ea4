"""A mis-indented recipe: the error says which line is indented how, under what, and the fix.

PyYAML reports the token it stopped at ("found '?'", "found '<block mapping start>'"), which is
not in the file; ``check`` (and ``simulate --recipe``, ``calibrate --recipe``, which load recipes
the same way) say what is mis-indented under what, with PyYAML's words after it.
"""

import sys

import pytest

from nemo_rs_plugin.cli import EXIT_INVALID, main
from nemo_rs_plugin.tools.recipe_yaml import indentation_problem

CASES = [
    (
        "loss_fn:\n  - a\n  b: 1\n",
        "line 3: `b: 1` is a key at 2 spaces under `loss_fn:` (line 1), whose entries at that indentation are "
        "list entries (`- a`, line 2)",
    ),
    (
        "loss_fn:\n  name: rs_clipped_pg\n - x\n",
        "line 3: `- x` is indented by 1 space under `loss_fn:` (line 1), whose entries are at 2 spaces "
        "(`name: rs_clipped_pg`, line 2): indent it by 2 spaces to put it there, or by 0 spaces to end it",
    ),
    (
        "grpo: {}\nloss_fn:\n    name: rs_clipped_pg\n  is_correction_level: token\n",
        "line 4: `is_correction_level: token` is indented by 2 spaces under `loss_fn:` (line 2), whose entries are "
        "at 4 spaces (`name: rs_clipped_pg`, line 3): indent it by 4 spaces to put it there, or by 0 spaces",
    ),
    (
        "grpo: {}\nloss_fn:\n  name: rs_clipped_pg\n   use_importance_sampling_correction: true\n",
        "line 4: `use_importance_sampling_correction: true` is indented by 3 spaces, more than "
        "`name: rs_clipped_pg` (line 3), which already has a value and so cannot hold it: indent it by 2 spaces",
    ),
    (
        "loss_fn:\n  rejection_sampling:\n  - level: sequence\n     agg: mean\n",
        "line 4: `agg: mean` is indented by 5 spaces, more than `- level: sequence` (line 3), which already has a "
        "value and so cannot hold it: indent it by 4 spaces",
    ),
    (
        "loss_fn:\n  rejection_sampling:\n    - {level: sequence}\n   - {level: token}\n",
        "line 4: `- {level: token}` is indented by 3 spaces under `rejection_sampling:` (line 2), whose entries are "
        "at 4 spaces (`- {level: sequence}`, line 3)",
    ),
]


@pytest.fixture(autouse=True)
def no_nemo_rl(monkeypatch):
    for k in [k for k in sys.modules if k == "nemo_rl" or k.startswith("nemo_rl.")]:
        monkeypatch.delitem(sys.modules, k)
    monkeypatch.setitem(sys.modules, "nemo_rl", None)


@pytest.mark.parametrize("text, says", CASES)
def test_check_says_what_is_mis_indented_under_what(tmp_path, capsys, text, says):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(text)
    code = main(["check", str(recipe)])
    _, err = capsys.readouterr()
    assert code == EXIT_INVALID
    [line] = [line for line in err.splitlines() if line.startswith("error:")]
    assert ": invalid YAML: mis-indented: " in line and says in line, line
    # PyYAML's own words come after, in parentheses: the explanation leads
    assert line.index(says) < line.index("(PyYAML: "), line


def test_a_problem_that_is_not_indentation_keeps_pyyamls_message():
    assert indentation_problem("loss_fn:\n  name: a: b\n", 1) is None
    assert indentation_problem("a: [\n", 1) is None
