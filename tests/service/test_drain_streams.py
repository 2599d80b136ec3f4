"""How ``ErrorInterceptor.end_client_streams`` (its ``Draining``) ends client streams, on a real gRPC server on
loopback with real channels: a stream still writing is read to its half-close and told how many
of its messages were processed and how many dropped; a stream that sends nothing for the discard
time is ended then; a bidi stream's reads (each in a task of its own) are ended the same way.
The handlers are plain ones: the interceptor is what is under test."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator

import grpc
import pytest

from eplb_service.calls import ErrorInterceptor

DISCARD_S = 0.5


class Server:
    """A gRPC server with the interceptor and two handlers: ``/t.S/Count`` (client stream,
    answers how many messages it read) and ``/t.S/Echo`` (bidi)."""

    def __init__(self) -> None:
        self.calls = ErrorInterceptor()
        self.read: list[bytes] = []

    async def _count(self, requests: AsyncIterator[bytes], context: object) -> bytes:
        async for r in requests:
            self.read.append(r)
        return str(len(self.read)).encode()

    async def _echo(self, requests: AsyncIterator[bytes], context: object) -> AsyncIterator[bytes]:
        async for r in requests:
            self.read.append(r)
            yield r

    async def __aenter__(self) -> grpc.aio.Channel:
        handlers = {
            "Count": grpc.stream_unary_rpc_method_handler(self._count),
            "Echo": grpc.stream_stream_rpc_method_handler(self._echo),
        }
        self.server = grpc.aio.server(interceptors=[self.calls])
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.S", handlers),))
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        return self.channel

    async def __aexit__(self, *exc: object) -> None:
        await self.channel.close()
        await self.server.stop(0)


def _counts(details: str) -> tuple[int, int]:
    m = re.search(r"processed the first (\d+) messages of this stream, not the (\d+) after them", details)
    assert m and "resend those to another instance (same seqs)" in details, details
    return int(m[1]), int(m[2])


async def test_a_stream_still_writing_is_read_to_its_end_and_told_what_was_dropped():
    server = Server()
    async with server as channel:

        async def writes() -> AsyncIterator[bytes]:
            for _ in range(30):  # over 0.3 s, well inside the discard time
                yield b"x" * 1000
                await asyncio.sleep(0.01)

        async def end_soon() -> None:
            await asyncio.sleep(0.1)
            # A discard time far above the writes' 0.3 s: it ends at the half-close, not at this.
            server.calls.end_client_streams(discard_s=5.0)

        ender = asyncio.create_task(end_soon())
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await channel.stream_unary("/t.S/Count")(writes())
        await ender
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    processed, dropped = _counts(err.value.details())
    # Every message was either processed (read by the handler) or read and dropped, and some
    # were dropped: the status came after the client half-closed, not at end_client_streams.
    assert processed == len(server.read) and processed + dropped == 30 and dropped > 0


async def test_a_quiet_stream_is_ended_once_the_discard_time_is_up():
    server = Server()
    async with server as channel:
        quiet = asyncio.Event()

        async def three_then_quiet() -> AsyncIterator[bytes]:
            for _ in range(3):
                yield b"x"
            quiet.set()
            await asyncio.Event().wait()  # never writes again, never half-closes

        call = channel.stream_unary("/t.S/Count")(three_then_quiet())
        await quiet.wait()
        await asyncio.sleep(0.1)  # the three are read; the handler waits for a fourth
        ended_at = time.monotonic()
        server.calls.end_client_streams(discard_s=DISCARD_S)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await asyncio.wait_for(call, DISCARD_S + 5)
        took = time.monotonic() - ended_at
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert _counts(err.value.details()) == (3, 0)
    # Not before the discard time (a message sent in it would have been counted as dropped).
    assert took >= DISCARD_S - 0.05, took
    assert not server.calls.draining._reading and not server.calls.draining._woken  # nothing left behind


async def test_a_quiet_bidi_stream_is_ended_too():
    server = Server()
    async with server as channel:
        call = channel.stream_stream("/t.S/Echo")()
        for _ in range(3):  # each message is read in a new task of the interceptor's
            await call.write(b"x")
            assert await call.read() == b"x"
        await asyncio.sleep(0.05)
        server.calls.end_client_streams(discard_s=0.1)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await asyncio.wait_for(call.read(), 5)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert _counts(err.value.details()) == (3, 0)
