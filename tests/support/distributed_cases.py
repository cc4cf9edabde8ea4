"""Rank functions for tests/parallel/test_distributed.py (module-level so spawn can import them).

Every rank builds the same seeded batch, computes the single-process reference on the full
batch, then its sharded result, and returns the differences it finds.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from nemo_rs_plugin import CorrectedPGLoss, RSClippedPGLossConfig
from nemo_rs_plugin.core.correction import PolicyLogProbs, compute_correction
from nemo_rs_plugin.core.distributed import SequenceGroups
from nemo_rs_plugin.core.masking import TokenMasks
from nemo_rs_plugin.core.reporting.metrics import GlobalCounts
from nemo_rs_plugin.parallel.layout import cp_shard, shift_left
from nemo_rs_plugin.parallel.sharded import sharded_loss, sharded_loss_inputs
from tests.support.logprobs import at_most_zero

IS = {"use_importance_sampling_correction": True}
CONFIGS = {
    "token-level/token-IS/tis": {
        **IS,
        "truncated_importance_sampling_type": "tis",
        "truncated_importance_sampling_ratio": 1.5,
    },
    "token-level/sequence-IS/icepop": {
        **IS,
        "is_correction_level": "sequence",
        "truncated_importance_sampling_type": "icepop",
        "truncated_importance_sampling_ratio": 3.0,
        "truncated_importance_sampling_ratio_min": 0.3,
    },
    "seq-level/sequence_mean/seq-mask-tis": {
        **IS,
        "is_correction_level": "sequence_mean",
        "token_level_loss": False,
        "truncated_importance_sampling_type": "seq-mask-tis",
        "truncated_importance_sampling_ratio": 1.05,
        "truncated_importance_sampling_ratio_min": 0.95,
    },
    "gspo/sequence-IS": {**IS, "sequence_level_importance_ratios": True, "token_level_loss": False},
    "gspo/sequence_mean+geo-rs+veto+token-k3": {
        **IS,
        "sequence_level_importance_ratios": True,
        "token_level_loss": False,
        "is_correction_level": "sequence_mean",
        "positive_example_nll_weight": 0.2,
        "rejection_sampling": [
            {"level": "sequence", "agg": "mean", "lower": 0.95, "upper": 1.05},
            {"level": "sequence", "agg": "any", "lower": 0.1, "upper": 10.0},
            {"level": "token", "statistic": "kl_k3", "upper": 0.02},
        ],
    },
    "token-level/filters-sum-max-min-kl": {
        **IS,
        "is_correction_level": "token",
        "reference_policy_kl_type": "k2",
        "use_on_policy_kl_approximation": True,
        "rejection_sampling": [
            {"level": "token", "lower": 0.5, "upper": 2.0},
            {"level": "sequence", "agg": "sum", "lower": 0.2, "upper": 5.0},
            {"level": "sequence", "agg": "max", "upper": 1.8},
            {"level": "sequence", "agg": "min", "lower": 0.6},
            {"level": "sequence", "statistic": "kl_k1", "agg": "mean", "lower": -0.1, "upper": 0.1},
            {"level": "sequence", "statistic": "kl_k2", "agg": "sum", "upper": 0.2},
            {"level": "sequence", "statistic": "kl_k3", "agg": "max", "upper": 0.2},
            {"level": "token", "statistic": "kl_k1", "lower": -0.3, "upper": 0.3},
        ],
    },
    # Issue 9: the peers' statistics, OPSM's advantage condition and batch normalisation.
    "token-level/peer-statistics+opsm+batch-norm": {
        **IS,
        "is_correction_level": "token",
        "truncated_importance_sampling_type": "tis",
        "truncated_importance_sampling_ratio": 1.3,
        "is_batch_normalization": "microbatch",
        "rejection_sampling": [
            {"level": "token", "statistic": "total_variation", "upper": 0.015, "advantage_sign": "negative"},
            {
                "level": "sequence",
                "statistic": "kl_k1",
                "agg": "mean",
                "upper": -0.01,
                "log_ratio": "curr-gen",
                "advantage_sign": "negative",
            },
            {"level": "token", "statistic": "binary_kl", "upper": 0.002},
            {"level": "sequence", "statistic": "kl_k3", "agg": "max", "upper": 0.03, "log_ratio": "gen-prev"},
            {"level": "sequence", "statistic": "binary_kl", "agg": "sum", "upper": 0.001, "log_ratio": "curr-prev"},
            {"level": "sequence", "statistic": "mult_prob_error", "agg": "mean", "upper": 1.09},
            {"level": "sequence", "statistic": "total_variation", "agg": "mean", "upper": 0.0095},
        ],
    },
    # Issue 20: prime-rl's DPPO (advantage-signed, policy-gradient-only prob_diff filters and the
    # penalty toward the sampler) with a sequence prob_diff statistic reduced over the CP group.
    "token-level/dppo+sampler-kl+sequence-prob_diff": {
        **IS,
        "force_on_policy_ratio": True,
        "sampler_kl_penalty": 0.05,
        "rejection_sampling": [
            {
                "level": "token",
                "statistic": "prob_diff",
                "log_ratio": "curr-gen",
                "advantage_sign": "positive",
                "upper": 0.01,
                "applies_to": "policy_gradient",
            },
            {
                "level": "token",
                "statistic": "prob_diff",
                "log_ratio": "curr-gen",
                "advantage_sign": "negative",
                "lower": -0.01,
                "applies_to": "policy_gradient",
            },
            {"level": "sequence", "statistic": "prob_diff", "agg": "mean", "lower": -0.004, "upper": 0.004},
        ],
    },
    # VERL's decoupled denominator: the kept fraction's base is the valid tokens summed over
    # the CP group, not one rank's share (with a single rank's base the loss is off by ~cp).
    "token-level/kept-denominator": {
        **IS,
        "rejection_denominator": "kept",
        "rejection_sampling": [
            {"level": "token", "lower": 0.9, "upper": 1.1},
            {"level": "sequence", "agg": "mean", "lower": 0.97, "upper": 1.03},
        ],
    },
    "seq-level/kept-denominator": {
        **IS,
        "is_correction_level": "sequence_mean",
        "token_level_loss": False,
        "rejection_denominator": "kept",
        "rejection_sampling": [{"level": "token", "lower": 0.9, "upper": 1.1}],
    },
    "seq-level/sequence_mean+batch-norm+mult_prob_error": {
        **IS,
        "is_correction_level": "sequence_mean",
        "token_level_loss": False,
        "is_batch_normalization": "microbatch",
        "rejection_sampling": [{"level": "sequence", "statistic": "mult_prob_error", "agg": "max", "upper": 1.2}],
    },
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
    advantages = torch.randn(B, 1, generator=g).expand(B, S).contiguous()
    ref = prev + 0.2 * torch.randn(B, S, generator=g)
    prev, gen, ref = at_most_zero(prev, gen, ref)  # log-probs <= 0 (the noise put some above)
    data = {
        "input_ids": input_ids,
        "advantages": advantages,
        "prev_logprobs": prev * token_mask,
        "generation_logprobs": gen * token_mask,
        "reference_policy_logprobs": ref * token_mask,
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
        loss_fn = CorrectedPGLoss(cfg)
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
            failures.append(
                f"{name}: logprob grad@{rank} max diff {(inputs.curr.grad - want_lp).abs().max().item():.3g}"
            )
        failures += _check_masks(name, loss_fn.cfg, data, cp_group, cp, cp_rank, gvs, gvt, _aligned_curr(logits, data))
        # every rank of the group reports identical metrics
        vec = torch.tensor([v for k, v in sorted(metrics.items()) if math.isfinite(v)])
        hi, lo = vec.clone(), vec.clone()
        dist.all_reduce(hi, op=dist.ReduceOp.MAX)
        dist.all_reduce(lo, op=dist.ReduceOp.MIN)
        if not torch.equal(hi, lo):
            failures.append(f"{name}: metrics differ between ranks")
    return failures


def _correction_keep(cfg, data, groups, shard_fn, gvs, gvt, curr):
    """``curr``: ``[B, S]`` current log-probs, already aligned (position t predicts t + 1)."""
    prev, gen = (shard_fn(shift_left(data[k])) for k in ("prev_logprobs", "generation_logprobs"))
    tm = shard_fn(shift_left(data["token_mask"]).float())
    d = prev - gen
    sm = data["sample_mask"]
    finite = torch.isfinite(d).float()
    out = compute_correction(
        cfg,
        d,
        TokenMasks.build(tm, sm, finite, finite),
        groups,
        counts=GlobalCounts(tokens=torch.as_tensor(gvt), sequences=torch.as_tensor(gvs)),
        log_probs=PolicyLogProbs(curr=shard_fn(curr), prev=prev, gen=gen),
        advantages=shard_fn(shift_left(data["advantages"])),
    )
    return out.keep * tm * sm[:, None], out.is_weight


def _aligned_curr(logits, data):
    """Current log-probs ``[B, S]`` at the positions that predict each token (last is 0)."""
    lp = torch.log_softmax(logits, -1).gather(-1, shift_left(data["input_ids"]).unsqueeze(-1)).squeeze(-1)
    return torch.cat([lp[:, :-1], torch.zeros_like(lp[:, :1])], 1)


def _check_masks(name, cfg, data, cp_group, cp, cp_rank, gvs, gvt, curr):
    full_keep, full_w = _correction_keep(cfg, data, SequenceGroups(), lambda x: x, gvs, gvt, curr)
    keep, w = _correction_keep(
        cfg, data, SequenceGroups.of(cp_group), lambda x: cp_shard(x, cp, cp_rank), gvs, gvt, curr
    )
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
    cfg = RSClippedPGLossConfig.from_any(
        {"rejection_sampling": [{"level": "sequence", "agg": "sum", "lower": 0.7, "upper": 1.3}]}
    )
    S = 8
    # d = 0.1 on every token: each rank's partial sum 0.4 -> exp 1.49 > 1.3 would reject
    # locally too, so use d = 0.05: partial 0.2 (exp 1.22, inside), whole 0.4 (1.49, outside).
    d = torch.full((1, S), 0.05)
    tm = torch.ones(1, S)
    local = cp_shard(d, world_size, rank)
    tm_l = cp_shard(tm, world_size, rank)
    finite = torch.isfinite(local).float()
    masks = TokenMasks.build(tm_l, torch.ones(1), finite, finite)
    counts = GlobalCounts(tokens=tm.sum(), sequences=torch.tensor(1.0))
    out = compute_correction(cfg, local, masks, SequenceGroups.of(group), counts=counts)
    unreduced = compute_correction(cfg, local, masks, SequenceGroups(), counts=counts)
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
    loss_fn = CorrectedPGLoss({})
    cases = {
        "shard shape": (
            lambda: sharded_loss(loss_fn, logits, data, gvs, gvt, cp_group=group),
            "does not match [B, S/cp]",
        ),
        "divisibility": (
            lambda: sharded_loss(
                loss_fn,
                logits[:, :7],
                {k: v[:, :14] if v.dim() == 2 else v for k, v in data.items()},
                gvs,
                gvt,
                cp_group=group,
            ),
            "not divisible by 2 * cp",
        ),
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
    bytes, and the only all-gather is the call header's (fixed size, int64, once per group:
    ``agree_before_collectives``)."""
    from nemo_rs_plugin.core.correction import statistics as correction_mod

    group = dist.new_group(list(range(world_size)))
    calls = []
    orig_all_reduce = dist.all_reduce

    def counting_all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        calls.append((str(op), tensor.numel()))
        return orig_all_reduce(tensor, op=op, group=group, async_op=async_op)

    orig_all_gather = dist.all_gather
    header_gathers = []

    def header_gather_only(parts, tensor, group=None, async_op=False):
        if tensor.dtype != torch.int64 or tensor.dim() != 1:
            raise AssertionError(f"all_gather of {tensor.dtype} {tuple(tensor.shape)} issued")
        header_gathers.append(tensor.numel())
        return orig_all_gather(parts, tensor, group=group, async_op=async_op)

    def no_gather(*args, **kwargs):
        raise AssertionError("all_gather_into_tensor issued")

    stat_calls, total_calls = [], []
    orig_reduce = correction_mod.reduce_sequence_statistics
    orig_totals = correction_mod.reduce_batch_totals

    def spy(sums, maxima, groups):
        before = len(calls)
        out = orig_reduce(sums, maxima, groups)
        stat_calls.append(calls[before:])
        return out

    def spy_totals(totals, groups, **kwargs):
        before = len(calls)
        out = orig_totals(totals, groups, **kwargs)
        total_calls.append(calls[before:])
        return out

    saved = (dist.all_reduce, dist.all_gather, dist.all_gather_into_tensor)
    dist.all_reduce, dist.all_gather, dist.all_gather_into_tensor = counting_all_reduce, header_gather_only, no_gather
    correction_mod.reduce_sequence_statistics = spy
    correction_mod.reduce_batch_totals = spy_totals
    failures = []
    try:
        B, S, V = 5, 16, 12
        logits, data, gvs, gvt = make_data(B, S, V)
        for name in (
            "gspo/sequence_mean+geo-rs+veto+token-k3",
            "token-level/filters-sum-max-min-kl",
            "token-level/peer-statistics+opsm+batch-norm",
            "seq-level/sequence_mean+batch-norm+mult_prob_error",
        ):
            stat_calls.clear()
            total_calls.clear()
            header_gathers.clear()
            loss, _ = sharded_loss(
                CorrectedPGLoss(CONFIGS[name]),
                cp_shard(logits, world_size, rank).requires_grad_(True),
                data,
                gvs,
                gvt,
                cp_group=group,
            )
            loss.backward()
            if len(header_gathers) != 1 or header_gathers[0] > 256:
                failures.append(f"{name}: call headers gathered {header_gathers}, expected one of at most 256 numbers")
            if len(stat_calls) != 1:
                failures.append(f"{name}: statistics reduced {len(stat_calls)} times, expected once")
            elif len(stat_calls[0]) > 2 or any(n > 64 * B for _, n in stat_calls[0]):
                failures.append(f"{name}: statistic collectives {stat_calls[0]}")
            # Batch normalisation: one SUM of two numbers over CP for token totals (partial
            # sums), none for per-sequence weights (already identical on the CP ranks).
            normalized = CorrectedPGLoss(CONFIGS[name]).cfg.is_batch_normalization is not None
            token_level = CorrectedPGLoss(CONFIGS[name]).cfg.effective_is_level == "token"
            want = ([[("ReduceOp.SUM", 2)]] if token_level else [[]]) if normalized else []
            if [[(op.split(".")[-1], n) for op, n in c] for c in total_calls] != [
                [(op.split(".")[-1], n) for op, n in c] for c in want
            ]:
                failures.append(f"{name}: batch-total collectives {total_calls}, expected {want}")
    finally:
        dist.all_reduce, dist.all_gather, dist.all_gather_into_tensor = saved
        correction_mod.reduce_sequence_statistics = orig_reduce
        correction_mod.reduce_batch_totals = orig_totals
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
        sharded_loss(CorrectedPGLoss({}), cp_shard(logits, world_size, rank), data, 2.0, 0.0, cp_group=group)
    except ValueError as exc:
        if "global_valid_toks: got 0 while this microbatch has 3 valid tokens" not in str(exc):
            return [f"unclear error on rank {rank}: {exc}"]
        return []
    return [f"no error on rank {rank}"]


def check_data_parallel_batch_normalization(rank, world_size):
    """DP2 x CP2: each data-parallel rank holds half of the batch's sequences, CP splits their
    tokens. ``is_batch_normalization: data_parallel`` divides every rank's weights by the mean
    over the whole batch (the single-process run on all sequences); ``microbatch`` by the mean
    over its own half (the single-process run on that half), which differs here."""
    cp, dp = 2, world_size // 2
    cp_groups = [dist.new_group([j * cp + c for c in range(cp)]) for j in range(dp)]
    dp_groups = [dist.new_group([j * cp + c for j in range(dp)]) for c in range(cp)]
    dp_rank, cp_rank = rank // cp, rank % cp
    cp_group, dp_group = cp_groups[dp_rank], dp_groups[cp_rank]
    B, S, V = 6, 16, 12
    logits, data, gvs, gvt = make_data(B, S, V, seed=11)
    rows = slice(dp_rank * B // dp, (dp_rank + 1) * B // dp)
    local = {k: (v[rows] if isinstance(v, torch.Tensor) else v) for k, v in data.items()}
    shard = lambda x: cp_shard(x, cp, cp_rank)  # noqa: E731
    failures = []
    for level in ("token", "sequence_mean"):
        cfg = {
            **IS,
            "is_correction_level": level,
            "truncated_importance_sampling_type": "tis",
            "truncated_importance_sampling_ratio": 1.1,
            "is_batch_normalization": "data_parallel",
            "rejection_sampling": [{"level": "sequence", "statistic": "mult_prob_error", "agg": "mean", "upper": 1.09}],
        }
        loss_fn = CorrectedPGLoss(cfg)
        ref_loss, ref_metrics, _, _ = reference(loss_fn, logits, data, gvs, gvt)
        _, full_w = _correction_keep(
            loss_fn.cfg, data, SequenceGroups(), lambda x: x, gvs, gvt, _aligned_curr(logits, data)
        )
        groups = SequenceGroups.of(cp_group, data_parallel=dp_group)
        _, w = _correction_keep(loss_fn.cfg, local, groups, shard, gvs, gvt, _aligned_curr(logits[rows], local))
        want = full_w[rows] if full_w.shape[1] == 1 else shard(full_w[rows])
        if not close(w, want):
            failures.append(
                f"{level}: weights@{rank} differ from the whole batch's, max diff {(w - want).abs().max().item():.3g}"
            )
        z = shard(logits[rows]).clone().requires_grad_(True)
        loss, metrics = sharded_loss(loss_fn, z, local, gvs, gvt, cp_group=cp_group, data_parallel_group=dp_group)
        total = loss.detach().clone()
        dist.all_reduce(total, group=dp_group)  # each DP rank's loss is its share of the batch's
        if not close(total, ref_loss):
            failures.append(f"{level}: loss summed over DP {total.item()} vs {ref_loss.item()}")
        if not close(metrics["is_batch_norm_factor"], ref_metrics["is_batch_norm_factor"]):
            failures.append(
                f"{level}: factor@{rank} {metrics['is_batch_norm_factor']} vs {ref_metrics['is_batch_norm_factor']}"
            )
        per_rank = CorrectedPGLoss({**cfg, "is_batch_normalization": "microbatch"})
        _, half = sharded_loss(per_rank, z.detach(), local, gvs, gvt, cp_group=cp_group, data_parallel_group=dp_group)
        half_ref = reference(per_rank, logits[rows], local, gvs, gvt)[1]
        if not close(half["is_batch_norm_factor"], half_ref["is_batch_norm_factor"]):
            failures.append(
                f"{level}: microbatch factor@{rank} {half['is_batch_norm_factor']} vs "
                f"{half_ref['is_batch_norm_factor']}"
            )
        if close(half["is_batch_norm_factor"], ref_metrics["is_batch_norm_factor"]):
            failures.append(f"{level}: test data broken: a half has the whole batch's mean")
    return failures


def check_sharded_loss_gradient_scale(rank, world_size):
    """``sharded_loss`` returns the full loss on every rank; divided by ``cp`` (NeMo-RL's
    ``cp_normalize``) its backward gives each rank exactly the unsharded ``dL/dz`` of its shard.

    Returning the bare share instead would give ``dL/dz / cp``. The same contract is checked
    inside NeMo-RL's real Megatron loop in tests/parallel/test_real_megatron.py, which needs
    NeMo-RL; this checks it wherever gloo runs.
    """
    cp_group, cp, cp_rank = dist.group.WORLD, world_size, rank
    failures = []
    B, S, V = 5, 16, 12
    logits, data, gvs, gvt = make_data(B, S, V)
    for name in ("token-level/token-IS/tis", "gspo/sequence_mean+geo-rs+veto+token-k3", "seq-level/kept-denominator"):
        loss_fn = CorrectedPGLoss(CONFIGS[name])
        ref_loss, ref_metrics, ref_zgrad, _ = reference(loss_fn, logits, data, gvs, gvt)
        z = cp_shard(logits, cp, cp_rank).clone().requires_grad_(True)
        loss, metrics = sharded_loss(loss_fn, z, data, gvs, gvt, cp_group=cp_group)
        if not close(loss.detach(), ref_loss):
            failures.append(f"{name}: sharded_loss {loss.item()} vs the full loss {ref_loss.item()}")
        (loss / cp).backward()
        want = cp_shard(ref_zgrad, cp, cp_rank)
        scale = ref_zgrad.abs().max().item() + 1e-12
        if not close(z.grad, want, abs_=1e-6 * scale):
            ratio = (z.grad * want).sum().item() / ((want * want).sum().item() + 1e-30)
            failures.append(f"{name}: logits grad@{rank} is {ratio:.3g} x the unsharded one")
        for key, value in ref_metrics.items():
            if not close(metrics[key], value):
                failures.append(f"{name}: metric {key}@{rank} {metrics[key]} vs {value}")
    return failures
