"""The calls that act on a deployment as a whole: create, get, list, delete, its placements,
watches, rollout acks and SetRanksDown. Which deployments this instance follows, and their
instance-local state, is :mod:`.registry`'s.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator

import numpy as np

import eplb
from eplb import limits
from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb
from eplb_wire.arrays import encode

from . import arrays, codec, validation
from . import rollout as rollout_states
from .clip import clip
from .config import BalancerConfig
from .errors import (
    FailedPrecondition,
    FieldViolation,
    InvalidArgument,
    NotFound,
    OutOfRange,
    ResourceExhausted,
    StoreUnavailable,
)
from .liveness import Liveness
from .log_throttle import LogThrottle
from .metrics import Metrics
from .planner import Planner
from .registry import Registry
from .store import DeploymentRecord, Store, created_seconds
from .store_health import StoreHealth
from .windows import sum_blobs

__all__ = ["Deployments"]

log = logging.getLogger(__name__)


class Deployments:
    """The calls on whole deployments of ``registry``: create, get, list, delete, placements,
    watches, acks and SetRanksDown (planned by ``planner``); ``liveness`` answers their suspect
    ranks, ``health`` refuses writes at once while the store is down."""

    def __init__(
        self,
        registry: Registry,
        store: Store,
        health: StoreHealth,
        liveness: Liveness,
        planner: Planner,
        metrics: Metrics,
        config: BalancerConfig,
    ) -> None:
        self.registry = registry
        self.store = store
        self.health = health
        self.liveness = liveness
        self.planner = planner
        self.metrics = metrics
        self.config = config
        # A rank may send FAILED acks as often as it likes: one line per (deployment, rank) a minute.
        self._failed_acks = LogThrottle()

    async def create(self, request: pb.CreateDeploymentRequest) -> pb.CreateDeploymentResponse:
        deployment = validation.check_deployment(request.deployment)
        topo = validation.topology_from(deployment.topology, "deployment.topology")
        if deployment.policy == "ilp":
            validation.check_ilp_size(topo, "deployment.topology")
        self.health.check_writable()
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
            phy2log=encode(placement.phy2log),
            stats=pb.PlanStats(policy="initial", policy_used="initial"),
        )
        if placement.down_gpus:
            # An initial placement with gpus empty: their ranks are down from the start.
            ranks = codec.gpu_ranks(deployment)
            if ranks is None:
                raise InvalidArgument(
                    FieldViolation(
                        "initial_phy2log",
                        f"gpus {list(placement.down_gpus)} hold no expert, but deployment.ranks names fewer ranks "
                        f"than num_gpus: no rank to mark down",
                    )
                )
            first.down_ranks.extend(sorted(ranks[g] for g in placement.down_gpus))
            first.down_ranks_version = 1
        first.create_time.FromNanoseconds(int(now * 1e9))
        _check_fits(first, self.config.max_message_bytes, topo)
        await self.store.create(deployment, first)
        self.registry.forget(deployment.name)  # a stale local copy of an earlier deployment of this name
        self.registry.adopt(deployment)
        self.registry.seen(first)
        out = pb.Deployment()
        out.CopyFrom(deployment)
        out.version = 1
        return pb.CreateDeploymentResponse(deployment=out, placement=first)

    async def get(self, name: str) -> pb.GetDeploymentResponse:
        validation.check_name(name, "name")
        record = await self.registry.known(name, lambda: self.store.get(name))
        acks = await self.store.acks(name)
        out = pb.Deployment()
        out.CopyFrom(record.deployment)
        out.version = record.version
        current = await self.registry.known(name, lambda: self.store.placement(name))
        return pb.GetDeploymentResponse(
            down_ranks=current.down_ranks,
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
        latest = self.registry.latest(name)
        # This instance's copy when it has the current version (a v3-sized placement is not read
        # from Redis per deployment per list), else the store's.
        current = latest if latest is not None and latest.version == version else await self.store.placement(name)
        # The current version's live ranks: a rank down in it takes no part in its rollout.
        ranks = [r for r in codec.deployment_ranks(record.deployment) if r not in set(current.down_ranks)]
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
        if codec.suspect_after_s(record.deployment):
            # Read fresh (service/liveness.py), merged with this instance's own times.
            status.suspect_ranks.extend(
                await self.liveness.suspects(record.deployment, set(current.down_ranks), self.registry.local.get(name))
            )
        return status

    async def window_loads(self, name: str) -> tuple[np.ndarray, int]:
        """``[L, E]`` float64 tokens in ``name``'s load window as a plan would read it now (every
        instance's last flush and the write-ahead entries not folded yet), and the reports behind."""
        validation.check_name(name, "deployment")
        local = await self.registry.get(name)
        topo = local.topology
        blobs = await self.store.windows(name)
        loads, reports, _ = sum_blobs(
            blobs, (topo.num_layers, topo.num_experts), time.time(), local.window_spec.stale_after_s
        )
        return loads, reports

    async def delete(self, name: str) -> None:
        self.health.check_writable()
        await self.store.delete(name)
        self.registry.forget(name)

    # placements

    async def placement(self, name: str, version: int = 0) -> pb.Placement:
        """The current placement (version 0) or a recent one. Served from this instance's memory
        while it follows the deployment, and also while the store is unreachable (the last
        version this instance saw); a deployment it knows is never NOT_FOUND after the store
        restarted empty (it is written back first)."""
        validation.check_name(name, "deployment")
        local = self.registry.local.get(name)
        remembered = None
        if local is not None and not local.hub.deleted:
            remembered = local.hub.latest if version == 0 else local.hub.ring.get(version)
            if remembered is not None and (local.hub.live or not self.health.healthy):
                return remembered
        try:
            return await self.registry.known(name, lambda: self.store.placement(name, version))
        except StoreUnavailable:
            if remembered is not None:
                return remembered
            raise
        except NotFound:
            if version:
                await self.store.get(name)  # NOT_FOUND for the deployment itself first
            raise

    async def watch(self, name: str, since_version: int) -> AsyncIterator[pb.Placement]:
        validation.check_name(name, "deployment")
        local = await self.registry.get(name)
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
        self.health.check_writable()
        record = await self.registry.known(request.deployment, lambda: self.store.get(request.deployment))
        validation.check_rank(request.rank, codec.deployment_ranks(record.deployment), "rank")
        if request.version > record.version:
            raise FailedPrecondition(f"version {request.version} is not published yet (current {record.version})")
        name = request.deployment
        # A version's rollout counts the ranks live in it; a rank down there takes no part. A
        # version older than the kept ones is counted with the current version's down ranks.
        try:
            acked = await self.placement(name, request.version)
        except NotFound:
            acked = await self.store.placement(name)
        if request.rank in acked.down_ranks:
            raise FailedPrecondition(
                f"rank {request.rank} is down in version {request.version} (down ranks {list(acked.down_ranks)}); "
                "it takes no part in that version's rollout (SetRanksDown up=[rank] plans it in again)"
            )
        # The store's current version (``record``), not an older one this instance remembers: an
        # instance that has not seen the survivor placement yet must not let the superseded
        # version finish. Its memory serves when it is that version (placements are large).
        current = await self.placement(name)
        if current.version < record.version:
            current = await self.store.placement(name)
        counted = codec.live_ranks(record.deployment, acked)
        superseded = request.version < current.down_ranks_version
        if superseded:
            # The ranks went down (or up) while this version was rolling out: the survivor
            # placement supersedes it. A switch step fixed before the change stands (ranks may
            # already route with it); none is fixed after it: the rank that never acks (-1)
            # keeps the version from completing, on either store.
            counted = [*counted, -1]
        rollout = await self.store.ack(
            name,
            request.rank,
            request.version,
            request.state,
            request.step,
            counted,
            codec.switch_margin(record.deployment),
        )
        if superseded:
            rollout = dataclasses.replace(
                rollout, num_ranks=len(counted) - 1, aborted=rollout.aborted or not rollout.switch_step
            )
        (await self.registry.get(name)).saw(request.rank)
        if (
            request.state == rollout_states.FAILED
            and (held := self._failed_acks.admit((name, request.rank))) is not None
        ):
            log.warning(
                "%s rank %d failed to prepare version %d: %s%s",
                name,
                request.rank,
                request.version,
                clip(request.error, 256) if request.error else "(no error given)",
                f" ({held} more FAILED acks of this rank in the last minute)" if held else "",
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

    async def set_ranks_down(
        self, request: pb.SetRanksDownRequest, who: str = "", deadline_s: float | None = None
    ) -> pb.SetRanksDownResponse:
        """Checks a ``SetRanksDown`` and applies it (``Planner.publish_survivors``). ``who``:
        the caller, for the audit log."""
        validation.check_name(request.deployment, "deployment")
        violations = []
        if len(request.reason) > 256:
            violations.append(FieldViolation("reason", f"{len(request.reason)} characters; at most 256"))
        if not request.down and not request.up:
            violations.append(FieldViolation("down", "name at least one rank in down or up"))
        if violations:
            raise InvalidArgument(violations)
        local = await self.registry.get(request.deployment)
        ranks = codec.gpu_ranks(local.deployment)
        if ranks is None:
            raise FailedPrecondition(
                f"{request.deployment!r} names {len(codec.deployment_ranks(local.deployment))} ranks for "
                f"{local.topology.num_gpus} gpus: Deployment.ranks[g] must name every gpu's rank to mark ranks down"
            )
        known = set(ranks)
        for name, items in (("down", request.down), ("up", request.up)):
            seen: set[int] = set()
            for i, r in enumerate(items):
                if r not in known:
                    shown = (
                        f"{ranks[0]} .. {ranks[-1]}" if ranks == list(range(ranks[0], ranks[-1] + 1)) else ranks[:16]
                    )
                    violations.append(
                        FieldViolation(f"{name}[{i}]", f"rank {r} is not a gpu's rank of the deployment ({shown})")
                    )
                elif r in seen:
                    violations.append(FieldViolation(f"{name}[{i}]", f"rank {r} is listed twice"))
                seen.add(r)
        both = sorted(set(request.down) & set(request.up))
        if both:
            violations.append(FieldViolation("up", f"ranks {both} are in both down and up"))
        if violations:
            raise InvalidArgument(violations)
        self.health.check_writable()
        return await self.planner.publish_survivors(
            local, set(request.down), set(request.up), who, request.reason, deadline_s
        )


# Room a published placement needs beyond version 1's message and its loads: its stats (notes, moves, bytes).
_STATS_HEADROOM = 1024


def _check_fits(first: pb.Placement, max_message_bytes: int, topo: eplb.Topology) -> None:
    """Refuses a deployment whose placements would not fit in one message of this server: every
    GetPlacement and WatchPlacements answer would fail with RESOURCE_EXHAUSTED. Later versions
    carry the float32 ``[L, E]`` loads they were planned from, counted here."""
    loads = encode(np.zeros((topo.num_layers, topo.num_experts), dtype=np.float32))
    size = first.ByteSize() + pb.Placement(loads=loads).ByteSize() + _STATS_HEADROOM
    if size > max_message_bytes:
        L, P = first.phy2log.shape
        raise InvalidArgument(
            FieldViolation(
                "deployment.topology",
                f"a placement of num_layers x num_slots ({L} x {P}) needs about {size} bytes per message, "
                f"over this server's --max-message-bytes {max_message_bytes}",
            )
        )
