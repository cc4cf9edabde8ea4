"""The package's layers: every import inside ``nemo_rs_plugin`` goes down, and none forms a circle.

Layers, bottom up: ``core`` (tensor math: torch and pydantic only), ``parallel`` (the sharded
path), ``nemo_rl`` (the glue: the only layer that imports NeMo-RL), ``tools`` (the user's
commands), ``lab`` (the experiment: the only layer with transformers and the statistics
libraries). Above them all, outside the layers, ``nemo_rs_plugin/cli.py`` is the program that
assembles the commands; no layer imports it.
The start-up hook ``_nemo_rs_plugin_hook`` is the ground: standard library only, importing
nothing of the package. Imports inside functions count as much as those at the top.
"""

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "nemo_rs_plugin"
LAYERS = ("core", "parallel", "nemo_rl", "tools", "lab")
#: Third-party imports each layer may make (beyond the standard library and lower layers).
#: ``omegaconf`` is optional everywhere: a config handed over as OmegaConf is read as a dict.
ALLOWED_THIRD_PARTY = {
    "core": {"torch", "pydantic", "omegaconf"},
    "parallel": {"torch"},
    "nemo_rl": {"torch", "pydantic", "omegaconf", "yaml", "nemo_rl", "megatron", "_nemo_rs_plugin_hook"},
    "tools": {"torch", "pydantic", "omegaconf", "yaml", "nemo_rl", "matplotlib", "numpy"},
    "lab": {"torch", "matplotlib", "transformers", "numpy", "scipy", "statsmodels"},
}
#: The modules above every layer: nothing of the package imports them.
PROGRAM = ("nemo_rs_plugin.cli",)


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module) of every import in ``path``, at any depth."""
    tree = ast.parse(path.read_text(), str(path))
    package = ".".join(path.relative_to(REPO).with_suffix("").parts[:-1])
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            found.append((node.lineno, module))
            # `from nemo_rs_plugin.core import loss` imports the module nemo_rs_plugin.core.loss
            found += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
    return found


def _layer_of(module: str):
    parts = module.split(".")
    if parts[0] != "nemo_rs_plugin" or len(parts) < 2 or parts[1] not in LAYERS:
        return None
    return parts[1]


def _product_modules():
    return sorted(p for p in PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", _product_modules(), ids=lambda p: str(p.relative_to(REPO)))
def test_imports_only_go_down(path):
    rel = path.relative_to(PACKAGE).parts
    own = rel[0] if rel[0] in LAYERS else None
    if own is None:  # nemo_rs_plugin/__init__.py: the public names, resolved lazily by string
        return
    rank = LAYERS.index(own)
    upward = []
    for line, module in _imports(path):
        layer = _layer_of(module)
        if layer is not None and LAYERS.index(layer) > rank:
            upward.append(f"line {line}: {module} ({layer} is above {own})")
        if module.split(".")[0] == "nemo_rs_plugin" and layer is None and module not in ("nemo_rs_plugin",):
            upward.append(f"line {line}: {module} (not in a layer)")
    assert not upward, upward


@pytest.mark.parametrize("path", _product_modules(), ids=lambda p: str(p.relative_to(REPO)))
def test_third_party_imports_stay_in_their_layer(path):
    import sys

    rel = path.relative_to(PACKAGE).parts
    if rel[0] not in LAYERS:
        return
    allowed = ALLOWED_THIRD_PARTY[rel[0]]
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    foreign = [
        f"line {line}: {module}"
        for line, module in _imports(path)
        if module.split(".")[0] not in stdlib | allowed | {"nemo_rs_plugin"}
        and not module.startswith(("typing_extensions",))
    ]
    assert not foreign, foreign


def test_the_start_up_hook_imports_nothing_of_the_package():
    hook = REPO / "_nemo_rs_plugin_hook.py"
    import sys

    modules = {module.split(".")[0] for _, module in _imports(hook)}
    assert modules <= set(sys.stdlib_module_names), modules - set(sys.stdlib_module_names)


def test_no_circle_between_modules():
    """Module-level graph of the package (hook included): no module reaches itself."""
    graph = {}
    for path in _product_modules():
        name = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
        graph[name] = {m for _, m in _imports(path) if m.startswith("nemo_rs_plugin.") or m == "_nemo_rs_plugin_hook"}
    graph["_nemo_rs_plugin_hook"] = {m for _, m in _imports(REPO / "_nemo_rs_plugin_hook.py")}
    graph = {k: {m for m in v if m in graph and m != k} for k, v in graph.items()}
    # Packages' __init__ files import nothing of their modules here; an edge into one is no edge back.
    state, circles = {}, []

    def visit(node, stack):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                circles.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not circles, circles


def test_every_folder_of_the_package_is_a_layer_and_only_the_program_sits_above():
    """A new folder must be placed in LAYERS (and so in the import rules); a module beside the
    layers is the program (``cli.py``) or the package's ``__init__``, and no layer imports it."""
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders == set(LAYERS), folders ^ set(LAYERS)
    loose = {p.stem for p in PACKAGE.glob("*.py")}
    assert loose == {"__init__", "cli"}, loose
    importers = [
        f"{path.relative_to(REPO)} line {line}"
        for path in _product_modules()
        if path.relative_to(PACKAGE).parts[0] in LAYERS
        for line, module in _imports(path)
        if module in PROGRAM
    ]
    assert not importers, importers


#: core/'s parts in the order of one loss call, bottom up (docs/architecture.md): the tensor
#: primitives and the evaluation form, what the config's names mean, the config, the metric machinery, the inputs, the
#: correction, the objective, then the loss. Each imports only from the parts before it.
CORE_ORDER = (
    "masking",
    "distributed",
    "evaluation",
    "policy_loss",
    "registries",
    "settings",
    "reporting",
    "batch",
    "correction",
    "loss_terms",
    "compiled",
    "loss",
)


def test_core_parts_import_only_the_parts_below():
    core = PACKAGE / "core"
    parts = {p.relative_to(core).parts[0].removesuffix(".py") for p in core.rglob("*.py")} - {"__init__"}
    assert parts == set(CORE_ORDER), parts ^ set(CORE_ORDER)
    upward = []
    for path in sorted(core.rglob("*.py")):
        own = path.relative_to(core).parts[0].removesuffix(".py")
        if own == "__init__":
            continue
        for line, module in _imports(path):
            names = module.split(".")
            if names[:2] != ["nemo_rs_plugin", "core"] or len(names) < 3 or names[2] == own:
                continue
            if CORE_ORDER.index(names[2]) > CORE_ORDER.index(own):
                upward.append(f"{path.relative_to(REPO)}:{line}: {module} ({names[2]} is above {own})")
    assert not upward, upward
