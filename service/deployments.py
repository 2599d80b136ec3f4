"""This replica's deployments: which it follows (adopt, forget) and the calls that act on a
deployment as a whole: create, get, list, delete, its placements, watches and rollout acks.

Every replica follows every deployment (``_refresh``), so it can serve, plan and restore all
of them; a deployment's replica-local state is a :class:`LocalDeployment`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

import eplb

from . import arrays, codec, limits, validation
from . import rollout as rollout_states
from ._gen.eplb.v1 import balancer_pb2 as pb
from .errors import (
    FailedPrecondition,
    FieldViolation,
    InvalidArgument,
    NotFound,
    OutOfRange,
    ResourceExhausted,
    StoreUnavailable,
)
from .hub import PlacementHub
from .store import DeploymentRecord, created_seconds
from .trigger import TriggerSpec
from .windows import (
    DecayWindow,
    SlidingWindow,
    WindowSpec,
    make_window,
    sum_blobs,
)

if TYPE_CHECKING:
    from .ingest import _Batcher

__all__ = ["Deployments", "LocalDeployment"]

log = logging.getLogger(__name__)


@dataclass
class LocalDeployment:
    """This replica's state for one deployment: its window, follower (hub) and planning state."""

    deployment: pb.Deployment
    topology: eplb.Topology
    window_spec: WindowSpec
    trigger: TriggerSpec
    window: SlidingWindow | DecayWindow
    hub: PlacementHub
    ranks: frozenset[int]
    phy2log: dict[int, np.ndarray] = field(default_factory=dict)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    dirty: bool = False
    flushed_at: float = 0.0
    # Write-ahead entries of batches in ``window`` that no flush has folded in yet.
    unfolded: list[str] = field(default_factory=list)
    batcher: _Batcher | None = None
    flushing: asyncio.Task | None = None
    # Flushes one at a time: an older blob landing last would drop entries a newer one folded.
    flush_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # Why the last triggered re-plan failed, None while they succeed (logs once per change).
    failing: str | None = None


class Deployments:
    """Mixin of :class:`.balancer.Balancer` (shares its ``store``, ``metrics``, ``_local`` and
    ``_latest``): the deployment registry and the calls on whole deployments."""

    async def _refresh(self) -> None:
        """Follows every deployment, so this replica can plan, restore and serve all of them."""
        for record in await self.store.list():
            if record.deployment.name not in self._local:
                self._adopt(record.deployment)

    # deployments

    def _adopt(self, deployment: pb.Deployment) -> LocalDeployment:
        name = deployment.name
        topo = validation.topology_from(deployment.topology, "deployment.topology")
        spec = codec.window_spec(deployment)
        gen = deployment.create_time.ToNanoseconds()
        hub = PlacementHub(
            self.store, name, on_version=self._seen, gen=gen, confirm_deleted=lambda: self._confirm_deleted(name, gen)
        )
        local = LocalDeployment(
            deployment,
            topo,
            spec,
            codec.trigger_spec(deployment),
            make_window((topo.num_layers, topo.num_experts), spec),
            hub,
            frozenset(codec.deployment_ranks(deployment)),
        )
        self._local[name] = local
        hub.start()
        return local

    def _seen(self, placement: pb.Placement) -> None:
        name = placement.deployment
        if name in self._local and placement.version > self._latest.get(name, pb.Placement()).version:
            self._latest[name] = placement
            self.metrics.version.labels(name).set(placement.version)
            self.metrics.imbalance.labels(name).set(placement.stats.imbalance_after or placement.stats.imbalance_before)

    def _forget(self, name: str) -> None:
        local = self._local.pop(name, None)
        self._latest.pop(name, None)
        if local is not None:
            asyncio.create_task(local.hub.stop())
        self.metrics.forget(name)

    async def _get_local(self, name: str) -> LocalDeployment:
        local = self._local.get(name)
        if local is not None and local.hub.deleted:
            self._forget(name)
            local = None
        if local is None:
            record = await self._known(name, lambda: self.store.get(name))
            local = self._local.get(name) or self._adopt(record.deployment)
        return local

    async def create(self, request: pb.CreateDeploymentRequest) -> pb.CreateDeploymentResponse:
        deployment = validation.check_deployment(request.deployment)
        topo = validation.topology_from(deployment.topology, "deployment.topology")
        if deployment.policy == "ilp":
            validation.check_ilp_size(topo, "deployment.topology")
        self._check_writable()
        if await self.store.count() >= limits.MAX_DEPLOYMENTS:
            raise ResourceExhausted(
                f"this service holds {limits.MAX_DEPLOYMENTS} deployments, its limit; delete one first"
            )
        if request.HasField("initial_phy2log"):
            phy2log = arrays.decode(
                request.initial_phy2log, "initial_phy2log", (topo.num_layers, topo.num_slots), kinds="iu"
            )
            try:
                placement = eplb.Placement(phy2log, topo)
            except ValueError as exc:
                raise InvalidArgument(FieldViolation("initial_phy2log", str(exc))) from None
        else:
            placement = eplb.Placement.contiguous(topo)
        now = time.time()
        deployment.create_time.FromNanoseconds(int(now * 1e9))
        first = pb.Placement(
            deployment=deployment.name,
            version=1,
            phy2log=arrays.encode(placement.phy2log),
            stats=pb.PlanStats(policy="initial", policy_used="initial"),
        )
        first.create_time.FromNanoseconds(int(now * 1e9))
        _check_fits(first, self.config.max_message_bytes)
        await self.store.create(deployment, first)
        self._forget(deployment.name)  # a stale local copy of an earlier deployment of this name
        self._adopt(deployment)
        self._seen(first)
        out = pb.Deployment()
        out.CopyFrom(deployment)
        out.version = 1
        return pb.CreateDeploymentResponse(deployment=out, placement=first)

    async def get(self, name: str) -> pb.GetDeploymentResponse:
        validation.check_name(name, "name")
        record = await self._known(name, lambda: self.store.get(name))
        acks = await self.store.acks(name)
        out = pb.Deployment()
        out.CopyFrom(record.deployment)
        out.version = record.version
        return pb.GetDeploymentResponse(
            deployment=out,
            acks=[
                pb.RankAck(
                    rank=r, version=a.switched, prepared_version=max(a.switched, a.prepared), failed_version=a.failed
                )
                for r, a in sorted(acks.items())
            ],
            status=await self._status(record, acks),
        )

    async def list(self) -> pb.ListDeploymentsResponse:
        out = []
        records = await self.store.list()
        for record in records:
            d = pb.Deployment()
            d.CopyFrom(record.deployment)
            d.version = record.version
            out.append(d)
        # Concurrently, 32 at a time: on Redis each status is a few round trips, and a list of
        # hundreds of deployments should not take hundreds in a row, nor open a connection each.
        limit = asyncio.Semaphore(32)

        async def status(record: DeploymentRecord) -> pb.DeploymentStatus:
            async with limit:
                return await self._status(record)

        statuses = await asyncio.gather(*(status(r) for r in records), return_exceptions=True)
        return pb.ListDeploymentsResponse(
            deployments=out,
            # One whose part of the store did not answer (or that was deleted meanwhile) gets an
            # empty status rather than failing the list.
            statuses=[s if isinstance(s, pb.DeploymentStatus) else pb.DeploymentStatus() for s in statuses],
        )

    async def _status(
        self, record: DeploymentRecord, acks: dict[int, rollout_states.RankState] | None = None
    ) -> pb.DeploymentStatus:
        """Where ``record``'s deployment stands: its current version's rollout and stats, and when
        it was last planned (``DeploymentStatus``)."""
        name, version = record.deployment.name, record.version
        if acks is None:
            acks = await self.store.acks(name)
        marks = await self.store.marks(name)
        latest = self._latest.get(name)
        # This replica's copy when it has the current version (a v3-sized placement is not read
        # from Redis per deployment per list), else the store's.
        current = latest if latest is not None and latest.version == version else await self.store.placement(name)
        ranks = codec.deployment_ranks(record.deployment)
        acked, prepared, failed = rollout_states.version_counts(acks, ranks, version)
        status = pb.DeploymentStatus(
            version=version,
            version_time=current.create_time,
            ranks_acked=acked,
            ranks_prepared=prepared,
            ranks_failed=failed,
            num_ranks=len(ranks),
            stats=current.stats,
        )
        if marks.planned_at != created_seconds(record.deployment):
            status.last_plan_time.FromNanoseconds(int(marks.planned_at * 1e9))
        return status

    async def window_loads(self, name: str) -> tuple[np.ndarray, int]:
        """``[L, E]`` float64 tokens in ``name``'s load window as a plan would read it now (every
        replica's last flush and the write-ahead entries not folded yet), and the reports behind."""
        validation.check_name(name, "deployment")
        local = await self._get_local(name)
        topo = local.topology
        blobs = await self.store.windows(name)
        loads, reports, _ = sum_blobs(
            blobs, (topo.num_layers, topo.num_experts), time.time(), local.window_spec.stale_after_s
        )
        return loads, reports

    async def delete(self, name: str) -> None:
        self._check_writable()
        await self.store.delete(name)
        self._forget(name)

    # placements

    async def placement(self, name: str, version: int = 0) -> pb.Placement:
        """The current placement (version 0) or a recent one. Served from this replica's memory
        while it follows the deployment, and also while the store is unreachable (the last
        version this replica saw); a deployment it knows is never NOT_FOUND after the store
        restarted empty (it is written back first)."""
        validation.check_name(name, "deployment")
        local = self._local.get(name)
        remembered = None
        if local is not None and not local.hub.deleted:
            remembered = local.hub.latest if version == 0 else local.hub.ring.get(version)
            if remembered is not None and (local.hub.live or not self.healthy):
                return remembered
        try:
            return await self._known(name, lambda: self.store.placement(name, version))
        except StoreUnavailable:
            if remembered is not None:
                return remembered
            raise
        except NotFound:
            if version:
                await self.store.get(name)  # NOT_FOUND for the deployment itself first
            raise

    async def _known(self, name: str, call: Callable[[], Awaitable[object]]) -> object:
        """``call()``; if the store says NOT_FOUND for a deployment this replica follows, checks
        whether the store restarted empty (then writes everything back) and asks again."""
        try:
            return await call()
        except NotFound:
            if name not in self._local or await self._confirm_deleted(name):
                raise
            return await call()

    async def watch(self, name: str, since_version: int) -> AsyncIterator[pb.Placement]:
        validation.check_name(name, "deployment")
        local = await self._get_local(name)
        current = local.hub.version or (await self.store.get(name)).version
        if since_version > current:
            raise OutOfRange(
                f"since_version {since_version} is above {name!r}'s current version {current}; "
                "pass the last version you received, or 0 for the current one"
            )
        gauge = self.metrics.watchers.labels(name)
        gauge.inc()
        try:
            async for placement in local.hub.watch(since_version):
                yield placement
        finally:
            gauge.dec()

    async def ack(self, request: pb.AckPlacementRequest) -> pb.AckPlacementResponse:
        """Records where a rank stands with a version and answers the version's rollout."""
        validation.check_name(request.deployment, "deployment")
        violations = []
        if request.version == 0:
            violations.append(FieldViolation("version", "must be >= 1"))
        if request.state not in pb.AckState.values():
            allowed = ", ".join(pb.AckState.keys())
            violations.append(FieldViolation("state", f"unknown state {request.state}; allowed: {allowed}"))
        if len(request.error) > 1024:
            violations.append(FieldViolation("error", f"{len(request.error)} characters; at most 1024"))
        if violations:
            raise InvalidArgument(violations)
        self._check_writable()
        record = await self._known(request.deployment, lambda: self.store.get(request.deployment))
        ranks = codec.deployment_ranks(record.deployment)
        validation.check_rank(request.rank, ranks, "rank")
        if request.version > record.version:
            raise FailedPrecondition(f"version {request.version} is not published yet (current {record.version})")
        rollout = await self.store.ack(
            request.deployment,
            request.rank,
            request.version,
            request.state,
            request.step,
            ranks,
            codec.switch_margin(record.deployment),
        )
        name = request.deployment
        if request.state == rollout_states.FAILED:
            log.warning(
                "%s rank %d failed to prepare version %d: %s",
                name,
                request.rank,
                request.version,
                request.error or "(no error given)",
            )
        for outcome, became, what in (
            ("prepared", rollout.became_prepared, f"every rank prepared, switch at step {rollout.switch_step}"),
            ("switched", rollout.became_switched, "every rank switched"),
            ("failed", rollout.became_failed, "rollout aborted"),
        ):
            if became:
                self.metrics.rollouts.labels(name, outcome).inc()
                log.info("%s version %d: %s", name, request.version, what)
        return rollout.to_pb()


# Room a published placement needs beyond version 1's message: its stats (notes, moves, bytes).
_STATS_HEADROOM = 1024


def _check_fits(first: pb.Placement, max_message_bytes: int) -> None:
    """Refuses a deployment whose placements would not fit in one message of this server: every
    GetPlacement and WatchPlacements answer would fail with RESOURCE_EXHAUSTED."""
    size = first.ByteSize() + _STATS_HEADROOM
    if size > max_message_bytes:
        L, P = first.phy2log.shape
        raise InvalidArgument(
            FieldViolation(
                "deployment.topology",
                f"a placement of num_layers x num_slots ({L} x {P}) needs about {size} bytes per message, "
                f"over this server's --max-message-bytes {max_message_bytes}",
            )
        )
