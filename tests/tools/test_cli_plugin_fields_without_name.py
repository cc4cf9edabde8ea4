"""A ``loss_fn`` with plugin fields and no ``name``: NeMo-RL would build its own loss and ignore them.

``nemo-rs check``, ``simulate --recipe`` and ``calibrate --recipe`` each refuse such a recipe,
naming every plugin field and the fix, before anything runs (the named-loss cases are in
test_cli_check.py, test_cli_simulate_recipe.py and test_cli_calibrate.py).
"""

import json

import pytest
import yaml

from nemo_rs_plugin.cli import EXIT_INVALID, main

NAMELESS = {
    "use_importance_sampling_correction": True,
    "is_correction_level": "sequence_mean",
    "rejection_sampling": [{"level": "sequence", "statistic": "ratio", "agg": "mean", "lower": 0.99, "upper": 1.01}],
}
WANT = [
    f"loss_fn.{field}: a nemo-rs-plugin field under NeMo-RL's own loss, which would ignore it; "
    "add `name: rs_clipped_pg` to loss_fn"
    for field in ("is_correction_level", "rejection_sampling")
]


@pytest.fixture
def recipe(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({"loss_fn": NAMELESS}))
    return str(path)


@pytest.fixture
def records(tmp_path):
    path = tmp_path / "dump.jsonl"
    with open(path, "w") as fh:
        for i in range(32):
            gen = [-1.0 - 0.01 * t for t in range(20)]
            fh.write(
                json.dumps({"prev_logprobs": [g + (i - 16) / 100 for g in gen], "generation_logprobs": gen}) + "\n"
            )
    return str(path)


@pytest.mark.parametrize(
    "command",
    [
        ["check", "{recipe}"],
        ["simulate", "--recipe", "{recipe}"],
        ["calibrate", "--from", "{records}", "--recipe", "{recipe}"],
    ],
    ids=["check", "simulate", "calibrate"],
)
def test_plugin_fields_without_a_name_are_refused(recipe, records, capsys, command):
    code = main([arg.format(recipe=recipe, records=records) for arg in command])
    out, err = capsys.readouterr()
    assert code == EXIT_INVALID, (out, err)
    text = " ".join(err.split())
    assert all(want in text for want in WANT), err
    assert "Traceback" not in err
