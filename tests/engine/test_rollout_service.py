"""The rollout protocol through the service's AckPlacement barrier: ranks (threads here, each
with its own client) switch at the step the service fixes, and one rank's failure aborts."""

from __future__ import annotations

import threading
import time

import pytest
from svc_thread import ServerThread, report_some_load
from test_rollout_group import Recorder

import eplb
from eplb_engine.client import ServiceClient
from eplb_engine.rollout import Rollout, ServiceBarrier
from eplb_engine.watcher import PlacementWatcher
from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb

TOPO = eplb.Topology(num_layers=2, num_experts=8, num_slots=12, num_gpus=3)
# Ranks here are threads that do not step in lockstep, so the margin also covers their skew.
MARGIN = 40


@pytest.fixture
def server():
    s = ServerThread().start()
    yield s
    s.stop()


def run_rank(address: str, rank: int, applier: Recorder, steps: int, out: dict) -> None:
    """One rank: watcher → rollout.offer, then ``steps`` steps of 5 ms; records the version per step."""
    client = ServiceClient(address)
    rollout = Rollout(
        client.get_placement("d1", topology=TOPO), applier, ServiceBarrier(client, "d1", rank), timeout_s=5.0
    )
    watcher = PlacementWatcher(address, "d1", rollout.offer, topology=TOPO, rank=rank, ack=False)
    routed = []
    for step in range(steps):
        routed.append(rollout.step(step).version)
        time.sleep(0.005)
    watcher.close()
    rollout.close()
    client.close()
    out[rank] = (routed, applier.calls, [(e.kind, e.version, e.step, e.error) for e in rollout.events])


def run_ranks(address: str, appliers: list[Recorder], steps: int, publish_after_s: float) -> dict:
    out: dict = {}
    threads = [threading.Thread(target=run_rank, args=(address, r, a, steps, out)) for r, a in enumerate(appliers)]
    for t in threads:
        t.start()
    time.sleep(publish_after_s)
    report_some_load(address, shape=(TOPO.num_layers, TOPO.num_experts))
    with ServiceClient(address) as client:
        assert client.rebalance("d1", force=True).published
    for t in threads:
        t.join(30)
    return out


def test_every_rank_switches_at_the_step_the_service_fixes(server):
    with ServiceClient(server.address) as client:
        client.create_deployment("d1", TOPO, switch_margin_steps=MARGIN)
        # Rank 2 prepares slowest: the switch step is its PREPARED step + the margin.
        out = run_ranks(server.address, [Recorder(delay_s=0.02 * r) for r in range(3)], steps=200, publish_after_s=0.2)
        steps = {out[r][2][0][2] for r in range(3)}
        assert len(steps) == 1
        (switch,) = steps
        for r in range(3):
            routed, calls, events = out[r]
            assert calls == ["prepare", "commit"] and events == [("switched", 2, switch, "")]
            assert set(routed[:switch]) == {1} and set(routed[switch:]) == {2}
        # Everyone switched: the service saw every rank at version 2.
        got = client.call("GetDeployment", pb.GetDeploymentRequest(name="d1")).acks
        assert [(a.rank, a.version, a.prepared_version) for a in got] == [(0, 2, 2), (1, 2, 2), (2, 2, 2)]
        reply = client.ack("d1", 0, 2, "prepared", step=0)
        assert reply.switch_step == switch and reply.ranks_prepared == 3 and not reply.aborted


def test_a_failed_prepare_is_reported_and_aborts_every_rank(server):
    with ServiceClient(server.address) as client:
        client.create_deployment("d1", TOPO, switch_margin_steps=MARGIN)
        out = run_ranks(server.address, [Recorder(fail=r == 1) for r in range(3)], steps=100, publish_after_s=0.2)
        for r in range(3):
            routed, calls, events = out[r]
            assert set(routed) == {1} and calls == ["prepare", "rollback"]
        assert out[1][2][0][0] == "failed" and out[1][2][0][3] == "RuntimeError: staging buffer allocation failed"
        assert [e[0] for e in out[0][2]] == [e[0] for e in out[2][2]] == ["aborted"]
        reply = client.ack("d1", 0, 2, "prepared", step=0)
        assert reply.aborted and reply.ranks_failed == 1 and reply.switch_step == 0
        got = client.call("GetDeployment", pb.GetDeploymentRequest(name="d1")).acks
        assert [(a.rank, a.failed_version) for a in got if a.failed_version] == [(1, 2)]


class Chunked(Recorder):
    """A chunked applier: its prepare leaves two chunks to switch one after the other."""

    chunks = ((0,), (1,))

    def prepare_next(self) -> None:
        self.calls.append("prepare_next")


def test_the_service_barrier_refuses_a_version_that_needs_several_chunks(server):
    with ServiceClient(server.address) as client:
        client.create_deployment("d1", TOPO, switch_margin_steps=MARGIN)
        out = run_ranks(server.address, [Chunked() for _ in range(3)], steps=100, publish_after_s=0.2)
        for r in range(3):
            routed, calls, events = out[r]
            assert set(routed) == {1} and calls == ["prepare", "rollback"]
            assert events[0][0] == "failed" and "ServiceBarrier switches whole versions only" in events[0][3]
        got = client.call("GetDeployment", pb.GetDeploymentRequest(name="d1")).acks
        assert sorted(a.failed_version for a in got) == [2, 2, 2]
