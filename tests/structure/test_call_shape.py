"""The shape of one loss call, as a reader follows it: one way down, a bounded depth.

Profiled with ``sys.setprofile`` over one eager CPU call (forward and backward) per
configuration. Held: no two plugin modules call each other both ways (the metric set holds
data, not callbacks: derived metrics are formulas of ``metric_kernels``, and the loss judges
the inputs itself after the one transfer); at most ``MAX_PLUGIN_FRAMES`` plugin frames nested
(issue 43 measured 12-13 before, and set 6 as a target; see docs/architecture.md#one-loss-call
for what is reached and why not less); at most ``MAX_PLUGIN_CALLS`` Python calls into the plugin
(each a frame's bookkeeping, and in eager mode most come with a torch call of a microsecond or so).
"""

from __future__ import annotations

import sys

import pytest
import torch

from nemo_rs_plugin import CorrectedPGLoss

MAX_PLUGIN_FRAMES = 8  # 9 until the loss called the correction's three steps itself (2026-11-30)
#: Python calls into the plugin per call (frames entered, generator resumptions included), the
#: largest configuration below (``sequence_mean`` + three filters). 471 at b5d0390, 388 after the
#: metric set held its values as given, 296 after the filters' entries were resolved where the loss
#: is built and the inputs read in one loop (2026-11-30), 263 since a declaration is one lookup in
#: the metric layout's table, not a call (2026-11-30); issue 52 asks for 150
#: (docs/architecture.md#one-loss-call).
MAX_PLUGIN_CALLS = 270

CONFIGS = {
    "plain": {},
    "seq-mask-tis": {
        "use_importance_sampling_correction": True,
        "truncated_importance_sampling_type": "seq-mask-tis",
        "truncated_importance_sampling_ratio": 1.002,
        "truncated_importance_sampling_ratio_min": 0.999,
    },
    "sequence_mean+filters": {
        "use_importance_sampling_correction": True,
        "is_correction_level": "sequence_mean",
        "rejection_sampling": [
            {"level": "sequence", "statistic": "ratio", "agg": "mean", "lower": 0.5, "upper": 2.0},
            {"level": "token", "statistic": "ratio", "lower": 0.1, "upper": 10.0},
            {"level": "sequence", "statistic": "ratio", "agg": "any", "lower": 1e-4, "upper": 1e4},
        ],
    },
    "gspo+kl+nll": {
        "sequence_level_importance_ratios": True,
        "token_level_loss": False,
        "reference_policy_kl_penalty": 0.01,
        "positive_example_nll_weight": 0.1,
    },
}


def _batch(B: int = 4, S: int = 32):
    g = torch.Generator().manual_seed(0)
    prev = -torch.rand(B, S, generator=g)
    data = {
        "advantages": torch.randn(B, S, generator=g),
        "prev_logprobs": prev,
        "generation_logprobs": (prev + 0.01 * torch.randn(B, S, generator=g)).clamp(max=0),
        "reference_policy_logprobs": prev,
        "token_mask": torch.ones(B, S, dtype=torch.long),
        "sample_mask": torch.ones(B),
        "rewards": torch.tensor([1.0, 0.0, 1.0, 0.0])[:B],
    }
    curr = (prev[:, 1:] + 0.01 * torch.randn(B, S - 1, generator=g)).clamp(max=0).requires_grad_(True)
    return curr, data, torch.tensor(float(B)), torch.tensor(float(B * (S - 1)))


def call_shape(loss_fn, args) -> tuple[set[tuple[str, str]], list[str], int]:
    """Plugin module pairs (caller, callee) seen in one call, the deepest chain of plugin frames,
    and how many plugin frames were entered."""
    edges: set[tuple[str, str]] = set()
    stack: list[tuple[bool, str]] = []
    deepest: list[str] = []
    calls = 0

    def profile(frame, event, arg):
        nonlocal deepest, calls
        if event == "call":
            module = frame.f_globals.get("__name__", "")
            ours = module.startswith("nemo_rs_plugin")
            calls += ours
            if ours and frame.f_back is not None:
                caller = frame.f_back.f_globals.get("__name__", "")
                if caller.startswith("nemo_rs_plugin") and caller != module:
                    edges.add((caller, module))
            stack.append((ours, f"{module.rsplit('.', 1)[-1]}.{frame.f_code.co_name}"))
            chain = [name for is_ours, name in stack if is_ours]
            if len(chain) > len(deepest):
                deepest = chain
        elif event == "return" and stack:
            stack.pop()

    sys.setprofile(profile)
    try:
        loss, _ = loss_fn(*args)
        loss.backward()
    finally:
        sys.setprofile(None)
    return edges, deepest, calls


@pytest.mark.parametrize("name", list(CONFIGS))
def test_one_call_runs_one_way_within_the_frame_bound(name):
    loss_fn = CorrectedPGLoss(CONFIGS[name])
    loss_fn(*_batch())  # warm-up: first-call imports and caches are not the call's shape
    edges, deepest, calls = call_shape(loss_fn, _batch())
    both_ways = sorted((a, b) for a, b in edges if (b, a) in edges and a < b)
    assert both_ways == [], both_ways
    assert len(deepest) <= MAX_PLUGIN_FRAMES, " > ".join(deepest)
    assert deepest[0] == "loss.__call__", deepest
    assert calls <= MAX_PLUGIN_CALLS, f"{calls} Python calls into the plugin for one call of {name!r}"
