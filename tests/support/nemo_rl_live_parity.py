"""Live parity: the plugin against NeMo-RL's own ``ClippedPGLossFn``, in this interpreter.

``python tests/support/nemo_rl_live_parity.py`` with one NeMo-RL checkout on ``PYTHONPATH`` prints one
JSON line: the host version, how many option combinations the host accepts, and every
disagreement (loss, gradient, a metric, or which configs are refused), each naming the
combination. The combinations are the product of the upstream option axes below, restricted to
the fields this host version has (``--cover``: a subset holding every pair of options,
``all_pairs``); each runs on three generated batches (ragged rows with an empty response and a
masked sample; a batch that is one microbatch of a larger global batch; a fully masked batch).

Tolerances as for the recorded fixtures: loss rtol 1e-4 / atol 1e-5, metrics 1e-5 + 1e-4 |v|,
gradient rtol 1e-4 / atol 1e-4 * max|grad|.
"""

from __future__ import annotations

import itertools
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

AXES = {
    "ratio": {
        "ppo": {},
        "asym": {"ratio_clip_max": 0.28},
        "dual": {"ratio_clip_c": 3.0},
        "cispo": {"use_cispo": True, "ratio_clip_max": 0.28},
        "reinforce": {"disable_ppo_ratio": True},
        "on_policy": {"force_on_policy_ratio": True},
    },
    "level": {
        "token": {"token_level_loss": True},
        "seq": {"token_level_loss": False},
        "gspo": {"token_level_loss": False, "sequence_level_importance_ratios": True},
    },
    "is": {
        "off": {"use_importance_sampling_correction": False},
        "on": {"use_importance_sampling_correction": True},
        "tis": {
            "use_importance_sampling_correction": True,
            "truncated_importance_sampling_type": "tis",
            "truncated_importance_sampling_ratio": 1.5,
        },
        "tis_min": {
            "use_importance_sampling_correction": True,
            "truncated_importance_sampling_type": "tis",
            "truncated_importance_sampling_ratio": 1.5,
            "truncated_importance_sampling_ratio_min": 0.7,
        },
        "icepop": {
            "use_importance_sampling_correction": True,
            "truncated_importance_sampling_type": "icepop",
            "truncated_importance_sampling_ratio": 1.5,
            "truncated_importance_sampling_ratio_min": 0.7,
        },
        "seq_mask": {
            "use_importance_sampling_correction": True,
            "truncated_importance_sampling_type": "seq-mask-tis",
            "truncated_importance_sampling_ratio": 1.05,
            "truncated_importance_sampling_ratio_min": 0.95,
        },
    },
    "kl": {
        "none": {"reference_policy_kl_penalty": 0.0},
        "k1": {"reference_policy_kl_penalty": 0.1, "reference_policy_kl_type": "k1"},
        "k2": {"reference_policy_kl_penalty": 0.1, "reference_policy_kl_type": "k2"},
        "k3": {"reference_policy_kl_penalty": 0.1, "reference_policy_kl_type": "k3"},
        "k3_clamped": {
            "reference_policy_kl_penalty": 0.1,
            "reference_policy_kl_type": "k3",
            "kl_input_clamp_value": 0.5,
            "kl_output_clamp_value": 0.2,
        },
        "k3_on_policy": {
            "reference_policy_kl_penalty": 0.1,
            "reference_policy_kl_type": "k3",
            "use_on_policy_kl_approximation": True,
        },
        "in_reward": {"reference_policy_kl_penalty": 0.1, "use_kl_in_reward": True},
    },
    "nll": {"0": {}, "0.3": {"positive_example_nll_weight": 0.3}},
}

# NeMo-RL's own defaults (v0.7.0/main pydantic defaults; v0.6.0 has no defaults, its recipes set these).
BASE = {
    "reference_policy_kl_penalty": 0.01,
    "reference_policy_kl_type": "k3",
    "kl_input_clamp_value": 20.0,
    "kl_output_clamp_value": 10.0,
    "ratio_clip_min": 0.2,
    "ratio_clip_max": 0.2,
    "ratio_clip_c": None,
    "use_on_policy_kl_approximation": False,
    "use_importance_sampling_correction": False,
    "truncated_importance_sampling_ratio": None,
    "truncated_importance_sampling_type": None,
    "truncated_importance_sampling_ratio_min": None,
    "token_level_loss": True,
    "sequence_level_importance_ratios": False,
    "disable_ppo_ratio": False,
    "force_on_policy_ratio": False,
    "use_kl_in_reward": False,
    "use_cispo": False,
    "positive_example_nll_weight": 0.0,
}


def host_fields(host_loss) -> list[str]:
    cfg_cls = host_loss.ClippedPGLossConfig
    if hasattr(cfg_cls, "model_fields"):
        return list(cfg_cls.model_fields)
    return list(getattr(cfg_cls, "__annotations__", {}))


def batches():
    """Three (name, next_token_logprobs, data, global_valid_seqs, global_valid_toks) inputs."""
    import torch

    g = torch.Generator().manual_seed(2024)
    B, S = 6, 24
    token_mask = torch.zeros(B, S, dtype=torch.long)
    for i in range(B):
        start = 2 + i % 3
        end = start + int(torch.randint(3, S - start, (1,), generator=g))
        token_mask[i, start:end] = 1
    token_mask[4] = 0  # empty response
    sample_mask = torch.ones(B)
    sample_mask[1] = 0  # masked sample
    prev = -torch.rand(B, S, generator=g) * 3
    gen = prev + 0.15 * torch.randn(B, S, generator=g)
    gen[0, 6] -= 3.0  # outlier tokens
    gen[2, 8] += 3.0
    curr = prev[:, 1:] + 0.3 * torch.randn(B, S - 1, generator=g)
    data = {
        "input_ids": torch.randint(0, 100, (B, S), generator=g),
        "advantages": torch.randn(B, 1, generator=g).expand(B, S).contiguous() * token_mask,
        "prev_logprobs": prev * token_mask,
        "generation_logprobs": gen * token_mask,
        "reference_policy_logprobs": (prev + 0.2 * torch.randn(B, S, generator=g)) * token_mask,
        "token_mask": token_mask,
        "sample_mask": sample_mask,
        "rewards": torch.tensor([1.0, 0.0, 1.0, -1.0, 1.0, 0.5]),
    }
    valid = (token_mask[:, 1:].float() * sample_mask[:, None]).sum()
    yield "ragged", curr, data, sample_mask.sum(), valid
    yield "microbatch-of-global", curr, data, sample_mask.sum() * 2.5, valid * 2.5
    masked = dict(data, sample_mask=torch.zeros(B))
    yield "all-masked", curr, masked, torch.tensor(0.0), torch.tensor(0.0)


def _per_sequence_metric(loss_fn, curr, data, gvs, gvt, key, BatchedDataDict) -> float:
    """``key`` summed over one call of ``loss_fn`` per sequence (NeMo-RL's metrics are sums over calls)."""
    total = 0.0
    for i in range(curr.shape[0]):
        row = {k: v[i : i + 1].clone() if hasattr(v, "shape") and v.dim() > 0 else v for k, v in data.items()}
        _, metrics = loss_fn(curr[i : i + 1].clone(), BatchedDataDict(row), gvs, gvt)
        total += float(metrics[key])
    return total


def all_pairs(choices: list[tuple]) -> list[tuple]:
    """A subset of ``choices`` (one value per axis each) holding every pair of two axes' values they hold.

    Greedy: the choice that covers most of the pairs not yet covered, first. A released checkout's
    cover (``nemo_rl_hosts.whole_matrix``): every option meets every option of every other axis.
    """
    pairs_of = [{(i, c[i], j, c[j]) for i in range(len(c)) for j in range(i + 1, len(c))} for c in choices]
    uncovered = set().union(*pairs_of) if choices else set()
    chosen: list[tuple] = []
    while uncovered:
        best = max(range(len(choices)), key=lambda k: len(pairs_of[k] & uncovered))
        chosen.append(choices[best])
        uncovered -= pairs_of[best]
    return chosen


def run(every: bool = True) -> dict:
    from tests.support import nemo_rl_shims

    nemo_rl_shims.install()
    import nemo_rl
    import torch
    from nemo_rl.algorithms import loss as host_loss
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict

    from nemo_rs_plugin.nemo_rl.host import host_api
    from nemo_rs_plugin.nemo_rl.loss_fn import RSClippedPGLossFn

    fields = host_fields(host_loss)
    pydantic = host_api() == "pydantic"
    combos = accepted = compared = 0
    failures: list[str] = []
    skipped_axes = sorted(
        {f"{a}={v}" for a, vals in AXES.items() for v, opts in vals.items() if any(k not in fields for k in opts)}
    )
    present = [
        choice
        for choice in itertools.product(*[list(v) for v in AXES.values()])
        if all(k in fields for axis, name in zip(AXES, choice) for k in AXES[axis][name])
    ]
    for names in present if every else all_pairs(present):
        choice = [(name, AXES[axis][name]) for axis, name in zip(AXES, names)]
        options = {}
        for _, opts in choice:
            options.update(opts)
        combos += 1
        label = "/".join(f"{axis}={name}" for axis, (name, _) in zip(AXES, choice))
        cfg = {k: v for k, v in {**BASE, **options}.items() if k in fields}

        def build(cls, extra=None):
            values = dict(cfg, **(extra or {}))
            return cls(host_loss.ClippedPGLossConfig(**values) if pydantic else values)

        try:
            host = build(host_loss.ClippedPGLossFn)
        except (AssertionError, ValueError) as exc:
            host = exc
        try:
            plugin = build(RSClippedPGLossFn, {"name": "rs_clipped_pg"} if pydantic else None)
        except (AssertionError, ValueError) as exc:
            plugin = exc
        if isinstance(host, Exception) or isinstance(plugin, Exception):
            if isinstance(host, Exception) != isinstance(plugin, Exception):
                failures.append(
                    f"{label}: host {'refuses' if isinstance(host, Exception) else 'accepts'}, "
                    f"plugin {'refuses' if isinstance(plugin, Exception) else 'accepts'}: "
                    f"{(host if isinstance(host, Exception) else plugin)!s:.200}"
                )
            continue
        accepted += 1
        for name, curr, data, gvs, gvt in batches():
            results = []
            for fn in (host, plugin):
                lp = curr.clone().requires_grad_(True)
                loss, metrics = fn(lp, BatchedDataDict({k: v.clone() for k, v in data.items()}), gvs, gvt)
                loss.backward()
                grad = lp.grad if lp.grad is not None else torch.zeros_like(lp)
                metrics = {k: float(v) for k, v in metrics.items()}
                results.append((loss.detach().float(), grad, metrics))
            compared += 1
            (h_loss, h_grad, h_metrics), (p_loss, p_grad, p_metrics) = results
            if cfg.get("sequence_level_importance_ratios") and "sampling_importance_ratio" in h_metrics:
                # The deliberate difference: NeMo-RL's GSPO value of one call on B sequences is
                # inflated by its [B, 1] x [B] broadcast (#3753); the plugin logs NeMo-RL's value
                # summed over one call per sequence (what NeMo-RL's packing wrapper logs).
                h_metrics["sampling_importance_ratio"] = _per_sequence_metric(
                    host, curr, data, gvs, gvt, "sampling_importance_ratio", BatchedDataDict
                )
            where = f"{label} on {name}"
            if not torch.allclose(p_loss, h_loss, rtol=1e-4, atol=1e-5, equal_nan=True):
                failures.append(f"{where}: loss {float(p_loss)} vs NeMo-RL {float(h_loss)}")
            if not torch.allclose(p_grad, h_grad, rtol=1e-4, atol=1e-4 * float(h_grad.abs().max()) + 1e-12):
                failures.append(f"{where}: gradient max diff {float((p_grad - h_grad).abs().max()):.3g}")
            for key, ref in h_metrics.items():
                got = p_metrics.get(key)
                if got is None:
                    failures.append(f"{where}: metric {key} missing")
                elif not (got == ref or abs(got - ref) <= 1e-5 + 1e-4 * abs(ref)):
                    failures.append(f"{where}: metric {key} {got} vs NeMo-RL {ref}")
    return {
        "version": getattr(nemo_rl, "__version__", "?"),
        "combinations": combos,
        "accepted": accepted,
        "compared": compared,
        "axes_absent_in_this_version": skipped_axes,
        "failures": failures,
    }


if __name__ == "__main__":
    print(json.dumps(run(every="--cover" not in sys.argv[1:])))
