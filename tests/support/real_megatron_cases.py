"""Rank functions: the plugin inside NeMo-RL's real Megatron loss path, on CPU with gloo.

Run by ``tests/parallel/test_real_megatron.py`` in a world of 4 processes per NeMo-RL version. Every
component that decides a gradient's scale or a token's place is the real one:

* megatron-core: ``parallel_state.initialize_model_parallel`` (groups, on gloo),
  ``get_batch_on_this_cp_rank`` (the unpacked CP layout), ``schedules.forward_step`` (its
  ``* cp / num_microbatches`` loss scaling) and ``schedules.backward_step``;
* NeMo-RL: ``LossPostProcessor`` (``cp_normalize``, the counter-scaling, the choice of
  ``wrap_loss_fn_with_input_preparation`` or ``SequencePackingLossWrapper``), which on the
  gathered path calls ``prepare_loss_input`` -> ``from_parallel_logits_to_logprobs`` ->
  ``AllGatherCPTensor``; ``_get_pack_sequence_parameters_for_megatron`` and
  ``_pack_sequences_for_megatron`` (the packed CP layout).

One stand-in, because no transformer runs here and none is needed (the loss sees only
logits): the "model" is a module whose forward returns a parameter holding this rank's logits
shard, so ``param.grad`` is exactly the gradient the loss path sends into the logits.
"""

from __future__ import annotations

import sys
from typing import Optional

import torch

from tests.support.nemo_rl_hosts import whole_matrix

LAYOUTS = ((1, 2), (1, 4), (2, 2), (2, 1))  # (tp, cp) on 4 ranks; the rest is data parallel
#: A released checkout's cover of (layout, packed, dtype) (``nemo_rl_hosts.whole_matrix``): every
#: layout once, packed and unpacked twice each, float32 and bfloat16 twice each, every pairing of
#: packing and dtype once; the newest checkout runs all 16.
RELEASE_COVER = {
    ((1, 2), True, torch.float32),
    ((1, 4), False, torch.float32),
    ((2, 2), True, torch.bfloat16),
    ((2, 1), False, torch.bfloat16),
}
B, S, V = 5, 16, 12
NUM_MICROBATCHES = 2  # NeMo-RL's "* nmb / cp" must cancel megatron-core's "* cp / nmb"

IS = {"use_importance_sampling_correction": True}
CONFIGS = {
    "token-loss/token-IS/tis/kl": {
        **IS,
        "truncated_importance_sampling_type": "tis",
        "truncated_importance_sampling_ratio": 2.0,
        "reference_policy_kl_penalty": 0.05,
    },
    "seq-loss/gspo/sequence_mean/geo-rs+veto+token-k3": {
        **IS,
        "sequence_level_importance_ratios": True,
        "token_level_loss": False,
        "is_correction_level": "sequence_mean",
        "rejection_sampling": [
            {"level": "sequence", "agg": "mean", "lower": 0.9, "upper": 1.1},
            {"level": "sequence", "agg": "any", "lower": 1e-2, "upper": 1e2},
            {"level": "token", "statistic": "kl_k3", "upper": 0.5},
        ],
    },
    "token-loss/sequence-IS/icepop/filters-kept-denominator": {
        **IS,
        "is_correction_level": "sequence",
        "truncated_importance_sampling_type": "icepop",
        "truncated_importance_sampling_ratio": 5.0,
        "truncated_importance_sampling_ratio_min": 0.2,
        "rejection_denominator": "kept",
        "reference_policy_kl_penalty": 0.02,
        "reference_policy_kl_type": "k2",
        "rejection_sampling": [
            {"level": "token", "lower": 0.2, "upper": 5.0},
            {"level": "sequence", "agg": "max", "upper": 20.0},
            {"level": "sequence", "statistic": "kl_k1", "agg": "sum", "lower": -3.0, "upper": 3.0},
        ],
    },
    # Totals that need every sequence's current policy: under the per-sequence packing wrapper with
    # logits as input these were refused until its calls were gathered (nemo_rl/packing.py).
    "token-loss/token-IS/on-policy-batch-norm/curr-gen-filter-kept": {
        **IS,
        "truncated_importance_sampling_type": "tis",
        "truncated_importance_sampling_ratio": 2.0,
        "is_batch_normalization": "microbatch",
        "force_on_policy_ratio": True,
        "rejection_denominator": "kept",
        "rejection_sampling": [
            {"level": "sequence", "statistic": "kl_k1", "agg": "mean", "upper": 0.05, "log_ratio": "curr-gen"}
        ],
    },
}


def make_batch(seed: int = 5):
    """Full logits ``[B, S, V]`` and NeMo-RL's ``[B, S]`` data dict, identical on every rank.

    Ragged lengths, a row with an empty response, a row with ``sample_mask = 0`` and outlier
    tokens (``|prev - gen|`` of 4 nats) that the veto and the token filter reject.
    """
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, S, V, generator=g)
    input_ids = torch.randint(0, V, (B, S), generator=g)
    lengths = torch.tensor([16, 11, 7, 3, 13])  # row 3: prompt only (empty response)
    prompt = 2
    token_mask = torch.zeros(B, S, dtype=torch.long)
    for i, n in enumerate(lengths.tolist()):
        token_mask[i, prompt:n] = 1
    token_mask[3] = 0
    sample_mask = torch.ones(B)
    sample_mask[2] = 0  # fully masked sample
    lp = torch.log_softmax(logits, -1)[:, :-1].gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    prev = torch.cat([torch.zeros(B, 1), lp], 1) + 0.05 * torch.randn(B, S, generator=g)
    gen = prev + 0.1 * torch.randn(B, S, generator=g)
    gen[0, 5] -= 4.0  # outlier tokens
    gen[4, 9] += 4.0
    data = {
        "input_ids": input_ids,
        "input_lengths": lengths,
        "advantages": torch.randn(B, 1, generator=g).expand(B, S).contiguous(),
        "prev_logprobs": prev * token_mask,
        "generation_logprobs": gen * token_mask,
        "reference_policy_logprobs": (prev + 0.2 * torch.randn(B, S, generator=g)) * token_mask,
        "token_mask": token_mask,
        "sample_mask": sample_mask,
    }
    valid = token_mask[:, 1:].float() * sample_mask[:, None]
    return logits, data, sample_mask.sum(), valid.sum()


def _host_modules(host: str):
    if host:
        sys.path.insert(0, host)
    from tests.support import nemo_rl_shims

    nemo_rl_shims.install()
    import warnings

    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state
    from megatron.core.enums import ModelType
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.utils import get_batch_on_this_cp_rank
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict
    from nemo_rl.models.megatron import data as megatron_data
    from nemo_rl.models.megatron.train import LossPostProcessor

    return {
        "ps": parallel_state,
        "ModelType": ModelType,
        "ModelParallelConfig": ModelParallelConfig,
        "schedules": schedules,
        "cp_layout": get_batch_on_this_cp_rank,
        "BatchedDataDict": BatchedDataDict,
        "megatron_data": megatron_data,
        "LossPostProcessor": LossPostProcessor,
        "stand_ins": nemo_rl_shims.stand_ins,
    }


class _LogitsModel(torch.nn.Module):
    """The stand-in model: its output is a leaf holding this rank's logits shard."""

    def __init__(self, shard: torch.Tensor, config, model_type):
        super().__init__()
        self.shard = torch.nn.Parameter(shard.clone())
        self.config = config
        self.model_type = model_type

    def set_input_tensor(self, tensor):  # megatron-core's forward_step calls it
        pass

    def forward(self):
        return self.shard * 1  # a non-leaf output, as a real model's


def _local_logits(m, logits, data, tp, cp, packed):
    """This rank's logits shard in NeMo-RL's layout, and the packing parameters if packed."""
    ps = m["ps"]
    tp_rank = ps.get_tensor_model_parallel_rank()
    v_local = V // tp
    if not packed:
        local = m["cp_layout"]({"logits": logits})["logits"]
        return local[..., tp_rank * v_local : (tp_rank + 1) * v_local].contiguous(), None
    # Pack the (row, position) index of each token the way NeMo-RL packs input_ids, then read
    # the logits off it: local position j holds the logits of token ids[j] - 1 (0: padding).
    megatron_cfg = {
        "tensor_model_parallel_size": tp,
        "sequence_parallel": False,
        "pipeline_model_parallel_size": 1,
        "context_parallel_size": cp,
    }
    pad_each, pad_packed, pad_to = m["megatron_data"]._get_pack_sequence_parameters_for_megatron(
        megatron_cfg, 2 * cp * tp, S
    )
    ids = torch.arange(1, B * S + 1).reshape(B, S)
    _, local_ids, packed_seq_params, _, _ = m["megatron_data"]._pack_sequences_for_megatron(
        ids, data["input_lengths"], pad_each, pad_packed, pad_to, cp_rank=ps.get_context_parallel_rank(), cp_size=cp
    )
    rows = torch.cat([logits.reshape(B * S, V), torch.zeros(1, V)])  # last row: padding logits
    index = torch.where(local_ids[0] > 0, local_ids[0] - 1, B * S)
    local = rows[index].unsqueeze(0)
    return local[..., tp_rank * v_local : (tp_rank + 1) * v_local].contiguous(), packed_seq_params


def _train_step(m, loss_fn, shard, data, gvs, gvt, packed_seq_params, cp, sampling_params=None, chunk_size=None):
    """One microbatch through megatron-core's forward_step/backward_step with NeMo-RL's
    LossPostProcessor (``chunk_size``: its ``policy.logprob_chunk_size``); returns (logits
    gradient, reported metrics, scaled loss tensor)."""
    config = m["ModelParallelConfig"](
        tensor_model_parallel_size=m["ps"].get_tensor_model_parallel_world_size(), context_parallel_size=cp
    )
    model = _LogitsModel(shard, config, m["ModelType"].encoder_or_decoder)
    post = m["LossPostProcessor"](
        loss_fn=loss_fn,
        cfg={"sequence_packing": {"enabled": packed_seq_params is not None}, "logprob_chunk_size": chunk_size},
        num_microbatches=NUM_MICROBATCHES,
        sampling_params=sampling_params,
    )
    batch = m["BatchedDataDict"]({k: v.clone() for k, v in data.items()})

    def forward_step_func(data_iterator, model):
        next(data_iterator)
        return model(), post(batch, packed_seq_params, gvs, gvt)

    store = []
    output, _ = m["schedules"].forward_step(
        forward_step_func=forward_step_func,
        data_iterator=iter([None]),
        model=model,
        num_microbatches=NUM_MICROBATCHES,
        input_tensor=None,
        forward_data_store=store,
        config=config,
        cp_group_size=cp,
    )
    m["schedules"].backward_step(None, output, None, model.model_type, config)
    return model.shard.grad.detach().clone(), store[0], output.detach()


def _close(a: torch.Tensor, b: torch.Tensor, rel: float) -> tuple[bool, float]:
    scale = float(b.abs().max()) + 1e-12
    diff = float((a.float() - b.float()).abs().max())
    return diff <= rel * scale, diff / scale


def _host_passes_chunk_size() -> bool:
    """Whether this NeMo-RL's training-time ``prepare_loss_input`` takes ``policy.logprob_chunk_size`` (v0.7.0 on)."""
    import inspect

    from nemo_rl.algorithms.loss.utils import prepare_loss_input

    return "chunk_size" in inspect.signature(prepare_loss_input).parameters


def check_sharded_equals_gathered(rank, world_size, host):
    """For every layout, packing, logits dtype and config: the sharded path's logits
    gradients, reported metrics and loss value equal NeMo-RL's gathered path's.

    fp32 runs set ``policy.logprob_chunk_size: 3`` (several chunks on every layout): from v0.7.0
    on NeMo-RL's gathered path then takes its ``ChunkedDistributedLogprob`` and the plugin must
    read the same chunk size from NeMo-RL's ``prepare_fn`` (recorded below); bf16 runs leave it
    unset (NeMo-RL's ``DistributedLogprob``, the plugin's default chunk)."""
    m = _host_modules(host)
    from nemo_rs_plugin.nemo_rl.loss_fn import RSClippedPGLossFn
    from nemo_rs_plugin.parallel import sharded

    chunk_sizes_used = []
    real_target_logprobs = sharded.target_logprobs_and_nonfinite_rows

    def recording(logits, target, tp_group, chunk_size):
        chunk_sizes_used.append(chunk_size)
        return real_target_logprobs(logits, target, tp_group, chunk_size)

    sharded.target_logprobs_and_nonfinite_rows = recording
    try:
        return _sharded_equals_gathered(rank, m, RSClippedPGLossFn, chunk_sizes_used, whole_matrix(host))
    finally:
        sharded.target_logprobs_and_nonfinite_rows = real_target_logprobs


def runs(every: bool) -> list[tuple[tuple[int, int], bool, torch.dtype]]:
    """The (layout, packed, logits dtype) runs of one world: all of them, or :data:`RELEASE_COVER`."""
    out = [
        (layout, packed, dtype)
        for layout in LAYOUTS
        for packed in (False, True)
        for dtype in (torch.float32, torch.bfloat16)
    ]
    return out if every else [r for r in out if r in RELEASE_COVER]


def _sharded_equals_gathered(rank, m, RSClippedPGLossFn, chunk_sizes_used, every):
    logits_full, data, gvs, gvt = make_batch()
    failures, ratios = [], {}
    chosen = runs(every)
    layout = None
    for (tp, cp), packed, dtype in chosen:
        if layout != (tp, cp):  # once per layout: megatron-core's destroy forgets its gloo groups unfreed
            layout = (tp, cp)
            m["ps"].destroy_model_parallel()
            m["ps"].initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)
        shard, packed_seq_params = _local_logits(m, logits_full.to(dtype), data, tp, cp, packed)
        # bf16 gradients are rounded to 8 bits of mantissa; fp32 ones must agree to 1e-5.
        rel = 1e-5 if dtype == torch.float32 else 1e-2
        chunk_size = 3 if dtype == torch.float32 else None
        for name, cfg in CONFIGS.items():
            label = f"tp{tp}cp{cp}/{'packed' if packed else 'unpacked'}/{str(dtype)[6:]}/{name}"
            out = {}
            for path, sharded in (("gathered", False), ("sharded", True)):
                loss_fn = RSClippedPGLossFn(dict(cfg, name="rs_clipped_pg", sharded_logits_input=sharded))
                chunk_sizes_used.clear()
                out[path] = _train_step(m, loss_fn, shard, data, gvs, gvt, packed_seq_params, cp, chunk_size=chunk_size)
            want_chunks = chunk_size if _host_passes_chunk_size() else None
            if not chunk_sizes_used or set(chunk_sizes_used) != {want_chunks}:
                failures.append(f"{label}: chunk sizes used {chunk_sizes_used}, expected {want_chunks}")
            (g_grad, g_metrics, g_out), (s_grad, s_metrics, s_out) = out["gathered"], out["sharded"]
            ok, err = _close(s_grad, g_grad, rel)
            ratios[label] = float(s_grad.float().norm() / g_grad.float().norm().clamp_min(1e-30))
            if not ok:
                failures.append(f"{label}: logits grad rel err {err:.3g}, |sharded|/|gathered| = {ratios[label]:.4f}")
            if not torch.allclose(s_out.float(), g_out.float(), rtol=1e-5, atol=1e-6):
                failures.append(f"{label}: scaled loss {float(s_out)} vs {float(g_out)}")
            for key, value in g_metrics.items():
                got = s_metrics.get(key)
                if got is None or not (got == value or abs(got - value) <= 1e-6 + 1e-5 * abs(value)):
                    failures.append(f"{label}: metric {key} {got} vs {value}")
    if rank == 0 and not failures:
        print(f"[rank 0] stand-in modules: {m['stand_ins']()}", flush=True)
    return failures


def check_real_megatron(rank, world_size, host):
    """Every check in one world (a world's start-up, mostly imports, is the costly part)."""
    return (
        check_gathered_path_gives_full_gradient(rank, world_size, host)
        + check_sharded_refuses_training_time_filtering(rank, world_size, host)
        + check_sharded_refuses_a_chunk_size_that_cannot_work(rank, world_size, host)
        + check_sharded_equals_gathered(rank, world_size, host)
    )


def check_sharded_refuses_a_chunk_size_that_cannot_work(rank, world_size, host):
    """``policy.logprob_chunk_size: 0`` reaches the loss through NeMo-RL's ``prepare_fn`` (v0.7.0 on):
    refused by name, packed and unpacked, before any log-prob is computed."""
    m = _host_modules(host)
    if not _host_passes_chunk_size():
        return []
    logits_full, data, gvs, gvt = make_batch()
    cfg = dict(CONFIGS["token-loss/token-IS/tis/kl"], name="rs_clipped_pg", sharded_logits_input=True)
    failures = []
    m["ps"].destroy_model_parallel()
    m["ps"].initialize_model_parallel(tensor_model_parallel_size=2, context_parallel_size=2)
    for packed in (False, True):
        shard, packed_seq_params = _local_logits(m, logits_full, data, 2, 2, packed)
        refusal = _refusal(m, cfg, shard, data, gvs, gvt, packed_seq_params, 2, chunk_size=0)
        if refusal is None:
            failures.append(f"packed={packed}: logprob_chunk_size 0 was not refused")
        elif "policy.logprob_chunk_size: got 0" not in refusal:
            failures.append(f"packed={packed}: unclear error {refusal}")
    return failures


def _refusal(m, cfg, shard, data, gvs, gvt, packed_seq_params, cp, **step) -> Optional[str]:
    """The ConfigError the plugin's sharded loss raises in one real train step (``None``: it trained)."""
    from nemo_rs_plugin.core.settings.config import ConfigError
    from nemo_rs_plugin.nemo_rl.loss_fn import RSClippedPGLossFn

    try:
        _train_step(m, RSClippedPGLossFn(cfg), shard, data, gvs, gvt, packed_seq_params, cp, **step)
    except ConfigError as exc:
        return str(exc)
    return None


def check_sharded_refuses_training_time_filtering(rank, world_size, host):
    """NeMo-RL filters log-probs (top-k/top-p) only for LOGPROB-input losses: the sharded path
    must refuse to train when the Megatron worker's LossPostProcessor carries such settings,
    and run when it carries none (temperature alone is applied to the logits upstream)."""
    m = _host_modules(host)
    from nemo_rl.algorithms.logits_sampling_utils import TrainingSamplingParams

    logits_full, data, gvs, gvt = make_batch()
    cfg = dict(CONFIGS["token-loss/token-IS/tis/kl"], name="rs_clipped_pg", sharded_logits_input=True)
    failures = []
    m["ps"].destroy_model_parallel()
    m["ps"].initialize_model_parallel(tensor_model_parallel_size=1, context_parallel_size=2)
    for packed in (False, True):
        shard, packed_seq_params = _local_logits(m, logits_full, data, 1, 2, packed)
        for params, should_refuse in (
            (TrainingSamplingParams(top_k=8), True),
            (TrainingSamplingParams(top_p=0.9), True),
            (TrainingSamplingParams(temperature=0.7), False),
        ):
            refusal = _refusal(m, cfg, shard, data, gvs, gvt, packed_seq_params, 2, sampling_params=params)
            refused = refusal is not None and "sharded_logits_input" in refusal
            if refused != should_refuse:
                failures.append(f"packed={packed} {params}: refused={refused}, expected {should_refuse}")
    return failures


def check_gathered_path_gives_full_gradient(rank, world_size, host):
    """The measurement behind the fix: under NeMo-RL's real post-processing the gathered
    path sends rank r exactly ``dL/dz_r`` (not ``/ cp``), the single-process gradient."""
    m = _host_modules(host)
    from nemo_rs_plugin import CorrectedPGLoss
    from nemo_rs_plugin.nemo_rl.loss_fn import RSClippedPGLossFn

    logits_full, data, gvs, gvt = make_batch()
    cfg = CONFIGS["seq-loss/gspo/sequence_mean/geo-rs+veto+token-k3"]
    z = logits_full.clone().requires_grad_(True)
    lp = torch.log_softmax(z, -1)[:, :-1].gather(-1, data["input_ids"][:, 1:].unsqueeze(-1)).squeeze(-1)
    loss, _ = CorrectedPGLoss(cfg)(lp, data, gvs, gvt)
    loss.backward()
    failures = []
    for tp, cp in ((1, 4), (2, 2)):
        m["ps"].destroy_model_parallel()
        m["ps"].initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)
        shard, _ = _local_logits(m, logits_full, data, tp, cp, packed=False)
        want, _ = _local_logits(m, z.grad, data, tp, cp, packed=False)
        grad, _, _ = _train_step(m, RSClippedPGLossFn(dict(cfg, name="rs_clipped_pg")), shard, data, gvs, gvt, None, cp)
        ok, err = _close(grad, want, 1e-5)
        if not ok:
            failures.append(
                f"tp{tp}cp{cp}: gathered-path gradient is not dL/dz_r (rel err {err:.3g}, "
                f"ratio {float(grad.norm() / want.norm()):.4f})"
            )
    return failures
