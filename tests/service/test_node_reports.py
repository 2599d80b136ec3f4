"""Node reports (ReportLoadRequest.covers): one report holds several ranks' reports, accepted all
together or not at all, on the embedded store and on Redis (one server and a 3-master cluster)."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from svc_helpers import status_details

from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb
from eplb_wire.arrays import encode

L, E = 4, 16


def node_report(covers: list[tuple[int, int]], tokens: int = 1, steps: int = 0) -> pb.ReportLoadRequest:
    return pb.ReportLoadRequest(
        deployment="d1",
        covers=[pb.ReportCover(rank=r, seq=s) for r, s in covers],
        logical=encode(np.full((L, E), tokens * len(covers), dtype=np.int32)),
        steps=steps,
    )


def own_report(rank: int, seq: int, tokens: int = 1) -> pb.ReportLoadRequest:
    return pb.ReportLoadRequest(
        deployment="d1", rank=rank, seq=seq, logical=encode(np.full((L, E), tokens, dtype=np.int32))
    )


@pytest.fixture
def client(d1_client):
    return d1_client


async def window(c) -> tuple[int, float]:
    dry = await c.stub.Rebalance(pb.RebalanceRequest(deployment="d1", dry_run=True))
    return dry.window_reports, dry.window_tokens


async def test_a_node_report_counts_each_rank_once_and_its_resend_is_a_duplicate(client):
    covers = [(r, 5) for r in range(8)]
    out = await client.stub.ReportLoad(iter([node_report(covers)]))
    assert (out.accepted, out.duplicates) == (1, 0)
    again = await client.stub.ReportLoad(iter([node_report(covers)]))
    assert (again.accepted, again.duplicates) == (0, 1)
    # A rank that re-sends its own report of the node report: a duplicate too.
    solo = await client.stub.ReportLoad(iter([own_report(3, 5)]))
    assert (solo.accepted, solo.duplicates) == (0, 1)
    assert await window(client) == (8, 8 * L * E)


async def test_a_node_report_partly_counted_before_is_refused_whole_and_nothing_is_lost(client):
    # Rank 2 sent its report (seq 7) on its own meanwhile (its agent looked dead to it).
    assert (await client.stub.ReportLoad(iter([own_report(2, 7)]))).accepted == 1
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await client.stub.ReportLoad(iter([node_report([(0, 7), (1, 7), (2, 7)])]))
    assert err.value.code() == grpc.StatusCode.ABORTED
    assert "each rank must send its report on its own" in err.value.details()
    assert await window(client) == (1, L * E)  # nothing of the node report
    # As told, ranks 0 and 1 send their own: each counted once, rank 2's a duplicate.
    for rank in (0, 1, 2):
        await client.stub.ReportLoad(iter([own_report(rank, 7)]))
    assert await window(client) == (3, 3 * L * E)


async def test_node_reports_and_own_reports_share_one_stream_and_one_batch(client):
    stream = [node_report([(0, 1), (1, 1)]), own_report(2, 1), node_report([(0, 2), (1, 2), (2, 2)])]
    out = await client.stub.ReportLoad(iter(stream))
    assert (out.accepted, out.duplicates) == (3, 0)
    assert await window(client) == (6, 6 * L * E)


@pytest.mark.parametrize(
    "request_, field, says",
    [
        (
            node_report([(0, 1)]).__class__(deployment="d1", rank=1, covers=[pb.ReportCover(rank=0, seq=1)]),
            "covers",
            "rank and seq 0",
        ),
        (node_report([(0, 1), (9, 1)]), "covers[1].rank", "rank"),
        (node_report([(0, 1), (1, 0)]), "covers[1].seq", "must be in [1, 2^53)"),
        (node_report([(0, s) for s in range(1, 4098)]), "covers", "at most 4096"),
    ],
    ids=["rank-and-covers", "unknown-rank", "zero-seq", "too-many"],
)
async def test_bad_node_reports_are_invalid_argument_and_count_nothing(client, request_, field, says):
    if not request_.HasField("logical"):
        request_.logical.CopyFrom(encode(np.ones((L, E), dtype=np.int32)))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await client.stub.ReportLoad(iter([request_]))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = dict(status_details(err.value))
    assert field in details and says in details[field], details
    with pytest.raises(grpc.aio.AioRpcError):  # the window is empty
        await window(client)
