"""The engine client against a real service on 127.0.0.1: wire helpers, reporter, watcher."""

from __future__ import annotations

import re
import time

import grpc
import numpy as np
import pytest
import torch
from svc_thread import ServerThread, free_port, report_some_load

import eplb
from eplb_engine import wire
from eplb_engine.client import ServiceClient
from eplb_engine.reporter import LoadReporter
from eplb_engine.watcher import PlacementWatcher
from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb

TOPO = eplb.Topology(num_layers=4, num_experts=16, num_slots=24, num_gpus=8, num_nodes=2, num_groups=4)


@pytest.fixture
def server():
    s = ServerThread().start()
    yield s
    s.stop()


def window_tokens(client: ServiceClient, name: str = "d1") -> tuple[float, int]:
    dry = client.rebalance(name, dry_run=True)
    return dry.window_tokens, dry.window_reports


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.float32, np.float64])
def test_arrays_round_trip_with_shape_and_dtype(dtype):
    arr = (np.arange(24).reshape(2, 3, 4) * 3).astype(dtype)
    out = wire.decode_array(wire.encode_array(arr))
    assert out.dtype == np.dtype(dtype) and out.shape == (2, 3, 4)
    np.testing.assert_array_equal(out, arr)


def test_other_integer_dtypes_travel_as_int64():
    out = wire.decode_array(wire.encode_array(np.array([[1, 2], [3, 250]], dtype=np.uint8)))
    assert out.dtype == np.int64 and out.tolist() == [[1, 2], [3, 250]]


def test_decode_names_the_field_when_bytes_do_not_fill_the_shape():
    msg = pb.Array(dtype=pb.DTYPE_INT32, shape=[2, 3], data=b"\0" * 20)
    with pytest.raises(ValueError, match=r"placement.phy2log.data: holds 20 bytes; shape \[2, 3\] of int32 needs 24"):
        wire.decode_array(msg, "placement.phy2log")
    with pytest.raises(ValueError, match="dtype 9 is not one of DTYPE_INT32"):
        wire.decode_array(pb.Array(dtype=9, shape=[1], data=b"\0" * 4))


def test_placement_decodes_to_an_eplb_placement_and_checks_the_topology():
    contiguous = eplb.Placement.contiguous(TOPO)
    msg = pb.Placement(deployment="d1", version=3, phy2log=wire.encode_array(contiguous.phy2log))
    got = wire.placement_from_pb(msg, TOPO)
    assert got.version == 3 and got.deployment == "d1" and got.placement == contiguous
    with pytest.raises(ValueError, match=r"does not fit the topology's \[layers, slots\] = \[4, 20\]"):
        wire.placement_from_pb(msg, eplb.Topology(4, 16, 20, 4))


def test_create_deployment_from_a_topology_and_read_it_back(server):
    with ServiceClient(server.address) as client:
        created = client.create_deployment("d1", TOPO, window_s=30, interval_s=0, switch_margin_steps=4)
        assert wire.topology_from_pb(created.topology) == TOPO
        assert created.window.sliding.duration.seconds == 30
        # exist_ok returns the stored deployment; a different topology is an error.
        assert client.create_deployment("d1", TOPO, exist_ok=True).name == "d1"
        with pytest.raises(ValueError, match="exists with"):
            client.create_deployment("d1", TOPO.with_layers(2), exist_ok=True)
        with pytest.raises(grpc.RpcError) as info:
            client.create_deployment("d1", TOPO)
        assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
        current = client.get_placement("d1")
        assert current.version == 1 and current.placement == eplb.Placement.contiguous(TOPO)
        assert client.healthy()
    with ServiceClient(f"127.0.0.1:{free_port()}", timeout_s=0.5) as dead:
        assert not dead.healthy(timeout_s=0.3)


def test_reporter_streams_logical_and_physical_counts(server):
    rng = np.random.default_rng(0)
    with ServiceClient(server.address) as client:
        client.create_deployment("d1", TOPO)
        total = 0.0
        with LoadReporter(server.address, "d1", rank=0, topology=TOPO, interval_s=0.05) as reporter:
            for _ in range(20):
                logical = rng.integers(0, 100, (4, 16))
                physical = torch.from_numpy(rng.integers(0, 100, (4, 24)))
                assert reporter.add(logical) and reporter.add(physical, version=1)
                total += logical.sum() + float(physical.sum())
            assert reporter.flush(10)
            stats = reporter.stats()
        assert stats.added == 40 and stats.pending == 0 and stats.dropped_reports == 0
        assert stats.accepted == stats.sent >= 2 and stats.duplicates == 0
        tokens, _ = window_tokens(client)
        assert tokens == pytest.approx(total)


def test_reporter_refuses_wrong_shapes_on_the_callers_thread(server):
    reporter = LoadReporter(server.address, "d1", rank=0, topology=TOPO, start=False)
    with pytest.raises(ValueError, match=r"logical counts must be \[L, E\] = \[4, 16\], got \[4, 24\]"):
        reporter.add(np.zeros((4, 24)))
    with pytest.raises(ValueError, match=r"physical counts \(version=2\) must be \[L, P\] = \[4, 24\]"):
        reporter.add(np.zeros((4, 16)), version=2)
    with pytest.raises(ValueError, match="version must be the placement version"):
        reporter.add(np.zeros((4, 24)), version=0)


@pytest.mark.parametrize(
    "bad",
    [
        -np.ones((4, 16)),
        np.full((4, 16), np.nan),
        np.full((4, 16), np.inf),
        np.full((4, 16), 2e12),  # above the service's limit on one count
        torch.full((4, 16), -1, dtype=torch.int32),
    ],
)
def test_reporter_refuses_bad_counts_and_keeps_the_intervals_good_ones(server, bad):
    with ServiceClient(server.address) as client:
        client.create_deployment("d1", TOPO)
        with LoadReporter(server.address, "d1", rank=0, topology=TOPO, interval_s=10) as reporter:
            assert reporter.add(np.full((4, 16), 2.0))
            with pytest.raises(ValueError, match=r"every count must be finite and in \[0, 1e\+12\] tokens; got "):
                reporter.add(bad)
            physical = np.ones((4, 24))
            physical[1, 3] = -5
            with pytest.raises(ValueError, match=r"counts \(version=1\): .* got values from -5 to 1"):
                reporter.add(physical, version=1)
            assert reporter.add(np.ones((4, 24)), version=1)
            assert reporter.stats().pending_tokens == 0  # nothing summed yet; the bad arrays never queued
            assert reporter.flush(10)
            stats = reporter.stats()
        assert stats.invalid_adds == 2 and stats.added == 2 and stats.rejected == 0 and stats.accepted == 2
        assert stats.pending_tokens == 0 and stats.last_error == ""
        assert window_tokens(client)[0] == 2.0 * 64 + 96


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA tensor's values are checked on the reporter's thread")
def test_reporter_drops_a_bad_cuda_tensor_on_its_thread_and_sends_the_rest(server):
    with ServiceClient(server.address) as client:
        client.create_deployment("d1", TOPO)
        with LoadReporter(server.address, "d1", rank=0, topology=TOPO, interval_s=10) as reporter:
            assert reporter.add(torch.full((4, 16), float("nan"), device="cuda"))
            assert reporter.add(torch.full((4, 16), 3.0, device="cuda"))
            assert reporter.flush(10)
            stats = reporter.stats()
        assert stats.invalid_adds == 1 and stats.accepted == 1 and stats.rejected == 0 and "NaN" in stats.last_error
        assert window_tokens(client)[0] == 3.0 * 64


def test_reporter_drops_a_report_the_service_refuses_and_keeps_the_rest(server):
    with ServiceClient(server.address) as client:
        client.create_deployment("d1", TOPO)
        with LoadReporter(server.address, "d1", rank=0, topology=TOPO, interval_s=10) as reporter:
            reporter.add(np.ones((4, 24)), version=7)  # a version the service never published
            reporter.add(np.full((4, 16), 2.0))
            assert reporter.flush(10)
            stats = reporter.stats()
        assert stats.rejected == 1 and stats.accepted == 1 and "FAILED_PRECONDITION" in stats.last_error
        assert window_tokens(client)[0] == 2.0 * 64


def test_reporter_never_blocks_and_counts_what_it_drops_while_the_service_is_away():
    addr = f"127.0.0.1:{free_port()}"
    with LoadReporter(addr, "d1", rank=0, topology=TOPO, interval_s=0.01, max_pending=3, max_queued=50) as reporter:
        start = time.perf_counter()
        for _ in range(200):
            reporter.add(np.ones((4, 16)))
            time.sleep(0.001)
        took = time.perf_counter() - start
        time.sleep(0.2)
        stats = reporter.stats()
        assert not reporter.close(timeout_s=0.2)
    assert took < 2.0  # 200 adds around 1 ms sleeps: nothing waited on the network
    assert stats.sent == 0 and stats.pending <= 4
    assert stats.added + stats.dropped_adds == 200
    # Every token added is either still held for sending or counted as dropped.
    assert stats.dropped_reports >= 1 and stats.dropped_tokens > 0
    assert stats.dropped_tokens + stats.pending_tokens == 64.0 * stats.added


def test_watcher_delivers_each_version_once_and_acks_after_the_callback(server):
    seen: list[int] = []
    with ServiceClient(server.address) as client:
        client.create_deployment("d1", TOPO)
        with PlacementWatcher(server.address, "d1", lambda p: seen.append(p.version), rank=3) as watcher:
            assert watcher.wait_for(1)
            report_some_load(server.address)
            client.rebalance("d1", force=True)
            assert watcher.wait_for(2)
        acks = client.call("GetDeployment", pb.GetDeploymentRequest(name="d1")).acks
    assert seen == [1, 2]
    assert [(a.rank, a.version) for a in acks] == [(3, 2)]


def test_watcher_reports_a_failed_callback_and_goes_on(server):
    def apply(p: wire.PublishedPlacement) -> None:
        if p.version == 2:
            raise RuntimeError("out of memory while staging")

    with ServiceClient(server.address) as client:
        client.create_deployment("d1", TOPO)
        with PlacementWatcher(server.address, "d1", apply, rank=0) as watcher:
            assert watcher.wait_for(1)
            report_some_load(server.address)
            client.rebalance("d1", force=True)
            assert watcher.wait_for(2)
            client.rebalance("d1", force=True)
            assert watcher.wait_for(3)
    assert watcher.failed == 1 and watcher.delivered == 3


def test_watcher_with_a_refused_token_gives_up_and_says_why():
    # It used to retry UNAUTHENTICATED forever, a warning every few hundred ms.
    s = ServerThread(token="right").start()
    try:
        with ServiceClient(s.address, token="right") as client:
            client.create_deployment("d1", TOPO)
        start = time.monotonic()
        with PlacementWatcher(s.address, "d1", lambda p: None, token="wrong", rank=0) as watcher:
            assert watcher.wait_for(1, timeout_s=10) is False
            assert time.monotonic() - start < 5
            assert watcher.gave_up and watcher.last_error.startswith("UNAUTHENTICATED")
            assert watcher.reconnects == 0 and not watcher._thread.is_alive()
    finally:
        s.stop()


def test_healthy_tries_every_address_and_keeps_the_one_that_answers(server):
    dead = f"127.0.0.1:{free_port()}"
    with ServiceClient(f"{dead},{server.address}") as client:
        assert client.endpoints.address == dead
        assert client.healthy(timeout_s=1.0)
        assert client.endpoints.address == server.address
    with ServiceClient(f"{dead},127.0.0.1:{free_port()}") as client:
        assert not client.healthy(timeout_s=0.5)


def test_a_sliding_and_a_decay_window_at_once_is_refused():
    with pytest.raises(ValueError, match="window_s .* or half_life_s .*, not both"):
        wire.deployment_pb("d1", TOPO, window_s=60, half_life_s=30)
    assert wire.deployment_pb("d1", TOPO, half_life_s=30).window.HasField("decay")
    assert not wire.deployment_pb("d1", TOPO).HasField("window")  # the service's default


def test_create_deployment_sets_planning_and_migration_and_the_plans_follow_them(server):
    # The client could not set Planning or Migration, and its max_moves went to the deprecated
    # Trigger.max_moves.
    options = dict(tolerance=0.0, layer_tolerance=0.0, max_moves=5, max_layer_moves=2)
    planning = dict(effort="high", work_budget=0, time_limit_s=30)
    loads = np.random.default_rng(3).lognormal(0, 2, (4, 16)).round() + 1
    with ServiceClient(server.address) as client:
        client.create_deployment("d1", TOPO, policy="global", **options, **planning)
        stored = client.get_deployment("d1")
        assert stored.migration == pb.Migration(**options)
        assert stored.trigger.max_moves == 0  # the deprecated field stays unset
        assert stored.planning.effort == "high" and stored.planning.work_budget == 0
        assert stored.planning.time_limit.ToNanoseconds() == 30 * 10**9
        client.ack("d1", 0, 1)  # the engines hold version 1: re-plans keep what they can of it
        with LoadReporter(server.address, "d1", rank=0, topology=TOPO, interval_s=0.05) as reporter:
            assert reporter.add(loads) and reporter.flush(10)
        plan = client.rebalance("d1", force=True)
    want = eplb.rebalance(
        loads,
        TOPO,
        "global",
        previous=eplb.Placement.contiguous(TOPO),
        effort="high",
        work_budget=0,
        time_limit=30,
        **options,
    )
    assert want.total_moves == 5 and want.moves.max() == 2 and want.replan.budget_limited
    got = wire.placement_from_pb(plan.placement, TOPO)
    assert plan.published and got.placement == want.placement
    assert plan.placement.stats.moves == 5 and plan.placement.stats.budget_limited


@pytest.mark.parametrize(
    "option, value, allowed",
    [
        ("tolerance", -0.01, "a finite number >= 0"),
        ("tolerance", float("nan"), "a finite number >= 0"),
        ("layer_tolerance", float("inf"), "a finite number >= 0"),
        ("max_moves", -1, "an integer >= 0"),
        ("max_moves", 2.5, "an integer >= 0"),
        ("max_layer_moves", True, "an integer >= 0"),
        ("effort", "max", "one of 'fast', 'default', 'high'"),
        ("work_budget", -5, "an integer >= 0"),
        ("time_limit_s", 0, "a finite number of seconds > 0"),
        ("time_limit_s", float("inf"), "a finite number of seconds > 0"),
    ],
)
def test_bad_planning_and_migration_options_are_refused_before_any_call(option, value, allowed):
    # A dead address: a ValueError at once, not an RPC retried until its deadline.
    with ServiceClient(f"127.0.0.1:{free_port()}", timeout_s=5) as client:
        start = time.monotonic()
        with pytest.raises(
            ValueError, match=rf"^{option} must be {re.escape(allowed)}.*, got {re.escape(repr(value))}$"
        ):
            client.create_deployment("d1", TOPO, **{option: value})
        assert time.monotonic() - start < 1


def test_watcher_of_a_service_that_is_down_says_why_and_logs_the_outage_and_recovery(caplog):
    # It used to wait 10 s in the client's retries of the topology: last_error '', reconnects 0
    # and nothing logged after 5 s.
    import logging

    port = free_port()  # closed: nothing listens on it yet
    s = ServerThread(port=port)
    with caplog.at_level(logging.WARNING, logger="eplb_engine.watcher"):
        with PlacementWatcher(f"127.0.0.1:{port}", "d1", lambda p: None, rank=0, ack=False) as watcher:
            assert watcher.wait_for(1, timeout_s=3) is False
            assert watcher.last_error.startswith("UNAVAILABLE"), watcher.last_error
            assert watcher.reconnects >= 1 and not watcher.connected and not watcher.gave_up
            down = [r for r in caplog.records if "retrying until it answers" in r.getMessage()]
            assert len(down) == 1 and "UNAVAILABLE" in down[0].getMessage()
            s.start()
            try:
                with ServiceClient(s.address) as client:
                    client.create_deployment("d1", TOPO)
                assert watcher.wait_for(1, timeout_s=10)
                assert watcher.connected and watcher.last_error == ""
                again = [r for r in caplog.records if "again after" in r.getMessage()]
                assert len(again) == 1 and again[0].levelno == logging.WARNING
                assert len([r for r in caplog.records if "retrying until it answers" in r.getMessage()]) == 1
            finally:
                watcher.close()
                s.stop()
