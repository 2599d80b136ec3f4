"""The Redis key schema: every key the store writes, its type and what it holds, in one table
(:data:`SCHEMA`), and :class:`Keys`, which names them for one store.

``P`` is the key prefix (default ``eplb``); ``{d}`` is the deployment name in a hash tag, so
every key of one deployment lives in one Redis Cluster slot and every Lua script (:mod:`.lua`)
touches one slot only. On Redis Cluster no command names keys of two slots: the deployments
index is :data:`INDEX_BUCKETS` buckets, each a slot of its own with its own feed. A deployment
is deleted with one ``DEL`` of every ``P:{d}:`` key of the table (:meth:`Keys.fixed`) and its
kept placements.
"""

from __future__ import annotations

import binascii
from dataclasses import dataclass
from typing import Literal

__all__ = ["INDEX_BUCKETS", "SCHEMA", "DeploymentKey", "KeySpec", "Keys"]

# Index buckets on Redis Cluster (a slot each; a deployment's bucket is CRC32(name) mod this).
INDEX_BUCKETS = 16

# The fixed keys of one deployment, ``P:{d}:<what>`` (placements are per version).
DeploymentKey = Literal["deployment", "meta", "announce", "seq", "acks", "rollout", "windows", "wal2", "lease", "seen"]


@dataclass(frozen=True)
class KeySpec:
    """One key pattern: its Redis type and what it holds."""

    pattern: str
    type: str
    holds: str


SCHEMA: tuple[KeySpec, ...] = (
    KeySpec("P:deployments", "set", "deployment names, on one Redis (the only key outside a deployment's slot)"),
    KeySpec(
        "P:{index:<k>}:deployments",
        "set",
        "on Redis Cluster instead: the names whose CRC32 is `k` mod 16, each bucket a slot of its own",
    ),
    KeySpec("P:{d}:deployment", "string", "the `eplb.v1.Deployment` message, serialized"),
    KeySpec(
        "P:{d}:meta",
        "hash",
        "`version` (current), `reports` (accepted in total), `planned_reports`, `planned_at`, `gen` (the deployment's create time in ns)",
    ),
    KeySpec("P:{d}:placement:<v>", "string", "the `eplb.v1.Placement` message of version `v`; the last 16 are kept"),
    KeySpec(
        "P:{d}:announce",
        "stream",
        "`version=<v>` per commit, `MAXLEN ~ 64` (written for instances of earlier releases; instances now read the feeds)",
    ),
    KeySpec(
        "P:feed",
        "stream",
        "on one Redis: `name=<d>` after each commit, create, restore and delete, `MAXLEN ~ 4096`, expiring 10 minutes after its last entry; every instance's reader blocks on it",
    ),
    KeySpec(
        "P:{index:<k>}:feed", "stream", "on Redis Cluster instead: the feed of index bucket `k`, in the bucket's slot"
    ),
    KeySpec("P:{d}:seq", "hash", "rank → last accepted report seq (idempotent retries)"),
    KeySpec("P:{d}:acks", "hash", "`<rank>` → latest switched version, `<rank>:p` prepared, `<rank>:f` failed"),
    KeySpec(
        "P:{d}:rollout",
        "hash",
        "`<v>:step` largest PREPARED step, `<v>:switch` the fixed switch step, `<v>:aborted`; the last 16 versions",
    ),
    KeySpec(
        "P:{d}:windows",
        "hash",
        "instance id → that instance's window blob (`EPW2`, or `EPW1` from before 1.0; see `windows.py`)",
    ),
    KeySpec(
        "P:{d}:wal2",
        "stream",
        "`b=<EPW2 entry>`: the sums of one accepted batch of reports at their own width, until its instance's next flush folds it in (`MINID` trimmed to the window's span)",
    ),
    KeySpec("P:{d}:lease", "string", "owner id of the planning lease, with a PX expiry"),
    KeySpec(
        "P:{d}:seen",
        "hash",
        "liveness: rank → latest time (epoch seconds, ms precision) an instance received a report or ack of it; `start` → when recording began",
    ),
)

_DEPLOYMENT = "P:{d}:"
# Every fixed key of a deployment, in the table's order.
_FIXED = tuple(
    s.pattern[len(_DEPLOYMENT) :] for s in SCHEMA if s.pattern.startswith(_DEPLOYMENT) and "<" not in s.pattern
)


class Keys:
    """The keys of one store: prefix ``prefix``, on one Redis or (``cluster``) a Redis Cluster."""

    def __init__(self, prefix: str, cluster: bool) -> None:
        self.prefix = prefix
        if cluster:
            self.index = [f"{prefix}:{{index:{k}}}:deployments" for k in range(INDEX_BUCKETS)]
            self.feeds = [f"{prefix}:{{index:{k}}}:feed" for k in range(INDEX_BUCKETS)]
        else:
            self.index = [f"{prefix}:deployments"]
            self.feeds = [f"{prefix}:feed"]

    def of(self, name: str, what: DeploymentKey) -> str:
        """``P:{name}:what``."""
        return f"{self.prefix}:{{{name}}}:{what}"

    def placement(self, name: str, version: int) -> str:
        """``P:{name}:placement:<version>``."""
        return f"{self.prefix}:{{{name}}}:placement:{version}"

    def fixed(self, name: str) -> list[str]:
        """Every fixed key of deployment ``name`` (placements are per version)."""
        return [f"{self.prefix}:{{{name}}}:{what}" for what in _FIXED]

    def index_of(self, name: str) -> str:
        """The index set (on Redis Cluster, the bucket) that lists ``name``."""
        return self.index[binascii.crc32(name.encode()) % len(self.index)]

    def feed_of(self, name: str) -> str:
        """The feed that ``name``'s commits, creates, restores and deletes are appended to."""
        return self.feeds[binascii.crc32(name.encode()) % len(self.feeds)]
