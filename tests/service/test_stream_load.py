"""StreamLoad: ReportLoad on a long-lived stream that answers each report, in order, once it is
counted, on real servers (embedded store, one Redis, a 3-master cluster) through real channels."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest
from svc_helpers import REDIS_URL, small_deployment, status_details

from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb
from eplb_wire.arrays import encode

L, E = 4, 16


def own(rank: int, seq: int, tokens: int = 1, shape: tuple[int, int] = (L, E)) -> pb.ReportLoadRequest:
    return pb.ReportLoadRequest(
        deployment="d1", rank=rank, seq=seq, logical=encode(np.full(shape, tokens, dtype=np.int32))
    )


def node(covers: list[tuple[int, int]], tokens: int = 1) -> pb.ReportLoadRequest:
    return pb.ReportLoadRequest(
        deployment="d1",
        covers=[pb.ReportCover(rank=r, seq=s) for r, s in covers],
        logical=encode(np.full((L, E), tokens * len(covers), dtype=np.int32)),
    )


@pytest.fixture
def c(d1_client):
    return d1_client


async def window(c) -> tuple[int, float]:
    try:
        dry = await c.stub.Rebalance(pb.RebalanceRequest(deployment="d1", dry_run=True))
    except grpc.aio.AioRpcError as exc:
        assert exc.code() == grpc.StatusCode.FAILED_PRECONDITION and "is empty" in exc.details()
        return 0, 0
    return dry.window_reports, dry.window_tokens


async def test_each_report_is_answered_in_order_and_counted_once(c):
    call = c.stub.StreamLoad()
    acks = []
    # Written ahead of the answers (pipelined): the acks still come one a report, in order.
    sent = [own(0, 1), own(1, 1), own(0, 1), node([(2, 1), (3, 1)]), own(1, 2), node([(2, 1), (3, 1)])]
    for r in sent:
        await call.write(r)
    for _ in sent:
        acks.append((await asyncio.wait_for(call.read(), 10)).accepted)
    await call.done_writing()
    assert await call.read() == grpc.aio.EOF
    assert await call.code() == grpc.StatusCode.OK
    # The repeats (rank 0 seq 1, the same node report) are duplicates, the rest counted.
    assert acks == [True, True, False, True, True, False]
    assert await window(c) == (5, 5 * L * E)


async def test_the_stream_stays_open_between_reports(c):
    call = c.stub.StreamLoad()
    for seq in range(1, 4):
        await call.write(own(0, seq, tokens=seq))
        assert (await asyncio.wait_for(call.read(), 10)).accepted
        await asyncio.sleep(0.2)  # an engine between intervals: nothing ends the stream
    assert await window(c) == (3, 6 * L * E)
    await call.done_writing()
    assert await call.code() == grpc.StatusCode.OK


async def test_a_refused_report_ends_the_stream_saying_what_was_kept(c):
    call = c.stub.StreamLoad()
    await call.write(own(0, 1))
    await call.write(own(0, 2))
    await call.write(own(0, 3, shape=(L, E + 1)))  # the wrong shape
    await call.write(own(0, 4))
    assert [(await call.read()).accepted for _ in range(2)] == [True, True]
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await asyncio.wait_for(call.read(), 10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    fields = dict(status_details(err.value))
    assert "logical" in " ".join(fields) and "2 reports before it in this stream were kept" in fields["stream"]
    # The two acknowledged are counted; the refused one and the one after it are not.
    assert await window(c) == (2, 2 * L * E)


async def test_an_unknown_deployment_is_not_found_and_nothing_is_counted(c):
    call = c.stub.StreamLoad()
    await call.write(pb.ReportLoadRequest(deployment="nope", rank=0, seq=1, logical=encode(np.ones((L, E), np.int32))))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await asyncio.wait_for(call.read(), 10)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert await window(c) == (0, 0)


async def test_shutdown_ends_an_open_stream_between_reports_and_keeps_what_it_acknowledged(serve, connect, prefix):
    key_prefix = prefix()
    server = await serve(redis_url=REDIS_URL, key_prefix=key_prefix)
    c = connect(server)
    await c.stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=small_deployment()))
    call = c.stub.StreamLoad()
    for seq in range(1, 6):
        await call.write(own(0, seq))
        assert (await asyncio.wait_for(call.read(), 10)).accepted
    stopping = asyncio.create_task(server.stop(2.0))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await asyncio.wait_for(call.read(), 10)
    await stopping
    # UNAVAILABLE (another instance takes the stream), saying the five were processed.
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "processed the first 5 messages of this stream" in err.value.details()
    # What was acknowledged survives the instance: a new one reads it from the store.
    again = await serve(redis_url=REDIS_URL, key_prefix=key_prefix)
    assert await window(connect(again)) == (5, 5 * L * E)
