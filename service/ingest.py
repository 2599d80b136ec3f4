"""Ingestion: a report is checked, mapped to logical experts, deduplicated on ``(rank, seq)``
and, batched with the reports that arrive meanwhile, made durable in the store with its counts
(a write-ahead entry) before it is acknowledged; then it enters this instance's window, which
``flush`` writes to the store, folding the write-ahead entries it covers.
"""

from __future__ import annotations

import asyncio
import logging
import time

import numpy as np

from eplb import limits
from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb

from . import arrays, report_counts, validation
from .batcher import Batcher
from .errors import (
    Aborted,
    FailedPrecondition,
    FieldViolation,
    InvalidArgument,
    NotFound,
    StoreUnavailable,
)
from .local import LocalDeployment
from .metrics import Metrics
from .registry import Registry
from .store import AcceptCall, Store
from .store_health import StoreHealth
from .windows import (
    encode_blob,
    encode_sums,
)

# Write-ahead entries an instance lets pile up before it flushes its window early.
_UNFOLDED_MAX = 64
# Deployments whose reports have at most this many counts share their store calls: the
# batches of all such deployments on one shard (a Redis master) go in one pipeline, since each
# call costs the loop redis-py's call path whatever it carries (docs/service.md, Ingestion at
# scale). Bigger ones get calls of their own, so that their transfers do not hold up the small
# deployments' answers.
SHARED_MAX_COUNTS = 262_144

__all__ = ["Ingest"]

log = logging.getLogger(__name__)


class Ingest:
    """Reports in to ``registry``'s deployments, their windows out to ``store`` under this
    instance's ``replica_id`` (the name the store keys its window blob by); ``health`` refuses reports at once while the store is down.
    ``linger_s``: the group commit of report batches (:class:`.Batcher`), per shard of the store
    for deployments of up to ``SHARED_MAX_COUNTS`` counts a report, per deployment above."""

    def __init__(
        self,
        registry: Registry,
        store: Store,
        health: StoreHealth,
        metrics: Metrics,
        replica_id: str,
        linger_s: float = 0.0,
    ) -> None:
        self.registry = registry
        self.linger_s = linger_s
        self.store = store
        self.health = health
        self.metrics = metrics
        self.replica_id = replica_id
        self._shared: dict[str, Batcher] = {}

    async def report(self, request: pb.ReportLoadRequest) -> bool:
        """Validates, deduplicates and windows one report; False for a duplicate ``(rank, seq)``."""
        validation.check_name(request.deployment, "deployment")
        self.health.check_writable()
        if request.seq >= validation.MAX_SEQ:
            raise InvalidArgument(FieldViolation("seq", f"must be < 2^53, got {request.seq}"))
        local = await self.registry.get(request.deployment)
        rejected = self.metrics.reports_rejected
        try:
            pairs = self._pairs(request, local)
        except InvalidArgument:
            rejected.labels(request.deployment, "unknown_rank").inc()
            raise
        topo = local.topology
        kind = request.WhichOneof("counts")
        try:
            if kind == "logical":
                counts = await report_counts.decode(request.logical, "logical", (topo.num_layers, topo.num_experts))
            elif kind == "physical":
                phys = await report_counts.decode(
                    request.physical.counts, "physical.counts", (topo.num_layers, topo.num_slots)
                )
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
        if request.steps > limits.MAX_REPORT_STEPS:
            raise InvalidArgument(FieldViolation("steps", f"must be <= {limits.MAX_REPORT_STEPS}, got {request.steps}"))
        fresh = await self._batcher(local).submit((local, pairs, counts))
        if fresh is None:
            rejected.labels(request.deployment, "partly_counted").inc()
            raise Aborted(
                f"the node report covers reports already counted on their own ({len(pairs)} covered); "
                "nothing of it was counted: each rank must send its report on its own"
            )
        if fresh:
            local.note_batch(counts, request.steps, time.time())
        for rank, _ in pairs:
            local.saw(rank)  # a duplicate too: the rank is alive
        self.metrics.reports.labels(request.deployment, "accepted" if fresh else "duplicate").inc(len(pairs))
        return bool(fresh)

    @staticmethod
    def _pairs(request: pb.ReportLoadRequest, local: LocalDeployment) -> tuple[tuple[int, int], ...]:
        """The ``(rank, seq)`` reports ``request`` holds: its own, or a node report's covers."""
        if not request.covers:
            validation.check_rank(request.rank, local.ranks, "rank")
            return ((request.rank, request.seq),)
        if request.rank or request.seq:
            raise InvalidArgument(FieldViolation("covers", "a node report (covers set) has rank and seq 0"))
        if len(request.covers) > limits.MAX_REPORT_COVERS:
            raise InvalidArgument(
                FieldViolation(
                    "covers", f"at most {limits.MAX_REPORT_COVERS} reports in a node report, got {len(request.covers)}"
                )
            )
        pairs = []
        for i, cover in enumerate(request.covers):
            validation.check_rank(cover.rank, local.ranks, f"covers[{i}].rank")
            if not 0 < cover.seq < validation.MAX_SEQ:
                raise InvalidArgument(FieldViolation(f"covers[{i}].seq", f"must be in [1, 2^53), got {cover.seq}"))
            pairs.append((cover.rank, cover.seq))
        return tuple(pairs)

    def _batcher(self, local: LocalDeployment) -> Batcher:
        """The batcher of ``local``'s reports, fixed for its life on this instance (so its
        reports reach the store in the order they came)."""
        if local.batcher is None:
            topo = local.topology
            if topo.num_layers * topo.num_experts > SHARED_MAX_COUNTS:
                local.batcher = Batcher(self._accept, self.linger_s)
            else:
                shard = self.store.shard(local.deployment.name)
                shared = self._shared.get(shard)
                if shared is None:
                    shared = self._shared[shard] = Batcher(self._accept, self.linger_s)
                local.batcher = shared
        return local.batcher

    async def _accept(
        self, items: list[tuple[LocalDeployment, tuple[tuple[int, int], ...], np.ndarray]]
    ) -> list[bool | None | Exception]:
        """One store call for a batch of reports (one write-ahead entry per deployment in it);
        the new ones enter their window as soon as the store has them, in the same step. A
        deployment whose call failed fails its own reports only."""
        groups: dict[int, list[int]] = {}
        for i, (local, *_) in enumerate(items):
            groups.setdefault(id(local), []).append(i)
        locals_ = [items[idx[0]][0] for idx in groups.values()]
        calls = [self._call(local, [items[i][1:] for i in idx]) for local, idx in zip(locals_, groups.values())]
        answers: list = await self.store.accept_many(calls)
        gone = [k for k, answer in enumerate(answers) if isinstance(answer, NotFound)]
        if gone:
            # Deleted, or the store restarted empty (written back, then retried): checked
            # together, so that the batch's other deployments wait for one round of checks.
            retried = await asyncio.gather(*(self._retry_gone(calls[k], answers[k]) for k in gone))
            for k, answer in zip(gone, retried):
                answers[k] = answer
        out: list[bool | None | Exception] = [False] * len(items)
        for local, idx, answer in zip(locals_, groups.values(), answers):
            if isinstance(answer, Exception):
                for i in idx:
                    out[i] = answer
                continue
            flags = iter(answer[0])
            # Per report: new (all its pairs new), a duplicate (none), or None (refused).
            fresh = []
            for i in idx:
                mine = [next(flags) for _ in items[i][1]]
                fresh.append(None if None in mine else all(mine))
            self._apply(local, [(items[i][2], len(items[i][1])) for i in idx], fresh, answer[1])
            for i, f in zip(idx, fresh):
                out[i] = f
        return out

    async def _retry_gone(
        self, call: AcceptCall, missing: NotFound
    ) -> tuple[list[bool | None], str | None] | Exception:
        """``call`` found its deployment missing: ``missing`` if it is really gone, else its answer
        once more (after a store that restarted empty got this instance's deployments back)."""
        try:
            if await self.registry.confirm_deleted(call.name):
                return missing
            return await self.store.accept_reports(call.name, call.pairs, call.journal, call.keep_s, call.groups)
        except Exception as exc:  # noqa: BLE001  (this deployment's reports fail with it)
            return exc

    @staticmethod
    def _call(local: LocalDeployment, items: list[tuple[tuple[tuple[int, int], ...], np.ndarray]]) -> AcceptCall:
        """The store call of one deployment's ``(pairs, counts)`` reports (a pair each, or a
        node report's covers: accepted all together or not at all)."""
        spec = local.window_spec
        pairs = [pair for report, _ in items for pair in report]
        groups = [k for k, (report, _) in enumerate(items) for _ in report]
        several = len(pairs) > len(items)

        def journal(fresh: list[bool]) -> bytes:
            flags = iter(fresh)
            # A report's pairs are all new or none (the store sees to it): its first says.
            new = [(counts, len(report)) for report, counts in items if [bool(next(flags)) for _ in report][0]]
            if len(new) == 1:
                sums = new[0][0]  # as it came: an int32 report's entry is its own counts
            else:
                # In place, in report order: one array for the batch rather than one per
                # report; exact int64 sums while every report is integer.
                exact = all(c.dtype.kind == "i" for c, _ in new)
                sums = np.zeros(local.window.shape, dtype=np.int64 if exact else np.float64)
                for counts, _ in new:
                    sums += counts
            return encode_sums(sums, sum(n for _, n in new), time.time(), spec)

        return AcceptCall(local.deployment.name, pairs, journal, spec.stale_after_s, groups if several else None)

    def _apply(
        self, local: LocalDeployment, counts: list[tuple[np.ndarray, int]], fresh: list[bool | None], entry: str | None
    ) -> None:
        """The reports the store accepted (counts, how many reports they sum) into ``local``'s
        window, with their write-ahead entry."""
        now = time.time()
        for (c, n), f in zip(counts, fresh):
            if f:
                local.window.add(c, now, n)
                local.dirty = True
        if entry is not None:
            local.unfolded.append(entry)
            if len(local.unfolded) >= _UNFOLDED_MAX and (local.flushing is None or local.flushing.done()):
                # Fold early under a high report rate, so the write-ahead stream stays short.
                local.flushing = asyncio.create_task(self.flush(local, now))

    async def _to_logical(self, local: LocalDeployment, phys: np.ndarray, version: int) -> np.ndarray:
        """``phys``: ``[L, P]`` counts recorded under ``version`` → ``[L, E]`` per logical expert."""
        if version == 0:
            raise InvalidArgument(
                FieldViolation("physical.placement_version", "required: the version the counts were recorded under")
            )
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
        # Empty slots (-1: a down gpu's) route no token: counts there mean the report was
        # recorded under another placement, and folding them would bin them into the previous
        # layer's last expert.
        empty = phy2log < 0
        if empty.any() and (phys[empty] != 0).any():
            lay, slot = (int(i[0]) for i in np.nonzero(empty & (phys != 0)))
            raise InvalidArgument(
                FieldViolation(
                    "physical.counts",
                    f"layer {lay} slot {slot} has counts but holds no expert in placement version {version} "
                    f"(its gpu is down); counts of empty slots must be 0",
                )
            )
        index = np.where(empty, L * E, phy2log.astype(np.int64) + (np.arange(L, dtype=np.int64) * E)[:, None])
        folded = np.bincount(index.ravel(), weights=phys.ravel(), minlength=L * E + 1)
        return folded[: L * E].reshape(L, E)

    async def flush(self, local: LocalDeployment, now: float) -> None:
        """Writes ``local``'s window to the store, folding the write-ahead entries it covers."""
        # The blob and the entries it folds in are taken in one step: a batch accepted while
        # the write is under way stays in ``unfolded`` for the next flush.
        async with local.flush_lock:
            folded, local.unfolded = local.unfolded, []
            local.dirty = False
            local.flushed_at = now
            try:
                await self.store.put_window(
                    local.deployment.name, self.replica_id, encode_blob(local.window, time.time()), folded
                )
            except BaseException:
                local.unfolded[:0] = folded
                local.dirty = True
                raise

    async def flush_all(self) -> None:
        """Flushes every changed window (and those with a bucket expired since their last flush)."""
        now = time.time()
        unavailable: StoreUnavailable | None = None
        for local in list(self.registry.local.values()):
            spec = local.window_spec
            # Unchanged windows only change when a bucket expires (decay is applied by the reader),
            # so re-flushing them every flush_s would only cost Redis bandwidth and loop time.
            expiry = spec.duration_s / spec.buckets if spec.kind == "sliding" and spec.duration_s > 0 else float("inf")
            stale = local.flushed_at > 0 and now - local.flushed_at >= expiry
            if local.hub.deleted or not (local.dirty or stale):
                continue
            try:
                await self.flush(local, now)
            except NotFound:
                continue
            except StoreUnavailable as exc:
                # On Redis Cluster one master's deployments fail while the others' flush.
                unavailable = exc
        if unavailable is not None:
            raise unavailable
