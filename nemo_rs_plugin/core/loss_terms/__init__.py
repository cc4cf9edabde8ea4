"""The objective: the clipped policy-gradient terms, KL, NLL and their aggregation with NeMo-RL's global counts."""
