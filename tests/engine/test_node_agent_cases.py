"""Edge cases of the node agent (eplb agent) and LoadReporter(node_agent=), each a defect a review
found (each test's docstring says what went wrong before the fix): reports lost to seq order
across node reports, a refused node report, a rank that never reached the agent, a hung agent,
a rank that does not read, closing, the outbox's overflow, the socket file, the interval."""

from __future__ import annotations

import os
import socket
import threading
import time

import grpc
import numpy as np
import pytest
from agent_helpers import TOPO, agent_process, window
from svc_thread import ServerThread

from eplb_engine.agent import NodeAgent, write_frame
from eplb_engine.client import ServiceClient
from eplb_engine.reporter import LoadReporter
from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb
from eplb_wire._gen.eplb.v1 import balancer_pb2_grpc as pb_grpc
from eplb_wire.arrays import encode

LOGICAL = np.ones((2, 32), dtype=np.int64)  # 64 tokens
PHYSICAL = np.ones((2, 48), dtype=np.int64)  # 96 tokens


def own(rank: int, seq: int, counts: np.ndarray = LOGICAL) -> pb.ReportLoadRequest:
    return pb.ReportLoadRequest(deployment="d1", rank=rank, seq=seq, logical=encode(counts.astype(np.int32)))


def test_a_rank_whose_engine_steps_from_the_start_ever_uses_the_agent(d1_server, sock_path):
    """An engine adds every step from the moment its reporter starts (BalancedRank, drop-ins):
    each round _aggregate fills the outbox before _through_agent looks, and _through_agent only
    connects with an empty outbox, so the rank never reaches the agent."""
    with NodeAgent(sock_path, d1_server.address, interval_s=0.2) as agent:
        rep = LoadReporter(d1_server.address, "d1", rank=0, topology=TOPO, interval_s=0.1, node_agent=sock_path)
        for _ in range(100):  # 2 s of steps, 20 ms each
            assert rep.add(LOGICAL)
            time.sleep(0.02)
        stats = rep.stats()
        rep.close()
        received = agent.stats["received"]
    assert received > 0 and stats.via_agent > 0, (received, stats)


def test_a_ranks_reports_of_two_kinds_keep_their_seq_order_through_the_agent(d1_server, sock_path):
    """The agent groups a round's reports by (deployment, kind, version) in order of first
    appearance, so rank 0's later report (logical, seq s2) goes in a node report before its
    earlier one (physical, seq s1): s1 is then below rank 0's high-water mark, a duplicate,
    and lost (also when rank 0 re-sends it on its own)."""
    with NodeAgent(sock_path, d1_server.address, interval_s=2.0):
        a = LoadReporter(d1_server.address, "d1", rank=0, topology=TOPO, interval_s=0.05, node_agent=sock_path)
        b = LoadReporter(d1_server.address, "d1", rank=1, topology=TOPO, interval_s=0.05, node_agent=sock_path)
        time.sleep(0.3)  # both connected
        assert b.add(LOGICAL)  # rank 1: logical first in the agent's round
        time.sleep(0.15)
        assert a.add(PHYSICAL, version=1)  # rank 0: s1 physical
        time.sleep(0.15)
        assert a.add(LOGICAL)  # rank 0: s2 logical
        assert a.flush(10) and b.flush(10)
        sa = a.stats()
        a.close()
        b.close()
    assert window(d1_server.address) == (3, 64 + 96 + 64), sa


def test_after_a_refused_node_report_the_agent_does_not_count_a_later_report_of_its_ranks(d1_server, sock_path):
    """The agent tells rank 0 ON_YOUR_OWN for s1 (its node report ABORTED: rank 5 had sent its
    own) and goes on to send rank 0's s2 in the next node report of the round: counted, so rank
    0's own re-send of s1 is a duplicate and s1 is lost."""
    with NodeAgent(sock_path, d1_server.address, interval_s=2.0):
        a = LoadReporter(d1_server.address, "d1", rank=0, topology=TOPO, interval_s=0.05, node_agent=sock_path)
        time.sleep(0.3)  # connected
        r5 = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        r5.connect(sock_path)
        write_frame(r5, own(5, 100).SerializeToString())  # rank 5, logical: first in the round
        time.sleep(0.1)
        with grpc.insecure_channel(d1_server.address) as ch:  # rank 5 also sends its own (it thought the agent dead)
            assert pb_grpc.ExpertLoadBalancerServiceStub(ch).ReportLoad(iter([own(5, 100)])).accepted == 1
        assert a.add(LOGICAL)  # rank 0: s1, in the node report with rank 5's (ABORTED)
        time.sleep(0.15)
        assert a.add(PHYSICAL, version=1)  # rank 0: s2, a node report of its own (counted)
        assert a.flush(10)
        sa = a.stats()
        a.close()
        r5.close()
    assert window(d1_server.address) == (3, 64 + 64 + 96), sa


def test_a_closed_agent_hands_its_ranks_back(d1_server, sock_path):
    """NodeAgent.close() stops summing but leaves its ranks' connections open and read: a rank
    keeps handing reports to it that nobody sends, and they are never counted."""
    agent = NodeAgent(sock_path, d1_server.address, interval_s=0.1).start()
    rep = LoadReporter(d1_server.address, "d1", rank=0, topology=TOPO, interval_s=0.05, node_agent=sock_path)
    time.sleep(0.3)  # connected
    agent.close()
    assert rep.add(LOGICAL)
    done = rep.flush(3)
    rep.close(1)
    assert done and window(d1_server.address) == (1, 64)


def test_closing_a_reporter_closes_its_agent_connection(d1_server, sock_path):
    """LoadReporter.close() close()s the agent socket while its ack thread is blocked in recv:
    on Linux that does not end the connection, so the ack thread and the agent's reader of that
    rank live on (one of each per closed reporter)."""
    with NodeAgent(sock_path, d1_server.address, interval_s=0.2):
        for rank in range(4):
            rep = LoadReporter(d1_server.address, "d1", rank=rank, topology=TOPO, interval_s=0.05, node_agent=sock_path)
            time.sleep(0.2)
            assert rep.add(LOGICAL)
            assert rep.flush(5)
            rep.close()
        time.sleep(1.0)
        names = [t.name for t in threading.enumerate()]
    assert not [n for n in names if n.startswith("eplb-reporter-acks") or n == "eplb-agent-rank"], names


def test_a_report_dropped_from_the_full_outbox_but_counted_by_the_agent_is_not_dropped(d1_server, sock_path):
    """max_pending: the outbox drops its oldest report, which the agent holds and later counts:
    stats say dropped_reports=1 yet the service counted its tokens."""
    agent = NodeAgent(sock_path, d1_server.address, interval_s=1.5).start()
    rep = LoadReporter(
        d1_server.address, "d1", rank=0, topology=TOPO, interval_s=0.05, max_pending=2, node_agent=sock_path
    )
    try:
        time.sleep(0.3)  # connected
        for _ in range(3):  # 3 reports handed before the agent's round: the first is dropped
            assert rep.add(LOGICAL)
            time.sleep(0.12)
        assert rep.flush(10)
        s = rep.stats()
    finally:
        rep.close()
        agent.close()
    reports, tokens = window(d1_server.address)
    assert tokens == 3 * 64 - s.dropped_tokens, (s, tokens)


def test_starting_an_agent_does_not_delete_a_file_that_is_not_a_socket(sock_path):
    with open(sock_path, "w") as f:
        f.write("precious")
    try:
        NodeAgent(sock_path, "127.0.0.1:1", interval_s=1.0).start().close()
    except OSError:
        pass  # refusing is fine
    assert os.path.exists(sock_path) and open(sock_path).read() == "precious"


def test_a_second_agent_on_a_live_agents_socket_is_refused(sock_path):
    """The second start() unlinks the live agent's socket and binds its own; when the first one
    closes it unlinks the second's, and no rank can reach the host's agent any more."""
    first = NodeAgent(sock_path, "127.0.0.1:1", interval_s=1.0).start()
    second = None
    try:
        with pytest.raises(OSError):
            second = NodeAgent(sock_path, "127.0.0.1:1", interval_s=1.0).start()
    finally:
        first.close()
        if second is not None:
            alive = os.path.exists(sock_path)
            second.close()
            assert alive, "the second agent's socket was unlinked by the first's close()"


def test_an_interval_of_nan_or_inf_is_refused():
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError):
            NodeAgent("/tmp/unused.sock", "127.0.0.1:1", interval_s=bad)


def test_a_busy_rank_goes_back_to_a_restarted_agent(d1_server, sock_path):
    """After the agent dies (or says ON_YOUR_OWN once) a rank that adds every step never returns
    to the agent: _through_agent only reconnects with an empty outbox, and each round's
    _aggregate has just put the new report in it."""
    import signal

    first = agent_process(sock_path, d1_server.address, 0.2)
    rep = LoadReporter(d1_server.address, "d1", rank=0, topology=TOPO, interval_s=0.1, node_agent=sock_path)
    try:
        time.sleep(0.3)  # connected
        for _ in range(25):
            assert rep.add(LOGICAL)
            time.sleep(0.02)
        assert rep.stats().via_agent > 0  # it did use the first agent
        first.send_signal(signal.SIGKILL)
        first.wait()
        with NodeAgent(sock_path, d1_server.address, interval_s=0.2) as second:
            for _ in range(150):  # 3 s of steps
                assert rep.add(LOGICAL)
                time.sleep(0.02)
            received = second.stats["received"]
    finally:
        rep.close()
        first.kill()
    assert received > 0, "the rank never went back to the restarted agent"


def test_one_kind_a_node_report_kept_across_rounds_then_aborted_loses_nothing(sock_path):
    """One kind of counts. While the service answers NOT_FOUND (a replica whose store restarted
    empty, until the deployment is written back) the agent keeps N1 {rank 5: 100, rank 0: a1}
    and queues N2 {rank 0: a2}. Rank 5 sends its own meanwhile. Then N1 is ABORTED (rank 0 told
    ON_YOUR_OWN for a1) and the agent goes straight on to N2: a2 counted, so rank 0's own a1 is a
    duplicate: lost."""
    s = ServerThread().start()
    try:
        agent = NodeAgent(sock_path, s.address, interval_s=2.0).start()
        t0 = time.monotonic()
        a = LoadReporter(s.address, "d2", rank=0, topology=TOPO, interval_s=0.05, node_agent=sock_path)
        r5 = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        time.sleep(0.5)  # connected
        r5.connect(sock_path)
        d2 = own(5, 100)
        d2.deployment = "d2"
        write_frame(r5, d2.SerializeToString())
        assert a.add(LOGICAL)  # a1: in N1 with rank 5's, NOT_FOUND at t0+2: kept
        time.sleep(t0 + 2.5 - time.monotonic())
        assert a.add(LOGICAL)  # a2: N2 at t0+4 (N1 NOT_FOUND again: both kept)
        time.sleep(t0 + 4.5 - time.monotonic())
        with ServiceClient(s.address) as client:
            client.create_deployment("d2", TOPO)
        with grpc.insecure_channel(s.address) as ch:  # rank 5 on its own
            assert pb_grpc.ExpertLoadBalancerServiceStub(ch).ReportLoad(iter([d2])).accepted == 1
        assert a.flush(10)  # t0+6: N1 ABORTED, N2 counted; rank 0 re-sends a1 and a2 on its own
        sa = a.stats()
        a.close()
        agent.close()
        r5.close()
        with grpc.insecure_channel(s.address) as ch:
            dry = pb_grpc.ExpertLoadBalancerServiceStub(ch).Rebalance(
                pb.RebalanceRequest(deployment="d2", dry_run=True)
            )
        assert (dry.window_reports, dry.window_tokens) == (3, 3 * 64), sa
    finally:
        s.stop()


def test_a_hung_agent_does_not_make_a_rank_drop_reports_while_the_service_is_up(d1_server, sock_path):
    """An agent that is alive but stuck (SIGSTOP here; or its send loop blocked) never answers:
    the rank leaves it after agent_timeout_s and sends its reports on its own (it kept them for
    the agent and dropped them past max_pending, though the service was up)."""
    import signal

    agent = agent_process(sock_path, d1_server.address, 0.2)
    rep = LoadReporter(
        d1_server.address,
        "d1",
        rank=0,
        topology=TOPO,
        interval_s=0.1,
        max_pending=8,
        node_agent=sock_path,
        agent_timeout_s=0.5,  # an agent that answers nothing for this long is left
    )
    try:
        time.sleep(0.4)  # connected
        agent.send_signal(signal.SIGSTOP)
        for _ in range(40):  # 4 s of steps
            assert rep.add(LOGICAL)
            time.sleep(0.1)
        s = rep.stats()
    finally:
        agent.send_signal(signal.SIGCONT)
        rep.close(2)
        agent.kill()
        agent.wait()
    assert s.dropped_reports == 0, s


def test_a_rank_that_does_not_read_its_acks_does_not_stall_the_others(d1_server, sock_path):
    """_Rank.tell is a blocking sendall on the agent's only send thread: about 278 unread
    13-byte acks fill a Unix socket's buffer, and then no rank of the host hears anything."""
    with NodeAgent(sock_path, d1_server.address, interval_s=0.3):
        a = LoadReporter(d1_server.address, "d1", rank=0, topology=TOPO, interval_s=0.05, node_agent=sock_path)
        time.sleep(0.4)  # connected
        quiet = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        quiet.connect(sock_path)
        for seq in range(1, 401):  # rank 7: 400 reports, never reads an ack
            write_frame(quiet, own(7, seq).SerializeToString())
        time.sleep(0.5)
        assert a.add(LOGICAL)
        done = a.flush(5)
        a.close(1)
        quiet.close()
    assert done


def test_a_report_handed_after_a_give_back_is_not_counted_before_the_given_back_one(d1_server, sock_path):
    """A rank that had not read its ON_YOUR_OWN yet handed its next report to the agent, which
    counted it in the next round: the given-back lower seq, re-sent on its own, was then a
    duplicate (lost). Now a give-back ends the rank's connection."""
    import contextlib

    from eplb_engine.agent import ACK, ON_YOUR_OWN, read_frame

    with NodeAgent(sock_path, d1_server.address, interval_s=1.0):
        t0 = time.monotonic()
        r5 = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        r5.connect(sock_path)
        r0 = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        r0.connect(sock_path)
        write_frame(r5, own(5, 100).SerializeToString())
        write_frame(r0, own(0, 1).SerializeToString())
        with grpc.insecure_channel(d1_server.address) as ch:  # rank 5 also sent its own
            assert pb_grpc.ExpertLoadBalancerServiceStub(ch).ReportLoad(iter([own(5, 100)])).accepted == 1
        time.sleep(t0 + 1.4 - time.monotonic())  # round 1: {5:100, 0:1} ABORTED, s1 given back
        with contextlib.suppress(OSError):
            write_frame(r0, own(0, 2).SerializeToString())  # rank 0 has not read its answer yet
        time.sleep(t0 + 2.5 - time.monotonic())  # round 2
        r0.settimeout(2)
        assert ACK.unpack(read_frame(r0)) == (1, ON_YOUR_OWN)
        assert read_frame(r0) is None  # its connection ended: seq 2 was not taken
        with grpc.insecure_channel(d1_server.address) as ch:  # rank 0 sends its outbox on its own
            stub = pb_grpc.ExpertLoadBalancerServiceStub(ch)
            assert stub.ReportLoad(iter([own(0, 1), own(0, 2)])).accepted == 2
        r0.close()
        r5.close()
    assert window(d1_server.address) == (3, 3 * 64)
