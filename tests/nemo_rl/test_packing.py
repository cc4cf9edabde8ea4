"""The same loss, gradient and logged metrics whether NeMo-RL packs sequences or not, at every host.

NeMo-RL calls the loss in three ways (SPEC, "How NeMo-RL calls the loss"): once per microbatch
(no packing), once per sequence through ``SequencePackingLossWrapper`` (packing on the DTensor
worker, automodel, and Megatron without ``fuse_loss``: what every shipped recipe did), and once
per microbatch through ``SequencePackingFusionLossWrapper`` (Megatron with ``fuse_loss: true``).
``tests/support/packing_host.py`` runs each configuration of ``tests/support/packing_cases.py``
(derived from the configuration's fields and presets) through NeMo-RL's real wrappers, two
microbatches each, metrics combined by NeMo-RL's driver rule. Here:

* every configuration gives, per sequence and fused, the unpacked call's loss, gradient and
  metrics (to float64 rounding per sequence; fused to NeMo-RL's float32 log-softmax); per
  sequence the loss gathers the wrapper's calls into one, log-probs or logits as input
  (``nemo_rs_plugin.nemo_rl.packing``); under a wrapper whose position the loss cannot read
  (``per_sequence_unindexed``, this suite's own loop) each call computes its own sequence with
  the microbatch totals;
* there, a configuration that cannot be made invariant is refused on the wrapper's first call
  with the one message that names ``policy.sequence_packing``; which ones is
  :func:`~nemo_rs_plugin.core.batch.microbatch.current_policy_problems`' decision;
* with only NeMo-RL's own fields set, the plugin equals NeMo-RL's own loss unpacked and fused,
  and its unpacked result per sequence (where NeMo-RL's own NLL changes), but for the GSPO
  ``sampling_importance_ratio``: NeMo-RL's per-sequence value in every call shape.
"""

import json
import math
import os
from pathlib import Path

import pytest

from nemo_rs_plugin.core.batch.microbatch import current_policy_problems
from nemo_rs_plugin.core.settings.config import RSClippedPGLossConfig
from tests.nemo_rl.test_activation import plugin_installed
from tests.support.fork_server import run_python
from tests.support.nemo_rl_hosts import (
    host_label,
    nemo_rl_hosts,
    no_hosts_mark,
    real_host_required,
    skip_or_fail,
    whole_matrix,
)
from tests.support.packing_cases import UPSTREAM_ONLY, packing_cases

SCRIPT = Path(__file__).resolve().parents[1] / "support" / "packing_host.py"
HOSTS = nemo_rl_hosts()
CASES, REFUSED = packing_cases()
pytestmark = [
    no_hosts_mark(),
    pytest.mark.skipif(
        not plugin_installed() and not real_host_required(), reason="nemo-rs-plugin is not pip-installed here"
    ),
]

#: Per sequence the float64 sums run in another order; fused, NeMo-RL computes log-probs in float32.
TOLERANCE = {"per_sequence": 1e-9, "fused": 2e-6, "per_sequence_unindexed": 1e-9, "per_sequence_megatron": 1e-9}
#: The plugin against NeMo-RL's own loss: the same formulas, arithmetic in another order (GSPO: 7e-9).
PARITY_TOLERANCE = 1e-7
_RESULTS: dict = {}
#: The field cases of one filter each (statistic x aggregation, log-ratio, sign, scope): the plugin's
#: own arithmetic under wrappers that every other case runs too. A released checkout leaves them out
#: (``whole_matrix``) but for the one the rejection check below reads; the presets there still
#: filter at both levels, with and without a sign and a policy-gradient scope.
FILTER_FIELD_CASES = tuple(name for name in CASES if name.startswith("filter/") and name != "filter/sequence_ratio_any")


def host_cases(host) -> dict:
    """The cases that run at ``host``: every one at the newest NeMo-RL, all but the filter field cases at a release."""
    if whole_matrix(host):
        return CASES
    return {name: section for name, section in CASES.items() if name not in FILTER_FIELD_CASES}


def results(host, tmp_path_factory):
    """Every case through the three wrappers at ``host``, in one interpreter (cached per host)."""
    if host not in _RESULTS:
        tmp = tmp_path_factory.mktemp("packing")
        (tmp / "cases.json").write_text(json.dumps(host_cases(host)))
        env = dict(os.environ)
        if host:
            env["PYTHONPATH"] = os.pathsep.join([host] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
        proc = run_python(
            [str(SCRIPT), str(tmp / "cases.json"), str(tmp / "out.json")],
            env=env,
            timeout=900,
            cwd=SCRIPT.parents[2],
        )
        if proc.returncode != 0 and "ModuleNotFoundError" in proc.stderr:
            skip_or_fail(f"NeMo-RL at {host or 'this environment'} lacks a dependency: {proc.stderr.splitlines()[-1]}")
        assert proc.returncode == 0, proc.stderr[-4000:]
        _RESULTS[host] = json.loads((tmp / "out.json").read_text())
    return _RESULTS[host]


def differences(got, want, tol):
    """Human-readable differences between two runs' loss, gradient and metrics (empty: equal)."""
    for run in (got, want):
        assert "error" not in run, run.get("traceback") or run["error"]

    def close(a, b):
        if math.isinf(a) or math.isinf(b):
            return a == b
        return abs(a - b) <= tol * max(1.0, abs(a), abs(b))

    out = []
    if not close(got["loss"], want["loss"]):
        out.append(f"loss {got['loss']} != {want['loss']}")
    worst = max((abs(a - b) for a, b in zip(got["grad"], want["grad"])), default=0.0)
    scale = max((abs(b) for b in want["grad"]), default=1.0)
    if len(got["grad"]) != len(want["grad"]) or worst > tol * max(1.0, scale):
        out.append(f"gradient off by {worst:.3g}")
    if set(got["metrics"]) != set(want["metrics"]):
        out.append(f"metric names differ: {sorted(set(got['metrics']) ^ set(want['metrics']))}")
    out += [
        f"{k}: {got['metrics'][k]} != {v}"
        for k, v in want["metrics"].items()
        if k in got["metrics"] and not close(got["metrics"][k], v)
    ]
    return out


#: The cases whose totals need the current policy of every sequence (written out, not derived from
#: the rule under test). Where the wrapper's position is read its calls are gathered into one, log-probs
#: or logits as input: they run.
CURRENT_POLICY_TOTALS = {
    "rejection_denominator=kept/curr-gen",
    "is_batch_normalization=microbatch/force_on_policy_ratio",
    "sharded_logits_input=true/rejection_denominator=kept/curr-gen",
    "sharded_logits_input=true/is_batch_normalization=microbatch/force_on_policy_ratio",
}


def refusal_expected(name, mode) -> bool:
    """Refused where each call computes its own sequence: a wrapper whose position is not read."""
    return mode == "per_sequence_unindexed" and name in CURRENT_POLICY_TOTALS


def test_the_matrix_covers_the_configuration():
    """Every case is a valid configuration; the refusal rule picks exactly the listed cases."""
    assert REFUSED == []
    assert len(CASES) >= 100
    ruled = {
        name
        for name, section in CASES.items()
        if current_policy_problems(RSClippedPGLossConfig.from_any({k: v for k, v in section.items() if k != "name"}))
    }
    assert ruled == CURRENT_POLICY_TOTALS
    # the guide states the matrix's size: the one read here
    plugin_cases = sum(not name.startswith("control/") for name in CASES)
    guide = (Path(__file__).resolve().parents[2] / "docs" / "guide.md").read_text()
    assert f"on {plugin_cases} configurations generated" in " ".join(guide.split())


def test_a_release_leaves_out_only_the_filter_field_cases(monkeypatch):
    """A released checkout's cover keeps what the checks read: NeMo-RL's fields and their controls,
    the refusals, the sequence level's weights, the rejecting filter, and the presets, which filter
    at both levels with a sign and a policy-gradient scope."""
    from tests.support.nemo_rl_hosts import FULL_MATRIX_ENV

    monkeypatch.delenv(FULL_MATRIX_ENV, raising=False)
    assert host_cases("/checkouts/nemo-rl-main") == CASES
    release = host_cases("/checkouts/nemo-rl-v0.7.0")
    assert set(CASES) - set(release) == set(FILTER_FIELD_CASES)
    assert FILTER_FIELD_CASES and all(name.startswith("filter/") for name in FILTER_FIELD_CASES)
    kept = set(UPSTREAM_ONLY) | {f"control/{name}" for name in UPSTREAM_ONLY} | CURRENT_POLICY_TOTALS
    assert kept | {"filter/sequence_ratio_any", "preset/is_level(sequence)"} <= set(release)
    filters = [f for name, section in release.items() for f in section.get("rejection_sampling", [])]
    assert {f["level"] for f in filters} == {"token", "sequence"}
    assert {f.get("advantage_sign") for f in filters} >= {None, "negative", "positive"}
    assert {f.get("applies_to", "loss") for f in filters} == {"loss", "policy_gradient"}
    monkeypatch.setenv(FULL_MATRIX_ENV, "1")
    assert host_cases("/checkouts/nemo-rl-v0.7.0") == CASES


@pytest.mark.parametrize("host", HOSTS, ids=host_label)
def test_packed_calls_equal_the_unpacked_call(host, tmp_path_factory):
    out = results(host, tmp_path_factory)
    assert set(out) == set(host_cases(host))
    failures = {}
    for name, section in host_cases(host).items():
        if name.startswith("control/"):
            continue
        runs = out[name]
        assert "error" not in runs["unpacked"], (name, runs["unpacked"].get("traceback"))
        for mode in ("per_sequence", "fused", "per_sequence_unindexed", "per_sequence_megatron"):
            if mode not in runs:  # per_sequence_megatron: log-prob input only
                continue
            run = runs[mode]
            if mode.startswith("per_sequence") and refusal_expected(name, mode):
                if not (run.get("type") == "ConfigError" and "policy.sequence_packing" in run.get("error", "")):
                    failures[(name, mode)] = f"not refused: {run.get('error') or 'ran'}"
                elif (
                    "sharded_logits_input: false" if section.get("sharded_logits_input") else "fuse_loss: true"
                ) not in run[
                    "error"
                ]:  # the way out: logits -> log-probs (gathered); an unreadable wrapper -> NeMo-RL's fused wrapper
                    failures[(name, mode)] = f"the refusal does not say what to set: {run['error']}"
                continue
            if mode == "fused" and section.get("sharded_logits_input"):
                # NeMo-RL's fused preparation takes log-probs only (nemo-rs check says so for a recipe)
                assert "only supports LossInputType.LOGPROB" in run.get("error", ""), (name, run)
                continue
            if "error" in run:
                failures[(name, mode)] = run.get("traceback") or run["error"]
                continue
            diff = differences(run, runs["unpacked"], TOLERANCE[mode])
            if diff:
                failures[(name, mode)] = diff
    assert failures == {}
    # the batch has what the checks need to mean something: weights in both tails, rejections
    sequence_level = out["preset/is_level(sequence)"]["unpacked"]["metrics"]
    assert sequence_level["is_weight_raw_low_frac"] > 0 and sequence_level["is_weight_raw_high_frac"] > 0
    assert out["filter/sequence_ratio_any"]["unpacked"]["metrics"]["rs_seq_rejected_frac"] > 0


# v0.6.0 aside: there the plugin computes v0.7.0's loss, on purpose (tests/nemo_rl/test_nemo_rl_live_parity.py
# pins those differences); the packing tests above still run at v0.6.0.
@pytest.mark.parametrize("host", [h for h in HOSTS if host_label(h) != "v0.6.0"], ids=host_label)
def test_nemo_rl_fields_alone_equal_nemo_rl_own_loss_in_every_mode(host, tmp_path_factory):
    """Per sequence the plugin gives NeMo-RL's *unpacked* result; fused, NeMo-RL's fused one.

    Per sequence NeMo-RL's own loss departs from its unpacked result in two places (the control
    below pins them): its NLL is averaged over each sequence alone, and its GSPO
    ``sampling_importance_ratio`` changes. The plugin gathers the wrapper's calls into the
    unpacked call, so it keeps the unpacked NLL there too. The GSPO metric is the one deliberate
    difference: in every call shape the plugin logs NeMo-RL's *per-sequence* value, the mean
    over sequences, which NeMo-RL's unpacked and fused calls inflate by about the number of
    sequences per call (their ``[B, 1]`` weight against the ``[B]`` sample mask, NeMo-RL #3753).
    """
    out = results(host, tmp_path_factory)
    for name in UPSTREAM_ONLY:
        gspo_per_sequence = out[f"control/{name}"]["per_sequence"]["metrics"].get("sampling_importance_ratio")
        for mode in ("unpacked", "per_sequence", "fused"):
            plugin = out[name][mode]
            own = out[f"control/{name}"]["unpacked" if mode == "per_sequence" else mode]
            if name == "upstream/gspo":
                own = {**own, "metrics": {**own["metrics"], "sampling_importance_ratio": gspo_per_sequence}}
            own_metrics = {k: v for k, v in plugin["metrics"].items() if k in own["metrics"]}
            assert set(own["metrics"]) <= set(plugin["metrics"]), (name, mode)
            # as close as the two losses' float64 arithmetic allows (the live parity test's own bar is 1e-4)
            assert differences({**plugin, "metrics": own_metrics}, own, PARITY_TOLERANCE) == [], (name, mode)


@pytest.mark.parametrize("host", HOSTS, ids=host_label)
def test_nemo_rl_own_loss_is_packing_invariant_where_the_plugin_claims_parity(host, tmp_path_factory):
    """The control: NeMo-RL's own loss gives the unpacked result packed, except its NLL per sequence."""
    out = results(host, tmp_path_factory)
    for name in UPSTREAM_ONLY:
        if name == "upstream/nll" and host_label(host) == "v0.6.0":
            continue  # v0.6.0's loss has no positive_example_nll_weight (the plugin refuses it there)
        runs = out[f"control/{name}"]
        for mode in ("per_sequence", "fused"):
            diff = differences(runs[mode], runs["unpacked"], TOLERANCE[mode])
            if name == "upstream/gspo":  # its [B, 1] weight broadcast: per sequence not a sum (7.99 -> 16.5 here)
                gspo_metric = [d for d in diff if d.startswith("sampling_importance_ratio:")]
                assert (mode == "per_sequence") == bool(gspo_metric), (mode, diff)
                diff = [d for d in diff if d not in gspo_metric]
            if host_label(host) == "v0.6.0":  # v0.6.0's is_oob_ratio is a mean of this call (v0.7.0 on: a sum)
                diff = [d for d in diff if not d.startswith("is_oob_ratio:")]
            if name == "upstream/nll" and mode == "per_sequence":
                assert any(d.startswith("positive_nll_loss") for d in diff)
                continue
            assert diff == [], (name, mode)


@pytest.mark.slow  # 10-12 s per host: a two-rank gloo world
@pytest.mark.distributed
@pytest.mark.parametrize("host", HOSTS, ids=host_label)
def test_data_parallel_ranks_with_different_sequence_counts_finish_and_agree(host):
    """Rank 0 packs three sequences, rank 1 two: the same collectives on both, the unpacked result."""
    import importlib.util

    from tests.support.distributed_harness import run_world
    from tests.support.packing_world import check_data_parallel_packing

    if importlib.util.find_spec("megatron.core") is None:
        skip_or_fail("megatron-core is not installed (pip install megatron-core)")
    run_world(2, check_data_parallel_packing, host, timeout=300)
