"""The store's Lua scripts: ``scripts/<name>.lua`` (package data), each opening with the KEYS
and ARGV it takes, and how they are called. Every script touches the keys of one deployment
only, so on Redis Cluster each runs in one slot."""

from __future__ import annotations

import functools
import hashlib
from importlib import resources

import redis.asyncio as redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import NoScriptError

__all__ = ["Script", "source"]

_PACKAGE = __name__.rpartition(".")[0]


@functools.cache
def source(name: str) -> str:
    """The text of ``scripts/<name>.lua``."""
    return resources.files(_PACKAGE).joinpath("scripts", f"{name}.lua").read_text(encoding="utf-8")


class Script:
    """A Lua script: EVALSHA, and EVAL where the server lacks it (which caches it there).

    Not redis-py's registered scripts: on Redis Cluster they load a missing script with SCRIPT
    LOAD on every master, so one master down failed the first call of a script on every other
    one; on one Redis their per-call type checks (``isinstance`` against typing Protocols) were
    a visible share of a report's time on the event loop (py-spy, 2,000 reports/s).
    """

    def __init__(self, r: redis.Redis | RedisCluster, name: str) -> None:
        self._r = r
        self._source = source(name)
        self.sha = hashlib.sha1(self._source.encode()).hexdigest()

    async def __call__(self, keys: list[str], args: list[object]) -> object:
        try:
            return await self._r.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:
            return await self._r.eval(self._source, len(keys), *keys, *args)
