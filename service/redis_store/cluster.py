"""Redis Cluster specifics: the cluster client (keys routed to their slot's master, no
retries), a connection of its own to one master (feed readers, health pings), and the errors
that mean a slot no reachable master holds. Slots and masters are found through the client
(``get_node_from_key``); the store groups its calls per master with them."""

from __future__ import annotations

import redis.asyncio as redis
from redis import exceptions as redis_errors
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry

from ..cluster import parse_cluster_url
from .command_table import CommandTable
from .failures import no_retry

__all__ = ["CLUSTER_UNREACHABLE", "cluster_client", "master_client"]

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
