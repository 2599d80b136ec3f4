"""Redis Cluster specifics: the cluster client (keys routed to their slot's master, no
retries), a connection of its own to one master (feed readers, health pings), and the errors
that mean a slot no reachable master holds. Slots and masters are found through the client
(``get_node_from_key``); the store groups its calls per master with them."""

from __future__ import annotations

import contextlib

import redis.asyncio as redis
from redis import exceptions as redis_errors
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.exceptions import RedisClusterException, RedisError

from ..cluster import parse_cluster_url
from ..errors import StoreUnavailable
from .command_table import CommandTable
from .failures import no_retry, retry, unavailable

__all__ = ["CLUSTER_UNREACHABLE", "Masters", "cluster_client", "master_client"]

# The cluster client's errors for a slot no reachable master holds (not RedisErrors): a store
# that does not answer there. RedisClusterUnreachableError is redis-py 8.2's (the SGLang venv
# pins 8.1, which raises SlotNotCoveredError there).
CLUSTER_UNREACHABLE = tuple(
    getattr(redis_errors, n)
    for n in ("SlotNotCoveredError", "RedisClusterUnreachableError")
    if hasattr(redis_errors, n)
)


def cluster_client(url: str, prefix: str, max_connections: int) -> RedisCluster:
    """The client of the cluster whose seed nodes ``url`` names (``redis+cluster://``): keys go to
    their slot's master, with ``max_connections`` per master."""
    seeds = parse_cluster_url(url)
    assert seeds is not None
    client = RedisCluster(
        startup_nodes=[ClusterNode(host, port) for host, port in seeds.nodes],
        # A master that is down takes its own slots down, not the others'; the servers must say
        # so too (cluster-require-full-coverage no), or every slot answers CLUSTERDOWN.
        require_full_coverage=False,
        ssl=seeds.tls,
        username=seeds.username,
        password=seeds.password,
        # Per master, as the pool of one Redis is.
        max_connections=max_connections,
        client_name=f"eplb:{prefix}",
        socket_connect_timeout=1.0,
        socket_timeout=1.0,
        retry=no_retry(),
        health_check_interval=0,
        **dict(seeds.options),
    )
    client.commands_parser = CommandTable()
    return client


def master_client(url: str, prefix: str, host: str, port: int, socket_timeout: float, retry: Retry) -> redis.Redis:
    """One connection of its own to the master ``host:port`` of the cluster (its TLS, user and
    options as the seed URL ``url`` says), outside the cluster client: its calls do not wait on,
    or reset, the connections of the others."""
    seeds = parse_cluster_url(url)
    assert seeds is not None
    return redis.Redis(
        host=host,
        port=port,
        ssl=seeds.tls,
        username=seeds.username,
        password=seeds.password,
        socket_connect_timeout=1.0,
        socket_timeout=socket_timeout,
        retry=retry,
        health_check_interval=0,
        max_connections=1,
        client_name=f"eplb:{prefix}",
        **dict(seeds.options),
    )


class Masters:
    """A cluster's masters as the store sees them: which one owns a key's slot, and connections
    of their own to single masters (the health ping's, a feed reader's)."""

    def __init__(self, client: RedisCluster, url: str, prefix: str) -> None:
        self._client = client
        self._url = url
        self._prefix = prefix
        self._ping_clients: dict[str, redis.Redis] = {}

    @property
    def mapped(self) -> bool:
        """Whether the client knows the slot map (so ``of`` answers without a call)."""
        return bool(self._client.nodes_manager.slots_cache)

    def of(self, key: str) -> str:
        """``host:port`` of the master owning ``key``'s slot."""
        return self._client.get_node_from_key(key).name

    async def initialized(self) -> None:
        """The cluster client's slot map, (re)read if the client asks for it.

        The client's re-initialization also asks its default node for the command table; when
        that node is a dead master it fails although the other masters answer (seen in CI: the
        health ping, then the deployment count of a CreateDeployment, failed with the dead
        master's 'Connection refused'). The slot map known so far still routes every key, so
        a failure counts only before there is one.
        """
        try:
            with unavailable():
                await self._client.initialize()
        except StoreUnavailable:
            if not self.mapped:
                raise

    async def refresh(self) -> None:
        """Reads the slot map again now (after a MOVED answer); a failure leaves the old one."""
        with contextlib.suppress(RedisError, OSError, RedisClusterException, *CLUSTER_UNREACHABLE):
            await self._client.nodes_manager.initialize()

    def primaries(self) -> list[ClusterNode]:
        return self._client.get_primaries()

    def ping_client(self, master: ClusterNode) -> redis.Redis:
        """A connection of its own to one master, for the health ping.

        Through the cluster client, a call to a dead master reinitializes the client and drops
        connections other calls hold, so a ping of a live master raced into ConnectionError and
        an instance whose masters all but one answered went NOT_SERVING (seen in CI, 1 run in 3
        on a loaded machine). Its own connection answers for that master alone.
        """
        client = self._ping_clients.get(master.name)
        if client is None:
            client = master_client(self._url, self._prefix, master.host, master.port, 1.0, retry())
            self._ping_clients[master.name] = client
        return client

    async def reader(self, key: str, socket_timeout: float) -> redis.Redis:
        """A connection of its own to the master of ``key``'s slot, with no retries (a feed's
        reader: a failed read falls back to direct checks at once)."""
        await self.initialized()
        node = self._client.get_node_from_key(key)
        return master_client(self._url, self._prefix, node.host, node.port, socket_timeout, no_retry())

    async def close(self) -> None:
        for client in self._ping_clients.values():
            await client.aclose()
