"""Recording is diagnostics, never a reason to stop training (issue 49, ``nemo_rs_plugin/nemo_rl/recording.py``).

The recorder alone: a folder that cannot be created is refused where the loss is built (a
``ConfigError`` naming it and the cause); a write that fails later (a directory in the way, a full
disk, the folder gone) returns, warns once naming the file and the errno, stops recording on that
rank and counts what is lost. In NeMo-RL's real Megatron loss path on a gloo world (TP 2, CP 2),
the writing rank's failed write leaves every rank finishing the call with the loss of a call
without recording (:mod:`tests.support.recording_world`).
"""

import errno
import logging
import os
import shutil

import pytest
import torch

from nemo_rs_plugin.core.settings.config import ConfigError
from nemo_rs_plugin.nemo_rl import recording
from nemo_rs_plugin.nemo_rl.recording import LogprobRecorder
from tests.nemo_rl.test_recording import _microbatch, _steps
from tests.support.nemo_rl_hosts import host_label, nemo_rl_hosts, no_hosts_mark, skip_or_fail


def test_a_record_dir_that_cannot_be_created_is_refused_before_step_1(tmp_path):
    blocked = tmp_path / "records"
    blocked.write_text("a file where the folder should be")
    recorder = LogprobRecorder(str(blocked), every=1, writer=lambda: (True, 0))
    with pytest.raises(ConfigError) as caught:
        recorder.check()
    message = str(caught.value)
    assert f"loss_fn.record_dir: got {str(blocked)!r}" in message
    assert "ENOTDIR (Not a directory)" in message and "record_logprobs: false" in message


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records if "recording stopped" in r.getMessage()]


def _folder(recorder) -> str:
    """Where the recorder's files go (before run folders: its directory itself)."""
    return getattr(recorder, "run_dir", recorder.directory)


@pytest.mark.parametrize("fault", ["directory at the record's name", "disk full", "run folder replaced by a file"])
def test_a_failed_write_warns_once_stops_and_is_counted(tmp_path, caplog, monkeypatch, fault):
    recorder = LogprobRecorder(str(tmp_path / "records"), every=1, writer=lambda: (True, 0))
    folder = _folder(recorder)
    first = os.path.join(folder, recording.record_name(0, 0, 0))
    code, named = {
        "directory at the record's name": ("EISDIR", first),
        "disk full": ("ENOSPC", first),
        "run folder replaced by a file": ("ENOTDIR", folder),
    }[fault]
    if fault == "directory at the record's name":
        os.makedirs(first)
    elif fault == "disk full":

        def full(*args, **kwargs):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(torch, "save", full)
    else:
        if hasattr(recorder, "check"):  # the loss checks the folder when it is built: it was fine then
            recorder.check()
            shutil.rmtree(folder)
        os.makedirs(os.path.dirname(folder), exist_ok=True)
        with open(folder, "w") as fh:
            fh.write("not a folder")
    with caplog.at_level(logging.WARNING, logger="nemo_rs_plugin"):
        _steps(recorder, 3)  # 3 steps of 2 microbatches: none may raise
    (warning,) = _warnings(caplog)
    assert named in warning and code in warning and "training goes on" in warning, warning
    assert "record_write_failures" in warning and "records nothing more" in warning
    assert recorder.written == [] and recorder.take_failures() == 6 and recorder.take_failures() == 0
    if fault == "directory at the record's name":  # no temporary file left behind
        assert sorted(os.listdir(folder)) == sorted([recording.MANIFEST, os.path.basename(first)])


def test_no_file_under_a_records_name_is_ever_partial(tmp_path, monkeypatch):
    """The bytes go to a temporary name first: a write cut short leaves no file under the record's name."""
    recorder = LogprobRecorder(str(tmp_path), every=1, writer=lambda: (True, 0))
    first = os.path.join(_folder(recorder), recording.record_name(0, 0, 0))
    real_open = open

    class Short:
        def __init__(self, fh):
            self.fh = fh

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.fh.close()

        def write(self, data):
            self.fh.write(data[: len(data) // 2])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def short_open(path, mode="r", *args, **kwargs):
        fh = real_open(path, mode, *args, **kwargs)
        return Short(fh) if "w" in mode and str(path).endswith(".tmp") else fh

    monkeypatch.setattr("builtins.open", short_open)
    try:
        written = recorder.observe(torch.tensor(1.0), _microbatch(0))
    finally:
        monkeypatch.undo()
    assert written is None and not os.path.exists(first)
    assert [n for n in os.listdir(_folder(recorder)) if n != "manifest.json"] == []  # nor a temporary one
    assert recorder.take_failures() == 1


@pytest.mark.slow  # 20-40 s per host: a 2-rank gloo world inside NeMo-RL's Megatron post-processing
@pytest.mark.distributed
@no_hosts_mark()
@pytest.mark.parametrize("host", nemo_rl_hosts(), ids=host_label)
def test_a_failed_write_on_one_rank_lets_every_rank_finish_the_call(host, tmp_path):
    import importlib.util

    from tests.support.distributed_harness import run_world
    from tests.support.recording_world import check_failed_writes_never_stop_the_call

    if importlib.util.find_spec("megatron.core") is None:
        skip_or_fail("megatron-core is not installed (pip install megatron-core)")
    # A rank that raised would leave its peer in the TP all-gather or CP all-reduce: the harness's
    # timeout (not gloo's 30 minutes) then fails the test.
    run_world(2, check_failed_writes_never_stop_the_call, host, str(tmp_path), timeout=240)
