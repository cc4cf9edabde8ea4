"""The batch as the loss reads it.

NeMo-RL's data dict aligned, checked, sanitised and masked; the microbatch's totals.
"""
