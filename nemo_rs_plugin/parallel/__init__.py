"""The sharded input path: logits split over tensor-parallel ranks and sequences over context-parallel ranks.

Built on :mod:`nemo_rs_plugin.core` (the loss and its one collective); imports neither NeMo-RL
nor megatron-core: the groups come from the caller.
"""
