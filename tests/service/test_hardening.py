"""What one caller may send and what it costs everyone else: client strings bounded in every log
line and status, names checked before anything else, refusals throttled by caller, undecodable
messages answered without a traceback, every Duration and Timestamp in protobuf's ranges, and
per-deployment health that tells no name to a caller who may not see it (docs/service.md,
"Limits" and "Tenants").

Every test runs a real server on 127.0.0.1 and calls it through real channels; the health test
runs on the real local Redis Cluster with a master killed.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import time
import uuid
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
from google.protobuf import json_format
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc
from svc_helpers import report_some_load, small_deployment, status_details

from eplb_service.auth import token_sha256
from eplb_service.clip import MAX_MESSAGE
from eplb_service.server import SERVICE_NAME
from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb
from eplb_wire.arrays import encode

ADMIN, ENGINE_A = "admin-tok-h", "engine-a-tok-h"
TOKENS = {ADMIN: ("admin", []), ENGINE_A: ("engine", ["team-a-*"])}
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
# What a bounded status weighs at most in trailers (clip.py): message, details and their framing.
MAX_TRAILERS = 6 * 1024


def write_auth(path, tokens=TOKENS):
    entries = [{"sha256": token_sha256(t), "role": role, "deployments": globs} for t, (role, globs) in tokens.items()]
    path.write_text(json.dumps({"tokens": entries}))
    return path


class LogBytes:
    """Every record the server's loggers write at INFO and above, formatted: what a log file grows by."""

    def __init__(self) -> None:
        self.stream = io.StringIO()
        self.handler = logging.StreamHandler(self.stream)
        self.handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
        self.handler.setLevel(logging.INFO)

    def __enter__(self) -> LogBytes:
        root = logging.getLogger()
        self._level = root.level
        root.setLevel(logging.INFO)
        root.addHandler(self.handler)
        return self

    def __exit__(self, *exc: object) -> None:
        root = logging.getLogger()
        root.removeHandler(self.handler)
        root.setLevel(self._level)

    @property
    def text(self) -> str:
        return self.stream.getvalue()


def _strings(msg: Message, text: Iterator[str], depth: int = 0) -> int:
    """Sets every string field of ``msg`` and of its message fields (recursively) to the next of
    ``text``; how many it set."""
    count = 0
    for field in msg.DESCRIPTOR.fields:
        if field.type == field.TYPE_STRING:
            if field.is_repeated:
                getattr(msg, field.name).append(next(text))
            else:
                setattr(msg, field.name, next(text))
            count += 1
        elif field.type == field.TYPE_MESSAGE and not field.is_repeated and depth < 3:
            if field.message_type.full_name.startswith("google.protobuf."):
                continue
            count += _strings(getattr(msg, field.name), text, depth + 1)
    return count


def _requests(size: int) -> list[tuple[str, Message]]:
    """One request of each RPC, every string field a distinct string of ``size`` characters (the
    rest a valid small deployment where the RPC takes one)."""
    counter = iter(range(10**6))
    text = (f"{next(counter):06d}" + "x" * size)[:size]
    texts = (f"{i:06d}{text[6:]}" for i in counter)
    out: list[tuple[str, Message]] = []
    for method in pb.DESCRIPTOR.services_by_name["ExpertLoadBalancerService"].methods:
        request = getattr(pb, method.input_type.name)()
        if method.name == "CreateDeployment":
            request.deployment.CopyFrom(small_deployment("x"))
        if method.name == "ComputePlacement":
            request.topology.CopyFrom(small_deployment().topology)
            request.loads.CopyFrom(encode(np.ones((4, 16), np.int32)))
        if _strings(request, texts):  # (ListDeployments takes no string)
            out.append((method.name, request))
    assert len(out) == 11, [m for m, _ in out]
    return out


async def _call(stub: object, method: str, request: Message, metadata: tuple = ()) -> grpc.aio.AioRpcError | None:
    fn = getattr(stub, method)
    try:
        if method == "ReportLoad":
            await fn(iter([request]), metadata=metadata, timeout=10)
        elif method == "StreamLoad":
            call = fn(iter([request]), metadata=metadata, timeout=10)
            await call.read()
            await call
        elif method == "WatchPlacements":
            call = fn(request, metadata=metadata, timeout=10)
            await call.read()
            call.cancel()
        else:
            await fn(request, metadata=metadata, timeout=10)
    except grpc.aio.AioRpcError as exc:
        return exc
    return None


def _trailer_bytes(err: grpc.aio.AioRpcError) -> int:
    return sum(len(k) + len(v) for k, v in err.trailing_metadata() or ()) + len(err.details() or "")


@pytest.mark.parametrize("auth", [False, True], ids=["open", "auth"])
async def test_oversized_strings_in_every_field_bound_the_log_and_the_status(serve, connect, tmp_path, auth):
    """Every RPC, every string field 256 KiB (distinct each round): each answer is a request
    error with a bounded status (never the transport's RESOURCE_EXHAUSTED on trailers), and the
    whole flood writes a few KiB of log, not the strings (it wrote each name whole: 42 MB from 40
    GetDeployment calls of 1 MiB)."""
    server = await serve(auth_file=write_auth(tmp_path / "auth.json") if auth else None)
    tokens = [ADMIN, ENGINE_A] if auth else [None]
    with LogBytes() as logged:
        for token in tokens:
            c = connect(server, token=token)
            for _ in range(3):
                for method, request in _requests(256 * 1024):
                    err = await _call(c.stub, method, request, c.metadata)
                    assert err is not None, method
                    assert err.code() in (
                        grpc.StatusCode.INVALID_ARGUMENT,
                        grpc.StatusCode.PERMISSION_DENIED,
                        grpc.StatusCode.NOT_FOUND,
                    ), (method, err.code(), err.details()[:300])
                    assert len(err.details()) <= MAX_MESSAGE + 100, method
                    assert _trailer_bytes(err) < MAX_TRAILERS, (method, _trailer_bytes(err))
        server.access and server.access.refusals.flush(everything=True)
    lines = logged.text.splitlines()
    assert len(logged.text) < 16 * 1024, (len(logged.text), lines[:5])
    assert max((len(line) for line in lines), default=0) < 2048


@pytest.mark.parametrize("size", [20 * 1024, 1 << 20], ids=["20KiB", "1MiB"])
@pytest.mark.parametrize("auth", [False, True], ids=["open", "auth"])
async def test_long_names_are_invalid_argument_naming_the_limit(serve, connect, tmp_path, size, auth):
    """A name over 64 characters is INVALID_ARGUMENT on its field, checked before the token's scope,
    with the name clipped in the status (8 KiB names came back as RESOURCE_EXHAUSTED "received
    metadata size exceeds hard limit", with megabytes of trailers)."""
    server = await serve(auth_file=write_auth(tmp_path / "auth.json") if auth else None)
    c = connect(server, token=ENGINE_A if auth else None)
    name = "team-b-" + "n" * (size - 7)
    calls = [
        ("CreateDeployment", pb.CreateDeploymentRequest(deployment=small_deployment(name)), "deployment.name"),
        ("GetPlacement", pb.GetPlacementRequest(deployment=name), "deployment"),
        ("GetDeployment", pb.GetDeploymentRequest(name=name), "name"),
    ]
    for method, request, field in calls:
        err = await _call(c.stub, method, request, c.metadata)
        assert err is not None and err.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, err and err.code())
        [(got_field, description)] = status_details(err)
        assert got_field == field and "1-64 letters" in description, description
        assert f"({size} characters, sha256 " in description and len(description) < 300
        assert _trailer_bytes(err) < MAX_TRAILERS


async def test_refusals_are_throttled_by_caller_not_by_name(serve, connect, tmp_path, caplog):
    """200 out-of-scope names from one engine token write one audit line, not one a name."""
    server = await serve(auth_file=write_auth(tmp_path / "auth.json"))
    c = connect(server, token=ENGINE_A)
    caplog.set_level(logging.INFO, logger="eplb_service.audit")
    codes = await asyncio.gather(
        *(_call(c.stub, "GetDeployment", pb.GetDeploymentRequest(name=f"team-b-{i}"), c.metadata) for i in range(200))
    )
    assert {e.code() for e in codes} == {grpc.StatusCode.PERMISSION_DENIED}
    lines = [r for r in caplog.records if r.name == "eplb_service.audit"]
    assert len(lines) == 1 and lines[0].token == token_sha256(ENGINE_A)[:8], [r.getMessage() for r in lines]
    caplog.clear()
    server.access.refusals.flush(everything=True)
    [summary] = caplog.records
    assert summary.count == 199 and "team-b-" in summary.reason


async def test_refused_creates_are_audited_throttled_and_successes_always(serve, connect, caplog):
    server = await serve()
    c = connect(server)
    caplog.set_level(logging.INFO, logger="eplb_service.audit")
    for i in range(50):
        await _call(
            c.stub, "CreateDeployment", pb.CreateDeploymentRequest(deployment=small_deployment(f"bad name {i}"))
        )
    for i in range(3):
        await c.stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=small_deployment(f"ok-{i}")))
    codes = [r.code for r in caplog.records if r.name == "eplb_service.audit"]
    assert codes == ["INVALID_ARGUMENT", "OK", "OK", "OK"], codes


async def test_undecodable_messages_are_invalid_argument_in_one_throttled_line(serve, connect):
    """Bytes that are no valid message: INVALID_ARGUMENT saying so, one log line for many calls and
    no traceback (it was UNKNOWN with an ERROR traceback a call); a report stream says how many of
    its messages before the bad one were processed."""
    server = await serve()
    c = connect(server)
    await c.stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=small_deployment("d1")))
    garbage = b"\xff\xff\xff\xff"
    raw = {
        m: c.channel.unary_unary(f"/eplb.v1.ExpertLoadBalancerService/{m}")
        for m in ("GetDeployment", "GetPlacement", "CreateDeployment")
    }
    with LogBytes() as logged:
        for _ in range(20):
            for method, call in raw.items():
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await call(garbage, timeout=5)
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, method
                assert f"do not parse as eplb.v1.{method}Request" in info.value.details()
        good = pb.ReportLoadRequest(deployment="d1", rank=0, seq=1, logical=encode(np.ones((4, 16), np.int32)))
        stream = c.channel.stream_unary("/eplb.v1.ExpertLoadBalancerService/ReportLoad")
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stream(iter([good.SerializeToString(), garbage]), timeout=5)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert status_details(info.value)[0][0] == "message 1"
        assert "the 1 messages before it were processed" in info.value.details()
    assert "Traceback" not in logged.text
    lines = [line for line in logged.text.splitlines() if "is not a valid" in line]
    assert len(lines) == 4, logged.text[:2000]  # one per method, in its minute
    # The report before the bad message was kept: resending it is a duplicate.
    resent = await c.stub.ReportLoad(iter([good]))
    assert (resent.accepted, resent.duplicates) == (0, 1)


def _bad_times() -> list[tuple[str, pb.Deployment]]:
    cases = []
    for field, setter in (
        ("deployment.window.sliding.duration.nanos", lambda d: d.window.sliding.duration.MergeFrom(
            pb.google_dot_protobuf_dot_duration__pb2.Duration(seconds=1, nanos=2_000_000_000))),
        ("deployment.window.sliding.duration.nanos", lambda d: d.window.sliding.duration.MergeFrom(
            pb.google_dot_protobuf_dot_duration__pb2.Duration(seconds=5, nanos=-1))),
        ("deployment.window.decay.half_life.nanos", lambda d: d.window.decay.half_life.MergeFrom(
            pb.google_dot_protobuf_dot_duration__pb2.Duration(seconds=60, nanos=-5))),
        ("deployment.trigger.interval.nanos", lambda d: d.trigger.interval.MergeFrom(
            pb.google_dot_protobuf_dot_duration__pb2.Duration(nanos=1_500_000_000))),
        ("deployment.liveness.suspect_after.seconds", lambda d: d.liveness.suspect_after.MergeFrom(
            pb.google_dot_protobuf_dot_duration__pb2.Duration(seconds=10**12))),
        ("deployment.create_time.nanos", lambda d: d.create_time.MergeFrom(
            pb.google_dot_protobuf_dot_timestamp__pb2.Timestamp(seconds=1, nanos=-1))),
        ("deployment.create_time.seconds", lambda d: d.create_time.MergeFrom(
            pb.google_dot_protobuf_dot_timestamp__pb2.Timestamp(seconds=10**13))),
    ):  # fmt: skip
        d = small_deployment(f"t-{uuid.uuid4().hex[:6]}")
        setter(d)
        cases.append((field, d))
    return cases


async def test_out_of_range_durations_and_timestamps_are_refused_and_nothing_stored(serve, connect):
    """Out of protobuf's ranges, a time was stored and then no JSON tool (grpcurl among them) could
    render the deployment or any ListDeployments answer."""
    server = await serve()
    c = connect(server)
    await c.stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=small_deployment("kept")))
    for field, deployment in _bad_times():
        err = await _call(c.stub, "CreateDeployment", pb.CreateDeploymentRequest(deployment=deployment))
        assert err is not None and err.code() == grpc.StatusCode.INVALID_ARGUMENT, field
        assert field in [f for f, _ in status_details(err)], status_details(err)
    listed = await c.stub.ListDeployments(pb.ListDeploymentsRequest())
    assert [d.name for d in listed.deployments] == ["kept"]
    json_format.MessageToJson(listed)  # renders
    # A stateless plan's planning.time_limit too.
    request = pb.ComputePlacementRequest(topology=small_deployment().topology, loads=encode(np.ones((4, 16), np.int32)))
    request.planning.time_limit.nanos = -2_000_000_000
    err = await _call(c.stub, "ComputePlacement", request)
    assert err is not None and err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert status_details(err)[0][0] == "planning.time_limit.nanos"


async def _health(channel: grpc.aio.Channel, service: str, metadata: tuple = ()) -> int | str:
    try:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), metadata=metadata, timeout=5
        )
    except grpc.aio.AioRpcError as exc:
        return f"{exc.code().name}:{exc.details()}"
    return reply.status


async def _first_watched(channel: grpc.aio.Channel, service: str, metadata: tuple = ()) -> int:
    call = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=service), metadata=metadata)
    try:
        return (await asyncio.wait_for(call.read(), 5)).status
    finally:
        call.cancel()


async def test_per_deployment_health_tells_no_name_without_a_scoped_token(serve, connect, tmp_path, redis_cluster):
    """With tokens on, a master of the cluster killed and back: per-deployment health answers an
    existing deployment and an unknown name alike to a caller without a token or outside its
    globs (it said SERVING / NOT_SERVING against NOT_FOUND), and the truth to one that may see
    it. The overall health stays open."""
    p = f"eplb-test-{uuid.uuid4().hex[:10]}"
    # One team-a and one team-b deployment on the master to kill; one team-a elsewhere.
    victim_port = redis_cluster.ports[1]
    names: dict[str, str] = {}
    for i in range(400):
        for team in ("a", "b"):
            n = f"team-{team}-{i}"
            on_victim = redis_cluster.port_of(f"{p}:{{{n}}}:meta") == victim_port
            key = f"{team}-victim" if on_victim else f"{team}-other"
            names.setdefault(key, n)
        if len(names) == 4:
            break
    server = await serve(redis_url=redis_cluster.url, key_prefix=p, auth_file=write_auth(tmp_path / "auth.json"))
    admin, anon, engine = connect(server, ADMIN), connect(server), connect(server, ENGINE_A)
    for n in names.values():
        await admin.stub.CreateDeployment(
            pb.CreateDeploymentRequest(deployment=small_deployment(n)), metadata=admin.metadata
        )
        await report_some_load(admin.stub, n, metadata=admin.metadata)
    unknown = "team-b-never-made"

    async def hidden_alike(c, hidden: list[str]) -> None:
        answers = {n: await _health(c.channel, f"{SERVICE_NAME}/{n}", c.metadata) for n in [*hidden, unknown]}
        assert set(answers.values()) == {"NOT_FOUND:"}, answers
        watched = {n: await _first_watched(c.channel, f"{SERVICE_NAME}/{n}", c.metadata) for n in [*hidden, unknown]}
        assert set(watched.values()) == {UNKNOWN}, watched

    redis_cluster.kill(redis_cluster.ports[1])
    try:
        deadline = time.monotonic() + 15
        while await _health(admin.channel, f"{SERVICE_NAME}/{names['a-victim']}", admin.metadata) != NOT_SERVING:
            assert time.monotonic() < deadline, "the dead master's deployment never went NOT_SERVING"
            await asyncio.sleep(0.1)
        assert await _health(admin.channel, f"{SERVICE_NAME}/{names['b-other']}", admin.metadata) == SERVING
        assert await _health(anon.channel, "") == SERVING and await _health(anon.channel, SERVICE_NAME) == SERVING
        await hidden_alike(anon, list(names.values()))
        await hidden_alike(engine, [names["b-victim"], names["b-other"]])
        assert await _health(engine.channel, f"{SERVICE_NAME}/{names['a-victim']}", engine.metadata) == NOT_SERVING
        assert await _health(engine.channel, f"{SERVICE_NAME}/{names['a-other']}", engine.metadata) == SERVING
    finally:
        redis_cluster.start_node(victim_port)
        redis_cluster.wait_ok()
    deadline = time.monotonic() + 20
    while await _health(admin.channel, f"{SERVICE_NAME}/{names['a-victim']}", admin.metadata) != SERVING:
        assert time.monotonic() < deadline, "the master's deployment never came back SERVING"
        await asyncio.sleep(0.1)
    await hidden_alike(anon, list(names.values()))
    # A name too long for any deployment is refused at once, a watch too (an open watch holds its
    # request: 100 watches of 1 MiB names held 220 MiB).
    too_long = "INVALID_ARGUMENT:a health service name is at most 256 characters; this one has 100000"
    assert await _health(anon.channel, "x" * 100_000) == too_long
    call = health_pb2_grpc.HealthStub(anon.channel).Watch(health_pb2.HealthCheckRequest(service="x" * 100_000))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await asyncio.wait_for(call.read(), 5)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_repeated_failed_acks_write_one_line_a_rank_a_minute(serve, connect):
    """An engine may send FAILED acks as often as it likes: one log line per (deployment, rank) a
    minute, the error clipped to about 256 characters however it escapes (300 acks of 1,024
    emoji wrote 2.7 KB a line, 810 KB)."""
    server = await serve()
    c = connect(server)
    await c.stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=small_deployment("d1")))
    with LogBytes() as logged:
        for i in range(200):
            await c.stub.AckPlacement(
                pb.AckPlacementRequest(
                    deployment="d1", rank=i % 2, version=1, state=pb.ACK_STATE_FAILED, error="\U0001f600" * 1024
                )
            )
    lines = [line for line in logged.text.splitlines() if "failed to prepare" in line]
    assert len(lines) == 2 and all(len(line) < 512 for line in lines), [len(line) for line in lines]


async def test_random_tokens_cannot_push_a_known_tokens_refusals_out(serve, connect, tmp_path, caplog):
    """Unknown tokens are one caller: 300 random ones write one line, and a known token's refusal
    after them is still logged under its own hash prefix (it went to "other" once 256 random
    tokens held every window)."""
    server = await serve(auth_file=write_auth(tmp_path / "auth.json"))
    caplog.set_level(logging.INFO, logger="eplb_service.audit")
    for i in range(300):
        spray = connect(server, token=f"spray-{i}")
        err = await _call(spray.stub, "GetDeployment", pb.GetDeploymentRequest(name="x"), spray.metadata)
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED
        await spray.channel.close()
    engine = connect(server, token=ENGINE_A)
    err = await _call(engine.stub, "GetDeployment", pb.GetDeploymentRequest(name="team-b-1"), engine.metadata)
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED
    lines = [r for r in caplog.records if r.name == "eplb_service.audit"]
    assert [r.token for r in lines] == ["unknown", token_sha256(ENGINE_A)[:8]], [r.getMessage() for r in lines]
    assert lines[0].reason == f"unknown token {token_sha256('spray-0')[:8]}"


async def test_audit_fields_hold_names_only_when_plain(serve, connect, caplog):
    """The audit line's ``deployment`` field is the name itself only when it is a valid one; a
    refused name with line-break or bidi characters goes clipped (ASCII), as in the message."""
    server = await serve()
    c = connect(server)
    caplog.set_level(logging.INFO, logger="eplb_service.audit")
    odd = 'ok\u2028{"level": "CRITICAL"}\x85\u202e'
    await _call(c.stub, "CreateDeployment", pb.CreateDeploymentRequest(deployment=small_deployment(odd)))
    await c.stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=small_deployment("fine-1")))
    fields = [r.deployment for r in caplog.records if r.name == "eplb_service.audit"]
    assert fields == [ascii(odd), "fine-1"] and fields[0].isascii()


async def test_a_topology_too_big_to_re_plan_is_refused_at_create(serve, connect):
    """Within every size limit, a few gpus of many slots may still need more memory to re-plan
    than the library allows (eplb.limits.plan_bytes): refused when created, not at its first plan
    (which ran the worker out of memory before the library's guard)."""
    server = await serve()
    c = connect(server)
    d = pb.Deployment(name="wide", topology=pb.Topology(num_layers=64, num_experts=8192, num_slots=16384, num_gpus=1))
    err = await _call(c.stub, "CreateDeployment", pb.CreateDeploymentRequest(deployment=d))
    assert err is not None and err.code() == grpc.StatusCode.INVALID_ARGUMENT
    [(field, description)] = status_details(err)
    assert field == "deployment.topology" and "eplb.limits.plan_bytes" in description, description
    assert not (await c.stub.ListDeployments(pb.ListDeploymentsRequest())).deployments
