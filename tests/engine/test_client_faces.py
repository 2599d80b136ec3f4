"""The sync and the asyncio face of the engine client agree: the same calls and the same
failures, run through both against the same real service, give the same results and errors
(``ServiceClient`` and ``AsyncServiceClient`` run one implementation, ``client.Calls``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import grpc
import numpy as np
import pytest
from svc_thread import ServerThread, free_port

import eplb
from eplb_engine.aio import AsyncServiceClient
from eplb_engine.client import ServiceClient, report_request

TOPO = eplb.Topology(num_layers=4, num_experts=16, num_slots=24, num_gpus=8, num_nodes=2, num_groups=4)
LOADS = np.broadcast_to((np.arange(16) % 7 + 1) * 10, (4, 16)).astype(np.int32)
REPORT = [report_request("d1", 0, seq, LOADS) for seq in (1, 2)]


class AsyncFace:
    """``AsyncServiceClient`` called like ``ServiceClient``: each coroutine run on one loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, *args: object, **kw: object) -> None:
        self.loop = loop
        self.client = loop.run_until_complete(self._make(*args, **kw))

    @staticmethod
    async def _make(*args: object, **kw: object) -> AsyncServiceClient:
        return AsyncServiceClient(*args, **kw)  # its channels belong to the running loop

    def __getattr__(self, name: str) -> Callable[..., object]:
        method = getattr(self.client, name)
        if name == "watch":
            return lambda *a, **k: self._first(method(*a, **k))
        return lambda *a, **k: self.loop.run_until_complete(method(*a, **k))

    def _first(self, stream: object) -> object:
        async def first() -> object:
            try:
                return await asyncio.wait_for(anext(stream), 10)
            finally:
                await stream.aclose()

        return self.loop.run_until_complete(first())

    @property
    def endpoints(self) -> object:
        return self.client.endpoints

    def close(self) -> None:
        self.loop.run_until_complete(self.client.close())


class SyncFace:
    """``ServiceClient``, with ``watch`` giving its first placement as ``AsyncFace`` does."""

    def __init__(self, *args: object, **kw: object) -> None:
        self.client = ServiceClient(*args, **kw)

    def __getattr__(self, name: str) -> Callable[..., object]:
        method = getattr(self.client, name)
        if name == "watch":

            def first(*a: object, **k: object) -> object:
                stream = method(*a, **k)
                try:
                    return next(stream)
                finally:
                    stream.close()

            return first
        return method

    @property
    def endpoints(self) -> object:
        return self.client.endpoints

    def close(self) -> None:
        self.client.close()


def outcome(fn: Callable[[], object]) -> tuple:
    """What a call came to: ("ok", value) or the error's kind, status code and message."""
    try:
        return ("ok", fn())
    except grpc.RpcError as exc:
        return ("rpc", exc.code(), exc.details())
    except ValueError as exc:
        return ("ValueError", str(exc))


# (name, call): the calls in order on one deployment "d1", the service's state carried along.
CALLS: list[tuple[str, Callable[[object], object]]] = [
    ("healthy", lambda c: c.healthy()),
    (
        "create",
        lambda c: (lambda d: (d.name, d.version, d.window.sliding.duration.seconds))(
            c.create_deployment("d1", TOPO, window_s=30)
        ),
    ),
    ("create again: ALREADY_EXISTS", lambda c: c.create_deployment("d1", TOPO)),
    ("create exist_ok", lambda c: c.create_deployment("d1", TOPO, exist_ok=True).name),
    ("create exist_ok, other topology", lambda c: c.create_deployment("d1", TOPO.with_layers(2), exist_ok=True)),
    ("bad option, before any call", lambda c: c.create_deployment("d2", TOPO, tolerance=-1)),
    ("unknown deployment: NOT_FOUND", lambda c: c.get_deployment("nope")),
    ("topology", lambda c: c.topology("d1")),
    ("placement", lambda c: (lambda p: (p.version, p.placement.phy2log.tolist()))(c.get_placement("d1"))),
    ("unknown version", lambda c: c.get_placement("d1", version=7)),
    ("rebalance an empty window", lambda c: c.rebalance("d1", force=True)),
    ("report", lambda c: (lambda r: (r.accepted, r.duplicates))(c.report(REPORT))),
    ("report again: duplicates", lambda c: (lambda r: (r.accepted, r.duplicates))(c.report(REPORT))),
    (
        "dry run",
        lambda c: (lambda r: (r.published, r.window_tokens, r.window_reports))(c.rebalance("d1", dry_run=True)),
    ),
    (
        "rebalance",
        lambda c: (lambda r: (r.published, r.placement.version, r.placement.stats.moves))(
            c.rebalance("d1", force=True)
        ),
    ),
    ("ack", lambda c: (lambda r: (r.ranks_acked, r.aborted))(c.ack("d1", 0, 2))),
    ("ack an unknown state", lambda c: c.ack("d1", 0, 2, "done")),
    ("ack an unknown version", lambda c: c.ack("d1", 0, 99)),
    ("watch", lambda c: (lambda p: (p.version, p.placement.phy2log.tolist()))(c.watch("d1"))),
    ("watch, wire messages", lambda c: (lambda m: (type(m).__name__, m.version))(c.watch("d1", decode=False))),
    ("watch an unknown deployment", lambda c: c.watch("nope")),
    ("delete", lambda c: c.delete_deployment("d1")),
    ("deleted: NOT_FOUND", lambda c: c.get_deployment("d1")),
]


@pytest.fixture(scope="module")
def server():
    s = ServerThread().start()
    yield s
    s.stop()


@pytest.fixture
def loop():
    out = asyncio.new_event_loop()
    yield out
    out.close()


def run_calls(face: object) -> list[tuple]:
    try:
        return [outcome(lambda: call(face)) for _, call in CALLS]
    finally:
        face.close()


def test_both_faces_give_the_same_results_and_errors_for_the_same_calls(server, loop):
    # One after the other on one service; each ends by deleting "d1", so the next starts alike.
    sync = run_calls(SyncFace(server.address))
    aio = run_calls(AsyncFace(loop, server.address))
    for (name, _), s, a in zip(CALLS, sync, aio):
        assert s == a, f"{name}: sync {s} != asyncio {a}"
    by_name = dict(zip((n for n, _ in CALLS), sync))
    # The table checks something: the expected outcomes of a few calls.
    assert by_name["create"] == ("ok", ("d1", 1, 30))
    assert by_name["create again: ALREADY_EXISTS"][:2] == ("rpc", grpc.StatusCode.ALREADY_EXISTS)
    assert by_name["create exist_ok, other topology"][0] == "ValueError"
    assert by_name["bad option, before any call"] == (
        "ValueError",
        "tolerance must be a finite number >= 0 (a fraction, 0.01 = 1 %) or None (the service's default, 0.01), got -1",
    )
    assert by_name["rebalance an empty window"][:2] == ("rpc", grpc.StatusCode.FAILED_PRECONDITION)
    assert by_name["report again: duplicates"] == ("ok", (0, 2))
    assert by_name["rebalance"][1][:2] == (True, 2)
    assert by_name["ack an unknown state"] == ("ValueError", "state 'done' is not one of prepared, switched, failed")
    assert by_name["watch"][1][0] == 2 and by_name["watch, wire messages"] == ("ok", ("Placement", 2))
    assert by_name["watch an unknown deployment"][:2] == ("rpc", grpc.StatusCode.NOT_FOUND)
    assert by_name["deleted: NOT_FOUND"][:2] == ("rpc", grpc.StatusCode.NOT_FOUND)


def faces(loop: asyncio.AbstractEventLoop) -> list[tuple[str, Callable[..., object]]]:
    return [("sync", SyncFace), ("asyncio", lambda *a, **k: AsyncFace(loop, *a, **k))]


def test_both_faces_fail_over_to_the_address_that_answers_by_the_same_rule(server, loop):
    dead = f"127.0.0.1:{free_port()}"
    seen = []
    for _, make in faces(loop):
        face = make([dead, server.address], timeout_s=10)
        try:
            got = outcome(lambda: face.get_deployment("nope"))  # NOT_FOUND from the second address
            seen.append((got[:2], face.endpoints.address, face.endpoints.failovers))
        finally:
            face.close()
    assert seen[0] == seen[1] == (("rpc", grpc.StatusCode.NOT_FOUND), server.address, 1)


def test_both_faces_retry_an_unreachable_service_until_the_deadline_and_no_longer(loop):
    dead = f"127.0.0.1:{free_port()}"
    for name, make in faces(loop):
        face = make([dead], timeout_s=0.6)
        try:
            start = time.monotonic()
            got = outcome(lambda: face.get_deployment("d1"))
            took = time.monotonic() - start
            assert got[0] == "rpc" and got[1] in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED), name
            assert 0.5 <= took < 3.0, (name, took)
            assert face.endpoints.failovers >= 2, name  # retried, moving on after each failure
            assert not face.healthy(timeout_s=0.3), name
        finally:
            face.close()


def test_both_faces_give_up_at_once_on_a_refused_token(loop):
    s = ServerThread(token="right").start()
    try:
        seen = []
        for name, make in faces(loop):
            face = make(s.address, token="wrong", timeout_s=10)
            try:
                start = time.monotonic()
                got = outcome(lambda: face.get_deployment("d1"))
                seen.append((got, face.endpoints.failovers))
                assert time.monotonic() - start < 2, name  # not retried until the deadline
            finally:
                face.close()
        assert seen[0] == seen[1] and seen[0][0][:2] == ("rpc", grpc.StatusCode.UNAUTHENTICATED)
        assert seen[0][1] == 0
    finally:
        s.stop()


def test_without_a_deadline_both_faces_make_one_attempt_and_raise_its_failure(loop):
    dead = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]
    seen = []
    for _, make in faces(loop):
        face = make(dead, timeout_s=None)
        try:
            start = time.monotonic()
            got = outcome(lambda: face.get_deployment("d1"))
            seen.append((got[:2], face.endpoints.failovers, face.endpoints.address))
            assert time.monotonic() - start < 2
        finally:
            face.close()
    assert seen[0] == seen[1] == (("rpc", grpc.StatusCode.UNAVAILABLE), 0, dead[0])
