from nemo_rl.algorithms.loss import ClippedPGLossConfig, ClippedPGLossFn


def build_loss(loss_config: ClippedPGLossConfig, use_fused_linear_logprobs: bool = False):
    # The construction site, as in NeMo-RL's GRPO setup.
    return ClippedPGLossFn(loss_config, use_fused_linear_logprobs=use_fused_linear_logprobs)
