"""``ReportStream``: one long-lived ``StreamLoad`` call that answers each report as it is counted.

A report sent on its own ``ReportLoad`` call costs the service a whole RPC (a new HTTP/2
stream, its handler, its status: most of what a report costs it, docs/service.md); a stream
kept open costs one message a report. ``send`` writes one report and waits for its ack, so a
caller (``LoadReporter``'s thread, ``NodeAgent``'s sender) keeps its reports until each is
known counted, as before.

A stream that breaks, or whose ack does not come within ``timeout_s``, is dropped and the
error raised (a ``grpc.RpcError``; a missing ack reads as ``DEADLINE_EXCEEDED``, a transient
code); the caller keeps the report and the next ``send`` opens a new stream, maybe at another
address: the service drops a ``(rank, seq)`` it has counted, so a report whose ack was lost
counts once. A service without ``StreamLoad`` (UNIMPLEMENTED: older than this client) is sent
each report on its own ``ReportLoad`` call from then on.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence

import grpc

from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb
from eplb_wire._gen.eplb.v1 import balancer_pb2_grpc as pb_grpc

from .client import Endpoints

__all__ = ["AckTimeout", "ReportStream"]

_END = object()  # ends the request iterator: the stream half-closes


class AckTimeout(grpc.RpcError):
    """No ack came (within the timeout, or before the stream ended): the stream was dropped.
    Reads as ``DEADLINE_EXCEEDED``, a transient code: the report is sent again."""

    def __init__(self, details: str) -> None:
        super().__init__(details)
        self._details = details

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.DEADLINE_EXCEEDED

    def details(self) -> str:
        return self._details


class _Open:
    """One ``StreamLoad`` call, its requests fed from a queue and its acks read by a thread."""

    def __init__(self, stub: pb_grpc.ExpertLoadBalancerServiceStub, metadata: Sequence[tuple[str, str]]) -> None:
        self.stub = stub
        self._requests: queue.SimpleQueue[object] = queue.SimpleQueue()
        self.acks: queue.SimpleQueue[pb.ReportLoadAck | grpc.RpcError | None] = queue.SimpleQueue()
        # No deadline: the stream lives as long as it answers (each ack is timed instead).
        self._call = stub.StreamLoad(iter(self._requests.get, _END), metadata=metadata)
        threading.Thread(target=self._read, name="eplb-report-acks", daemon=True).start()

    def _read(self) -> None:
        try:
            for ack in self._call:
                self.acks.put(ack)
        except grpc.RpcError as exc:
            self.acks.put(exc)
            return
        self.acks.put(None)  # ended with OK: only after our half-close

    def write(self, request: pb.ReportLoadRequest) -> None:
        self._requests.put(request)

    def close(self) -> None:
        self._requests.put(_END)
        self._call.cancel()


class ReportStream:
    """Sends reports one at a time on a kept-open ``StreamLoad`` stream of ``endpoints``'
    current address; thread-compatible (one sender at a time)."""

    def __init__(self, endpoints: Endpoints, timeout_s: float = 10.0) -> None:
        self.endpoints = endpoints
        self.timeout_s = timeout_s
        self.stub: pb_grpc.ExpertLoadBalancerServiceStub | None = None  # of the last send
        self._open: _Open | None = None
        self._unary = False  # the service has no StreamLoad: one ReportLoad call a report

    def send(self, request: pb.ReportLoadRequest) -> bool:
        """``request`` counted (True) or a duplicate (False); a ``grpc.RpcError`` otherwise, the
        stream then closed (the next ``send`` opens another; after a transient error the
        caller may ``endpoints.failover(stream.stub)`` first)."""
        self.stub = self.endpoints.stub()
        if self._unary:
            return self._send_unary(request)
        if self._open is None or self._open.stub is not self.stub:
            self.close()
            self._open = _Open(self.stub, self.endpoints.metadata)
        stream = self._open
        stream.write(request)
        try:
            answer = stream.acks.get(timeout=self.timeout_s)
        except queue.Empty:
            self.close()
            raise AckTimeout(f"no answer to a report within {self.timeout_s:g}s") from None
        if isinstance(answer, pb.ReportLoadAck):
            return answer.accepted
        self.close()
        if answer is None:
            raise AckTimeout("the stream ended before it answered the report")
        if answer.code() == grpc.StatusCode.UNIMPLEMENTED:
            self._unary = True
            return self._send_unary(request)
        raise answer

    def _send_unary(self, request: pb.ReportLoadRequest) -> bool:
        assert self.stub is not None
        response = self.stub.ReportLoad(iter([request]), timeout=self.timeout_s, metadata=self.endpoints.metadata)
        return response.accepted > 0

    def close(self) -> None:
        """Ends the open stream, if any (a report waiting for its ack is then not known counted)."""
        if self._open is not None:
            self._open.close()
            self._open = None
