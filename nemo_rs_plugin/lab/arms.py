"""The lab's arms: each compared loss configuration, built from :mod:`nemo_rs_plugin.core.settings.presets`.

Which arms a run compares (:data:`DEFAULT_ARMS` for the single-lag run of docs/lab.md,
:data:`DOSE_ARMS` for the dose-response run) and the GRPO loss fields they share
(:data:`BASE_LOSS`). The training loop that runs them is :mod:`~nemo_rs_plugin.lab.experiment`.
"""

from __future__ import annotations

from dataclasses import dataclass

from nemo_rs_plugin.core.settings import presets

__all__ = ["Arm", "BASE_LOSS", "CONFIGS", "DEFAULT_ARMS", "DOSE_ARMS", "DOSE_LAGS", "SEQ_MASK_TIS_BOUNDS"]


@dataclass(frozen=True)
class Arm:
    """One compared configuration: its loss section, and how its sampler or band is set."""

    loss: dict
    """The ``loss_fn`` fragment (the common fields are in :data:`BASE_LOSS`)."""
    on_policy: bool = False
    """Sampler in float32 with no lag: the reference without mismatch (no correction)."""
    calibrated: tuple = ()
    """Filter templates whose bounds are set from this run's own first ``calibration_steps``
    steps (:func:`~nemo_rs_plugin.core.correction.calibration.calibrate_filters`, the function
    behind ``nemo-rs calibrate``); they run before the ``loss``'s own filters."""
    widen_only: bool = True
    """Calibrated arms: the band only widens the template's (``nemo-rs calibrate``'s default);
    ``False`` takes the quantile band however narrow (``--allow-tighter``)."""
    role: str = ""
    """``reference`` or ``control`` (a known failure kept as a check on the lab), else empty."""


#: NeMo-RL's reference bounds of ``seq-mask-tis`` (docs/guide.md, "IS correction level"), as the
#: project ships them (recipes/grpo-qwen3.5-35ba3b-4n8g-megatron-ep16-9k-seqmean.yaml; a test
#: holds the two equal): ``(truncated_importance_sampling_ratio_min, truncated_importance_sampling_ratio)``.
SEQ_MASK_TIS_BOUNDS = (0.999, 1.002)

#: The compared arms, in table order. The presets are core/settings/presets.py's.
CONFIGS: dict[str, Arm] = {
    "on-policy": Arm({}, on_policy=True, role="reference"),
    "none": Arm({}),
    "token-tis": Arm(presets.tis("token")),
    "sequence_mean": Arm(presets.is_level("sequence_mean")),
    "sequence": Arm(presets.is_level("sequence"), role="control"),
    "seqmean+geo-rs+veto": Arm(
        {**presets.is_level("sequence_mean"), "rejection_sampling": [presets.GEO_RS, presets.OUTLIER_VETO]}
    ),
    "geo-rs+token-mis": Arm({**presets.is_level("token"), "rejection_sampling": [presets.GEO_RS, presets.TOKEN_MIS]}),
    "seqmean+calibrated-geo-rs+veto": Arm(
        {**presets.is_level("sequence_mean"), "rejection_sampling": [presets.OUTLIER_VETO]},
        calibrated=(presets.GEO_RS,),
    ),
    # Not in the default run: the quantile band without the template as its floor (docs/lab.md, lag 0).
    "seqmean+quantile-geo-rs+veto": Arm(
        {**presets.is_level("sequence_mean"), "rejection_sampling": [presets.OUTLIER_VETO]},
        calibrated=(presets.GEO_RS,),
        widen_only=False,
    ),
    # The async recipe's correction exactly as shipped (recipes/grpo-qwen3-30ba3b-4n8g-megatron-
    # async-tokentis.yaml; a test holds the arm equal to the recipe's loss section).
    "token-tis+veto": Arm({**presets.tis("token"), "rejection_sampling": [presets.OUTLIER_VETO]}),
    # Peers' single mechanisms. Token-MIS alone (AReaL #1218's "Token-MIS alone"; IcePop at
    # [0.5, 2]): token IS weights, tokens with a ratio outside TOKEN_MIS's band rejected.
    "token-mis": Arm({**presets.is_level("token"), "rejection_sampling": [presets.TOKEN_MIS]}),
    # Sequence-level masked IS: NeMo-RL's seq-mask-tis as NeMo-RL runs it (token IS weights,
    # untruncated; sequences whose geometric-mean ratio is outside the bounds zeroed).
    "seq-mis": Arm(
        {
            **presets.is_level("token"),
            "truncated_importance_sampling_type": "seq-mask-tis",
            "truncated_importance_sampling_ratio_min": SEQ_MASK_TIS_BOUNDS[0],
            "truncated_importance_sampling_ratio": SEQ_MASK_TIS_BOUNDS[1],
        }
    ),
    # The outlier-token veto alone, no IS weights.
    "veto": Arm({"rejection_sampling": [presets.OUTLIER_VETO]}),
}
#: The arms of the default single-lag run (docs/lab.md).
DEFAULT_ARMS = [
    "on-policy",
    "none",
    "token-tis",
    "sequence_mean",
    "sequence",
    "seqmean+geo-rs+veto",
    "geo-rs+token-mis",
    "seqmean+calibrated-geo-rs+veto",
]
#: The arms of the dose-response run (``--lags``): the reference, no correction, the
#: configurations the project recommends as shipped, and peers' single mechanisms.
DOSE_ARMS = [
    "on-policy",
    "none",
    "token-tis+veto",
    "seqmean+geo-rs+veto",
    "seqmean+calibrated-geo-rs+veto",
    "token-mis",
    "seq-mis",
    "veto",
]
#: The lags of the dose-response run, in optimizer steps (2 per rollout batch).
DOSE_LAGS = [0, 1, 2, 4, 8]

# GRPO as NeMo-RL's grpo_math_1B: PPO clip 0.2 both sides, token-level loss, no KL penalty.
BASE_LOSS = {
    "reference_policy_kl_penalty": 0.0,
    "ratio_clip_min": 0.2,
    "ratio_clip_max": 0.2,
    "token_level_loss": True,
}
