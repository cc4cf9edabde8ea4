"""The numbers README.md and the recipes state about ``nemo-rs simulate`` come from the commands they name.

Each test reruns the named command (in this process, through the CLI's ``main()``; only the
configurations the sentence quotes, which leaves their rows unchanged) and checks the text
holds exactly the numbers, as printed in the doc.
"""

import json
from pathlib import Path

import pytest

from nemo_rs_plugin.cli import main

REPO = Path(__file__).resolve().parents[2]
QUOTED = ["--configs", "sequence", "sequence+tis2", "sequence_mean"]


def simulate(tmp_path, *args):
    out = tmp_path / "rows.json"
    assert main(["simulate", *args, *QUOTED, "--json", str(out)]) == 0
    return {r["config"]: r for r in json.loads(out.read_text())["rows"]}


def span(values, fmt):
    lo, hi = format(min(values), fmt), format(max(values), fmt)
    return lo if lo == hi else f"{lo}-{hi}"


def flat(path):
    """The doc's text with line breaks and comment markers folded into single spaces."""
    lines = [line.strip().lstrip("#").strip() for line in (REPO / path).read_text().splitlines()]
    return " ".join(lines)


@pytest.fixture(scope="module")
def default_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("simulate")
    return [simulate(tmp, "--seed", str(seed)) for seed in (0, 1, 2)]


def test_readme_numbers_come_from_seeds_0_to_2(default_runs):
    seq = [r["sequence"] for r in default_runs]
    tis = [r["sequence+tis2"] for r in default_runs]
    mean = [r["sequence_mean"] for r in default_runs]
    text = flat("README.md")
    assert "Over `nemo-rs simulate --seed 0`, `--seed 1` and `--seed 2`" in text
    for claim in [
        f"smallest {span([r['is_weight_min'] for r in seq], '.2g')}, ESS {span([r['ess'] for r in seq], '.2f')}",
        f"their mean stays at {span([r['is_weight_mean'] for r in seq], '.2f')}",
        f"the gradient norm grows {span([r['grad_norm_ratio'] for r in seq], '.1f')}x",
        f"their mean falls to {span([r['is_weight_mean'] for r in tis], '.2f')}",
        f"`sequence_mean` stays at {span([r['is_weight_mean'] for r in mean], '.4f')}, "
        f"ESS {span([r['ess'] for r in mean], '.0f')}",
    ]:
        assert claim in text, claim


def test_9k_recipe_numbers_come_from_seed_0(default_runs):
    rows = default_runs[0]
    seq, tis, mean = rows["sequence"], rows["sequence+tis2"], rows["sequence_mean"]
    text = flat("recipes/grpo-qwen3.5-35ba3b-4n8g-megatron-ep16-9k-seqmean.yaml")
    for claim in [
        f"`nemo-rs simulate --seed 0` (same lengths and mismatch, unbiased noise) shows the mechanism, "
        f"not those numbers: sequence weights from {seq['is_weight_min']:.2g} up, ESS {seq['ess']:.2f}, "
        f"gradient norm {seq['grad_norm_ratio']:.1f}x; truncated at 2, their mean is {tis['is_weight_mean']:.2f}; "
        f"sequence_mean stays at {mean['is_weight_mean']:.4f}.",
        f"geometric-mean weight std of {mean['is_weight_std']:.2g} in `nemo-rs simulate --seed 0`",
    ]:
        assert claim in text, claim


def test_32k_recipe_numbers_come_from_length_28000(tmp_path):
    rows = simulate(tmp_path, "--length", "28000", "--seed", "0")
    seq, tis, mean = rows["sequence"], rows["sequence+tis2"], rows["sequence_mean"]
    text = flat("recipes/grpo-qwen3-30ba3b-4n8g-megatron-tp4ep8-32k-rs.yaml")
    claim = (
        f"(`nemo-rs simulate --length 28000 --seed 0`: mean sequence weight {seq['is_weight_mean']:.2f}, "
        f"gradient norm {seq['grad_norm_ratio']:.2f}x; truncated at 2, mean {tis['is_weight_mean']:.2f}); "
        f"the geometric mean stays at {mean['is_weight_mean']:.4f}"
    )
    assert claim in text, claim
