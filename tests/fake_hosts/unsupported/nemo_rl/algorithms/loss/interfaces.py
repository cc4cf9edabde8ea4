import enum


class LossType(enum.Enum):
    TOKEN_LEVEL = "token_level"
    SEQUENCE_LEVEL = "sequence_level"


class LossInputType(enum.Enum):
    LOGIT = "logit"
    LOGPROB = "logprob"


class MetricNormalizer(enum.Enum):
    TOKENS = "tokens"
    SEQUENCES = "sequences"
    NONE = "none"
