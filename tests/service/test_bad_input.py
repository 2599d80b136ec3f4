"""Bad input → the right status with field violations; the server stays up, stored state unchanged."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest
from google.protobuf.duration_pb2 import Duration
from svc_helpers import REDIS_URL, small_deployment, status_details

from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb

L, E, P = 4, 16, 24
INVALID = grpc.StatusCode.INVALID_ARGUMENT


def arr(values: np.ndarray, dtype: int | None = None) -> pb.Array:
    values = np.asarray(values)
    code = {np.dtype("int32"): pb.DTYPE_INT32, np.dtype("float64"): pb.DTYPE_FLOAT64}[values.dtype]
    return pb.Array(dtype=dtype if dtype is not None else code, shape=list(values.shape), data=values.tobytes())


def logical(values: np.ndarray, seq: int = 10, rank: int = 0, name: str = "d1", **kw) -> pb.ReportLoadRequest:
    return pb.ReportLoadRequest(deployment=name, rank=rank, seq=seq, logical=arr(values, **kw))


GOOD = np.full((L, E), 5, dtype=np.int32)
NAN = np.ones((L, E))
NAN[1, 2] = np.nan
NEG = GOOD.copy()
NEG[0, 0] = -1
SHORT = pb.ReportLoadRequest(
    deployment="d1", rank=0, seq=10, logical=pb.Array(dtype=pb.DTYPE_INT32, shape=[L, E], data=b"\0" * 8)
)

# (case, report request, code, violated field or None)
REPORT_CASES = [
    ("wrong shape", logical(np.zeros((L, E - 1), np.int32)), INVALID, "logical.shape"),
    ("short data", SHORT, INVALID, "logical.data"),
    ("NaN counts", logical(NAN), INVALID, "logical.data"),
    ("negative counts", logical(NEG), INVALID, "logical.data"),
    ("unknown dtype enum", logical(GOOD, dtype=99), INVALID, "logical.dtype"),
    ("no counts", pb.ReportLoadRequest(deployment="d1", rank=0, seq=10), INVALID, "counts"),
    ("seq too large", logical(GOOD, seq=2**60), INVALID, "seq"),
    ("bad deployment name", logical(GOOD, name="no/slash"), INVALID, "deployment"),
    ("unknown deployment", logical(GOOD, name="nope"), grpc.StatusCode.NOT_FOUND, None),
    (
        "physical without version",
        pb.ReportLoadRequest(
            deployment="d1", rank=0, seq=10, physical=pb.PhysicalCounts(counts=arr(np.zeros((L, P), np.int32)))
        ),
        INVALID,
        "physical.placement_version",
    ),
    (
        "physical under unknown version",
        pb.ReportLoadRequest(
            deployment="d1",
            rank=0,
            seq=10,
            physical=pb.PhysicalCounts(counts=arr(np.zeros((L, P), np.int32)), placement_version=99),
        ),
        grpc.StatusCode.FAILED_PRECONDITION,
        None,
    ),
]


async def state(c) -> tuple[int, float, int]:
    """(version, window tokens, window reports) as the service sees them."""
    await asyncio.sleep(0.25)  # let the instance flush its window
    version = (await c.stub.GetPlacement(pb.GetPlacementRequest(deployment="d1"))).placement.version
    dry = await c.stub.Rebalance(pb.RebalanceRequest(deployment="d1", dry_run=True))
    return version, dry.window_tokens, dry.window_reports


@pytest.fixture
async def primed(serve, connect, prefix):
    """A Redis-backed server with deployment d1 and one accepted report (rank 0, seq 5)."""
    server = await serve(redis_url=REDIS_URL, key_prefix=prefix())
    c = connect(server)
    await c.stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=small_deployment()))
    resp = await c.stub.ReportLoad(iter([logical(GOOD, seq=5)]))
    assert resp.accepted == 1
    return server, c


@pytest.mark.parametrize("case,request_,code,field", REPORT_CASES, ids=[c[0] for c in REPORT_CASES])
async def test_bad_report_is_rejected_and_changes_nothing(primed, case, request_, code, field):
    server, c = primed
    before = await state(c)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await c.stub.ReportLoad(iter([request_]))
    assert info.value.code() == code, info.value.details()
    if field is not None:
        assert [f for f, _ in status_details(info.value)] == [field]
    assert await state(c) == before
    # Still serving, and the rank's seq bookkeeping was not advanced by the bad message.
    assert (await c.stub.ReportLoad(iter([logical(GOOD, seq=6)]))).accepted == 1


async def test_duplicate_rank_seq_is_counted_once(primed):
    _, c = primed
    before = await state(c)
    resp = await c.stub.ReportLoad(
        iter([logical(GOOD, seq=5), logical(GOOD, seq=4), logical(GOOD, seq=7), logical(GOOD, seq=7)])
    )
    assert (resp.accepted, resp.duplicates) == (1, 3)
    version, tokens, reports = await state(c)
    assert (version, tokens, reports) == (before[0], before[1] + GOOD.sum(), before[2] + 1)


CREATE_CASES = [
    (
        "zero layers",
        dict(topology=pb.Topology(num_layers=0, num_experts=16, num_slots=24, num_gpus=8)),
        "deployment.topology.num_layers",
    ),
    (
        "slots not a multiple of gpus",
        dict(topology=pb.Topology(num_layers=1, num_experts=16, num_slots=20, num_gpus=8)),
        "deployment.topology",
    ),
    ("unknown policy", dict(policy="magic"), "deployment.policy"),
    ("bad name", dict(name="has space"), "deployment.name"),
    ("gain out of range", dict(trigger=pb.Trigger(min_gain_percent=150)), "deployment.trigger.min_gain_percent"),
    (
        "trigger interval under a second",
        dict(trigger=pb.Trigger(interval=Duration(nanos=1000))),
        "deployment.trigger.interval",
    ),
    ("empty sliding window", dict(window=pb.Window(sliding=pb.SlidingWindow())), "deployment.window.sliding"),
    ("negative tolerance", dict(migration=pb.Migration(tolerance=-0.1)), "deployment.migration.tolerance"),
    (
        "tolerance not a number",
        dict(migration=pb.Migration(layer_tolerance=float("nan"))),
        "deployment.migration.layer_tolerance",
    ),
    (
        "migration bounds for a from-scratch policy",
        dict(policy="deepseek", migration=pb.Migration(tolerance=0.02)),
        "deployment.migration.tolerance",
    ),
    (
        "per-layer move budget for a from-scratch policy",
        dict(policy="ilp", migration=pb.Migration(max_layer_moves=10)),
        "deployment.migration.max_layer_moves",
    ),
]


@pytest.mark.parametrize("case,fields,field", CREATE_CASES, ids=[c[0] for c in CREATE_CASES])
async def test_bad_deployment_is_rejected(primed, case, fields, field):
    _, c = primed
    deployment = small_deployment("d2")
    for k, v in fields.items():
        if isinstance(v, str):
            setattr(deployment, k, v)
        else:
            getattr(deployment, k).CopyFrom(v)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await c.stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=deployment))
    assert info.value.code() == INVALID
    assert field in [f for f, _ in status_details(info.value)]
    names = [d.name for d in (await c.stub.ListDeployments(pb.ListDeploymentsRequest())).deployments]
    assert names == ["d1"]


async def test_existing_deployment_is_not_overwritten(primed):
    _, c = primed
    other = small_deployment()
    other.policy = "global"
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await c.stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=other))
    assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
    got = await c.stub.GetDeployment(pb.GetDeploymentRequest(name="d1"))
    assert got.deployment.policy == "auto" and got.deployment.version == 1


async def test_unknown_names_and_versions(primed):
    _, c = primed
    for call in (
        c.stub.GetDeployment(pb.GetDeploymentRequest(name="nope")),
        c.stub.DeleteDeployment(pb.DeleteDeploymentRequest(name="nope")),
        c.stub.GetPlacement(pb.GetPlacementRequest(deployment="nope")),
        c.stub.GetPlacement(pb.GetPlacementRequest(deployment="d1", version=42)),
        c.stub.Rebalance(pb.RebalanceRequest(deployment="nope")),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await c.stub.AckPlacement(pb.AckPlacementRequest(deployment="d1", rank=0, version=2))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    watch = c.stub.WatchPlacements(pb.WatchPlacementsRequest(deployment="nope"))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await watch.read()
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


async def test_compute_placement_rejects_bad_loads(primed):
    _, c = primed
    req = pb.ComputePlacementRequest(topology=small_deployment().topology, loads=arr(np.ones((L, E + 1))))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await c.stub.ComputePlacement(req)
    assert info.value.code() == INVALID and [f for f, _ in status_details(info.value)] == ["loads.shape"]


async def test_compute_placement_rejects_bad_migration_bounds(primed):
    _, c = primed
    req = pb.ComputePlacementRequest(
        topology=small_deployment().topology, loads=arr(np.ones((L, E))), migration=pb.Migration(tolerance=-1.0)
    )
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await c.stub.ComputePlacement(req)
    assert info.value.code() == INVALID
    assert [f for f, _ in status_details(info.value)] == ["migration.tolerance"]


async def test_oversize_message_is_resource_exhausted(serve, connect, prefix):
    server = await serve(redis_url=REDIS_URL, key_prefix=prefix(), max_message_bytes=64 * 1024)
    c = connect(server)
    await c.stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=small_deployment()))
    big = pb.ReportLoadRequest(
        deployment="d1", rank=0, seq=1, logical=pb.Array(dtype=pb.DTYPE_INT32, shape=[L, E], data=b"\0" * (128 * 1024))
    )
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await c.stub.ReportLoad(iter([big]))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert (await c.stub.ReportLoad(iter([logical(GOOD, seq=2)]))).accepted == 1


async def test_a_deployment_whose_placement_cannot_be_sent_is_refused_on_create(serve, connect):
    # It used to be stored, and then every GetPlacement and watch failed with RESOURCE_EXHAUSTED.
    c = connect(await serve(max_message_bytes=8192), max_message_bytes=1 << 20)
    big = small_deployment("big")
    big.topology.CopyFrom(pb.Topology(num_layers=16, num_experts=64, num_slots=128, num_gpus=8))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await c.stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=big))
    assert info.value.code() == INVALID
    ((field, why),) = status_details(info.value)
    assert field == "deployment.topology" and "--max-message-bytes 8192" in why
    assert not (await c.stub.ListDeployments(pb.ListDeploymentsRequest())).deployments
    # One that fits is stored and readable.
    await c.stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=small_deployment()))
    got = await c.stub.GetPlacement(pb.GetPlacementRequest(deployment="d1"))
    assert got.placement.version == 1


async def test_bad_token_is_unauthenticated(serve, connect, prefix):
    server = await serve(redis_url=REDIS_URL, key_prefix=prefix(), token="s3cret")
    good, bad, none = connect(server, token="s3cret"), connect(server, token="wrong"), connect(server)
    await good.stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=small_deployment()), metadata=good.metadata)
    for c in (bad, none):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await c.stub.GetPlacement(pb.GetPlacementRequest(deployment="d1"), metadata=c.metadata)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await c.stub.ReportLoad(iter([logical(GOOD, seq=1)]), metadata=c.metadata)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    resp = await good.stub.ReportLoad(iter([logical(GOOD, seq=1)]), metadata=good.metadata)
    assert (resp.accepted, resp.duplicates) == (1, 0)  # the rejected reports left no trace
    # The scheme is case-insensitive (RFC 7235), the token is not.
    for header, code in (("bearer s3cret", None), ("BEARER s3cret", None), ("Bearer S3CRET", "x"), ("s3cret", "x")):
        call = good.stub.GetPlacement(pb.GetPlacementRequest(deployment="d1"), metadata=(("authorization", header),))
        if code is None:
            assert (await call).placement.version == 1
        else:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


LIMIT_CASES = [
    ("newline after the name", dict(name="nl\n"), "deployment.name"),
    (
        "20,000 layers",
        dict(topology=pb.Topology(num_layers=20_000, num_experts=16, num_slots=24, num_gpus=8)),
        "deployment.topology.num_layers",
    ),
    (
        "2^32 - 1 layers",
        dict(topology=pb.Topology(num_layers=2**32 - 1, num_experts=16, num_slots=24, num_gpus=8)),
        "deployment.topology.num_layers",
    ),
    (
        "2^32 - 1 gpus",
        dict(topology=pb.Topology(num_layers=4, num_experts=16, num_slots=24, num_gpus=2**32 - 1)),
        "deployment.topology.num_gpus",
    ),
    (
        "placement over 4 MiB",
        dict(topology=pb.Topology(num_layers=1000, num_experts=256, num_slots=2048, num_gpus=8)),
        "deployment.topology",
    ),
    ("repeated ranks", dict(ranks=[0, 1, 1]), "deployment.ranks"),
]


@pytest.mark.parametrize("case,fields,field", LIMIT_CASES, ids=[c[0] for c in LIMIT_CASES])
async def test_limits_are_enforced_before_anything_is_stored(primed, case, fields, field):
    _, c = primed
    deployment = small_deployment("d2")
    for k, v in fields.items():
        if isinstance(v, str):
            setattr(deployment, k, v)
        elif isinstance(v, list):
            getattr(deployment, k).extend(v)
        else:
            getattr(deployment, k).CopyFrom(v)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await c.stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=deployment))
    assert info.value.code() == INVALID, info.value.details()
    assert field in [f for f, _ in status_details(info.value)]
    names = [d.name for d in (await c.stub.ListDeployments(pb.ListDeploymentsRequest())).deployments]
    assert names == ["d1"]


async def test_deployments_per_service_are_limited(serve, connect, monkeypatch):
    from eplb import limits

    monkeypatch.setattr(limits, "MAX_DEPLOYMENTS", 2)
    c = connect(await serve())
    for name in ("a", "b"):
        await c.stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=small_deployment(name)))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await c.stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=small_deployment("c")))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert [d.name for d in (await c.stub.ListDeployments(pb.ListDeploymentsRequest())).deployments] == ["a", "b"]


async def test_watch_from_a_version_above_the_current_is_out_of_range(primed):
    _, c = primed
    watch = c.stub.WatchPlacements(pb.WatchPlacementsRequest(deployment="d1", since_version=5))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await asyncio.wait_for(watch.read(), 5)
    assert info.value.code() == grpc.StatusCode.OUT_OF_RANGE
    assert "current version 1" in info.value.details()


async def test_a_broken_stream_says_how_many_of_its_reports_were_kept(primed):
    _, c = primed
    before = await state(c)
    nan = np.full((L, E), np.nan)
    stream = [logical(GOOD, seq=10), logical(GOOD, seq=11), logical(nan, seq=12), logical(GOOD, seq=13)]
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await c.stub.ReportLoad(iter(stream))
    details = dict(status_details(info.value))
    assert info.value.code() == INVALID and set(details) == {"logical.data", "stream"}
    assert "2 accepted, 0 duplicates" in details["stream"]
    version, tokens, reports = await state(c)
    assert (tokens, reports) == (before[1] + 2 * GOOD.sum(), before[2] + 2)
