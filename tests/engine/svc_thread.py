"""A real balancer service on 127.0.0.1 in a background thread, for the engine client's tests.

The engine client is synchronous, so the server runs on its own event loop in a thread that a
test can stop and start again on the same port (a restart) without blocking the test's thread.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from dataclasses import replace

import grpc
import numpy as np

from eplb_service.balancer import BalancerConfig
from eplb_service.server import RunningServer, ServerConfig, start_server
from eplb_tools.ports import free_port
from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb
from eplb_wire._gen.eplb.v1 import balancer_pb2_grpc as pb_grpc
from eplb_wire.arrays import encode

REDIS_URL = "redis://127.0.0.1:6379/0"
# Fast timings so tests see flushes and triggers within a second.
FAST = BalancerConfig(lease_s=2.0, flush_s=0.1, tick_s=0.1, refresh_s=0.3)


def report_some_load(address: str, deployment: str = "d1", shape: tuple[int, int] = (4, 16), rank: int = 0) -> None:
    """One skewed ``[L, E]`` report from ``rank``, so a forced rebalance has load to plan (on an
    empty window the service refuses it with FAILED_PRECONDITION)."""
    counts = np.broadcast_to((np.arange(shape[1], dtype=np.int32) % 7 + 1) * 10, shape).copy()
    request = pb.ReportLoadRequest(deployment=deployment, rank=rank, seq=time.time_ns() // 1000, logical=encode(counts))
    with grpc.insecure_channel(address) as chan:
        pb_grpc.ExpertLoadBalancerServiceStub(chan).ReportLoad(iter([request]), timeout=10)


class ServerThread:
    """``start()`` serves on ``port`` (0: a free one, kept for restarts); ``stop()`` stops it."""

    def __init__(self, port: int = 0, **config: object) -> None:
        self.port = port or free_port()
        self.config = config
        self.loop: asyncio.AbstractEventLoop | None = None
        self.server: RunningServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> ServerThread:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        balancer = replace(FAST, replica_id=uuid.uuid4().hex[:8])
        config = replace(ServerConfig(port=self.port, balancer=balancer), **self.config)
        self.server = asyncio.run_coroutine_threadsafe(start_server(config), self.loop).result(10)
        return self

    def run(self, coro: object, timeout: float = 10.0) -> object:
        """Runs ``coro`` on the server's loop (e.g. a balancer call) and returns its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self, grace_s: float = 0.0) -> None:
        """Stops serving: calls in flight get ``grace_s`` to finish, then the replica flushes its
        windows and closes its store.

        The gRPC server is stopped before the balancer: ``RunningServer.stop`` flushes first and
        then lets calls in flight go on for the grace period, so reports accepted in that period
        are marked seen but never flushed (lost); draining first keeps this harness's restarts
        exact, which is what the client's tests measure.
        """
        if self.server is None:
            return
        self.run(self.server.server.stop(grace_s))
        self.run(self.server.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()
        self.server = None
