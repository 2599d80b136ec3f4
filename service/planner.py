"""Planning of deployments: the trigger loop, Rebalance and the survivor plans of SetRanksDown.
One instance plans a deployment at a time (the store's lease, renewed while the plan runs); the
plan itself runs in a worker process (:mod:`.solver`); :func:`.trigger.decide` says whether it
is published. Stateless plans (ComputePlacement) are :mod:`.compute`'s.

Triggered re-plans of different deployments run concurrently, each in a task of its own, so a
large deployment's re-plan never delays a small one's (which plans in the small-plan lane of
:mod:`.solver`); never two of one deployment at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator

import numpy as np

import eplb
from eplb.survivors import survivors
from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb
from eplb_wire.arrays import encode

from . import arrays, codec, validation
from .clip import clip
from .compute import topology_tuple
from .config import BalancerConfig
from .errors import (
    Aborted,
    FailedPrecondition,
    FieldViolation,
    InvalidArgument,
    NotFound,
    ServiceError,
    StoreUnavailable,
)
from .ingest import Ingest
from .local import LocalDeployment
from .metrics import Metrics
from .registry import Registry
from .solver import Job, Solver
from .store import Store
from .store_health import StoreHealth
from .trigger import decide, due, next_check
from .windows import (
    sum_blobs,
)

__all__ = ["Planner"]

log = logging.getLogger(__name__)
audit = logging.getLogger("eplb_service.audit")


class Planner:
    """Re-plans of ``registry``'s deployments on ``solver``'s re-plan workers; ``ingest``
    flushes this instance's window before a plan reads the store's."""

    def __init__(
        self,
        registry: Registry,
        ingest: Ingest,
        solver: Solver,
        store: Store,
        health: StoreHealth,
        metrics: Metrics,
        config: BalancerConfig,
    ) -> None:
        self.registry = registry
        self.ingest = ingest
        self.solver = solver
        self.store = store
        self.health = health
        self.metrics = metrics
        self.config = config
        # The triggered re-plans in flight: deployment → (its task, whether it is small).
        self._triggered: dict[str, tuple[asyncio.Task, bool]] = {}

    async def rebalance(self, request: pb.RebalanceRequest, deadline_s: float | None = None) -> pb.RebalanceResponse:
        """Plans now; waits for another instance's plan of the deployment (its lease) for up to
        ``deadline_s`` (the caller's time left; None: 60 s)."""
        validation.check_name(request.deployment, "deployment")
        local = await self.registry.get(request.deployment)
        # A plan reads the window from the store and a publication writes to it.
        self.health.check_writable()
        if request.dry_run:
            return await self._plan(local, dry_run=True, force=request.force)
        name = request.deployment
        wait_s = 60.0 if deadline_s is None else max(0.0, deadline_s - 0.1)
        # One plan at a time per deployment: the local lock orders this instance's callers, the
        # store's lease (one owner token per attempt) orders the instances.
        async with local.lock:
            owner = f"{self.config.replica_id}:{uuid.uuid4().hex[:8]}"
            deadline = time.monotonic() + wait_s
            while not await self.store.acquire_lease(name, owner, self.config.lease_s):
                if time.monotonic() > deadline:
                    raise Aborted(f"another instance has been planning {name!r} for over {wait_s:g}s; retry later")
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
        third of it), then releases it: a long plan never lets a second instance plan the same
        version, and a crashed planner still blocks the others for one lease at most."""

        async def renew() -> None:
            while True:
                await asyncio.sleep(self.config.lease_s / 3)
                try:
                    if not await self.store.renew_lease(name, owner, self.config.lease_s):
                        log.warning(
                            "the planning lease of %s expired while planning; another instance may plan too", name
                        )
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

    async def trigger_all(self) -> None:
        """Starts a re-plan of every deployment whose trigger is due, each in a task of its own
        (:meth:`_trigger`), so one deployment's long plan never delays another's; never two of
        one deployment. At most as many run as the workers can take: ``Solver.workers`` large
        ones, and ``Solver.workers + Solver.small_workers`` in all (a small one also plans in a
        re-plan worker when its lane is busy); a due deployment past that starts on a later
        tick. One deployment's failure (a store error, a window the planner refuses) never keeps
        the others from re-planning."""
        now = time.time()
        workers = max(1, self.solver.workers)
        capacity = workers + (self.solver.small_workers if self.solver.workers else 0)
        for name, local in list(self.registry.local.items()):
            if not local.trigger.enabled or local.hub.deleted or local.lock.locked() or name in self._triggered:
                continue
            small = (
                self.solver.workers > 0
                and self.solver.small_workers > 0
                and self.solver.is_small_topology(topology_tuple(local.topology))
            )
            running = [s for _, s in self._triggered.values()]
            if len(running) >= capacity or (not small and running.count(False) >= workers):
                continue
            if now < local.next_trigger_check:
                continue
            try:
                marks = await self.store.marks(name)
                if due(local.trigger, marks, now) is None:
                    local.next_trigger_check = next_check(local.trigger, marks, now)
                    self._succeeded(name, local)
                    continue
            except NotFound:
                continue
            except StoreUnavailable:
                if name in self.health.down:
                    continue  # its Redis Cluster master is down; the others re-plan
                raise  # every deployment would fail alike: the health check reports it
            except Exception as exc:  # noqa: BLE001  (isolated per deployment, counted, logged once)
                self._failed(name, local, exc)
                continue
            task = asyncio.create_task(self._trigger(name, local), name=f"replan-{name}")
            self._triggered[name] = (task, small)
            task.add_done_callback(lambda done, name=name: self._done(name, done))

    def _done(self, name: str, task: asyncio.Task) -> None:
        if self._triggered.get(name, (None,))[0] is task:
            del self._triggered[name]

    async def stop(self) -> None:
        """Cancels the triggered re-plans in flight (their leases are released) and waits for them."""
        tasks = [task for task, _ in self._triggered.values()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=2.0)

    async def _trigger(self, name: str, local: LocalDeployment) -> None:
        """One triggered re-plan, isolated: its failure is counted and logged once per change."""
        try:
            await self._trigger_one(name, local)
        except NotFound:
            pass
        except StoreUnavailable as exc:
            # Its Redis Cluster master is down, or the whole store (the health check reports it).
            log.debug("triggered re-plan of %s: %s", name, exc)
        except Exception as exc:  # noqa: BLE001  (isolated per deployment, counted, logged once)
            self._failed(name, local, exc)
        else:
            self._succeeded(name, local)

    def _failed(self, name: str, local: LocalDeployment, exc: Exception) -> None:
        self.metrics.replan_failures.labels(name).inc()
        if local.failing is None:
            log.warning(
                "triggered re-plan of %s failed: %s: %s (logged once until it succeeds)",
                name,
                type(exc).__name__,
                exc,
            )
        local.failing = f"{type(exc).__name__}: {exc}"

    def _succeeded(self, name: str, local: LocalDeployment) -> None:
        if local.failing is not None:
            log.info("triggered re-plans of %s succeed again", name)
            local.failing = None

    async def _trigger_one(self, name: str, local: LocalDeployment) -> None:
        async with local.lock:
            owner = f"{self.config.replica_id}:{uuid.uuid4().hex[:8]}"
            if not await self.store.acquire_lease(name, owner, self.config.lease_s):
                return
            async with self._renewing(name, owner):
                # Re-read under the lease: another instance may have just planned.
                why = due(local.trigger, await self.store.marks(name), time.time())
                if why is not None:
                    log.info("re-planning %s: %s", name, why)
                    try:
                        await self._plan(local, dry_run=False, force=False, asked=False)
                    except Aborted as exc:
                        log.info("triggered plan of %s lost the race: %s", name, exc)

    async def _plan(
        self, local: LocalDeployment, dry_run: bool, force: bool, asked: bool = True
    ) -> pb.RebalanceResponse:
        """One plan of ``local`` from its window: published, skipped (the trigger's gates) or a
        dry run. ``asked``: a caller's Rebalance (an empty window is FAILED_PRECONDITION), not
        the trigger's."""
        name, topo = local.deployment.name, local.topology
        policy = local.deployment.policy
        start = time.perf_counter()
        now = time.time()
        marks = await self.store.marks(name)
        await self.ingest.flush(local, now)
        blobs = await self.store.windows(name)
        loads, reports, stale = sum_blobs(
            blobs, (topo.num_layers, topo.num_experts), now, local.window_spec.stale_after_s
        )
        await self.store.drop_windows(name, stale)
        if not loads.any():
            # A plan of no load is a plan of nothing (from the first-plan path, a fresh one that
            # moves most slots), forced or not, dry or not: nothing is planned and the placement
            # in service stays. A caller is told so; the trigger (an interval that came round
            # with no report since) notes the round as planned, as a skipped plan would.
            if not asked:
                await self.store.mark_planned(name, marks.reports, now)
                self.metrics.rebalances.labels(name, policy, "skipped").inc()
                return pb.RebalanceResponse(reason="the load window is empty", window_reports=reports)
            raise FailedPrecondition(
                f"the load window of {name!r} is empty (no load reported, or all of it older than "
                f"stale_after_s): there is nothing to plan from, so the current placement stays"
            )
        current = await self.store.placement(name)
        previous = arrays.decode(current.phy2log, "phy2log", (topo.num_layers, topo.num_slots))
        options = codec.migration_options(local.deployment.migration, policy)
        down = codec.down_gpus(local.deployment, current)
        if down:
            # The ranks down stay out of every plan until SetRanksDown brings them back.
            options["down_gpus"] = down
        learned = None
        notes = []
        p = local.deployment.planning
        if p.kernel_model and not p.tokens_per_gpu:
            learned = local.batch_sizes(now)
            notes.append(
                "planned for time at the reports' tokens per gpu per step "
                + ", ".join(f"{b} ({w:.0%})" for b, w in learned)
                if learned
                else "planned for tokens: no report in the window says its steps (ReportLoadRequest.steps), "
                "so the batch sizes to plan for time are unknown"
            )
        planning = codec.planning_options(p, policy, topo.num_layers, None, local.trigger.interval_s, learned)
        if not dry_run and self.config.layer_workers > 1 and policy != "ilp" and codec.accepts(policy, "workers"):
            planning["workers"] = self.config.layer_workers
        fresh = await self._first_plan_is_fresh(name, current, previous, topo)
        if fresh:
            # Nobody loaded weights for the initial contiguous placement yet: a fresh plan, not a
            # repair of it (moves are still counted against it).
            options = {k: v for k, v in options.items() if k not in codec.MIGRATION_FIELDS}
            notes.append("first plan from the initial contiguous placement: planned fresh")
        job = Job(
            loads,
            topology_tuple(topo),
            policy,
            None if fresh else previous,
            {**options, **planning},
            baseline=previous,
            expert_bytes=local.deployment.expert_bytes,
        )
        # A dry run publishes nothing, so any caller may ask for many: it plans on the bounded
        # capacity of stateless calls, never on the re-plans' own.
        solved = await (self.solver.compute(job, None) if dry_run else self.solver.replan(job))
        stats = solved.stats
        stats.notes.extend(notes)
        before = stats.imbalance_before
        candidate = pb.Placement(
            deployment=name,
            phy2log=encode(solved.phy2log),
            stats=stats,
            down_ranks=current.down_ranks,
            down_ranks_version=current.down_ranks_version,
            loads=encode(loads.astype(np.float32)),
            eplb_version=codec.EPLB_VERSION,
        )
        candidate.create_time.FromNanoseconds(int(time.time() * 1e9))
        reason = (
            decide(
                local.trigger,
                float(loads.sum()),
                # A plan for time is judged by the time it saves, not by its token imbalance.
                stats.predicted_gain_percent if stats.predicted_ms else stats.gain_percent,
                stats.moves,
                force,
                saved_ms=stats.predicted_saved_ms if stats.predicted_ms else None,
                stall_s=stats.transfer.predicted_seconds if stats.HasField("transfer") else 0.0,
            )
            or ""
        )
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
            self.registry.seen(candidate)
            response.published = True
            outcome = "published"
            if stats.budget_limited:
                self.metrics.budget_limited.labels(name).inc()
        response.placement.CopyFrom(candidate)
        self.metrics.rebalances.labels(name, policy, outcome).inc()
        self.metrics.rebalance_seconds.labels(name, policy).observe(time.perf_counter() - start)
        log.info(
            "plan %s: %s, imbalance %.4f -> %.4f, %d moves%s",
            name,
            outcome,
            before,
            stats.imbalance_after,
            stats.moves,
            f", version {candidate.version}" if response.published else "",
        )
        return response

    async def publish_survivors(
        self, local: LocalDeployment, down: set[int], up: set[int], who: str, reason: str, deadline_s: float | None
    ) -> pb.SetRanksDownResponse:
        """Marks ``down`` ranks down and ``up`` ranks up; a change publishes a survivor placement
        at once (the current placement's experts carried onto the live gpus, lost ones
        restored; ``codec.SURVIVOR_*``), past the gain gate and the move budget. Under the
        planning lease, so no re-plan of the same version publishes meanwhile."""
        name, topo = local.deployment.name, local.topology
        wait_s = 60.0 if deadline_s is None else max(0.0, deadline_s - 0.1)
        async with local.lock:
            owner = f"{self.config.replica_id}:{uuid.uuid4().hex[:8]}"
            deadline = time.monotonic() + wait_s
            while not await self.store.acquire_lease(name, owner, self.config.lease_s):
                if time.monotonic() > deadline:
                    raise Aborted(f"another instance has been planning {name!r} for over {wait_s:g}s; retry later")
                await asyncio.sleep(0.02)
            async with self._renewing(name, owner):
                current = await self.store.placement(name)
                was = set(current.down_ranks)
                now_down = (was | down) - up
                if now_down == was:
                    return pb.SetRanksDownResponse(down_ranks=sorted(was), published=False, placement=current)
                ranks = codec.gpu_ranks(local.deployment)
                gpus = [g for g, r in enumerate(ranks) if r in now_down]
                try:
                    survivors(topo, gpus)
                except ValueError as exc:
                    raise InvalidArgument(
                        FieldViolation("down", f"ranks {sorted(now_down)} down (gpus {gpus}) leave too few: {exc}")
                    ) from None
                shape = (topo.num_layers, topo.num_slots)
                previous = arrays.decode(current.phy2log, "phy2log", shape).astype(np.int32)
                job = Job(
                    codec.survivor_loads(current, (topo.num_layers, topo.num_experts)),
                    topology_tuple(topo),
                    codec.SURVIVOR_POLICY,
                    previous,
                    {**codec.SURVIVOR_OPTIONS, "down_gpus": gpus},
                    baseline=previous,
                    expert_bytes=local.deployment.expert_bytes,
                )
                start = time.perf_counter()
                solved = await self.solver.replan(job)
                stats = solved.stats
                stats.notes.append(
                    f"survivor plan (SetRanksDown): ranks down {sorted(now_down)} (were {sorted(was)}), from version "
                    f"{current.version}; published past the gain gate and the move budget"
                )
                version = current.version + 1
                out = pb.Placement(
                    deployment=name,
                    version=version,
                    phy2log=encode(solved.phy2log),
                    stats=stats,
                    down_ranks=sorted(now_down),
                    down_ranks_version=version,
                    survivor_of=current.version,
                    eplb_version=codec.EPLB_VERSION,
                )
                if current.HasField("loads"):
                    out.loads.CopyFrom(current.loads)
                out.create_time.FromNanoseconds(int(time.time() * 1e9))
                await self.store.publish(name, out)
                self.registry.seen(out)
        self.metrics.rebalances.labels(name, codec.SURVIVOR_POLICY, "survivor").inc()
        self.metrics.rebalance_seconds.labels(name, codec.SURVIVOR_POLICY).observe(time.perf_counter() - start)
        audit.warning(
            "audit: SetRanksDown %s by %s: ranks down %s -> %s (%s); published survivor version %d "
            "(%d moves, %d restored, imbalance %.4f)",
            name,
            who or "unknown peer",
            sorted(was),
            sorted(now_down),
            clip(reason, 256) if reason else "no reason given",
            version,
            stats.moves,
            stats.transfer.restored_experts,
            stats.imbalance_after,
            extra={"audit": "set_ranks_down", "deployment": name, "peer": who, "down_ranks": sorted(now_down)},
        )
        return pb.SetRanksDownResponse(down_ranks=sorted(now_down), published=True, placement=out)

    async def _first_plan_is_fresh(
        self, name: str, current: pb.Placement, phy2log: np.ndarray, topo: eplb.Topology
    ) -> bool:
        """Version 1 is the contiguous placement the service made up, and no rank acked it."""
        if current.version != 1 or current.stats.policy != "initial":
            return False
        if not np.array_equal(phy2log, eplb.Placement.contiguous(topo).phy2log):
            return False  # the engines' own initial placement: keep what they loaded
        return not await self.store.acks(name)
