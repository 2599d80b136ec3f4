"""The rollout's state machine on a group of one (gloo): the phases one rank walks through,
one step boundary at a time, for a switch, a failed prepare and a prepare that times out."""

from __future__ import annotations

import logging
import os
import threading
import time

import pytest
import torch.distributed as dist
from svc_thread import free_port
from test_rollout_group import Recorder, published

from eplb_engine.rollout import ChunkedApplier, MoverApplier, Phase, ProcessGroupBarrier, Rollout
from eplb_engine.survivors import GroupMismatch


@pytest.fixture(scope="module")
def group_of_one():
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class Gated(Recorder):
    """A prepare that returns when the test opens ``gate``; it records the thread it ran on."""

    def __init__(self, fail: bool = False) -> None:
        super().__init__(fail=fail)
        self.gate = threading.Event()
        self.threads: list[str] = []

    def prepare(self, old, new) -> None:
        self.threads.append(threading.current_thread().name)
        assert self.gate.wait(10)
        super().prepare(old, new)


def settle(rollout: Rollout, applier: Gated, step: int) -> Phase:
    """Opens the gate, waits for the prepare's future, and steps once."""
    applier.gate.set()
    time.sleep(0.05)
    rollout.step(step)
    return rollout.phase


def test_a_switch_goes_idle_preparing_ready_idle(group_of_one):
    applier = Gated()
    rollout = Rollout(published(1), applier, ProcessGroupBarrier())
    assert rollout.step(0).version == 1 and rollout.phase is Phase.IDLE
    assert rollout.switch_target is None
    rollout.offer(published(2))
    rollout.step(1)  # the barrier agrees to start: the prepare runs on the worker
    assert rollout.phase is Phase.PREPARING and rollout.step(2).version == 1  # still preparing
    assert rollout.switch_target.version == 2  # what a chunked adapter draws its tables over
    # The outcome is read at a step boundary, where the barrier sees the rank ready and switches.
    assert settle(rollout, applier, 3) is Phase.IDLE and rollout.current.version == 2
    assert rollout.switch_target is None
    assert applier.calls == ["prepare", "commit"] and applier.threads[0].startswith("eplb-prepare")
    assert [(e.kind, e.version, e.step) for e in rollout.events] == [("switched", 2, 3)]
    rollout.close()


def test_a_failed_prepare_goes_failed_then_idle_and_is_not_prepared_again(group_of_one):
    applier = Gated(fail=True)
    rollout = Rollout(published(1), applier, ProcessGroupBarrier())
    rollout.offer(published(2))
    rollout.step(0)
    assert settle(rollout, applier, 1) is Phase.IDLE  # FAILED, then the agreed abort at the same boundary
    assert [(e.kind, e.error) for e in rollout.events] == [("failed", "RuntimeError: staging buffer allocation failed")]
    rollout.step(2)
    assert rollout.phase is Phase.IDLE and applier.calls == ["prepare", "rollback"]  # v2 is refused
    rollout.close()


class Mismatched(Gated):
    def prepare(self, old, new) -> None:
        super().prepare(old, new)
        raise GroupMismatch("the process group has 2 ranks; the topology has num_gpus = 3")


def test_a_version_the_mover_group_cannot_hold_is_refused_with_a_warning_not_a_traceback(group_of_one, caplog):
    # After a death a version planned for the whole group reaches the survivors' group: it used
    # to be logged at ERROR with a traceback on every such run (eplb demo --fail-rank).
    applier = Mismatched()
    rollout = Rollout(published(1), applier, ProcessGroupBarrier())
    rollout.offer(published(2))
    rollout.step(0)
    with caplog.at_level(logging.WARNING, logger="eplb_engine.rollout"):
        assert settle(rollout, applier, 1) is Phase.IDLE
    assert [(e.kind, e.error) for e in rollout.events] == [
        ("failed", "GroupMismatch: the process group has 2 ranks; the topology has num_gpus = 3")
    ]
    (record,) = [r for r in caplog.records if r.name == "eplb_engine.rollout"]
    assert record.levelno == logging.WARNING and record.exc_info is None
    assert "version 2 refused by this rank's mover group" in record.getMessage()
    rollout.close()


def test_a_timed_out_prepare_is_rolled_back_only_once_it_returns(group_of_one):
    applier = Gated()
    rollout = Rollout(published(1), applier, ProcessGroupBarrier(), timeout_s=0.05)
    rollout.offer(published(2))
    rollout.step(0)
    time.sleep(0.1)
    rollout.step(1)  # timed out: FAILED, but the prepare still runs, so no rollback yet
    assert rollout.phase is Phase.FAILED and applier.calls == []
    assert settle(rollout, applier, 2) is Phase.IDLE and applier.calls == ["prepare", "rollback"]
    assert [(e.kind, e.error) for e in rollout.events] == [("failed", "prepare of version 2 timed out after 0.05 s")]
    rollout.close()


def test_chunked_appliers_are_told_apart_by_the_declared_protocol():
    assert isinstance(MoverApplier(layers=[]), ChunkedApplier)
    assert not isinstance(Recorder(), ChunkedApplier)


def test_route_moved_is_refused_while_a_transition_is_in_flight(group_of_one):
    applier = Gated()
    rollout = Rollout(published(1), applier, ProcessGroupBarrier())
    rollout.offer(published(2))
    rollout.step(0)
    assert rollout.phase is Phase.PREPARING
    with pytest.raises(RuntimeError, match="route_moved needs an idle rollout, this one is preparing"):
        rollout.route_moved(published(3), published(1))
    assert rollout.current.version == 1 and rollout.local_survivor is None  # nothing taken over
    assert settle(rollout, applier, 1) is Phase.IDLE and rollout.current.version == 2
    rollout.close()


@pytest.mark.parametrize("service_first", [False, True])
def test_route_moved_adopts_the_services_plan_of_the_pair_whether_it_came_before_or_after(group_of_one, service_first):
    """The service's plan of (base, no rank down), the same map as the one the ranks moved to
    themselves, may reach a rank's watcher before that rank calls route_moved (a faster rank
    already told the service). Dropping it left this rank on its local number while the others
    adopted the service's, and no later version was ever started."""
    from dataclasses import replace

    base = published(1)
    local = replace(published(2), survivor_of=1, down_ranks=())
    service_plan = replace(local)  # the service's own: same number, pair and map, another object
    applier = Recorder()
    rollout = Rollout(base, applier, ProcessGroupBarrier())
    if service_first:
        rollout.offer(service_plan)
    rollout.route_moved(local, base)
    if not service_first:
        rollout.offer(service_plan)
    rollout.step(0)
    assert rollout.current is service_plan and rollout.local_survivor is None
    assert [(e.kind, e.version) for e in rollout.events] == [("adopted", 2)] and applier.calls == []
    # A later version is rolled out from the map routed, as usual.
    rollout.offer(published(3))
    for step in range(1, 20):
        rollout.step(step)
        if rollout.current.version == 3:
            break
        time.sleep(0.02)
    assert rollout.current.version == 3 and applier.calls[:1] == ["prepare"]
    rollout.close()
