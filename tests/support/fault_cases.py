"""Rank functions: one fault at a time inside NeMo-RL's real Megatron loss path (gloo, CPU).

Run by ``tests/parallel/test_faults.py`` in a world of 4 processes per NeMo-RL version, with the
pieces of :mod:`tests.support.real_megatron_cases` (megatron-core's ``parallel_state``,
``forward_step``/``backward_step``, NeMo-RL's ``LossPostProcessor``; the stand-in model returns
this rank's logits shard as a parameter, so ``param.grad`` is what the loss path sends into the
logits). Layouts ``(tp, cp)``: TP 2 x CP 2 (all 4 ranks in one block), CP 2 and TP 2 (two
data-parallel replicas: the one without the fault trains).

* Non-finite logits (``sharded_logits_input``, the 64k recipe's path): a NaN or +inf logit at a
  prompt position, in a row with ``sample_mask`` 0, at the last position and at a valid token,
  in the vocabulary shard of TP rank 1 (TP 2 x CP 2, packed and unpacked; at the valid token
  also +inf, a position of -inf over the whole vocabulary, and TP rank 1's whole shard -inf
  beside finite logits, which is no fault). Every rank's logits gradient must be finite, the
  loss finite, and ``nonfinite_logit_rows_count`` 1 on every rank (0 for the masked shard).
* A shape fault on one rank (global rank 1): ``generation_logprobs`` one position short, or a
  logits shard one position shorter than its peers'. Every rank must raise, within seconds, the
  same error naming the tensor, instead of waiting in a collective (a hang fails the world's
  timeout).
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

from tests.support.real_megatron_cases import CONFIGS, S, V, _host_modules, _local_logits, _train_step, make_batch

FAULT_LAYOUTS = ((2, 2), (1, 2), (2, 1))
#: TP 2 x CP 2 carries a bad row across both groups (its TP all-gather, its CP statistics).
NONFINITE_LAYOUTS = ((2, 2),)
#: (label, row, position) of the injected logit: row 2 has sample_mask 0; row 0 is valid at 2..15.
POSITIONS = (("prompt", 0, 0), ("masked-row", 2, 4), ("last", 0, S - 1), ("valid-token", 0, 5))
#: Seconds within which every rank must have raised (a collective wait would last minutes).
RAISE_WITHIN_S = 20.0


def _layout(m, tp: int, cp: int) -> None:
    m["ps"].destroy_model_parallel()
    m["ps"].initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)


def check_nonfinite_logits(rank, world_size, host):
    """A NaN/+inf logit anywhere: finite loss and gradients on every rank, the row counted once."""
    m = _host_modules(host)
    from nemo_rs_plugin.nemo_rl.loss_fn import RSClippedPGLossFn

    logits_full, data, gvs, gvt = make_batch()
    cfg = dict(CONFIGS["seq-loss/gspo/sequence_mean/geo-rs+veto+token-k3"], name="rs_clipped_pg")
    failures = []
    for tp, cp in NONFINITE_LAYOUTS:
        _layout(m, tp, cp)
        for packed in (False, True):
            for label, row, position in POSITIONS:
                values = ("nan", "inf", "row-neginf", "shard-neginf") if label == "valid-token" else ("nan",)
                for value in values:
                    bad = logits_full.clone()
                    if value == "row-neginf":  # no finite logit at this position: softmax 0/0
                        bad[row, position] = -math.inf
                    elif value == "shard-neginf":  # TP rank 1's whole shard masked: a finite row
                        bad[row, position, V // 2 :] = -math.inf
                    else:  # in the last vocabulary shard: TP rank 1's
                        bad[row, position, V - 1] = float(value)
                    shard, packed_seq_params = _local_logits(m, bad, data, tp, cp, packed)
                    loss_fn = RSClippedPGLossFn(dict(cfg, sharded_logits_input=True))
                    case = f"tp{tp}cp{cp}/{'packed' if packed else 'unpacked'}/{label}/{value}"
                    grad, metrics, out = _train_step(m, loss_fn, shard, data, gvs, gvt, packed_seq_params, cp)
                    if not torch.isfinite(grad).all():
                        failures.append(f"{case}: {int((~torch.isfinite(grad)).sum())} non-finite logit gradients")
                    if not torch.isfinite(out).all():
                        failures.append(f"{case}: loss {out}")
                    count = metrics.get("nonfinite_logit_rows_count")
                    expected = 0 if value == "shard-neginf" else 1
                    if count != expected:
                        failures.append(f"{case}: nonfinite_logit_rows_count {count}, expected {expected}")
    return failures


def check_shape_fault_on_one_rank(rank, world_size, host):
    """One rank's inputs differ: every rank raises the same error within seconds, naming the tensor."""
    m = _host_modules(host)
    from nemo_rs_plugin.nemo_rl.loss_fn import RSClippedPGLossFn

    logits_full, data, gvs, gvt = make_batch()
    cfg = dict(CONFIGS["token-loss/token-IS/tis/kl"], name="rs_clipped_pg", sharded_logits_input=True)
    failures = []
    for tp, cp in FAULT_LAYOUTS:
        _layout(m, tp, cp)
        for fault, tensor in (("short-generation-logprobs", "generation_logprobs"), ("short-logits", "logits")):
            shard, _ = _local_logits(m, logits_full, data, tp, cp, packed=False)
            mine = {k: v.clone() for k, v in data.items()}
            if rank == 1 and fault == "short-generation-logprobs":
                mine["generation_logprobs"] = mine["generation_logprobs"][:, :-1]
            if rank == 1 and fault == "short-logits":
                shard = shard[:, :-1]
            case = f"tp{tp}cp{cp}/{fault}"
            start = time.monotonic()
            try:
                _train_step(m, RSClippedPGLossFn(cfg), shard, mine, gvs, gvt, None, cp)
                message = None
            except ValueError as exc:
                message = str(exc)
            elapsed = time.monotonic() - start
            # Every rank's outcome, over the whole world (gloo), to compare within each group.
            outcomes = [None] * world_size
            dist.all_gather_object(outcomes, (message, elapsed))
            peers = _group_ranks(m)
            if 1 not in peers:  # another data-parallel replica: its inputs are fine, it trains
                if message is not None:
                    failures.append(f"{case}: rank {rank}, outside rank 1's groups, raised {message}")
                continue
            if message is None:
                failures.append(f"{case}: rank {rank} trained")
                continue
            if elapsed > RAISE_WITHIN_S:
                failures.append(f"{case}: raised after {elapsed:.1f} s")
            if tensor not in message:
                failures.append(f"{case}: the error does not name {tensor}: {message}")
            # Rank 1 and the ranks of its TP x CP block must tell the same story.
            for peer in peers:
                if outcomes[peer][0] != message:
                    failures.append(f"{case}: rank {peer} raised {outcomes[peer][0]!r}, rank {rank} {message!r}")
    return failures


def _group_ranks(m) -> list[int]:
    """The global ranks this rank's loss shares collectives with: its TP x CP block."""
    return sorted(dist.get_process_group_ranks(m["ps"].get_tensor_and_context_parallel_group()))


def check_faults(rank, world_size, host):
    """Every fault check in one world (a world's start-up, mostly imports, is the costly part)."""
    return check_shape_fault_on_one_rank(rank, world_size, host) + check_nonfinite_logits(rank, world_size, host)
