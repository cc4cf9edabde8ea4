"""Checks against a real NeMo-RL, run in a fresh interpreter (``python nemo_rl_scripts.py NAME``).

The interpreter has one NeMo-RL checkout on PYTHONPATH and the plugin from its installation,
so the start-up hook activates it as in a user's run. Each check prints one JSON line.
"""

import json
import os
import sys

# Python 3.11 / CPU-torch shims for NeMo-RL's archives (appended: the installed plugin wins).
sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tests.support import nemo_rl_shims  # noqa: E402

nemo_rl_shims.install()


def _loss_cfg():
    return {
        "name": "rs_clipped_pg",
        "use_importance_sampling_correction": True,
        "is_correction_level": "sequence_mean",
        "rejection_sampling": [
            {"level": "sequence", "statistic": "ratio", "agg": "mean", "lower": 0.9, "upper": 1.1},
            {"level": "token", "statistic": "kl_k3", "upper": 0.5},
        ],
    }


def recipe():
    """load_config (defaults + Hydra overrides) -> MasterConfig -> GRPO's ClippedPGLossFn(...)."""
    import nemo_rl
    import yaml
    from nemo_rl.algorithms import grpo
    from nemo_rl.utils import config as host_config
    from nemo_rl.utils.config import load_config, parse_hydra_overrides
    from omegaconf import OmegaConf

    if hasattr(host_config, "register_omegaconf_resolvers"):  # as run_grpo.py does
        host_config.register_omegaconf_resolvers()

    checkout = os.path.dirname(os.path.dirname(nemo_rl.__file__))
    base = os.path.join(checkout, "examples", "configs", "grpo_math_1B.yaml")
    path = os.path.join(sys.argv[2], "recipe.yaml")
    with open(path, "w") as fh:
        yaml.safe_dump({"defaults": base, "loss_fn": _loss_cfg()}, fh)
    cfg = load_config(path)
    cfg = parse_hydra_overrides(cfg, ["loss_fn.ratio_clip_max=0.28"])
    cfg = OmegaConf.to_container(cfg, resolve=True)
    master = grpo.MasterConfig(**cfg) if hasattr(grpo.MasterConfig, "model_validate") else cfg
    loss_cfg = master.loss_fn if hasattr(master, "loss_fn") else master["loss_fn"]
    loss_fn = grpo.ClippedPGLossFn(loss_cfg)
    own_cfg = dict(cfg["loss_fn"])
    for key in ("name", "is_correction_level", "rejection_sampling"):
        own_cfg.pop(key)
    own = grpo.ClippedPGLossFn(type(loss_cfg)(**own_cfg) if hasattr(loss_cfg, "model_dump") else own_cfg)
    return {
        "version": nemo_rl.__version__,
        "type": type(loss_fn).__name__,
        "is_host_instance": isinstance(loss_fn, grpo.ClippedPGLossFn),
        "level": loss_fn.rs_config.is_correction_level,
        "filters": len(loss_fn.rs_config.rejection_sampling),
        "ratio_clip_max": loss_fn.rs_config.ratio_clip_max,
        "inherited_kl_penalty": loss_fn.rs_config.reference_policy_kl_penalty,
        "own_type": f"{type(own).__module__}.{type(own).__name__}",
    }


def prepare():
    """The plugin loss inside NeMo-RL's input preparation, unpacked and packed."""
    import torch
    from nemo_rl.algorithms import grpo
    from nemo_rl.algorithms.loss import (
        SequencePackingLossWrapper,
        prepare_loss_input,
        wrap_loss_fn_with_input_preparation,
    )
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict

    from nemo_rs_plugin import CorrectedPGLoss

    cfg = _loss_cfg()
    host_cfg_cls = getattr(
        __import__("nemo_rl.algorithms.loss", fromlist=["ClippedPGLossConfig"]), "ClippedPGLossConfig"
    )
    loss_cfg = host_cfg_cls(**cfg) if hasattr(host_cfg_cls, "model_validate") else dict(cfg)
    loss_fn = grpo.ClippedPGLossFn(loss_cfg)
    core = CorrectedPGLoss({k: v for k, v in cfg.items() if k != "name"})
    g = torch.Generator().manual_seed(0)
    B, S, V = 3, 12, 17
    lengths = [12, 9, 5]
    logits = torch.randn(B, S, V, generator=g)
    input_ids = torch.randint(0, V, (B, S), generator=g)
    token_mask = torch.zeros(B, S, dtype=torch.long)
    for i, n in enumerate(lengths):
        token_mask[i, 2:n] = 1
    prev = torch.log_softmax(logits, -1).gather(-1, input_ids.unsqueeze(-1)).squeeze(-1)
    prev = torch.cat([torch.zeros(B, 1), prev[:, :-1]], 1) * token_mask
    data = {
        "input_ids": input_ids,
        "advantages": torch.randn(B, S, generator=g),
        "prev_logprobs": prev,
        "generation_logprobs": (prev + 0.03 * torch.randn(B, S, generator=g)) * token_mask,
        "reference_policy_logprobs": prev,
        "token_mask": token_mask,
        "sample_mask": torch.ones(B),
    }
    gvs = torch.tensor(float(B))
    gvt = (token_mask[:, 1:].float()).sum()
    lp = torch.log_softmax(logits, -1)[:, :-1].gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    ref_loss, ref_metrics = core(lp, data, gvs, gvt)
    loss, metrics = wrap_loss_fn_with_input_preparation(
        logits, BatchedDataDict(data), gvs, gvt, loss_fn, prepare_loss_input
    )
    # Packed: each sequence's valid prefix back to back, NeMo-RL's per-sequence wrapper.
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    packed = torch.cat([logits[i, :n] for i, n in enumerate(lengths)]).unsqueeze(0)
    wrapper = SequencePackingLossWrapper(
        loss_fn=loss_fn, prepare_fn=prepare_loss_input, cu_seqlens_q=torch.tensor(cu, dtype=torch.int32)
    )
    packed_loss, packed_metrics = wrapper(packed, BatchedDataDict(data), gvs, gvt)
    keys = ["loss", "is_weight_mean", "rs_token_rejected_frac", "token_mult_prob_error"]
    return {
        "unpacked": [abs(float(loss) - float(ref_loss)), {k: abs(metrics[k] - ref_metrics[k]) for k in keys}],
        "packed": [
            abs(float(packed_loss) - float(ref_loss)),
            {k: abs(packed_metrics[k] - ref_metrics[k]) for k in keys},
        ],
    }


def parity():
    """The recorded NeMo-RL cases through the subclass, built the way GRPO builds it."""
    import torch
    from nemo_rl.algorithms import grpo
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict

    from tests.support.fixture_metrics import plugin_value_of_recorded

    host_loss = __import__("nemo_rl.algorithms.loss", fromlist=["ClippedPGLossConfig"])
    fx = torch.load(sys.argv[2])
    failures = []
    for c in fx["cases"]:
        cfg = dict(c["config"], name="rs_clipped_pg")
        loss_cfg = (
            host_loss.ClippedPGLossConfig(**cfg) if hasattr(host_loss.ClippedPGLossConfig, "model_validate") else cfg
        )
        loss_fn = grpo.ClippedPGLossFn(loss_cfg)
        lp = c["next_token_logprobs"].clone().requires_grad_(True)
        loss, metrics = loss_fn(
            lp,
            BatchedDataDict({k: v.clone() for k, v in c["data"].items()}),
            c["global_valid_seqs"],
            c["global_valid_toks"],
        )
        loss.backward()
        ok = abs(float(loss) - float(c["loss"])) <= 1e-5 + 1e-4 * abs(float(c["loss"]))
        want = {k: plugin_value_of_recorded(c, k, v) for k, v in c["metrics"].items()}  # GSPO's one difference
        ok &= all(v is None or metrics[k] == v or abs(metrics[k] - v) <= 1e-5 + 1e-4 * abs(v) for k, v in want.items())
        g = lp.grad if lp.grad is not None else torch.zeros_like(lp)
        ok &= bool(torch.allclose(g, c["grad"], rtol=1e-4, atol=1e-4 * float(c["grad"].abs().max()) + 1e-12))
        if not ok:
            failures.append(c["name"])
    return {"cases": len(fx["cases"]), "failures": failures, "type": type(loss_fn).__name__}


def recipes_load():
    """Every shipped recipe through NeMo-RL's loader, MasterConfig and GRPO's construction."""
    import nemo_rl
    from nemo_rl.algorithms import grpo
    from nemo_rl.utils import config as host_config
    from omegaconf import OmegaConf

    from nemo_rs_plugin.tools.recipes import export_recipes

    if hasattr(host_config, "register_omegaconf_resolvers"):
        host_config.register_omegaconf_resolvers()
    checkout = os.path.dirname(os.path.dirname(nemo_rl.__file__))
    out = {}
    for path in export_recipes(sys.argv[2], checkout):
        try:
            cfg = OmegaConf.to_container(host_config.load_config(str(path)), resolve=True)
            master = grpo.MasterConfig(**cfg) if hasattr(grpo.MasterConfig, "model_validate") else cfg
            loss_cfg = master.loss_fn if hasattr(master, "loss_fn") else master["loss_fn"]
            loss_fn = grpo.ClippedPGLossFn(loss_cfg)
            out[path.name] = type(loss_fn).__name__
        except Exception as exc:  # noqa: BLE001 - reported per recipe
            out[path.name] = f"{type(exc).__name__}: {exc}"[:600]
    return out


def new_upstream_field():
    """A field NeMo-RL adds to ClippedPGLossConfig after this plugin's release."""
    import pydantic
    from nemo_rl.algorithms import loss as host_loss

    base = host_loss.ClippedPGLossConfig
    if not hasattr(base, "model_fields"):
        return {"api": "typeddict"}
    extended = pydantic.create_model("ClippedPGLossConfig", __base__=base, new_upstream_option=(float, 0.0))
    host_loss.ClippedPGLossConfig = extended
    from nemo_rs_plugin.nemo_rl.loss_fn import RSClippedPGLossFn

    built = RSClippedPGLossFn(extended(name="rs_clipped_pg", is_correction_level="sequence_mean"))
    try:
        RSClippedPGLossFn(extended(name="rs_clipped_pg", new_upstream_option=0.5))
        error = None
    except AssertionError as exc:
        error = str(exc)
    return {
        "api": "pydantic",
        "default_builds": type(built).__name__,
        "host_saw_default": getattr(built, "new_upstream_option", "absent"),
        "error": error,
    }


def registry_alias():
    """A third party's name for the plugin's class builds it without the direct-use name warning."""
    import warnings

    from nemo_rs_plugin.core.settings.config import ConfigWarning
    from nemo_rs_plugin.nemo_rl import registry
    from nemo_rs_plugin.nemo_rl.loss_fn import RSClippedPGLossFn

    registry.register_loss("third_party_rs", RSClippedPGLossFn)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss_fn = registry.get_loss_class("third_party_rs")({"name": "third_party_rs"})
    return {
        "type": type(loss_fn).__name__,
        "config_warnings": [str(w.message) for w in caught if issubclass(w.category, ConfigWarning)],
    }


def all_checks():
    """Every check above in this one interpreter (NeMo-RL's import is the costly part).

    ``argv``: ``all_checks TMPDIR FIXTURES``. Each check's result, or its traceback under "__traceback__";
    ``new_upstream_field`` runs last because it replaces NeMo-RL's config class.
    """
    import traceback

    tmp, fixtures = sys.argv[2], sys.argv[3]
    plan = [
        ("recipe", os.path.join(tmp, "recipe")),
        ("prepare", None),
        ("parity", fixtures),
        ("recipes_load", os.path.join(tmp, "recipes")),
        ("registry_alias", None),
        ("new_upstream_field", None),
    ]
    out = {}
    for name, arg in plan:
        if arg is not None and name != "parity":
            os.makedirs(arg, exist_ok=True)
        sys.argv[2:] = [arg] if arg is not None else []
        try:
            out[name] = globals()[name]()
        except Exception:  # noqa: BLE001 - reported to the test that owns the check
            out[name] = {"__traceback__": traceback.format_exc()[-4000:]}
    return out


if __name__ == "__main__":
    print(json.dumps(globals()[sys.argv[1]]()))
