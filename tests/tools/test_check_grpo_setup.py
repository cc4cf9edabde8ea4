"""``nemo-rs check`` refuses what NeMo-RL's GRPO start-up refuses about ``loss_fn`` (issue 31, item 3).

Each rule of :data:`nemo_rs_plugin.tools.check.GRPO_SETUP_RULES` is checked three ways:

* without NeMo-RL (the version unknown): an error where every supported version refuses the
  recipe, a warning naming the versions that refuse it where only some do;
* with a stand-in NeMo-RL of each version (tests/tools/test_cli_check.py's ``fake_nemo_rl``):
  the rules of that version, and exit 0 for the fixed recipe;
* against the real NeMo-RL of each checkout in ``$NEMO_RS_NEMO_RL_CHECKOUTS``: NeMo-RL's own
  statement (found by reading its ``nemo_rl/algorithms/grpo.py`` with ``ast`` and executed alone,
  with the config sections its function binds, on the ``MasterConfig`` that ``run_grpo.py``
  builds) refuses the bad recipe exactly where ``nemo-rs check --nemo-rl`` says it does, and
  accepts the fixed one, which ``check`` calls valid.
"""

import copy
import json
import os
from pathlib import Path

import pytest

from nemo_rs_plugin.tools.check import CheckReport
from nemo_rs_plugin.tools.grpo_setup import GRPO_SETUP_RULES, NEMO_RL_VERSIONS
from tests.support.fork_server import run_python
from tests.support.nemo_rl_hosts import RUN_CLI_SOURCE, host_label, nemo_rl_hosts, no_hosts_mark, skip_or_fail
from tests.tools.test_cli_check import (
    EXIT_INVALID,
    EXIT_UNCHECKED,
    GRPO_PYDANTIC,
    GRPO_TYPEDDICT,
    LOSS,
    error_lines,
    fake_nemo_rl,
    isolated,  # noqa: F401 - the autouse fixture: NeMo-RL modules and sys.path restored
    no_nemo_rl,  # noqa: F401 - a fixture: NeMo-RL not importable
    run_check,
    write_recipe,
)

REPO = Path(__file__).resolve().parents[2]
ALL = NEMO_RL_VERSIONS
DELETE = object()

#: A whole GRPO recipe (no defaults) that passes every rule: NeMo-RL's base values where it has them.
BASE = {
    "grpo": {
        "num_prompts_per_step": 32,
        "num_generations_per_prompt": 16,
        "seq_logprob_error_threshold": None,
        "skip_reference_policy_logprobs_calculation": False,
        "async_grpo": {"enabled": False},
        "adv_estimator": {"name": "grpo"},
    },
    "policy": {
        "train_global_batch_size": 512,
        "generation": {"backend": "vllm", "vllm_cfg": {"precision": "bfloat16"}},
    },
    "loss_fn": {**LOSS, "reference_policy_kl_penalty": 0.01, "force_on_policy_ratio": False, "use_kl_in_reward": False},
}

FORCE = {"loss_fn.force_on_policy_ratio": True}
OPD = {"grpo.adv_estimator.name": "opd", "on_policy_distillation.enabled": True, **FORCE}
KL_IN_REWARD = {"loss_fn.use_kl_in_reward": True, **FORCE}
SKIP = {"grpo.skip_reference_policy_logprobs_calculation": True}
FP8 = {"policy.generation.vllm_cfg.precision": "fp8"}
ASYNC = {"grpo.async_grpo.enabled": True}
NO_IS = {"loss_fn.use_importance_sampling_correction": False}
THRESHOLD = {"grpo.seq_logprob_error_threshold": 2.0}


class Case:
    def __init__(self, bad, fixed, needle, fix, refused_by=ALL, not_applicable=(), unresolved=None):
        self.bad, self.fixed, self.needle, self.fix = bad, fixed, needle, fix
        self.refused_by, self.not_applicable = refused_by, not_applicable
        #: (field removed from the bad recipe, the not-checked line's start): the rule does not guess.
        self.unresolved = unresolved


#: One per rule: the recipe NeMo-RL refuses, the fix, and the versions whose GRPO start-up refuses it
#: (read from each version's nemo_rl/algorithms/grpo.py; see the docstrings of the rules in check.py).
CASES = {
    "force_on_policy_ratio": Case(
        bad={**FORCE, "policy.train_global_batch_size": 256},
        fixed=FORCE,
        needle="loss_fn.force_on_policy_ratio: got true with policy.train_global_batch_size: 256, but "
        "grpo.num_prompts_per_step * grpo.num_generations_per_prompt is 32 * 16 = 512",
        fix="set policy.train_global_batch_size: 512",
        unresolved=("policy.train_global_batch_size", "loss_fn.force_on_policy_ratio: true: policy.train_global"),
    ),
    "async_grpo": Case(
        bad={**ASYNC, **NO_IS},
        fixed=ASYNC,
        needle="loss_fn.use_importance_sampling_correction: got false with grpo.async_grpo.enabled: true",
        fix="set loss_fn.use_importance_sampling_correction: true",
        unresolved=("loss_fn.use_importance_sampling_correction", "grpo.async_grpo.enabled: true: loss_fn.use_imp"),
    ),
    "skip_reference": Case(
        bad=SKIP,
        fixed={**SKIP, "loss_fn.reference_policy_kl_penalty": 0.0},
        needle="grpo.skip_reference_policy_logprobs_calculation: got true with "
        "loss_fn.reference_policy_kl_penalty: 0.01",
        fix="set loss_fn.reference_policy_kl_penalty: 0",
        unresolved=("loss_fn.reference_policy_kl_penalty", "grpo.skip_reference_policy_logprobs_calculation: true"),
    ),
    # v0.6.0 checks it in grpo_train only; its async_grpo_train ignores the flag.
    "skip_reference_async": Case(
        bad={**SKIP, **ASYNC},
        fixed={**SKIP, **ASYNC, "loss_fn.reference_policy_kl_penalty": 0.0},
        needle="grpo.skip_reference_policy_logprobs_calculation: got true with "
        "loss_fn.reference_policy_kl_penalty: 0.01",
        fix="set loss_fn.reference_policy_kl_penalty: 0",
        refused_by=("v0.7.0", "main"),
    ),
    "fp8": Case(
        bad={**FP8, **NO_IS},
        fixed=FP8,
        needle="loss_fn.use_importance_sampling_correction: got false with vLLM FP8 generation "
        "(policy.generation.vllm_cfg.precision: fp8)",
        fix="set loss_fn.use_importance_sampling_correction: true",
        unresolved=("policy.generation.backend", "policy.generation.vllm_cfg.precision: fp8: policy.generation.b"),
    ),
    "use_kl_in_reward": Case(
        bad=KL_IN_REWARD,
        fixed={**KL_IN_REWARD, **THRESHOLD},
        needle="loss_fn.use_kl_in_reward: got true with reference_policy_kl_penalty: 0.01 and "
        "force_on_policy_ratio: true",
        fix="set loss_fn.use_kl_in_reward: false",
        refused_by=("main",),
        unresolved=("grpo.seq_logprob_error_threshold", "loss_fn.use_kl_in_reward: true: grpo.seq_logprob_error"),
    ),
    "opd": Case(
        bad=OPD,
        fixed={**OPD, **THRESHOLD},
        needle="loss_fn.force_on_policy_ratio: got true with on-policy distillation",
        fix="set loss_fn.force_on_policy_ratio: false",
        refused_by=("v0.7.0", "main"),
        not_applicable=("v0.6.0",),
        unresolved=("grpo.seq_logprob_error_threshold", "grpo.adv_estimator.name: opd: grpo.seq_logprob_error"),
    ),
}


def recipe(changes, base=BASE):
    data = copy.deepcopy(base)
    for dotted, value in changes.items():
        *parents, key = dotted.split(".")
        node = data
        for part in parents:
            node = node.setdefault(part, {})
        if value is DELETE:
            del node[key]
        else:
            node[key] = value
    return data


def verdict(case, versions):
    """``"error"``, ``"warning"`` or ``None``: what check says about ``case.bad`` when the run may use ``versions``."""
    candidates = [v for v in versions if v not in case.not_applicable]
    refusing = [v for v in candidates if v in case.refused_by]
    if refusing and len(refusing) == len(candidates):
        return "error"
    return "warning" if refusing else None


def warning_lines(out):
    return [line for line in out.splitlines() if line.startswith("warning: ")]


def not_checked_lines(err):
    return [line for line in err.splitlines() if line.startswith("not checked: ")]


def named(versions):
    return versions[0] if len(versions) == 1 else ", ".join(versions[:-1]) + " and " + versions[-1]


@pytest.mark.parametrize("rule", GRPO_SETUP_RULES, ids=lambda rule: rule.__name__)
def test_every_rule_has_a_case_that_breaks_it_and_a_fix(rule):
    def refusal(changes):
        cfg = recipe(changes)
        return rule(cfg, cfg["loss_fn"], CheckReport())

    broken = [name for name, case in CASES.items() if refusal(case.bad) is not None]
    assert broken, f"no case breaks {rule.__name__}"
    assert all(refusal(CASES[name].fixed) is None for name in broken)


# --------------------------------------------------------------------------- NeMo-RL's version unknown
@pytest.mark.parametrize("name", CASES)
@pytest.mark.usefixtures("no_nemo_rl")
def test_without_nemo_rl_every_version_s_refusal_is_an_error_and_some_versions_a_warning(name, tmp_path, capsys):
    case = CASES[name]
    code, out, err = run_check(capsys, write_recipe(tmp_path / "bad.yaml", recipe(case.bad)))
    expected = verdict(case, ALL)
    if expected == "error":
        assert code == EXIT_INVALID, (out, err)
        [line] = error_lines(err)
        assert line.startswith(f"error: {case.needle}"), line
        assert case.fix in line and "refuse it at start-up" in line, line
        refusing = [v for v in ALL if v in case.refused_by and v not in case.not_applicable]
        assert f"NeMo-RL {named(refusing)} refuse it at start-up: {case.fix}" in line, line
    else:  # refused by some versions only: which runs is not known here
        assert code == EXIT_UNCHECKED and not error_lines(err), (out, err)
        [line] = [w for w in warning_lines(out) if case.needle in w]
        assert "not known here (pass --nemo-rl PATH)" in line and case.fix in line, line
        assert f"NeMo-RL {named(case.refused_by)} refuse" in line, line


@pytest.mark.parametrize("name", CASES)
@pytest.mark.usefixtures("no_nemo_rl")
def test_without_nemo_rl_the_fixed_recipe_has_no_error_warning_or_unchecked_line_of_its_own(name, tmp_path, capsys):
    case = CASES[name]
    code, out, err = run_check(capsys, write_recipe(tmp_path / "fixed.yaml", recipe(case.fixed)))
    assert code == EXIT_UNCHECKED and not error_lines(err), (out, err)  # NeMo-RL itself was not checked
    [line] = not_checked_lines(err)
    assert "NeMo-RL is not installed" in line
    assert not [w for w in warning_lines(out) if case.needle.split(":")[0] in w and "refuse" in w], out


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c.unresolved])
def test_an_unresolved_input_is_not_checked_never_an_error(name, tmp_path, capsys):
    """A field the rule needs is not in the recipe (or in defaults not found): not checked, with what and how."""
    case = CASES[name]
    field_, start = case.unresolved
    host = fake_nemo_rl(tmp_path / "RL", GRPO_PYDANTIC + MAIN_MARKER)  # a version that refuses every case
    code, out, err = run_check(
        capsys, write_recipe(tmp_path / "r.yaml", recipe({**case.bad, field_: DELETE})), "--nemo-rl", str(host)
    )
    assert code == EXIT_UNCHECKED and not error_lines(err), (out, err)
    [line] = not_checked_lines(err)
    assert line.startswith(f"not checked: {start}"), line
    assert field_ in line and "set it in the recipe" in line, line


@pytest.mark.usefixtures("no_nemo_rl")
def test_defaults_not_found_leave_the_rule_unchecked(tmp_path, capsys):
    data = {"defaults": "../../grpo_math_1B.yaml", "loss_fn": {**LOSS, "force_on_policy_ratio": True}}
    code, out, err = run_check(capsys, write_recipe(tmp_path / "r.yaml", data))
    assert code == EXIT_UNCHECKED and not error_lines(err), (out, err)
    assert any(line.startswith("not checked: loss_fn.force_on_policy_ratio: true:") for line in err.splitlines())


@pytest.mark.usefixtures("no_nemo_rl")
def test_async_without_the_field_keeps_the_warning(tmp_path, capsys):
    data = recipe({**ASYNC, "loss_fn.use_importance_sampling_correction": DELETE})
    code, out, err = run_check(capsys, write_recipe(tmp_path / "r.yaml", data))
    assert code == EXIT_UNCHECKED and not error_lines(err), err
    assert "async_grpo.enabled is true but loss_fn.use_importance_sampling_correction is false (not set" in out


# --------------------------------------------------------------------------- a stand-in NeMo-RL of each version
MAIN_MARKER = "\n\ndef _validate_use_kl_in_reward_compat(master_config):  # main's GRPO module has it\n    pass\n"
STAND_INS = {
    "v0.6.0": (GRPO_TYPEDDICT, True),
    "v0.7.0": (GRPO_PYDANTIC, False),
    "main": (GRPO_PYDANTIC + MAIN_MARKER, False),
}


@pytest.mark.parametrize("version", STAND_INS)
@pytest.mark.parametrize("name", CASES)
def test_with_nemo_rl_the_rules_of_its_version_apply(name, version, tmp_path, capsys):
    case = CASES[name]
    grpo, typeddict = STAND_INS[version]
    host = fake_nemo_rl(tmp_path / "RL", grpo, typeddict=typeddict)
    bad = write_recipe(tmp_path / "bad.yaml", recipe(case.bad))
    code, out, err = run_check(capsys, bad, "--nemo-rl", str(host))
    if verdict(case, (version,)) == "error":
        assert code == EXIT_INVALID, (out, err)
        [line] = error_lines(err)
        assert line.startswith(f"error: {case.needle}") and case.fix in line, line
        assert f"NeMo-RL {version} refuses it at start-up" in line, line
    else:
        assert code == 0 and not error_lines(err), (out, err)
    fixed = write_recipe(tmp_path / "fixed.yaml", recipe(case.fixed))
    code, out, err = run_check(capsys, fixed, "--nemo-rl", str(host))
    assert code == 0 and f"{fixed}: valid" in out and not error_lines(err), (out, err)
    assert not [w for w in warning_lines(out) if case.needle in w], out


@pytest.mark.parametrize(
    "version, name, needle",
    [
        ("v0.7.0", "use_kl_in_reward", "v0.7.0 starts and its advantage estimator computes the reward's KL"),
        ("v0.6.0", "skip_reference_async", "v0.6.0's async GRPO ignores"),
        ("v0.6.0", "use_kl_in_reward", None),  # v0.6.0 always computes prev_logprobs: nothing to say
    ],
)
def test_a_version_that_starts_anyway_gets_a_warning_where_it_matters(version, name, needle, tmp_path, capsys):
    """v0.7.0 computes use_kl_in_reward against zero prev_logprobs; v0.6.0's async GRPO ignores the skip flag."""
    grpo, typeddict = STAND_INS[version]
    host = fake_nemo_rl(tmp_path / "RL", grpo, typeddict=typeddict)
    bad = write_recipe(tmp_path / "bad.yaml", recipe(CASES[name].bad))
    code, out, err = run_check(capsys, bad, "--nemo-rl", str(host))
    assert code == 0, (out, err)
    lines = [w for w in warning_lines(out) if CASES[name].needle in w]
    if needle is None:
        assert lines == [], out
    else:
        [line] = lines
        assert needle in line and CASES[name].fix in line, line


# --------------------------------------------------------------------------- --json
@pytest.mark.usefixtures("no_nemo_rl")
def test_json_output_is_one_object_with_the_exit_code_and_its_meaning(tmp_path, capsys):
    case = CASES["force_on_policy_ratio"]
    bad = write_recipe(tmp_path / "bad.yaml", recipe(case.bad))
    _, _, text_err = run_check(capsys, bad)
    code, out, err = run_check(capsys, bad, "--json")
    report = json.loads(out)  # stdout is the JSON object alone
    assert code == report["exit_code"] == EXIT_INVALID and report["result"] == "invalid"
    assert [f"error: {e}" for e in report["errors"]] == error_lines(text_err)
    assert set(report["exit_codes"]) == {"0", "2", "3"} and report["exit_codes"]["2"].startswith("invalid: ")
    assert report["unchecked"] and "NeMo-RL is not installed" in report["unchecked"][0]
    assert report["nemo_rl"] is False and report["nemo_rl_versions"] == list(ALL)
    assert not error_lines(err)  # nothing but the JSON speaks

    warned = write_recipe(tmp_path / "warned.yaml", recipe(CASES["use_kl_in_reward"].bad))
    code, out, _ = run_check(capsys, warned, "--json")
    report = json.loads(out)
    assert code == report["exit_code"] == EXIT_UNCHECKED and report["result"] == "not_fully_checked"
    assert report["errors"] == [] and any(CASES["use_kl_in_reward"].needle in w for w in report["warnings"])
    assert report["pipeline"] and isinstance(report["notes"], list)


def test_json_with_a_stand_in_host_says_valid(tmp_path, capsys):
    host = fake_nemo_rl(tmp_path / "RL", GRPO_PYDANTIC + MAIN_MARKER)
    fixed = write_recipe(tmp_path / "fixed.yaml", recipe(CASES["use_kl_in_reward"].fixed))
    code, out, _ = run_check(capsys, fixed, "--nemo-rl", str(host), "--json")
    report = json.loads(out)
    assert code == report["exit_code"] == 0 and report["result"] == "valid"
    assert report["errors"] == report["unchecked"] == [] and report["nemo_rl_versions"] == ["main"]


@pytest.mark.usefixtures("no_nemo_rl")
def test_json_reports_bad_options_too(tmp_path, capsys):
    code, out, err = run_check(capsys, write_recipe(tmp_path / "r.yaml", BASE), "--mismatch", "-1", "--json")
    report = json.loads(out)
    assert code == report["exit_code"] == EXIT_INVALID and not err
    assert report["errors"] == ["--mismatch: got -1.0; allowed: a finite number >= 0"]


# --------------------------------------------------------------------------- the real NeMo-RL
HOSTS = nemo_rl_hosts()

#: Run in a fresh interpreter per checkout (NeMo-RL's import takes seconds): for each recipe, what
#: NeMo-RL's own statement does with it, and what ``nemo-rs check --nemo-rl`` says.
HOST_SCRIPT = (
    r"""
import ast, contextlib, importlib.util, inspect, io, json, sys, textwrap, warnings

checkout, repo, root, jobs = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
if checkout:
    sys.path.insert(0, checkout)
sys.path.append(repo)
from tests.support import nemo_rl_shims  # Python 3.11 / CPU torch (see that module)

nemo_rl_shims.install()
"""
    + RUN_CLI_SOURCE
    + r'''
try:
    from omegaconf import OmegaConf
    from nemo_rl.algorithms import grpo
    from nemo_rl.utils import config as host_config
except Exception as exc:
    print(json.dumps({"import_error": f"{type(exc).__name__}: {exc}"}))
    sys.exit(0)

SECTIONS = {"policy_config", "generation_config", "loss_config", "grpo_config"}


def master_config(path):
    """As examples/run_grpo.py builds it: load_config, resolved, MasterConfig where that is a model."""
    if hasattr(host_config, "register_omegaconf_resolvers"):
        host_config.register_omegaconf_resolvers()
    cfg = OmegaConf.to_container(host_config.load_config(path), resolve=True)
    return grpo.MasterConfig(**cfg) if hasattr(grpo.MasterConfig, "model_validate") else cfg


def text(src, node):
    return ast.get_source_segment(src, node) or ""


def asserts(src, node, word):
    return any(isinstance(n, ast.Assert) and word in text(src, n) for n in ast.walk(node))


def locate(functions, want):
    """The first statement ``want`` picks in NeMo-RL's own functions: (function, source, tree, node, line)."""
    for name in functions:
        fn = getattr(grpo, name, None)
        if fn is None:
            continue
        lines, first = inspect.getsourcelines(fn)
        src = textwrap.dedent("".join(lines))
        tree = ast.parse(src).body[0]
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            if want(src, node, parents):
                return name, src, tree, node, first + node.lineno - 1
    return None


def under_vllm(src, node, parents):
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If) and text(src, node.test).replace("'", '"') == 'backend == "vllm"':
            return True
    return False


STATEMENTS = {
    "force_on_policy_ratio": (("setup",), lambda s, n, p: isinstance(n, ast.If)
        and "force_on_policy_ratio" in text(s, n.test) and asserts(s, n, "train_global_batch_size")),
    "async_grpo": (("async_grpo_train",), lambda s, n, p: isinstance(n, ast.Assert)
        and "use_importance_sampling_correction" in text(s, n.test)),
    "skip_reference": (("setup", "grpo_train"), lambda s, n, p: isinstance(n, ast.If)
        and "skip_reference_policy_logprobs_calculation" in text(s, n.test)
        and asserts(s, n, "reference_policy_kl_penalty")),
    "skip_reference_async": (("setup", "async_grpo_train"), lambda s, n, p: isinstance(n, ast.If)
        and "skip_reference_policy_logprobs_calculation" in text(s, n.test)
        and asserts(s, n, "reference_policy_kl_penalty")),
    "fp8": (("setup",), lambda s, n, p: isinstance(n, ast.If) and '"fp8"' in text(s, n.test).replace("'", '"')
        and "precision" in text(s, n.test) and asserts(s, n, "use_importance_sampling_correction")
        and under_vllm(s, n, p)),
}


def run_statement(found, master):
    """That one statement, with the config sections its function binds before it (setup's own lines)."""
    name, src, tree, node, line = found
    scope = dict(vars(grpo), master_config=master)
    for stmt in tree.body:
        if stmt.lineno >= node.lineno:
            break
        if not isinstance(stmt, (ast.Assign, ast.AnnAssign)) or stmt.value is None:
            continue
        target = stmt.target if isinstance(stmt, ast.AnnAssign) else stmt.targets[0]
        if isinstance(target, ast.Name) and target.id in SECTIONS:
            scope[target.id] = eval(compile(ast.Expression(body=stmt.value), name, "eval"), scope)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            exec(compile(ast.Module(body=[node], type_ignores=[]), f"grpo.py:{name}", "exec"), scope)
    except (AssertionError, ValueError) as exc:
        return {"refused": True, "where": f"grpo.py:{line} ({name})", "message": str(exc)}
    return {"refused": False, "where": f"grpo.py:{line} ({name})"}


def nemo_rl_verdict(case, master):
    if case in STATEMENTS:
        found = locate(*STATEMENTS[case])
        return run_statement(found, master) if found else {"refused": False, "absent": True}
    if case == "use_kl_in_reward":  # main: a function of its own, called by setup
        check = getattr(grpo, "_validate_use_kl_in_reward_compat", None)
        if check is None or "_validate_use_kl_in_reward_compat(" not in inspect.getsource(grpo.setup):
            return {"refused": False, "absent": True}
        call = check
    else:  # opd: the advantage estimator, built as training starts
        if importlib.util.find_spec("nemo_rl.algorithms.opd") is None:
            return {"refused": False, "absent": True}
        assert "_create_advantage_estimator(" in inspect.getsource(grpo.grpo_train)
        call = grpo._create_advantage_estimator
    try:
        with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            call(master)
    except (AssertionError, ValueError) as exc:
        return {"refused": True, "where": call.__name__, "message": str(exc)}
    return {"refused": False, "where": call.__name__}


out = []
for job in jobs:
    try:
        nemo_rl = nemo_rl_verdict(job["case"], master_config(job["path"]))
    except Exception as exc:  # the config itself did not load: say so, the test fails on it
        nemo_rl = {"error": f"{type(exc).__name__}: {exc}"}
    [check] = run_cli([["check", job["path"], "--nemo-rl", root]])
    out.append({**job, "nemo_rl": nemo_rl, "check": check})
print(json.dumps({"results": out}))
'''
)


def checkout_of(host):
    if host:
        return Path(host)
    import nemo_rl

    return Path(nemo_rl.__file__).resolve().parents[1]


@no_hosts_mark()
@pytest.mark.slow  # 13-17 s per host
@pytest.mark.parametrize("host", HOSTS, ids=host_label)
def test_real_nemo_rl_refuses_what_check_refuses(host, tmp_path):
    root = checkout_of(host)
    base = {"defaults": str(root / "examples" / "configs" / "grpo_math_1B.yaml"), **copy.deepcopy(BASE)}
    jobs = []
    for name, case in CASES.items():
        for variant in ("bad", "fixed"):
            path = write_recipe(tmp_path / f"{name}-{variant}.yaml", recipe(getattr(case, variant), base))
            jobs.append({"case": name, "variant": variant, "path": path})
    (tmp_path / "tmp").mkdir(exist_ok=True)  # made by the isolated fixture
    env = dict(os.environ, TMPDIR=str(tmp_path / "tmp"), NEMO_RS_PLUGIN_WORKER_PATH=str(tmp_path / "worker-path"))
    proc = run_python(
        ["-c", HOST_SCRIPT, host, str(REPO), str(root), json.dumps(jobs)],
        env=env,
        cwd=tmp_path,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    data = json.loads(proc.stdout.strip().splitlines()[-1])
    if "import_error" in data:
        skip_or_fail(f"NeMo-RL at {host or 'this environment'} does not import here: {data['import_error']}")
    version = host_label(host)
    for r in data["results"]:
        case, nemo_rl, check = CASES[r["case"]], r["nemo_rl"], r["check"]
        where = (version, r["case"], r["variant"], nemo_rl, check["err"][-2000:])
        assert "error" not in nemo_rl and "Traceback" not in check["err"], where
        errors = error_lines(check["err"])
        if r["variant"] == "fixed":  # NeMo-RL starts, and check calls it valid
            assert not nemo_rl["refused"], where
            assert check["code"] == 0 and not errors and not not_checked_lines(check["err"]), where
            continue
        if version in ALL:  # what each version's grpo.py was read to do (check.py's rule docstrings)
            assert nemo_rl["refused"] == (version in case.refused_by), where
            assert nemo_rl.get("absent", False) == (version not in case.refused_by), where
        if nemo_rl["refused"]:
            assert check["code"] == EXIT_INVALID and len(errors) == 1, where
            assert errors[0].startswith(f"error: {case.needle}") and case.fix in errors[0], where
        else:
            assert check["code"] == 0 and not errors, where
