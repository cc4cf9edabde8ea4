"""The loss records what ``nemo-rs calibrate --from DIR`` reads (``nemo_rs_plugin.nemo_rl.recording``).

Without NeMo-RL: the recorder's steps, writers and files, read back by ``calibrate`` to the
numbers of the in-memory batch. With NeMo-RL (every supported host): the plugin's loss through
NeMo-RL's real per-sequence packing wrapper writes one file per microbatch.
"""

import json
import os
import pickle
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from nemo_rs_plugin.core.correction.calibration import calibrate_filters
from nemo_rs_plugin.core.settings import presets
from nemo_rs_plugin.core.settings.config import ConfigError, RejectionFilter, RSClippedPGLossConfig
from nemo_rs_plugin.nemo_rl.record_format import MANIFEST, META, fields_digest, parse_record_name
from nemo_rs_plugin.nemo_rl.recording import RECORDED_FIELDS, LogprobRecorder, record_name
from nemo_rs_plugin.tools.batch_formats import BatchFormatError, load_batch
from tests.support.fork_server import run_python
from tests.support.nemo_rl_hosts import host_label, nemo_rl_hosts, no_hosts_mark, skip_or_fail

REPO = Path(__file__).resolve().parents[2]


def _microbatch(seed, B=3, S=12):
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(B, S, dtype=torch.long)
    for i in range(B):
        mask[i, 1 : S - 2 * i] = 1
    prev = -torch.rand(B, S, generator=g) * mask
    return {
        "prev_logprobs": prev,
        "generation_logprobs": (prev - 0.05 * torch.randn(B, S, generator=g)).clamp_max(0) * mask,
        "token_mask": mask,
        "advantages": torch.randn(B, 1, generator=g).expand(B, S).contiguous(),
        "sample_mask": torch.ones(B),
        "input_ids": torch.zeros(B, S, dtype=torch.long),  # not recorded
    }


def _steps(recorder, n_steps, per_step=2, seed=0):
    """``n_steps`` optimizer steps of ``per_step`` microbatches, each step with its own count tensor."""
    batches = []
    for step in range(n_steps):
        counts = torch.tensor(100.0 + step)
        for k in range(per_step):
            mb = _microbatch(seed + 10 * step + k)
            recorder.observe(counts, mb)
            batches.append((step, mb))
    return batches


def _records(folder):
    """The record files in a folder (not the manifest), sorted."""
    return sorted(name for name in os.listdir(folder) if parse_record_name(name))


def test_every_nth_step_is_recorded_one_file_per_microbatch(tmp_path):
    recorder = LogprobRecorder(str(tmp_path), every=3, writer=lambda: (True, 5))
    _steps(recorder, 7)
    assert os.listdir(tmp_path) == [recorder.run_id]  # the run's own folder
    names = _records(recorder.run_dir)
    assert names == [record_name(s, 5, k) for s in (0, 3, 6) for k in (0, 1)]
    assert sorted(os.listdir(recorder.run_dir)) == sorted(names + [MANIFEST])  # no temporary file left
    saved = torch.load(Path(recorder.run_dir) / names[0], weights_only=True)
    assert set(saved) == set(RECORDED_FIELDS) | {META}
    assert saved["token_mask"].dtype == torch.int8 and saved["prev_logprobs"].dtype == torch.float32
    assert saved[META]["run_id"] == recorder.run_id and saved[META]["sha256"] == fields_digest(saved)


def test_the_packing_wrapper_microbatch_is_recorded_once(tmp_path):
    recorder = LogprobRecorder(str(tmp_path), every=1, writer=lambda: (True, 0))
    counts, mb = torch.tensor(5.0), _microbatch(0)
    for _ in range(4):  # the per-sequence wrapper's calls, each passing its whole microbatch
        recorder.observe(counts, mb)
    assert _records(recorder.run_dir) == [record_name(0, 0, 0)]


def test_a_rank_that_does_not_write_writes_nothing(tmp_path):
    recorder = LogprobRecorder(str(tmp_path / "r"), every=1, writer=lambda: (False, 1))
    _steps(recorder, 2)
    assert not (tmp_path / "r").exists() and recorder.written == []  # nothing checked, nothing written


def test_steps_that_do_not_record_dispatch_no_operator(tmp_path):
    recorder = LogprobRecorder(str(tmp_path), every=100, writer=lambda: (True, 0))
    recorder.observe(torch.tensor(1.0), _microbatch(0))  # step 0: recorded
    later = [(torch.tensor(2.0 + s), _microbatch(s)) for s in range(3)]

    class Count(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.calls += 1
            return func(*args, **(kwargs or {}))

    with Count():
        for counts, mb in later:
            recorder.observe(counts, mb)
    assert Count.calls == 0 and len(recorder.written) == 1


def test_the_count_survives_the_loss_nemo_rl_sends_again_every_step(tmp_path):
    """NeMo-RL pickles the driver's loss to its workers with every ``policy.train`` call: a worker
    unpickles a fresh recorder each GRPO step, and the step count must go on, not restart."""
    driver = LogprobRecorder(str(tmp_path), every=3)  # the default writer: one process, rank 0
    driver.check()  # where the loss is built
    sent = pickle.dumps(driver)
    for step in range(7):  # one GRPO step = one optimizer step here, two microbatches
        worker = pickle.loads(sent)
        counts = torch.tensor(100.0 + step)
        for k in range(2):
            worker.observe(counts, _microbatch(10 * step + k))
    assert os.listdir(tmp_path) == [driver.run_id]  # the workers write the driver's run
    assert _records(driver.run_dir) == [record_name(s, 0, k) for s in (0, 3, 6) for k in (0, 1)]


def test_calibrate_reads_the_records_to_the_in_memory_numbers(tmp_path):
    recorder = LogprobRecorder(str(tmp_path), every=2, writer=lambda: (True, 0))
    batches = _steps(recorder, 4)  # steps 0 and 2 recorded
    recorded = [mb for step, mb in batches if step in (0, 2)]

    def stages(batch):
        prev, gen = batch["prev_logprobs"][:, 1:], batch["generation_logprobs"][:, 1:]
        mask = batch["token_mask"][:, 1:] * batch["sample_mask"][:, None]
        return calibrate_filters([RejectionFilter(**presets.GEO_RS)], prev, gen, mask, 0.1)

    in_memory = {k: torch.cat([mb[k] for mb in recorded]).float() for k in RECORDED_FIELDS}
    assert stages(load_batch(str(tmp_path))) == stages(in_memory)
    # the newest step only
    newest = {k: torch.cat([mb[k] for mb in recorded[2:]]).float() for k in RECORDED_FIELDS}
    assert stages(load_batch(str(tmp_path), newest_steps=1)) == stages(newest)


def test_calibrate_command_reads_a_records_folder(tmp_path, capsys):
    from nemo_rs_plugin.cli import main

    recorder = LogprobRecorder(str(tmp_path / "rec"), every=1, writer=lambda: (True, 0))
    _steps(recorder, 3, per_step=4)
    out = tmp_path / "band.json"
    assert main(["calibrate", "--from", str(tmp_path / "rec"), "--steps", "2", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["from"] == str(tmp_path / "rec")


def test_a_folder_without_records_is_a_clear_error(tmp_path):
    with pytest.raises(BatchFormatError, match="a folder without records .* record_logprobs: true"):
        load_batch(str(tmp_path))


def test_recording_fields_are_validated_and_idle_ones_warned():
    with pytest.raises(ConfigError, match="record_every: got 0; allowed: an integer >= 1"):
        RSClippedPGLossConfig.from_any({"record_logprobs": True, "record_every": 0})
    assert any(
        w.startswith("record_dir: got 'x' with record_logprobs: false")
        for w in RSClippedPGLossConfig.model_construct(record_dir="x", record_logprobs=False).config_warnings
    )


_HOST_SCRIPT = """
import os, sys
sys.path.insert(0, {repo!r})
from tests.support import packing_host as ph
from nemo_rs_plugin.nemo_rl.loss_fn import RSClippedPGLossFn
loss = RSClippedPGLossFn({{"use_importance_sampling_correction": True, "record_logprobs": True,
                          "record_dir": {out!r}, "record_every": 1, "sharded_logits_input": {sharded}}})
batches = ph._microbatches()
gvs, gvt = ph._global_counts(batches)
for logits, data, lengths in batches:  # one optimizer step, two microbatches, one call per sequence
    ph._call("per_sequence", loss, logits, data, lengths, gvs, gvt, pad_multiple=2 if {sharded} else 1)
(run,) = os.listdir({out!r})
print(sorted(n for n in os.listdir(os.path.join({out!r}, run)) if n.startswith("step")))
"""


@pytest.mark.slow  # 9-12 s per host and input form: NeMo-RL's packing wrapper in a fresh interpreter
@no_hosts_mark()
@pytest.mark.parametrize("sharded", [False, True], ids=["log-probs, gathered", "logits, gathered"])
@pytest.mark.parametrize("host", nemo_rl_hosts(), ids=host_label)
def test_the_nemo_rl_loss_records_under_per_sequence_packing(host, sharded, tmp_path):
    out = tmp_path / "records"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (host, os.environ.get("PYTHONPATH")) if p)}
    proc = run_python(
        ["-c", _HOST_SCRIPT.format(repo=str(REPO), out=str(out), sharded=sharded)],
        env=env,
        cwd=REPO,
        timeout=300,
    )
    if proc.returncode != 0 and "ModuleNotFoundError" in proc.stderr:
        skip_or_fail(f"NeMo-RL at {host} lacks a dependency: {proc.stderr.splitlines()[-1]}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("\n")[-2] == str([record_name(0, 0, 0), record_name(0, 0, 1)])
    batch = load_batch(str(out))
    assert batch["prev_logprobs"].shape[0] == 5  # 3 + 2 sequences, each microbatch once
