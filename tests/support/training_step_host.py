"""NeMo-RL's training step on gloo CPU ranks, from ``Policy.train`` down to the loss and back to the driver's metrics.

Run by ``tests/nemo_rl/test_training_step.py`` through :func:`tests.support.distributed_harness.run_world`:
every rank calls :func:`run_cases` with one NeMo-RL checkout, which it puts first on
``sys.path``. For each case (a loss section and a split of the step: data-parallel size, number
of global batches, microbatch size or sequence packing) a rank:

1. builds a tiny random Hugging Face Llama (``transformers.LlamaConfig``: hidden 16, 2 layers,
   vocabulary 64; no download) from one fixed initial state;
2. builds NeMo-RL's DTensor-v2 worker (``DTensorPolicyWorkerV2Impl``) and ``lm_policy.Policy``
   without their ``__init__`` (:func:`_worker`, :func:`_policy` set the attributes ``train``
   reads, as ``__init__`` and ``nemo_rl.models.automodel.setup`` would);
3. calls NeMo-RL's own ``Policy.train``: its sharding of the global batch over the
   data-parallel ranks (``_shard_for_train`` / ``shard_by_batch_size``, sequence packing's bins
   included), the worker's ``train`` (``process_global_batch``, ``get_microbatch_iterator`` with
   its dummy microbatches, ``automodel_forward_backward`` with its division of the metrics by the
   number of global batches, ``LossPostProcessor`` with ``prepare_loss_input`` or
   ``SequencePackingLossWrapper`` over ``pack_sequences``' rows, the optimizer step per global
   batch, ``aggregate_training_statistics``), then the policy's gathering of the ranks' results;
4. runs the GRPO driver's metric aggregation, read from NeMo-RL's ``grpo.py`` (and
   ``grpo_sync.py`` where it exists) and executed as written (:func:`driver_aggregations`), and
   ``single_controller_utils.aggregate_step_metrics`` where the host has it.

What cannot run on a CPU, or needs Ray, is replaced at run time in the rank processes (nothing of
NeMo-RL is edited; the test's docstring lists the same):

* ``nemo_automodel`` (NeMo-RL pins an Automodel git commit; the newest PyPI releases, 0.6.0 and
  0.7.0, need transformers 5.12 / 5.18 where NeMo-RL pins < 5.9, and have moved names NeMo-RL
  imports, e.g. ``cp_utils``, ``create_device_mesh``): :class:`_AutomodelFinder` gives
  stand-in modules whose names only exist for NeMo-RL's imports (a stand-in class raises if it
  is ever instantiated), except three functions with their real behaviour for this path:
  ``to_local_if_dtensor``, ``cp_utils.get_train_context`` (no loss parallel, no compiled
  autograd, no context parallelism: an empty context) and
  ``training.utils.scale_grads_and_clip_grad_norm`` (no pipeline or expert parallelism: the
  L2 norm of the gradients and ``clip_grad_norm_``, which is what it computes for plain,
  non-DTensor parameters);
* the worker's ``__init__`` (Ray actor, ``setup_distributed`` on NCCL, the model loaded from
  the Hub and sharded by FSDP2): the attributes are set by :func:`_worker`; FSDP2 is replaced by
  ``torch.nn.parallel.DistributedDataParallel`` on the data-parallel gloo group (data-parallel
  size 2; no wrapping at size 1), which averages the gradients over the ranks as FSDP2's
  reduce-scatter does (the worker multiplies the loss by the data-parallel size for that
  reason); the model is float32 (NeMo-RL's master weights, ``precision: float32``), with
  ``sdpa`` attention instead of ``flash_attention_2`` under packing: transformers builds the
  block-diagonal causal mask from the packed rows' restarting ``position_ids`` (NeMo-RL passes no
  attention mask there), so each packed sequence attends only to itself; the optimizer is SGD
  (lr 0.5) with a constant scheduler, ``max_grad_norm`` 1e6 (the norm is computed and logged,
  clipping never fires: a scaled loss cannot hide behind it); the tokenizer is
  :class:`_Tokenizer` (the training path reads only the pad id of packed rows);
* ``Policy.__init__`` (a Ray cluster and worker group): the attributes ``train`` reads are set by
  :func:`_policy`, and the worker group is :class:`_LocalWorkerGroup`: each rank runs its own
  data-parallel shard on its worker, and the results are gathered over the data-parallel group
  (``all_gather_object``) in rank order, as Ray's ``get_all_worker_results`` returns them;
* ``nemo_rl.models.automodel.setup``, imported by the worker module for its ``__init__`` only,
  imports with the stand-ins above (NeMo-RL main's check that Automodel lacks
  ``NeMoAutoModelForTokenClassification`` is answered as the pinned commit answers it);
* CUDA: ``tensor.cuda()`` and ``pin_memory`` as in ``tests/support/nemo_rl_shims.py``; every
  ``device="cuda"`` (``torch.tensor(..., device="cuda")``, ``BatchedDataDict.to("cuda")``) is
  mapped to the CPU by a ``TorchFunctionMode`` (:class:`_CudaOnCpu`);
  ``torch.cuda.get_device_name`` answers ``"cpu"``; ``torch.cuda.nvtx.range_push``/``range_pop``
  (``nemo_rl.utils.nsys.wrap_with_nvtx_name`` on the worker's ``train``) do nothing;
  ``torch.autocast(device_type="cuda")`` disables itself on the CPU (its warning is filtered):
  autocast to float32 on float32 weights changes nothing on a GPU either.

Every rank writes ``OUT.rank<r>`` (``torch.save``): per case, the loss and metrics of every
microbatch (dummy ones marked), the gradient before each optimizer step, the parameters after
the step, the policy's results and the driver's logged metrics.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import importlib.abc
import importlib.machinery
import os
import sys
import time
import traceback
import types
import warnings
from typing import Any

#: Warnings raised by third-party code on this CPU path, each ignored in the ranks with its reason.
_IGNORED_WARNINGS = [
    # torch.autocast(device_type="cuda") on a CPU-only build disables itself (see the module docstring)
    ("ignore", r"CUDA is not available or torch_xla is imported\. Disabling autocast", UserWarning),
    # megatron-core's import without Apex (the CPU test env; pyproject names its Transformer Engine
    # sibling): NeMo-RL v0.6.0's nemo_rl.distributed.model_utils imports megatron.core.models.gpt
    ("ignore", r"Apex is not installed\. Falling back to Torch Norm", UserWarning),
]

_STOOD_IN: list[str] = []


def suite_warning_filters() -> None:
    """The test suite's warning policy in this process: pyproject's ``filterwarnings``, then :data:`_IGNORED_WARNINGS`.

    Every warning is an error, but for the third-party ones pyproject names (pytest's
    ``action:message:category:module`` lines, applied as pytest applies them) and the ones above.
    """
    import builtins

    import tomllib

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "pyproject.toml"), "rb") as fh:
        lines = tomllib.load(fh)["tool"]["pytest"]["ini_options"]["filterwarnings"]
    warnings.resetwarnings()
    for line in lines:
        action, message, category, module = (line.split(":", 4) + ["", "", "", ""])[:4]
        cls = getattr(builtins, category, Warning) if category else Warning
        warnings.filterwarnings(action, message=message, category=cls, module=module)
    for action, message, category in _IGNORED_WARNINGS:
        warnings.filterwarnings(action, message=message, category=category)


def _refuse(self, *args, **kwargs):
    raise RuntimeError(f"{type(self).__module__}.{type(self).__name__} is a test stand-in: not on the training path")


class _AutomodelStandIn(types.ModuleType):
    """A ``nemo_automodel`` module: every public name is an empty class that refuses instances."""

    #: Names the pinned Automodel commit does not export (NeMo-RL main's setup.py checks this one).
    ABSENT = {"nemo_automodel": {"NeMoAutoModelForTokenClassification"}}

    def __getattr__(self, name: str):
        if name.startswith("__") or name in self.ABSENT.get(self.__name__, ()):
            raise AttributeError(name)
        value = type(name, (), {"__module__": self.__name__, "__init__": _refuse})
        setattr(self, name, value)
        return value


def _to_local_if_dtensor(tensor):
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _get_train_context(enable_loss_parallel: bool, enable_compiled_autograd: bool, cp_context=None):
    if enable_loss_parallel or enable_compiled_autograd or cp_context is not None:
        raise NotImplementedError(
            "stand-in get_train_context: loss parallel, compiled autograd and CP are not on this path"
        )

    @contextlib.contextmanager
    def context():
        yield

    return context


def _scale_grads_and_clip_grad_norm(
    max_grad_norm, model_parts, *, norm_type=2.0, pp_enabled=False, moe_mesh=None, foreach=True, **_
):
    import torch

    if pp_enabled or moe_mesh is not None:
        raise NotImplementedError("stand-in scale_grads_and_clip_grad_norm: no pipeline or expert parallelism")
    if max_grad_norm is None:
        return 0.0
    parameters = [p for m in model_parts for p in m.parameters() if p.requires_grad]
    # a number: the worker wraps it in torch.tensor(grad_norm, ...), which warns on a tensor
    return float(torch.nn.utils.clip_grad_norm_(parameters, max_grad_norm, norm_type=norm_type, foreach=foreach))


def _not_on_this_path(name):
    def refuse(*args, **kwargs):
        raise RuntimeError(f"{name} is a test stand-in: not on the training path")

    return refuse


#: The functions of the training path, with their behaviour for this configuration.
_AUTOMODEL_FUNCTIONS = {
    "nemo_automodel.components.distributed.tensor_utils": {
        "to_local_if_dtensor": _to_local_if_dtensor,
        "get_cpu_state_dict": _not_on_this_path("get_cpu_state_dict"),
    },
    "nemo_automodel.components.distributed.cp_utils": {
        "get_train_context": _get_train_context,
        "create_context_parallel_ctx": _not_on_this_path("create_context_parallel_ctx"),
    },
    "nemo_automodel.components.training.utils": {"scale_grads_and_clip_grad_norm": _scale_grads_and_clip_grad_norm},
}


class _AutomodelFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """First on ``sys.meta_path``: every ``nemo_automodel`` module is a stand-in (installed or not)."""

    def find_spec(self, fullname, path, target=None):
        parent, _, name = fullname.rpartition(".")
        if name in _AutomodelStandIn.ABSENT.get(parent, ()):
            return None  # `from nemo_automodel import <absent name>` falls back to a submodule import
        if fullname == "nemo_automodel" or fullname.startswith("nemo_automodel."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _AutomodelStandIn(spec.name)
        module.__path__ = []
        for name, fn in _AUTOMODEL_FUNCTIONS.get(spec.name, {}).items():
            setattr(module, name, fn)
        _STOOD_IN.append(spec.name)
        return module

    def exec_module(self, module):
        pass


def _cuda_to_cpu(value):
    import torch

    if isinstance(value, str) and (value == "cuda" or value.startswith("cuda:")):
        return "cpu"
    if isinstance(value, torch.device) and value.type == "cuda":
        return torch.device("cpu")
    return value


def _cuda_on_cpu_mode():
    import torch
    from torch.overrides import TorchFunctionMode

    devices = (str, torch.device)

    class _CudaOnCpu(TorchFunctionMode):
        """Every ``cuda`` device argument of a torch call becomes the CPU; so does an integer
        ``device=`` (a CUDA ordinal, as ``torch.cuda.current_device()`` gives it: Megatron's).

        Every torch call of a rank passes here (some 8,000 per training step), so the common case,
        no device argument, returns at once: no new tuple or dict.
        """

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if kwargs:
                device = kwargs.get("device")
                if device is not None:
                    device = torch.device("cpu") if isinstance(device, int) else _cuda_to_cpu(device)
                    kwargs = {**kwargs, "device": device}
            else:
                kwargs = {}
            for arg in args:
                if isinstance(arg, devices):
                    args = tuple(_cuda_to_cpu(a) for a in args)
                    break
            return func(*args, **kwargs)

    return _CudaOnCpu()


def install_stand_ins(host: str) -> None:
    """The host first on ``sys.path``, NeMo-RL's CPU shims, the stand-ins above (idempotent)."""
    if getattr(install_stand_ins, "_done", False):
        return
    install_stand_ins._done = True
    if host:
        sys.path.insert(0, host)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if root not in sys.path:
        sys.path.append(root)
    from tests.support import nemo_rl_shims

    nemo_rl_shims.install()
    sys.meta_path.insert(0, _AutomodelFinder())
    import torch

    torch.cuda.get_device_name = lambda *a, **k: "cpu"
    # nemo_rl.utils.nsys.wrap_with_nvtx_name (the worker's train): NVTX ranges need a CUDA build
    torch.cuda.nvtx.range_push = lambda *a, **k: 0
    torch.cuda.nvtx.range_pop = lambda *a, **k: 0
    _cuda_on_cpu_mode().__enter__()  # for the life of the rank process


# ----------------------------------------------------------------------------- the GRPO driver


def driver_aggregations(host: str) -> dict[str, Any]:
    """The GRPO driver's metric aggregation, compiled from NeMo-RL's source: ``{where: code}``.

    In every training loop of ``nemo_rl/algorithms/grpo.py`` (and ``grpo_sync.py``): the
    ``"loss"`` and ``"grad_norm"`` entries of its ``metrics = {...}``, its
    ``metrics.update(train_results["all_mb_metrics"])`` and its ``for k, v in metrics.items():``
    loop (min/max of ``probs_ratio_*``, mean of ``lr``/``global_valid_*``, sum of the rest),
    executed in that order on ``train_results``.
    """
    out = {}
    for name in ("grpo.py", "grpo_sync.py"):
        path = os.path.join(host, "nemo_rl", "algorithms", name)
        if not os.path.exists(path):
            continue
        with open(path) as fh:
            tree = ast.parse(fh.read())
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            loops = [
                n
                for n in ast.walk(fn)
                if isinstance(n, ast.For)
                and ast.unparse(n.iter) == "metrics.items()"
                and "probs_ratio_min" in ast.unparse(n)
            ]
            if not loops:
                continue
            loop = loops[0]
            entries = [
                (k, v)
                for n in ast.walk(fn)
                if isinstance(n, ast.Dict)
                for k, v in zip(n.keys, n.values)
                if isinstance(k, ast.Constant)
                and k.value in ("loss", "grad_norm")
                and ast.unparse(v).startswith("train_results[")
                and n.lineno < loop.lineno
            ]
            update = [
                n
                for n in ast.walk(fn)
                if isinstance(n, ast.Expr)
                and ast.unparse(n) == "metrics.update(train_results['all_mb_metrics'])"
                and n.lineno < loop.lineno
            ]
            keys = sorted(k.value for k, _ in entries)
            assert keys == ["grad_norm", "loss"] and len(update) == 1, (name, fn.name, keys, len(update))
            start = ast.Assign(
                targets=[ast.Name("metrics", ast.Store())],
                value=ast.Dict(keys=[k for k, _ in entries], values=[v for _, v in entries]),
                lineno=0,
            )
            module = ast.fix_missing_locations(ast.Module(body=[start, update[0], loop], type_ignores=[]))
            out[f"{name}:{fn.name}:{loop.lineno}"] = compile(module, f"{path}:{fn.name}", "exec")
    return out


def run_driver(code, train_results) -> dict[str, float]:
    import io

    import numpy as np

    namespace = {"np": np, "train_results": train_results}
    with contextlib.redirect_stdout(io.StringIO()):  # main prints "Skipping aggregation for ..." for scalars
        exec(code, namespace)
    return {k: float(v) for k, v in namespace["metrics"].items()}


# ----------------------------------------------------------------------------- model and data


def _model():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.support.training_step_cases import VOCAB

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
        eos_token_id=0,
        bos_token_id=1,
        tie_word_embeddings=False,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)  # the initial weights: the same in every process and case
    return LlamaForCausalLM(config).to(torch.float32)


def make_data(model) -> dict:
    """The batch of :func:`training_step_cases.batch_spec` with log-probs from the initial ``model``.

    ``prev``: the model's log-probs of the sampled tokens plus noise (sd 0.12: the PPO ratio is
    clipped on some tokens); ``gen = prev - d``; ``ref = prev +`` noise (sd 0.02). Float32, as
    NeMo-RL's data. Position 0 is 0, and so is every position past the sequence's length.
    """
    import torch

    from tests.support.training_step_cases import batch_spec

    spec = batch_spec()
    ids, lengths = spec["input_ids"], spec["input_lengths"]
    B, S = ids.shape
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits.float()
    lp = torch.log_softmax(logits, -1)[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    inside = (torch.arange(S)[None, :] < lengths[:, None]).float()
    g = torch.Generator().manual_seed(99)
    prev = torch.cat([torch.zeros(B, 1), lp], 1) + 0.12 * torch.randn(B, S, generator=g)
    prev = prev.clamp_max(-1e-3) * inside
    prev[:, 0] = 0.0
    gen = (prev - spec["d"]) * inside
    ref = (prev + 0.02 * torch.randn(B, S, generator=g)).clamp_max(-1e-3) * inside
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


# ----------------------------------------------------------------------------- worker and policy


class _Tokenizer:
    """What the worker's training path reads of its tokenizer: the pad id of packed rows."""

    eos_token_id = 0
    pad_token_id = 0


def policy_config(split: dict) -> dict:
    """The ``policy`` section ``train`` reads (NeMo-RL's names and meanings)."""
    from tests.support.training_step_cases import GBS

    return {
        "model_name": "tiny-random-llama (built from a LlamaConfig)",
        "precision": "float32",
        "train_global_batch_size": GBS,
        "train_micro_batch_size": split["mbs"],
        "logprob_batch_size": split["mbs"],
        "max_grad_norm": 1e6,
        "make_sequence_length_divisible_by": 1,
        "dtensor_cfg": {
            "enabled": True,
            "_v2": True,
            "cpu_offload": False,
            "sequence_parallel": False,
            "activation_checkpointing": False,
            "tensor_parallel_size": 1,
            "context_parallel_size": 1,
            "clear_cache_every_n_steps": None,
        },
        "dynamic_batching": {"enabled": False},
        "sequence_packing": {
            "enabled": split["packing"] is not None,
            "train_mb_tokens": split["packing"] or 0,
            "logprob_mb_tokens": split["packing"] or 0,
            "algorithm": "modified_first_fit_decreasing",
        },
        "generation": None,
    }


def _worker(worker_cls, cfg: dict, model, dp_group, device_mesh):
    """``DTensorPolicyWorkerV2Impl`` with the attributes its ``__init__`` sets that ``train`` reads."""
    import torch

    worker = object.__new__(worker_cls)
    dp = torch.distributed.get_world_size(dp_group)
    worker.cfg = cfg
    worker.rank = torch.distributed.get_rank()
    worker.device_mesh = device_mesh
    worker.dp_cp_mesh = None
    worker.dp_mesh, worker.tp_mesh, worker.cp_mesh = device_mesh["dp"], device_mesh["tp"], device_mesh["cp"]
    worker.moe_mesh = None
    worker.dp_size, worker.tp_size, worker.cp_size = dp, 1, 1
    worker.model = torch.nn.parallel.DistributedDataParallel(model, process_group=dp_group) if dp > 1 else model
    worker.optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    worker.scheduler = torch.optim.lr_scheduler.LambdaLR(worker.optimizer, lambda step: 1.0)
    worker.tokenizer = _Tokenizer()
    worker.processor = None
    worker.is_vlm = False
    worker._is_reward_model = False
    worker.is_hf_model, worker.is_moe_model = True, False
    worker.allow_flash_attn_args = True
    worker.dtype = torch.float32
    worker.autocast_enabled = True  # setup_model_and_optimizer: HF models (not custom MoE) autocast
    worker.enable_seq_packing = cfg["sequence_packing"]["enabled"]
    worker.max_grad_norm = cfg["max_grad_norm"]
    worker.sampling_params = None  # no generation section: no top-k/top-p/temperature
    worker.cpu_offload = False
    worker.lora_enabled = False
    try:
        from nemo_rl.utils.timer import Timer

        worker.timer = Timer(context={"worker": "dtensor_policy_v2", "rank": worker.rank})
    except (ImportError, TypeError):  # v0.6.0's train reads no timer
        pass
    return worker


class _LocalWorkerGroup:
    """Ray's worker group for the policy's ``train``: this rank's shard on this rank's worker."""

    def __init__(self, worker, dp_group):
        import torch

        self.worker = worker
        self.dp_group = dp_group
        self.dp_rank = torch.distributed.get_rank(dp_group)
        self.calls: list[str] = []

    def run_all_workers_sharded_data(
        self, method_name, data, in_sharded_axes, replicate_on_axes, output_is_replicated, common_kwargs
    ):
        assert in_sharded_axes == ["data_parallel"], in_sharded_axes
        self.calls.append(method_name)
        return getattr(self.worker, method_name)(data=data[self.dp_rank], **common_kwargs)

    def shutdown(self, cleanup_method=None):  # Policy.__del__ -> Policy.shutdown
        return True

    def get_all_worker_results(self, local_result):
        import torch

        gathered = [None] * torch.distributed.get_world_size(self.dp_group)
        torch.distributed.all_gather_object(gathered, local_result, group=self.dp_group)
        return gathered


def _policy(policy_cls, cfg: dict, worker_group):
    """``lm_policy.Policy`` with the attributes its ``__init__`` sets that ``train`` reads."""
    import numpy as np
    import torch
    from nemo_rl.distributed.named_sharding import NamedSharding

    policy = object.__new__(policy_cls)
    dp = torch.distributed.get_world_size(worker_group.dp_group)
    policy.cfg = cfg
    policy.debug_payload_metrics = False
    policy.sharding_annotations = NamedSharding(
        layout=np.arange(dp).reshape(1, -1, 1, 1),
        names=["pipeline_parallel", "data_parallel", "context_parallel", "tensor_parallel"],
    )
    policy.worker_group = worker_group
    policy.flops_tracker = None  # FLOP accounting: no metric of the loss
    policy.use_dynamic_batches = False
    policy.use_sequence_packing = cfg["sequence_packing"]["enabled"]
    if policy.use_sequence_packing:
        policy.sequence_packing_args = {
            "algorithm": cfg["sequence_packing"]["algorithm"],
            "input_key": "input_ids",
            "input_lengths_key": "input_lengths",
            "sequence_length_pad_multiple": cfg["make_sequence_length_divisible_by"],
        }
    return policy


def _uneven_data_class(batched_cls):
    """A ``BatchedDataDict`` whose packed shards move rank 1's last bin to rank 0 in every global batch.

    NeMo-RL's packer gives every data-parallel rank the same number of bins; these shards, built
    from its own, make rank 1 run one microbatch fewer per global batch, which NeMo-RL's worker
    makes up with a dummy microbatch (``get_microbatch_iterator``: loss times 0, metrics dropped).
    """

    class UnevenPackedShards(batched_cls):
        def shard_by_batch_size(self, shards, batch_size=None, **kwargs):
            result = super().shard_by_batch_size(shards, batch_size=batch_size, **kwargs)
            if kwargs.get("sequence_packing_args") is None:
                return result
            sharded, order = result
            assert shards == 2, shards
            per_rank = []  # per rank: per global batch: list of (rows, padded length) bins
            for shard in sharded:
                gbs, start = [], 0
                for gb, count in enumerate(shard.elem_counts_per_gb):
                    rows = shard.slice(start, start + count)
                    bins = [
                        (rows.slice(a, b), length)
                        for (a, b), length in zip(shard.micro_batch_indices[gb], shard.micro_batch_lengths[gb])
                    ]
                    gbs.append(bins)
                    start += count
                per_rank.append(gbs)
            for gb in range(len(per_rank[0])):
                assert len(per_rank[1][gb]) >= 2, "rank 1 needs two bins to give one away"
                per_rank[0][gb].append(per_rank[1][gb].pop())
            out = []
            for gbs in per_rank:
                pieces, indices, lengths, counts = [], [], [], []
                for bins in gbs:
                    start, gb_indices = 0, []
                    for rows, length in bins:
                        pieces.append(rows)
                        gb_indices.append([start, start + rows.size])
                        start += rows.size
                    indices.append(gb_indices)
                    lengths.append([length for _, length in bins])
                    counts.append(start)
                shard = type(sharded[0]).from_batches(pieces)
                shard.micro_batch_indices, shard.micro_batch_lengths, shard.elem_counts_per_gb = (
                    indices,
                    lengths,
                    counts,
                )
                out.append(shard)
            return out, order

    return UnevenPackedShards


# ----------------------------------------------------------------------------- losses


def build_loss(kind: str, section: dict):
    """``plugin``: ``RSClippedPGLossFn(section)``; ``nemo_rl``: NeMo-RL's ``ClippedPGLossFn`` on its full config."""
    from nemo_rl.algorithms import loss as host_loss

    if kind.startswith("plugin"):
        from nemo_rs_plugin.nemo_rl.loss_fn import RSClippedPGLossFn

        return RSClippedPGLossFn({"name": "rs_clipped_pg", **section})
    from tests.support.packing_host import _host_defaults

    cfg_cls = host_loss.ClippedPGLossConfig
    full = {**_host_defaults(), **section}
    return host_loss.ClippedPGLossFn(cfg_cls(**full) if hasattr(cfg_cls, "model_validate") else full)


@contextlib.contextmanager
def broken_loss(rank: int, world_size: int):
    """On the last rank only, the plugin's loss scaled by 1.01 (the deliberate break the test must catch)."""
    from nemo_rs_plugin.core.loss import CorrectedPGLoss

    original = CorrectedPGLoss.__call__

    def scaled(self, *args, **kwargs):
        loss, metrics = original(self, *args, **kwargs)
        return loss * 1.01, metrics

    if rank == world_size - 1:
        CorrectedPGLoss.__call__ = scaled
    try:
        yield
    finally:
        CorrectedPGLoss.__call__ = original


# ----------------------------------------------------------------------------- one case


def _number(value) -> float:
    import torch

    return float(value.detach()) if isinstance(value, torch.Tensor) else float(value)


def _flat(tensors) -> Any:
    import torch

    return torch.cat([t.detach().reshape(-1).to(torch.float64) for t in tensors])


def run_case(ctx: dict, split: dict, kind: str, section: dict) -> dict:
    import torch

    from tests.support.training_step_cases import GBS

    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    cfg = policy_config(split)
    model = _model()
    model.load_state_dict(ctx["initial_state"])
    params = list(model.parameters())
    worker = _worker(ctx["worker_cls"], cfg, model, ctx["dp_group"], ctx["device_mesh"])
    group = _LocalWorkerGroup(worker, ctx["dp_group"])
    policy = _policy(ctx["policy_cls"], cfg, group)

    grads = []
    worker.optimizer.register_step_pre_hook(lambda opt, args, kwargs: grads.append(_flat(p.grad for p in params)))
    microbatches, loops = [], []
    module = ctx["worker_module"]
    original = module.automodel_forward_backward

    def recording(*args, **kwargs):
        results = original(*args, **kwargs)
        valid = kwargs.get("num_valid_microbatches")
        processor = kwargs.get("post_processing_fn")
        loops.append(
            {
                "microbatches": len(results),
                "valid": valid,
                "packing": bool(getattr(processor, "enable_seq_packing", False)),
                "num_global_batches": kwargs.get("num_global_batches"),
            }
        )
        for i, (loss, metrics) in enumerate(results):
            microbatches.append(
                {
                    "loss": _number(loss),
                    "metrics": {k: _number(v) for k, v in metrics.items()},
                    "dummy": valid is not None and i >= valid,
                    "global_batch": len(loops) - 1,
                }
            )
        return results

    data_cls = _uneven_data_class(ctx["data_cls"]) if split.get("uneven") else ctx["data_cls"]
    rows = split["ngb"] * GBS
    data = data_cls({k: v[:rows].clone() for k, v in ctx["data"].items()})
    loss_fn = build_loss(kind, section)
    module.automodel_forward_backward = recording
    try:
        with broken_loss(rank, world_size) if kind == "plugin_broken" else contextlib.nullcontext():
            train_results = policy.train(data, loss_fn, gbs=GBS, mbs=split["mbs"])
    finally:
        module.automodel_forward_backward = original
    drivers = {where: run_driver(code, train_results) for where, code in ctx["drivers"].items()}
    if ctx["aggregate_step_metrics"] is not None:
        drivers["aggregate_step_metrics"] = {
            k: float(v) for k, v in ctx["aggregate_step_metrics"](train_results).items() if not isinstance(v, dict)
        }
    return {
        "microbatches": microbatches,
        "loops": loops,
        "grads": grads,
        "params": _flat(params),
        "policy_loss": [float(x) for x in train_results["loss"].reshape(-1)],
        "grad_norm": _number(train_results["grad_norm"]),
        "all_mb_metrics": {k: [_number(x) for x in v] for k, v in train_results["all_mb_metrics"].items()},
        "driver": drivers,
        "worker_group_calls": group.calls,
    }


def run_cases(rank: int, world_size: int, host: str, cases: list, out_path: str) -> list[str]:
    """Rank function: every ``(case, split, kind, section)`` in this world; results to ``OUT.rank<r>``."""
    suite_warning_filters()
    install_stand_ins(host)
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    started = time.time()
    worker_module = importlib.import_module("nemo_rl.models.policy.workers.dtensor_policy_worker_v2")
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict
    from nemo_rl.models.policy import lm_policy

    try:
        from nemo_rl.algorithms.single_controller_utils.utils import aggregate_step_metrics
    except ImportError:  # v0.6.0, v0.7.0: the single controller is newer
        aggregate_step_metrics = None
    imported = time.time() - started
    model = _model()
    ctx = {
        "worker_module": worker_module,
        "worker_cls": worker_module.DTensorPolicyWorkerV2Impl,
        "policy_cls": lm_policy.Policy,
        "data_cls": BatchedDataDict,
        "initial_state": {k: v.clone() for k, v in model.state_dict().items()},
        "data": make_data(model),
        "drivers": driver_aggregations(host or os.path.dirname(os.path.dirname(sys.modules["nemo_rl"].__file__))),
        "aggregate_step_metrics": aggregate_step_metrics,
        "device_mesh": init_device_mesh("cpu", (world_size, 1, 1), mesh_dim_names=("dp", "cp", "tp")),
    }
    ctx["dp_group"] = ctx["device_mesh"]["dp"].get_group()
    out = {}
    for name, split, kind, section in cases:
        try:
            out[name] = run_case(ctx, split, kind, section)
        except Exception:
            out[name] = {"error": traceback.format_exc()[-4000:]}
        dist.barrier()
    out["_meta"] = {
        "rank": rank,
        "world_size": world_size,
        "stood_in": sorted(set(_STOOD_IN)),
        "nemo_rl_shims": __import__("tests.support.nemo_rl_shims", fromlist=["stand_ins"]).stand_ins(),
        "drivers": sorted(ctx["drivers"]),
        "import_seconds": imported,
        "seconds": time.time() - started,
    }
    torch.save(out, f"{out_path}.rank{rank}")
    return []  # the test compares the saved results
