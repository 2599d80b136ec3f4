"""In-process ``Store``: the embedded default for a single service process."""

from __future__ import annotations

import asyncio
import builtins
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb

from .errors import Aborted, AlreadyExists, NotFound
from .rollout import RankState, Rollout, VersionRollout, apply_ack
from .store import (
    PLACEMENTS_KEPT,
    AcceptCall,
    Accepted,
    DeploymentRecord,
    PlanMarks,
    Seen,
    all_or_nothing,
    created_seconds,
)

__all__ = ["MemoryStore"]


@dataclass
class _State:
    deployment: pb.Deployment
    placements: dict[int, pb.Placement]
    version: int
    seq: dict[int, int] = field(default_factory=dict)
    acks: dict[int, RankState] = field(default_factory=dict)
    rollouts: dict[int, VersionRollout] = field(default_factory=dict)
    windows: dict[str, bytes] = field(default_factory=dict)
    reports: int = 0
    planned_reports: int = 0
    planned_at: float = field(default_factory=time.time)
    lease: tuple[str, float] | None = None
    deleted: bool = False
    # Liveness: rank → latest time seen, and when recording began.
    seen: dict[int, float] = field(default_factory=dict)
    seen_start: float = field(default_factory=time.time)


class MemoryStore:
    """Implements :class:`.store.Store` with dicts; ``follow`` wakes on an ``asyncio.Condition``."""

    def __init__(self) -> None:
        self._run_id = uuid.uuid4().hex
        self._states: dict[str, _State] = {}
        self._changed = asyncio.Condition()

    def _get(self, name: str) -> _State:
        state = self._states.get(name)
        if state is None:
            raise NotFound(f"deployment {name!r} not found")
        return state

    async def ping(self) -> str:
        return self._run_id

    def down(self, names: list[str]) -> set[str]:
        return set()

    async def create(self, deployment: pb.Deployment, placement: pb.Placement) -> None:
        if deployment.name in self._states:
            raise AlreadyExists(f"deployment {deployment.name!r} already exists")
        self._states[deployment.name] = _State(
            deployment, {placement.version: placement}, placement.version, planned_at=created_seconds(deployment)
        )
        await self._notify()

    async def restore(self, deployment: pb.Deployment, placement: pb.Placement) -> bool:
        state = self._states.get(deployment.name)
        if state is not None and state.version >= placement.version:
            return False
        self._states[deployment.name] = _State(deployment, {placement.version: placement}, placement.version)
        await self._notify()
        return True

    async def get(self, name: str) -> DeploymentRecord:
        state = self._get(name)
        return DeploymentRecord(state.deployment, state.version)

    async def list(self) -> list[DeploymentRecord]:
        return [DeploymentRecord(s.deployment, s.version) for _, s in sorted(self._states.items())]

    async def names(self) -> builtins.list[str]:
        return sorted(self._states)

    async def count(self) -> int:
        return len(self._states)

    async def delete(self, name: str) -> None:
        state = self._get(name)
        state.deleted = True
        del self._states[name]
        await self._notify()

    async def placement(self, name: str, version: int = 0) -> pb.Placement:
        state = self._get(name)
        found = state.placements.get(version or state.version)
        if found is None:
            raise NotFound(f"deployment {name!r} has no placement version {version} (current {state.version})")
        return found

    async def publish(self, name: str, placement: pb.Placement) -> None:
        state = self._get(name)
        if placement.version != state.version + 1:
            raise Aborted(f"version {placement.version} is not current + 1 ({state.version + 1}); another plan won")
        state.placements[placement.version] = placement
        state.placements.pop(placement.version - PLACEMENTS_KEPT, None)
        state.version = placement.version
        await self._notify()

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def follow(self, name: str, since_version: int, gen: int = 0) -> AsyncIterator[pb.Placement]:
        # A deleted or re-created deployment is a new _State: the old one's ``deleted`` ends this.
        state = self._get(name)
        if gen and state.deployment.create_time.ToNanoseconds() != gen:
            raise NotFound(f"deployment {name!r} not found")
        sent = since_version
        if state.version > sent:
            # Resuming: every kept version missed, in order; a fresh follower starts at the current.
            sent = max(sent + 1, state.version - PLACEMENTS_KEPT + 1) if sent else state.version
            yield state.placements[sent]
            while sent < state.version:
                sent += 1
                yield state.placements[sent]
        while True:
            async with self._changed:
                await self._changed.wait_for(lambda: state.deleted or state.version > sent)
            if state.deleted:
                raise NotFound(f"deployment {name!r} was deleted")
            while sent < state.version:
                # Every kept version in order; a follower that fell past the kept ones jumps ahead.
                sent = max(sent + 1, state.version - PLACEMENTS_KEPT + 1)
                yield state.placements[sent]

    async def accept_reports(
        self,
        name: str,
        pairs: builtins.list[tuple[int, int]],
        journal: Callable[[builtins.list[bool]], bytes],
        keep_s: float,
        groups: builtins.list[int] | None = None,
    ) -> Accepted:
        # One process: the windows in memory die with the seqs, so no write-ahead entry is kept.
        state = self._get(name)
        # As the Redis script and its caller do: flag the pairs in order, refuse the reports
        # that are not all new, and flag again without them (a refused report's pair must not
        # make a later pair of its rank look counted) until no more is refused.
        refused: set[int] = set()
        while True:
            last: dict[int, int] = {}
            flags = []
            for i, (rank, seq) in enumerate(pairs):
                new = i not in refused and seq > last.get(rank, state.seq.get(rank, -1))
                if new:
                    last[rank] = seq
                flags.append(new)
            more = {i for i, f in enumerate(all_or_nothing(flags, groups)) if f is None} - refused
            if not more:
                break
            refused |= more
        out: list[bool | None] = [None if i in refused else f for i, f in enumerate(flags)]
        for (rank, seq), f in zip(pairs, out):
            if f:
                state.seq[rank] = seq
                state.reports += 1
        return out, None

    async def accept_many(self, calls: Sequence[AcceptCall]) -> builtins.list[Accepted | Exception]:
        out: list[Accepted | Exception] = []
        for c in calls:
            try:
                out.append(await self.accept_reports(c.name, c.pairs, c.journal, c.keep_s, c.groups))
            except NotFound as exc:
                out.append(exc)
        return out

    def shard(self, name: str) -> str:
        return "memory"

    async def marks(self, name: str) -> PlanMarks:
        state = self._get(name)
        return PlanMarks(state.reports, state.planned_reports, state.planned_at)

    async def mark_planned(self, name: str, reports: int, at: float) -> None:
        state = self._get(name)
        state.planned_reports, state.planned_at = reports, at

    async def put_window(self, name: str, instance: str, blob: bytes, folded: builtins.list[str]) -> None:
        self._get(name).windows[instance] = blob

    async def windows(self, name: str) -> dict[str, bytes]:
        return dict(self._get(name).windows)

    async def drop_windows(self, name: str, keys: builtins.list[str]) -> None:
        for r in keys:
            self._get(name).windows.pop(r, None)

    async def ack(
        self, name: str, rank: int, version: int, state: int, step: int, ranks: builtins.list[int], margin: int
    ) -> Rollout:
        s = self._get(name)
        out = apply_ack(s.acks, s.rollouts, rank, version, state, step, ranks, margin)
        s.rollouts.pop(version - PLACEMENTS_KEPT, None)
        return out

    async def acks(self, name: str) -> dict[int, RankState]:
        return dict(self._get(name).acks)

    async def record_seen(self, name: str, seen: dict[int, float]) -> None:
        state = self._get(name)
        for rank, at in seen.items():
            if at > state.seen.get(rank, 0.0):
                state.seen[rank] = at

    async def seen(self, name: str) -> Seen:
        state = self._get(name)
        return Seen(state.seen_start, dict(state.seen))

    async def acquire_lease(self, name: str, owner: str, ttl_s: float) -> bool:
        state = self._get(name)
        now = time.monotonic()
        if state.lease is None or state.lease[1] <= now:
            state.lease = (owner, now + ttl_s)
            return True
        return False

    async def renew_lease(self, name: str, owner: str, ttl_s: float) -> bool:
        state = self._states.get(name)
        if state is None or state.lease is None or state.lease[0] != owner or state.lease[1] <= time.monotonic():
            return False
        state.lease = (owner, time.monotonic() + ttl_s)
        return True

    async def release_lease(self, name: str, owner: str) -> None:
        state = self._states.get(name)
        if state is not None and state.lease is not None and state.lease[0] == owner:
            state.lease = None

    async def close(self) -> None:
        return None
