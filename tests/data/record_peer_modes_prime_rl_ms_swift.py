"""Record ``peer_modes_prime_rl_ms_swift.json``: prime-rl's and ms-swift's own functions on the shared peer batch.

Usage (outside the repository's environment; the peers are not dependencies of this project)::

    python tests/data/record_peer_modes_prime_rl_ms_swift.py --prime-rl /path/to/prime-rl-checkout \
        --prime-rl-commit <sha> --ms-swift /path/to/unpacked/ms_swift-4.6.0-wheel \
        > tests/data/peer_modes_prime_rl_ms_swift.json

``--prime-rl`` is a checkout of https://github.com/PrimeIntellect-ai/prime-rl; this script
imports ``src/prime_rl/trainer/rl/loss.py`` from it, unchanged, and calls its
``compute_loss`` with its ``default_loss_fn`` (DPPO + KL) and ``ipo_loss_fn`` (IPO + KL). The
loss configs are plain objects with the fields of prime-rl's ``DefaultLossConfig`` /
``IPOLossConfig`` (their defaults read from the checkout's config source, then the values of
each mode): the loss functions only read those attributes, and the pydantic config package
pulls in prime-rl's whole configuration tree. Needs torch, jaxtyping and beartype.

``--ms-swift`` is the unpacked ``ms-swift`` wheel (``pip download ms-swift==4.6.0 --no-deps``,
then unzip): its trainer module imports vLLM, TRL, transformers and accelerate, so the four
methods of ``swift/rlhf_trainers/grpo_trainer.py:GRPOTrainer`` that compute the rollout
importance-sampling weights and the mismatch diagnostics (``_apply_rollout_importance_sampling``,
``_compute_sequence_level_ratios``, ``_compute_is_correction_metrics``,
``_compute_rollout_offpolicy_metrics``) are read out of that file with ``ast``, compiled
unchanged and called as methods of an object holding the two settings they read. They get
``old_per_token_logps - rollout_per_token_logps`` = ``prev - gen``, as ``_get_rollout_is_correction``
passes them.

No peer code is copied here. The batch is ``peer_modes.json``'s (8 rows x 16 positions, row 6
empty, outliers), plus a sample mask that masks row 0, a sample with tokens: prime-rl's
``loss_mask`` is ``token_mask & sample_mask``. Everything runs in float64.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import sys
import types
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
MASKED_SAMPLE = 0  # the row whose sample_mask is 0

LOSS_FILE = "src/prime_rl/trainer/rl/loss.py"
CONFIG_FILE = "packages/prime-rl-configs/src/prime_rl/configs/trainer.py"


def config_defaults(root: Path, class_name: str) -> dict:
    """The field defaults of one prime-rl loss config class, read from its source (``Field(default, ...)``)."""
    tree = ast.parse((root / CONFIG_FILE).read_text())
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            out = {}
            for stmt in node.body:
                if isinstance(stmt, ast.AnnAssign) and stmt.value is not None:
                    value = stmt.value
                    if isinstance(value, ast.Call):  # Field(default, ...)
                        value = value.args[0]
                    out[stmt.target.id] = ast.literal_eval(value)
            return out
    raise KeyError(class_name)


def import_prime_rl_loss(root: Path):
    """prime-rl's ``loss.py``, unchanged; its two package imports answered by stand-ins.

    ``prime_rl.configs.trainer`` provides the config classes only for ``isinstance`` in
    ``setup_rl_loss_fn`` (not called here); ``prime_rl.utils.utils.import_object`` serves custom
    losses only.
    """
    configs = types.ModuleType("prime_rl.configs.trainer")
    for name in ("CustomLossConfig", "DefaultLossConfig", "IPOLossConfig", "LossConfig"):
        setattr(configs, name, type(name, (), {}))
    utils = types.ModuleType("prime_rl.utils.utils")
    utils.import_object = lambda path: None
    for name, module in {
        "prime_rl": types.ModuleType("prime_rl"),
        "prime_rl.configs": types.ModuleType("prime_rl.configs"),
        "prime_rl.configs.trainer": configs,
        "prime_rl.utils": types.ModuleType("prime_rl.utils"),
        "prime_rl.utils.utils": utils,
    }.items():
        sys.modules.setdefault(name, module)
    spec = importlib.util.spec_from_file_location("prime_rl_loss", root / LOSS_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_mode(loss, loss_fn, loss_config, batch: dict) -> dict:
    """One call of prime-rl's ``compute_loss`` on the batch (one packed sample per row)."""
    curr, gen, adv = (torch.tensor(batch[k], dtype=torch.float64) for k in ("curr", "gen", "advantages"))
    token_mask = torch.tensor(batch["token_mask"], dtype=torch.bool)
    sample_mask = torch.tensor(batch["sample_mask"], dtype=torch.bool)
    loss_mask = token_mask & sample_mask[:, None]
    rows = [curr[i].clone().requires_grad_(True) for i in range(curr.shape[0])]
    loss_value, metrics = loss.compute_loss(
        trainer_logprobs=rows,
        inference_logprobs=list(gen),
        ref_logprobs=None,
        advantages=list(adv),
        loss_mask=list(loss_mask),
        rl_weights=None,
        ce_weights=None,
        ref_kl_weights=None,
        rl_loss_fn=lambda inputs: loss_fn(inputs, loss_config),
        rl_scale=int(loss_mask.sum()),
        ce_scale=1,
        ref_kl_scale=1,
    )
    loss_value.backward()
    grad = torch.stack([r.grad if r.grad is not None else torch.zeros_like(r) for r in rows])
    # The policy-gradient mask read back from the peer's gradient: on a loss token,
    # N * grad = -keep * adv_tau * A * exp(curr - gen) + 2 * kl_tau * (curr - gen), so keep is
    # (2 kl_tau d - N grad) / (adv_tau A r), exactly 0 or 1 up to rounding (A != 0 on every loss
    # token of this batch). 0 off the loss tokens.
    n, d = float(loss_mask.sum()), curr - gen
    scale = loss_config.adv_tau * adv * torch.exp(d)
    keep = (2 * loss_config.kl_tau * d - n * grad) / torch.where(loss_mask, scale, torch.ones_like(scale))
    keep = torch.where(loss_mask, keep, torch.zeros_like(keep))
    assert torch.allclose(keep, keep.round(), atol=1e-9), "the gradient does not read back as a 0/1 mask"
    return {
        "loss": float(loss_value.detach()),
        "grad": grad.tolist(),
        "policy_gradient_keep": keep.round().tolist(),
        "per_row_metrics": {k: v.tolist() for k, v in metrics.items()},
        "loss_tokens_per_row": loss_mask.sum(-1).tolist(),
    }


SWIFT_TRAINER = "swift/rlhf_trainers/grpo_trainer.py"
SWIFT_METHODS = (
    "_apply_rollout_importance_sampling",
    "_compute_sequence_level_ratios",
    "_compute_is_correction_metrics",
    "_compute_rollout_offpolicy_metrics",
)


def swift_trainer_methods(root: Path) -> dict:
    """The named methods of ms-swift's ``GRPOTrainer``, compiled from its source, unchanged."""
    import typing

    path = root / SWIFT_TRAINER
    tree = ast.parse(path.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "GRPOTrainer")
    chosen = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name in SWIFT_METHODS]
    assert {n.name for n in chosen} == set(SWIFT_METHODS), "ms-swift's trainer changed: methods missing"
    namespace = {"torch": torch, **{name: getattr(typing, name) for name in ("Dict", "Optional", "List", "Tuple")}}
    exec(compile(ast.Module(body=chosen, type_ignores=[]), str(path), "exec"), namespace)
    return {name: namespace[name] for name in SWIFT_METHODS}


def run_swift_mode(methods: dict, mode: str, threshold: float, batch: dict) -> dict:
    """ms-swift's IS weights and metrics for one ``rollout_importance_sampling_mode``."""
    trainer = types.SimpleNamespace(
        rollout_importance_sampling_mode=mode, rollout_importance_sampling_threshold=threshold
    )
    for name, fn in methods.items():
        setattr(trainer, name, types.MethodType(fn, trainer))
    prev, gen = (torch.tensor(batch[k], dtype=torch.float64) for k in ("prev", "gen"))
    completion_mask = torch.tensor(batch["token_mask"], dtype=torch.float64)
    log_ratio = prev - gen  # _get_rollout_is_correction: old_per_token_logps - rollout_per_token_logps
    weights = trainer._apply_rollout_importance_sampling(log_ratio, completion_mask)
    metrics = {
        **trainer._compute_rollout_offpolicy_metrics(prev, gen, completion_mask),
        **trainer._compute_is_correction_metrics(log_ratio, weights, completion_mask),
    }
    return {"weight": (weights * completion_mask).tolist(), "metrics": {k: float(v) for k, v in metrics.items()}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prime-rl", type=Path, required=True, help="a prime-rl checkout")
    parser.add_argument("--prime-rl-commit", required=True, help="its commit, recorded with the outputs")
    parser.add_argument("--ms-swift", type=Path, required=True, help="the unpacked ms-swift wheel")
    args = parser.parse_args(argv)
    torch.set_default_dtype(torch.float64)
    loss = import_prime_rl_loss(args.prime_rl)
    batch = dict(json.loads((HERE / "peer_modes.json").read_text())["batch"])
    batch["sample_mask"] = [0.0 if i == MASKED_SAMPLE else 1.0 for i in range(len(batch["token_mask"]))]
    version = f"prime-rl git {args.prime_rl_commit}"
    modes = []
    for name, fn_name, class_name, overrides, plugin_config in MODES:
        values = {**config_defaults(args.prime_rl, class_name), **overrides}
        values.pop("type", None)
        out = run_mode(loss, getattr(loss, fn_name), types.SimpleNamespace(**values), batch)
        modes.append(
            {
                "name": name,
                "peer": "prime-rl",
                "version": version,
                "function": f"{LOSS_FILE}:compute_loss with {fn_name}",
                "call": f"{class_name}({', '.join(f'{k}={v!r}' for k, v in values.items())}), "
                "rl_scale = loss tokens of the batch, one packed sample per row",
                "plugin_config": plugin_config(values),
                **out,
            }
        )
    swift = swift_trainer_methods(args.ms_swift)
    swift_version = "ms-swift " + ast.literal_eval(
        next(
            line.split("=", 1)[1].strip()
            for line in (args.ms_swift / "swift/version.py").read_text().splitlines()
            if line.startswith("__version__")
        )
    )
    weight_modes = []
    for swift_mode, threshold, plugin_config in SWIFT_MODES:
        weight_modes.append(
            {
                "name": f"ms_swift/{swift_mode}_{threshold:g}",
                "peer": "ms-swift",
                "version": f"{swift_version} (PyPI wheel)",
                "function": f"{SWIFT_TRAINER}:GRPOTrainer._apply_rollout_importance_sampling, "
                "_compute_is_correction_metrics, _compute_rollout_offpolicy_metrics",
                "call": f"rollout_importance_sampling_mode={swift_mode!r}, "
                f"rollout_importance_sampling_threshold={threshold}, log ratio prev - gen",
                "plugin_config": plugin_config,
                **run_swift_mode(swift, swift_mode, threshold, batch),
            }
        )
    about = (
        "Outputs of prime-rl's own loss functions (src/prime_rl/trainer/rl/loss.py, unchanged, run outside "
        "this repository by tests/data/record_peer_modes_prime_rl_ms_swift.py) on peer_modes.json's batch plus a sample "
        f"mask that masks row {MASKED_SAMPLE}, in float64. Per mode: the loss, its gradient with respect to "
        "the current log-probs [B, T], prime-rl's per-row metrics (each a mean over that row's loss tokens, "
        "0 for a row without any) and the loss tokens per row. 'weight_modes': ms-swift's rollout importance "
        "sampling (GRPOTrainer methods compiled unchanged from its wheel) on the same batch without the sample "
        "mask: its per-token weight times the completion mask, and its metrics. "
        "Read by tests/core/test_peer_modes_prime_rl_ms_swift.py."
    )
    json.dump({"about": about, "batch": batch, "modes": modes, "weight_modes": weight_modes}, sys.stdout)
    sys.stdout.write("\n")
    return 0


def _filters(values: dict, kind: str) -> list[dict]:
    """The plugin's filters for a prime-rl trust region: ``p_curr - p_gen`` against the bounds."""
    common = {"level": "token", "statistic": "prob_diff", "log_ratio": "curr-gen", "applies_to": "policy_gradient"}
    if kind == "ipo":
        return [{**common, "lower": -values["ipo_threshold"], "upper": values["ipo_threshold"]}]
    return [
        {**common, "advantage_sign": "positive", "upper": values["dppo_mask_high"]},
        {**common, "advantage_sign": "negative", "lower": -values["dppo_mask_low"]},
    ]


def _plugin_config(kind: str):
    def build(values: dict) -> dict:
        return {
            "force_on_policy_ratio": True,
            "use_importance_sampling_correction": True,
            "reference_policy_kl_penalty": 0.0,
            "sampler_kl_penalty": values["kl_tau"],
            "rejection_sampling": _filters(values, kind),
        }

    return build


# (name, prime-rl loss function, its config class, values that differ from its defaults, plugin config)
MODES = [
    ("prime_rl/dppo_default", "default_loss_fn", "DefaultLossConfig", {}, _plugin_config("dppo")),
    (
        "prime_rl/dppo_tight",
        "default_loss_fn",
        "DefaultLossConfig",
        {"dppo_mask_high": 0.03, "dppo_mask_low": 0.02, "kl_tau": 0.05},
        _plugin_config("dppo"),
    ),
    ("prime_rl/ipo_default", "ipo_loss_fn", "IPOLossConfig", {}, _plugin_config("ipo")),
    (
        "prime_rl/ipo_tight",
        "ipo_loss_fn",
        "IPOLossConfig",
        {"ipo_threshold": 0.03, "kl_tau": 0.05},
        _plugin_config("ipo"),
    ),
]


def _swift_plugin_config(truncation: str, level: str, threshold: float) -> dict:
    return {
        "use_importance_sampling_correction": True,
        "is_correction_level": level,
        "truncated_importance_sampling_type": truncation,
        "truncated_importance_sampling_ratio": threshold,
        "truncated_importance_sampling_ratio_min": 0.0,
        "reference_policy_kl_penalty": 0.0,
    }


# (ms-swift mode, threshold, plugin config); 2.0 is ms-swift's default threshold.
SWIFT_MODES = [
    (mode, threshold, _swift_plugin_config(truncation, level, threshold))
    for threshold in (2.0, 1.05)
    for mode, truncation, level in (
        ("token_truncate", "tis", "token"),
        ("token_mask", "icepop", "token"),
        ("sequence_truncate", "tis", "sequence_mean"),
        ("sequence_mask", "seq-mask-tis", "token"),
    )
]


if __name__ == "__main__":
    sys.exit(main())
