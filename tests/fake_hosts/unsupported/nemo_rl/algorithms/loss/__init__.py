from nemo_rl.algorithms.loss.interfaces import LossInputType


class ClippedPGLossConfig(dict):
    pass


class ClippedPGLossFn:
    input_type = LossInputType.LOGIT

    def __init__(self, cfg):
        self.cfg = cfg

    def __call__(self, logits, data, global_valid_seqs, global_valid_toks):
        raise NotImplementedError
