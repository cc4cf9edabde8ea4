"""The seam (``nemo_rs_plugin.nemo_rl.seam``): NeMo-RL's context reaches the loss explicitly, at every host.

* At each NeMo-RL checkout (``tests/support/seam_host.py``): after activation the names NeMo-RL's
  Megatron training code builds its loss wrappers from (``SequencePackingLossWrapper``,
  ``SequencePackingFusionLossWrapper``, ``wrap_loss_fn_with_input_preparation``, in
  ``nemo_rl.models.megatron.train`` and ``nemo_rl.algorithms.loss``) are the plugin's; through
  NeMo-RL's real ``LossPostProcessor``, unpacked and packed, a ``policy.logprob_chunk_size`` of 0
  or 2.5 is refused by name (v0.7.0 on: v0.6.0 does not pass it) and training-time top-k/top-p
  are refused, temperature alone trains; in an interpreter without the start-up hook (a Ray
  worker), unpickling the loss installs the seam into the training module imported before it,
  and NeMo-RL's own per-sequence wrapper refuses the loss.
* No frame inspection is left in the package (``sys._getframe``, ``f_back``, ``f_locals``,
  ``inspect.stack``, ``inspect.currentframe``).
* :class:`~nemo_rs_plugin.nemo_rl.packing.HostCall` counts calls: more or fewer calls than
  sequences are errors.
"""

import json
import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from nemo_rs_plugin.nemo_rl.packing import HostCall
from tests.support.fork_server import run_python
from tests.support.nemo_rl_hosts import host_label, nemo_rl_hosts, skip_or_fail, whole_matrix

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "support" / "seam_host.py"
HOSTS = nemo_rl_hosts()
SEAM = ["SequencePackingLossWrapper", "SequencePackingFusionLossWrapper", "wrap_loss_fn_with_input_preparation"]
FRAME_READING = re.compile(r"_getframe|\bf_back\b|\bf_locals\b|inspect\.stack|inspect\.currentframe|inspect\.trace")


def test_no_frame_inspection_left_in_the_package():
    found = [
        f"{path.relative_to(REPO)}:{n}: {line.strip()}"
        for path in sorted((REPO / "nemo_rs_plugin").rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if FRAME_READING.search(line)
    ]
    assert not found, found


def test_a_host_call_counts_one_call_per_sequence():
    call = HostCall({"chunk_size": 4}, microbatch=None, sequences=2)
    assert [c.sequence_index for c in (call.next_call(), call.next_call())] == [None, None]  # no microbatch
    with pytest.raises(RuntimeError, match="3 times for 2 sequences"):
        call.next_call()
    short = HostCall({}, microbatch=None, sequences=2)
    short.next_call()
    with pytest.raises(RuntimeError, match="1 times for 2 sequences"):
        short.check_complete()
    assert HostCall({"chunk_size": 4}).next_call() is None  # a wrapper that calls the loss once


def test_a_host_call_reads_its_microbatch_once(monkeypatch):
    """Whether the wrapper's data is its whole microbatch is decided when the wrapper call opens,
    not in each of its per-sequence calls (a per-call cost under packing: bench_packing.py)."""
    import torch

    from nemo_rs_plugin.nemo_rl import packing

    microbatch = {k: torch.zeros(2, 3) for k in ("token_mask", "sample_mask", "generation_logprobs")}
    reads = []
    monkeypatch.setattr(packing, "is_microbatch", lambda data, n: reads.append(n) or True)
    call = HostCall({}, microbatch=microbatch, sequences=2)
    assert [c.sequence_index for c in (call.next_call(), call.next_call())] == [0, 1]
    assert reads == [2]
    assert HostCall({}, microbatch=microbatch, sequences=2, positions=False).next_call().sequence_index is None


def _run(host, *args, no_site=False, tmp):
    """``seam_host.py`` at ``host``. ``no_site``: as a worker without the start-up hook; at the newest
    NeMo-RL a new interpreter with ``-S`` (no ``.pth`` processed), at a release (``whole_matrix``) a
    process of the fork server with the hook's finder taken off (the same state, 20-30 s sooner)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([host] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    if no_site and not whole_matrix(host):
        env["NEMO_RS_TEST_HOOK_REMOVED"] = "1"
        proc = run_python([str(SCRIPT), *args], env=env, timeout=600, cwd=REPO)
    elif no_site:  # no site-packages processing: no .pth, so no start-up hook (a worker environment)
        site = sysconfig.get_paths()["purelib"]
        code = (
            f"import sys, runpy; sys.path.append({site!r}); sys.argv = {[str(SCRIPT), *args]!r}; "
            f"runpy.run_path({str(SCRIPT)!r}, run_name='__main__')"
        )
        proc = subprocess.run(
            [sys.executable, "-S", "-c", code], capture_output=True, text=True, env=env, timeout=600, cwd=REPO
        )
    else:  # the start-up hook ran in the fork server, as it runs at any interpreter's start
        proc = run_python([str(SCRIPT), *args], env=env, timeout=600, cwd=REPO)
    if proc.returncode != 0 and "ModuleNotFoundError" in proc.stderr:
        skip_or_fail(f"NeMo-RL at {host} lacks a dependency: {proc.stderr.splitlines()[-1]}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(Path(args[-1]).read_text())


@pytest.fixture(scope="module", params=HOSTS, ids=host_label)
def host_reports(request, tmp_path_factory):
    host = request.param
    tmp = tmp_path_factory.mktemp("seam")
    out = str(tmp / "driver.json")
    driver = _run(host, "driver", "-", out, tmp=tmp)
    worker = _run(host, "worker", out + ".pickle", str(tmp / "worker.json"), no_site=True, tmp=tmp)
    return host, driver, worker


def test_the_seam_is_where_nemo_rl_builds_its_wrappers(host_reports):
    _, driver, _ = host_reports
    assert driver["names"] == {"train": SEAM, "loss": SEAM}


@pytest.mark.parametrize("mode", ["unpacked", "packed"])
def test_the_chunk_size_reaches_the_loss_through_the_seam(host_reports, mode):
    host, driver, _ = host_reports
    passes_chunk_size = host_label(host) != "v0.6.0"  # v0.6.0's training preparation has no chunk_size
    for bad in ("0", "2.5"):
        refusal = driver[f"{mode}/chunk_size_{bad}"]
        if passes_chunk_size:
            assert refusal and f"policy.logprob_chunk_size: got {bad}; allowed: a positive integer" in refusal
        else:
            assert refusal is None
    assert driver[f"{mode}/chunk_size_3"] is None
    assert driver[f"{mode}/plain"] is None


@pytest.mark.parametrize("mode", ["unpacked", "packed"])
def test_the_sampling_params_reach_the_loss_through_the_seam(host_reports, mode):
    _, driver, _ = host_reports
    for filtering in ("top_k", "top_p"):
        refusal = driver[f"{mode}/{filtering}"]
        assert refusal and "loss_fn.sharded_logits_input: got true with training-time top-k/top-p" in refusal
    assert driver[f"{mode}/temperature"] is None


def test_unpickling_the_loss_installs_the_seam_in_a_worker_without_the_hook(host_reports):
    _, _, worker = host_reports
    assert worker["hook_installed"] is False
    assert worker["before"] == {"train": [], "loss": []}
    assert worker["after"] == {"train": SEAM, "loss": SEAM}
    assert "NeMo-RL's own SequencePackingLossWrapper was given a nemo-rs-plugin loss" in worker["original_refuses"]
