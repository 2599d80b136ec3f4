"""The balancer: deployments, load windows, planning and publication on top of a ``Store``.

One ``Balancer`` per service replica. Background tasks flush this replica's windows to the
store, start plans when a deployment's trigger is due (one replica at a time, under the
store's planning lease), and watch the store's health, writing back every deployment's
latest placement if the store comes back empty (a Redis restart without persistence).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import numpy as np

import eplb
from . import arrays, codec, limits
from . import rollout as rollout_states
from ._gen.eplb.v1 import balancer_pb2 as pb
from .errors import (
    Aborted,
    FailedPrecondition,
    FieldViolation,
    InvalidArgument,
    NotFound,
    OutOfRange,
    ResourceExhausted,
    ServiceError,
    StoreUnavailable,
)
from .hub import PlacementHub
from .metrics import Metrics
from .solver import Job, Solver
from .store import Store
from .trigger import TriggerSpec, due, gate
from .windows import DecayWindow, SlidingWindow, WindowSpec, encode_blob, encode_sums, make_window, sum_blobs

__all__ = ["Balancer", "BalancerConfig"]

log = logging.getLogger(__name__)

# Write-ahead entries a replica lets pile up before it flushes its window early.
_UNFOLDED_MAX = 64


@dataclass(frozen=True)
class BalancerConfig:
    """Timings in seconds. ``lease_s`` bounds how long a crashed planner blocks the others."""

    replica_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    lease_s: float = 10.0
    flush_s: float = 1.0
    tick_s: float = 0.5
    refresh_s: float = 2.0
    # Worker processes for re-plans and for stateless ComputePlacement calls (service/solver.py);
    # 0 plans in a thread of the serving process (only to measure what the pools buy).
    plan_workers: int = limits.REPLAN_WORKERS
    compute_workers: int = limits.COMPUTE_WORKERS


@dataclass
class _Local:
    """This replica's state for one deployment."""

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


class _Batcher:
    """Coalesces concurrent calls into one: while a call is in flight, new items queue for the next."""

    def __init__(self, fn: Callable[[list], Awaitable[list]]) -> None:
        self._fn = fn
        self._pending: list[tuple[object, asyncio.Future]] = []
        self._running = False

    async def submit(self, item: object) -> object:
        fut = asyncio.get_running_loop().create_future()
        self._pending.append((item, fut))
        if not self._running:
            self._running = True
            asyncio.create_task(self._drain())
        return await fut

    async def _drain(self) -> None:
        try:
            while self._pending:
                batch, self._pending = self._pending, []
                try:
                    results = await self._fn([item for item, _ in batch])
                except Exception as exc:  # noqa: BLE001  (handed to every waiter)
                    for _, fut in batch:
                        if not fut.done():
                            fut.set_exception(exc)
                    continue
                for (_, fut), result in zip(batch, results):
                    if not fut.done():
                        fut.set_result(result)
        finally:
            self._running = False


class Balancer:
    def __init__(self, store: Store, metrics: Metrics | None = None, config: BalancerConfig | None = None,
                 on_health: Callable[[bool], None] | None = None) -> None:
        self.store = store
        self.metrics = metrics or Metrics()
        self.config = config or BalancerConfig()
        self.solver = Solver(self.config.plan_workers, self.config.compute_workers)
        self.healthy = True
        self._on_health = on_health
        self._local: dict[str, _Local] = {}
        self._latest: dict[str, pb.Placement] = {}
        self._run_id: str | None = None
        self._tasks: list[asyncio.Task] = []
        self._stopping = False

    # lifecycle

    async def start(self) -> None:
        with contextlib.suppress(ServiceError):
            self._run_id = await self.store.ping()
        self._tasks = [
            asyncio.create_task(self._every(self.config.flush_s, self._flush_all), name="flush"),
            asyncio.create_task(self._every(self.config.tick_s, self._trigger_all), name="trigger"),
            asyncio.create_task(self._every(self.config.tick_s, self._check_health), name="health"),
            asyncio.create_task(self._every(self.config.refresh_s, self._refresh), name="refresh"),
        ]

    async def stop(self) -> None:
        self._stopping = True
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            # The flag ends the loops even if a client library swallowed the cancellation.
            await asyncio.wait(self._tasks, timeout=2.0)
        with contextlib.suppress(ServiceError):
            await self._flush_all()
        for local in self._local.values():
            await local.hub.stop()

    async def _every(self, seconds: float, fn: Callable[[], Awaitable[None]]) -> None:
        while not self._stopping:
            await asyncio.sleep(seconds)
            try:
                await fn()
            except ServiceError as exc:
                log.debug("%s: %s", fn.__name__, exc)
            except Exception:
                log.exception("background task %s failed", fn.__name__)

    async def _check_health(self) -> None:
        try:
            run_id = await self.store.ping()
        except ServiceError:
            self._set_health(False)
            return
        if self._run_id is not None and run_id != self._run_id:
            await self._restore_all(run_id)
        self._run_id = run_id
        self._set_health(True)

    def _set_health(self, ok: bool) -> None:
        if ok != self.healthy:
            log.warning("store %s", "reachable again" if ok else "unreachable")
            self.healthy = ok
            if self._on_health is not None:
                self._on_health(ok)

    async def _restore_all(self, run_id: str) -> None:
        """The store restarted empty: write back every deployment's latest placement we know."""
        for name, local in list(self._local.items()):
            latest = self._latest.get(name)
            if latest is not None and await self.store.restore(local.deployment, latest):
                log.warning("restored deployment %s at version %d after a store restart", name, latest.version)
        self._run_id = run_id

    async def _confirm_deleted(self) -> bool:
        """A deployment looked missing: deleted, or the store restarted (then restore, not deleted)."""
        try:
            run_id = await self.store.ping()
        except ServiceError:
            return False
        if self._run_id is not None and run_id != self._run_id:
            await self._restore_all(run_id)
            return False
        return True

    async def _refresh(self) -> None:
        """Follows every deployment, so this replica can plan, restore and serve all of them."""
        for record in await self.store.list():
            if record.deployment.name not in self._local:
                self._adopt(record.deployment)

    # deployments

    def _adopt(self, deployment: pb.Deployment) -> _Local:
        name = deployment.name
        topo = codec.topology_from(deployment.topology, "deployment.topology")
        spec = codec.window_spec(deployment)
        hub = PlacementHub(self.store, name, on_version=self._seen, confirm_deleted=self._confirm_deleted,
                           gen=deployment.create_time.ToNanoseconds())
        local = _Local(deployment, topo, spec, codec.trigger_spec(deployment),
                       make_window((topo.num_layers, topo.num_experts), spec), hub,
                       frozenset(codec.deployment_ranks(deployment)))
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

    async def _get_local(self, name: str) -> _Local:
        local = self._local.get(name)
        if local is not None and local.hub.deleted:
            self._forget(name)
            local = None
        if local is None:
            record = await self._known(name, lambda: self.store.get(name))
            local = self._local.get(name) or self._adopt(record.deployment)
        return local

    async def create(self, request: pb.CreateDeploymentRequest) -> pb.CreateDeploymentResponse:
        deployment = codec.check_deployment(request.deployment)
        topo = codec.topology_from(deployment.topology, "deployment.topology")
        if await self.store.count() >= limits.MAX_DEPLOYMENTS:
            raise ResourceExhausted(f"this service holds {limits.MAX_DEPLOYMENTS} deployments, its limit; "
                                    "delete one first")
        if request.HasField("initial_phy2log"):
            phy2log = arrays.decode(request.initial_phy2log, "initial_phy2log", (topo.num_layers, topo.num_slots), kinds="iu")
            try:
                placement = eplb.Placement(phy2log, topo)
            except ValueError as exc:
                raise InvalidArgument(FieldViolation("initial_phy2log", str(exc))) from None
        else:
            placement = eplb.Placement.contiguous(topo)
        now = time.time()
        deployment.create_time.FromNanoseconds(int(now * 1e9))
        first = pb.Placement(deployment=deployment.name, version=1, phy2log=arrays.encode(placement.phy2log),
                             stats=pb.PlanStats(policy="initial", policy_used="initial"))
        first.create_time.FromNanoseconds(int(now * 1e9))
        await self.store.create(deployment, first)
        self._forget(deployment.name)  # a stale local copy of an earlier deployment of this name
        self._adopt(deployment)
        self._seen(first)
        out = pb.Deployment()
        out.CopyFrom(deployment)
        out.version = 1
        return pb.CreateDeploymentResponse(deployment=out, placement=first)

    async def get(self, name: str) -> pb.GetDeploymentResponse:
        codec.check_name(name, "name")
        record = await self._known(name, lambda: self.store.get(name))
        acks = await self.store.acks(name)
        out = pb.Deployment()
        out.CopyFrom(record.deployment)
        out.version = record.version
        return pb.GetDeploymentResponse(deployment=out, acks=[
            pb.RankAck(rank=r, version=a.switched, prepared_version=max(a.switched, a.prepared), failed_version=a.failed)
            for r, a in sorted(acks.items())
        ])

    async def list(self) -> pb.ListDeploymentsResponse:
        out = []
        for record in await self.store.list():
            d = pb.Deployment()
            d.CopyFrom(record.deployment)
            d.version = record.version
            out.append(d)
        return pb.ListDeploymentsResponse(deployments=out)

    async def delete(self, name: str) -> None:
        await self.store.delete(name)
        self._forget(name)

    # reports

    async def report(self, request: pb.ReportLoadRequest) -> bool:
        """Validates, deduplicates and windows one report; False for a duplicate ``(rank, seq)``."""
        codec.check_name(request.deployment, "deployment")
        self._check_writable()
        if request.seq >= codec.MAX_SEQ:
            raise InvalidArgument(FieldViolation("seq", f"must be < 2^53, got {request.seq}"))
        local = await self._get_local(request.deployment)
        rejected = self.metrics.reports_rejected
        try:
            codec.check_rank(request.rank, local.ranks, "rank")
        except InvalidArgument:
            rejected.labels(request.deployment, "unknown_rank").inc()
            raise
        topo = local.topology
        kind = request.WhichOneof("counts")
        try:
            if kind == "logical":
                counts = arrays.decode_counts(request.logical, "logical", (topo.num_layers, topo.num_experts),
                                              cap=limits.MAX_REPORT_COUNT)
            elif kind == "physical":
                phys = arrays.decode_counts(request.physical.counts, "physical.counts",
                                            (topo.num_layers, topo.num_slots), cap=limits.MAX_REPORT_COUNT)
                counts = await self._to_logical(local, phys, request.physical.placement_version)
            else:
                raise InvalidArgument(FieldViolation("counts", "set logical or physical"))
        except InvalidArgument as exc:
            over = any("report cap" in v.description for v in exc.violations)
            rejected.labels(request.deployment, "over_cap" if over else "invalid").inc()
            raise
        except FailedPrecondition:
            rejected.labels(request.deployment, "stale_version").inc()
            raise
        if local.batcher is None:
            local.batcher = _Batcher(lambda items, local=local: self._accept(local, items))
        fresh = await local.batcher.submit((request.rank, request.seq, counts))
        self.metrics.reports.labels(request.deployment, "accepted" if fresh else "duplicate").inc()
        return bool(fresh)

    async def _accept(self, local: _Local, items: list[tuple[int, int, np.ndarray]]) -> list[bool]:
        """One store call for a batch of reports; the new ones enter the window as soon as the
        store has them (with their write-ahead entry), in the same step."""
        name, spec = local.deployment.name, local.window_spec

        def journal(fresh: list[bool]) -> bytes:
            sums = sum((c for (_, _, c), f in zip(items, fresh) if f), np.zeros(local.window.shape))
            return encode_sums(sums, sum(fresh), time.time(), spec)

        pairs = [(rank, seq) for rank, seq, _ in items]
        try:
            fresh, entry = await self.store.accept_reports(name, pairs, journal, spec.stale_after_s)
        except NotFound:
            if await self._confirm_deleted():
                raise
            fresh, entry = await self.store.accept_reports(name, pairs, journal, spec.stale_after_s)
        now = time.time()
        for (_, _, counts), f in zip(items, fresh):
            if f:
                local.window.add(counts, now)
                local.dirty = True
        if entry is not None:
            local.unfolded.append(entry)
            if len(local.unfolded) >= _UNFOLDED_MAX and (local.flushing is None or local.flushing.done()):
                # Fold early under a high report rate, so the write-ahead stream stays short.
                local.flushing = asyncio.create_task(self._flush(local, now))
        return fresh

    async def _to_logical(self, local: _Local, phys: np.ndarray, version: int) -> np.ndarray:
        """``phys``: ``[L, P]`` counts recorded under ``version`` → ``[L, E]`` per logical expert."""
        if version == 0:
            raise InvalidArgument(FieldViolation("physical.placement_version", "required: the version the counts were recorded under"))
        phy2log = local.phy2log.get(version)
        if phy2log is None:
            placement = local.hub.ring.get(version)
            if placement is None:
                try:
                    placement = await self.store.placement(local.deployment.name, version)
                except NotFound:
                    raise FailedPrecondition(
                        f"counts are tagged with placement version {version}, which {local.deployment.name!r} "
                        f"does not have (current {local.hub.version}; the last 16 versions are kept)"
                    ) from None
            topo = local.topology
            phy2log = arrays.decode(placement.phy2log, "phy2log", (topo.num_layers, topo.num_slots))
            local.phy2log[version] = phy2log
            while len(local.phy2log) > 16:
                local.phy2log.pop(next(iter(local.phy2log)))
        L, E = local.topology.num_layers, local.topology.num_experts
        index = phy2log.astype(np.int64) + (np.arange(L, dtype=np.int64) * E)[:, None]
        return np.bincount(index.ravel(), weights=phys.ravel(), minlength=L * E).reshape(L, E)

    # placements

    async def placement(self, name: str, version: int = 0) -> pb.Placement:
        """The current placement (version 0) or a recent one. Served from this replica's memory
        while it follows the deployment, and also while the store is unreachable (the last
        version this replica saw); a deployment it knows is never NOT_FOUND after the store
        restarted empty (it is written back first)."""
        codec.check_name(name, "deployment")
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

    def _check_writable(self) -> None:
        """Fails at once while the store is known to be down, rather than after its timeouts."""
        if not self.healthy:
            raise StoreUnavailable("the store is unreachable (this replica's health is NOT_SERVING); retry later")

    async def _known(self, name: str, call: Callable[[], Awaitable[object]]) -> object:
        """``call()``; if the store says NOT_FOUND for a deployment this replica follows, checks
        whether the store restarted empty (then writes everything back) and asks again."""
        try:
            return await call()
        except NotFound:
            if name not in self._local or await self._confirm_deleted():
                raise
            return await call()

    async def watch(self, name: str, since_version: int) -> AsyncIterator[pb.Placement]:
        codec.check_name(name, "deployment")
        local = await self._get_local(name)
        current = local.hub.version or (await self.store.get(name)).version
        if since_version > current:
            raise OutOfRange(f"since_version {since_version} is above {name!r}'s current version {current}; "
                             "pass the last version you received, or 0 for the current one")
        gauge = self.metrics.watchers.labels(name)
        gauge.inc()
        try:
            async for placement in local.hub.watch(since_version):
                yield placement
        finally:
            gauge.dec()

    async def ack(self, request: pb.AckPlacementRequest) -> pb.AckPlacementResponse:
        """Records where a rank stands with a version and answers the version's rollout."""
        codec.check_name(request.deployment, "deployment")
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
        record = await self._known(request.deployment, lambda: self.store.get(request.deployment))
        ranks = codec.deployment_ranks(record.deployment)
        codec.check_rank(request.rank, ranks, "rank")
        if request.version > record.version:
            raise FailedPrecondition(f"version {request.version} is not published yet (current {record.version})")
        rollout = await self.store.ack(request.deployment, request.rank, request.version, request.state,
                                       request.step, ranks, codec.switch_margin(record.deployment))
        name = request.deployment
        if request.state == rollout_states.FAILED:
            log.warning("%s rank %d failed to prepare version %d: %s", name, request.rank, request.version,
                        request.error or "(no error given)")
        for outcome, became, what in (
            ("prepared", rollout.became_prepared, f"every rank prepared, switch at step {rollout.switch_step}"),
            ("switched", rollout.became_switched, "every rank switched"),
            ("failed", rollout.became_failed, "rollout aborted"),
        ):
            if became:
                self.metrics.rollouts.labels(name, outcome).inc()
                log.info("%s version %d: %s", name, request.version, what)
        return rollout.to_pb()

    # planning

    async def rebalance(self, request: pb.RebalanceRequest, deadline_s: float | None = None) -> pb.RebalanceResponse:
        """Plans now; waits for another replica's plan of the deployment (its lease) for up to
        ``deadline_s`` (the caller's time left; None: 60 s)."""
        codec.check_name(request.deployment, "deployment")
        local = await self._get_local(request.deployment)
        if request.dry_run:
            return await self._plan(local, dry_run=True, force=request.force)
        name = request.deployment
        wait_s = 60.0 if deadline_s is None else max(0.0, deadline_s - 0.1)
        # One plan at a time per deployment: the local lock orders this replica's callers, the
        # store's lease (one owner token per attempt) orders the replicas.
        async with local.lock:
            owner = f"{self.config.replica_id}:{uuid.uuid4().hex[:8]}"
            deadline = time.monotonic() + wait_s
            while not await self.store.acquire_lease(name, owner, self.config.lease_s):
                if time.monotonic() > deadline:
                    raise Aborted(f"another replica has been planning {name!r} for over {wait_s:g}s; retry later")
                await asyncio.sleep(0.02)
            async with self._renewing(name, owner):
                try:
                    return await self._plan(local, dry_run=False, force=request.force)
                except Aborted as exc:
                    log.info("plan of %s lost the race: %s", name, exc)
                    raise

    @contextlib.asynccontextmanager
    async def _renewing(self, name: str, owner: str) -> AsyncIterator[None]:
        """Holds the planning lease ``owner`` acquired for as long as the plan runs (renewed every
        third of it), then releases it: a long plan never lets a second replica plan the same
        version, and a crashed planner still blocks the others for one lease at most."""

        async def renew() -> None:
            while True:
                await asyncio.sleep(self.config.lease_s / 3)
                try:
                    if not await self.store.renew_lease(name, owner, self.config.lease_s):
                        log.warning("the planning lease of %s expired while planning; another replica may plan too", name)
                        return
                except ServiceError as exc:
                    log.info("renewing the planning lease of %s failed: %s", name, exc)

        task = asyncio.create_task(renew(), name=f"lease-{name}")
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(ServiceError):
                await self.store.release_lease(name, owner)

    async def _trigger_all(self) -> None:
        """Re-plans every deployment whose trigger is due; one deployment's failure (a store
        error, a window the planner refuses) never keeps the others from re-planning."""
        now = time.time()
        for name, local in list(self._local.items()):
            if not local.trigger.enabled or local.hub.deleted or local.lock.locked():
                continue
            try:
                await self._trigger_one(name, local, now)
            except NotFound:
                continue
            except StoreUnavailable:
                raise  # every deployment would fail alike: the health check reports it
            except Exception as exc:  # noqa: BLE001  (isolated per deployment, counted, logged once)
                self.metrics.replan_failures.labels(name).inc()
                if local.failing is None:
                    log.warning("triggered re-plan of %s failed: %s: %s (logged once until it succeeds)",
                                name, type(exc).__name__, exc)
                local.failing = f"{type(exc).__name__}: {exc}"
            else:
                if local.failing is not None:
                    log.info("triggered re-plans of %s succeed again", name)
                    local.failing = None

    async def _trigger_one(self, name: str, local: _Local, now: float) -> None:
        if due(local.trigger, await self.store.marks(name), now) is None:
            return
        async with local.lock:
            owner = f"{self.config.replica_id}:{uuid.uuid4().hex[:8]}"
            if not await self.store.acquire_lease(name, owner, self.config.lease_s):
                return
            async with self._renewing(name, owner):
                # Re-read under the lease: another replica may have just planned.
                why = due(local.trigger, await self.store.marks(name), time.time())
                if why is not None:
                    log.info("re-planning %s: %s", name, why)
                    try:
                        await self._plan(local, dry_run=False, force=False)
                    except Aborted as exc:
                        log.info("triggered plan of %s lost the race: %s", name, exc)

    async def _plan(self, local: _Local, dry_run: bool, force: bool) -> pb.RebalanceResponse:
        name, topo = local.deployment.name, local.topology
        policy = local.deployment.policy
        start = time.perf_counter()
        now = time.time()
        marks = await self.store.marks(name)
        await self._flush(local, now)
        blobs = await self.store.windows(name)
        loads, reports, stale = sum_blobs(blobs, (topo.num_layers, topo.num_experts), now, local.window_spec.stale_after_s)
        await self.store.drop_windows(name, stale)
        current = await self.store.placement(name)
        previous = arrays.decode(current.phy2log, "phy2log", (topo.num_layers, topo.num_slots))
        options = codec.migration_options(local.deployment.migration, policy)
        budget = local.trigger.max_moves
        if not force and budget and policy in codec.MIGRATION_POLICIES and options.get("max_moves", budget) >= budget:
            # Plan within the trigger's move budget rather than plan past it and be refused.
            options["max_moves"] = budget
        planning, notes = codec.planning_options(local.deployment.planning, policy, topo.num_layers, None)
        fresh = await self._first_plan_is_fresh(name, current, previous, topo)
        if fresh:
            # Nobody loaded weights for the initial contiguous placement yet: a fresh plan, not a
            # repair of it (moves are still counted against it).
            options = {k: v for k, v in options.items() if k not in codec.MIGRATION_FIELDS}
            notes.append("first plan from the initial contiguous placement: planned fresh")
        job = Job(loads, _topology_tuple(topo), policy, None if fresh else previous, {**options, **planning},
                  baseline=previous, expert_bytes=local.deployment.expert_bytes)
        solved = await self.solver.replan(job)
        stats = solved.stats
        stats.notes.extend(notes)
        before = stats.imbalance_before
        candidate = pb.Placement(deployment=name, phy2log=arrays.encode(solved.phy2log), stats=stats)
        candidate.create_time.FromNanoseconds(int(time.time() * 1e9))
        reason = ""
        if not force:
            if not loads.any():
                reason = "the load window is empty"
            else:
                reason = gate(local.trigger, stats.gain_percent, stats.moves) or ""
        response = pb.RebalanceResponse(window_tokens=float(loads.sum()), window_reports=reports)
        if dry_run:
            outcome = "dry_run"
            response.reason = reason or "dry run"
        elif reason:
            outcome = "skipped"
            response.reason = reason
            await self.store.mark_planned(name, marks.reports, now)
        else:
            candidate.version = current.version + 1
            await self.store.publish(name, candidate)
            await self.store.mark_planned(name, marks.reports, now)
            self._seen(candidate)
            response.published = True
            outcome = "published"
            if stats.budget_limited:
                self.metrics.budget_limited.labels(name).inc()
        response.placement.CopyFrom(candidate)
        self.metrics.rebalances.labels(name, policy, outcome).inc()
        self.metrics.rebalance_seconds.labels(name, policy).observe(time.perf_counter() - start)
        log.info("plan %s: %s, imbalance %.4f -> %.4f, %d moves%s", name, outcome, before,
                 stats.imbalance_after, stats.moves, f", version {candidate.version}" if response.published else "")
        return response

    async def _first_plan_is_fresh(self, name: str, current: pb.Placement, phy2log: np.ndarray, topo: eplb.Topology) -> bool:
        """Version 1 is the contiguous placement the service made up, and no rank acked it."""
        if current.version != 1 or current.stats.policy != "initial":
            return False
        if not np.array_equal(phy2log, eplb.Placement.contiguous(topo).phy2log):
            return False  # the engines' own initial placement: keep what they loaded
        return not await self.store.acks(name)

    async def _flush(self, local: _Local, now: float) -> None:
        # The blob and the entries it folds in are taken in one step: a batch accepted while
        # the write is under way stays in ``unfolded`` for the next flush.
        async with local.flush_lock:
            folded, local.unfolded = local.unfolded, []
            local.dirty = False
            local.flushed_at = now
            try:
                await self.store.put_window(local.deployment.name, self.config.replica_id,
                                            encode_blob(local.window, time.time()), folded)
            except BaseException:
                local.unfolded[:0] = folded
                local.dirty = True
                raise

    async def _flush_all(self) -> None:
        now = time.time()
        for local in list(self._local.values()):
            spec = local.window_spec
            # Unchanged windows only change when a bucket expires (decay is applied by the reader),
            # so re-flushing them every flush_s would only cost Redis bandwidth and loop time.
            expiry = spec.duration_s / spec.buckets if spec.kind == "sliding" and spec.duration_s > 0 else float("inf")
            stale = local.flushed_at > 0 and now - local.flushed_at >= expiry
            if local.hub.deleted or not (local.dirty or stale):
                continue
            with contextlib.suppress(NotFound):
                await self._flush(local, now)

    async def compute(self, request: pb.ComputePlacementRequest, deadline_s: float | None) -> pb.ComputePlacementResponse:
        """Stateless: ``loads [L, E]`` (+ optional ``previous_phy2log [L, P]``) → a plan, on the
        bounded compute pool, within ``deadline_s`` (the caller's time left; None: none)."""
        topo = codec.topology_from(request.topology, "topology")
        policy = codec.check_policy(request.policy, "policy")
        loads = arrays.decode_counts(request.loads, "loads", (topo.num_layers, topo.num_experts))
        violations = codec.check_migration(request.migration, policy, "migration")
        violations += codec.check_planning(request.planning, policy, "planning")
        if violations:
            raise InvalidArgument(violations)
        if policy == "ilp":
            codec.check_ilp_size(topo, "topology")
        previous = None
        if request.HasField("previous_phy2log"):
            previous = arrays.decode(request.previous_phy2log, "previous_phy2log", (topo.num_layers, topo.num_slots), kinds="iu")
            try:
                eplb.Placement(previous, topo)
            except ValueError as exc:
                raise InvalidArgument(FieldViolation("previous_phy2log", str(exc))) from None
            previous = previous.astype(np.int32)
        options = codec.migration_options(request.migration, policy) if previous is not None else {}
        planning, notes = codec.planning_options(request.planning, policy, topo.num_layers, deadline_s)
        job = Job(np.asarray(loads, dtype=np.float64), _topology_tuple(topo), policy, previous, {**options, **planning},
                  expert_bytes=request.expert_bytes if previous is not None else 0)
        solved = await self.solver.compute(job, deadline_s)
        solved.stats.notes.extend(notes)
        return pb.ComputePlacementResponse(phy2log=arrays.encode(solved.phy2log), logcnt=arrays.encode(solved.logcnt),
                                           stats=solved.stats)


def _topology_tuple(topo: eplb.Topology) -> tuple[int, int, int, int, int, int]:
    return (topo.num_layers, topo.num_experts, topo.num_slots, topo.num_gpus, topo.num_nodes, topo.num_groups)
