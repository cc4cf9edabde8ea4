"""Rank function: two data-parallel ranks holding different numbers of packed sequences (gloo, CPU).

Rank ``r`` holds microbatch ``r`` of :func:`tests.support.packing_host._microbatches` (three
sequences on rank 0, two on rank 1) and runs it through NeMo-RL's real
``SequencePackingLossWrapper`` and its unpacked input preparation, with megatron-core's
``parallel_state`` (TP = CP = 1, so the data-parallel group is both ranks) giving the loss its
data-parallel group, as in NeMo-RL's Megatron worker. With ``is_batch_normalization:
data_parallel`` the loss issues a data-parallel SUM: once per microbatch on every rank, whatever
the number of sequences it holds and whether it takes log-probs or logits (:data:`CASES`), or
the two ranks' collectives would pair with the wrong partners (a hang, or the gradient
all-reduce mixed with the weights' sums).
"""

from __future__ import annotations

import sys

#: Batch normalisation over the data-parallel group (the sequences gathered into one call per microbatch).
DATA_PARALLEL = {
    "use_importance_sampling_correction": True,
    "is_correction_level": "sequence_mean",
    "is_batch_normalization": "data_parallel",
}
#: The same with a forced on-policy ratio: the weights need every sequence's current log-probs.
DATA_PARALLEL_ON_POLICY = {**DATA_PARALLEL, "is_correction_level": "token", "force_on_policy_ratio": True}
#: ``(label, config, pad_multiple)``: each with log-probs and with logits as input (the sharded path,
#: one-rank TP and CP groups; its sequences padded to 2 * cp positions, as NeMo-RL's Megatron packing).
CASES = [
    (f"{label}{'+logits' if logits else ''}", {**cfg, "sharded_logits_input": logits}, 2 if logits else 1)
    for label, cfg in (("data_parallel", DATA_PARALLEL), ("data_parallel+on_policy", DATA_PARALLEL_ON_POLICY))
    for logits in (False, True)
]


def check_data_parallel_packing(rank: int, world_size: int, host: str) -> list[str]:
    if host:
        sys.path.insert(0, host)
    import torch
    from megatron.core import parallel_state

    from nemo_rs_plugin.nemo_rl.loss_fn import RSClippedPGLossFn
    from tests.support import packing_host as ph  # installs the CPU shims before NeMo-RL's import

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, context_parallel_size=1)
    failures = []
    try:
        batches = ph._microbatches()
        gvs, gvt = ph._global_counts(batches)
        logits, data, lengths = batches[rank]
        for label, cfg, pad_multiple in CASES:
            out = {}
            for mode in ("unpacked", "per_sequence"):
                loss_fn = RSClippedPGLossFn(cfg)
                loss, metrics, grad = ph._call(mode, loss_fn, logits, data, lengths, gvs, gvt, pad_multiple)
                out[mode] = (loss.detach(), metrics, grad)
            (loss_u, metrics_u, grad_u), (loss_p, metrics_p, grad_p) = out["unpacked"], out["per_sequence"]
            if not torch.allclose(loss_p, loss_u, rtol=1e-9, atol=1e-12):
                failures.append(f"{label}: loss {float(loss_p)} != unpacked {float(loss_u)}")
            if not torch.allclose(grad_p, grad_u, rtol=1e-9, atol=1e-12):
                failures.append(f"{label}: gradient off by {float((grad_p - grad_u).abs().max()):.3g}")
            for k, v in metrics_u.items():
                if abs(metrics_p[k] - v) > 1e-9 * max(1.0, abs(v)):
                    failures.append(f"{label}: metric {k}: {metrics_p[k]} != unpacked {v}")
            # the normalisation really is over both ranks: its factor differs from this rank's own mean
            own = ph._call(
                "unpacked",
                RSClippedPGLossFn({**cfg, "is_batch_normalization": "microbatch"}),
                logits,
                data,
                lengths,
                gvs,
                gvt,
                pad_multiple,
            )[0]
            if torch.allclose(own.detach(), loss_u, rtol=1e-6):
                failures.append(f"{label}: data_parallel normalisation gave the microbatch's own result")
    finally:
        parallel_state.destroy_model_parallel()
    return failures
