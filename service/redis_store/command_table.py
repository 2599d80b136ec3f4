"""The one use of redis-py's private API: the cluster client's command table, read once.

redis-py has no public way to keep the table a cluster client reads with ``COMMAND`` (to find
a command's keys); its parser class is private (``redis._parsers``). This module is the one
place that subclasses it, so a redis-py upgrade that changes it breaks here alone. redis-py
8.2 reads the table once by itself (``RedisCluster._refresh_topology``); the service allows
``redis>=5.0``, whose earlier releases read it again on every re-initialization, so the
subclass stays until the minimum is raised.
"""

from __future__ import annotations

from redis._parsers import AsyncCommandsParser
from redis.asyncio.cluster import ClusterNode

__all__ = ["CommandTable"]


class CommandTable(AsyncCommandsParser):
    """redis-py's command table (for finding a command's keys), read from a master once.

    The cluster client re-initializes after any broken connection or CLUSTERDOWN answer, and
    each re-initialization read the table again from its default node: when that node was a
    dead master, every call on the live masters failed with its 'Connection refused' (seen in
    CI). Every master of a cluster runs the same server, so the first table stays right.
    """

    async def initialize(self, node: ClusterNode | None = None) -> None:
        if not self.commands:
            await super().initialize(node)
