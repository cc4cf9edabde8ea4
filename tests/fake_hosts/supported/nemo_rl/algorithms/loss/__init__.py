from typing import Optional

from pydantic import BaseModel

from nemo_rl.algorithms.loss.interfaces import LossInputType, LossType


class ClippedPGLossConfig(BaseModel, extra="allow"):
    disable_ppo_ratio: bool = False
    token_level_loss: bool = True
    sequence_level_importance_ratios: bool = False
    ratio_clip_min: float = 0.2
    ratio_clip_max: float = 0.2
    ratio_clip_c: Optional[float] = None
    reference_policy_kl_penalty: float = 0.01
    reference_policy_kl_type: str = "k3"
    kl_input_clamp_value: Optional[float] = 20.0
    kl_output_clamp_value: Optional[float] = 10.0
    use_kl_in_reward: bool = False
    use_importance_sampling_correction: bool = False
    truncated_importance_sampling_type: Optional[str] = None
    truncated_importance_sampling_ratio: Optional[float] = None
    truncated_importance_sampling_ratio_min: Optional[float] = None
    use_on_policy_kl_approximation: bool = False
    force_on_policy_ratio: bool = False
    use_cispo: bool = False
    positive_example_nll_weight: float = 0.0


class ClippedPGLossFn:
    input_type = LossInputType.LOGPROB

    def __init__(self, cfg, use_fused_linear_logprobs=False):
        self.use_fused_linear_logprobs = use_fused_linear_logprobs
        self.reference_policy_kl_penalty = cfg.reference_policy_kl_penalty
        self.truncated_importance_sampling_type = cfg.truncated_importance_sampling_type
        self.loss_type = LossType.TOKEN_LEVEL if cfg.token_level_loss else LossType.SEQUENCE_LEVEL
        self.metric_normalizations = {}

    def __call__(self, next_token_logprobs, data, global_valid_seqs, global_valid_toks):
        raise NotImplementedError("the fake host's own loss is never called by these tests")


# The loss wrappers' names (nemo_rs_plugin.nemo_rl.seam replaces them): stand-ins with the same
# call shapes, written for these tests.
def wrap_loss_fn_with_input_preparation(
    next_token_logits, data, global_valid_seqs, global_valid_toks, loss_fn, prepare_fn, **groups
):
    loss_input, data = prepare_fn(logits=next_token_logits, data=data, loss_fn=loss_fn, **groups)
    return loss_fn(data=data, global_valid_seqs=global_valid_seqs, global_valid_toks=global_valid_toks, **loss_input)


class SequencePackingLossWrapper:
    def __init__(self, loss_fn, prepare_fn, cu_seqlens_q, cu_seqlens_q_padded=None, **groups):
        self.loss_fn, self.prepare_fn, self.cu_seqlens_q = loss_fn, prepare_fn, cu_seqlens_q

    def __call__(self, next_token_logits, data, global_valid_seqs, global_valid_toks):
        raise NotImplementedError("the stand-in per-sequence wrapper is never called by these tests")


class SequencePackingFusionLossWrapper(SequencePackingLossWrapper):
    pass
