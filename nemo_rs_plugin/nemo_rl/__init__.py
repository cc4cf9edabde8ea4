"""The NeMo-RL glue: the loss class NeMo-RL builds, the rules of each NeMo-RL version, and the activation.

``loss_fn`` (``RSClippedPGLossFn``, imports NeMo-RL), ``host`` (version rules, shared with
``nemo-rs check``), ``activation`` (what the start-up hook calls), ``registry`` (loss names),
``workers`` and ``recipe_defaults`` (standard library only).
"""
