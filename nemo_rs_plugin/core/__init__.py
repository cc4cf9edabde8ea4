"""The tensor math: config, per-token and per-sequence statistics, IS weights, rejection filters, the loss.

Imports torch and pydantic only: neither NeMo-RL nor Megatron. ``distributed`` holds the one
collective the loss issues (over the groups the caller passes in); ``compiled`` the opt-in
``torch.compile`` of the tensor core.
"""
