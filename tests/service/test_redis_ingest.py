"""What a report costs the store: write-ahead entries at the width the counts came in (EPW2, in
the ``wal2`` stream).

Before: each accepted report was a float64 EPW1 entry: 118,813 bytes for an int32 [58, 256]
report whose payload is 59,392."""

from __future__ import annotations

import asyncio
import struct
import time
import uuid
from dataclasses import replace

import grpc
import numpy as np
import pytest
import redis
from svc_helpers import FAST, REDIS_URL

from eplb_bench.harness.service import reports
from eplb_engine.aio import AsyncServiceClient
from eplb_service.windows import WindowSpec, encode_sums, sum_blobs
from eplb_wire import arrays
from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb

SHAPE = (58, 256)
# A deployment whose reports are not folded during the test (flush every minute).
SLOW_FLUSH = replace(FAST, flush_s=60.0)


def deployment(name: str) -> pb.Deployment:
    return pb.Deployment(
        name=name,
        topology=pb.Topology(num_layers=58, num_experts=256, num_slots=288, num_gpus=32, num_nodes=4, num_groups=8),
        policy="auto",
    )


def wal_entries(prefix: str, name: str, stream: str) -> list[bytes]:
    with redis.Redis.from_url(REDIS_URL) as r:
        return [f[b"b"] for _, f in r.xrange(f"{prefix}:{{{name}}}:{stream}")]


@pytest.fixture
async def replica(serve, connect, prefix):
    p = prefix()
    server = await serve(
        redis_url=REDIS_URL, key_prefix=p, balancer=replace(SLOW_FLUSH, replica_id=uuid.uuid4().hex[:8])
    )
    c = connect(server)
    await c.stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=deployment("big")))
    return p, c


async def lingering_replica(serve, connect, prefix, linger: float, calls: list | None = None):
    """An instance (and a client of it) whose report batches go to Redis ``linger`` apart;
    ``calls`` gets the deployments of each of its ``accept_many`` calls."""
    p = prefix()
    server = await serve(
        redis_url=REDIS_URL,
        key_prefix=p,
        balancer=replace(SLOW_FLUSH, replica_id=uuid.uuid4().hex[:8], report_linger_s=linger),
    )
    if calls is not None:
        store = server.balancer.ingest.store
        accept_many = store.accept_many

        async def spy(batch):
            calls.append([c.name for c in batch])
            return await accept_many(batch)

        store.accept_many = spy
    return p, connect(server)


async def test_an_int32_report_is_written_at_int32_width(replica):
    p, c = replica
    counts = np.random.default_rng(0).integers(0, 1 << 20, SHAPE, dtype=np.int32)
    assert (await AsyncServiceClient.over(c.channel).report(reports("big", 0, [counts]))).accepted == 1
    (entry,) = wal_entries(p, "big", "wal2")
    assert len(entry) <= 1.3 * counts.nbytes, f"{len(entry)} bytes for a {counts.nbytes}-byte report"
    sums, n, stale = sum_blobs({"wal2:1": entry}, SHAPE, time.time(), 60)
    assert n == 1 and stale == [] and np.array_equal(sums, counts)


async def test_physical_counts_folded_into_experts_stay_int32(replica):
    p, c = replica
    placement = (await c.stub.GetPlacement(pb.GetPlacementRequest(deployment="big"))).placement
    counts = np.ones((58, 288), dtype=np.int32)
    out = await AsyncServiceClient.over(c.channel).report(
        reports("big", 1, [counts], placement_version=placement.version)
    )
    assert out.accepted == 1
    (entry,) = wal_entries(p, "big", "wal2")
    assert len(entry) <= 1.3 * 58 * 256 * 4
    sums, _, _ = sum_blobs({"wal2:1": entry}, SHAPE, time.time(), 60)
    assert sums.sum() == counts.sum()


def test_sums_that_overflow_int32_widen_that_entry_only():
    spec = WindowSpec()
    big = np.full(SHAPE, 2**31 - 1, dtype=np.float64) * 2  # two int32-max reports in one batch
    wide = encode_sums(big, 2, time.time(), spec)
    narrow = encode_sums(np.ones(SHAPE), 1, time.time(), spec)
    assert len(wide) > 58 * 256 * 8 and len(narrow) < 58 * 256 * 4 + 64
    sums, n, stale = sum_blobs({"a": wide, "b": narrow}, SHAPE, time.time(), 60)
    assert n == 3 and stale == [] and np.array_equal(sums, big + 1)
    fractional = encode_sums(np.full(SHAPE, 0.1), 1, time.time(), spec)
    assert np.array_equal(sum_blobs({"f": fractional}, SHAPE, time.time(), 60)[0], np.full(SHAPE, 0.1))


def test_an_int32_report_as_decoded_is_its_own_entry_and_int_sums_widen_exactly():
    # Reports stay in their own dtype from the wire to the entry: a lone int32 report's entry
    # is its bytes after the header, no float pass; integer batch sums are int64, exact.
    spec = WindowSpec()
    counts = np.random.default_rng(2).integers(0, 1 << 30, SHAPE, dtype=np.int32)
    as_decoded = arrays.decode_counts(arrays.encode(counts), "logical", SHAPE, cap=2**31, native=True)
    assert as_decoded.dtype == np.int32 and not as_decoded.flags.writeable
    entry = encode_sums(as_decoded, 1, time.time(), spec)
    assert entry.endswith(counts.tobytes()) and len(entry) == struct.calcsize("<4sBdQd") + 1 + counts.nbytes
    wide = encode_sums(as_decoded.astype(np.int64) * 4, 4, time.time(), spec)  # over int32
    assert len(wide) == struct.calcsize("<4sBdQd") + 1 + counts.size * 8
    sums, n, _ = sum_blobs({"a": entry, "b": wide}, SHAPE, time.time(), 60)
    assert n == 5 and np.array_equal(sums, counts.astype(np.float64) * 5)


async def test_concurrent_reports_of_mixed_dtypes_are_summed_exactly(replica):
    # Reports that arrive together share one entry: int32 ones summed in int64, a batch with a
    # float report in float64; whichever way they batch, the entries hold exactly their sum.
    p, c = replica
    rng = np.random.default_rng(1)
    batches = []
    for rank in range(8):
        b = [rng.integers(0, 1 << 20, SHAPE, dtype=np.int32) for _ in range(6)]
        if rank % 2:
            b[2] = b[2].astype(np.float32) + np.float32(0.5)
        batches.append(b)
    client = AsyncServiceClient.over(c.channel)
    outs = await asyncio.gather(*(client.report(reports("big", rank, b)) for rank, b in enumerate(batches)))
    assert sum(o.accepted for o in outs) == 48
    want = sum(x.astype(np.float64) for b in batches for x in b)
    entries = wal_entries(p, "big", "wal2")
    sums, n, stale = sum_blobs({f"e{i}": e for i, e in enumerate(entries)}, SHAPE, time.time(), 60)
    assert n == 48 and stale == [] and np.array_equal(sums, want)
    got = await c.stub.GetPlacement(pb.GetPlacementRequest(deployment="big", include_window_loads=True))
    assert got.window_reports == 48
    assert np.array_equal(arrays.decode(got.window_loads, "window_loads", SHAPE), want)


async def test_group_commit_spaces_a_deployments_store_calls_and_keeps_every_report(serve, connect, prefix):
    # --report-linger-seconds: while reports keep coming, a deployment's batches go to Redis at
    # least a linger apart (one write-ahead entry each, its stream id the time it was added);
    # a report after a quiet spell is answered at once.
    linger = 0.2
    p, c = await lingering_replica(serve, connect, prefix, linger)
    await c.stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=deployment("big")))
    client = AsyncServiceClient.over(c.channel)
    t = time.monotonic()
    assert (await client.report(reports("big", 0, [np.ones(SHAPE, dtype=np.int32)]))).accepted == 1
    assert time.monotonic() - t < linger / 2  # after a quiet spell: not held for the linger
    rng = np.random.default_rng(3)
    batches = [[rng.integers(0, 1000, SHAPE, dtype=np.int32) for _ in range(6)] for _ in range(4)]
    # Four streams, each waiting for its answer before its next report: 24 reports.
    outs = await asyncio.gather(*(client.report(reports("big", 1 + r, b)) for r, b in enumerate(batches)))
    assert sum(o.accepted for o in outs) == 24
    with redis.Redis.from_url(REDIS_URL) as r:
        ids = [int(i.split(b"-")[0]) for i, _ in r.xrange(f"{p}:{{big}}:wal2")]
    gaps = [b - a for a, b in zip(ids[1:], ids[2:])]  # between the calls after the first report
    assert gaps and min(gaps) >= linger * 1000 * 0.9, gaps
    assert len(ids) <= 1 + 24 / 4 + 2  # about one call a linger, each with a report of every stream
    entries = wal_entries(p, "big", "wal2")
    sums, n, _ = sum_blobs({f"e{i}": e for i, e in enumerate(entries)}, SHAPE, time.time(), 60)
    want = 1 + sum(x.astype(np.float64) for b in batches for x in b)
    assert n == 25 and np.array_equal(sums, want)


async def test_group_commit_spans_deployments_one_round_trip_for_many(serve, connect, prefix):
    # The batches of every deployment of one shard (here one Redis) share the group commit: after
    # a first report, one report to each of 6 deployments goes in one pipeline a linger later
    # (each deployment's own entry; fewer than the 8 waiting reports that go at once). Before,
    # each deployment had its own batcher, so a first report of a quiet deployment went at once,
    # one round trip each.
    linger = 0.2
    p, c = await lingering_replica(serve, connect, prefix, linger)
    names = [f"d{i}" for i in range(6)]
    for name in names:
        await c.stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=deployment(name)))
    client = AsyncServiceClient.over(c.channel)
    assert (await client.report(reports("d0", 0, [np.ones(SHAPE, dtype=np.int32)]))).accepted == 1
    rng = np.random.default_rng(5)
    counts = {name: rng.integers(0, 1000, SHAPE, dtype=np.int32) for name in names}
    outs = await asyncio.gather(*(client.report(reports(name, 1, [counts[name]])) for name in names))
    assert [o.accepted for o in outs] == [1] * 6
    with redis.Redis.from_url(REDIS_URL) as r:
        ids = {name: [int(i.split(b"-")[0]) for i, _ in r.xrange(f"{p}:{{{name}}}:wal2")] for name in names}
    first = ids["d0"][0]
    later = [ids["d0"][1]] + [ids[name][0] for name in names[1:]]
    # Held for the linger (the gap is measured between Redis's times of the two calls, so
    # allow for the first call's own latency), and sent together.
    assert min(later) - first >= linger * 1000 * 0.5, (first, later)
    assert max(later) - min(later) < linger * 1000 / 2, later
    for name in names:  # every deployment's entry holds its own report
        sums, n, _ = sum_blobs({f"e{i}": e for i, e in enumerate(wal_entries(p, name, "wal2"))}, SHAPE, time.time(), 60)
        want = counts[name].astype(np.float64) + (1 if name == "d0" else 0)
        assert n == (2 if name == "d0" else 1) and np.array_equal(sums, want), name


async def test_a_deployment_gone_from_a_shared_batch_fails_alone(serve, connect, prefix):
    # Two deployments' reports in one pipeline; one deployment's keys were removed behind the
    # instance's back (another instance deleted it): its report gets NOT_FOUND, the other's is
    # accepted and stored.
    calls: list[list[str]] = []
    p, c = await lingering_replica(serve, connect, prefix, 0.2, calls)
    for name in ("alive", "gone"):
        await c.stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=deployment(name)))
    client = AsyncServiceClient.over(c.channel)
    # The feed's reader has made its first full check: the keys removed below (with no feed
    # entry) go unnoticed by the follower, so the report reaches the store call.
    await asyncio.sleep(0.5)
    assert (await client.report(reports("alive", 0, [np.ones(SHAPE, dtype=np.int32)]))).accepted == 1
    with redis.Redis.from_url(REDIS_URL) as r:
        r.delete(*r.keys(f"{p}:{{gone}}:*"))
        r.srem(f"{p}:deployments", "gone")
    alive, gone = await asyncio.gather(
        client.report(reports("alive", 1, [np.full(SHAPE, 2, dtype=np.int32)])),
        client.report(reports("gone", 1, [np.ones(SHAPE, dtype=np.int32)])),
        return_exceptions=True,
    )
    assert isinstance(gone, grpc.aio.AioRpcError) and gone.code() == grpc.StatusCode.NOT_FOUND, gone
    assert "gone" in gone.details()
    assert alive.accepted == 1
    assert sorted(calls[-1]) == ["alive", "gone"], calls  # one call carried both
    entries = wal_entries(p, "alive", "wal2")
    sums, n, _ = sum_blobs({f"e{i}": e for i, e in enumerate(entries)}, SHAPE, time.time(), 60)
    assert n == 2 and np.array_equal(sums, np.full(SHAPE, 3.0))
