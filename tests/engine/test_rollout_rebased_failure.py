"""A failed move from a rebased local survivor placement (a group of one, gloo).

The survivors route L, a survivor placement they computed after a death (known by its base
version B and down ranks); the service then publishes another plan S under L's number, so the
rank rebases (``current`` back to B, L still routed) and moves to S from L. If that move fails,
the rank must stay on L, the map its weights hold: moving "back" to B would route the dead
rank's slots again (the bug: events ``failed 2`` then ``reverted 1``, ending on B's map)."""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np
import pytest
from test_rollout_group import published
from test_rollout_phases import group_of_one  # noqa: F401 (a fixture)

import eplb
from eplb_engine.rollout import Phase, ProcessGroupBarrier, Rollout

BASE = published(1)
# The local survivor placement of (version 1, gpu 1 down): numbered 2 on this rank only.
LOCAL = replace(published(2), survivor_of=1, down_ranks=(1,))
# The service's version 2: a normal plan from version 1, another map under the same number.
SERVICE = replace(published(3), version=2)
NEWER = published(4)


class Moves:
    """Records each prepare's (old, new) maps; fails the prepare (or, chunked, the prepare of
    chunk ``fail_chunk``) of a move to ``fail``'s map."""

    def __init__(self, fail: eplb.Placement, chunked: bool = False, fail_chunk: int = 0) -> None:
        self.fail, self.fail_chunk, self.moves, self.calls = fail, fail_chunk, [], []
        self._new: eplb.Placement | None = None
        self._chunk = 0
        if chunked:
            self.chunks: tuple[tuple[int, ...], ...] = ()
            self.prepare_next = self._prepare_next

    def prepare(self, old: eplb.Placement, new: eplb.Placement) -> None:
        self.moves.append((old.phy2log.tolist(), new.phy2log.tolist()))
        self.calls.append("prepare")
        self._new, self._chunk = new, 0
        if hasattr(self, "chunks"):
            self.chunks = ((0,), (1,))
        self._check()

    def _prepare_next(self) -> None:
        self.calls.append("prepare_next")
        self._chunk += 1
        self._check()

    def _check(self) -> None:
        if self._new is not None and np.array_equal(self._new.phy2log, self.fail.phy2log):
            if self._chunk == self.fail_chunk:
                raise RuntimeError("staging buffer allocation failed")

    def commit(self) -> None:
        self.calls.append("commit")

    def rollback(self) -> None:
        self.calls.append("rollback")


def run(rollout: Rollout, first: int, until, steps: int = 200) -> int:
    """Steps from ``first`` until ``until()`` holds (2 ms apart); the next step's number."""
    step = first
    for step in range(first, first + steps):
        rollout.step(step)
        if until():
            return step + 1
        time.sleep(0.002)
    raise AssertionError(f"not reached in {steps} steps: {rollout.events}")


def idle(rollout: Rollout, first: int, steps: int = 5) -> tuple[int, object]:
    """``steps`` more steps; the next step's number and the last map routed."""
    for step in range(first, first + steps):
        routed = rollout.step(step)
        time.sleep(0.002)
    return first + steps, routed


def rows(p: eplb.Placement) -> list:
    return p.phy2log.tolist()


@pytest.mark.parametrize("chunked", [False, True])
def test_a_failed_move_from_a_rebased_survivor_map_stays_on_it(group_of_one, chunked):  # noqa: F811
    assert not np.array_equal(LOCAL.placement.phy2log, SERVICE.placement.phy2log)
    # Chunked: chunk 0 (layer 0) of the move to the service's map switches, chunk 1 fails.
    applier = Moves(SERVICE.placement, chunked=chunked, fail_chunk=1 if chunked else 0)
    rollout = Rollout(BASE, applier, ProcessGroupBarrier())
    rollout.route_moved(LOCAL, BASE)
    rollout.offer(SERVICE)
    step = run(rollout, 0, lambda: bool(rollout.events) and rollout.phase is Phase.IDLE)
    if chunked:  # the switched layer moves back, to the survivor map, not to the base
        step = run(rollout, step, lambda: len(rollout.events) == 2 and rollout.phase is Phase.IDLE)
    step, routed = idle(rollout, step)  # a few more steps: nothing else happens
    kinds = [(e.kind, e.version) for e in rollout.events]
    assert kinds == ([("failed", 2), ("reverted", 2)] if chunked else [("failed", 2)])
    assert rollout.events[0].error == "RuntimeError: staging buffer allocation failed"
    # The rank routes L again, under L's number and pair, as route_moved left it.
    assert rows(routed.placement) == rows(LOCAL.placement) and routed.version == 2
    assert rollout.current is LOCAL and (rollout.current.survivor_of, rollout.current.down_ranks) == (1, (1,))
    assert rollout.routing is LOCAL.placement and not rollout.mixed and rollout.local_survivor is LOCAL
    # Nothing moved towards the base map; chunked, the one switched layer moved back to L.
    assert [new for _, new in applier.moves] == [rows(SERVICE.placement)] + ([rows(LOCAL.placement)] if chunked else [])
    assert applier.moves[0][0] == rows(LOCAL.placement)
    if chunked:
        half = rows(LOCAL.placement)
        half[0] = rows(SERVICE.placement)[0]
        assert applier.moves[1][0] == half
    # The failed version is refused: offered again, it is not prepared again.
    prepares = len(applier.moves)
    rollout.offer(SERVICE)
    step, _ = idle(rollout, step)
    assert len(applier.moves) == prepares and rollout.current is LOCAL
    # A newer service version rolls out from L.
    rollout.offer(NEWER)
    run(rollout, step, lambda: rollout.current is NEWER and rollout.phase is Phase.IDLE)
    assert applier.moves[-1] == (rows(LOCAL.placement), rows(NEWER.placement))
    assert [(e.kind, e.version) for e in rollout.events][-1] == ("switched", 4)
    assert rollout.routing is NEWER.placement and rollout.local_survivor is None
    rollout.close()


def test_a_regroup_during_a_move_from_a_rebased_survivor_map_goes_back_to_it(group_of_one):  # noqa: F811
    """Another rank dies while the move to the service's version is half switched: the move is
    dropped, and ``current`` is the survivor placement again (the next survivor placement is
    computed from ``current``; the base still counts the rank that died first)."""
    applier = Moves(NEWER.placement, chunked=True)  # fails nothing here
    rollout = Rollout(BASE, applier, ProcessGroupBarrier())
    rollout.route_moved(LOCAL, BASE)
    rollout.offer(SERVICE)
    step = run(rollout, 0, lambda: "commit" in applier.calls)  # chunk 0 switched
    rollout.regroup(ProcessGroupBarrier())
    assert [(e.kind, e.version, e.error) for e in rollout.events] == [("aborted", 2, "a rank died")]
    assert rollout.phase is Phase.IDLE and rollout.current is LOCAL and rollout.local_survivor is LOCAL
    half = rows(LOCAL.placement)
    half[0] = rows(SERVICE.placement)[0]
    assert rollout.mixed and rows(rollout.routing) == half  # layer 0 stays switched: the next move starts there
    # The survivors then offer their next survivor placement, of current (ranks_down does):
    # its move starts from the map held, and it switches.
    survivor = replace(published(5), version=3, survivor_of=2, down_ranks=(1, 2))
    rollout.offer(survivor, supersede=True)
    run(rollout, step, lambda: rollout.current is survivor and rollout.phase is Phase.IDLE)
    assert applier.moves[-1] == (half, rows(survivor.placement)) and not rollout.mixed
    assert [(e.kind, e.version) for e in rollout.events][-1] == ("switched", 3)
    rollout.close()
