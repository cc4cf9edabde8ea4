"""The evaluation form (``core/evaluation.py``): which form a call gets, and that it is one object.

That every form computes the same loss, gradient and metrics is held where the forms differ:
``test_metrics.py`` (rows stacked or one by one), ``test_inputs.py`` (inputs used as given where the
host may read them), ``test_compile.py`` (compiled against eager).
"""

from types import SimpleNamespace

import torch

from nemo_rs_plugin import CorrectedPGLoss
from nemo_rs_plugin.core.distributed import NO_GROUPS
from nemo_rs_plugin.core.evaluation import ROW_BY_ROW, EvaluationForm, evaluation_form

CPU, CUDA, SHARDED = torch.device("cpu"), torch.device("cuda"), SimpleNamespace(active=True)


def test_host_reads_only_where_free():
    """Only the eager core, on the CPU, in the CPU form, unsharded, reads values on the host."""
    eager = CorrectedPGLoss({})
    assert evaluation_form(eager, CPU, NO_GROUPS) == EvaluationForm(host_reads=True)
    assert evaluation_form(eager, CUDA, NO_GROUPS) == EvaluationForm(batched=True)
    assert evaluation_form(CorrectedPGLoss({}, batched_metrics=True), CPU, NO_GROUPS) == EvaluationForm(batched=True)
    assert evaluation_form(eager, CPU, SHARDED) == EvaluationForm()


def test_a_compiled_call_is_row_by_row_unless_forced_and_a_sharded_one_is_eager():
    """Inductor fuses the per-row reductions (stacking would add copies); collectives stay eager."""
    compiled = CorrectedPGLoss({"compile": True})
    assert evaluation_form(compiled, CPU, NO_GROUPS) == EvaluationForm(compiled=True)
    assert evaluation_form(compiled, CUDA, NO_GROUPS) == EvaluationForm(compiled=True)
    forced = CorrectedPGLoss({"compile": True}, batched_metrics=True)
    assert evaluation_form(forced, CUDA, NO_GROUPS) == EvaluationForm(batched=True, compiled=True)
    assert evaluation_form(compiled, CPU, SHARDED) == EvaluationForm()


def test_a_standalone_caller_gets_its_device_s_eager_form_reading_nothing_on_the_host():
    """``plan``/``compute_correction`` alone and ``microbatch_totals``: nothing is read on the host there."""
    assert EvaluationForm.for_device(CUDA) == EvaluationForm(batched=True)
    assert EvaluationForm.for_device(CPU) == ROW_BY_ROW == EvaluationForm()
    assert EvaluationForm.for_device(CPU, batched=True) == EvaluationForm(batched=True)
