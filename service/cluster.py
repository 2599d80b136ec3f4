"""Redis Cluster URLs: ``redis+cluster://HOST:PORT[,HOST:PORT…][?option=value…]`` (and
``rediss+cluster://`` for TLS) name seed nodes of a Redis Cluster; the client learns the rest.

Query options are passed to redis-py's cluster client as keyword arguments, as ``redis://``
URLs pass theirs to ``from_url``: ``ssl_ca_certs``, ``ssl_certfile``, ``ssl_keyfile``,
``ssl_cert_reqs`` (``none``, ``optional``, ``required``). A username and password may precede
the first node (``redis+cluster://user:pass@h1:7000,h2:7001``).
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qsl, unquote

__all__ = ["ClusterUrl", "SCHEMES", "parse_cluster_url"]

# scheme → TLS
SCHEMES = {"redis+cluster": False, "rediss+cluster": True}
_OPTIONS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs")


@dataclass(frozen=True)
class ClusterUrl:
    """Seed nodes ``(host, port)``, TLS, credentials and client options of a cluster URL."""

    nodes: tuple[tuple[str, int], ...]
    tls: bool
    username: str | None
    password: str | None
    options: tuple[tuple[str, str], ...] = ()


def parse_cluster_url(url: str) -> ClusterUrl | None:
    """A cluster URL's parts; None for any other scheme. ``ValueError`` says what is wrong."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in SCHEMES:
        return None
    rest, _, query = rest.partition("?")
    rest = rest.rstrip("/")
    username = password = None
    if "@" in rest:
        auth, rest = rest.rsplit("@", 1)
        user, colon, pw = auth.partition(":")
        username, password = (unquote(user) or None, unquote(pw)) if colon else (None, unquote(user))
    nodes = []
    for part in rest.split(","):
        host, colon, port = part.strip().rpartition(":")
        host = host.strip("[]")
        if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{scheme}:// takes comma-separated HOST:PORT seed nodes, got {part!r} in {url!r}")
        nodes.append((host, int(port)))
    options = tuple(parse_qsl(query))
    for key, _ in options:
        if key not in _OPTIONS:
            raise ValueError(f"unknown option {key!r} in {url!r}; allowed: {', '.join(_OPTIONS)}")
    return ClusterUrl(tuple(nodes), SCHEMES[scheme.lower()], username, password, options)
