"""The loss through NeMo-RL's real packing wrappers, in a host's interpreter (``python packing_host.py CASES OUT``).

Run by ``tests/nemo_rl/test_packing.py`` with one NeMo-RL checkout on ``PYTHONPATH``. For every
loss section in the ``CASES`` JSON file it builds the loss the way GRPO does (the plugin's
``rs_clipped_pg``, or NeMo-RL's own ``ClippedPGLossFn`` as the control) and calls it on the same
microbatches in the three ways NeMo-RL does:

* ``unpacked``: ``wrap_loss_fn_with_input_preparation`` on ``[B, S, V]`` logits (no packing);
* ``per_sequence``: ``SequencePackingLossWrapper`` over the sequences packed back to back
  (Megatron without ``fuse_loss``, the DTensor worker, automodel);
* ``fused``: ``SequencePackingFusionLossWrapper`` with ``prepare_packed_loss_input`` (Megatron
  with ``sequence_packing.fuse_loss: true``), on a one-rank gloo tensor-parallel group;
* ``per_sequence_unindexed``: a per-sequence wrapper of this file's own that hands the loss its
  microbatch through the seam but does not promise NeMo-RL's order (``HostCall(positions=False)``:
  each call on its own sequence, with the microbatch totals);
* ``per_sequence_megatron``: ``SequencePackingLossWrapper`` as Megatron builds it, sequences
  padded to a multiple of 4 and the padded boundaries as ``cu_seqlens_q`` (log-prob input).

Each mode runs two microbatches with the step's global counts; the per-microbatch metrics are
combined as NeMo-RL's GRPO driver does (``aggregate_step_metrics`` where the host has it, else
its inline rule: min/max for ``probs_ratio_*``, a sum for the rest). The gradient is that of the
summed microbatch losses with respect to the logits, mapped back to ``[B, S, V]``. Writes
``{case name: {mode: {"loss", "grad", "metrics"} or {"error", "type"}}}`` as JSON to ``OUT``.
"""

import json
import math
import os
import sys
import traceback

sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tests.support import nemo_rl_shims  # noqa: E402

nemo_rl_shims.install()

import torch  # noqa: E402

V = 17
#: Response lengths of the two microbatches (one prompt token each): 9-40 tokens, uneven counts.
MICROBATCH_LENGTHS = ([12, 40, 9], [27, 15])


def _microbatches(seed=0):
    """Two microbatches of float64 log-probs with mismatch, some of it large (the filters bite)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for lengths in MICROBATCH_LENGTHS:
        # rows padded to an even length, as NeMo-RL pads a batch (make_sequence_length_divisible_by)
        B, S = len(lengths), -(-max(lengths) // 2) * 2
        logits = torch.randn(B, S, V, generator=g, dtype=torch.float64)
        input_ids = torch.randint(0, V, (B, S), generator=g)
        token_mask = torch.zeros(B, S, dtype=torch.long)
        for i, n in enumerate(lengths):
            token_mask[i, 1:n] = 1
        # prev: the trainer before the update (not the current logits: the PPO ratio moves)
        shifted = torch.log_softmax(logits + 0.3 * torch.randn(B, S, V, generator=g, dtype=torch.float64), -1)
        prev = shifted.gather(-1, input_ids.unsqueeze(-1)).squeeze(-1)
        prev = torch.cat([torch.zeros(B, 1, dtype=torch.float64), prev[:, :-1]], 1) * token_mask
        noise = 0.05 * torch.randn(B, S, generator=g, dtype=torch.float64)
        noise[0, 3] = -3.0  # one outlier token (ratio e^3): vetoes and token filters have something to reject
        noise[1] += 1.0  # a sampler far more confident than the trainer: weights below 1/2 (the low tail)
        gen = (prev + noise).clamp_max(0.0) * token_mask
        ref = (prev + 0.02 * torch.randn(B, S, generator=g, dtype=torch.float64)) * token_mask
        advantages = torch.randn(B, 1, generator=g, dtype=torch.float64).expand(B, S).clone()
        advantages[-1] = 0.0  # a sequence without gradient signal
        data = {
            "input_ids": input_ids,
            "input_lengths": torch.tensor(lengths),
            "advantages": advantages,
            "prev_logprobs": prev,
            "generation_logprobs": gen,
            "reference_policy_logprobs": ref,
            "token_mask": token_mask,
            # the first microbatch's last sequence is masked out (NeMo-RL's sample_mask = 0)
            "sample_mask": torch.tensor(
                [1.0] * (B - 1) + [0.0 if lengths == MICROBATCH_LENGTHS[0] else 1.0], dtype=torch.float64
            ),
            "rewards": (advantages[:, 0] > 0).to(torch.float64),
        }
        out.append((logits, data, lengths))
    return out


def _global_counts(batches):
    seqs = sum(float(d["sample_mask"].sum()) for _, d, _ in batches)
    toks = sum(float((d["token_mask"][:, 1:] * d["sample_mask"].unsqueeze(-1)).sum()) for _, d, _ in batches)
    return torch.tensor(seqs, dtype=torch.float64), torch.tensor(toks, dtype=torch.float64)


def _driver_aggregate(per_microbatch):
    """NeMo-RL's GRPO driver over the microbatches' metric dicts."""
    lists = {}
    for metrics in per_microbatch:
        for k, v in metrics.items():
            lists.setdefault(k, []).append(float(v))
    try:
        from nemo_rl.algorithms.single_controller_utils.utils import aggregate_step_metrics
    except Exception:  # v0.6.0 / v0.7.0: the rule is inline in grpo.py's training loop
        aggregate_step_metrics = None
    if aggregate_step_metrics is not None:
        return aggregate_step_metrics({"all_mb_metrics": lists})
    import math

    out = {}
    for k, v in lists.items():
        if k in ("probs_ratio_min", "probs_ratio_clamped_min"):
            finite = [x for x in v if not math.isinf(x)]
            out[k] = min(finite) if finite else -1.0
        elif k in ("probs_ratio_max", "probs_ratio_clamped_max"):
            finite = [x for x in v if not math.isinf(x)]
            out[k] = max(finite) if finite else -1.0
        else:
            out[k] = sum(v)
    return out


def _tp_group():
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    return dist.group.WORLD


def _cumulative(lengths):
    return torch.tensor([0] + [sum(lengths[: i + 1]) for i in range(len(lengths))], dtype=torch.int32)


def _call(mode, loss_fn, logits, data, lengths, gvs, gvt, pad_multiple=1):
    """``(loss, metrics, grad of loss w.r.t. [B, S, V] logits)`` for one microbatch in ``mode``.

    ``pad_multiple``: each packed sequence padded to a multiple of it, as NeMo-RL's Megatron
    packing pads for context parallelism (``cu_seqlens_q_padded``).
    """
    from functools import partial

    from nemo_rl.algorithms import loss as host_loss
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict

    leaf = logits.clone().requires_grad_(True)
    batch = BatchedDataDict({k: v.clone() for k, v in data.items()})
    padded = [-(-n // pad_multiple) * pad_multiple for n in lengths]
    cu, cu_padded = _cumulative(lengths), _cumulative(padded)
    if mode == "unpacked":
        loss, metrics = host_loss.wrap_loss_fn_with_input_preparation(
            leaf, batch, gvs, gvt, loss_fn, host_loss.prepare_loss_input
        )
        loss.backward()
        return loss, metrics, leaf.grad
    segments = []
    for i, (n, p) in enumerate(zip(lengths, padded)):
        segments += [leaf[i, :n], torch.zeros(p - n, V, dtype=leaf.dtype)]
    packed = torch.cat(segments).unsqueeze(0)
    if mode == "per_sequence_unindexed":
        loss, metrics = _unindexed_wrapper(host_loss, loss_fn)(packed, batch, cu, cu_padded, gvs, gvt)
        loss.backward()
        return loss, metrics, leaf.grad
    if mode in ("per_sequence", "per_sequence_megatron"):
        wrapper = host_loss.SequencePackingLossWrapper(
            loss_fn=loss_fn,
            prepare_fn=host_loss.prepare_loss_input,
            # Megatron hands the wrapper its padded boundaries as cu_seqlens_q too (a sequence's
            # data then has its padding columns: token_mask 0 there)
            cu_seqlens_q=cu_padded if mode == "per_sequence_megatron" else cu,
            cu_seqlens_q_padded=cu_padded if pad_multiple > 1 else None,
        )
    else:
        from nemo_rl.algorithms.loss.utils import prepare_packed_loss_input

        wrapper = host_loss.SequencePackingFusionLossWrapper(
            loss_fn=loss_fn,
            prepare_fn=partial(prepare_packed_loss_input, sampling_params=None),
            cu_seqlens_q=cu,
            cu_seqlens_q_padded=cu_padded,
            vocab_parallel_rank=0,
            vocab_parallel_group=_tp_group(),
        )
    loss, metrics = wrapper(packed, batch, gvs, gvt)
    loss.backward()
    return loss, metrics, leaf.grad


_FOLD = {
    "probs_ratio_min": min,
    "probs_ratio_clamped_min": min,
    "probs_ratio_max": max,
    "probs_ratio_clamped_max": max,
}


def _unindexed_wrapper(host_loss, loss_fn):
    """A per-sequence wrapper that hands the loss its microbatch but not the order of its calls.

    It opens the seam's ``HostCall`` with ``positions=False`` (``nemo_rs_plugin.nemo_rl.packing``):
    the loss computes each call on its own sequence with the microbatch totals. Written here, on
    NeMo-RL's interfaces (its ``prepare_loss_input``, the wrapper's ``loss_fn``).
    """
    from contextlib import nullcontext

    from nemo_rs_plugin.nemo_rl.packing import HostCall

    class SequencePackingLossWrapper:
        def __init__(self, loss_fn):
            self.loss_fn = loss_fn
            self.cu_seqlens_q = None

        def __call__(self, packed, data, cu, cu_padded, gvs, gvt):
            self.cu_seqlens_q = cu
            total, summed = 0, {}
            lengths = (cu[1:] - cu[:-1]).tolist()
            entry = getattr(self.loss_fn, "nemo_rl_call", None)  # NeMo-RL's own loss (the control) has none
            with entry(HostCall({}, data, len(lengths), positions=False)) if entry else nullcontext():
                return self._loop(packed, data, cu_padded, lengths, gvs, gvt, total, summed)

        def _loop(self, packed, data, cu_padded, lengths, gvs, gvt, total, summed):
            for position, (start, end) in enumerate(zip(cu_padded[:-1].tolist(), cu_padded[1:].tolist())):
                n = lengths[position]  # the sequence's data unpadded, its logits as packed (padded)
                one = {
                    k: (v[position : position + 1, :n] if v.dim() > 1 else v[position : position + 1])
                    for k, v in data.items()
                }
                loss_input, one = host_loss.prepare_loss_input(packed[:, start:end], one, self.loss_fn)
                loss, metrics = self.loss_fn(data=one, global_valid_seqs=gvs, global_valid_toks=gvt, **loss_input)
                total = total + loss
                for k, v in metrics.items():  # NeMo-RL's rule: min / max of the finite ratio extremes, else a sum
                    v, fold = float(v), _FOLD.get(k)
                    if fold is None:
                        summed[k] = summed.get(k, 0.0) + v
                    elif not math.isinf(v):
                        summed[k] = fold(summed[k], v) if k in summed else v
            return total, summed

    return SequencePackingLossWrapper(loss_fn)


def _build(section):
    from nemo_rl.algorithms import grpo
    from nemo_rl.algorithms import loss as host_loss

    cfg_cls = host_loss.ClippedPGLossConfig
    section = dict(section)
    if section.get("name") in (None, "clipped_pg"):  # the control: NeMo-RL's own loss
        section.pop("name", None)
        full = {**_host_defaults(), **section}
        return host_loss.ClippedPGLossFn(cfg_cls(**full) if hasattr(cfg_cls, "model_validate") else full)
    return grpo.ClippedPGLossFn(cfg_cls(**section) if hasattr(cfg_cls, "model_validate") else section)


def _host_defaults():
    from nemo_rs_plugin.core.settings.config import NeMoRLLossFields

    return {k: v for k, v in NeMoRLLossFields().model_dump().items() if k != "name"}


def run_case(section, modes=("unpacked", "per_sequence", "fused", "per_sequence_unindexed", "per_sequence_megatron")):
    batches = _microbatches()
    gvs, gvt = _global_counts(batches)
    out = {}
    for mode in modes:
        pad_multiple = 2 if section.get("sharded_logits_input") else 1  # its layout: 2 * cp positions
        if mode == "per_sequence_megatron":
            if section.get("sharded_logits_input"):
                continue  # its per_sequence mode already has padded sequences
            pad_multiple = 4
        try:
            loss_fn = _build(section)  # a fresh loss per mode: nothing carried between modes
            total, grads, per_mb = 0.0, [], []
            for logits, data, lengths in batches:
                loss, metrics, grad = _call(mode, loss_fn, logits, data, lengths, gvs, gvt, pad_multiple)
                total += float(loss.detach())
                grads.append(grad.reshape(-1))
                per_mb.append({k: float(v) for k, v in metrics.items()})
            out[mode] = {
                "loss": total,
                "grad": torch.cat(grads).tolist(),
                "metrics": _driver_aggregate(per_mb),
            }
        except Exception as exc:  # reported, not raised: the test decides what is expected
            out[mode] = {"error": str(exc), "type": type(exc).__name__, "traceback": traceback.format_exc()[-3000:]}
    return out


def main(cases_path, out_path):
    with open(cases_path) as fh:
        cases = json.load(fh)
    results = {name: run_case(section) for name, section in cases.items()}
    with open(out_path, "w") as fh:
        json.dump(results, fh)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
