"""An in-process stand-in for a process group: ranks are threads, collectives meet at a barrier.

It lets a fast, non-``distributed`` test run the loss on token shards exactly as CP or
sequence-parallel TP ranks would, with real reductions (SUM, MAX, MIN, in a fixed rank
order, so identical on every rank) and all-gathers, and record every collective issued. It
replaces ``torch.distributed.all_reduce``, ``all_gather``, ``get_rank`` and ``get_world_size`` for
the duration of
:func:`run_ranks`; ``SequenceGroups`` is built directly from :class:`ThreadGroup` objects.
The gloo tests in ``test_distributed.py`` remain the check against real processes.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import torch
import torch.distributed as dist

_local = threading.local()


class ThreadGroup:
    """A group of thread ranks; ``ranks`` lists the global ranks in reduction order."""

    def __init__(self, ranks: list[int], timeout: float = 60.0):
        self.ranks = list(ranks)
        self.barrier = threading.Barrier(len(self.ranks), timeout=timeout)
        self.slots: dict[int, torch.Tensor] = {}

    def __repr__(self) -> str:
        return f"ThreadGroup({self.ranks})"


def _all_reduce(tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM, group: Any = None, async_op: bool = False):
    if not isinstance(group, ThreadGroup):
        raise AssertionError(f"all_reduce without an explicit thread group (got {group!r})")
    if async_op:
        raise AssertionError("async all_reduce is not emulated")
    rank = _local.rank
    _local.log.append((op, group))
    group.slots[rank] = tensor.detach().clone()
    group.barrier.wait()
    values = torch.stack([group.slots[r] for r in group.ranks])
    if op == dist.ReduceOp.SUM:
        out = values[0].clone()
        for v in values[1:]:
            out = out + v
    elif op == dist.ReduceOp.MAX:
        out = values.amax(0)
    elif op == dist.ReduceOp.MIN:
        out = values.amin(0)
    else:
        raise AssertionError(f"reduce op {op} is not emulated")
    group.barrier.wait()  # everyone has read the slots before anyone writes again
    with torch.no_grad():
        tensor.copy_(out)


def _all_gather(tensor_list: list, tensor: torch.Tensor, group: Any = None, async_op: bool = False):
    if not isinstance(group, ThreadGroup):
        raise AssertionError(f"all_gather without an explicit thread group (got {group!r})")
    if async_op:
        raise AssertionError("async all_gather is not emulated")
    rank = _local.rank
    _local.log.append(("all_gather", group))
    group.slots[rank] = tensor.detach().clone()
    group.barrier.wait()
    with torch.no_grad():
        for out, r in zip(tensor_list, group.ranks):
            out.copy_(group.slots[r])
    group.barrier.wait()


def _get_rank(group: Any = None) -> int:
    if not isinstance(group, ThreadGroup):
        raise AssertionError(f"get_rank without an explicit thread group (got {group!r})")
    return group.ranks.index(_local.rank)


def _get_world_size(group: Any = None) -> int:
    if not isinstance(group, ThreadGroup):
        raise AssertionError(f"get_world_size without an explicit thread group (got {group!r})")
    return len(group.ranks)


def run_ranks(world_size: int, fn: Callable[[int], Any], groups: list[ThreadGroup], monkeypatch) -> list[Any]:
    """Run ``fn(rank)`` on ``world_size`` threads; return each rank's ``(result, collectives)``.

    ``collectives`` lists the ``(op, group)`` of every all-reduce that rank issued, in order.
    An exception on any rank aborts the barriers (no rank hangs) and is re-raised.
    """
    monkeypatch.setattr(torch.distributed, "all_reduce", _all_reduce)
    monkeypatch.setattr(torch.distributed, "all_gather", _all_gather)
    monkeypatch.setattr(torch.distributed, "get_rank", _get_rank)
    monkeypatch.setattr(torch.distributed, "get_world_size", _get_world_size)
    results: list[Any] = [None] * world_size
    errors: list[BaseException] = []

    def target(rank: int) -> None:
        _local.rank, _local.log = rank, []
        try:
            results[rank] = (fn(rank), list(_local.log))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            errors.append(exc)
            for g in groups:
                g.barrier.abort()

    threads = [threading.Thread(target=target, args=(r,), daemon=True) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    if errors:
        real = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
        raise (real or errors)[0]
    if any(t.is_alive() for t in threads):
        raise AssertionError("a thread rank did not finish")
    return results
