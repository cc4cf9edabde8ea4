"""The metrics.

The catalog (each metric declared once), the metric set and its kernels, NeMo-RL's own metrics,
the run-time warning when the filters eat the batch.
"""
