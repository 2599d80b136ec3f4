"""``eplb_engine.membership`` on real processes (gloo, CPU) around a real ``TCPStore`` held by
the test, the supervisor: a rank killed and detected, the survivors' epoch group, a restarted
rank joined at the step the survivors chose."""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import signal
import time
import traceback
from collections.abc import Callable
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist

import eplb
from eplb_engine import membership
from eplb_engine.membership import JoinWord

_TIMEOUT = timedelta(seconds=30)


def _connect(port: int) -> dist.TCPStore:
    torch.set_num_threads(1)
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=_TIMEOUT)


def _gloo_world(store: dist.TCPStore, rank: int, size: int) -> None:
    dist.init_process_group(
        "gloo", store=dist.PrefixStore("world", store), rank=rank, world_size=size, timeout=_TIMEOUT
    )


def _entry(body: Callable[..., dict], rank: int, port: int, out: mp.Queue, *args: object) -> None:
    try:
        out.put((rank, body(rank, _connect(port), *args)))
    except BaseException:
        out.put((rank, traceback.format_exc()))
    out.close()
    out.join_thread()
    # The world group holds the heartbeat abandoned at a death: destroying it (at exit) would
    # wait out its timeout. The result is flushed; leave without it.
    os._exit(0)


def _results(out: mp.Queue, ranks: list[int], timeout_s: float = 60.0) -> dict[int, dict]:
    got: dict[int, dict] = {}
    deadline = time.monotonic() + timeout_s
    while set(got) != set(ranks):
        rank, result = out.get(timeout=max(0.1, deadline - time.monotonic()))
        assert isinstance(result, dict), f"rank {rank} failed:\n{result}"
        got[rank] = result
    return got


def _start(ctx: mp.context.SpawnContext, body: Callable[..., dict], rank: int, port: int, out: mp.Queue, *args: object):
    p = ctx.Process(target=_entry, args=(body, rank, port, out, *args), daemon=True)
    p.start()
    return p


def _kill(store: dist.TCPStore, proc: mp.Process, rank: int) -> float:
    """The supervisor's part: once ``rank`` asks for it, SIGKILL it and mark it down; the time of the mark."""
    store.wait([f"kill-me/{rank}"], _TIMEOUT)
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(10)
    marked = time.time()  # before the mark: a survivor may read it within a millisecond
    membership.mark_down(store, [rank])
    return marked


def _heartbeats(rank: int, store: dist.TCPStore, victim: int, beats: int) -> dict:
    """Heartbeats on the world until a death; ``victim`` stops after ``beats`` of them."""
    for step in range(1000):
        if rank == victim and step == beats:
            store.set(f"kill-me/{rank}", "1")
            time.sleep(600)
        down = membership.detect_down(dist.group.WORLD, store)
        if down is not None:
            return {"down": down, "step": step, "detected": time.time()}
    raise AssertionError("no death detected")


# ---- a death ----


def _survivor(rank: int, store: dist.TCPStore) -> dict:
    _gloo_world(store, rank, 3)
    seen = _heartbeats(rank, store, victim=2, beats=5)
    groups = membership.epoch_groups(store, 1, rank, 2, mover_timeout_s=10.0)
    sums = []
    for group in (groups.steps, groups.barrier, groups.mover):
        t = torch.tensor([rank + 1.0])
        dist.all_reduce(t, group=group)
        sums.append(float(t))
    return {**seen, "sums": sums}


def test_survivors_detect_a_killed_rank_within_the_check_interval_and_all_reduce_over_their_epoch():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=_TIMEOUT)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [_start(ctx, _survivor, r, store.port, out) for r in range(3)]
    try:
        marked = _kill(store, procs[2], 2)
        got = _results(out, [0, 1])
    finally:
        for p in procs:
            p.kill()
    for rank, seen in got.items():
        # Every heartbeat completed while rank 2 took part; the sixth waited for it, and ended at the mark.
        assert (seen["down"], seen["step"]) == ([2], 5), rank
        # CHECK_S is 5 ms; on a loaded shared machine a process may wait longer for a core.
        assert 0 <= seen["detected"] - marked < 0.5, (rank, seen["detected"] - marked)
        assert seen["sums"] == [3.0, 3.0, 3.0], rank


# ---- a rejoin ----


def _base(topo: eplb.Topology) -> object:
    from eplb_engine.wire import PublishedPlacement
    from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb

    placement = eplb.Placement.contiguous(topo)
    return PublishedPlacement("m", 4, placement, pb.PlanStats(moves=7), (2,), 3, 3, np.ones((2, 6)))


_TOPO = eplb.Topology(2, 6, 9, 3, 1, 1)


def _joined_sum(rank: int, groups: membership.EpochGroups) -> float:
    t = torch.tensor([10.0**rank])
    dist.all_reduce(t, group=groups.mover)
    return float(t)


def _rejoin_survivor(rank: int, store: dist.TCPStore) -> dict:
    _gloo_world(store, rank, 3)
    seen = _heartbeats(rank, store, victim=2, beats=3)
    live = dist.new_group([0, 1], use_local_synchronization=True, timeout=_TIMEOUT)
    # The survivors' vote, one all-reduce a step: they join at the step after all saw it ready.
    for step in range(seen["step"] + 1, 100000):
        vote = torch.tensor([float(membership.joiner_ready(store))])
        dist.all_reduce(vote, group=live)
        if int(vote) == 2:
            join = step + 1
            break
        time.sleep(0.005)
    if rank == 0:
        base = _base(_TOPO)
        membership.announce_join(store, JoinWord(join, base, base.placement.phy2log))
    groups = membership.epoch_groups(store, 1, rank, 3, mover_timeout_s=10.0)
    return {"join": join, "sum": _joined_sum(rank, groups)}


def _restarted(rank: int, store: dist.TCPStore) -> dict:
    membership.placeholder_world(rank, 3)
    membership.mark_ready(store)
    word = membership.wait_join(store)
    assert word is not None
    groups = membership.epoch_groups(store, 1, rank, 3, mover_timeout_s=10.0)
    moves = word.base.stats.moves
    return {"join": word.step, "moves": moves, "routing": word.routing.tolist(), "sum": _joined_sum(rank, groups)}


def test_a_restarted_rank_joins_the_survivors_at_the_step_they_chose_and_all_reduces_with_them():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=_TIMEOUT)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [_start(ctx, _rejoin_survivor, r, store.port, out) for r in range(3)]
    try:
        _kill(store, procs[2], 2)
        procs.append(_start(ctx, _restarted, 2, store.port, out))
        got = _results(out, [0, 1, 2])
    finally:
        for p in procs:
            p.kill()
    joins = {r: got[r]["join"] for r in got}
    assert len(set(joins.values())) == 1 and joins[0] > 4, joins
    # Ranks 0, 1, 2 of epoch 1 each added 10**rank: all three took part.
    assert [got[r]["sum"] for r in range(3)] == [111.0] * 3
    assert got[2]["moves"] == 7
    assert got[2]["routing"] == eplb.Placement.contiguous(_TOPO).phy2log.tolist()


# ---- without processes ----


def test_the_down_ranks_read_back_sorted_and_none_before_any_mark():
    store = dist.HashStore()
    assert membership.read_down(store) is None
    membership.mark_down(store, {3: 0.0, 1: 0.0})
    assert membership.read_down(store) == [1, 3]


def test_the_join_word_travels_whole_and_a_cancel_ends_the_wait():
    base = dataclasses.replace(_base(_TOPO), loads=np.arange(12.0).reshape(2, 6))
    store = dist.HashStore()
    assert not membership.joiner_ready(store)
    membership.mark_ready(store)
    assert membership.joiner_ready(store)
    membership.announce_join(store, JoinWord(42, base, base.placement.phy2log))
    word = membership.wait_join(store)
    assert (word.step, word.base.version, word.base.stats.moves, word.base.down_ranks) == (42, 4, 7, (2,))
    np.testing.assert_array_equal(word.routing, base.placement.phy2log)
    np.testing.assert_array_equal(word.base.loads, base.loads)
    cancelled = dist.HashStore()
    membership.cancel_join(cancelled)
    assert membership.wait_join(cancelled) is None


def test_epoch_groups_name_the_missing_torch_private_instead_of_an_attribute_error(monkeypatch):
    import torch.distributed.distributed_c10d as c10d

    monkeypatch.delattr(c10d, "_new_process_group_helper")
    with pytest.raises(RuntimeError, match="_new_process_group_helper.*does not have"):
        membership.epoch_groups(dist.HashStore(), 1, 0, 1, mover_timeout_s=1.0)


def test_a_heartbeat_every_rank_joins_reports_no_death():
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        assert membership.detect_down(dist.group.WORLD, store) is None
    finally:
        dist.destroy_process_group()


def test_a_placeholder_world_names_the_missing_fake_backend(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "torch.testing._internal.distributed.fake_pg", None)
    with pytest.raises(RuntimeError, match="fake process group.*does not have"):
        membership.placeholder_world(0, 1)
    assert not dist.is_initialized()
