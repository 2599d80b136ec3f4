"""The one interceptor every call passes (``ErrorInterceptor``): it turns what a handler raised
into its status (``errors.abort_status``), so servicers never build a status themselves; and since
it sees every call end, it also counts calls by method and status code, times them, writes the
audit lines of deployment changes, and ends open streams when the server shuts down (see
:meth:`ErrorInterceptor.end_server_streams`).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc

from .clip import cap, clip, plain
from .errors import FieldViolation, InvalidArgument, ShuttingDown, abort_status
from .metrics import Metrics

__all__ = ["ErrorInterceptor", "LogThrottle"]

# The logger names operators filter by stay those of before the interceptor had its own module.
log = logging.getLogger("eplb_service.errors")
audit = logging.getLogger("eplb_service.audit")

_CODE_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}


class LogThrottle:
    """At most one log line per key per ``window_s``: :meth:`admit` says whether to write one
    now and how many it held back since the last. At most ``max_keys`` keys are tracked; more
    share the key ``"other"``, so callers choosing keys cannot grow it."""

    def __init__(self, window_s: float = 60.0, max_keys: int = 256, clock: Callable[[], float] = time.monotonic):
        self.window_s = window_s
        self.max_keys = max_keys
        self._clock = clock
        self._last: dict[Any, list] = {}  # key -> [time of the last line, held back since]

    def admit(self, key: Any) -> int | None:
        """None: hold this line back (counted); else write it, with this many held back before it."""
        now = self._clock()
        if key not in self._last and len(self._last) >= self.max_keys:
            key = "other"
        entry = self._last.get(key)
        if entry is not None and now - entry[0] < self.window_s:
            entry[1] += 1
            return None
        held = 0 if entry is None else entry[1]
        self._last[key] = [now, 0]
        return held


@dataclass(frozen=True)
class Undecodable:
    """A request message whose bytes did not parse (what the interceptor's deserializer hands
    the handler instead of raising: grpc would log a traceback and answer UNKNOWN)."""

    message_type: str
    size: int
    error: str


def _decoding(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    """``deserializer``, returning :class:`Undecodable` for bytes it cannot parse."""
    if deserializer is None:
        return None
    owner = getattr(deserializer, "__self__", None)
    message_type = getattr(getattr(owner, "DESCRIPTOR", None), "full_name", "the request message")

    def decode(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as exc:  # noqa: BLE001  (protobuf's DecodeError, or another deserializer's error)
            return Undecodable(message_type, len(data), cap(f"{type(exc).__name__}: {exc}", 200))

    return decode


# Successful or refused, these are written as one audit line each (logger ``eplb_service.audit``).
_AUDITED = {
    "/eplb.v1.ExpertLoadBalancerService/CreateDeployment": lambda request: request.deployment.name,
    "/eplb.v1.ExpertLoadBalancerService/DeleteDeployment": lambda request: request.name,
}

# Bidirectional streams that answer each client message and end between messages on shutdown.
_CLIENT_PACED = frozenset({"/eplb.v1.ExpertLoadBalancerService/StreamLoad"})


def short_name(method: str) -> str:
    """``/eplb.v1.ExpertLoadBalancerService/ReportLoad`` → ``ExpertLoadBalancerService/ReportLoad``."""
    service, _, name = method.rpartition("/")
    return f"{service.rpartition('.')[2]}/{name}"


class _Call:
    """One call's bookkeeping: its method label, start time and final status code."""

    __slots__ = ("code", "label", "start")

    def __init__(self, label: str) -> None:
        self.label = label
        self.start = time.perf_counter()
        self.code = "OK"


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Maps exceptions raised by any handler to statuses, in one place; counts and times every call.

    Put it first in the server's interceptor list, so it also sees the calls that later
    interceptors (auth) refuse.
    """

    def __init__(self, metrics: Metrics | None = None) -> None:
        self._metrics = metrics
        # Wrapped handlers per (method, handler): building them on every call costs as much as a
        # small RPC. The handler is kept with its wrapper so its id cannot be reused.
        self._wrapped: dict[tuple[str, int], tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}
        # Lines about what callers sent (undecodable messages, refused creates and deletes) are
        # throttled: any caller could otherwise write one a call.
        self._throttle = LogThrottle()
        self._counts: dict[tuple[str, str], Any] = {}
        self._latencies: dict[str, Any] = {}
        self._end_server_streams: asyncio.Future | None = None
        self._end_client_streams = False
        self._discard_until = 0.0
        # Tasks of client streams waiting for their next message, and those of them that
        # _wake_waiting woke: a quiet stream (an engine between reports) would otherwise hear of
        # the shutdown only when the server stops at the end of the grace period.
        self._reading: set[asyncio.Task] = set()
        self._woken: set[asyncio.Task] = set()

    # shutdown

    def _server_streams_end(self) -> asyncio.Future:
        if self._end_server_streams is None:
            self._end_server_streams = asyncio.get_running_loop().create_future()
        return self._end_server_streams

    def end_server_streams(self) -> None:
        """Ends every open server stream (watches, health watches) with UNAVAILABLE, now and from now on."""
        fut = self._server_streams_end()
        if not fut.done():
            fut.set_result(None)

    def end_client_streams(self, discard_s: float = 0.5) -> None:
        """Ends every client stream (ReportLoad) with UNAVAILABLE before it processes another message.

        The message in hand is processed first, so what a stream accepted stays accepted and the
        client resends the rest, with the same seqs, to another replica. Messages the client is
        still sending are read and dropped, for up to ``discard_s``, so the status goes out after
        the client half-closed: grpc-python's asyncio client reports a status that arrives while
        it is still writing as ``INTERNAL: Internal error from Core`` (grpc/grpc#36066). A stream
        still waiting for its next message once ``discard_s`` is up (it sent none meanwhile) is
        ended then, rather than when it sends one or the server stops.
        """
        self._discard_until = time.monotonic() + discard_s
        self._end_client_streams = True
        asyncio.get_running_loop().call_later(discard_s, self._wake_waiting)

    def _wake_waiting(self) -> None:
        """Ends the client streams waiting for a message: their reads are cancelled (read() tells
        this cancel from any other by ``_woken``)."""
        for task in self._reading:
            if not task.done():
                self._woken.add(task)
                task.cancel()

    # interception

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method
        key = (method, id(handler))
        cached = self._wrapped.get(key)
        if cached is None:
            cached = self._wrapped[key] = (handler, self._wrap(method, handler))
        return cached[1]

    def _wrap(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        kw = {
            "request_deserializer": _decoding(handler.request_deserializer),
            "response_serializer": handler.response_serializer,
        }
        label = short_name(method)
        audited = _AUDITED.get(method)
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(self._unary(label, handler.unary_unary, audited), **kw)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(self._unary(label, handler.stream_unary, None, True), **kw)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(self._stream(label, handler.unary_stream), **kw)
        return grpc.stream_stream_rpc_method_handler(
            self._stream(label, handler.stream_stream, True, paced=method in _CLIENT_PACED), **kw
        )

    def _finish(self, call: _Call, context: grpc.aio.ServicerContext, request: Any, audited: Callable | None) -> None:
        if self._metrics is not None:
            # Label children are looked up once: ``labels()`` costs more than the update itself.
            key = (call.label, call.code)
            count = self._counts.get(key)
            if count is None:
                count = self._counts[key] = self._metrics.rpc_requests.labels(*key)
            latency = self._latencies.get(call.label)
            if latency is None:
                latency = self._latencies[call.label] = self._metrics.rpc_latency.labels(call.label)
            count.inc()
            latency.observe(time.perf_counter() - call.start)
        # A refused token is audited by auth (throttled), not once per call here.
        if audited is not None and call.code not in ("UNAUTHENTICATED", "PERMISSION_DENIED"):
            if isinstance(request, Undecodable):
                return  # logged (throttled) where it was refused
            held = 0
            if call.code != "OK":
                # Every change is audited; refused ones (a bad name, an existing deployment) at most
                # one line a minute per method and code, with the count of the others.
                held = self._throttle.admit((call.label, call.code))
                if held is None:
                    return
            name = audited(request)
            shown = clip(name)
            audit.info(
                "audit: %s %s by %s: %s%s",
                call.label.rpartition("/")[2],
                shown,
                context.peer(),
                call.code,
                f" ({held} more like it in the last minute)" if held else "",
                extra={
                    "audit": call.label.rpartition("/")[2],
                    # The name itself when it is a valid one (JSON logs keep it a plain value);
                    # anything else clipped, so no raw control or line-break characters.
                    "deployment": name if plain(name) else shown,
                    "peer": context.peer(),
                    "code": call.code,
                },
            )

    async def _fail(self, call: _Call, context: grpc.aio.ServicerContext, exc: BaseException) -> None:
        """Aborts the call with ``exc``'s status (INTERNAL, logged with its traceback, if not ours)."""
        status, ours = abort_status(exc)
        if not ours:
            log.error("unhandled error in %s", call.label, exc_info=exc)
        else:
            # Expected (the client got the reason); the balancer logs lost planning races at INFO.
            log.debug("%s failed: %s: %s", call.label, status.code.name, status.details)
        call.code = status.code.name
        await context.abort_with_status(status)

    def _aborted(self, call: _Call, context: grpc.aio.ServicerContext) -> None:
        """The handler aborted the call itself (e.g. auth, health ``Check`` of an unknown service)."""
        code = context.code()
        call.code = code.name if isinstance(code, grpc.StatusCode) else _CODE_NAMES.get(code, "UNKNOWN")

    def _undecodable(self, label: str, request: Undecodable, context: grpc.aio.ServicerContext) -> InvalidArgument:
        """The status for a message that did not parse; one log line a minute per method."""
        held = self._throttle.admit((label, "undecodable"))
        if held is not None:
            log.warning(
                "%s: a message of %d bytes from %s is not a valid %s (%s)%s",
                label,
                request.size,
                context.peer(),
                request.message_type,
                request.error,
                f"; {held} more in the last minute" if held else "",
            )
        return InvalidArgument(
            FieldViolation("request", f"{request.size} bytes that do not parse as {request.message_type}")
        )

    def _requests(
        self, requests: AsyncIterator[Any], label: str = "", context: grpc.aio.ServicerContext | None = None
    ) -> AsyncIterator[Any]:
        async def read() -> AsyncIterator[Any]:
            processed = 0
            while True:
                # Checked before each read: the message in hand has been processed by now.
                if self._end_client_streams:
                    dropped = await self._discard(requests)
                    raise self._ended(processed, dropped)
                # Per read: a bidi handler's messages are each read in a task of their own.
                task = asyncio.current_task()
                self._reading.add(task)
                try:
                    request = await anext(requests)
                except StopAsyncIteration:
                    return
                except asyncio.CancelledError:
                    if task not in self._woken:
                        raise
                    self._woken.discard(task)
                    if task.uncancel() > 0:
                        raise  # cancelled by gRPC too (the client went, or the server stops)
                    # Woken by _wake_waiting: the cancelled read closed the request iterator, so
                    # nothing more is read. A message that arrived in that same turn of the loop
                    # is not counted as processed: the client resends it.
                    raise self._ended(processed, 0) from None
                finally:
                    self._reading.discard(task)
                if isinstance(request, Undecodable):
                    exc = self._undecodable(label, request, context)
                    raise InvalidArgument(
                        [
                            FieldViolation(f"message {processed}", exc.violations[0].description),
                            FieldViolation(
                                "stream", f"the {processed} messages before it were processed; resend from it on"
                            ),
                        ]
                    )
                processed += 1
                yield request

        return read()

    @staticmethod
    def _ended(processed: int, dropped: int) -> ShuttingDown:
        return ShuttingDown(
            f"server shutting down: processed the first {processed} messages of this stream, "
            f"not the {dropped} after them; resend those to another replica (same seqs)"
        )

    async def _discard(self, requests: AsyncIterator[Any]) -> int:
        """Reads and drops ``requests`` until the client half-closes or the discard time is up."""
        dropped = 0
        while (left := self._discard_until - time.monotonic()) > 0:
            try:
                await asyncio.wait_for(anext(requests), left)
            except (StopAsyncIteration, TimeoutError):
                break
            dropped += 1
        return dropped

    def _unary(
        self, label: str, fn: Callable[..., Awaitable[Any]], audited: Callable | None, client_stream: bool = False
    ) -> Callable[..., Awaitable[Any]]:
        async def handle(request: Any, context: grpc.aio.ServicerContext) -> Any:
            call = _Call(label)
            try:
                if isinstance(request, Undecodable):
                    raise self._undecodable(label, request, context)
                return await fn(self._requests(request, label, context) if client_stream else request, context)
            except grpc.aio.AbortError:
                self._aborted(call, context)
                raise
            except asyncio.CancelledError:
                call.code = "CANCELLED"
                raise
            except Exception as exc:  # noqa: BLE001  (ours map to their status; others to INTERNAL, logged once)
                await self._fail(call, context, exc)
            finally:
                self._finish(call, context, request, audited)

        return handle

    def _stream(
        self, label: str, fn: Callable[..., Any], client_stream: bool = False, paced: bool = False
    ) -> Callable[..., AsyncIterator[Any] | Awaitable[None]]:
        # Handlers either yield (async generators) or write to the context and return (the
        # health servicer's Watch); the wrapper keeps the handler's kind.
        generator = inspect.isasyncgenfunction(fn)
        # A stream that answers each client message (StreamLoad) ends as a client stream does,
        # between messages (the read raises ShuttingDown): ending it as a server stream would
        # cancel a report mid-way, its ack never sent though it may be counted.
        next_item = anext if paced else (lambda items: until_end(anext(items)))

        async def until_end(aw: Awaitable[Any]) -> Any:
            """``aw``'s result, or ShuttingDown once server streams are told to end."""
            task = asyncio.ensure_future(aw)
            try:
                await asyncio.wait({task, self._server_streams_end()}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                if not task.done():
                    task.cancel()
                    await asyncio.wait({task})
            if task.cancelled():
                raise ShuttingDown("server shutting down: reconnect to another replica")
            return task.result()

        async def each(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            call = _Call(label)
            items = None
            try:
                if isinstance(request, Undecodable):
                    raise self._undecodable(label, request, context)
                items = fn(self._requests(request, label, context) if client_stream else request, context)
                while True:
                    try:
                        item = await next_item(items)
                    except StopAsyncIteration:
                        return
                    yield item
            except grpc.aio.AbortError:
                self._aborted(call, context)
                raise
            except (asyncio.CancelledError, GeneratorExit):  # GeneratorExit: closed while sending
                call.code = "CANCELLED"
                raise
            except Exception as exc:  # noqa: BLE001
                await self._fail(call, context, exc)
            finally:
                if items is not None:
                    # Runs the handler's own clean-up now (e.g. the watcher gauge), not at GC.
                    await items.aclose()
                self._finish(call, context, None, None)

        async def written(request: Any, context: grpc.aio.ServicerContext) -> None:
            call = _Call(label)
            try:
                if isinstance(request, Undecodable):
                    raise self._undecodable(label, request, context)
                await until_end(fn(self._requests(request, label, context) if client_stream else request, context))
            except grpc.aio.AbortError:
                self._aborted(call, context)
                raise
            except asyncio.CancelledError:
                call.code = "CANCELLED"
                raise
            except Exception as exc:  # noqa: BLE001
                await self._fail(call, context, exc)
            finally:
                self._finish(call, context, None, None)

        return each if generator else written
