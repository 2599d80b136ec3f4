"""Tenants: scoped tokens (``--auth-file``), who may do what, reload, /metrics auth, throttled
refusal logs, certificate dates; and the empty-window rule and the logged metrics address.

Every test runs a real server on 127.0.0.1 and calls it through real channels (HTTP for /metrics).
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from datetime import UTC, datetime, timedelta
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from svc_helpers import free_port, report_some_load, small_deployment

from eplb_bench.harness.service import reports
from eplb_engine.aio import AsyncServiceClient
from eplb_service.auth import AuthFileError, RefusalLog, Role, parse_auth_file, token_sha256
from eplb_service.server import StartError, check_certificate_dates
from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb
from eplb_wire.arrays import encode

ROOT = Path(__file__).resolve().parents[2]

ADMIN, ENGINE_A, ENGINE_B, READER_A = "admin-tok-1", "engine-a-tok", "engine-b-tok", "reader-a-tok"
DENIED, UNAUTH = grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED
TOKENS = {
    ADMIN: ("admin", []),
    ENGINE_A: ("engine", ["team-a-*"]),
    ENGINE_B: ("engine", ["team-b-*"]),
    READER_A: ("reader", ["team-a-*"]),
}


def write_auth(path: Path, tokens: dict[str, tuple[str, list[str]]]) -> Path:
    entries = [{"sha256": token_sha256(t), "role": role, "deployments": globs} for t, (role, globs) in tokens.items()]
    path.write_text(json.dumps({"tokens": entries}))
    return path


async def tenant_server(serve, connect, tmp_path, tokens=TOKENS, **kw):
    """A server with ``tokens``; deployments team-a-1 and team-b-1 made by the admin."""
    server = await serve(auth_file=write_auth(tmp_path / "auth.json", tokens), **kw)
    admin = connect(server, token=ADMIN)
    for name in ("team-a-1", "team-b-1"):
        await admin.stub.CreateDeployment(
            pb.CreateDeploymentRequest(deployment=small_deployment(name)), metadata=admin.metadata
        )
    return server, admin


async def code_of(aw) -> grpc.StatusCode:
    try:
        await aw
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


async def refused(aw) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await aw
    return info.value


def counts(shape=(4, 16)) -> pb.Array:
    return encode(np.full(shape, 5, dtype=np.int32))


def report(deployment: str, rank: int, seq: int) -> pb.ReportLoadRequest:
    return pb.ReportLoadRequest(deployment=deployment, rank=rank, seq=seq, logical=counts())


async def first_of_watch(c, deployment: str) -> grpc.StatusCode:
    call = c.stub.WatchPlacements(pb.WatchPlacementsRequest(deployment=deployment), metadata=c.metadata)
    try:
        await asyncio.wait_for(call.read(), 5)
        return grpc.StatusCode.OK
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    finally:
        call.cancel()


async def stream_load(c, request: pb.ReportLoadRequest) -> grpc.StatusCode:
    """One report on a StreamLoad stream: OK once it is acknowledged, else the stream's status."""
    call = c.stub.StreamLoad(metadata=c.metadata)
    try:
        await call.write(request)
        ack = await asyncio.wait_for(call.read(), 5)
        assert ack.accepted
        await call.done_writing()
        return grpc.StatusCode.OK
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    finally:
        call.cancel()


async def calls_by_method(c, deployment: str) -> dict[str, grpc.StatusCode]:
    """Each method called once on ``deployment`` with ``c``'s token → its status code."""
    md = c.metadata
    compute = pb.ComputePlacementRequest(
        topology=small_deployment().topology, policy="auto", loads=encode(np.ones((4, 16), np.int32))
    )
    ack = pb.AckPlacementRequest(deployment=deployment, rank=0, version=1, state=pb.ACK_STATE_SWITCHED)
    seq = int(datetime.now(UTC).timestamp() * 1e6)
    return {
        "GetDeployment": await code_of(c.stub.GetDeployment(pb.GetDeploymentRequest(name=deployment), metadata=md)),
        "ListDeployments": await code_of(c.stub.ListDeployments(pb.ListDeploymentsRequest(), metadata=md)),
        "GetPlacement": await code_of(c.stub.GetPlacement(pb.GetPlacementRequest(deployment=deployment), metadata=md)),
        "WatchPlacements": await first_of_watch(c, deployment),
        "ReportLoad": await code_of(c.stub.ReportLoad(iter([report(deployment, 0, seq)]), metadata=md)),
        "StreamLoad": await stream_load(c, report(deployment, 1, seq)),
        "AckPlacement": await code_of(c.stub.AckPlacement(ack, metadata=md)),
        "ComputePlacement": await code_of(c.stub.ComputePlacement(compute, metadata=md)),
        "Rebalance": await code_of(
            c.stub.Rebalance(pb.RebalanceRequest(deployment=deployment, dry_run=True), metadata=md)
        ),
        "SetRanksDown": await code_of(
            c.stub.SetRanksDown(pb.SetRanksDownRequest(deployment=deployment, up=[0]), metadata=md)
        ),
        "CreateDeployment": await code_of(
            c.stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=small_deployment(deployment)), metadata=md)
        ),
    }


OK = grpc.StatusCode.OK
ALL_DENIED = dict.fromkeys(
    [
        "GetDeployment",
        "ListDeployments",
        "GetPlacement",
        "WatchPlacements",
        "ReportLoad",
        "StreamLoad",
        "AckPlacement",
        "ComputePlacement",
        "Rebalance",
        "SetRanksDown",
        "CreateDeployment",
    ],
    DENIED,
)


async def test_each_role_may_call_what_it_is_given_and_nothing_else(serve, connect, tmp_path):
    server, admin = await tenant_server(serve, connect, tmp_path)
    engine, reader = connect(server, token=ENGINE_A), connect(server, token=READER_A)
    # On its own deployments: the engine reports, acks, reads and computes; the reader reads.
    assert await calls_by_method(engine, "team-a-1") == {
        **ALL_DENIED,
        "GetDeployment": OK,
        "GetPlacement": OK,
        "WatchPlacements": OK,
        "ReportLoad": OK,
        "StreamLoad": OK,
        "AckPlacement": OK,
        "ComputePlacement": OK,
        "SetRanksDown": OK,
    }
    assert await calls_by_method(reader, "team-a-1") == {
        **ALL_DENIED,
        "GetDeployment": OK,
        "ListDeployments": OK,
        "GetPlacement": OK,
        "WatchPlacements": OK,
    }
    # On another tenant's deployment only what touches no deployment passes.
    assert await calls_by_method(engine, "team-b-1") == {**ALL_DENIED, "ComputePlacement": OK}
    assert await calls_by_method(reader, "team-b-1") == {**ALL_DENIED, "ListDeployments": OK}
    # The admin: everything, everywhere (its dry run and a create of an existing name answer as such).
    assert await calls_by_method(admin, "team-b-1") == {
        **dict.fromkeys(ALL_DENIED, OK),
        "CreateDeployment": grpc.StatusCode.ALREADY_EXISTS,
    }
    # The messages name the deployment and the role.
    err = await refused(
        engine.stub.Rebalance(pb.RebalanceRequest(deployment="team-a-1", force=True), metadata=engine.metadata)
    )
    assert err.code() == DENIED
    assert "engine token may not call Rebalance" in err.details() and "'team-a-1'" in err.details()
    assert "admin only" in err.details()
    err = await refused(
        engine.stub.GetPlacement(pb.GetPlacementRequest(deployment="team-b-1"), metadata=engine.metadata)
    )
    assert "'team-b-1' is outside this engine token's deployments ('team-a-*')" in err.details()
    err = await refused(
        admin.stub.DeleteDeployment(pb.DeleteDeploymentRequest(name="team-a-1"), metadata=reader.metadata)
    )
    assert err.code() == DENIED and "reader token may not call DeleteDeployment" in err.details()
    # Out-of-scope names are refused whether or not they exist: no probing for other tenants' names.
    err = await refused(engine.stub.GetDeployment(pb.GetDeploymentRequest(name="team-b-x"), metadata=engine.metadata))
    assert err.code() == DENIED
    err = await refused(engine.stub.GetDeployment(pb.GetDeploymentRequest(name="team-a-x"), metadata=engine.metadata))
    assert err.code() == grpc.StatusCode.NOT_FOUND
    # Delete is admin only, and works for it.
    assert (
        await code_of(
            engine.stub.DeleteDeployment(pb.DeleteDeploymentRequest(name="team-a-1"), metadata=engine.metadata)
        )
        == DENIED
    )
    await admin.stub.DeleteDeployment(pb.DeleteDeploymentRequest(name="team-b-1"), metadata=admin.metadata)


async def test_unknown_and_missing_tokens_are_unauthenticated_and_health_and_reflection_stay_open(
    serve, connect, tmp_path
):
    server, _ = await tenant_server(serve, connect, tmp_path)
    for c in (connect(server, token="guessed"), connect(server)):
        err = await refused(c.stub.GetPlacement(pb.GetPlacementRequest(deployment="team-a-1"), metadata=c.metadata))
        assert err.code() == UNAUTH and "bearer token" in err.details()
        assert await first_of_watch(c, "team-a-1") == UNAUTH
        seq = [report("team-a-1", 0, 1)]
        assert await code_of(c.stub.ReportLoad(iter(seq), metadata=c.metadata)) == UNAUTH
    anon = connect(server)
    health = await health_pb2_grpc.HealthStub(anon.channel).Check(health_pb2.HealthCheckRequest())
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    stream = reflection_pb2_grpc.ServerReflectionStub(anon.channel).ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")])
    )
    names = [s.name async for r in stream for s in r.list_services_response.service]
    assert "eplb.v1.ExpertLoadBalancerService" in names


async def test_list_deployments_shows_only_what_the_token_may_see(serve, connect, tmp_path):
    tokens = {**TOKENS, "reader-all": ("reader", ["*"]), "reader-b2": ("reader", ["team-b-[2-9]", "nothing"])}
    server, admin = await tenant_server(serve, connect, tmp_path, tokens)
    for name in ("team-a-2", "team-b-2", "other"):
        await admin.stub.CreateDeployment(
            pb.CreateDeploymentRequest(deployment=small_deployment(name)), metadata=admin.metadata
        )

    async def listed(token: str) -> list[str]:
        c = connect(server, token=token)
        return [
            d.name for d in (await c.stub.ListDeployments(pb.ListDeploymentsRequest(), metadata=c.metadata)).deployments
        ]

    assert await listed(ADMIN) == ["other", "team-a-1", "team-a-2", "team-b-1", "team-b-2"]
    assert await listed("reader-all") == ["other", "team-a-1", "team-a-2", "team-b-1", "team-b-2"]
    assert await listed(READER_A) == ["team-a-1", "team-a-2"]
    assert await listed("reader-b2") == ["team-b-2"]
    # Each listed deployment keeps its own status (eplb ctl list): filtered with the names.
    c = connect(server, token="reader-b2")
    got = await c.stub.ListDeployments(pb.ListDeploymentsRequest(), metadata=c.metadata)
    assert len(got.statuses) == 1 and got.statuses[0].version == 1 and got.statuses[0].num_ranks > 0


async def test_cross_tenant_reports_and_acks_are_refused_and_nothing_is_stored(serve, connect, tmp_path):
    server, admin = await tenant_server(serve, connect, tmp_path)
    a, b = connect(server, token=ENGINE_A), connect(server, token=ENGINE_B)
    # One stream from tenant B: its own report, then one as a rank of tenant A's deployment.
    err = await refused(
        b.stub.ReportLoad(iter([report("team-b-1", 0, 1), report("team-a-1", 0, 1)]), metadata=b.metadata)
    )
    assert err.code() == DENIED and "'team-a-1'" in err.details()
    assert "the 1 reports before it in this stream were kept" in err.details()
    # Nothing reached team-a-1's window: a forced re-plan has nothing to plan; team-b-1's does.
    err = await refused(
        admin.stub.Rebalance(pb.RebalanceRequest(deployment="team-a-1", force=True), metadata=admin.metadata)
    )
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "load window" in err.details()
    out = await admin.stub.Rebalance(pb.RebalanceRequest(deployment="team-b-1", force=True), metadata=admin.metadata)
    assert out.published and out.window_reports == 1

    # A rollout of team-a-1 at version 2; tenant B's FAILED ack for one of its ranks is refused.
    await AsyncServiceClient.over(a.channel, token=ENGINE_A).report(
        reports("team-a-1", 0, [np.ones((4, 16), np.int32)])
    )
    out = await admin.stub.Rebalance(pb.RebalanceRequest(deployment="team-a-1", force=True), metadata=admin.metadata)
    assert out.published and out.placement.version == 2
    fail = pb.AckPlacementRequest(deployment="team-a-1", rank=0, version=2, state=pb.ACK_STATE_FAILED, error="x")
    assert (await refused(b.stub.AckPlacement(fail, metadata=b.metadata))).code() == DENIED
    got = await a.stub.GetDeployment(pb.GetDeploymentRequest(name="team-a-1"), metadata=a.metadata)
    assert list(got.acks) == []
    # Not aborted: tenant A's own rank prepares normally.
    reply = await AsyncServiceClient.over(a.channel, token=ENGINE_A).ack("team-a-1", 1, 2, "prepared", step=10)
    assert reply.ranks_prepared == 1 and reply.ranks_failed == 0 and not reply.aborted


async def test_a_reload_keeps_valid_streams_and_ends_revoked_ones_at_once(serve, connect, tmp_path, caplog):
    tokens = {**TOKENS, "engine-a-2": ("engine", ["team-a-*"]), "engine-a-3": ("engine", ["team-a-*"])}
    server, admin = await tenant_server(serve, connect, tmp_path, tokens)
    path = server.access.auth_file
    watchers = {t: connect(server, token=t) for t in (ENGINE_A, "engine-a-2", "engine-a-3")}
    calls = {
        t: c.stub.WatchPlacements(pb.WatchPlacementsRequest(deployment="team-a-1"), metadata=c.metadata)
        for t, c in watchers.items()
    }
    for call in calls.values():
        assert (await asyncio.wait_for(call.read(), 5)).placement.version == 1
    stream_open = asyncio.Event()

    async def stream():  # an open ReportLoad stream of a token that stays valid
        for _ in range(3):
            yield reports("team-a-1", 0, [np.ones((4, 16), np.int32)])[0]
            stream_open.set()
            await asyncio.sleep(0.3)

    open_report = asyncio.ensure_future(
        watchers[ENGINE_A].stub.ReportLoad(stream(), metadata=watchers[ENGINE_A].metadata)
    )
    await stream_open.wait()

    # engine-a-2 revoked; engine-a-3 moved to another tenant's deployments; engine-a kept.
    write_auth(path, {**TOKENS, "engine-a-3": ("engine", ["team-b-*"])})
    caplog.set_level(logging.INFO, logger="eplb_service")
    loop = asyncio.get_running_loop()
    started = loop.time()
    assert server.reload_auth()
    for token, code in (("engine-a-2", UNAUTH), ("engine-a-3", DENIED)):
        err = await refused(asyncio.wait_for(calls[token].read(), 2))
        assert err.code() == code, token
    assert loop.time() - started < 1.0  # ended by the reload, not at the next version
    assert "2 open watches ended" in caplog.text
    # The valid stream and watch go on: its reports count, and it sees the next version.
    assert (await open_report).accepted == 3
    out = await admin.stub.Rebalance(pb.RebalanceRequest(deployment="team-a-1", force=True), metadata=admin.metadata)
    assert out.published
    assert (await asyncio.wait_for(calls[ENGINE_A].read(), 5)).placement.version == 2
    # The new file is in force for new calls too.
    c2 = watchers["engine-a-2"]
    assert (
        await code_of(c2.stub.GetPlacement(pb.GetPlacementRequest(deployment="team-a-1"), metadata=c2.metadata))
        == UNAUTH
    )
    c3 = watchers["engine-a-3"]
    assert (
        await code_of(c3.stub.GetPlacement(pb.GetPlacementRequest(deployment="team-b-1"), metadata=c3.metadata)) == OK
    )

    # A bad file on reload: ERROR, and the tokens in force stay.
    path.write_text('{"tokens": [{"sha256": "abc", "role": "engine"}]}')
    caplog.clear()
    assert not server.reload_auth()
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "tokens[0].sha256" in errors[0].getMessage() and "stay" in errors[0].getMessage()
    c1 = watchers[ENGINE_A]
    assert (
        await code_of(c1.stub.GetPlacement(pb.GetPlacementRequest(deployment="team-a-1"), metadata=c1.metadata)) == OK
    )
    calls[ENGINE_A].cancel()


def http_get(port: int, path: str, token: str | None = None) -> tuple[int, str]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}")
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


async def test_metrics_answer_only_admin_and_reader_tokens_and_only_on_metrics(serve, connect, tmp_path):
    server, admin = await tenant_server(serve, connect, tmp_path, metrics_port=0)
    port = server.metrics_port
    get = lambda path, token=None: asyncio.to_thread(http_get, port, path, token)  # noqa: E731
    for token in (None, "guessed", ENGINE_A):
        status, body = await get("/metrics", token)
        assert status == 401 and "eplb_" not in body, token
    assert "engine token may not read /metrics" in (await get("/metrics", ENGINE_A))[1]
    for token in (READER_A, ADMIN):
        status, body = await get("/metrics?name[]=x", token)
        assert status == 200 and "eplb_rpc_requests_total" in body
        # A reader sees every series, other tenants' deployments included (docs/service.md).
        assert 'deployment="team-b-1"' in body
    for path in ("/", "/debug", "/metrics/x", "/favicon.ico"):
        assert (await get(path, ADMIN))[0] == 404, path
        assert (await get(path))[0] == 404, path


async def test_without_an_auth_file_metrics_stay_open(serve):
    server = await serve(metrics_port=0, token="only-admin")
    status, body = await asyncio.to_thread(http_get, server.metrics_port, "/metrics")
    assert status == 200 and "eplb_rpc_requests_total" in body


async def test_refused_calls_are_logged_once_per_token_and_reason_with_a_count(serve, connect, tmp_path, caplog):
    server, _ = await tenant_server(serve, connect, tmp_path)
    guessed, engine = connect(server, token="guessed"), connect(server, token=ENGINE_A)
    caplog.set_level(logging.INFO, logger="eplb_service.audit")
    # 2,000 calls with an unknown token and 500 of an engine token outside its scope, 100 at a time.
    for c, request, rounds in ((guessed, "team-a-1", 20), (engine, "team-b-1", 5)):
        for _ in range(rounds):
            codes = await asyncio.gather(
                *(
                    code_of(c.stub.GetPlacement(pb.GetPlacementRequest(deployment=request), metadata=c.metadata))
                    for _ in range(100)
                )
            )
            assert set(codes) == {UNAUTH if c is guessed else DENIED}
    lines = [r for r in caplog.records if r.name == "eplb_service.audit"]
    assert len(lines) == 2, [r.getMessage() for r in lines]
    by_kind = {r.audit: r for r in lines}
    assert by_kind["auth_failure"].token == "unknown"  # every token not in the file is one caller
    assert by_kind["auth_failure"].reason == f"unknown token {token_sha256('guessed')[:8]}"
    assert by_kind["permission_denied"].token == token_sha256(ENGINE_A)[:8]
    assert "'team-b-1'" in by_kind["permission_denied"].reason
    assert "guessed" not in caplog.text and ENGINE_A not in caplog.text  # tokens never logged
    # When the window ends: one line each with the count of the others.
    caplog.clear()
    server.access.refusals.flush(everything=True)
    summaries = sorted((r.audit, r.count) for r in caplog.records)
    assert summaries == [("auth_failure", 1999), ("permission_denied", 499)]
    # The server ends windows on its own: with a short one, the count comes without another refusal.
    server.access.refusals.window_s = 0.3
    for _ in range(3):
        await code_of(guessed.stub.GetPlacement(pb.GetPlacementRequest(deployment="x"), metadata=guessed.metadata))
    for _ in range(40):
        if any(getattr(r, "count", 0) == 2 for r in caplog.records):
            break
        await asyncio.sleep(0.1)
    assert [r.count for r in caplog.records[2:]] == [1, 2]


def test_refusal_log_windows_and_its_bound_on_keys(caplog):
    now = [0.0]
    log = RefusalLog(window_s=60.0, max_keys=3, clock=lambda: now[0])
    caplog.set_level(logging.INFO, logger="eplb_service.audit")
    for _ in range(5):
        log.refused("aaaa", "unknown token", "UNAUTHENTICATED", "/m", "ipv4:1")
    now[0] = 59.0
    log.flush()
    assert [r.count for r in caplog.records] == [1]  # the window is still open
    now[0] = 60.0
    log.flush()
    assert [r.count for r in caplog.records] == [1, 4]
    # Random tokens: beyond max_keys open windows they are counted under "other".
    for i in range(100):
        log.refused(f"t{i:03d}", "unknown token", "UNAUTHENTICATED", "/m", "ipv4:1")
    tokens = [r.token for r in caplog.records[2:]]
    assert tokens == ["t000", "t001", "t002", "other"]


def make_cert(tmp_path: Path, start: datetime, end: datetime, name: str = "cert") -> tuple[Path, Path]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp_path / f"{name}.pem", tmp_path / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert_path, key_path


async def test_an_expired_or_not_yet_valid_certificate_refuses_to_start(serve, connect, tmp_path, caplog):
    now = datetime.now(UTC)
    expired = make_cert(tmp_path, now - timedelta(days=30), now - timedelta(days=1), "expired")
    early = make_cert(tmp_path, now + timedelta(days=1), now + timedelta(days=30), "early")
    for (cert, key), words in ((expired, "has expired"), (early, "is not valid yet")):
        with pytest.raises(StartError) as info:
            await serve(tls_cert=cert, tls_key=key)
        message = str(info.value)
        assert info.value.field == "tls_cert" and str(cert) in message and words in message
        assert f"{(now - timedelta(days=30) if cert == expired[0] else now + timedelta(days=1)):%Y-%m-%d}" in message
    # Expiring within 14 days: it starts, with a warning; 60 days: no warning.
    caplog.set_level(logging.WARNING, logger="eplb_service")
    soon = make_cert(tmp_path, now - timedelta(days=1), now + timedelta(days=3), "soon")
    server = await serve(tls_cert=soon[0], tls_key=soon[1])
    warned = [r.getMessage() for r in caplog.records if "expires in" in r.getMessage()]
    assert len(warned) == 1 and str(soon[0]) in warned[0] and "expires in 3.0 days" in warned[0]
    c = connect(server, root_certificates=soon[0].read_bytes())
    assert (await c.stub.ListDeployments(pb.ListDeploymentsRequest())).deployments == []
    caplog.clear()
    later = make_cert(tmp_path, now - timedelta(days=1), now + timedelta(days=60), "later")
    await serve(tls_cert=later[0], tls_key=later[1])
    assert not [r for r in caplog.records if "expires in" in r.getMessage()]
    # The check itself, at a given time.
    with pytest.raises(StartError):
        check_certificate_dates(later[0], later[0].read_bytes(), now + timedelta(days=61))


@pytest.mark.parametrize(
    ("doc", "words"),
    [
        ("not json", "JSON: not valid JSON"),
        ("[]", "top level: must be an object"),
        ('{"tokens": [], "extra": 1}', "unknown field 'extra'"),
        ('{"tokens": {}}', "tokens: must be a list"),
        (
            '{"tokens": [{"sha256": "' + "ab" * 32 + '", "role": "root", "deployments": ["x"]}]}',
            "tokens[0].role: must be one of",
        ),
        ('{"tokens": [{"sha256": "s3cret-token", "role": "admin"}]}', "tokens[0].sha256: must be the 64 hex digits"),
        ('{"tokens": [{"sha256": "' + "ab" * 32 + '", "role": "engine"}]}', "tokens[0].deployments: must be a list"),
        (
            '{"tokens": [{"sha256": "' + "ab" * 32 + '", "role": "reader", "deployments": []}]}',
            "needs at least one glob",
        ),
        (
            '{"tokens": [{"sha256": "' + "ab" * 32 + '", "role": "reader", "deployments": ["a b"]}]}',
            "tokens[0].deployments[0]",
        ),
        (
            '{"tokens": [{"sha256": "' + "ab" * 32 + '", "role": "admin", "name": "x"}]}',
            "tokens[0].name: unknown field",
        ),
        (
            '{"tokens": [{"sha256": "'
            + "ab" * 32
            + '", "role": "admin"}, {"sha256": "'
            + "AB" * 32
            + '", "role": "admin"}]}',
            "tokens[1].sha256: the same token as tokens[0]",
        ),
        ('{"tokens": [{"sha256": "' + "ab" * 32 + '", "role": "admin", "role": "reader"}]}', "appears twice"),
    ],
)
def test_a_bad_auth_file_is_refused_naming_the_entry_and_field(doc, words):
    with pytest.raises(AuthFileError) as info:
        parse_auth_file(doc, "auth.json")
    assert str(info.value).startswith("auth.json: ") and words in str(info.value)
    assert "s3cret-token" not in str(info.value)  # a token pasted as its hash is not echoed


def test_a_good_auth_file_parses_with_hashes_only():
    grants = parse_auth_file(
        json.dumps({"tokens": [{"sha256": token_sha256("t").upper(), "role": "engine", "deployments": ["a-*", "b"]}]}),
        "f",
    )
    (grant,) = grants.values()
    assert grant.sha256 == token_sha256("t") and grant.role is Role.ENGINE and grant.globs == ("a-*", "b")
    assert grant.sees("a-1") and grant.sees("b") and not grant.sees("b-1") and not grant.sees("A-1")


async def test_a_bad_auth_file_refuses_to_start(serve, tmp_path):
    bad = tmp_path / "auth.json"
    bad.write_text('{"tokens": [{"sha256": "' + "ab" * 32 + '", "role": "engine", "deployments": []}]}')
    with pytest.raises(StartError) as info:
        await serve(auth_file=bad)
    assert info.value.field == "auth_file" and str(bad) in str(info.value)
    with pytest.raises(StartError) as info:
        await serve(auth_file=tmp_path / "missing.json")
    assert "cannot read it" in str(info.value)
    # The --token is one admin token beside the file; the same token in the file too is refused.
    good = write_auth(tmp_path / "good.json", {ADMIN: ("admin", [])})
    with pytest.raises(StartError) as info:
        await serve(auth_file=good, token=ADMIN)
    assert "is the --token / EPLB_TOKEN admin token" in str(info.value)


async def test_the_token_flag_stays_an_admin_token_beside_the_file(serve, connect, tmp_path):
    server = await serve(
        auth_file=write_auth(tmp_path / "a.json", {READER_A: ("reader", ["team-a-*"])}), token="legacy"
    )
    legacy, reader = connect(server, token="legacy"), connect(server, token=READER_A)
    await legacy.stub.CreateDeployment(
        pb.CreateDeploymentRequest(deployment=small_deployment("team-a-1")), metadata=legacy.metadata
    )
    got = await reader.stub.GetPlacement(pb.GetPlacementRequest(deployment="team-a-1"), metadata=reader.metadata)
    assert got.placement.version == 1


async def test_engine_clients_work_with_a_scoped_token(serve, connect, tmp_path):
    """The engine side sends scoped tokens the same way: reports, watches, acks, and
    create_deployment(exist_ok=True) of a deployment an admin made (the engine may not create)."""
    import eplb
    from eplb_engine.aio import AsyncServiceClient
    from eplb_engine.client import ServiceClient
    from eplb_engine.watcher import PlacementWatcher

    server, admin = await tenant_server(serve, connect, tmp_path)
    topo = eplb.Topology(num_layers=4, num_experts=16, num_slots=24, num_gpus=8, num_nodes=2, num_groups=4)
    async with AsyncServiceClient(server.target, token=ENGINE_A, timeout_s=5) as client:
        assert (await client.create_deployment("team-a-1", topo, exist_ok=True)).name == "team-a-1"
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await client.create_deployment("team-a-new", topo, exist_ok=True)
        assert info.value.code() == DENIED  # does not exist: the create's own refusal
        assert (await client.get_placement("team-a-1")).version == 1

    def sync_side() -> tuple[int, bool, str]:
        with ServiceClient(server.target, token=ENGINE_A, timeout_s=5) as c:
            c.create_deployment("team-a-1", topo, exist_ok=True)
            acked = c.ack("team-a-1", 0, 1).ranks_acked
        with PlacementWatcher(server.target, "team-b-1", lambda p: None, token=ENGINE_A) as w:
            w.wait_for(1, timeout_s=5)
            return acked, w.gave_up, w.last_error

    acked, gave_up, last_error = await asyncio.to_thread(sync_side)
    assert acked == 1
    assert gave_up and last_error.startswith("PERMISSION_DENIED")


async def test_a_rebalance_of_an_empty_window_keeps_the_placement(serve, connect):
    server = await serve()
    c = connect(server)
    await c.stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=small_deployment()))
    before = await c.stub.GetDeployment(pb.GetDeploymentRequest(name="d1"))
    # Forced or not, dry or not: refused alike, no candidate planned from zero loads, no plan
    # noted (it answered OK with a candidate rewriting most slots when not forced).
    for force in (True, False):
        for dry_run in (False, True):
            err = await refused(c.stub.Rebalance(pb.RebalanceRequest(deployment="d1", force=force, dry_run=dry_run)))
            assert err.code() == grpc.StatusCode.FAILED_PRECONDITION, (force, dry_run)
            assert "load window of 'd1' is empty" in err.details() and "current placement stays" in err.details()
    got = await c.stub.GetPlacement(pb.GetPlacementRequest(deployment="d1"))
    assert got.placement.version == 1 and got.placement.stats.policy == "initial"
    after = await c.stub.GetDeployment(pb.GetDeploymentRequest(name="d1"))
    assert after.status.last_plan_time == before.status.last_plan_time
    # With load, force publishes.
    await report_some_load(c.stub)
    out = await c.stub.Rebalance(pb.RebalanceRequest(deployment="d1", force=True))
    assert out.published and out.placement.version == 2


async def test_the_metrics_address_is_logged_at_start(serve, caplog):
    caplog.set_level(logging.INFO, logger="eplb_service")
    server = await serve(metrics_port=0)
    lines = [r for r in caplog.records if "/metrics on" in r.getMessage()]
    assert len(lines) == 1
    assert lines[0].getMessage() == f"serving /metrics on http://127.0.0.1:{server.metrics_port}/metrics"
    assert lines[0].metrics_port == server.metrics_port != 0
    assert (await asyncio.to_thread(http_get, lines[0].metrics_port, "/metrics"))[0] == 200


@pytest.mark.slow
def test_eplb_serve_logs_the_metrics_port_and_reloads_the_auth_file_on_sighup(tmp_path):
    auth = write_auth(tmp_path / "auth.json", {ADMIN: ("admin", []), READER_A: ("reader", ["*"])})
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "eplb_tools.cli",
            "serve",
            "--port",
            str(port),
            "--metrics-port",
            "0",
            "--auth-file",
            str(auth),
            "--log-format",
            "json",
        ],
        cwd=ROOT,
        env=dict(os.environ, EPLB_TOKEN=""),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert "listening on 127.0.0.1" in proc.stdout.readline()
        records = []
        while not any("/metrics on" in r["msg"] for r in records):
            records.append(json.loads(proc.stderr.readline()))
        metrics_port = next(r["metrics_port"] for r in records if "metrics_port" in r)
        assert http_get(metrics_port, "/metrics", READER_A)[0] == 200
        write_auth(auth, {ADMIN: ("admin", [])})  # the reader revoked
        proc.send_signal(signal.SIGHUP)
        while not any("reloaded the auth file" in r["msg"] for r in records):
            records.append(json.loads(proc.stderr.readline()))
        assert http_get(metrics_port, "/metrics", READER_A)[0] == 401
        assert http_get(metrics_port, "/metrics", ADMIN)[0] == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    # A bad file at start: exit 2, one line naming the flag, the file and the field.
    auth.write_text('{"tokens": [{"role": "admin"}]}')
    out = subprocess.run(
        [sys.executable, "-m", "eplb_tools.cli", "serve", "--port", "0", "--auth-file", str(auth)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert f"eplb serve: error: --auth-file: {auth}: tokens[0].sha256" in out.stderr


def test_every_rpc_of_the_service_has_a_decided_scope_check():
    """A method added to the proto is admin only until servicer.py checks it and auth.py names it."""
    from eplb_service.auth import HANDLER_CHECKED, ROLE_METHODS

    service = pb.DESCRIPTOR.services_by_name["ExpertLoadBalancerService"]
    assert {f"/{service.full_name}/{m.name}" for m in service.methods} == set(HANDLER_CHECKED)
    assert set().union(*ROLE_METHODS.values()) <= {m.name for m in service.methods}


async def test_a_cancelled_scoped_watch_logs_no_error_and_gives_its_watcher_back(serve, connect, tmp_path, caplog):
    server, admin = await tenant_server(serve, connect, tmp_path)
    caplog.set_level(logging.DEBUG)
    engine = connect(server, token=ENGINE_A)
    watchers = lambda: server.metrics.registry.get_sample_value("eplb_watchers", {"deployment": "team-a-1"})  # noqa: E731
    calls = [
        engine.stub.WatchPlacements(pb.WatchPlacementsRequest(deployment="team-a-1"), metadata=engine.metadata)
        for _ in range(5)
    ]
    for call in calls:
        assert (await asyncio.wait_for(call.read(), 5)).placement.version == 1
    assert watchers() == 5
    for call in calls:
        call.cancel()
    for _ in range(50):
        if watchers() == 0:
            break
        await asyncio.sleep(0.05)
    assert watchers() == 0
    await server.stop(0)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
