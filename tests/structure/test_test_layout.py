"""The tests mirror the code: every module of ``nemo_rs_plugin/core`` has its test file, or names where it is tested.

``tests/core/test_<module>.py`` is the test of ``core/**/<module>.py`` (tests/README.md). A few
modules have no behaviour a caller can reach apart from the loss call they serve (the compiled
core, the sharded reductions, the metrics NeMo-RL's parity needs); :data:`TESTED_ELSEWHERE`
names the file that tests each and why, so a new module without a test, or an entry left
behind when a module gets its own file, fails here.
"""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CORE = REPO / "nemo_rs_plugin" / "core"

#: Core modules without a test file of their own: the file that tests them, and why there.
TESTED_ELSEWHERE = {
    "batch/sanitizing.py": ("tests/core/test_inputs.py", "its masks and counts are observable through a loss call"),
    "compiled.py": ("tests/core/test_compile.py", "the compiled core is the eager core under torch.compile"),
    "distributed.py": ("tests/parallel/test_distributed.py", "its reductions need several gloo ranks"),
    "loss.py": ("tests/core/test_parity.py", "the loss call against NeMo-RL's recorded outputs, and every core test"),
    "loss_terms/parity_metrics.py": ("tests/core/test_parity.py", "NeMo-RL's metrics, against its recorded values"),
    "reporting/metric_kernels.py": ("tests/core/test_metrics.py", "the kernels the metric set evaluates with"),
}


def core_modules() -> list[str]:
    return sorted(str(p.relative_to(CORE)) for p in CORE.rglob("*.py") if p.name != "__init__.py")


def test_every_core_module_has_its_test_file_or_names_where_it_is_tested():
    missing = [
        m
        for m in core_modules()
        if not (REPO / "tests/core" / f"test_{Path(m).stem}.py").exists() and m not in TESTED_ELSEWHERE
    ]
    assert not missing, f"core modules without tests/core/test_<module>.py or a TESTED_ELSEWHERE entry: {missing}"


def test_every_entry_elsewhere_is_a_module_without_its_own_file_and_names_a_test_that_exists():
    modules = core_modules()
    for module, (test_file, why) in TESTED_ELSEWHERE.items():
        assert module in modules, f"{module}: no such core module (renamed or removed?)"
        own = REPO / "tests/core" / f"test_{Path(module).stem}.py"
        assert not own.exists(), f"{module} has {own.relative_to(REPO)} now: remove its TESTED_ELSEWHERE entry"
        assert (REPO / test_file).exists() and why, (module, test_file)
