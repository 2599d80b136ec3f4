"""``Draining``: how the interceptor's streams end when the server shuts down. Server streams
(watches, health watches) end with UNAVAILABLE at once (:meth:`Draining.end_server_streams`);
client streams (ReportLoad, StreamLoad) between two messages, so what they accepted stays
accepted (:meth:`Draining.end_client_streams`). The client streams' messages are read through
:meth:`Draining.requests`, the one wrapper each message passes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from .decoding import Undecodable
from .errors import ShuttingDown

__all__ = ["Draining"]


class Draining:
    """Ends the streams of one server on shutdown (see the module docstring)."""

    def __init__(self) -> None:
        self._end_server_streams: asyncio.Future | None = None
        self._end_client_streams = False
        self._discard_until = 0.0
        # Tasks of client streams waiting for their next message, and those of them that
        # _wake_waiting woke: a quiet stream (an engine between reports) would otherwise hear of
        # the shutdown only when the server stops at the end of the grace period.
        self._reading: set[asyncio.Task] = set()
        self._woken: set[asyncio.Task] = set()

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
        client resends the rest, with the same seqs, to another instance. Messages the client is
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

    def requests(
        self, requests: AsyncIterator[Any], refuse: Callable[[Undecodable, int], Exception]
    ) -> AsyncIterator[Any]:
        """``requests``, ending with ShuttingDown once client streams are told to end; an
        undecodable message raises ``refuse(message, how many were processed before it)``."""

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
                    raise refuse(request, processed)
                processed += 1
                yield request

        return read()

    @staticmethod
    def _ended(processed: int, dropped: int) -> ShuttingDown:
        return ShuttingDown(
            f"server shutting down: processed the first {processed} messages of this stream, "
            f"not the {dropped} after them; resend those to another instance (same seqs)"
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

    async def until_end(self, aw: Awaitable[Any]) -> Any:
        """``aw``'s result, or ShuttingDown once server streams are told to end."""
        task = asyncio.ensure_future(aw)
        try:
            await asyncio.wait({task, self._server_streams_end()}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not task.done():
                task.cancel()
                await asyncio.wait({task})
        if task.cancelled():
            raise ShuttingDown("server shutting down: reconnect to another instance")
        return task.result()
