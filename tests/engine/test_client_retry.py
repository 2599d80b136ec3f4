"""Which failures the engine client retries: by what the status means, not by its code alone.

Each test serves a tiny ``ExpertLoadBalancerService`` on 127.0.0.1 whose ``GetDeployment`` (and
``ReportLoad``) fails as scripted, and calls it through a real channel with both faces.
"""

from __future__ import annotations

import time
from concurrent import futures
from dataclasses import dataclass

import grpc
import numpy as np
import pytest

import eplb
from eplb_engine.aio import AsyncServiceClient
from eplb_engine.client import PUSHBACK_KEY, ServiceClient, transient
from eplb_engine.reporter import LoadReporter
from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb
from eplb_wire._gen.eplb.v1 import balancer_pb2_grpc as pb_grpc

# Long enough that a failure retried until the deadline could not pass for one attempt.
DEADLINE_S = 3.0


@dataclass(frozen=True)
class Fail:
    """One scripted failure: its code, details and ``grpc-retry-pushback-ms`` trailer (None: none)."""

    code: grpc.StatusCode
    details: str = "scripted failure"
    pushback_ms: str | None = None


class Scripted(pb_grpc.ExpertLoadBalancerServiceServicer):
    """Fails each call with the next of ``script`` (the last one again once it runs out; None:
    answers), and counts the calls."""

    def __init__(self, script: list[Fail | None]) -> None:
        self.script = script
        self.calls = 0

    def _next(self, context: grpc.ServicerContext) -> None:
        fail = self.script[min(self.calls, len(self.script) - 1)]
        self.calls += 1
        if fail is None:
            return
        if fail.pushback_ms is not None:
            context.set_trailing_metadata(((PUSHBACK_KEY, fail.pushback_ms),))
        context.abort(fail.code, fail.details)

    def GetDeployment(
        self, request: pb.GetDeploymentRequest, context: grpc.ServicerContext
    ) -> pb.GetDeploymentResponse:
        self._next(context)
        return pb.GetDeploymentResponse(deployment=pb.Deployment(name=request.name))

    def ReportLoad(self, request_iterator, context: grpc.ServicerContext) -> pb.ReportLoadResponse:
        accepted = sum(1 for _ in request_iterator)
        self._next(context)
        return pb.ReportLoadResponse(accepted=accepted)

    def StreamLoad(self, request_iterator, context: grpc.ServicerContext):
        for _ in request_iterator:
            self._next(context)
            yield pb.ReportLoadAck(accepted=True)


class Older(Scripted):
    """A service from before StreamLoad: it answers UNIMPLEMENTED (the generated base's)."""

    StreamLoad = pb_grpc.ExpertLoadBalancerServiceServicer.StreamLoad


@pytest.fixture
def serve():
    """``serve(script)``: the address of a server running ``Scripted(script)``, and the servicer."""
    servers: list[grpc.Server] = []

    def start(script: list[Fail | None], kind: type[Scripted] = Scripted) -> tuple[str, Scripted]:
        servicer = kind(script)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        pb_grpc.add_ExpertLoadBalancerServiceServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        return f"127.0.0.1:{port}", servicer

    yield start
    for server in servers:
        server.stop(None)


def get(address: str) -> tuple[grpc.StatusCode | None, float]:
    """``GetDeployment`` through the sync face: the failure's code (None: answered) and the seconds it took."""
    start = time.monotonic()
    with ServiceClient(address, timeout_s=DEADLINE_S) as client:
        try:
            client.get_deployment("d1")
        except grpc.RpcError as exc:
            return exc.code(), time.monotonic() - start
    return None, time.monotonic() - start


async def aget(address: str) -> tuple[grpc.StatusCode | None, float]:
    """``get`` through the asyncio face."""
    start = time.monotonic()
    async with AsyncServiceClient(address, timeout_s=DEADLINE_S) as client:
        try:
            await client.get_deployment("d1")
        except grpc.RpcError as exc:
            return exc.code(), time.monotonic() - start
    return None, time.monotonic() - start


@pytest.mark.parametrize("code", [grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN])
def test_a_server_failure_is_raised_after_one_attempt(serve, code):
    address, servicer = serve([Fail(code, "internal error: KeyError")])
    failed, took = get(address)
    assert (failed, servicer.calls) == (code, 1)
    assert took < DEADLINE_S / 2


async def test_a_server_failure_is_raised_after_one_attempt_by_the_asyncio_face(serve):
    address, servicer = serve([Fail(grpc.StatusCode.INTERNAL, "internal error: KeyError")])
    failed, took = await aget(address)
    assert (failed, servicer.calls) == (grpc.StatusCode.INTERNAL, 1)
    assert took < DEADLINE_S / 2


@pytest.mark.parametrize(
    "fail",
    [
        Fail(grpc.StatusCode.UNAVAILABLE),
        Fail(grpc.StatusCode.DEADLINE_EXCEEDED),
        Fail(grpc.StatusCode.INTERNAL, "Received RST_STREAM with error code 2"),
        Fail(grpc.StatusCode.INTERNAL, "Internal error from Core"),
        Fail(grpc.StatusCode.UNKNOWN, "Stream removed"),
    ],
    ids=["unavailable", "deadline", "rst-stream", "aio-core", "stream-removed"],
)
def test_a_transient_failure_then_an_answer_succeeds(serve, fail):
    address, servicer = serve([fail, None])
    assert get(address)[0] is None
    assert servicer.calls == 2


async def test_unavailable_then_an_answer_succeeds_on_the_asyncio_face(serve):
    address, servicer = serve([Fail(grpc.StatusCode.UNAVAILABLE), None])
    assert (await aget(address))[0] is None
    assert servicer.calls == 2


def test_resource_exhausted_without_a_hint_is_not_retried(serve):
    address, servicer = serve([Fail(grpc.StatusCode.RESOURCE_EXHAUSTED, "1000 deployments (at most 1000)"), None])
    assert get(address)[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert servicer.calls == 1


def test_resource_exhausted_with_a_pushback_is_retried_after_it(serve):
    address, servicer = serve([Fail(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full", pushback_ms="400"), None])
    failed, took = get(address)
    assert (failed, servicer.calls) == (None, 2)
    assert took >= 0.4  # the backoff alone waits at most 50 ms before the second attempt


async def test_resource_exhausted_with_a_pushback_is_retried_by_the_asyncio_face(serve):
    address, servicer = serve([Fail(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full", pushback_ms="400"), None])
    failed, took = await aget(address)
    assert (failed, servicer.calls) == (None, 2)
    assert took >= 0.4


def test_a_pushback_past_the_deadline_is_not_waited_for(serve):
    address, servicer = serve([Fail(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full", pushback_ms="60000"), None])
    failed, took = get(address)
    assert (failed, servicer.calls) == (grpc.StatusCode.RESOURCE_EXHAUSTED, 1)
    assert took < DEADLINE_S / 2


@pytest.mark.parametrize("pushback_ms", ["-1", "soon"])
def test_a_negative_or_unreadable_pushback_stops_even_an_unavailable_retry(serve, pushback_ms):
    address, servicer = serve([Fail(grpc.StatusCode.UNAVAILABLE, pushback_ms=pushback_ms), None])
    assert get(address)[0] == grpc.StatusCode.UNAVAILABLE
    assert servicer.calls == 1


@pytest.mark.parametrize(
    ("code", "details", "expected"),
    [
        (grpc.StatusCode.UNAVAILABLE, "", True),
        (grpc.StatusCode.ABORTED, "another replica published first", True),
        (grpc.StatusCode.INTERNAL, "internal error: KeyError", False),
        (grpc.StatusCode.INTERNAL, "Received RST_STREAM with error code 0", True),
        (grpc.StatusCode.UNKNOWN, "Exception calling application: boom", False),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, "too big", False),
        (grpc.StatusCode.INVALID_ARGUMENT, "Internal error from Core", False),
        (grpc.StatusCode.NOT_FOUND, "", False),
    ],
)
def test_transient_reads_the_code_and_the_details(code, details, expected):
    error = grpc.RpcError()
    error.code, error.details, error.trailing_metadata = (lambda: code), (lambda: details), (lambda: ())
    assert transient(error) is expected


def test_the_reporter_drops_a_report_the_server_fails_on_instead_of_retrying_it(serve):
    address, servicer = serve([Fail(grpc.StatusCode.INTERNAL, "internal error: KeyError")])
    topology = eplb.Topology(num_layers=2, num_experts=4, num_slots=4, num_gpus=2)
    with LoadReporter(address, "d1", 0, topology, interval_s=0.05) as reporter:
        reporter.add(np.ones((2, 4), dtype=np.int32))
        assert reporter.flush(timeout_s=DEADLINE_S)
        stats = reporter.stats()
    # Sent once: refused, not retried until the deadline.
    assert (servicer.calls, stats.rejected, stats.sent) == (1, 1, 0)


def test_the_reporter_sends_each_report_on_its_own_call_to_a_service_without_stream_load(serve):
    address, servicer = serve([None], kind=Older)
    topology = eplb.Topology(num_layers=2, num_experts=4, num_slots=4, num_gpus=2)
    with LoadReporter(address, "d1", 0, topology, interval_s=0.05) as reporter:
        for _ in range(3):
            reporter.add(np.ones((2, 4), dtype=np.int32))
            assert reporter.flush(timeout_s=DEADLINE_S)
        stats = reporter.stats()
    # StreamLoad is UNIMPLEMENTED (not counted: the generated handler answers it), then every
    # report goes on a ReportLoad call of its own and is counted.
    assert (servicer.calls, stats.sent, stats.accepted, stats.rejected) == (3, 3, 3, 0)


class LosesTheFirstAnswer(pb_grpc.ExpertLoadBalancerServiceServicer):
    """Creates the deployment on the first CreateDeployment but answers UNAVAILABLE (the answer
    lost), then ALREADY_EXISTS, as the real service would; GetDeployment returns what it stored,
    defaults filled in as the service fills them."""

    def __init__(self) -> None:
        self.stored: pb.Deployment | None = None
        self.creates = 0

    def CreateDeployment(self, request, context):
        self.creates += 1
        if self.stored is not None:
            context.abort(grpc.StatusCode.ALREADY_EXISTS, f"deployment {request.deployment.name!r} already exists")
        self.stored = pb.Deployment()
        self.stored.CopyFrom(request.deployment)
        self.stored.window.sliding.buckets = self.stored.window.sliding.buckets or 10  # a default the service fills
        context.abort(grpc.StatusCode.UNAVAILABLE, "connection reset (the answer was lost)")

    def GetDeployment(self, request, context):
        if self.stored is None or request.name != self.stored.name:
            context.abort(grpc.StatusCode.NOT_FOUND, f"deployment {request.name!r} not found")
        return pb.GetDeploymentResponse(deployment=self.stored)


@pytest.fixture
def losing():
    servicer = LosesTheFirstAnswer()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_ExpertLoadBalancerServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}", servicer
    server.stop(None)


def test_a_create_whose_answer_was_lost_returns_the_deployment_it_created(losing):
    address, servicer = losing
    topology = eplb.Topology(num_layers=2, num_experts=4, num_slots=4, num_gpus=2)
    with ServiceClient(address, timeout_s=DEADLINE_S) as client:
        created = client.create_deployment("d1", topology, window_s=30.0)
        # Another create of a different deployment under the same name is still refused.
        with pytest.raises(grpc.RpcError) as err:
            client.create_deployment("d1", topology, window_s=60.0)
    assert created.name == "d1" and created.window.sliding.buckets == 10 and servicer.creates == 3
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
