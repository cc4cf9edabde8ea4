import enum


class LossInputType(enum.Enum):
    LOGIT = "logit"
