"""Scripts run in a fresh interpreter by the activation tests (``python host_scripts.py NAME``).

Each prints one JSON line. The interpreter gets NeMo-RL (real or one of tests/fake_hosts) on
PYTHONPATH and the plugin from its own installation, so the .pth start-up hook is exercised
exactly as a user's ``python examples/run_grpo.py`` would.
"""

import json
import os
import pickle
import sys


def startup():
    names = [type(f).__name__ for f in sys.meta_path]
    return {
        "finder": "_Finder" in names,
        "torch": "torch" in sys.modules,
        "pydantic": "pydantic" in sys.modules,
        "nemo_rs_plugin": "nemo_rs_plugin" in sys.modules,
    }


def _attempt(fn):
    try:
        fn()
        return "no error"
    except Exception as exc:  # noqa: BLE001 - the message is what is tested
        return f"{type(exc).__name__}: {exc}"


def disabled_guard():
    """NEMO_RS_PLUGIN_DISABLE=1: nothing of the plugin loads, and a plugin-named recipe is refused."""
    from nemo_rl.algorithms import grpo
    from nemo_rl.algorithms.loss import ClippedPGLossConfig
    from nemo_rl.utils import config as host_config

    out = {"selector": type(grpo.ClippedPGLossFn).__name__}
    for recipe in sys.argv[2:]:
        out[os.path.basename(recipe)] = _attempt(lambda: host_config.load_config(recipe))
    for label, cfg in {
        "build_named": {"name": "rs_clipped_pg"},
        "build_host_named": {"name": "clipped_pg"},
        "build_unnamed": {},
    }.items():
        out[label] = _attempt(lambda: grpo.build_loss(ClippedPGLossConfig(**cfg)))
    out["plugin_imported"] = sorted(m for m in sys.modules if m.startswith("nemo_rs_plugin"))
    return out


def elsewhere():
    """A NeMo-RL whose GRPO builds the loss without the name ClippedPGLossFn."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from nemo_rl.algorithms import grpo
    from nemo_rl.algorithms.loss import ClippedPGLossConfig
    from nemo_rl.utils import config as host_config

    out = {"warnings": [str(w.message) for w in caught if "nemo-rs-plugin" in str(w.message)]}
    for recipe in sys.argv[2:]:
        out[os.path.basename(recipe)] = _attempt(lambda: host_config.load_config(recipe))
    for label, cfg in {
        "build_named": {"name": "rs_clipped_pg"},
        "build_host_named": {"name": "clipped_pg"},
        "build_host_with_plugin_field": {"is_correction_level": "sequence_mean"},
        "build_unnamed": {},
    }.items():
        out[label] = _attempt(lambda: grpo.build_loss(ClippedPGLossConfig(**cfg)))
    return out


def guard_with_adapter_first():
    """The adapter imported before NeMo-RL's loss (a worker unpickling, user code): still guarded."""
    import importlib

    importlib.import_module("nemo_rs_plugin.nemo_rl.loss_fn")  # first
    from nemo_rl.algorithms import loss

    return {"guarded": getattr(loss.ClippedPGLossFn.__init__, "_nemo_rs_guard", False)}


def worker_path():
    """expose_to_workers on GRPO import: warnings, the link, PYTHONPATH, dangling links pruned."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from nemo_rl.algorithms import grpo  # noqa: F401
    from nemo_rs_plugin.nemo_rl import workers

    base = workers.worker_path_base()
    return {
        "warnings": [str(w.message) for w in caught if "nemo-rs-plugin" in str(w.message)],
        "pythonpath": os.environ.get("PYTHONPATH", "").split(os.pathsep),
        "entries": sorted(os.listdir(base)) if os.path.isdir(base) else None,
    }


def _batch():
    import torch

    g = torch.Generator().manual_seed(0)
    B, S = 3, 9
    prev = -torch.rand(B, S, generator=g)
    advantages = torch.randn(B, S, generator=g)
    gen = prev + 0.05 * torch.randn(B, S, generator=g)
    ref = prev + 0.1
    lp = prev[:, 1:] + 0.02 * torch.randn(B, S - 1, generator=g)
    # Log-probs <= 0 (the noise puts some above, an InputWarning): every input of a token moved
    # down by the same amount, so the log-ratios between them stay as drawn.
    curr = torch.cat([prev[:, :1], lp], 1)
    shift = torch.stack([curr, prev, gen, ref]).amax(0).clamp_min(0)
    prev, gen, ref, lp = prev - shift, gen - shift, ref - shift, (curr - shift)[:, 1:]
    data = {
        "input_ids": torch.zeros(B, S, dtype=torch.long),
        "advantages": advantages,
        "prev_logprobs": prev,
        "generation_logprobs": gen,
        "reference_policy_logprobs": ref,
        "token_mask": torch.ones(B, S, dtype=torch.long),
        "sample_mask": torch.ones(B),
    }
    return lp, data, torch.tensor(3.0), torch.tensor(float(B * (S - 1)))


PLUGIN_CFG = {
    "name": "rs_clipped_pg",
    "use_importance_sampling_correction": True,
    "is_correction_level": "sequence_mean",
    "rejection_sampling": [{"level": "sequence", "agg": "mean", "lower": 0.5, "upper": 2.0}],
}


def select():
    from nemo_rl.algorithms import grpo
    from nemo_rl.algorithms.loss import ClippedPGLossConfig

    original = grpo.ClippedPGLossFn
    plugin = grpo.build_loss(ClippedPGLossConfig(**PLUGIN_CFG), use_fused_linear_logprobs=True)
    own = grpo.build_loss(ClippedPGLossConfig())
    restored = pickle.loads(pickle.dumps(plugin))
    lp, data, gvs, gvt = _batch()
    loss, metrics = plugin(lp, data, gvs, gvt)
    loss2, _ = restored(lp, data, gvs, gvt)
    from nemo_rs_plugin import CorrectedPGLoss

    core_loss, _ = CorrectedPGLoss({k: v for k, v in PLUGIN_CFG.items() if k != "name"})(lp, data, gvs, gvt)
    return {
        "selector": type(original).__name__,
        "plugin_type": type(plugin).__name__,
        "plugin_is_host_instance": isinstance(plugin, original),
        "own_type_module": type(own).__module__,
        "own_is_host_class": type(own) is getattr(original, "original", original),
        "level": plugin.rs_config.is_correction_level,
        "fused": plugin.use_fused_linear_logprobs,
        "input_type": str(plugin.input_type),
        "normalizer": str(plugin.metric_normalizations.get("rs/sequence_ratio_mean/seq_rejected_frac")),
        "loss_equal_core": float(loss) == float(core_loss),
        "pickle_equal": float(loss) == float(loss2),
        "n_metrics": len(metrics),
    }


def errors():
    from nemo_rl.algorithms import grpo
    from nemo_rl.algorithms.loss import ClippedPGLossConfig

    out = {}
    for label, cfg in {
        "unknown_name": {"name": "rs_clipped"},
        "plugin_field_without_name": {"is_correction_level": "sequence_mean"},
        "misspelled_without_name": {"is_corection_level": "sequence_mean"},
        "misspelled_with_name": {"name": "rs_clipped_pg", "rejection_sampling_": []},
        "plugin_field_with_host_name": {"name": "clipped_pg", "is_correction_level": "sequence_mean"},
        "host_name_alone": {"name": "clipped_pg"},
    }.items():
        try:
            grpo.build_loss(ClippedPGLossConfig(**cfg))
            out[label] = "no error"
        except Exception as exc:  # noqa: BLE001 - the message is what is tested
            out[label] = f"{type(exc).__name__}: {exc}"
    return out


def unsupported():
    try:
        from nemo_rs_plugin.nemo_rl.loss_fn import RSClippedPGLossFn

        RSClippedPGLossFn({"name": "rs_clipped_pg"})
        return {"error": "no error"}
    except Exception as exc:  # noqa: BLE001
        return {"error": f"{type(exc).__name__}: {exc}"}


def shorthand():
    from nemo_rl.utils import config as host_config

    out = {}
    for recipe in sys.argv[2:]:
        try:
            cfg = host_config.load_config(recipe)
            out[os.path.basename(recipe)] = {"loss_fn": dict(cfg["loss_fn"])}
        except Exception as exc:  # noqa: BLE001
            out[os.path.basename(recipe)] = {"error": f"{type(exc).__name__}: {exc}"}
    return out


def _real_host_shims():
    """Python 3.11 / CPU shims for a real NeMo-RL checkout (tests/support/nemo_rl_shims.py; harmless
    for the fake hosts). Appended to sys.path: the plugin still comes from its installation."""
    sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from tests.support import nemo_rl_shims

    nemo_rl_shims.install()
    sys.path.pop()


def driver_pickle():
    """The driver side of the Ray-worker test: build, pickle, report the env a worker gets."""
    _real_host_shims()
    from nemo_rl.algorithms import grpo
    from nemo_rl.algorithms.loss import ClippedPGLossConfig

    # The name GRPO's setup calls, with a config the way GRPO passes it.
    loss_fn = grpo.ClippedPGLossFn(ClippedPGLossConfig(**PLUGIN_CFG))
    with open(sys.argv[2], "wb") as fh:
        pickle.dump(loss_fn, fh)
    lp, data, gvs, gvt = _batch()
    loss, _ = loss_fn(lp, data, gvs, gvt)
    # NeMo-RL hands the driver's environment to its workers (init_ray: env_vars=os.environ).
    return {"loss": float(loss), "worker_env": dict(os.environ)}


def worker_unpickle():
    spec_before = "nemo_rs_plugin" in sys.modules
    _real_host_shims()
    with open(sys.argv[2], "rb") as fh:
        loss_fn = pickle.load(fh)
    lp, data, gvs, gvt = _batch()
    loss, _ = loss_fn(lp, data, gvs, gvt)
    import nemo_rs_plugin

    return {
        "loss": float(loss),
        "preloaded": spec_before,
        "plugin_from": os.path.abspath(nemo_rs_plugin.__file__),
        "type": type(loss_fn).__name__,
    }


def sharded_adapter():
    """sharded_logits_input: LOGIT input, single rank and with megatron groups forwarded."""
    import torch

    from nemo_rs_plugin import CorrectedPGLoss
    from nemo_rs_plugin.nemo_rl.loss_fn import RSClippedPGLossFn
    from nemo_rs_plugin.parallel import sharded

    cfg = {k: v for k, v in PLUGIN_CFG.items() if k != "name"}
    loss_fn = RSClippedPGLossFn({**cfg, "sharded_logits_input": True})
    g = torch.Generator().manual_seed(1)
    B, S, V = 3, 8, 11
    logits = torch.randn(B, S, V, generator=g)
    _, data, gvs, gvt = _batch()
    data = {k: (v[:, :S] if v.dim() == 2 else v) for k, v in data.items()}
    data["input_ids"] = torch.randint(0, V, (B, S), generator=g)
    gvt = torch.tensor(float(B * (S - 1)))
    lp = torch.log_softmax(logits, -1)[:, :-1].gather(-1, data["input_ids"][:, 1:].unsqueeze(-1)).squeeze(-1)
    ref_loss, _ = CorrectedPGLoss(cfg)(lp, data, gvs, gvt)
    loss, _ = loss_fn(logits=logits, data=data, global_valid_seqs=gvs, global_valid_toks=gvt)
    # NeMo-RL's packing wrapper passes a padded sequence's logits with its unpadded data.
    short = {k: (v[:, : S - 3] if v.dim() == 2 else v) for k, v in data.items()}
    padded_loss, _ = loss_fn(logits=logits, data=short, global_valid_seqs=gvs, global_valid_toks=gvt)
    lp_short = lp[:, : S - 4]
    ref_short, _ = CorrectedPGLoss(cfg)(lp_short, short, gvs, gvt)
    # Plumbing: the groups come from megatron-core's parallel_state when it is initialised.
    from megatron_stub import install_parallel_state  # tests/support/, this script's folder

    seen = {}
    tp, cp = object(), object()
    install_parallel_state(tp, cp)

    def record(*args, **kwargs):
        seen.update(cp=kwargs["cp_group"] is cp, tp=kwargs["tp_group"] is tp)
        return torch.zeros(()), {}

    sharded.sharded_loss = record
    loss_fn(logits=logits, data=data, global_valid_seqs=gvs, global_valid_toks=gvt)
    errors = {}
    try:
        RSClippedPGLossFn({**cfg, "sharded_logits_input": True}, use_fused_linear_logprobs=True)
    except Exception as exc:  # noqa: BLE001
        errors["fused"] = str(exc)
    return {
        "input_type": str(loss_fn.input_type),
        "diff": abs(float(loss) - float(ref_loss)),
        "padded_diff": abs(float(padded_loss) - float(ref_short)),
        "groups": seen,
        "errors": errors,
    }


def batch_norm_adapter():
    """Where ``is_batch_normalization: data_parallel`` gets its group, through the adapter."""
    import torch
    import torch.distributed as dist

    from nemo_rs_plugin.nemo_rl import loss_fn as nemo_rl_adapter
    from nemo_rs_plugin.nemo_rl.loss_fn import RSClippedPGLossFn
    from nemo_rs_plugin.parallel import sharded

    cfg = {**{k: v for k, v in PLUGIN_CFG.items() if k != "name"}, "is_batch_normalization": "data_parallel"}
    lp, data, gvs, gvt = _batch()
    out = {}
    # Single process, no megatron-core: no group is needed, the loss runs.
    loss, metrics = RSClippedPGLossFn(cfg)(lp, data, gvs, gvt)
    out["single_process_loss"] = float(loss)
    # a per-call metric: not returned to NeMo-RL, which would sum it over microbatches and ranks
    out["factor_returned"] = "is_batch_norm_factor" in metrics
    # Several ranks and no megatron-core (NeMo-RL's DTensor backend): refused, naming the field.
    saved = dist.is_initialized, dist.get_world_size
    dist.is_initialized, dist.get_world_size = (lambda: True), (lambda group=None: 2)
    try:
        RSClippedPGLossFn(cfg)(lp, data, gvs, gvt)
    except Exception as exc:  # noqa: BLE001
        out["dtensor_error"] = str(exc)
    dist.is_initialized, dist.get_world_size = saved
    # Megatron: both paths receive parallel_state's data-parallel group.
    from megatron_stub import install_parallel_state  # tests/support/, this script's folder

    tp, cp, dp = object(), object(), object()
    install_parallel_state(tp, cp, dp)
    seen = {}
    real_groups = nemo_rl_adapter.SequenceGroups

    class Recorder:
        @staticmethod
        def of(*groups, data_parallel=None):
            seen["gathered"] = data_parallel is dp
            return real_groups()

    def record(*args, **kwargs):
        seen["sharded"] = kwargs["data_parallel_group"] is dp
        return torch.zeros(()), {}

    nemo_rl_adapter.SequenceGroups, sharded.sharded_loss = Recorder, record
    RSClippedPGLossFn(cfg)(lp, data, gvs, gvt)
    RSClippedPGLossFn({**cfg, "sharded_logits_input": True})(
        logits=torch.zeros(3, 8, 5), data=data, global_valid_seqs=gvs, global_valid_toks=gvt
    )
    out["groups"] = seen
    micro = RSClippedPGLossFn({**cfg, "is_batch_normalization": "microbatch"})
    out["microbatch_group"] = nemo_rl_adapter.batch_data_parallel_group(micro.rs_config)
    return out


if __name__ == "__main__":
    print(json.dumps(globals()[sys.argv[1]]()))
