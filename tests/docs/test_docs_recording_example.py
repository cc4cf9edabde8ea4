"""The recorder example of docs/cli.md is reproducible: a seed, and no draw gives a positive log-prob.

Without a seed and the clamp, about 1 run in 40 drew a generation log-prob above 1e-3 (a
log-prob is <= 0), which the loss warns about and ``calibrate --from`` then refuses.
"""

import re
import warnings
from pathlib import Path

import pytest
import torch

from nemo_rs_plugin.core.batch.input_checks import POSITIVE_LOGPROB_SLACK

REPO = Path(__file__).resolve().parents[2]


def example_code():
    text = (REPO / "docs" / "cli.md").read_text()
    section = text[text.index('<a id="recording-outside-nemo-rl"></a>') :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_example_sets_a_seed():
    assert re.search(r"^torch\.manual_seed\(\d+\)", example_code(), re.M)


@pytest.mark.parametrize("seed", range(0, 120, 3))
def test_no_seed_draws_a_log_prob_above_0(tmp_path, monkeypatch, seed):
    code = re.sub(r"torch\.manual_seed\(\d+\)", f"torch.manual_seed({seed})", example_code())
    observed = []
    from nemo_rs_plugin.nemo_rl import recording

    monkeypatch.setattr(recording.LogprobRecorder, "observe", lambda self, toks, data: observed.append(data))
    monkeypatch.chdir(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the loss's InputWarning for a positive log-prob
        exec(compile(code, "docs/cli.md", "exec"), {})
    assert len(observed) == 2
    for data in observed:
        assert torch.all(data["generation_logprobs"] <= POSITIVE_LOGPROB_SLACK)
