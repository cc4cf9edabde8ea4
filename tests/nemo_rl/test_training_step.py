"""NeMo-RL's training step around the loss, from ``Policy.train`` down to the loss and back to the driver's logs.

What guards: the code that decides what a training step is, around the loss, at every NeMo-RL
checkout (v0.6.0, v0.7.0, main). ``tests/support/training_step_host.py`` runs, on one and two
gloo CPU ranks, NeMo-RL's own ``lm_policy.Policy.train`` (the sharding of the global batch over
the data-parallel ranks, sequence packing's bins included, and the gathering of the ranks'
results), the DTensor-v2 worker's ``train`` (``DTensorPolicyWorkerV2Impl.train``: global
batches, ``process_global_batch``'s global counts, ``get_microbatch_iterator`` with its dummy
microbatches, ``automodel_forward_backward`` with its division of the metrics by the number of
global batches, ``LossPostProcessor`` with ``prepare_loss_input`` or, packed,
``pack_sequences`` and ``SequencePackingLossWrapper``, the optimizer step per global batch,
``aggregate_training_statistics``) on a tiny random Hugging Face Llama (hidden 16, 2 layers,
vocabulary 64, built from a ``LlamaConfig``: no download), and the GRPO driver's metric
aggregation read from ``grpo.py``/``grpo_sync.py`` and executed as written (min/max of
``probs_ratio_*``, mean of ``lr`` and the global counts, sum of the rest), plus
``aggregate_step_metrics`` where the host has it. The splits of one step
(:func:`tests.support.training_step_cases.splits`): data-parallel size 1 and 2, one and two
global batches, microbatches of 8, 4, 2 and 1 sequences, sequence packing at 40 and 64 tokens,
and packed shards made uneven (one bin moved from rank 1 to rank 0: rank 1 runs NeMo-RL's dummy
microbatch).

Replaced at run time in the rank processes, because they cannot run on this CPU machine or need
Ray (nothing of NeMo-RL is edited; ``training_step_host.py``'s docstring says how):

* ``tests/support/nemo_rl_shims.py``'s import-time shims, as in the other real-host tests
  (``TypedDict`` on Python 3.11; where the real import fails, stand-ins for modules NeMo-RL
  imports but this path never calls; megatron-core's ``PackedSeqParams.total_tokens``);
* ``nemo_automodel``: stand-in modules (a stand-in class refuses to be instantiated), but for
  three functions with their behaviour on this path: ``to_local_if_dtensor``;
  ``cp_utils.get_train_context`` without loss parallel, compiled autograd or CP (an empty
  context); ``scale_grads_and_clip_grad_norm`` without PP or EP (``clip_grad_norm_``, the norm
  returned as a number). NeMo-RL pins an Automodel git commit; the newest PyPI releases (0.6.0,
  0.7.0) need transformers 5.12 / 5.18 where NeMo-RL pins < 5.9, and have moved names NeMo-RL
  imports (``cp_utils``, ``create_device_mesh``, ``MoEParallelizerConfig``), so CI cannot
  install one beside NeMo-RL. NeMo-RL main's import-time check that Automodel lacks
  ``NeMoAutoModelForTokenClassification`` gets the pinned commit's answer;
* the worker's and the policy's ``__init__`` (Ray actors and cluster, NCCL, a Hub model and
  tokenizer, FSDP2, ``nemo_rl.models.automodel.setup``): the attributes ``train`` reads are set
  directly, with the values ``__init__`` would give them for this configuration; FSDP2 is
  replaced by ``DistributedDataParallel`` on the gloo data-parallel group at size 2 (both
  average the gradients over the ranks) and no wrapping at size 1; ``sdpa`` attention instead
  of ``flash_attention_2`` under packing (transformers masks the packed rows block-diagonally
  from their restarting ``position_ids``); the tokenizer is an object with the pad/eos id
  (all the training path reads of it); SGD (lr 0.5), a constant scheduler, ``max_grad_norm``
  1e6 (the norm is logged, clipping never fires); no FLOP tracker;
* Ray's worker group: each rank trains its own data-parallel shard on its worker; the results
  are gathered over the data-parallel group in rank order, as ``get_all_worker_results`` returns;
* CUDA: ``.cuda()`` and ``pin_memory`` (the shims), every ``device="cuda"`` argument (a
  ``TorchFunctionMode`` maps it to the CPU), ``torch.cuda.get_device_name``, the
  ``torch.cuda.nvtx`` ranges of ``wrap_with_nvtx_name``; ``torch.autocast("cuda")`` disables
  itself on the CPU (its warning is filtered; autocast to float32 on float32 weights changes
  nothing on a GPU either).

Observed, not replaced: the worker module's ``automodel_forward_backward`` is wrapped to record
each microbatch's loss and metrics (it calls NeMo-RL's function and returns its result), and an
optimizer step pre-hook records the gradients. The uneven shards are a ``BatchedDataDict``
subclass that rebuilds NeMo-RL's own packed shards with one bin moved.

Asserted, at each checkout:

(a) with only NeMo-RL's own fields (v0.7.0 and main; at v0.6.0 the plugin computes v0.7.0's
    loss on purpose, see ``test_nemo_rl_live_parity.py``), the plugin built as
    ``RSClippedPGLossFn(cfg)`` equals NeMo-RL's ``ClippedPGLossFn(cfg)`` in every split: the
    loss and metrics of every microbatch on every rank, the gradient before every optimizer
    step, the parameters after the step, the policy's loss, and every metric the driver logs
    (NeMo-RL's metrics; the plugin logs its own ``is_weight_*`` and ``nonfinite_*`` besides). One
    exception, in
    GSPO mode: NeMo-RL's ``sampling_importance_ratio`` without packing is inflated by its
    ``[B, 1]`` weight broadcast against the ``[B]`` sample mask (NeMo-RL #3753: about ``B``
    times the mean for microbatches of ``B`` sequences); under packing NeMo-RL calls the loss
    once per sequence and logs the mean over sequences, which is what the plugin logs in every
    split: the plugin's value equals NeMo-RL's *packed* value in every split;
(b) with the plugin's corrections (sequence-mean IS with a Geo-RS band and an ``agg: max``
    filter; token IS with TIS at 2 and a token filter), and for every plugin run above, the
    gradient, the parameters and every logged metric of each split equal those of one
    microbatch per global batch on one rank (float tolerance). The driver's
    ``global_valid_seqs``/``global_valid_toks`` are a mean over the step's logged *microbatches*
    (a driver rule, not the loss's): with two global batches it weighs each batch's count by its
    number of logged microbatches, so it is the reference's only where both batches log as many;
    every split here does, and that is checked with the value itself. Batch normalisation
    (``is_batch_normalization``) is left out on purpose: it divides the weights by their mean
    over one loss call (one microbatch, or one microbatch of every data-parallel rank), so it
    changes with the microbatch size by design. With two global batches, the filters'
    ``rs/<label>/seq_rejected_frac`` are the step's values, computed here from the batch alone
    (the plugin's labels avoid ``_min`` and ``_max``, which NeMo-RL's workers leave undivided:
    ``agg: max`` is ``sequence_ratio_largest``);
(c) the comparison catches a broken loss: in one case the plugin's loss is scaled by 1.01 on
    rank 1 only, and the same comparison reports the gradients, the parameters, the policy's
    loss and the logged ``grad_norm`` as different (the driver's logged ``loss`` is the loss's
    own metric, which a scaled loss tensor leaves as it is).
"""

from __future__ import annotations

import math
from collections import Counter

import pytest

from tests.support import training_step_cases as C
from tests.support.nemo_rl_hosts import host_label, nemo_rl_hosts, no_hosts_mark, skip_or_fail, whole_matrix

HOSTS = nemo_rl_hosts()
#: v0.6.0 aside: there the plugin computes v0.7.0's loss on purpose (test_nemo_rl_live_parity.py pins
#: those differences), so the parity with NeMo-RL's own loss is asserted at v0.7.0 and main only.
PARITY_HOSTS = [h for h in HOSTS if host_label(h) != "v0.6.0"]
pytestmark = [no_hosts_mark(), pytest.mark.slow, pytest.mark.distributed]

#: The plugin against NeMo-RL's loss in the same split: the same float32 model, the losses' float32
#: arithmetic in another order. Measured here (v0.7.0, main): at most 4.9e-7 (gradients, relative to
#: their largest entry), 1.2e-7 (parameters), 2.4e-7 (metrics).
PARITY_TOLERANCE = 5e-6
#: One split against another: the same float32 model on other microbatch shapes (packed rows,
#: padding), and sums in another order. Measured here: at most 5.0e-7 (gradients), 1.2e-7
#: (parameters), 2.4e-7 (metrics); a loss scaled by 1.01 on one rank of two: 4e-3 to 1e-2
#: (gradients), 2.2e-4 (parameters).
SPLIT_TOLERANCE = 1e-5
#: The driver averages these over the step's logged microbatches (see (b) in the module docstring).
MICROBATCH_MEANS = ("global_valid_seqs", "global_valid_toks")
#: NeMo-RL's GSPO metric that its unpacked call inflates (NeMo-RL #3753).
GSPO_METRIC = "sampling_importance_ratio"
BROKEN = ("plugin_broken", "rs/sequence_mean+filters", "dp2/gb2/mbs2")

_WORLDS: dict = {}


def case_name(kind: str, config: str, split: str) -> str:
    return f"{kind}|{config}|{split}"


def world_cases(host: str, dp: int) -> list:
    sections = {**C.CORRECTED, **(C.PARITY if host in PARITY_HOSTS else {})}
    cases = []
    for split_name, split in C.splits(dp, whole_matrix(host)).items():
        for config, section in sections.items():
            kinds = ("nemo_rl", "plugin") if config in C.PARITY else ("plugin",)
            cases += [(case_name(kind, config, split_name), split, kind, section) for kind in kinds]
    if dp == 2:
        kind, config, split_name = BROKEN
        cases.append((case_name(*BROKEN), C.splits(2)[split_name], kind, C.CORRECTED[config]))
    return cases


def world(host: str, dp: int, tmp_path_factory) -> list[dict]:
    """Every case of ``(host, dp)`` in one gloo world (cached): one result dict per rank."""
    import torch

    from tests.support.distributed_harness import run_world
    from tests.support.training_step_host import run_cases

    key = (host, dp)
    if key not in _WORLDS:
        out = str(tmp_path_factory.mktemp(f"step-{host_label(host)}-dp{dp}") / "out")
        try:
            run_world(dp, run_cases, host, world_cases(host, dp), out, timeout=600)
            _WORLDS[key] = [torch.load(f"{out}.rank{r}", weights_only=False) for r in range(dp)]
        except AssertionError as exc:  # kept: the next test of this world reports it without running it again
            _WORLDS[key] = exc
    if isinstance(_WORLDS[key], AssertionError):
        if "ModuleNotFoundError" in str(_WORLDS[key]):
            skip_or_fail(f"NeMo-RL at {host_label(host)} lacks a dependency: {str(_WORLDS[key])[-500:]}")
        raise _WORLDS[key]
    return _WORLDS[key]


def result(ranks: list[dict], name: str) -> list[dict]:
    """The case's result on every rank (fails with the rank's traceback where it raised)."""
    for r, out in enumerate(ranks):
        assert name in out, name
        assert "error" not in out[name], f"rank {r}, {name}:\n{out[name]['error']}"
    return [out[name] for out in ranks]


def close(a: float, b: float, tol: float) -> bool:
    if math.isinf(a) or math.isinf(b) or math.isnan(a) or math.isnan(b):
        return a == b
    return abs(a - b) <= tol * max(1.0, abs(a), abs(b))


def metric_differences(got: dict, want: dict, tol: float, skip=()) -> list[str]:
    """``want``'s metrics must be in ``got`` with close values (``got`` may have more)."""
    out = [f"{k}: missing" for k in want if k not in got and k not in skip]
    out += [
        f"{k}: {got[k]!r} != {v!r}" for k, v in want.items() if k in got and k not in skip and not close(got[k], v, tol)
    ]
    return out


def tensor_difference(label: str, got, want, tol: float) -> list[str]:
    if got.shape != want.shape:
        return [f"{label}: shape {tuple(got.shape)} != {tuple(want.shape)}"]
    worst = float((got - want).abs().max()) if got.numel() else 0.0
    scale = float(want.abs().max()) if want.numel() else 0.0  # relative to the largest entry
    return [f"{label}: off by {worst:.3g} (largest entry {scale:.3g})"] if worst > tol * scale else []


def step_differences(got: dict, want: dict, tol: float, skip_metrics=()) -> list[str]:
    """Gradients before each optimizer step, parameters after, the policy's loss and every metric the driver logs."""
    out = []
    if len(got["policy_loss"]) != len(want["policy_loss"]) or not all(
        close(a, b, tol) for a, b in zip(got["policy_loss"], want["policy_loss"])
    ):
        out.append(f"Policy.train's loss per global batch: {got['policy_loss']} != {want['policy_loss']}")
    if len(got["grads"]) != len(want["grads"]):
        out.append(f"optimizer steps: {len(got['grads'])} != {len(want['grads'])}")
    for i, (g, w) in enumerate(zip(got["grads"], want["grads"])):
        out += tensor_difference(f"gradient before step {i}", g, w, tol)
    out += tensor_difference("parameters after the step", got["params"], want["params"], tol)
    assert set(got["driver"]) == set(want["driver"])
    for where, metrics in want["driver"].items():
        out += [f"{where}: {d}" for d in metric_differences(got["driver"][where], metrics, tol, skip_metrics)]
    return out


def test_the_release_cover_holds_each_kind_of_split():
    """A released checkout's cover (``whole_matrix``) keeps what the comparisons read (the one-rank
    references, NeMo-RL's packed GSPO runs, the deliberately broken split) and each kind of split."""
    packings = set()
    for dp in (1, 2):
        cover = C.splits(dp, every=False)
        assert set(cover) == set(C.COVER[dp]) and set(cover) <= set(C.splits(dp))
        assert {s["ngb"] for s in cover.values()} == {1, 2}, dp
        assert any(s["packing"] is None and s["mbs"] < C.GBS // dp for s in cover.values()), dp  # several microbatches
        assert any(s["packing"] for s in cover.values()), dp
        packings |= {s["packing"] for s in cover.values() if s["packing"]}
    assert packings == {40, 64}
    assert {C.reference_split(1), C.reference_split(2), "dp1/gb1/packed40", "dp1/gb2/packed40"} <= set(C.COVER[1])
    assert BROKEN[2] in C.COVER[2] and any(C.splits(2)[s].get("uneven") for s in C.COVER[2])


def plugin_configs(host: str) -> list[str]:
    return list(C.CORRECTED) + (list(C.PARITY) if host in PARITY_HOSTS else [])


# ----------------------------------------------------------------------------------- (a)


@pytest.mark.parametrize("dp", [1, 2])
@pytest.mark.parametrize("host", PARITY_HOSTS, ids=host_label)
def test_nemo_rl_fields_alone_equal_nemo_rl_own_loss_in_every_split(host, dp, tmp_path_factory):
    """(a): every microbatch, gradient, parameter and logged metric, but GSPO's inflated metric."""
    ranks = world(host, dp, tmp_path_factory)
    reference = world(host, 1, tmp_path_factory)
    failures = {}
    for split_name, split in C.splits(dp, whole_matrix(host)).items():
        for config in C.PARITY:
            gspo = config == "nemo_rl/gspo"
            plugin = result(ranks, case_name("plugin", config, split_name))
            own = result(ranks, case_name("nemo_rl", config, split_name))
            diff = []
            for r, (p, o) in enumerate(zip(plugin, own)):
                if len(p["microbatches"]) != len(o["microbatches"]):
                    diff.append(f"rank {r}: {len(p['microbatches'])} microbatches != {len(o['microbatches'])}")
                for i, (pm, om) in enumerate(zip(p["microbatches"], o["microbatches"])):
                    if not close(pm["loss"], om["loss"], PARITY_TOLERANCE):
                        diff.append(f"rank {r} microbatch {i}: loss {pm['loss']} != {om['loss']}")
                    skip = (GSPO_METRIC,) if gspo else ()
                    diff += [
                        f"rank {r} microbatch {i}: {d}"
                        for d in metric_differences(pm["metrics"], om["metrics"], PARITY_TOLERANCE, skip)
                    ]
                diff += [
                    f"rank {r}: {d}"
                    for d in step_differences(p, o, PARITY_TOLERANCE, skip_metrics=(GSPO_METRIC,) if gspo else ())
                ]
            if gspo:
                # NeMo-RL's per-sequence (packed) value, from the same number of global batches on one rank
                packed = result(reference, case_name("nemo_rl", config, f"dp1/gb{split['ngb']}/packed40"))[0]
                for where, metrics in plugin[0]["driver"].items():
                    want = packed["driver"][where][GSPO_METRIC]
                    if not close(metrics[GSPO_METRIC], want, SPLIT_TOLERANCE):
                        diff.append(f"{where}: {GSPO_METRIC} {metrics[GSPO_METRIC]} != NeMo-RL packed {want}")
                    # ...and NeMo-RL's own unpacked value is inflated exactly where a call holds several sequences
                    own_value = own[0]["driver"][where][GSPO_METRIC]
                    several = split["packing"] is None and split["mbs"] > 1
                    if several == close(own_value, want, 1e-3):
                        diff.append(f"{where}: NeMo-RL's own {GSPO_METRIC} {own_value} vs packed {want} (#3753)")
            if diff:
                failures[(config, split_name)] = diff[:12]
    assert failures == {}


# ----------------------------------------------------------------------------------- (b)


@pytest.mark.parametrize("dp", [1, 2])
@pytest.mark.parametrize("host", HOSTS, ids=host_label)
def test_corrections_give_one_result_in_every_split(host, dp, tmp_path_factory):
    """(b): each split equals one microbatch per global batch on one rank (float tolerance)."""
    ranks = world(host, dp, tmp_path_factory)
    reference = world(host, 1, tmp_path_factory)
    failures = {}
    for split_name, split in C.splits(dp, whole_matrix(host)).items():
        for config in plugin_configs(host):
            runs = result(ranks, case_name("plugin", config, split_name))
            want = result(reference, case_name("plugin", config, C.reference_split(split["ngb"])))[0]
            diff = []
            for r, got in enumerate(runs):
                diff += [f"rank {r}: {d}" for d in step_differences(got, want, SPLIT_TOLERANCE)]
                # each logged microbatch carries its own global batch's counts, and each global batch
                # logs as many microbatches (so the driver's mean over microbatches is the reference's)
                for key in MICROBATCH_MEANS:
                    logged = Counter(got["all_mb_metrics"][key])
                    if set(logged) != set(want["all_mb_metrics"][key]) or len(set(logged.values())) != 1:
                        diff.append(f"rank {r}: {key} logged per microbatch {dict(logged)}")
            if diff:
                failures[(config, split_name)] = diff[:12]
    assert failures == {}


@pytest.mark.parametrize("host", HOSTS, ids=host_label)
def test_filter_fractions_are_the_step_values(host, tmp_path_factory):
    """(b): ``rs/<label>/seq_rejected_frac`` is the step's value, from the batch alone, in every split.

    One and two global batches: NeMo-RL divides each microbatch's metrics by the number of global
    batches, but not those whose name contains ``_min`` or ``_max`` (its ``probs_ratio_*``
    extremes, which the driver folds by min/max). The plugin's labels never contain them.
    """
    config = "rs/sequence_mean+filters"
    failures = {}
    for dp in (1, 2):
        ranks = world(host, dp, tmp_path_factory)
        for split_name, split in C.splits(dp, whole_matrix(host)).items():
            expected = C.expected_sequence_rejections(split["ngb"])
            got = result(ranks, case_name("plugin", config, split_name))[0]
            for where, metrics in got["driver"].items():
                for label, want in expected.items():
                    key = f"rs/{label}/seq_rejected_frac"
                    if not close(metrics.get(key, math.nan), want, 1e-6):
                        failures[(split_name, where, key)] = (metrics.get(key), want)
                total = sum(expected.values())
                if not close(metrics["rs_seq_rejected_frac"], total, 1e-6):
                    failures[(split_name, where, "rs_seq_rejected_frac")] = (metrics["rs_seq_rejected_frac"], total)
                undivided = [k for k in metrics if ("_min" in k or "_max" in k) and not k.startswith("probs_ratio_")]
                if undivided:
                    failures[(split_name, where, "undivided")] = undivided
    assert failures == {}
    # the two global batches reject different shares: the mean of the two is not either one's
    one, two = C.expected_sequence_rejections(1), C.expected_sequence_rejections(2)
    assert one["sequence_ratio_mean"] != two["sequence_ratio_mean"]
    assert one["sequence_ratio_largest"] != two["sequence_ratio_largest"]


@pytest.mark.parametrize("host", PARITY_HOSTS, ids=host_label)
def test_nemo_rl_own_loss_gives_one_result_in_every_split(host, tmp_path_factory):
    """The control: NeMo-RL's own loss through the same step is split-invariant (but GSPO's inflated metric).

    What differs between splits in (b) is then the loss's doing, not the harness's.
    """
    reference = world(host, 1, tmp_path_factory)
    failures = {}
    for dp in (1, 2):
        ranks = world(host, dp, tmp_path_factory)
        for split_name, split in C.splits(dp, whole_matrix(host)).items():
            for config in C.PARITY:
                runs = result(ranks, case_name("nemo_rl", config, split_name))
                want = result(reference, case_name("nemo_rl", config, C.reference_split(split["ngb"])))[0]
                skip = (GSPO_METRIC,) if config == "nemo_rl/gspo" else ()
                diff = [
                    f"rank {r}: {d}"
                    for r, got in enumerate(runs)
                    for d in step_differences(got, want, SPLIT_TOLERANCE, skip)
                ]
                if diff:
                    failures[(config, split_name)] = diff[:12]
    assert failures == {}


# ----------------------------------------------------------------------------------- (c)


@pytest.mark.parametrize("host", HOSTS, ids=host_label)
def test_a_loss_scaled_by_one_percent_on_one_rank_is_caught(host, tmp_path_factory):
    """(c): the plugin's loss times 1.01 on rank 1 only: the comparisons above report it."""
    ranks = world(host, 2, tmp_path_factory)
    kind, config, split_name = BROKEN
    broken = result(ranks, case_name(*BROKEN))
    sound = result(ranks, case_name("plugin", config, split_name))
    reference = result(world(host, 1, tmp_path_factory), case_name("plugin", config, C.reference_split(2)))[0]
    for want in (sound[0], reference):
        diff = step_differences(broken[0], want, SPLIT_TOLERANCE)
        assert any(d.startswith("gradient before step 0") for d in diff), diff
        assert any(d.startswith("parameters after the step") for d in diff), diff
        # Policy.train's loss (the worker's all-reduced global loss). The driver's logged "loss" is the
        # loss's own metric (all_mb_metrics' "loss" replaces train_results' in its metrics dict), which
        # the scaled tensor does not change.
        assert any(d.startswith("Policy.train's loss") for d in diff), diff
        assert any(": grad_norm: " in d for d in diff), diff
    # ...while the sound run of the same split agrees (the break is what differs)
    assert step_differences(sound[0], reference, SPLIT_TOLERANCE) == []


# ----------------------------------------------------------------------------------- the harness


@pytest.mark.parametrize("host", HOSTS, ids=host_label)
def test_the_step_runs_what_it_claims(host, tmp_path_factory):
    """Packing packs, uneven shards run dummy microbatches, the driver's code was found, only the listed stand-ins."""
    for dp in (1, 2):
        ranks = world(host, dp, tmp_path_factory)
        meta = [out["_meta"] for out in ranks]
        assert [m["world_size"] for m in meta] == [dp] * dp
        for m in meta:
            # nothing but nemo_automodel stood in by this harness; NeMo-RL's shims as their own test says
            assert m["stood_in"] and all(n.split(".")[0] == "nemo_automodel" for n in m["stood_in"]), m["stood_in"]
            assert {d.split(":")[1] for d in m["drivers"]} >= {"grpo_train", "async_grpo_train"}, m["drivers"]
        config = "rs/sequence_mean+filters"
        for split_name, split in C.splits(dp, whole_matrix(host)).items():
            runs = result(ranks, case_name("plugin", config, split_name))
            for r, run in enumerate(runs):
                assert run["worker_group_calls"] == ["train"]
                assert [loop["packing"] for loop in run["loops"]] == [split["packing"] is not None] * split["ngb"]
                assert [loop["num_global_batches"] for loop in run["loops"]] == [split["ngb"]] * split["ngb"]
                dummies = sum(mb["dummy"] for mb in run["microbatches"])
                # rank 1 of the uneven shards runs dummy microbatches (two fewer bins than rank 0); nothing else does
                assert (dummies > 0) == bool(split.get("uneven") and r == 1), (split_name, r, dummies)
                assert dummies == sum(loop["microbatches"] - loop["valid"] for loop in run["loops"])
                if split["packing"] is None:
                    assert len(run["microbatches"]) == split["ngb"] * (C.GBS // dp) // split["mbs"]
                assert all(math.isfinite(g.abs().sum().item()) and g.abs().sum() > 0 for g in run["grads"])
            # every rank runs as many microbatches per global batch (the dummies make up the difference)
            assert len({tuple(loop["microbatches"] for loop in run["loops"]) for run in runs}) == 1, split_name
        if dp == 1:  # the batch exercises what the comparisons are about
            seq = result(ranks, case_name("plugin", "rs/sequence_mean+filters", C.reference_split(2)))[0]["driver"]
            tok = result(ranks, case_name("plugin", "rs/token_tis+token_filter", C.reference_split(2)))[0]["driver"]
            for where in seq:
                assert seq[where]["probs_ratio_clamped_min"] == pytest.approx(0.8)  # the PPO clip bites
                assert seq[where]["probs_ratio_clamped_max"] == pytest.approx(1.2)
                assert tok[where]["rs/token_ratio/token_rejected_frac"] > 0  # the token filter rejects
                assert tok[where]["is_oob_ratio"] > 0  # TIS truncates
        if dp == 2:  # both ranks hold the same model after the step (the gradients were averaged)
            for name in ranks[0]:
                if name != "_meta" and "error" not in ranks[0][name]:
                    assert (ranks[0][name]["params"] == ranks[1][name]["params"]).all(), name
