"""Log-probs from logits in chunks of positions (nemo_rs_plugin/parallel/vocab_parallel.py).

The same numbers as before chunking and as NeMo-RL's own log-prob functions (TP 1 and TP 2 on
gloo, float32 and bf16 logits, several chunk sizes), one collective per call, and nothing of
the logits' size saved for backward: the memory contract behind
``benchmarks/bench_logprob_memory.py``. Through NeMo-RL's real ``LossPostProcessor``, with its
``policy.logprob_chunk_size``: ``tests/parallel/test_real_megatron.py``.
"""

import pytest
import torch

from nemo_rs_plugin import CorrectedPGLoss
from nemo_rs_plugin.parallel.sharded import sharded_loss
from nemo_rs_plugin.parallel.vocab_parallel import DEFAULT_LOGPROB_CHUNK_SIZE, chunk_size_problem, target_logprobs
from tests.support import chunked_logprob_cases as cases
from tests.support.distributed_cases import CONFIGS, make_data
from tests.support.distributed_harness import run_world, run_world_cases
from tests.support.nemo_rl_hosts import host_label, nemo_rl_hosts, no_hosts_mark
from tests.support.unchunked_logprobs import unchunked_target_logprobs

_RESULTS: dict = {}
WORLD = [
    ("references", cases.check_chunked_equals_references, ()),
    ("collectives", cases.check_collectives, ()),
]


def _failures(world_size: int, name: str) -> list:
    if world_size not in _RESULTS:
        _RESULTS[world_size] = run_world_cases(world_size, WORLD)
    return _RESULTS[world_size][name]


@pytest.mark.distributed
def test_chunked_logprobs_equal_float64_and_the_previous_path_tp2_gloo():
    failures = _failures(2, "references")
    assert not failures, "\n".join(failures[:40])


def _thread_ranks(world_size, fn, monkeypatch):
    """``fn(rank, group)`` on ``world_size`` thread ranks (tests/support/threaded_world.py); each rank's result."""
    import torch.distributed as dist

    from tests.support.threaded_world import ThreadGroup, run_ranks

    if world_size == 1:
        return [fn(0, None)]
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    group = ThreadGroup(list(range(world_size)))
    return [result for result, _ in run_ranks(world_size, lambda r: fn(r, group), [group], monkeypatch)]


@pytest.mark.parametrize("world_size", [1, 2, 3], ids=["tp1", "tp2-threads", "tp3-threads"])
def test_chunked_logprobs_equal_float64_and_the_previous_path_in_process(world_size, monkeypatch):
    """The same comparison with thread ranks (tests/support/threaded_world.py): fast, and in the mutation subset."""
    results = _thread_ranks(world_size, lambda r, group: cases.reference_failures(r, world_size, group), monkeypatch)
    failures = [f"rank {r}: {f}" for r, fs in enumerate(results) for f in fs]
    assert not failures, "\n".join(failures[:40])


@pytest.mark.distributed
def test_one_all_gather_per_call_and_no_collective_in_backward():
    failures = _failures(2, "collectives")
    assert not failures, "\n".join(failures[:40])


@pytest.mark.distributed
@no_hosts_mark()
@pytest.mark.parametrize("host", nemo_rl_hosts(), ids=host_label)
def test_chunked_logprobs_equal_nemo_rl_distributed_logprob(host):
    """Against NeMo-RL's ``DistributedLogprob`` and ``ChunkedDistributedLogprob``, TP 2 on gloo."""
    run_world(2, cases.check_equals_nemo_rl, host)


def _saved_bytes(fn, logits):
    """Bytes the graph of ``fn(logits)`` keeps for backward, the logits' own storage excepted.

    Tensors saved through autograd (``save_for_backward``, built-in ops) and tensors held as
    attributes of any node of the graph (a custom Function's ``ctx``).
    """
    saved = []
    mine = logits.untyped_storage().data_ptr()

    def note(t):
        if t.untyped_storage().data_ptr() != mine:
            saved.append((tuple(t.shape), t.dtype, t.numel() * t.element_size()))

    def pack(t):
        note(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(logits)
    todo, seen = [out.grad_fn], set()
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        for value in getattr(node, "__dict__", {}).values():
            if isinstance(value, torch.Tensor):
                note(value)
        todo.extend(next_node for next_node, _ in node.next_functions)
    return out, saved


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("path", ["log-probs", "the whole sharded loss"])
def test_nothing_of_the_logits_size_is_saved_for_backward(dtype, path):
    """Only O(B * T) tensors besides the logits (which NeMo-RL holds anyway): no float32 [T, V]."""
    B, S, V = 2, 64, 512
    logits, data, gvs, gvt = make_data(B, S, V)
    logits = logits.to(dtype).requires_grad_(True)
    if path == "log-probs":
        fn = lambda z: target_logprobs(z[:, :-1], data["input_ids"][:, 1:], None, 16)  # noqa: E731
    else:
        loss_fn = CorrectedPGLoss(CONFIGS["gspo/sequence_mean+geo-rs+veto+token-k3"])
        fn = lambda z: sharded_loss(loss_fn, z, data, gvs, gvt, chunk_size=16)[0]  # noqa: E731
    out, saved = _saved_bytes(fn, logits)
    largest = max(n for _, _, n in saved)
    assert largest <= 8 * B * S, f"a saved tensor of {largest} bytes: {sorted(saved, key=lambda s: -s[2])[:3]}"
    assert sum(n for _, _, n in saved) <= 256 * B * S, saved
    out.sum().backward()  # and the graph still runs
    assert torch.isfinite(logits.grad.float()).all()


def test_the_saved_bytes_probe_sees_a_saved_softmax():
    """The probe above is not blind: the previous path saved the float32 softmax of the shard."""
    B, S, V = 2, 64, 512
    logits, data, _, _ = make_data(B, S, V)
    _, saved = _saved_bytes(
        lambda z: torch.log_softmax(z[:, :-1].float(), -1).gather(-1, data["input_ids"][:, 1:, None]),
        logits.requires_grad_(True),
    )
    assert max(n for _, _, n in saved) >= 4 * B * (S - 1) * V
    _, saved = _saved_bytes(
        lambda z: unchunked_target_logprobs(z[:, :-1], data["input_ids"][:, 1:]), logits.requires_grad_(True)
    )
    assert max(n for _, _, n in saved) >= 4 * B * (S - 1) * V


@pytest.mark.parametrize("bad", [0, -8, 2.5, True, "1024"])
def test_a_chunk_size_that_cannot_work_is_refused_by_name(bad):
    logits = torch.randn(1, 4, 8)
    with pytest.raises(ValueError, match=r"chunk_size: got .*allowed: a positive integer"):
        target_logprobs(logits, torch.zeros(1, 4, dtype=torch.long), None, bad)
    problem = chunk_size_problem(bad)
    assert problem is not None and problem.startswith(f"policy.logprob_chunk_size: got {bad!r}")
    assert str(DEFAULT_LOGPROB_CHUNK_SIZE) in problem


@pytest.mark.parametrize("world_size", [1, 2], ids=["tp1", "tp2-threads"])
def test_an_id_outside_the_vocabulary_has_log_prob_0_and_no_gradient(world_size, monkeypatch):
    """NeMo-RL's vocab-range mask gives such a target (padding) log-prob 0; the other positions are unchanged."""
    V, v_local = 8, 8 // world_size
    z = torch.randn(2, 5, V, generator=torch.Generator().manual_seed(3), dtype=torch.float64).float()
    target = torch.tensor([[1, -1, 7, 8, 3], [100, 0, 5, 2, -7]])
    outside = (target < 0) | (target >= V)
    clamped = target.clamp(0, V - 1)
    want = torch.log_softmax(z, -1).gather(-1, clamped.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)

    def rank(r, group):
        shard = z[..., r * v_local : (r + 1) * v_local].clone().requires_grad_(True)
        lp = target_logprobs(shard, target, group, chunk_size=2)
        lp.sum().backward()
        return lp.detach(), shard.grad

    for lp, grad in _thread_ranks(world_size, rank, monkeypatch):
        torch.testing.assert_close(lp, want, rtol=1e-6, atol=1e-6)
        assert torch.equal(grad[outside], torch.zeros_like(grad[outside]))  # no gradient there
        assert grad[~outside].abs().sum() > 0


@pytest.mark.parametrize("world_size", [1, 2, 4], ids=["tp1", "tp2-threads", "tp4-threads"])
def test_rows_of_minus_infinity_give_float64_s_log_probs(world_size, monkeypatch):
    """A row whose whole shard is -inf (masked columns) next to very negative logits elsewhere: no nan, no inf."""
    V = 8
    v_local = V // world_size
    z = torch.randn(3, 4, V, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    z[0] = -120.0 + z[0]  # around -120: exp underflows relative to a maximum taken as 0
    z[0, :, V // 2 :] = -torch.inf  # the upper half masked on row 0 (whole shards at TP 2 and 4)
    z[1, :, : V // 2] = -torch.inf  # the lower half masked on row 1
    z[2, 1, 1:7] = -torch.inf  # most of the vocabulary masked at one position
    z = z.float()
    target = torch.tensor([[1, 0, 1, 0], [V - 1, V - 2, V - 1, V - 2], [V - 1, V - 1, 0, 1]])
    want_z = z.double().requires_grad_(True)
    want = torch.log_softmax(want_z, -1).gather(-1, target.unsqueeze(-1)).squeeze(-1)
    g = torch.randn(3, 4, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    want.backward(g)

    def rank(r, group):
        shard = z[..., r * v_local : (r + 1) * v_local].clone().requires_grad_(True)
        lp = target_logprobs(shard, target, group, chunk_size=3)
        lp.backward(g.float())
        return lp.detach(), shard.grad, r

    for lp, grad, r in _thread_ranks(world_size, rank, monkeypatch):
        finite = torch.isfinite(want.detach())
        assert torch.equal(torch.isfinite(lp), finite), (lp, want)
        torch.testing.assert_close(lp[finite].double(), want.detach()[finite], rtol=1e-5, atol=1e-5)
        want_grad = want_z.grad[..., r * v_local : (r + 1) * v_local]
        assert torch.isfinite(grad).all()
        torch.testing.assert_close(grad.double(), want_grad, rtol=1e-5, atol=1e-6)


def test_the_default_chunk_size_is_what_a_long_shard_is_cut_by(monkeypatch):
    from nemo_rs_plugin.parallel import vocab_parallel

    chunks = []
    real = vocab_parallel._float32_chunk

    def counting(chunk, shift):
        chunks.append(chunk.shape[1])
        return real(chunk, shift)

    monkeypatch.setattr(vocab_parallel, "_float32_chunk", counting)
    T = 2 * DEFAULT_LOGPROB_CHUNK_SIZE + 5
    z = torch.randn(1, T, 4, requires_grad=True)
    target_logprobs(z, torch.zeros(1, T, dtype=torch.long)).sum().backward()
    # forward then backward (bf16 would be the same; float32's backward works in place)
    assert chunks == [DEFAULT_LOGPROB_CHUNK_SIZE, DEFAULT_LOGPROB_CHUNK_SIZE, 5], chunks


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_nonfinite_logit_gives_a_nan_logprob_a_zero_gradient_row_and_is_flagged(value, dtype):
    """A NaN/+inf logit, or a position with -inf over the whole vocabulary: that position's
    log-prob is NaN (the loss counts and masks it) and its logits get gradient 0, the other
    positions exactly what finite logits give; one -inf entry is a masked vocabulary entry."""
    from nemo_rs_plugin.parallel.vocab_parallel import target_logprobs_and_nonfinite_rows

    g = torch.Generator().manual_seed(3)
    z = torch.randn(2, 7, 9, generator=g).to(dtype)
    target = torch.randint(0, 9, (2, 7), generator=g)
    bad = z.clone()
    bad[1, 3, 4] = value
    bad[0, 2, 5] = float("-inf")
    bad[1, 6] = float("-inf")  # no finite logit at all: softmax 0/0
    bad.requires_grad_(True)
    lp, rows = target_logprobs_and_nonfinite_rows(bad, target, None, 3)
    weights = torch.randn(2, 7, generator=g)
    (torch.nan_to_num(lp, nan=0.0) * weights).sum().backward()
    expected_rows = torch.zeros(2, 7, dtype=torch.bool)
    expected_rows[1, 3] = expected_rows[1, 6] = True
    assert torch.equal(rows, expected_rows)
    assert torch.isnan(lp[expected_rows]).all() and torch.isfinite(lp[~expected_rows]).all()
    assert torch.isfinite(bad.grad).all() and not bad.grad[1, 3].any() and not bad.grad[1, 6].any()
    ref = z.clone()
    ref[0, 2, 5] = float("-inf")
    ref.requires_grad_(True)
    ref_lp = target_logprobs(ref, target, None, 3)
    (ref_lp * weights * ~expected_rows).sum().backward()
    torch.testing.assert_close(lp[~expected_rows], ref_lp[~expected_rows])
    torch.testing.assert_close(bad.grad, ref.grad * ~expected_rows.unsqueeze(-1))


def test_nonfinite_logits_are_counted_at_every_position_and_warned_of_once(monkeypatch):
    """The sharded path's metric counts every position with a NaN/+inf logit (prompt, masked row,
    last position, valid token), and the InputWarning fires once per process."""
    import warnings

    from nemo_rs_plugin.core.batch import input_checks
    from nemo_rs_plugin.core.batch.input_checks import InputWarning

    monkeypatch.setattr(input_checks, "_SAID_ONCE", set())
    logits, data, gvs, gvt = make_data(3, 8, 6)
    data["sample_mask"][2] = 0
    bad = logits.clone()
    for row, position in ((0, 0), (2, 4), (1, 7), (0, 5)):  # prompt, masked row, last, valid token
        bad[row, position, 1] = float("nan")
    loss_fn = CorrectedPGLoss({"sharded_logits_input": True})
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(2):
            z = bad.clone().requires_grad_(True)
            loss, metrics = sharded_loss(loss_fn, z, data, gvs, gvt)
            loss.backward()
            assert torch.isfinite(loss) and torch.isfinite(z.grad).all()
            assert metrics["nonfinite_logit_rows_count"] == 4
    assert [w.category for w in seen].count(InputWarning) == 1, [str(w.message) for w in seen]
    _, clean = sharded_loss(loss_fn, logits, data, gvs, gvt)
    assert clean["nonfinite_logit_rows_count"] == 0


def test_an_empty_sequence_and_a_wider_field_keep_their_shapes():
    """No position: ``[B, 0]`` log-probs and flags, a ``[B, 0, V]`` gradient (at least one chunk runs);
    ``shift_left`` moves dimension 1 of any rank and leaves an empty sequence empty."""
    from nemo_rs_plugin.parallel.layout import shift_left
    from nemo_rs_plugin.parallel.vocab_parallel import target_logprobs_and_nonfinite_rows

    logits = torch.randn(2, 0, 8, requires_grad=True)
    logprobs, flagged = target_logprobs_and_nonfinite_rows(logits, torch.zeros(2, 0, dtype=torch.long), None, 4)
    assert logprobs.shape == flagged.shape == (2, 0)
    logprobs.sum().backward()
    assert logits.grad is not None and logits.grad.shape == (2, 0, 8)
    wide = torch.arange(30.0).reshape(2, 5, 3)
    assert torch.equal(shift_left(wide, -1.0), torch.cat([wide[:, 1:], torch.full((2, 1, 3), -1.0)], dim=1))
    assert shift_left(torch.ones(2, 0, dtype=torch.long)).shape == (2, 0)
