"""Override values read as NeMo-RL reads them: Hydra's override parser, with or without NeMo-RL importable.

NeMo-RL's ``parse_hydra_overrides`` hands each override to Hydra's ``OverridesParser``; without
NeMo-RL, ``check`` (and ``simulate --recipe``, ``calibrate --recipe``, which load recipes the same
way) used to read the value as YAML 1.1, which reads ``1e-4`` as a string and refused the
override. The plugin does not depend on Hydra: its own parser is compared here with Hydra's, value
by value, where hydra-core is installed (it is in the ``[test]`` extra).
"""

import math
import sys

import pytest

from nemo_rs_plugin.cli import EXIT_UNCHECKED, main
from nemo_rs_plugin.tools.recipe_overrides import OverrideError, apply_override, parse_override_value

hydra_parser = pytest.importorskip("hydra.core.override_parser.overrides_parser")

VALUES = [
    # numbers as Hydra types them (YAML 1.1 reads several of these differently)
    "1e-4",
    "1.0e-4",
    "1e4",
    "1E5",
    "2.0E-3",
    "-1.5e+3",
    ".5",
    "5.",
    "-.5",
    "1.",
    "0.99",
    "1_000",
    "1_0.5",
    "+1",
    "-0",
    "007",
    "0x10",
    "1.5.2",
    "1e",
    "e5",
    "inf",
    "-inf",
    "+inf",
    "NaN",
    "nan",
    # booleans and null: only true/false/null, any case (YAML 1.1 also reads on/yes/~)
    "true",
    "True",
    "TRUE",
    "false",
    "null",
    "NULL",
    "on",
    "yes",
    "off",
    "no",
    "True1",
    # strings
    "abc",
    "a b",
    " x ",
    "a:b",
    "a/b",
    "-",
    "",
    "2024-01-01",
    "$x",
    "a@b",
    "a%b",
    "a*b",
    "a?b",
    "a|b",
    "'1e-4'",
    '"q"',
    "' a '",
    '""',
    "'a\\'b'",
    "a\\,b",
    "\\ x",
    "a\\\\b",
    "\\\\",
    "\\(",
    "\\=",
    "a\\tb",
    # interpolations stay strings, for OmegaConf
    "${x.y}",
    "a${x}b",
    '"${x}"',
    "'${a}'",
    "${oc.env:X,1}",
    # containers
    "[1,2, 3]",
    "[]",
    "[ ]",
    "{}",
    "{ }",
    "[a,[b,c]]",
    "{a: 1, b: [x]}",
    "{a:{b:1}}",
    "[ 1 , x y ]",
    "[a:b]",
    "{a: b:c}",
    "{1: 2}",
    "{true: 1}",
    "{a b: 1}",
    "[1 , '2']",
    "{a: '1'}",
    "['a' ,b]",
    # what Hydra refuses
    "b=c",
    "'a'b",
    "[1,,2]",
    "[,1]",
    "{a:1,}",
    "{a:}",
    "a[b",
    "a]",
    "{'a': 1}",
    "a#b",
    "~",
    "a!b",
    "é",
    '"a""b"',
    "1 'a'",
    'a"b',
    "'open",
    "[1, 2",
    "${x:${y}}",
    "x(1)",
    # sweeps and functions: NeMo-RL's loader refuses sweeps; functions are left to it
    "a,b",
    "x y,z",
    "[1,2],[3]",
    "choice(1,2)",
    "int(3.5)",
]


def hydra_value(text):
    """``(ok, value)`` as Hydra parses ``k=text`` (a sweep is not a value NeMo-RL accepts)."""
    try:
        override = hydra_parser.OverridesParser.create().parse_override(f"k={text}")
        value = override.value()
    except Exception:  # noqa: BLE001 - any refusal of Hydra's
        return False, None
    return not override.is_sweep_override(), value


def same(a, b):
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a):
        return math.isnan(b)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


@pytest.mark.parametrize("text", VALUES)
def test_values_parse_as_hydras_override_parser_parses_them(text):
    ok, expected = hydra_value(text)
    if text in ("int(3.5)",):  # a function Hydra evaluates: left to NeMo-RL's loader, said so here
        with pytest.raises(OverrideError, match="only NeMo-RL's own loader evaluates"):
            parse_override_value(text)
        return
    if not ok:
        with pytest.raises(OverrideError):
            parse_override_value(text)
        return
    got = parse_override_value(text)
    assert same(got, dict(expected) if isinstance(expected, dict) else expected), (text, got, expected)


def test_the_plugin_does_not_import_hydra():
    import nemo_rs_plugin.tools.recipe_overrides as module

    assert "hydra" not in module.__dict__ and "yaml" not in module.__dict__


def test_a_sweep_is_refused_naming_the_list_and_quoted_forms():
    with pytest.raises(OverrideError, match=r"Hydra sweep .* written \[a,b\], .* quoted \('a,b'\)"):
        parse_override_value("a,b")


def test_an_override_of_1e_minus_4_applies_as_a_float():
    cfg = {"loss_fn": {"rejection_sampling": [{"lower": 0.5}, {"lower": 0.5}]}}
    apply_override(cfg, "loss_fn.rejection_sampling.1.lower=1e-4")
    assert cfg["loss_fn"]["rejection_sampling"][1]["lower"] == 1e-4


def test_check_without_nemo_rl_accepts_1e_minus_4_in_an_override(tmp_path, capsys, monkeypatch):
    for k in [k for k in sys.modules if k == "nemo_rl" or k.startswith("nemo_rl.")]:
        monkeypatch.delitem(sys.modules, k)
    monkeypatch.setitem(sys.modules, "nemo_rl", None)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "grpo: {}\nloss_fn:\n  name: rs_clipped_pg\n  use_importance_sampling_correction: true\n"
        "  is_correction_level: sequence_mean\n  rejection_sampling:\n"
        "    - {level: sequence, statistic: ratio, agg: mean, lower: 0.99, upper: 1.01}\n"
        "    - {level: sequence, statistic: ratio, agg: any, lower: 1.0e-4, upper: 1.0e+4}\n"
    )
    code = main(["check", str(recipe), "loss_fn.rejection_sampling.1.lower=1e-4", "+loss_fn.ratio_clip_max=2.8e-1"])
    out, err = capsys.readouterr()
    assert code == EXIT_UNCHECKED and "error:" not in err, err
    assert "not fully checked" in out, out


def test_random_values_parse_as_hydra_parses_them():
    """Strings drawn from the grammar's characters and words: the same value, or refused by both."""
    import random

    rng = random.Random(0)
    alphabet = [*"ab1e0.-_+ ,:[]{}'\"\\$xXnNT()", "true", "null", "inf", "${a}", "1e-4"]
    for _ in range(1500):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 9)))
        ok, expected = hydra_value(text)
        try:
            got, parsed = parse_override_value(text), True
        except OverrideError:
            got, parsed = None, False
        assert parsed == ok, (text, expected, got)
        assert not ok or same(got, dict(expected) if isinstance(expected, dict) else expected), (text, expected, got)
