"""The ``Store`` interface: where deployments, placements, dedup state and windows live.

Two implementations: :mod:`.memory_store` (one process, the embedded default) and
:mod:`.redis_store` (shared by several service instances). Placements and deployments are
stored as their serialized protobuf messages (explicit little-endian array bytes, never pickle).

Every method may raise ``StoreUnavailable`` when the backing store cannot be reached.
"""

from __future__ import annotations

import builtins
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb

from .rollout import RankState, Rollout

__all__ = [
    "Store",
    "AcceptCall",
    "Accepted",
    "DeploymentRecord",
    "PlanMarks",
    "Seen",
    "PLACEMENTS_KEPT",
    "created_seconds",
]

# Recent versions kept for GetPlacement(version=…) and for mapping physical counts that were
# recorded under an older placement; older versions are deleted on publish.
PLACEMENTS_KEPT = 16


@dataclass(frozen=True)
class DeploymentRecord:
    """A stored deployment (``create_time`` set, ``version`` 0) and its current version."""

    deployment: pb.Deployment
    version: int


@dataclass(frozen=True)
class PlanMarks:
    """Trigger bookkeeping: reports accepted in total, and the totals at the last plan."""

    reports: int
    planned_reports: int
    planned_at: float


def created_seconds(deployment: pb.Deployment) -> float:
    """The deployment's ``create_time`` in seconds: a store's ``planned_at`` on create, so that
    ``planned_at`` above it means the deployment was planned since."""
    return deployment.create_time.ToNanoseconds() / 1e9


@dataclass(frozen=True)
class Seen:
    """When a deployment's ranks were last heard from (liveness, :mod:`.liveness`): ``ranks``,
    rank → the latest time (seconds since the epoch, any instance's clock) a report or ack of it
    was received; ``start``, when the store began recording them (the deployment's creation, or
    its write-back after the store restarted empty; 0 when unknown: a deployment stored before
    liveness existed)."""

    start: float
    ranks: dict[int, float]


@dataclass(frozen=True)
class AcceptCall:
    """One deployment's batch of reports for :meth:`Store.accept_many`: the arguments of
    :meth:`Store.accept_reports`."""

    name: str
    pairs: list[tuple[int, int]]
    journal: Callable[[list[bool]], bytes]
    keep_s: float
    # The report each pair belongs to (None: a report each). A report of several pairs (a node
    # report's covers) is accepted all together or not at all: one pair counted before makes
    # its others not new either, and where some were new they answer None (refused).
    groups: list[int] | None = None


def all_or_nothing(flags: list[bool], groups: list[int] | None) -> list[bool | None]:
    """``flags`` (whether each pair is new) with every report of ``groups`` all new or none:
    a report with some new pairs and some not gets None for every pair (refused)."""
    if groups is None:
        return list(flags)
    seen: dict[int, list[int]] = {}
    for i, g in enumerate(groups):
        seen.setdefault(g, []).append(i)
    out: list[bool | None] = list(flags)
    for members in seen.values():
        if len(members) > 1:
            new = [flags[i] for i in members]
            if any(new) and not all(new):
                for i in members:
                    out[i] = None
    return out


# What :meth:`Store.accept_reports` returns: whether each pair is new (None: refused, its report
# partly counted before: see AcceptCall.groups), and the write-ahead id.
Accepted = tuple[list[bool | None], str | None]


class Store(Protocol):
    async def ping(self) -> str:
        """Returns an id of the backing store's run; a new id means it restarted empty (on Redis
        Cluster one id per master: a master that restarted empty changes it)."""

    def down(self, names: list[str]) -> set[str]:
        """Those of ``names`` whose part of the store did not answer the last ``ping`` while the
        rest did (Redis Cluster: deployments in a down master's slots); empty otherwise."""

    async def create(self, deployment: pb.Deployment, placement: pb.Placement) -> None:
        """Stores the deployment with ``placement`` as version 1; ``AlreadyExists`` if present."""

    async def restore(self, deployment: pb.Deployment, placement: pb.Placement) -> bool:
        """Writes back a deployment and its latest placement if the store lacks that version."""

    async def get(self, name: str) -> DeploymentRecord:
        """``NotFound`` when missing."""

    async def list(self) -> list[DeploymentRecord]: ...

    async def names(self) -> builtins.list[str]:
        """Every deployment's name, sorted: the index alone, no record read (what an instance
        polls to follow new deployments)."""

    async def count(self) -> int:
        """How many deployments there are."""

    async def delete(self, name: str) -> None:
        """Removes every key of the deployment; ``NotFound`` when missing."""

    async def placement(self, name: str, version: int = 0) -> pb.Placement:
        """Version 0 means current; ``NotFound`` when the deployment or version is gone."""

    async def publish(self, name: str, placement: pb.Placement) -> None:
        """Commits ``placement`` (its ``version`` must be current + 1) atomically and announces it.

        ``Aborted`` when another publisher got there first, ``NotFound`` when deleted.
        """

    def follow(self, name: str, since_version: int, gen: int = 0) -> AsyncIterator[pb.Placement]:
        """The current placement if newer than ``since_version``, then each new version in order.

        Ends with ``NotFound`` when the deployment is deleted or re-created (a generation other
        than ``gen``, the followed deployment's create time in nanoseconds; 0: any).
        """

    async def accept_reports(
        self,
        name: str,
        pairs: builtins.list[tuple[int, int]],
        journal: Callable[[builtins.list[bool]], bytes],
        keep_s: float,
        groups: builtins.list[int] | None = None,
    ) -> Accepted:
        """``(rank, seq)`` pairs → whether each is new (seq above the rank's last accepted; None:
        refused, as ``AcceptCall.groups`` says), and the id of the write-ahead entry holding the
        new reports' counts.

        ``journal(fresh)`` is the window blob of the reports flagged fresh; a store shared by
        instances writes it in the same atomic step as the seqs, so a report is never marked seen
        without its counts (kept ``keep_s`` at most, until ``put_window`` folds it). Counts
        accepted reports toward the trigger. ``NotFound`` when the deployment is gone.
        """

    async def accept_many(self, calls: Sequence[AcceptCall]) -> builtins.list[Accepted | Exception]:
        """:meth:`accept_reports` for the batches of several deployments, in one round trip where
        the store allows (one pipeline a Redis master); one answer per call, in order: its result,
        or the error that call alone failed with (``NotFound``; ``StoreUnavailable`` where its
        part of the store is down: on Redis Cluster each master's calls are answered apart, even
        when every master is down; a store's own error, a bug). Raises ``StoreUnavailable`` when
        a store of one part (one Redis) does not answer."""

    def shard(self, name: str) -> str:
        """The part of the store that holds ``name``'s keys (a Redis Cluster master), for
        grouping calls that :meth:`accept_many` can send together; one value on one Redis."""

    async def marks(self, name: str) -> PlanMarks:
        """``planned_at`` is ``created_seconds(deployment)`` until the first plan (a restore
        writes its own time)."""

    async def mark_planned(self, name: str, reports: int, at: float) -> None: ...

    async def put_window(self, name: str, instance: str, blob: bytes, folded: builtins.list[str]) -> None:
        """This instance's window aggregate (see :mod:`.windows`), replacing its previous one, and
        the deletion of the write-ahead entries ``folded`` into it, atomically."""

    async def windows(self, name: str) -> dict[str, bytes]:
        """Every instance's window blob, and every write-ahead entry not folded yet (``wal2:<id>``)."""

    async def drop_windows(self, name: str, keys: builtins.list[str]) -> None:
        """Drops stale blobs (instance ids) and write-ahead entries (``wal2:<id>``)."""

    async def ack(
        self, name: str, rank: int, version: int, state: int, step: int, ranks: builtins.list[int], margin: int
    ) -> Rollout:
        """Records where ``rank`` stands with ``version`` and returns the version's rollout over
        ``ranks``, atomically (rules in :mod:`.rollout`). ``NotFound`` when the deployment is gone."""

    async def acks(self, name: str) -> dict[int, RankState]:
        """Rank → its latest switched, prepared and failed versions."""

    async def record_seen(self, name: str, seen: dict[int, float]) -> None:
        """Rank → a time a report or ack of it was received: each kept where it is later than the
        stored one (instances write in any order). ``NotFound`` when the deployment is gone."""

    async def seen(self, name: str) -> Seen:
        """The ranks' latest recorded times. ``NotFound`` when the deployment is gone."""

    async def acquire_lease(self, name: str, owner: str, ttl_s: float) -> bool:
        """The planning lease for ``name``: true if ``owner`` holds it now (expires after ttl)."""

    async def renew_lease(self, name: str, owner: str, ttl_s: float) -> bool:
        """Extends ``owner``'s lease to ``ttl_s`` from now; False if ``owner`` no longer holds it."""

    async def release_lease(self, name: str, owner: str) -> None: ...

    async def close(self) -> None: ...
