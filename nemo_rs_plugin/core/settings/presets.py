"""Named corrections: the one definition of each preset that the tools, the recipes and the docs read.

Each preset is a plain fragment of a ``loss_fn`` section, as a recipe writes it. Where its
numbers come from, and where they are measured harmful, is in docs/guide.md ("What to pick
first") and docs/lab.md. ``nemo-rs simulate`` and ``nemo-rs lab`` build their configurations
from these.

* ``GEO_RS``: Geo-RS, the geometric mean of the sequence's ratios kept within ``[0.99, 1.01]``:
  a band for *precision* mismatch (about 1e-3 nats per token, NeMo-RL PR #2269; in the lab's
  synchronous runs it keeps 99.9% of the sequences). Under staleness it eats the batch and costs reward
  (docs/lab.md#confirmation): there, set the band with ``nemo-rs calibrate``
  (:mod:`nemo_rs_plugin.core.correction.calibration`).
* ``OUTLIER_VETO``: reject a sequence with any token ratio outside ``[1e-4, 1e4]``.
* ``TOKEN_MIS``: token-level masked IS, tokens with a ratio outside ``[0.5, 2]`` rejected.
* ``TIS_CAP``: the truncation cap of token/sequence TIS (``truncated_importance_sampling_ratio``).

References:
    - ``GEO_RS``: Liu, Li et al., "When Speed Kills Stability: Demystifying RL Collapse from the
      Training-Inference Mismatch", https://yingru.notion.site/When-Speed-Kills-Stability-Demystifying-RL-Collapse-from-the-Training-Inference-Mismatch-271211a558b7808d8b12d403fd15edda
    - ``GEO_RS`` in VERL (its Geo-RS presets): https://verl.readthedocs.io/en/latest/algo/rollout_corr.html
    - ``GEO_RS``'s band ``[0.99, 1.01]``: SkyRL PR #849's geometric mask, https://github.com/NovaSky-AI/SkyRL/pull/849
    - The precision-mismatch scale: NeMo-RL PR #2269, https://github.com/NVIDIA-NeMo/RL/pull/2269
    - ``OUTLIER_VETO``: SkyRL PR #849's outlier-token thresholds, https://github.com/NovaSky-AI/SkyRL/pull/849
    - ``TOKEN_MIS``: IcePop (Ant Group's Ling team), https://ringtech.notion.site/icepop
    - ``TIS_CAP``: TIS, Yao, Liu et al., "Your Efficient RL Framework Secretly Brings You Off-Policy RL
      Training", https://fengyao.notion.site/off-policy-rl
    - :func:`dppo`: Qi et al., "Rethinking the Trust Region in LLM Reinforcement Learning",
      https://arxiv.org/abs/2602.04879; prime-rl's default loss, https://docs.primeintellect.ai/prime-rl/algorithms
    - :func:`ipo`: prime-rl's IPO loss, https://docs.primeintellect.ai/prime-rl/ipo.md
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "PLUGIN_LOSS_NAME",
    "NEMO_RL_LOSS_NAME",
    "selects_nemo_rl_loss",
    "dppo",
    "ipo",
    "FILTERS",
    "GEO_RS",
    "OUTLIER_VETO",
    "TOKEN_MIS",
    "TIS_CAP",
    "IS_ON",
    "tis",
    "is_level",
]

#: The name a recipe selects this loss by (``loss_fn.name``; NeMo-RL's registry of the plugin maps it).
PLUGIN_LOSS_NAME = "rs_clipped_pg"
#: The name of NeMo-RL's own ``ClippedPGLossFn`` in the plugin's registry; no name selects it too.
NEMO_RL_LOSS_NAME = "clipped_pg"


def selects_nemo_rl_loss(name: Any) -> bool:
    """Whether ``loss_fn.name`` builds NeMo-RL's own loss (no name, or ``clipped_pg``), which ignores plugin fields."""
    return name is None or name == NEMO_RL_LOSS_NAME


GEO_RS: dict[str, Any] = {"level": "sequence", "statistic": "ratio", "agg": "mean", "lower": 0.99, "upper": 1.01}
OUTLIER_VETO: dict[str, Any] = {"level": "sequence", "statistic": "ratio", "agg": "any", "lower": 1e-4, "upper": 1e4}
TOKEN_MIS: dict[str, Any] = {"level": "token", "statistic": "ratio", "lower": 0.5, "upper": 2.0}
TIS_CAP = 2.0
#: The filter presets by the names the tools accept (``nemo-rs calibrate --filters``).
FILTERS: dict[str, dict[str, Any]] = {"geo-rs": GEO_RS, "token-mis": TOKEN_MIS, "outlier-veto": OUTLIER_VETO}
#: Importance sampling switched on (the level decides what the weight is).
IS_ON: dict[str, Any] = {"use_importance_sampling_correction": True}


def is_level(level: str) -> dict[str, Any]:
    """IS on, at ``level`` (``token``, ``sequence`` or ``sequence_mean``)."""
    return {**IS_ON, "is_correction_level": level}


def tis(level: str, cap: float = TIS_CAP) -> dict[str, Any]:
    """IS at ``level``, weights truncated at ``cap`` (TIS)."""
    return {
        **is_level(level),
        "truncated_importance_sampling_type": "tis",
        "truncated_importance_sampling_ratio": cap,
    }


def _prime_rl_trust_region(filters: list, kl_tau: float) -> dict[str, Any]:
    """prime-rl's objective around its mask (docs/guide.md#prime-rl-dppo).

    ``-A exp(curr - gen)`` on kept tokens, no clip, and ``kl_tau (curr - gen)^2`` on every loss token.
    """
    return {
        "force_on_policy_ratio": True,  # ratio exp(curr - sg(curr)): 1 in value, the gradient kept
        "use_importance_sampling_correction": True,  # times sg(exp(curr - gen)) at the token level
        "reference_policy_kl_penalty": 0.0,  # prime-rl's RL loss has no reference KL
        "sampler_kl_penalty": kl_tau,
        "rejection_sampling": filters,
    }


def _prob_diff_filter(**bounds: Any) -> dict[str, Any]:
    return {
        "level": "token",
        "statistic": "prob_diff",
        "log_ratio": "curr-gen",
        **bounds,
        "applies_to": "policy_gradient",
    }


def dppo(mask_high: float = 0.2, mask_low: float = 0.2, kl_tau: float = 1e-3) -> dict[str, Any]:
    """prime-rl's default loss (DPPO + the sampler KL), at its defaults.

    The policy term is dropped where ``p_curr - p_gen > mask_high`` with ``A > 0`` or
    ``< -mask_low`` with ``A < 0``.
    """
    return _prime_rl_trust_region(
        [
            _prob_diff_filter(advantage_sign="positive", upper=mask_high),
            _prob_diff_filter(advantage_sign="negative", lower=-mask_low),
        ],
        kl_tau,
    )


def ipo(threshold: float = 0.1, kl_tau: float = 1e-3) -> dict[str, Any]:
    """prime-rl's IPO loss: the policy term dropped where ``|p_curr - p_gen| > threshold``."""
    return _prime_rl_trust_region([_prob_diff_filter(lower=-threshold, upper=threshold)], kl_tau)
