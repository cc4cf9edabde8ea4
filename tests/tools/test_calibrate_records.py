"""Records calibrate can trust (issue 49): ``calibrate --from <record_dir>`` reads one run, verified, once each.

Written with the loss's own recorder (``nemo_rs_plugin/nemo_rl/recording.py``), read by
``nemo_rs_plugin/tools/records.py``: two runs sharing a folder, a resumed run, a corrupted or
truncated record, the copies several ranks write of one microbatch, a fractional ``sample_mask``,
the folders users already have (the format before run folders), and ``--steps`` beyond what was
recorded. A new worker process is :func:`_new_process` (the step count lives in the process).
"""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch

from nemo_rs_plugin.cli import main
from nemo_rs_plugin.nemo_rl import recording
from nemo_rs_plugin.nemo_rl.recording import RECORDED_FIELDS, LogprobRecorder
from nemo_rs_plugin.tools.batch_formats import load_batch
from tests.nemo_rl.test_recording import _microbatch


def _new_process():
    """What a new worker process (a resumed job, another run) starts with: no step counted yet."""
    recording._PROGRESS.clear()


def _record(recorder, steps, seed, per_step=2, first_counts=100.0):
    """``steps`` optimizer steps of ``per_step`` microbatches; the microbatches, in order."""
    out = []
    for step in range(steps):
        counts = torch.tensor(first_counts + step)
        for k in range(per_step):
            mb = _microbatch(seed + 10 * step + k)
            recorder.observe(counts, mb)
            out.append(mb)
    return out


def _files(folder) -> list[Path]:
    return sorted(Path(folder).rglob("step*.pt"))


def _as_batch(mbs):
    return {k: torch.cat([mb[k] for mb in mbs]).float() for k in RECORDED_FIELDS}


def _same(batch, mbs):
    want = _as_batch(mbs)
    return all(torch.equal(batch[k].float(), want[k]) for k in ("prev_logprobs", "generation_logprobs", "token_mask"))


def _calibrate(capsys, *args):
    code = main(["calibrate", "--allow-few", *map(str, args)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_two_runs_in_one_folder_keep_their_records_and_calibrate_reads_one(tmp_path, capsys):
    first = LogprobRecorder(str(tmp_path), every=1, writer=lambda: (True, 0))
    mbs_first = _record(first, 2, seed=0)
    _new_process()  # a second job writing into the same record_dir
    second = LogprobRecorder(str(tmp_path), every=1, writer=lambda: (True, 0))
    mbs_second = _record(second, 2, seed=500)
    assert len(_files(tmp_path)) == 8  # nothing overwritten
    assert _same(load_batch(str(tmp_path)), mbs_second)  # the newest run alone, not the mixture
    code, _, err = _calibrate(capsys, "--from", tmp_path)
    assert code == 0, err
    assert f"run {second.run_id}, 2 of its 2 recorded steps" in err
    assert f"1 other run(s) here, not read: {first.run_id} (--run names one)" in err
    out_json = tmp_path.parent / f"{tmp_path.name}-band.json"
    code, _, err = _calibrate(capsys, "--from", tmp_path, "--run", first.run_id, "--json", out_json)
    assert code == 0 and f"run {first.run_id}," in err, err
    import json

    assert json.loads(out_json.read_text())["records"] == {
        "run": first.run_id,
        "steps": [0, 1],
        "records": 4,
        "rank_copies_read_once": 0,
        "bad_records_skipped": 0,
    }
    from nemo_rs_plugin.tools.batch_formats import load_with_records

    assert _same(load_with_records(str(tmp_path), run=first.run_id)[0], mbs_first)
    assert _same(load_batch(first.run_dir), mbs_first)  # --from may name one run's folder
    code, _, err = _calibrate(capsys, "--from", tmp_path, "--run", "nope")
    assert code == 2 and f"--run nope: no such run with records in {tmp_path}; runs here: {second.run_id}" in err


def test_a_resumed_run_overwrites_nothing_and_steps_read_its_newest(tmp_path, capsys):
    before = LogprobRecorder(str(tmp_path), every=1, writer=lambda: (True, 0))
    _record(before, 6, seed=0)
    _new_process()  # the job resumed from a checkpoint: a new process, the same record_dir
    after = LogprobRecorder(str(tmp_path), every=1, writer=lambda: (True, 0))
    mbs_after = _record(after, 2, seed=700)
    assert len(_files(tmp_path)) == 16
    # "the newest 2 steps": the resumed job's, not steps 4 and 5 of the job before it
    assert _same(load_batch(str(tmp_path), newest_steps=2), mbs_after)
    code, _, err = _calibrate(capsys, "--from", tmp_path, "--steps", "2")
    assert code == 0 and f"run {after.run_id}, 2 of its 2 recorded steps (steps 0-1)" in err, err


def _corrupt(path: Path, tensor: torch.Tensor) -> None:
    """Change bytes inside ``tensor``'s stored data (the file stays a loadable torch file)."""
    raw = path.read_bytes()
    data = tensor.to(torch.float32).contiguous().numpy().tobytes()
    at = raw.index(data)
    bad = torch.tensor([-5.0, -7.0], dtype=torch.float32).numpy().tobytes()
    path.write_bytes(raw[: at + 8] + bad + raw[at + 8 + len(bad) :])


def test_a_corrupted_or_truncated_record_is_refused_by_name(tmp_path, capsys):
    recorder = LogprobRecorder(str(tmp_path), every=1, writer=lambda: (True, 0))
    mbs = _record(recorder, 2, seed=0)
    files = _files(tmp_path)
    _corrupt(files[1], mbs[1]["prev_logprobs"])
    assert torch.load(files[1], weights_only=True)  # it still loads: only the checksum tells
    code, out, err = _calibrate(capsys, "--from", tmp_path)
    assert code == 2 and out == "", out
    assert f"{files[1]}: checksum mismatch" in err and "--skip-bad-records" in err, err
    code, out, err = _calibrate(capsys, "--from", tmp_path, "--skip-bad-records")
    assert code == 0 and "--skip-bad-records: left out 1 bad record(s)" in err and str(files[1]) in err, err
    files[2].write_bytes(files[2].read_bytes()[:200])  # a write cut short (by an older writer)
    code, _, err = _calibrate(capsys, "--from", tmp_path)
    assert code == 2 and str(files[1]) in err
    code, _, err = _calibrate(capsys, "--from", tmp_path, "--skip-bad-records")
    assert code == 0 and "left out 2 bad record(s)" in err and str(files[2]) in err, err


_RANK = [0]


def _this_rank() -> tuple[bool, int]:
    """A writer for the ranks of one run in this process (a picklable function, as NeMo-RL's)."""
    return True, _RANK[0]


def test_copies_of_a_microbatch_from_several_ranks_count_once(tmp_path, capsys):
    """Under the DTensor backend with TP 2 both TP ranks record the same microbatches (one run, the
    loss the driver sent them): 12 sequences must not pass for 24 (the "at least 20" guard)."""
    driver = LogprobRecorder(str(tmp_path), every=1, writer=_this_rank)
    sent = pickle.dumps(driver)
    for rank in (0, 1):
        _new_process()
        _RANK[0] = rank
        mbs = _record(pickle.loads(sent), 2, seed=0)  # 2 steps x 2 microbatches x 3 sequences
    assert len(_files(tmp_path)) == 8
    batch = load_batch(str(tmp_path))
    assert batch["prev_logprobs"].shape[0] == 12 and _same(batch, mbs)
    code, _, err = main(["calibrate", "--from", str(tmp_path)]), None, capsys.readouterr().err
    assert code == 2 and "stage 0: only 12 units in --from; at least 20 are needed" in err, err
    code, _, err = _calibrate(capsys, "--from", tmp_path)
    assert code == 0 and "(4 identical rank copies read once)" in err, err


def test_a_fractional_sample_mask_is_stored_without_loss(tmp_path):
    recorder = LogprobRecorder(str(tmp_path), every=1, writer=lambda: (True, 0))
    mb = _microbatch(0)
    mb["sample_mask"] = torch.tensor([1.0, 0.5, 0.25])
    recorder.observe(torch.tensor(1.0), mb)
    assert torch.equal(load_batch(str(tmp_path))["sample_mask"], torch.tensor([1.0, 0.5, 0.25]))


def _legacy(folder: Path, seed: int) -> list[dict]:
    """Records as the loss wrote them before run folders: directly in record_dir, int8 masks, no checksum."""
    mbs = []
    for step in range(2):
        mb = _microbatch(seed + step)
        saved = {k: mb[k].to(torch.int8) if "mask" in k else mb[k].float() for k in RECORDED_FIELDS}
        torch.save(saved, folder / f"step{step:06d}-dp000-mb000.pt")
        mbs.append(mb)
    return mbs


def test_a_folder_of_the_old_format_is_read_with_a_note(tmp_path, capsys):
    mbs = _legacy(tmp_path, seed=3)
    assert _same(load_batch(str(tmp_path)), mbs)
    code, _, err = _calibrate(capsys, "--from", tmp_path)
    assert code == 0, err
    assert "run legacy, 2 of its 2 recorded steps" in err
    assert "records in the format before runs had their own folders (no run id, no checksum)" in err
    # A new run in the same folder is newer: read by default; the old records stay readable by name.
    recorder = LogprobRecorder(str(tmp_path), every=1, writer=lambda: (True, 0))
    new = _record(recorder, 1, seed=40)
    assert _same(load_batch(str(tmp_path)), new)
    code, _, err = _calibrate(capsys, "--from", tmp_path, "--run", "legacy")
    assert code == 0 and "run legacy," in err, err


def test_steps_beyond_the_recorded_ones_say_so(tmp_path, capsys):
    recorder = LogprobRecorder(str(tmp_path), every=1, writer=lambda: (True, 0))
    _record(recorder, 3, seed=0)
    code, _, err = _calibrate(capsys, "--from", tmp_path, "--steps", "100")
    assert code == 0, err
    assert f"note: --steps 100: run {recorder.run_id} has only 3 recorded step(s); reading those 3" in err


@pytest.mark.parametrize("flag", [["--run", "x"], ["--skip-bad-records"]])
def test_record_options_need_a_records_folder(tmp_path, capsys, flag):
    dump = tmp_path / "mb.pt"
    torch.save({k: v for k, v in _microbatch(0).items() if k in RECORDED_FIELDS}, dump)
    code, _, err = _calibrate(capsys, "--from", dump, *flag)
    assert code == 2 and f"{flag[0]}: reads a record_dir" in err, err
