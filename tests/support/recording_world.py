"""Rank functions: a record write that fails on one rank, inside NeMo-RL's real Megatron loss path (gloo, CPU).

Run by ``tests/nemo_rl/test_recording_faults.py`` in a world of 2 processes per NeMo-RL version,
with the real megatron-core ``parallel_state`` (TP 2, then CP 2) and NeMo-RL's
``LossPostProcessor`` through megatron-core's ``forward_step``/``backward_step``
(:mod:`tests.support.real_megatron_cases`). The loss takes logits (``sharded_logits_input``), so
its vocab-parallel all-gather (TP) or its statistics' all-reduce (CP) follows the record write
in the same call: a rank that raised there would leave its peer waiting in that collective.

On the writing rank (TP and CP rank 0) each fault makes the write fail: a directory where the
record's file goes (``EISDIR``), a full disk (``torch.save`` raising ``ENOSPC``), the run's
folder replaced by a file (``ENOTDIR``). Every rank must finish the call within
:data:`CALL_SECONDS`, with the loss and logits gradient of the same call without recording, the
same loss on both ranks, one warning naming the file and the cause, and
``record_write_failures`` counting the lost record. No mock of ``torch.distributed``.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import time

import torch

#: A call that takes longer has waited on a peer (a healthy one takes well under a second here).
CALL_SECONDS = 20.0
LAYOUTS = ((2, 1), (1, 2))  # (tp, cp) on 2 ranks
CONFIG = {"name": "rs_clipped_pg", "use_importance_sampling_correction": True, "sharded_logits_input": True}
RECORD = {"record_logprobs": True, "record_every": 1}


def _make_fault(kind: str, loss_fn) -> tuple[str, object]:
    """Break the writing rank's next record write; returns (the file that will fail, an undo)."""
    from nemo_rs_plugin.nemo_rl import recording

    recorder = loss_fn._recorder
    run_dir = getattr(recorder, "run_dir", recorder.directory)  # (before run folders: the folder itself)
    os.makedirs(run_dir, exist_ok=True)
    target = os.path.join(run_dir, recording.record_name(0, 0, 0))
    if kind == "directory at the record's name":
        os.makedirs(target)
        return target, lambda: None
    if kind == "disk full":
        real_save = torch.save

        def full(*args, **kwargs):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        recording.torch.save = full  # the module's torch is torch: restored below

        def undo():
            recording.torch.save = real_save

        return target, undo
    if kind == "run folder replaced by a file":
        shutil.rmtree(run_dir)
        with open(run_dir, "w") as fh:
            fh.write("not a folder")
        return run_dir, lambda: None
    raise ValueError(kind)


FAULTS = {
    "directory at the record's name": "EISDIR",
    "disk full": "ENOSPC",
    "run folder replaced by a file": "ENOTDIR",
}


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def check_failed_writes_never_stop_the_call(rank: int, world_size: int, host: str, folder: str) -> list[str]:
    import faulthandler

    from tests.support.real_megatron_cases import _host_modules, _local_logits, _train_step, make_batch

    faulthandler.dump_traceback_later(200)  # a rank still here then is stuck: show where (stderr)
    m = _host_modules(host)
    from nemo_rs_plugin.core.settings.config import ConfigError
    from nemo_rs_plugin.nemo_rl.loss_fn import RSClippedPGLossFn

    failures: list[str] = []
    # record_dir checked where the loss is built: a file in its place is a ConfigError naming it.
    blocked = os.path.join(folder, f"blocked-{rank}")
    with open(blocked, "w") as fh:
        fh.write("a file where the records folder should be")
    try:
        RSClippedPGLossFn({**CONFIG, **RECORD, "record_dir": blocked})
        failures.append("a record_dir that is a file was accepted when the loss was built")
    except ConfigError as exc:
        if blocked not in str(exc) or "ENOTDIR" not in str(exc) and "EEXIST" not in str(exc):
            failures.append(f"the ConfigError does not name the folder and the cause: {exc}")

    handler = _Collect()
    logging.getLogger("nemo_rs_plugin").addHandler(handler)
    logits_full, data, gvs, gvt = make_batch()
    for tp, cp in LAYOUTS:
        m["ps"].destroy_model_parallel()
        m["ps"].initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)
        shard, _ = _local_logits(m, logits_full, data, tp, cp, packed=False)
        plain = _train_step(m, RSClippedPGLossFn(CONFIG), shard, data, gvs, gvt, None, cp)
        writer = m["ps"].get_tensor_model_parallel_rank() == 0 and m["ps"].get_context_parallel_rank() == 0
        for kind, code in FAULTS.items():
            label = f"tp{tp}cp{cp}/{kind}"
            record_dir = os.path.join(folder, f"{label.replace('/', '_').replace(' ', '-')}-rank{rank}")
            loss_fn = RSClippedPGLossFn({**CONFIG, **RECORD, "record_dir": record_dir})
            target, undo = _make_fault(kind, loss_fn) if writer else (None, lambda: None)
            handler.messages.clear()
            start = time.monotonic()
            try:
                grad, metrics, out = _train_step(m, loss_fn, shard, data, gvs, gvt, None, cp)
            except Exception as exc:  # noqa: BLE001 - the failure under test
                failures.append(f"{label}: the loss call raised {type(exc).__name__}: {exc}")
                continue
            finally:
                undo()
            took = time.monotonic() - start
            if took > CALL_SECONDS:
                failures.append(f"{label}: the call took {took:.1f} s (waited on a peer?)")
            if not torch.equal(out, plain[2]) or not torch.equal(grad, plain[0]):
                failures.append(f"{label}: loss {float(out)} / gradient differ from the call without recording")
            both = [torch.zeros_like(out) for _ in range(world_size)]
            torch.distributed.all_gather(both, out.detach().contiguous())
            if not all(torch.equal(b, both[0]) for b in both):
                failures.append(f"{label}: the ranks' losses differ: {[float(b) for b in both]}")
            lost = metrics.get("record_write_failures")
            if lost != (1.0 if writer else 0.0):
                failures.append(f"{label}: record_write_failures is {lost} (expected {1.0 if writer else 0.0})")
            warned = [w for w in handler.messages if "recording stopped" in w]
            if writer and (len(warned) != 1 or target not in warned[0] or code not in warned[0]):
                failures.append(f"{label}: expected one warning naming {target} and {code}, got {warned}")
            if not writer and warned:
                failures.append(f"{label}: a rank that writes nothing warned: {warned}")
            # The next step: recording has stopped on the writer; the call still returns the metric.
            _, metrics, _ = _train_step(m, loss_fn, shard, data, gvs.clone(), gvt.clone(), None, cp)
            if metrics.get("record_write_failures") != (1.0 if writer else 0.0):
                failures.append(
                    f"{label}: the next step's record_write_failures is {metrics.get('record_write_failures')}"
                )
            if len([w for w in handler.messages if "recording stopped" in w]) > (1 if writer else 0):
                failures.append(f"{label}: warned again on the next step")
    m["ps"].destroy_model_parallel()
    faulthandler.cancel_dump_traceback_later()
    return failures
