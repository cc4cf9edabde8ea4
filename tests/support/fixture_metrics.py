"""How a metric recorded from NeMo-RL's own loss compares with the plugin's (the fixture cases).

One deliberate difference (docs/guide.md, "Where it differs from NeMo-RL on purpose"): NeMo-RL's GSPO
``sampling_importance_ratio`` of one call is ``sum_i w_i * sum_j s_j / N_seq`` (its ``[B, 1]``
weight against the ``[B]`` sample mask, NeMo-RL #3753); the plugin logs ``sum_i s_i w_i / N_seq``,
NeMo-RL's own value when it packs (one sequence per call). With every sample valid the two differ
by the factor ``B``; otherwise the recording cannot give the plugin's value, which
tests/core/test_reference.py and the live per-sequence comparison check instead.
"""

from __future__ import annotations

from typing import Any, Optional


def plugin_value_of_recorded(case: dict, key: str, recorded: float) -> Optional[float]:
    """The plugin's expected value of ``key`` given NeMo-RL's recorded one; ``None``: not derivable."""
    if key != "sampling_importance_ratio" or not case["config"].get("sequence_level_importance_ratios"):
        return recorded
    mask: Any = case["data"]["sample_mask"]
    if not bool((mask == 1).all()):
        return None
    return recorded / mask.numel()
