from nemo_rl.algorithms import loss as loss_lib


def build_loss(loss_config, use_fused_linear_logprobs=False):
    # The construction site of a NeMo-RL that reaches the loss through its module.
    return loss_lib.ClippedPGLossFn(loss_config, use_fused_linear_logprobs=use_fused_linear_logprobs)
