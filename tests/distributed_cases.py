"""Rank functions for tests/test_distributed.py (module-level so spawn can import them).

Every rank builds the same seeded batch, computes the single-process reference on the full
batch, then its sharded result, and returns the differences it finds.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from nemo_rs_plugin import RSClippedPGLoss, RSClippedPGLossConfig
from nemo_rs_plugin.correction import compute_correction
from nemo_rs_plugin.distributed import SequenceGroups
from nemo_rs_plugin.parallel_layout import cp_shard, shift_left
from nemo_rs_plugin.sharded import sharded_loss, sharded_loss_inputs

IS = {"use_importance_sampling_correction": True}
CONFIGS = {
    "token-level/token-IS/tis": {**IS, "truncated_importance_sampling_type": "tis",
                                 "truncated_importance_sampling_ratio": 1.5},
    "token-level/sequence-IS/icepop": {**IS, "is_correction_level": "sequence",
                                       "truncated_importance_sampling_type": "icepop",
                                       "truncated_importance_sampling_ratio": 3.0,
                                       "truncated_importance_sampling_ratio_min": 0.3},
    "seq-level/sequence_mean/seq-mask-tis": {**IS, "is_correction_level": "sequence_mean", "token_level_loss": False,
                                             "truncated_importance_sampling_type": "seq-mask-tis",
                                             "truncated_importance_sampling_ratio": 1.05,
                                             "truncated_importance_sampling_ratio_min": 0.95},
    "gspo/sequence-IS": {**IS, "sequence_level_importance_ratios": True, "token_level_loss": False},
    "gspo/sequence_mean+geo-rs+veto+token-k3": {
        **IS, "sequence_level_importance_ratios": True, "token_level_loss": False,
        "is_correction_level": "sequence_mean", "positive_example_nll_weight": 0.2,
        "rejection_sampling": [
            {"level": "sequence", "agg": "mean", "lower": 0.95, "upper": 1.05},
            {"level": "sequence", "agg": "any", "lower": 0.1, "upper": 10.0},
            {"level": "token", "metric": "kl_k3", "upper": 0.02},
        ]},
    "token-level/filters-sum-max-min-kl": {
        **IS, "is_correction_level": "token", "reference_policy_kl_type": "k2",
        "use_on_policy_kl_approximation": True,
        "rejection_sampling": [
            {"level": "token", "lower": 0.5, "upper": 2.0},
            {"level": "sequence", "agg": "sum", "lower": 0.2, "upper": 5.0},
            {"level": "sequence", "agg": "max", "upper": 1.8},
            {"level": "sequence", "agg": "min", "lower": 0.6},
            {"level": "sequence", "metric": "kl_k1", "agg": "mean", "lower": -0.1, "upper": 0.1},
            {"level": "sequence", "metric": "kl_k2", "agg": "sum", "upper": 0.2},
            {"level": "sequence", "metric": "kl_k3", "agg": "max", "upper": 0.2},
            {"level": "token", "metric": "kl_k1", "lower": -0.3, "upper": 0.3},
        ]},
}


def make_data(B: int, S: int, V: int, seed: int = 7):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, S, V, generator=g, dtype=torch.float64).float()
    input_ids = torch.randint(0, V, (B, S), generator=g)
    lp_full = torch.log_softmax(logits, -1).gather(-1, shift_left(input_ids).unsqueeze(-1)).squeeze(-1)
    # data convention of NeMo-RL: position t of [B, S] tensors belongs to token t.
    prev_tok = torch.cat([torch.zeros(B, 1), lp_full[:, :-1]], 1).detach()
    prev = prev_tok + 0.05 * torch.randn(B, S, generator=g)
    gen = prev + 0.1 * torch.randn(B, S, generator=g)
    token_mask = torch.zeros(B, S, dtype=torch.long)
    for i in range(B):  # ragged: prompt of 2..4 tokens, response of random length
        start = 2 + i % 3
        length = int(torch.randint(1, S - start, (1,), generator=g))
        token_mask[i, start : start + length] = 1
    token_mask[-1] = 0  # an empty sequence
    sample_mask = torch.ones(B)
    sample_mask[1] = 0  # a fully masked sample
    data = {
        "input_ids": input_ids,
        "advantages": torch.randn(B, 1, generator=g).expand(B, S).contiguous(),
        "prev_logprobs": prev * token_mask,
        "generation_logprobs": gen * token_mask,
        "reference_policy_logprobs": (prev + 0.2 * torch.randn(B, S, generator=g)) * token_mask,
        "token_mask": token_mask,
        "sample_mask": sample_mask,
        "rewards": torch.tensor([1.0, 0.0, -1.0, 1.0] * (B // 4 + 1))[:B],
    }
    valid = token_mask[:, 1:].float() * sample_mask[:, None]
    return logits, data, sample_mask.sum(), valid.sum()


def reference(loss_fn, logits, data, gvs, gvt):
    """Single process, full batch, NeMo-RL's [B, S-1] convention."""
    z = logits.clone().requires_grad_(True)
    lp = torch.log_softmax(z, -1)[:, :-1].gather(-1, data["input_ids"][:, 1:].unsqueeze(-1)).squeeze(-1)
    lp.retain_grad()
    loss, metrics = loss_fn(lp, data, gvs, gvt)
    loss.backward()
    lp_grad = torch.cat([lp.grad, torch.zeros_like(lp.grad[:, :1])], 1)  # to [B, S] positions
    return loss.detach(), metrics, z.grad, lp_grad


def close(a, b, rel=1e-5, abs_=1e-6):
    if isinstance(a, float):
        if math.isinf(a) or math.isinf(b):
            return a == b
        return abs(a - b) <= abs_ + rel * abs(b)
    return torch.allclose(a, b, rtol=rel, atol=abs_)


def compare_loss_and_metrics(label, loss, metrics, ref_loss, ref_metrics, group):
    """The loss shares summed over ``group`` and this rank's metrics against the reference."""
    failures = []
    total = loss.detach().clone()
    dist.all_reduce(total, group=group)
    if not close(total, ref_loss):
        failures.append(f"{label}: loss {total.item()} vs {ref_loss.item()}")
    for key, value in ref_metrics.items():
        if key not in metrics or not close(metrics[key], value):
            failures.append(f"{label}: metric {key}@{dist.get_rank()} {metrics.get(key)} vs {value}")
    return failures


def build_groups(rank, world_size, tp):
    """Megatron order: TP fastest. Every rank creates every group, in the same order."""
    cp = world_size // tp
    tp_groups = [dist.new_group(list(range(c * tp, (c + 1) * tp))) for c in range(cp)]
    cp_groups = [dist.new_group(list(range(t, world_size, tp))) for t in range(tp)]
    tp_rank, cp_rank = rank % tp, rank // tp
    return tp_groups[cp_rank], cp_groups[tp_rank], tp_rank, cp_rank, cp


def check_sharded_equals_unsharded(rank, world_size, tp):
    tp_group, cp_group, tp_rank, cp_rank, cp = build_groups(rank, world_size, tp)
    failures = []
    B, S, V = 5, 16, 12
    logits, data, gvs, gvt = make_data(B, S, V)
    v_local = V // tp
    for name, cfg in CONFIGS.items():
        loss_fn = RSClippedPGLoss(cfg)
        ref_loss, ref_metrics, ref_zgrad, ref_lpgrad = reference(loss_fn, logits, data, gvs, gvt)
        shard = cp_shard(logits, cp, cp_rank)[..., tp_rank * v_local : (tp_rank + 1) * v_local]
        z = shard.clone().requires_grad_(True)
        inputs = sharded_loss_inputs(z, data, cp_group=cp_group, tp_group=tp_group if tp > 1 else None)
        inputs.curr.retain_grad()
        loss, metrics = loss_fn.compute(inputs, gvs, gvt, SequenceGroups.of(cp_group))
        loss.backward()
        failures += compare_loss_and_metrics(name, loss, metrics, ref_loss, ref_metrics, cp_group)
        want_z = cp_shard(ref_zgrad, cp, cp_rank)[..., tp_rank * v_local : (tp_rank + 1) * v_local]
        scale = ref_zgrad.abs().max().item() + 1e-12
        if not close(z.grad, want_z, abs_=1e-6 * scale):
            failures.append(f"{name}: logits grad@{rank} max diff {(z.grad - want_z).abs().max().item():.3g}")
        want_lp = cp_shard(ref_lpgrad, cp, cp_rank)
        if not close(inputs.curr.grad, want_lp, abs_=1e-6 * scale):
            failures.append(f"{name}: logprob grad@{rank} max diff {(inputs.curr.grad - want_lp).abs().max().item():.3g}")
        failures += _check_masks(name, loss_fn.cfg, data, cp_group, cp, cp_rank, gvs, gvt)
        # every rank of the group reports identical metrics
        vec = torch.tensor([v for k, v in sorted(metrics.items()) if math.isfinite(v)])
        hi, lo = vec.clone(), vec.clone()
        dist.all_reduce(hi, op=dist.ReduceOp.MAX)
        dist.all_reduce(lo, op=dist.ReduceOp.MIN)
        if not torch.equal(hi, lo):
            failures.append(f"{name}: metrics differ between ranks")
    return failures


def _correction_keep(cfg, data, groups, shard_fn, gvs, gvt):
    d_full = shift_left(data["prev_logprobs"] - data["generation_logprobs"])
    tm = shift_left(data["token_mask"]).float()
    d, tm = shard_fn(d_full), shard_fn(tm)
    sm = data["sample_mask"]
    out = compute_correction(d, torch.isfinite(d).float(), tm * sm[:, None], tm, sm, torch.isfinite(d).float(),
                             cfg, gvs, gvt, groups)
    return out.keep * tm * sm[:, None], out.is_weight


def _check_masks(name, cfg, data, cp_group, cp, cp_rank, gvs, gvt):
    full_keep, full_w = _correction_keep(cfg, data, SequenceGroups(), lambda x: x, gvs, gvt)
    keep, w = _correction_keep(cfg, data, SequenceGroups.of(cp_group), lambda x: cp_shard(x, cp, cp_rank), gvs, gvt)
    out = []
    if not torch.equal(keep, cp_shard(full_keep, cp, cp_rank)):
        out.append(f"{name}: rejection mask differs from the unsharded one")
    want_w = full_w if full_w.shape[1] == 1 else cp_shard(full_w, cp, cp_rank)
    if not close(w, want_w):
        out.append(f"{name}: IS weights differ from the unsharded ones")
    return out


def check_statistic_reduced_before_masking(rank, world_size):
    """Each rank's half of sequence 0 is inside the Geo-RS band; the whole is outside."""
    group = dist.new_group(list(range(world_size)))
    cfg = RSClippedPGLossConfig.from_any({"rejection_sampling": [
        {"level": "sequence", "agg": "sum", "lower": 0.7, "upper": 1.3}]})
    S = 8
    # d = 0.1 on every token: each rank's partial sum 0.4 -> exp 1.49 > 1.3 would reject
    # locally too, so use d = 0.05: partial 0.2 (exp 1.22, inside), whole 0.4 (1.49, outside).
    d = torch.full((1, S), 0.05)
    tm = torch.ones(1, S)
    local = cp_shard(d, world_size, rank)
    tm_l = cp_shard(tm, world_size, rank)
    out = compute_correction(local, torch.isfinite(local).float(), tm_l, tm_l, torch.ones(1), torch.isfinite(local).float(),
                             cfg, torch.tensor(1.0), tm.sum(), SequenceGroups.of(group))
    unreduced = compute_correction(local, torch.isfinite(local).float(), tm_l, tm_l, torch.ones(1), torch.isfinite(local).float(),
                                   cfg, torch.tensor(1.0), tm.sum(), SequenceGroups())
    failures = []
    if out.keep.sum() != 0:
        failures.append(f"sequence kept on rank {rank}: its statistic was not reduced before masking")
    if unreduced.keep.sum() == 0:
        failures.append("test data broken: the local half alone should be inside the bounds")
    return failures


def check_bad_groups(rank, world_size):
    group = dist.new_group(list(range(world_size)))
    logits, data, gvs, gvt = make_data(2, 16, 6)
    failures = []
    loss_fn = RSClippedPGLoss({})
    cases = {
        "shard shape": (lambda: sharded_loss(loss_fn, logits, data, gvs, gvt, cp_group=group), "does not match [B, S/cp]"),
        "divisibility": (lambda: sharded_loss(loss_fn, logits[:, :7], {**data, "input_ids": data["input_ids"][:, :14]},
                                              gvs, gvt, cp_group=group), "not divisible by 2 * cp"),
    }
    for label, (call, needle) in cases.items():
        try:
            call()
            failures.append(f"{label}: no error")
        except ValueError as exc:
            if needle not in str(exc):
                failures.append(f"{label}: unclear error {exc}")
    return failures


def check_collective_budget(rank, world_size):
    """One loss call: the mask statistics cost one SUM and one MAX all-reduce of O(batch)
    bytes, and nothing is all-gathered."""
    from nemo_rs_plugin import correction as correction_mod

    group = dist.new_group(list(range(world_size)))
    calls = []
    orig_all_reduce = dist.all_reduce

    def counting_all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        calls.append((str(op), tensor.numel()))
        return orig_all_reduce(tensor, op=op, group=group, async_op=async_op)

    def no_gather(*args, **kwargs):
        raise AssertionError("all_gather issued")

    stat_calls = []
    orig_reduce = correction_mod.reduce_sequence_statistics

    def spy(sums, maxima, groups):
        before = len(calls)
        out = orig_reduce(sums, maxima, groups)
        stat_calls.append(calls[before:])
        return out

    saved = (dist.all_reduce, dist.all_gather, dist.all_gather_into_tensor)
    dist.all_reduce, dist.all_gather, dist.all_gather_into_tensor = counting_all_reduce, no_gather, no_gather
    correction_mod.reduce_sequence_statistics = spy
    failures = []
    try:
        B, S, V = 5, 16, 12
        logits, data, gvs, gvt = make_data(B, S, V)
        for name in ("gspo/sequence_mean+geo-rs+veto+token-k3", "token-level/filters-sum-max-min-kl"):
            stat_calls.clear()
            loss, _ = sharded_loss(RSClippedPGLoss(CONFIGS[name]), cp_shard(logits, world_size, rank).requires_grad_(True),
                                   data, gvs, gvt, cp_group=group)
            loss.backward()
            if len(stat_calls) != 1:
                failures.append(f"{name}: statistics reduced {len(stat_calls)} times, expected once")
            elif len(stat_calls[0]) > 2 or any(n > 64 * B for _, n in stat_calls[0]):
                failures.append(f"{name}: statistic collectives {stat_calls[0]}")
    finally:
        dist.all_reduce, dist.all_gather, dist.all_gather_into_tensor = saved
        correction_mod.reduce_sequence_statistics = orig_reduce
    return failures


def check_bad_global_count_raises_on_every_rank(rank, world_size):
    """global_valid_toks = 0 while only rank 0's shard holds valid tokens: every rank of the CP
    group raises (the check is reduced with the metrics), naming the microbatch's count."""
    group = dist.new_group(list(range(world_size)))
    logits, data, gvs, _ = make_data(2, 16, 6)
    token_mask = torch.zeros_like(data["token_mask"])
    token_mask[0, 1:4] = 1  # aligned positions 0..2: chunk 0, rank 0's shard only
    data = {**data, "token_mask": token_mask, "sample_mask": torch.ones(2)}
    try:
        sharded_loss(RSClippedPGLoss({}), cp_shard(logits, world_size, rank), data, 2.0, 0.0, cp_group=group)
    except ValueError as exc:
        if "global_valid_toks: got 0 while this microbatch has 3 valid tokens" not in str(exc):
            return [f"unclear error on rank {rank}: {exc}"]
        return []
    return [f"no error on rank {rank}"]
