"""``nemo-rs simulate``: options checked before the run, the ``--from`` format, strict JSON, the loss's weights.

Everything runs in this process through the CLI's ``main()``.
"""

import json
import math
import sys

import pytest
import torch

from nemo_rs_plugin.cli import EXIT_INVALID, main
from nemo_rs_plugin.core.loss import CorrectedPGLoss
from nemo_rs_plugin.tools import simulate as sim


@pytest.fixture
def no_run(monkeypatch):
    """Fail the test if the simulation starts: option errors must come before it."""

    def run(*args, **kwargs):
        raise AssertionError("the simulation ran before the options were checked")

    monkeypatch.setattr(sim, "run", run)


def run_simulate(capsys, *args):
    code = main(["simulate", *args])
    out, err = capsys.readouterr()
    return code, out, err


def error_lines(err):
    return [line for line in err.splitlines() if line.startswith("error: ")]


# --------------------------------------------------------------------------- options
@pytest.mark.parametrize(
    "args, needle",
    [
        (["--length", "0"], "--length: got 0; must be at least 1"),
        (["--steps", "0"], "--steps: got 0; must be at least 1"),
        (["--responses", "-2"], "--responses: got -2; must be at least 1"),
        (["--mismatch", "-0.1"], "--mismatch: got -0.1; allowed: a finite number >= 0"),
        (["--mismatch", "nan"], "--mismatch: got nan; allowed: a finite number >= 0"),
        (["--outlier-rate", "1.5"], "--outlier-rate: got 1.5; allowed: a number in [0, 1]"),
        (["--outlier-rate", "-0.001"], "--outlier-rate: got -0.001; allowed: a number in [0, 1]"),
        (["--staleness", "inf"], "--staleness: got inf; allowed: a finite number >= 0"),
        (
            ["--csv", "{tmp}/no/such/dir/t.csv"],
            "--csv {tmp}/no/such/dir/t.csv: directory {tmp}/no/such/dir does not exist",
        ),
        (["--json", "{tmp}/no/t.json"], "--json {tmp}/no/t.json: directory {tmp}/no does not exist"),
        (["--json", "{tmp}"], "--json {tmp}: is a directory"),
        (["--configs", "token", "tokn"], "--configs: unknown configuration(s) 'tokn'; known: uncorrected"),
    ],
)
def test_bad_option_is_one_line_before_the_run(tmp_path, capsys, no_run, args, needle):
    args = [a.format(tmp=tmp_path) for a in args]
    code, out, err = run_simulate(capsys, *args)
    assert code == EXIT_INVALID and out == ""
    [line] = error_lines(err)
    assert line.startswith("error: " + needle.format(tmp=tmp_path)), line


def test_every_bad_option_is_reported_at_once(capsys, no_run):
    code, _, err = run_simulate(capsys, "--length", "0", "--steps", "0", "--mismatch", "-1")
    assert code == EXIT_INVALID and len(error_lines(err)) == 3


@pytest.mark.parametrize(
    "name, needle",
    [
        ("plot.foo", "unknown format 'foo' (supported: "),
        ("plot", "no suffix; name the format ("),
    ],
)
def test_plot_format_is_checked_before_the_run(tmp_path, capsys, no_run, name, needle):
    pytest.importorskip("matplotlib")
    code, _, err = run_simulate(capsys, "--plot", str(tmp_path / name))
    assert code == EXIT_INVALID
    [line] = error_lines(err)
    assert f"--plot {tmp_path / name}: {needle}" in line and "png" in line


def test_plot_without_matplotlib_fails_before_the_run(tmp_path, capsys, monkeypatch, no_run):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    code, _, err = run_simulate(capsys, "--plot", str(tmp_path / "p.png"))
    assert code == EXIT_INVALID
    assert error_lines(err) == ["error: --plot needs matplotlib: pip install matplotlib (or: uv add matplotlib)"]


@pytest.mark.parametrize("args", [["--length", "100"], ["--steps", "2", "--seed", "1"], ["--mismatch", "0.02"]])
def test_synthetic_options_with_from_are_an_error(tmp_path, capsys, no_run, args):
    path = tmp_path / "run.jsonl"
    path.write_text('{"prev_logprobs": [-0.1], "generation_logprobs": [-0.1]}\n')
    code, _, err = run_simulate(capsys, "--from", str(path), *args)
    assert code == EXIT_INVALID
    [line] = error_lines(err)
    flags = [a for a in args if a.startswith("--")]
    assert line == (
        f"error: {', '.join(flags)}: shape(s) the synthetic batch, which --from replaces; drop them or drop --from"
    )


# --------------------------------------------------------------------------- --from
def jsonl(tmp_path, *records, name="run.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in records) + "\n")
    return str(path)


def rows_of(capsys, tmp_path, *args):
    out = tmp_path / "rows.json"
    code, _, err = run_simulate(capsys, *args, "--json", str(out))
    assert code == 0, err
    return {r["config"]: r for r in json.loads(out.read_text())["rows"]}


def test_from_jsonl_uses_every_token_of_a_record(tmp_path, capsys):
    # d = prev - gen = (0.5, 0): token weights exp(0.5) and 1; the sequence weight exp(0.5).
    path = jsonl(tmp_path, {"prev_logprobs": [-0.5, -1.0], "generation_logprobs": [-1.0, -1.0]})
    rows = rows_of(capsys, tmp_path, "--from", path, "--configs", "token", "sequence", "sequence_mean")
    assert rows["token"]["is_weight_mean"] == pytest.approx((math.exp(0.5) + 1) / 2, rel=1e-6)
    assert rows["sequence"]["is_weight_mean"] == pytest.approx(math.exp(0.5), rel=1e-6)
    assert rows["sequence_mean"]["is_weight_mean"] == pytest.approx(math.exp(0.25), rel=1e-6)


def test_from_jsonl_one_token_records_and_empty_records(tmp_path, capsys):
    path = jsonl(
        tmp_path,
        {"prev_logprobs": [-0.2], "generation_logprobs": [-0.3]},
        {"prev_logprobs": [], "generation_logprobs": []},
        {"prev_logprobs": [-0.2], "generation_logprobs": [-0.3], "token_mask": [0]},
    )
    rows = rows_of(capsys, tmp_path, "--from", path, "--configs", "token", "sequence")
    # Only the first record has a valid token; the others are sequences with no valid token.
    assert rows["token"]["is_weight_mean"] == pytest.approx(math.exp(0.1), rel=1e-6)
    assert rows["sequence"]["is_weight_mean"] == pytest.approx(math.exp(0.1), rel=1e-6)


def test_from_torch_drops_position_0_as_nemo_rl(tmp_path, capsys):
    # NeMo-RL's layout: position 0 belongs to no predicted token; d = 0.3 there is ignored.
    pt = tmp_path / "run.pt"
    torch.save(
        {
            "prev_logprobs": torch.tensor([[0.3, -0.5, -1.0]]),
            "generation_logprobs": torch.tensor([[0.0, -1.0, -1.0]]),
            "advantages": torch.ones(1, 3),
            "sample_mask": torch.ones(1),
        },
        pt,
    )
    rows = rows_of(capsys, tmp_path, "--from", str(pt), "--configs", "sequence")
    assert rows["sequence"]["is_weight_mean"] == pytest.approx(math.exp(0.5), rel=1e-6)


GOOD = {"prev_logprobs": [-0.1, -0.2], "generation_logprobs": [-0.1, -0.2]}


@pytest.mark.parametrize(
    "records, needle",
    [
        ([GOOD, {"prev_logprobs": [0.1]}], ":2: field 'generation_logprobs' is missing"),
        (
            [{"prev_logprobs": [0.1, 0.2], "generation_logprobs": [0.1]}],
            ":1: field 'generation_logprobs' has 1 values, expected 2",
        ),
        ([{"prev_logprobs": "x", "generation_logprobs": [0.1]}], ":1: field 'prev_logprobs' must be a list of numbers"),
        ([GOOD, "not json"], ":2: record is not valid JSON"),
        (["[1, 2]"], ":1: record must be a JSON object"),
        (
            [{**GOOD, "prev_logprobs": [-0.1, True]}],
            ":1: field 'prev_logprobs' value 1 is true; expected a number or null",
        ),
        (
            [{**GOOD, "generation_logprobs": [-0.1, "a"]}],
            ":1: field 'generation_logprobs' value 1 is \"a\"; expected a number",
        ),
        ([{**GOOD, "token_mask": [1, 2]}], ":1: field 'token_mask' value 1 is 2; expected 0 or 1"),
        ([{**GOOD, "token_mask": [1, None]}], ":1: field 'token_mask' value 1 is null; expected 0 or 1"),
        ([{**GOOD, "advantage": None}], ":1: field 'advantage' is null; expected a finite number"),
        ([{**GOOD, "advantage": "NaN-literal"}], ":1: field 'advantage' is \"NaN-literal\"; expected a finite number"),
        (['{"prev_logprobs": [0.1], "generation_logprobs": [0.1], "advantage": NaN}'], ":1: field 'advantage' is NaN"),
        ([{**GOOD, "advantages": [1.0, 1.0]}], ":1: field 'advantages' is unknown (fields: prev_logprobs, "),
        ([{"prev_logprobs": [], "generation_logprobs": []}], ": no valid token in any sequence"),
        ([{**GOOD, "token_mask": [0, 0]}], ": no valid token in any sequence"),
        ([], ": no records"),
    ],
)
def test_from_bad_jsonl_record_is_one_line(tmp_path, capsys, records, needle):
    path = jsonl(tmp_path, *records)
    code, out, err = run_simulate(capsys, "--from", path)
    assert code == EXIT_INVALID and out == ""
    [line] = error_lines(err)
    assert line.startswith(f"error: {path}{needle}"), line


def test_from_binary_file_without_torch_suffix_is_one_line(tmp_path, capsys):
    path = tmp_path / "run.bin"
    path.write_bytes(b"\x80\x81\xff\n")
    code, _, err = run_simulate(capsys, "--from", str(path))
    assert code == EXIT_INVALID
    assert error_lines(err) == [
        f"error: {path}: not a UTF-8 JSONL file (a torch file needs the suffix .pt, .pth, .torch)"
    ]


B2S4 = {"prev_logprobs": torch.zeros(2, 4), "generation_logprobs": torch.zeros(2, 4)}


@pytest.mark.parametrize(
    "content, needle",
    [
        ({**B2S4, "advantages": torch.ones(3)}, "field 'advantages' has shape [3], expected [2] or [2, 1] or [2, 4]"),
        (
            {**B2S4, "advantages": torch.ones(2, 5)},
            "field 'advantages' has shape [2, 5], expected [2] or [2, 1] or [2, 4]",
        ),
        ({**B2S4, "advantages": 3.0}, "field 'advantages' must be a tensor, got float"),
        ({**B2S4, "sample_mask": torch.ones(3)}, "field 'sample_mask' has shape [3], expected [2]"),
        ({**B2S4, "sample_mask": torch.ones(2, 1)}, "field 'sample_mask' has shape [2, 1], expected [2]"),
        ({**B2S4, "sample_mask": torch.full((2,), 0.5)}, "field 'sample_mask' must hold 0 or 1 only"),
        ({**B2S4, "token_mask": [1, 2]}, "field 'token_mask' must be a tensor, got list"),
        ({**B2S4, "token_mask": torch.ones(2, 3)}, "field 'token_mask' has shape [2, 3], expected [2, 4]"),
        ({**B2S4, "token_mask": torch.full((2, 4), 2)}, "field 'token_mask' must hold 0 or 1 only"),
        (
            {**B2S4, "generation_logprobs": torch.zeros(2, 5)},
            "field 'generation_logprobs' has shape [2, 5], expected [2, 4]",
        ),
        (
            {**B2S4, "generation_logprobs": torch.zeros(2, 4, 1)},
            "field 'generation_logprobs' must be a [B, S] tensor, got [2, 4, 1]",
        ),
        (
            {**B2S4, "prev_logprobs": torch.zeros(2, 4, dtype=torch.complex64)},
            "field 'prev_logprobs' must hold real numbers",
        ),
        (
            {**B2S4, "prev_logprobs": torch.zeros(2, 4, dtype=torch.bool)},
            "field 'prev_logprobs' must hold real numbers",
        ),
        ({"prev_logprobs": torch.zeros(0, 4), "generation_logprobs": torch.zeros(0, 4)}, "holds no sequence (B = 0)"),
        (
            {"prev_logprobs": torch.zeros(2, 1), "generation_logprobs": torch.zeros(2, 1)},
            "has S = 1; position 0 is dropped",
        ),
        ({"prev_logprobs": torch.zeros(2, 4)}, "field 'generation_logprobs' is missing"),
        ({**B2S4, "token_mask": torch.tensor([[1, 0, 0, 0], [1, 0, 0, 0]])}, "no valid token in any sequence"),
        ([1, 2], "expected a dict of tensors, got list"),
    ],
)
def test_from_bad_torch_file_is_one_line(tmp_path, capsys, content, needle):
    path = tmp_path / "run.pt"
    torch.save(content, path)
    code, out, err = run_simulate(capsys, "--from", str(path))
    assert code == EXIT_INVALID and out == ""
    [line] = error_lines(err)
    assert line.startswith(f"error: {path}: ") and needle in line, line


def test_from_unreadable_torch_file_is_one_line(tmp_path, capsys):
    path = tmp_path / "run.pt"
    path.write_text("not a torch file\n")
    code, _, err = run_simulate(capsys, "--from", str(path))
    assert code == EXIT_INVALID
    [line] = error_lines(err)
    assert line.startswith(f"error: {path}: a text file, not a torch file")


# --------------------------------------------------------------------------- outputs
def test_json_is_strict_with_non_finite_values_as_strings(tmp_path, capsys):
    # Every advantage 0: the uncorrected gradient is 0, so grad_norm_ratio is 0/0 = NaN.
    path = jsonl(tmp_path, {**GOOD, "advantage": 0.0})
    out = tmp_path / "rows.json"
    code, _, err = run_simulate(capsys, "--from", path, "--configs", "token", "--json", str(out))
    assert code == 0, err

    def reject(constant):
        raise ValueError(f"non-standard JSON constant {constant}")

    data = json.loads(out.read_text(), parse_constant=reject)
    assert data["rows"][0]["grad_norm_ratio"] == "NaN" and math.isnan(float("NaN"))
    sim.write_json([{"config": "x", "a": float("inf"), "b": float("-inf"), "c": 1.5}], "s", str(out))
    row = json.loads(out.read_text(), parse_constant=reject)["rows"][0]
    assert (row["a"], row["b"], row["c"]) == ("Infinity", "-Infinity", 1.5)
    assert float(row["a"]) == math.inf  # what the docs promise a reader


def test_plot_weight_axis_is_bounded_and_labels_what_it_cuts(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [
        {"config": "a", "is_weight_mean": 5e262, "ess": 0.1, "seq_rejected": 0.0},
        {"config": "b", "is_weight_mean": 0.98, "ess": float("nan"), "seq_rejected": 0.5},
    ]
    fig = sim.plot_figure(rows)
    weights, ess, _ = fig.axes
    assert weights.get_xlim() == pytest.approx((0, 1.05 * sim.WEIGHT_AXIS_MAX))
    assert [t.get_text() for t in weights.texts] == ["5e+262"]
    assert [t.get_text() for t in ess.texts] == ["nan"]
    sim.write_plot(rows, str(tmp_path / "p.svg"))
    assert (tmp_path / "p.svg").read_text().lstrip().startswith("<?xml")


# --------------------------------------------------------------------------- one rule for the weights
def test_weights_are_the_ones_the_loss_applies_float32_overflow_is_0(tmp_path, capsys):
    """A sequence whose exp(sum d) overflows float32 gets weight 0 in the loss, and in simulate."""
    n = 100  # sum d = 100 nats: exp(100) = 2.7e43 > float32 max 3.4e38
    path = jsonl(
        tmp_path,
        {"prev_logprobs": [-0.5] * n, "generation_logprobs": [-1.5] * n},
        {"prev_logprobs": [-0.5] * n, "generation_logprobs": [-0.5] * n},
    )
    rows = rows_of(capsys, tmp_path, "--from", path, "--configs", "sequence")
    assert rows["sequence"]["is_weight_mean"] == pytest.approx(0.5)  # weights (0, 1), not (2.7e43, 1)

    # The loss's own gradient says the same: on-policy (ratio 1), the gradient of each row is
    # -A * w / N, so the first row's is exactly 0.
    batch = sim.load_batch(path)
    w = sim._applied_weights(sim.DEFAULT_CONFIGS["sequence"], batch)
    lp = batch["prev_logprobs"][:, 1:].clone().requires_grad_(True)
    data = {
        **batch,
        "input_ids": torch.zeros_like(batch["token_mask"]),
        "reference_policy_logprobs": batch["prev_logprobs"],
    }
    valid = batch["token_mask"][:, 1:].float()
    loss, _ = CorrectedPGLoss(sim.DEFAULT_CONFIGS["sequence"])(lp, data, torch.tensor(2.0), valid.sum())
    loss.backward()
    from_gradient = -lp.grad[:, 0].double() * valid.sum()
    torch.testing.assert_close(w, from_gradient, rtol=1e-6, atol=0)
