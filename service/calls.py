"""The one interceptor every call passes (``ErrorInterceptor``): it turns what a handler raised
into its status (``errors.abort_status``), so servicers never build a status themselves.

It is the one wrapper around each handler and each client stream's messages, and hands the other
jobs to collaborators, one job each: the hooks that see each call end (``call_metrics.CallMetrics``
counts and times calls, ``audit.AuditLog`` writes the audit lines of deployment changes),
``decoding`` (messages that do not parse become INVALID_ARGUMENT) and ``draining.Draining``
(streams end when the server shuts down). One grpc interceptor, not one per job: each would wrap
every handler and every message of the ingest streams again.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Protocol

import grpc

from .decoding import BadMessages, Undecodable, decoding
from .draining import Draining
from .errors import abort_status

__all__ = ["Call", "CallHook", "ErrorInterceptor", "short_name"]

# The logger name operators filter by stays that of before the interceptor had its own module.
log = logging.getLogger("eplb_service.errors")

_CODE_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}

# Bidirectional streams that answer each client message and end between messages on shutdown.
_CLIENT_PACED = frozenset({"/eplb.v1.ExpertLoadBalancerService/StreamLoad"})


def short_name(method: str) -> str:
    """``/eplb.v1.ExpertLoadBalancerService/ReportLoad`` → ``ExpertLoadBalancerService/ReportLoad``."""
    service, _, name = method.rpartition("/")
    return f"{service.rpartition('.')[2]}/{name}"


class Call:
    """One call's bookkeeping, what the hooks see as it ends: its method label, start time, final
    status code, context and request message (None for a client stream)."""

    __slots__ = ("code", "context", "label", "request", "start")

    def __init__(self, label: str, context: grpc.aio.ServicerContext, request: Any = None) -> None:
        self.label = label
        self.context = context
        self.request = request
        self.start = time.perf_counter()
        self.code = "OK"


class CallHook(Protocol):
    """A collaborator that sees calls end: :meth:`bind` gives the function called as each call of
    ``method`` ends (after its status is known), or None for methods it has nothing to do with."""

    def bind(self, method: str, label: str) -> Callable[[Call], None] | None: ...


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Maps exceptions raised by any handler to statuses, in one place; calls ``hooks`` as each
    call ends, in their order; reads client streams through ``draining``.

    Put it first in the server's interceptor list, so it also sees the calls that later
    interceptors (auth) refuse.
    """

    def __init__(
        self,
        hooks: Sequence[CallHook] = (),
        *,
        bad_messages: BadMessages | None = None,
        draining: Draining | None = None,
    ) -> None:
        self.hooks = tuple(hooks)
        self.bad_messages = bad_messages if bad_messages is not None else BadMessages()
        self.draining = draining if draining is not None else Draining()
        # Wrapped handlers per (method, handler): building them on every call costs as much as a
        # small RPC. The handler is kept with its wrapper so its id cannot be reused.
        self._wrapped: dict[tuple[str, int], tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    # shutdown (Draining's)

    def end_server_streams(self) -> None:
        """Ends every open server stream with UNAVAILABLE (:meth:`.Draining.end_server_streams`)."""
        self.draining.end_server_streams()

    def end_client_streams(self, discard_s: float = 0.5) -> None:
        """Ends every client stream between messages (:meth:`.Draining.end_client_streams`)."""
        self.draining.end_client_streams(discard_s)

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
            "request_deserializer": decoding(handler.request_deserializer),
            "response_serializer": handler.response_serializer,
        }
        label = short_name(method)
        finishers = tuple(f for f in (hook.bind(method, label) for hook in self.hooks) if f is not None)
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(self._unary(label, handler.unary_unary, finishers), **kw)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(self._unary(label, handler.stream_unary, finishers, True), **kw)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(self._stream(label, handler.unary_stream, finishers), **kw)
        return grpc.stream_stream_rpc_method_handler(
            self._stream(label, handler.stream_stream, finishers, True, paced=method in _CLIENT_PACED), **kw
        )

    async def _fail(self, call: Call, context: grpc.aio.ServicerContext, exc: BaseException) -> None:
        """Aborts the call with ``exc``'s status (INTERNAL, logged with its traceback, if not ours)."""
        status, ours = abort_status(exc)
        if not ours:
            log.error("unhandled error in %s", call.label, exc_info=exc)
        else:
            # Expected (the client got the reason); the balancer logs lost planning races at INFO.
            log.debug("%s failed: %s: %s", call.label, status.code.name, status.details)
        call.code = status.code.name
        await context.abort_with_status(status)

    @staticmethod
    def _aborted(call: Call, context: grpc.aio.ServicerContext) -> None:
        """The handler aborted the call itself (e.g. auth, health ``Check`` of an unknown service)."""
        code = context.code()
        call.code = code.name if isinstance(code, grpc.StatusCode) else _CODE_NAMES.get(code, "UNKNOWN")

    def _requests(
        self, requests: AsyncIterator[Any], label: str, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Any]:
        """A client stream's messages, read through ``draining`` (the one wrapper per message)."""
        return self.draining.requests(
            requests, lambda request, processed: self.bad_messages.refuse_in_stream(label, request, context, processed)
        )

    def _unary(
        self,
        label: str,
        fn: Callable[..., Awaitable[Any]],
        finishers: tuple[Callable[[Call], None], ...],
        client_stream: bool = False,
    ) -> Callable[..., Awaitable[Any]]:
        async def handle(request: Any, context: grpc.aio.ServicerContext) -> Any:
            call = Call(label, context, None if client_stream else request)
            try:
                if isinstance(request, Undecodable):
                    raise self.bad_messages.refuse(label, request, context)
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
                for finish in finishers:
                    finish(call)

        return handle

    def _stream(
        self,
        label: str,
        fn: Callable[..., Any],
        finishers: tuple[Callable[[Call], None], ...],
        client_stream: bool = False,
        paced: bool = False,
    ) -> Callable[..., AsyncIterator[Any] | Awaitable[None]]:
        # Handlers either yield (async generators) or write to the context and return (the
        # health servicer's Watch); the wrapper keeps the handler's kind.
        generator = inspect.isasyncgenfunction(fn)
        until_end = self.draining.until_end
        # A stream that answers each client message (StreamLoad) ends as a client stream does,
        # between messages (the read raises ShuttingDown): ending it as a server stream would
        # cancel a report mid-way, its ack never sent though it may be counted.
        next_item = anext if paced else (lambda items: until_end(anext(items)))

        async def each(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            call = Call(label, context)
            items = None
            try:
                if isinstance(request, Undecodable):
                    raise self.bad_messages.refuse(label, request, context)
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
                for finish in finishers:
                    finish(call)

        async def written(request: Any, context: grpc.aio.ServicerContext) -> None:
            call = Call(label, context)
            try:
                if isinstance(request, Undecodable):
                    raise self.bad_messages.refuse(label, request, context)
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
                for finish in finishers:
                    finish(call)

        return each if generator else written
