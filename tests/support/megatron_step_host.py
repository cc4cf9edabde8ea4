"""NeMo-RL's Megatron training step on gloo CPU ranks with a real tiny megatron-core MoE ``GPTModel``.

Run by ``tests/nemo_rl/test_megatron_training_step.py`` through
:func:`tests.support.distributed_harness.run_world`: every rank calls :func:`run_cases` with one
NeMo-RL checkout, put first on ``sys.path``. For each case (a loss, a parallel layout and a split
of the step) a rank:

1. initialises megatron-core's ``parallel_state`` for the layout (TP, EP with expert-TP 1; the
   rest of the world is data parallel);
2. builds megatron-core's ``GPTModel`` from ``get_gpt_layer_local_spec(num_experts=4,
   moe_grouped_gemm=False)`` (hidden 32, 2 layers, 4 experts, top-2, the ``allgather`` token
   dispatcher, no aux loss, sequence parallel when TP > 1, float32) and loads one set of full
   weights into it, sliced for this rank (:func:`_load_full_weights`: every layout holds the
   same model), wraps it in megatron-core's ``DistributedDataParallel`` and builds megatron-core's
   own optimizer (``get_megatron_optimizer``, SGD; a constant-lr scheduler stands in for
   ``OptimizerParamScheduler``);
3. builds NeMo-RL's ``MegatronPolicyWorkerImpl`` and ``lm_policy.Policy`` without their
   ``__init__`` (the attributes ``train`` reads are set as ``__init__`` would set them) and calls
   NeMo-RL's ``Policy.train``: the global batch sharded over the data-parallel ranks (sequence
   packing's bins included), the worker's ``train`` (``process_global_batch``,
   ``get_microbatch_iterator``, ``megatron_forward_backward`` through megatron-core's
   ``forward_backward_no_pipelining`` with its ``finalize_model_grads``, ``LossPostProcessor``,
   the optimizer step per global batch, the metrics divided by the number of global batches,
   ``aggregate_training_statistics``);
4. runs the GRPO driver's aggregation of the metrics, read from NeMo-RL's ``grpo.py`` and
   executed as written (:func:`tests.support.training_step_host.driver_aggregations`).

Stand-ins (nothing of NeMo-RL or megatron-core is edited; the test's docstring lists the same):
see :data:`STAND_INS`.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import re
import sys
import time
import traceback
import types
from typing import Any

#: Every run-time stand-in of this harness, as the test's docstring lists it.
STAND_INS = (
    "tests/support/nemo_rl_shims.py and training_step_host.install_stand_ins (TypedDict, .cuda(), pin_memory, "
    "device='cuda' mapped to the CPU, nemo_automodel, empty modules for megatron.bridge/megatron.training/modelopt)",
    "names NeMo-RL imports from a newer megatron-core than PyPI's 0.16.1 (EngineState, get_async_strategy, ...): "
    "empty classes, never called on the training path (listed per run in _meta['missing_names'])",
    "torch.cuda.current_device -> the CPU device (megatron's buffers and its backward's torch.empty), "
    "integer device arguments mapped to the CPU",
    "the CUDA RNG tracker's fork: a no-op context (CPU initialisation, no dropout)",
    "an explicit causal attention mask (the local spec builds its default one on 'cuda')",
    "moe_utils.te_general_gemm: None (undefined without Transformer Engine; unused by the local spec)",
    "megatron.bridge's get_pg_collection, logical_and_across_model_parallel_group, "
    "reduce_max_stat_across_model_parallel_group: their behaviour (the model-parallel group; MIN/MAX all-reduce)",
    "the worker's mcore_state: no straggler timer; NeMo-RL main's FLOP count (Megatron-Bridge's "
    "flop_utils.num_floating_point_operations): 0; torch.cuda.synchronize: a no-op",
    "the optimizer's grad_norms_by_group (newer megatron-core's per-group norms): empty",
    "megatron.training.utils.get_ltor_masks_and_position_ids: Megatron-LM's causal mask and positions",
    "the local spec's torch LayerNorm built under sequence parallelism and marked sequence_parallel, as Apex's "
    "FusedLayerNorm is (its gradients all-reduced over TP by finalize_model_grads)",
    "DotProductAttention under packing: the block-diagonal causal mask from cu_seqlens_q_padded "
    "(the local attention refuses packed_seq_params)",
    "optimizer: megatron-core's own (get_megatron_optimizer, SGD lr 0.5, no clipping: its clip asserts CUDA "
    "tensors); scheduler: a constant lr object with get_lr/get_wd/step",
    "Ray's worker group: each rank trains its data-parallel shard; results gathered over the DP group",
)

_MISSING_NAMES: list[str] = []

#: Third-party warnings on this CPU path (megatron-core's own imports and CPU fallbacks), each ignored in the ranks.
_IGNORED_WARNINGS = [
    # gpt_layer_specs imports megatron-core's deprecated Transformer Engine alias module
    (r"The 'megatron.core.transformer.custom_layers.transformer_engine'", DeprecationWarning),
    # megatron-core 0.16.1's mappings call torch's older collective names (warned at torch's call site)
    (r"`torch\.distributed\.\w+` is deprecated", FutureWarning),
    # NeMo-RL's distributed log-softmax (the gathered path) calls torch.distributed.nn.functional
    (r"torch\.distributed\.nn\.functional\.\w+ is deprecated", FutureWarning),
    # NeMo-RL main's Policy.train reports theoretical FLOPs of unpacked steps from the GPU's name ("cpu")
    (r"Error getting theoretical flops", UserWarning),
]


def _import_filling_missing_names(module: str):
    """Import ``module``; a name a newer megatron-core has and PyPI's lacks becomes an empty class."""
    for _ in range(100):
        try:
            return importlib.import_module(module)
        except ImportError as exc:
            match = re.match(r"cannot import name '(\w+)' from '([\w.]+)'", str(exc))
            if not match or not match.group(2).startswith("megatron.core"):
                raise
            name, owner = match.groups()
            setattr(importlib.import_module(owner), name, type(name, (), {"__module__": owner}))
            _MISSING_NAMES.append(f"{owner}.{name}")
    raise ImportError(module)


def install(host: str) -> None:
    from tests.support.training_step_host import install_stand_ins

    install_stand_ins(host)
    import torch

    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda *a, **k: None  # NeMo-RL main's train synchronises before its timer
    from megatron.core.tensor_parallel import random as mrandom

    @contextlib.contextmanager
    def fork(self, name=None):
        yield

    mrandom.CudaRNGStatesTracker.fork = fork
    _local_attention_masks()
    _torch_norm_under_sequence_parallel()
    importlib.import_module("megatron.training.utils").get_ltor_masks_and_position_ids = _ltor_masks_and_position_ids
    # NeMo-RL main's train reports FLOPs (unpacked steps) through Megatron-Bridge's flop_utils: none here
    importlib.import_module("megatron.bridge.training.utils.flop_utils").num_floating_point_operations = (
        lambda cfg, batch_size=1: 0.0
    )
    try:
        from megatron.core.transformer.moe import moe_utils

        if not hasattr(moe_utils, "te_general_gemm"):
            moe_utils.te_general_gemm = None
    except ImportError:
        pass


# ----------------------------------------------------------------------------- model


VOCAB = 64
HIDDEN = 32


def _transformer_config(tp: int, ep: int):
    import torch
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=2,
        hidden_size=HIDDEN,
        ffn_hidden_size=64,
        num_attention_heads=4,
        num_moe_experts=4,
        moe_router_topk=2,
        moe_ffn_hidden_size=32,
        moe_token_dispatcher_type="allgather",
        moe_router_load_balancing_type="none",
        moe_grouped_gemm=False,
        use_cpu_initialization=True,
        add_bias_linear=False,
        tensor_model_parallel_size=tp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=1,
        sequence_parallel=tp > 1,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        calculate_per_token_loss=True,  # NeMo-RL's setup sets it
        perform_initialization=True,
        bf16=False,
        fp16=False,
    )


def _full_weight(name: str, shape) -> Any:
    """The full (unsharded) value of a parameter, from its name alone: the same in every layout."""
    import zlib

    import torch

    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    if name.endswith("layer_norm_weight") or name.endswith("norm.weight"):
        return 1.0 + 0.1 * torch.randn(shape, generator=g)
    if name.endswith("bias"):
        return 0.02 * torch.randn(shape, generator=g)
    return 0.2 * torch.randn(shape, generator=g) / (shape[-1] ** 0.5 if len(shape) > 1 else 1.0)


def _global_name(name: str, num_local_experts: int, ep_rank: int) -> str:
    match = re.search(r"local_experts\.(\d+)\.", name)
    if match is None:
        return name
    index = ep_rank * num_local_experts + int(match.group(1))
    return name[: match.start(1)] + str(index) + name[match.end(1) :]


def _load_full_weights(model, tp: int, ep: int) -> None:
    import torch
    from megatron.core import parallel_state as ps

    tp_rank = ps.get_tensor_model_parallel_rank()
    ep_rank = ps.get_expert_model_parallel_rank()
    local_experts = 4 // ep
    with torch.no_grad():
        for name, p in model.named_parameters():
            is_expert = not getattr(p, "allreduce", True)
            sharded = getattr(p, "tensor_model_parallel", False) and not is_expert  # expert-TP is 1
            shape = list(p.shape)
            if sharded:
                shape[p.partition_dim] *= tp
            full = _full_weight(_global_name(name, local_experts, ep_rank), shape)
            if sharded:
                full = full.chunk(tp, dim=p.partition_dim)[tp_rank]
            p.copy_(full)


def build_model(tp: int, ep: int, vocab: int = VOCAB):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    config = _transformer_config(tp, ep)
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False),
        vocab_size=vocab,
        max_sequence_length=64,
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
    )
    _load_full_weights(model, tp, ep)
    return model


def _local_attention_masks() -> None:
    """The local spec's ``DotProductAttention`` given an explicit mask: causal, and block-diagonal when packed.

    Unpacked, NeMo-RL passes no mask (Transformer Engine's attention is causal by its mask type) and
    the local attention would build its default causal mask on "cuda": the same mask is built on the
    CPU. Packed (``qkv_format='thd'``), the local attention refuses ``packed_seq_params``: the
    ``[t, heads, dim]`` tensors get their batch axis back and a causal mask restricted to each
    sequence's padded span of the packed row (``cu_seqlens_q_padded``, as Transformer Engine reads
    it); the output has the ``[t, 1, hidden]`` shape ``Attention`` expects of a packed call.
    """
    import torch
    from megatron.core.transformer import dot_product_attention as dpa

    original = dpa.DotProductAttention.forward
    if getattr(original, "_stand_in", False):
        return

    def forward(
        self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None
    ):
        if packed_seq_params is not None:
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
            t = query.shape[0]
            cu = packed_seq_params.cu_seqlens_q_padded
            if cu is None:
                cu = packed_seq_params.cu_seqlens_q
            segment = torch.bucketize(torch.arange(t), cu[1:].to(torch.long), right=True)
            same = segment[:, None] == segment[None, :]
            causal = torch.ones(t, t, dtype=torch.bool).tril()
            attention_mask = ~(same & causal)[None, None]
        elif attention_mask is None:
            s = query.shape[0]
            attention_mask = ~torch.ones(s, s, dtype=torch.bool).tril()[None, None]
        return original(self, query, key, value, attention_mask, attn_mask_type, attention_bias, None)

    forward._stand_in = True
    dpa.DotProductAttention.forward = forward


def _ltor_masks_and_position_ids(
    data, eod_token, pad_token, reset_position_ids, reset_attention_mask, eod_mask_loss, pad_mask_loss
):
    """Megatron-LM's ``megatron.training.utils.get_ltor_masks_and_position_ids`` for NeMo-RL's call.

    NeMo-RL calls it with every ``reset_*`` and ``*_mask_loss`` flag False and reads the causal mask
    (``True`` where a query may not attend) and the positions ``0..s-1``; Megatron-LM does not
    install on a CPU machine (``megatron.training`` is an empty stand-in module).
    """
    import torch

    assert not (reset_position_ids or reset_attention_mask or eod_mask_loss or pad_mask_loss)
    b, s = data.shape
    attention_mask = ~torch.ones(s, s, dtype=torch.bool, device=data.device).tril()[None, None]
    loss_mask = torch.ones(b, s, dtype=torch.float, device=data.device)
    position_ids = torch.arange(s, dtype=torch.long, device=data.device)[None].expand(b, s)
    return attention_mask, loss_mask, position_ids


def _torch_norm_under_sequence_parallel() -> None:
    """The local spec's torch ``LayerNorm`` under sequence parallelism, as Apex's ``FusedLayerNorm`` is.

    megatron-core's MoE layer refuses TP > 1 without sequence parallelism in training, and its torch
    norm refuses sequence parallelism (it cannot mark its weights). ``FusedLayerNorm`` (Apex, absent
    here) marks them ``sequence_parallel`` so that ``finalize_model_grads`` all-reduces their gradients
    over the TP group: the torch norm is built the same way and marked the same way.
    """
    from megatron.core.transformer import torch_norm

    original = torch_norm.WrappedTorchNorm.__new__
    if getattr(original, "_stand_in", False):
        return

    def new(cls, config, hidden_size, *args, **kwargs):
        sequence_parallel = config.sequence_parallel
        config.sequence_parallel = False
        try:
            norm = original(cls, config, hidden_size, *args, **kwargs)
        finally:
            config.sequence_parallel = sequence_parallel
        for parameter in norm.parameters():
            parameter.sequence_parallel = sequence_parallel
        return norm

    new._stand_in = True
    torch_norm.WrappedTorchNorm.__new__ = new


# ----------------------------------------------------------------------------- bridge functions


def _get_pg_collection(model):
    from megatron.core import parallel_state as ps

    return types.SimpleNamespace(mp=ps.get_model_parallel_group())


def _logical_and_across_model_parallel_group(value, mp_group=None):
    import torch

    flag = torch.tensor([1 if value else 0], dtype=torch.int)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN, group=mp_group)
    return bool(flag.item())


def _reduce_max_stat_across_model_parallel_group(stat, mp_group=None):
    import torch

    value = torch.tensor([-1.0 if stat is None else float(stat)], dtype=torch.float64)
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX, group=mp_group)
    return None if value.item() == -1.0 else float(value.item())


# ----------------------------------------------------------------------------- worker and policy


def policy_config(split: dict, tp: int, ep: int, chunk: int | None = None) -> dict:
    from tests.support.training_step_cases import GBS

    return {
        "model_name": "tiny megatron-core MoE GPTModel",
        "precision": "float32",
        "train_global_batch_size": GBS,
        "train_micro_batch_size": split["mbs"],
        "logprob_batch_size": split["mbs"],
        "max_grad_norm": 1e6,
        "make_sequence_length_divisible_by": tp,
        "max_total_sequence_length": 64,
        "logprob_chunk_size": chunk,
        "megatron_cfg": {
            "enabled": True,
            "tensor_model_parallel_size": tp,
            "expert_model_parallel_size": ep,
            "expert_tensor_parallel_size": 1,
            "pipeline_model_parallel_size": 1,
            "context_parallel_size": 1,
            "sequence_parallel": tp > 1,
            "empty_unused_memory_level": 0,
            "moe_per_layer_logging": False,
            "use_linear_ce_fusion_loss": False,
            "use_fused_linear_logprobs": False,
        },
        "dtensor_cfg": {"enabled": False},
        "dynamic_batching": {"enabled": False},
        "sequence_packing": {
            "enabled": split["packing"] is not None,
            "train_mb_tokens": split["packing"] or 0,
            "logprob_mb_tokens": split["packing"] or 0,
            "algorithm": "modified_first_fit_decreasing",
            "fuse_loss": bool(split.get("fuse_loss", False)),
        },
        "generation": None,
    }


class _Scheduler:
    """What the worker's ``train`` reads of megatron's ``OptimizerParamScheduler``: a constant lr, no decay."""

    def __init__(self, lr):
        self.lr = lr
        self.increments = []

    def get_lr(self, param_group):
        return self.lr

    def get_wd(self):
        return 0.0

    def step(self, increment):
        self.increments.append(increment)


def build_worker(worker_cls, cfg: dict, model, optimizer, lr: float):
    import torch
    from megatron.core import parallel_state as ps

    worker = object.__new__(worker_cls)
    worker.cfg = cfg
    worker.rank = torch.distributed.get_rank()
    worker.dp_size = ps.get_data_parallel_world_size()
    worker.model = model
    worker.optimizer = optimizer
    worker.scheduler = _Scheduler(lr)
    worker.mcore_state = types.SimpleNamespace(
        straggler_timer=None, cfg=types.SimpleNamespace(model=types.SimpleNamespace(seq_length=64))
    )
    worker.media_placeholder_token_id = None  # a text model (NeMo-RL main)
    # as __init__ sets them (NeMo-RL main asks the model; v0.7.0 has the first only)
    module = sys.modules[worker_cls.__module__]
    for attribute, function in (
        ("delegate_pack_to_model", "_model_self_packs_for_cp"),
        ("delegate_mtp_loss_mask_to_model", "_model_self_packs_mtp_loss_mask"),
        ("model_slices_context_parallel_inputs", "_model_slices_context_parallel_inputs"),
    ):
        setattr(worker, attribute, getattr(module, function)(model) if hasattr(module, function) else False)
    worker.sampling_params = None
    worker.draft_model = None
    worker.dtype = torch.float32
    worker.defer_fp32_logits = False
    worker.fp8_cfg = None
    worker.should_disable_forward_pre_hook = False
    worker._first_train_step_forward_pre_hook_disabled = False
    worker._router_replay_enabled = False
    worker.megatron_cfg = types.SimpleNamespace(
        optimizer=types.SimpleNamespace(reuse_grad_buf_for_mxfp8_param_ag=False),
        ddp=types.SimpleNamespace(overlap_param_gather=False),
    )
    try:
        from nemo_rl.utils.timer import Timer

        worker.timer = Timer(context={"worker": "megatron_policy", "rank": worker.rank})
    except (ImportError, TypeError):
        pass
    return worker


def build_optimizer(model, lr: float):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = OptimizerConfig(
        optimizer="sgd",
        lr=lr,
        weight_decay=0.0,
        sgd_momentum=0.0,
        bf16=False,
        fp16=False,
        params_dtype=__import__("torch").float32,
        use_distributed_optimizer=False,
        clip_grad=0.0,  # the norm is computed and logged; no clipping (megatron's clip asserts CUDA tensors)
    )
    optimizer = get_megatron_optimizer(config, [model])
    if not hasattr(optimizer, "grad_norms_by_group"):
        # NeMo-RL reads the per-group norms newer megatron-core fills during clipping (Megatron-LM
        # #4116); 0.16.1 lacks the attribute. No MTP group here: empty, as with clip_grad 0.
        optimizer.grad_norms_by_group = {}
    return optimizer


def wrap_ddp(model):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    ddp_config = DistributedDataParallelConfig(
        check_for_nan_in_grad=True,
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        overlap_param_gather=False,
        average_in_collective=False,
        use_distributed_optimizer=False,
    )
    wrapped = DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)
    model.config.finalize_model_grads_func = finalize_model_grads
    model.config.no_sync_func = wrapped.no_sync
    model.config.grad_scale_func = None
    return wrapped


# ----------------------------------------------------------------------------- one case


def _local_tensors(model, which: str) -> dict:
    """``{(global name, tp rank or None, partition dim): tensor}`` of this rank (``which``: grad or param)."""
    from megatron.core import parallel_state as ps

    tp_rank = ps.get_tensor_model_parallel_rank()
    ep = ps.get_expert_model_parallel_world_size()
    tp = ps.get_tensor_model_parallel_world_size()
    out = {}
    module = model.module if hasattr(model, "module") else model
    for name, p in module.named_parameters():
        is_expert = not getattr(p, "allreduce", True)
        sharded = getattr(p, "tensor_model_parallel", False) and not is_expert and tp > 1
        value = p.main_grad if which == "grad" else p.data
        key = (_global_name(name, 4 // ep, ps.get_expert_model_parallel_rank()), tp_rank if sharded else None)
        # numpy, not torch: all_gather_object pickles a tensor's storage through torch.save, one
        # archive per tensor (a quarter of a case's time went there); an array pickles as its bytes
        out[key] = (value.detach().to("cpu").double().numpy().copy(), p.partition_dim if sharded else None)
    return out


def full_tensors(model, which: str) -> dict:
    """Every parameter's full value (or gradient) by global name, assembled over the world's ranks."""
    import torch

    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, _local_tensors(model, which))
    pieces: dict = {}
    for local in gathered:
        for (name, tp_rank), (value, dim) in local.items():
            pieces.setdefault(name, {})[tp_rank] = (torch.from_numpy(value), dim)
    out = {}
    for name, by_rank in sorted(pieces.items()):
        if None in by_rank:
            out[name] = by_rank[None][0]
        else:
            dim = next(iter(by_rank.values()))[1]
            out[name] = torch.cat([by_rank[r][0] for r in sorted(by_rank)], dim=dim)
    return out


def run_case(ctx: dict, case: dict) -> dict:
    import torch
    from megatron.core import parallel_state as ps

    from tests.support.training_step_cases import GBS
    from tests.support.training_step_host import _LocalWorkerGroup, _number, _policy, build_loss, run_driver

    split, tp, ep = case["split"], case["tp"], case["ep"]
    if _LAYOUT != [tp, ep]:
        # Once per layout, as a training process initialises once: megatron-core's
        # destroy_model_parallel forgets its gloo groups without destroying them, so one
        # initialisation per case left some 20 groups' threads behind each time (3000 threads per
        # rank after 66 cases, which starved every other process on the machine).
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(
            tensor_model_parallel_size=tp, expert_model_parallel_size=ep, expert_tensor_parallel_size=1
        )
        _LAYOUT[:] = [tp, ep]
    lr = 0.5
    cfg = policy_config(split, tp, ep, case.get("chunk"))
    model = wrap_ddp(build_model(tp, ep, case.get("vocab", VOCAB)))
    record = case.get("record", True)  # False: no gradients or parameters gathered (the benchmark)
    optimizer = build_optimizer(model, lr)
    worker = build_worker(ctx["worker_cls"], cfg, model, optimizer, lr)
    group = _LocalWorkerGroup(worker, ps.get_data_parallel_group())
    group.cluster = types.SimpleNamespace(world_size=torch.distributed.get_world_size)  # main's FLOP report
    policy = _policy(ctx["policy_cls"], cfg, group)

    grads = []
    real_step = optimizer.step

    def step():
        if record:
            grads.append(full_tensors(model, "grad"))
        return real_step()

    optimizer.step = step
    microbatches = []
    module = ctx["worker_module"]
    original = module.megatron_forward_backward

    def recording(*args, **kwargs):
        _MICROBATCHES[0] = kwargs.get("num_microbatches", 1)
        results = original(*args, **kwargs)
        for metrics in results:
            microbatches.append({k: _number(v) for k, v in metrics.items()})
        return results

    rows = split["ngb"] * GBS
    data = ctx["data_cls"]({k: v[:rows].clone() for k, v in ctx["data"].items()})
    loss_fn = build_loss(case["kind"], case["section"])
    module.megatron_forward_backward = recording
    try:
        with case_breakage(case.get("broken")):
            train_results = policy.train(data, loss_fn, gbs=GBS, mbs=split["mbs"])
    finally:
        module.megatron_forward_backward = original
    drivers = {where: run_driver(code, train_results) for where, code in ctx["drivers"].items()}
    return {
        "microbatches": microbatches,
        "grads": grads,
        "params": full_tensors(model, "param") if record else {},
        "policy_loss": [float(x) for x in torch.as_tensor(train_results["loss"]).reshape(-1)],
        "grad_norm": _number(
            train_results["grad_norm"][0]
            if hasattr(train_results["grad_norm"], "__len__")
            else train_results["grad_norm"]
        ),
        "all_mb_metrics": {k: [_number(x) for x in v] for k, v in train_results["all_mb_metrics"].items()},
        "driver": drivers,
        "worker_group_calls": group.calls,
    }


#: The metric the "metric summed" break inflates (one NeMo-RL averages over the step's microbatches).
SUMMED_METRIC = "probs_ratio"


@contextlib.contextmanager
def case_breakage(kind):
    """Deliberate breaks the test must catch (``None``: the plugin as shipped).

    * ``scaled_loss``: the plugin's loss times 1.01 on the last rank only;
    * ``summed_metric``: the plugin's :data:`SUMMED_METRIC` multiplied by the number of microbatches
      of its global batch (a sum over microbatches where NeMo-RL's driver expects each microbatch's
      share of a mean);
    * ``unreduced_tp``: the sharded path's one TP collective (``all_gather`` of each rank's
      maximum, log-sum-exp and target logit) left out: every rank takes its own statistics for all.
    """
    import torch

    if kind is None:
        yield
        return
    restore = []
    if kind == "scaled_loss":
        from tests.support.training_step_host import broken_loss

        with broken_loss(torch.distributed.get_rank(), torch.distributed.get_world_size()):
            yield
        return
    if kind == "summed_metric":
        from nemo_rs_plugin.nemo_rl.loss_fn import RSClippedPGLossFn

        original = RSClippedPGLossFn.__call__

        def summed(self, *args, **kwargs):
            loss, metrics = original(self, *args, **kwargs)
            if SUMMED_METRIC in metrics:
                metrics = dict(metrics)
                metrics[SUMMED_METRIC] = metrics[SUMMED_METRIC] * _MICROBATCHES[0]
            return loss, metrics

        RSClippedPGLossFn.__call__ = summed
        restore.append(lambda: setattr(RSClippedPGLossFn, "__call__", original))
    elif kind == "unreduced_tp":
        from nemo_rs_plugin.parallel import vocab_parallel

        real_dist = vocab_parallel.dist

        class _Unreduced:
            def __getattr__(self, name):
                return getattr(real_dist, name)

            @staticmethod
            def all_gather(parts, local, group=None):
                for part in parts:
                    part.copy_(local)

        vocab_parallel.dist = _Unreduced()
        restore.append(lambda: setattr(vocab_parallel, "dist", real_dist))
    else:
        raise ValueError(kind)
    try:
        yield
    finally:
        for undo in restore:
            undo()


#: The number of microbatches of the global batch being trained (read by the summed_metric break).
_MICROBATCHES = [1]
#: The (TP, EP) megatron-core's parallel state is initialised for in this rank (empty: none yet).
_LAYOUT: list[int] = []


def run_cases(rank: int, world_size: int, host: str, cases: list, out_path: str) -> list[str]:
    """Rank function: every ``{name, kind, section, tp, ep, split}`` case; results to ``OUT.rank<r>``."""
    started = time.time()
    ctx, imported = make_context(host)
    out: dict = {}
    with open(f"{out_path}.rank{rank}.log", "w") as log:  # where a rank that dies (a collective abort) stopped
        _run_all(ctx, cases, out, log)
    out["_meta"] = {
        "rank": rank,
        "world_size": world_size,
        "missing_names": sorted(set(_MISSING_NAMES)),
        "nemo_rl_shims": __import__("tests.support.nemo_rl_shims", fromlist=["stand_ins"]).stand_ins(),
        "import_seconds": imported,
        "seconds": time.time() - started,
    }
    import torch

    torch.save(out, f"{out_path}.rank{rank}")
    return []


def make_context(host: str) -> tuple[dict, float]:
    """This rank's warning policy, stand-ins and NeMo-RL imports; what :func:`run_case` reads, and the import time."""
    from tests.support.training_step_host import suite_warning_filters

    suite_warning_filters()
    import warnings

    for message, category in _IGNORED_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
    # megatron-core's own warnings about its configuration and CPU fallbacks (none about the loss's inputs)
    warnings.filterwarnings("ignore", module=r"megatron\.core")
    started = time.time()
    install(host)
    import torch

    torch.set_num_threads(1)
    worker_module = _import_filling_missing_names("nemo_rl.models.policy.workers.megatron_policy_worker")
    worker_module.get_pg_collection = _get_pg_collection
    worker_module.logical_and_across_model_parallel_group = _logical_and_across_model_parallel_group
    worker_module.reduce_max_stat_across_model_parallel_group = _reduce_max_stat_across_model_parallel_group
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict
    from nemo_rl.models.policy import lm_policy

    from tests.support.training_step_host import driver_aggregations

    imported = time.time() - started
    ctx = {
        "worker_module": worker_module,
        "worker_cls": getattr(worker_module, "MegatronPolicyWorkerImpl", None)
        or getattr(worker_module, "MegatronPolicyWorker"),
        "policy_cls": lm_policy.Policy,
        "data_cls": BatchedDataDict,
        "data": make_data(),
        "drivers": driver_aggregations(host or os.path.dirname(os.path.dirname(sys.modules["nemo_rl"].__file__))),
    }
    return ctx, imported


def _run_all(ctx: dict, cases: list, out: dict, log) -> None:
    import torch.distributed as dist

    for case in cases:
        t0 = time.time()
        print(case["name"], flush=True, file=log)
        try:
            out[case["name"]] = run_case(ctx, case)
        except Exception:
            out[case["name"]] = {"error": traceback.format_exc()[-4000:]}
        out[case["name"]]["seconds"] = time.time() - t0
        dist.barrier()


def make_data() -> dict:
    """The batch of :func:`training_step_cases.batch_spec` with log-probs from the tiny model's full weights.

    Built without the model (log-probs drawn near a uniform policy over the vocabulary): the losses'
    ratios only need ``prev``, ``gen`` and ``ref`` close to the model's values, which float32 noise
    of sd 0.12 around ``-log V`` is, for a freshly initialised model with small weights.
    """
    import math

    import torch

    from tests.support.training_step_cases import batch_spec

    spec = batch_spec()
    ids, lengths = spec["input_ids"], spec["input_lengths"]
    B, S = ids.shape
    inside = (torch.arange(S)[None, :] < lengths[:, None]).float()
    g = torch.Generator().manual_seed(99)
    prev = -math.log(VOCAB) + 0.12 * torch.randn(B, S, generator=g)
    prev = prev * inside
    prev[:, 0] = 0.0
    gen = (prev - spec["d"]) * inside
    ref = (prev + 0.02 * torch.randn(B, S, generator=g)) * inside
    ref[:, 0] = 0.0
    gen[:, 0] = 0.0
    return {
        "input_ids": ids,
        "input_lengths": lengths,
        "advantages": spec["advantages"].float(),
        "prev_logprobs": prev.float(),
        "generation_logprobs": gen.float(),
        "reference_policy_logprobs": ref.float(),
        "token_mask": spec["token_mask"],
        "sample_mask": spec["sample_mask"].float(),
    }
