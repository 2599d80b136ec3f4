"""``Batcher``: concurrent calls coalesced into one (a deployment's reports into one store call)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

__all__ = ["Batcher"]


class Batcher:
    """Coalesces concurrent calls into one: while a call is in flight, new items queue for the next."""

    def __init__(self, fn: Callable[[list], Awaitable[list]]) -> None:
        self._fn = fn
        self._pending: list[tuple[object, asyncio.Future]] = []
        self._running = False

    async def submit(self, item: object) -> object:
        fut = asyncio.get_running_loop().create_future()
        self._pending.append((item, fut))
        if not self._running:
            self._running = True
            asyncio.create_task(self._drain())
        return await fut

    async def _drain(self) -> None:
        try:
            while self._pending:
                batch, self._pending = self._pending, []
                try:
                    results = await self._fn([item for item, _ in batch])
                except Exception as exc:  # noqa: BLE001  (handed to every waiter)
                    for _, fut in batch:
                        if not fut.done():
                            fut.set_exception(exc)
                    continue
                for (_, fut), result in zip(batch, results):
                    if not fut.done():
                        fut.set_result(result)
        finally:
            self._running = False
