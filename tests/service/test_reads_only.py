"""Reads-only instances (``eplb serve --reads-only``): they serve placements and watches from the
store the other instances write, refuse reports so that clients report elsewhere, and engines'
clients send their reads there first (``reads=``), falling back to the client's addresses."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import replace

import grpc
import numpy as np
import pytest
from svc_helpers import FAST, REDIS_URL, report_some_load, small_deployment

import eplb
from eplb_engine import LoadReporter
from eplb_engine.aio import AsyncServiceClient
from eplb_engine.client import ServiceClient
from eplb_engine.watcher import PlacementWatcher
from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb
from eplb_wire.errors import READS_ONLY, reason

TOPO = eplb.Topology(num_layers=4, num_experts=16, num_slots=24, num_gpus=8, num_nodes=2, num_groups=4)


async def _pair(serve, prefix):
    """A writer (takes reports, plans) and a reads-only instance on one Redis prefix."""
    p = prefix()
    writer = await serve(redis_url=REDIS_URL, key_prefix=p)
    reader = await serve(
        redis_url=REDIS_URL,
        key_prefix=p,
        balancer=replace(FAST, replica_id=uuid.uuid4().hex[:8], reads_only=True),
    )
    return writer, reader


async def test_a_reads_only_instance_serves_placements_and_refuses_reports(serve, connect, prefix):
    writer, reader = await _pair(serve, prefix)
    w, r = connect(writer), connect(reader)
    await w.stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=small_deployment()))
    got = (await r.stub.GetPlacement(pb.GetPlacementRequest(deployment="d1"))).placement
    assert got.version == 1
    assert got == (await w.stub.GetPlacement(pb.GetPlacementRequest(deployment="d1"))).placement
    watch = r.stub.WatchPlacements(pb.WatchPlacementsRequest(deployment="d1"))
    assert (await watch.read()).placement.version == 1

    # Reports: UNAVAILABLE (clients move to their next address), saying why; nothing counted.
    for call in (r.stub.StreamLoad, r.stub.ReportLoad):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await report_some_load_on(call)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "reads only" in err.value.details()
        # The reason for clients to act on, in the trailing metadata (the text is for people).
        assert reason(err.value) == READS_ONLY
    # Other refusals name no reason; nor does what is not a call's error.
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await w.stub.GetPlacement(pb.GetPlacementRequest(deployment="no-such"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and reason(err.value) == ""
    assert reason(ValueError("x")) == ""
    # The reader runs no trigger loop and no window flushes; the writer does.
    names = lambda s: {t.get_name() for t in s.balancer._tasks}  # noqa: E731
    assert {"trigger", "flush"} <= names(writer) and not {"trigger", "flush"} & names(reader)

    # A version the writer publishes reaches the reader's watchers and GetPlacement.
    await report_some_load(w.stub)
    out = await w.stub.Rebalance(pb.RebalanceRequest(deployment="d1", force=True))
    assert out.published and out.placement.version == 2
    assert (await asyncio.wait_for(watch.read(), 10)).placement.version == 2
    got = (await r.stub.GetPlacement(pb.GetPlacementRequest(deployment="d1"))).placement
    assert got == out.placement
    window = await w.stub.GetPlacement(pb.GetPlacementRequest(deployment="d1", include_window_loads=True))
    assert window.window_reports > 0  # the writer's reports, none of the reader's
    watch.cancel()


async def report_some_load_on(call) -> None:
    """One report on ``call`` (StreamLoad or ReportLoad), read to its end."""
    request = _request(1, np.ones((4, 16), dtype=np.int32))
    stream = call(iter([request]))
    if hasattr(stream, "read"):
        while (await stream.read()) is not grpc.aio.EOF:
            pass
    else:
        await stream


async def test_clients_read_from_the_reader_and_report_to_the_others(serve, prefix):
    writer, reader = await _pair(serve, prefix)
    client = AsyncServiceClient(writer.target, reads=reader.target, timeout_s=5)
    try:
        await client.create_deployment("d1", TOPO)
        loads = np.ones((4, 16), dtype=np.int32)
        assert (await client.report([_request(1, loads)])).accepted == 1
        assert (await client.get_placement("d1")).version == 1
        assert client.reads.address == reader.target
        # The writer gone, placements still come from the reader; reports have nowhere to go.
        await writer.stop(0)
        assert (await client.get_placement("d1")).version == 1
        async for published in client.watch("d1"):
            assert published.version == 1
            break
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await client.report([_request(2, loads)], timeout_s=1)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await client.close()


async def test_reads_fall_back_to_the_client_addresses(serve, prefix):
    writer, reader = await _pair(serve, prefix)
    with ServiceClient(writer.target, reads=[reader.target], timeout_s=5) as client:
        await asyncio.to_thread(client.create_deployment, "d1", TOPO)
        assert client.reads.addresses == (reader.target, writer.target)
        await reader.stop(0)
        # The reader down: GetPlacement fails over to the writer within the call's retries.
        assert (await asyncio.to_thread(client.get_placement, "d1")).version == 1
        assert client.reads.address == writer.target and client.endpoints.address == writer.target


async def test_a_reporter_given_the_reader_first_reports_to_the_next_address(serve, connect, prefix, caplog):
    writer, reader = await _pair(serve, prefix)
    w = connect(writer)
    await w.stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=small_deployment()))

    def run() -> None:
        with LoadReporter([reader.target, writer.target], "d1", 0, TOPO, interval_s=0.05) as reporter:
            for _ in range(3):
                reporter.add(np.full((4, 16), 2, dtype=np.int32))
                time.sleep(0.1)
            assert reporter.flush(10)
            assert reporter.endpoints.address == writer.target

    caplog.set_level("WARNING", logger="eplb_engine.reporter")
    await asyncio.to_thread(run)
    window = await w.stub.GetPlacement(pb.GetPlacementRequest(deployment="d1", include_window_loads=True))
    assert window.window_reports >= 1
    # The misconfiguration said once, naming the reader.
    told = [r.getMessage() for r in caplog.records if "reads-only instance" in r.getMessage()]
    assert len(told) == 1 and reader.target in told[0]


async def test_a_watcher_given_reads_watches_the_reader_and_acks_to_the_writer(serve, connect, prefix):
    writer, reader = await _pair(serve, prefix)
    w = connect(writer)
    await w.stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=small_deployment()))
    seen: list[int] = []

    def run() -> None:
        watcher = PlacementWatcher(writer.target, "d1", lambda p: seen.append(p.version), rank=0, reads=reader.target)
        try:
            deadline = time.monotonic() + 10
            while not seen and time.monotonic() < deadline:
                time.sleep(0.02)
            assert watcher.watching.address == reader.target
            assert watcher.client.endpoints.address == writer.target
        finally:
            watcher.close()

    await asyncio.to_thread(run)
    assert seen == [1]
    status = (await w.stub.GetDeployment(pb.GetDeploymentRequest(name="d1"))).status
    assert status.ranks_acked == 1  # the ack went to the writer (any instance may take it)


def _request(seq: int, loads: np.ndarray) -> pb.ReportLoadRequest:
    from eplb_engine.client import report_request

    return report_request("d1", 0, seq, loads)


def test_reads_only_needs_a_redis_url(monkeypatch):
    from eplb_service.cli import parse_args

    monkeypatch.delenv("EPLB_REDIS_URL", raising=False)
    with pytest.raises(SystemExit):
        parse_args(["--reads-only"])
    assert parse_args(["--reads-only", "--redis-url", REDIS_URL])[0].balancer.reads_only
    monkeypatch.setenv("EPLB_READS_ONLY", "yes")
    assert parse_args(["--redis-url", REDIS_URL])[0].balancer.reads_only
    monkeypatch.setenv("EPLB_READS_ONLY", "maybe")
    with pytest.raises(SystemExit):
        parse_args(["--redis-url", REDIS_URL])
    monkeypatch.setenv("EPLB_READS_ONLY", "")
    assert not parse_args([])[0].balancer.reads_only


def test_read_endpoints_are_checked():
    from eplb_engine.client import Endpoints, read_endpoints

    sync = Endpoints("a:1,b:2", token="t")
    assert read_endpoints(None, sync) is sync
    reads = read_endpoints("r:3,b:2", sync)
    # The reads' addresses first, then the client's own (each once), with the client's token.
    assert reads.addresses == ("r:3", "b:2", "a:1") and reads.metadata == sync.metadata
    assert read_endpoints(reads, sync) is reads
    with pytest.raises(ValueError, match="same face"):
        read_endpoints(Endpoints("r:3", aio=True), sync)
    import grpc as _grpc

    with _grpc.insecure_channel("a:1") as ch, pytest.raises(ValueError, match="owns its channels"):
        read_endpoints("r:3", Endpoints.over(ch))


def test_a_homing_endpoints_spreads_its_fallback_by_the_deployment():
    from eplb_engine.client import Endpoints, read_endpoints

    names = [f"d{i}" for i in range(200)]
    firsts = set()
    for name in names:
        reads = read_endpoints(["r1:1", "r2:2"], Endpoints("w1:1,w2:2,w3:3"))
        reads.prefer(name)
        # A reader first (the name's), the other reader, then every writer in a name's order.
        assert set(reads.addresses[:2]) == {"r1:1", "r2:2"} and reads.address in ("r1:1", "r2:2")
        assert sorted(reads.addresses[2:]) == ["w1:1", "w2:2", "w3:3"]
        firsts.add(reads.addresses[2])
    assert firsts == {"w1:1", "w2:2", "w3:3"}


async def test_reads_and_watches_go_back_to_the_reader_once_it_answers_again(serve, connect, prefix):
    from eplb_engine.client import Endpoints, read_endpoints

    p = prefix()
    writer = await serve(redis_url=REDIS_URL, key_prefix=p)
    ro = replace(FAST, replica_id=uuid.uuid4().hex[:8], reads_only=True)
    reader = await serve(redis_url=REDIS_URL, key_prefix=p, balancer=ro)
    port = reader.port
    w = connect(writer)
    await w.stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=small_deployment()))
    main = Endpoints(writer.target)
    reads = read_endpoints(reader.target, main, home_after_s=0.5)
    client = ServiceClient(main, reads=reads, timeout_s=5)
    seen: list[int] = []
    watcher = PlacementWatcher(main, "d1", lambda pl: seen.append(pl.version), reads=reads)

    async def until(check, what: str, within_s: float = 10.0) -> None:
        deadline = time.monotonic() + within_s
        while not check():
            assert time.monotonic() < deadline, what
            await asyncio.sleep(0.05)

    try:
        await until(lambda: seen == [1], "the first version")
        assert watcher.watching.address == reader.target
        await reader.stop(0)
        assert (await asyncio.to_thread(client.get_placement, "d1")).version == 1
        assert reads.address == writer.target  # fell back
        await until(lambda: watcher.connected and reads.address == writer.target, "the watch on the writer")
        reader = await serve(redis_url=REDIS_URL, key_prefix=p, balancer=ro, port=port)
        await asyncio.sleep(0.6)
        assert (await asyncio.to_thread(client.get_placement, "d1")).version == 1
        assert reads.address == reader.target  # back at the reader
        # The watch too: it was ended and resumed there, and a new version reaches it.
        await until(lambda: watcher.connected, "the watch back")
        await report_some_load(w.stub)
        out = await w.stub.Rebalance(pb.RebalanceRequest(deployment="d1", force=True))
        await until(lambda: seen[-1] == out.placement.version, "the new version")
        assert reads.address == reader.target and seen == [1, out.placement.version]
    finally:
        await asyncio.to_thread(watcher.close)
        client.close()
        reads.close()
        main.close()
