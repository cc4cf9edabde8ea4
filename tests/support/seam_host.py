"""The seam at one NeMo-RL checkout (``python seam_host.py driver OUT`` / ``worker PICKLE OUT``).

Run by ``tests/nemo_rl/test_seam.py`` with the checkout first on ``PYTHONPATH``.

``driver`` (an interpreter with the start-up hook, as NeMo-RL's driver): imports NeMo-RL's
Megatron training module, reports which of the seam's names it and ``nemo_rl.algorithms.loss``
bind to the plugin's versions, then runs NeMo-RL's real ``LossPostProcessor`` (one gloo rank,
megatron-core's groups of one) with a ``sharded_logits_input`` loss, unpacked and packed, with
a bad ``policy.logprob_chunk_size`` and with training-time top-k, and reports what each raised.
It also pickles a plugin loss to ``OUT.pickle`` for ``worker``.

``worker`` (an interpreter started with ``-S``, without the start-up hook: a Ray worker whose
environment lacks it): imports the training module first, reports its names, unpickles the
loss and reports them again, and whether NeMo-RL's own per-sequence wrapper refuses the loss.
Writes a JSON report to ``OUT``. With ``$NEMO_RS_TEST_HOOK_REMOVED=1`` it runs in a process forked
from the suite's fork server, where the hook ran at the server's start: its finder is taken off
``sys.meta_path`` first, which leaves what an interpreter without the hook has (nothing of NeMo-RL
or the plugin is imported there before this script).
"""

import json
import os
import sys

sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tests.support import nemo_rl_shims  # noqa: E402

nemo_rl_shims.install()

import torch  # noqa: E402

V, B, S = 11, 2, 6
CFG = {"name": "rs_clipped_pg", "use_importance_sampling_correction": True, "sharded_logits_input": True}


def _names(report, key):
    from nemo_rl.algorithms import loss as host_loss
    from nemo_rl.models.megatron import train

    from nemo_rs_plugin.nemo_rl import seam

    report[key] = {"train": seam.installed_in(train), "loss": seam.installed_in(host_loss)}


def _batch():
    g = torch.Generator().manual_seed(0)
    token_mask = torch.ones(B, S, dtype=torch.long)
    token_mask[:, 0] = 0
    prev = -torch.rand(B, S, generator=g) * token_mask
    data = {
        "input_ids": torch.randint(0, V, (B, S), generator=g),
        "input_lengths": torch.tensor([S] * B),
        "advantages": torch.randn(B, S, generator=g),
        "prev_logprobs": prev,
        "generation_logprobs": prev,
        "reference_policy_logprobs": prev,
        "token_mask": token_mask,
        "sample_mask": torch.ones(B),
    }
    return torch.randn(B, S, V, generator=g), data, torch.tensor(float(B)), token_mask[:, 1:].sum().float()


def _step(loss_fn, packed, chunk_size=None, sampling_params=None):
    """NeMo-RL's LossPostProcessor on one microbatch: ``None`` if it trained, else ``Type: message``."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict
    from nemo_rl.models.megatron.train import LossPostProcessor

    logits, data, gvs, gvt = _batch()
    params = None
    if packed:
        cu = torch.arange(0, (B + 1) * S, S, dtype=torch.int32)
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu)
        logits = logits.reshape(1, B * S, V)
    post = LossPostProcessor(
        loss_fn=loss_fn,
        cfg={"sequence_packing": {"enabled": packed}, "logprob_chunk_size": chunk_size},
        num_microbatches=1,
        sampling_params=sampling_params,
    )
    try:
        loss, _ = post(BatchedDataDict(data), params, gvs, gvt)(logits.requires_grad_(True))
        loss.backward()
    except Exception as exc:  # noqa: BLE001 - reported, the test decides
        return f"{type(exc).__name__}: {exc}"
    return None


def driver(out):
    import pickle

    import torch.distributed as dist
    from megatron.core import parallel_state

    from nemo_rs_plugin.nemo_rl.loss_fn import RSClippedPGLossFn

    report = {}
    _names(report, "names")
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, context_parallel_size=1)
    from nemo_rl.algorithms.logits_sampling_utils import TrainingSamplingParams

    loss = RSClippedPGLossFn(CFG)
    for packed in (False, True):
        mode = "packed" if packed else "unpacked"
        report[f"{mode}/plain"] = _step(loss, packed)
        report[f"{mode}/chunk_size_0"] = _step(loss, packed, chunk_size=0)
        report[f"{mode}/chunk_size_2.5"] = _step(loss, packed, chunk_size=2.5)
        report[f"{mode}/chunk_size_3"] = _step(loss, packed, chunk_size=3)
        report[f"{mode}/top_k"] = _step(loss, packed, sampling_params=TrainingSamplingParams(top_k=8))
        report[f"{mode}/top_p"] = _step(loss, packed, sampling_params=TrainingSamplingParams(top_p=0.9))
        report[f"{mode}/temperature"] = _step(loss, packed, sampling_params=TrainingSamplingParams(temperature=0.7))
    with open(out + ".pickle", "wb") as fh:
        pickle.dump(RSClippedPGLossFn(CFG), fh)
    return report


def worker(blob):
    import pickle

    import _nemo_rs_plugin_hook as hook

    if os.environ.get("NEMO_RS_TEST_HOOK_REMOVED") == "1":
        sys.meta_path[:] = [finder for finder in sys.meta_path if not isinstance(finder, hook._Finder)]
    report = {"hook_installed": hook.installed()}
    _names(report, "before")
    with open(blob, "rb") as fh:
        loss = pickle.load(fh)
    _names(report, "after")
    from nemo_rl.models.megatron import train

    from nemo_rs_plugin.nemo_rl import seam

    original = getattr(train.SequencePackingLossWrapper, seam.MARK)
    try:
        original(loss_fn=loss, prepare_fn=None, cu_seqlens_q=torch.tensor([0, 1]))
        report["original_refuses"] = None
    except seam.SeamNotInstalledError as exc:
        report["original_refuses"] = str(exc)
    return report


if __name__ == "__main__":
    kind, arg, out = sys.argv[1], sys.argv[2], sys.argv[3]
    result = driver(out) if kind == "driver" else worker(arg)
    with open(out, "w") as fh:
        json.dump(result, fh)
