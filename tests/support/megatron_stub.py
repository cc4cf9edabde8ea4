"""A stand-in for megatron-core's ``parallel_state`` (CPU tests have no megatron-core)."""

import sys
import types


def install_parallel_state(tp_group, cp_group, dp_group=None):
    """Register ``megatron.core.parallel_state`` reporting the given groups as initialised."""
    stub = types.ModuleType("megatron.core.parallel_state")
    stub.model_parallel_is_initialized = lambda: True
    stub.get_tensor_model_parallel_group = lambda: tp_group
    stub.get_context_parallel_group = lambda: cp_group
    stub.get_data_parallel_group = lambda: dp_group
    core_mod = types.ModuleType("megatron.core")
    core_mod.parallel_state = stub
    sys.modules.update(
        {"megatron": types.ModuleType("megatron"), "megatron.core": core_mod, "megatron.core.parallel_state": stub}
    )
    return stub
