"""The node agent (``eplb agent``): a host's ranks send one summed report per interval, and every
acknowledged count is counted exactly once, also when the agent is killed mid-interval.

A real service (``ServerThread``, the embedded store), real ``LoadReporter`` threads, the agent
in this process or as its own ``eplb agent`` process (killed with SIGKILL).
"""

from __future__ import annotations

import signal
import socket
import time

import grpc
import numpy as np
from agent_helpers import TOPO, agent_process, window

from eplb_engine.agent import ACK, COUNTED, ON_YOUR_OWN, NodeAgent, read_frame, write_frame
from eplb_engine.reporter import LoadReporter
from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb
from eplb_wire._gen.eplb.v1 import balancer_pb2_grpc as pb_grpc
from eplb_wire.arrays import encode


def test_eight_ranks_send_one_report_an_interval_and_every_count_is_counted_once(d1_server, sock_path):
    with NodeAgent(sock_path, d1_server.address, interval_s=0.2) as agent:
        reporters = [
            LoadReporter(d1_server.address, "d1", rank=r, topology=TOPO, interval_s=0.1, node_agent=sock_path)
            for r in range(8)
        ]
        time.sleep(0.3)  # connected
        for _ in range(10):
            for r, rep in enumerate(reporters):
                assert rep.add(np.full((2, 32), r + 1, dtype=np.int64))
            time.sleep(0.1)
        assert all(rep.flush(10) for rep in reporters)
        stats = [rep.stats() for rep in reporters]
        for rep in reporters:
            rep.close()
        node_reports, covered = agent.stats["node_reports"], agent.stats["covered"]
    reports = sum(s.sent for s in stats)
    assert sum(s.via_agent for s in stats) == reports > 0  # all went through the agent
    assert covered == reports and node_reports <= reports / 4  # about 8 ranks' reports in one
    assert window(d1_server.address) == (reports, 10 * 2 * 32 * sum(range(1, 9)))


def test_a_killed_agent_loses_nothing_and_counts_nothing_twice(d1_server, sock_path):
    agent = agent_process(sock_path, d1_server.address)
    reporters = [
        LoadReporter(d1_server.address, "d1", rank=r, topology=TOPO, interval_s=0.05, node_agent=sock_path)
        for r in range(8)
    ]
    try:
        time.sleep(0.3)
        added = 0
        for step in range(60):
            for r, rep in enumerate(reporters):
                assert rep.add(np.full((2, 32), r + 1, dtype=np.int64))
            added += 1
            if step == 20:
                agent.send_signal(signal.SIGKILL)  # mid-interval: some reports with it, unanswered
                agent.wait()
            if step == 40:
                agent = agent_process(sock_path, d1_server.address)  # ranks come back to it
            time.sleep(0.03)
        assert all(rep.flush(15) for rep in reporters)
        stats = [rep.stats() for rep in reporters]
    finally:
        for rep in reporters:
            rep.close()
        agent.kill()
        agent.wait()
    assert all(s.dropped_reports == 0 and s.rejected == 0 for s in stats)
    assert 0 < sum(s.via_agent for s in stats) < sum(s.sent for s in stats)  # both ways were used
    reports, tokens = window(d1_server.address)
    assert tokens == added * 2 * 32 * sum(range(1, 9))  # every count once
    # Each report the window holds is one a rank knows counted (accepted), or one the killed
    # agent had counted whose answer died with it (the kernel drops what a killed process's
    # socket still had for a rank): that rank sent it again and heard it was a duplicate.
    accepted, duplicates = sum(s.accepted for s in stats), sum(s.duplicates for s in stats)
    assert accepted <= reports <= accepted + duplicates


def test_a_node_report_beaten_by_a_ranks_own_tells_the_others_to_send_theirs(d1_server, sock_path):
    counts = encode(np.ones((2, 32), dtype=np.int32))
    with NodeAgent(sock_path, d1_server.address, interval_s=0.5):
        socks = []
        for rank in (0, 1):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(sock_path)
            s.settimeout(5)
            socks.append(s)
            write_frame(
                s, pb.ReportLoadRequest(deployment="d1", rank=rank, seq=100, logical=counts).SerializeToString()
            )
        # Rank 0 sends its own before the agent's interval ends (it thought the agent dead).
        with grpc.insecure_channel(d1_server.address) as ch:
            own = pb.ReportLoadRequest(deployment="d1", rank=0, seq=100, logical=counts)
            assert pb_grpc.ExpertLoadBalancerServiceStub(ch).ReportLoad(iter([own])).accepted == 1
        answers = [ACK.unpack(read_frame(s)) for s in socks]
        assert answers == [(100, ON_YOUR_OWN), (100, ON_YOUR_OWN)]
        # Rank 1 does as told; rank 0's is a duplicate: each counted once.
        with grpc.insecure_channel(d1_server.address) as ch:
            stub = pb_grpc.ExpertLoadBalancerServiceStub(ch)
            assert (
                stub.ReportLoad(iter([pb.ReportLoadRequest(deployment="d1", rank=1, seq=100, logical=counts)])).accepted
                == 1
            )
        # The agent ended both connections with its answer; rank 1 comes back on a new one.
        assert read_frame(socks[1]) is None
        again = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        again.connect(sock_path)
        again.settimeout(5)
        socks.append(again)
        write_frame(again, pb.ReportLoadRequest(deployment="d1", rank=1, seq=101, logical=counts).SerializeToString())
        assert ACK.unpack(read_frame(again)) == (101, COUNTED)
        for s in socks:
            s.close()
    assert window(d1_server.address) == (3, 3 * 2 * 32)
