"""``BalancedRank``: one object per engine rank that wires the engine half of eplb together.

Seven parts make a rank follow the balancer: a ``ServiceClient``, the ``LoadReporter`` that
streams what the rank routed, the ``PlacementWatcher`` that hands new versions to a
``Rollout``, whose ``MoverApplier`` moves the weights while the old map serves and whose
barrier (``ProcessGroupBarrier`` with an ``AckSender``, or ``ServiceBarrier``) makes every
rank switch at one step. Wired by hand they have rules that fail late when broken: the
watcher must not ack under a rollout (``ack=False``), the mover needs a process group of its
own (its transfers run on a worker thread while the step thread runs the barrier's
collective), the service barrier switches whole versions only (with the default chunking
``MoverApplier`` a large re-plan fails at run time), and while a chunked version is half
switched physical counts must be folded to experts before they are reported.
``BalancedRank`` wires them so and refuses, with a ``ValueError`` naming the options, the
combinations that cannot work.

A draft model (MTP, speculative decoding) whose MoE layers have experts of their own is a
second deployment on the same ranks (``draft=Draft(...)``): own experts, slots, loads and
versions, its own mover group, watcher and reporter, and its switches agreed with the
target's in one all-reduce a step (``RolloutGroup``), so that when both change they switch
at the same step. The service keeps per-deployment switch steps and nothing across them.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

import eplb

from .client import Endpoints, ServiceClient
from .reporter import LoadReporter
from .rollout import (
    DEFAULT_STAGING_BYTES,
    AckSender,
    Applier,
    Barrier,
    MoverApplier,
    ProcessGroupBarrier,
    Rollout,
    RolloutEvent,
    RolloutGroup,
    ServiceBarrier,
)
from .watcher import PlacementWatcher
from .wire import PublishedPlacement

__all__ = ["BalancedRank", "Draft", "Part", "fold_slot_counts"]

log = logging.getLogger(__name__)

OnSwitch = Callable[[int, tuple[int, ...], eplb.Placement], None]
OnEvent = Callable[[RolloutEvent], None]


@dataclass(frozen=True)
class Draft:
    """A draft model's MoE layers as their own deployment on the same ranks.

    ``deployment``: its name at the service (created like any other, with its own topology:
    its layers, experts and slots on the same gpus); ``layers``: this rank's draft expert
    tensors per layer (``WeightMover``'s ``layers``); ``topology``: checked against the
    service's (``None``: taken from it); ``on_switch`` / ``on_event``: as ``BalancedRank``'s,
    for the draft; ``staging_bytes`` / ``chunk_layers``: the draft's ``MoverApplier`` budget.
    """

    deployment: str
    layers: object
    topology: eplb.Topology | None = None
    on_switch: OnSwitch | None = None
    on_event: OnEvent | None = None
    staging_bytes: int | None = DEFAULT_STAGING_BYTES
    chunk_layers: int | None = None


def fold_slot_counts(counts: object, placement: eplb.Placement) -> object:
    """``counts [L, P]`` tokens per slot (numpy or torch, any device) → ``[L, E]`` tokens per
    expert under ``placement`` (each slot's count added to the expert it holds; an empty slot's,
    -1 on a gpu down, dropped), same kind."""
    topo = placement.topology
    E = topo.num_experts
    held = np.where(placement.phy2log >= 0, placement.phy2log, E)  # empty slots: a column dropped
    if hasattr(counts, "scatter_add"):  # a torch tensor: folded where it lives, no sync
        import torch

        index = torch.from_numpy(held.astype(np.int64)).to(counts.device)
        out = torch.zeros((topo.num_layers, E + 1), dtype=counts.dtype, device=counts.device)
        return out.scatter_add_(1, index, counts)[:, :E].contiguous()
    arr = np.asarray(counts)
    keys = np.arange(topo.num_layers)[:, None] * (E + 1) + held
    folded = np.bincount(keys.ravel(), weights=arr.ravel(), minlength=topo.num_layers * (E + 1))
    return np.ascontiguousarray(folded.reshape(topo.num_layers, E + 1)[:, :E])


class Part:
    """One deployment's parts on this rank: its ``rollout``, ``applier``, ``watcher`` and
    ``reporter``; ``routed`` is what it routes with since the last ``BalancedRank.step``."""

    def __init__(
        self,
        deployment: str,
        topology: eplb.Topology,
        rollout: Rollout,
        applier: Applier,
        watcher: PlacementWatcher,
        reporter: LoadReporter,
    ) -> None:
        self.deployment, self.topology = deployment, topology
        self.rollout, self.applier, self.watcher, self.reporter = rollout, applier, watcher, reporter
        self.routed: PublishedPlacement = rollout.current
        self._mixed = False

    def route_moved(self, published: PublishedPlacement, base: PublishedPlacement, barrier: object = None) -> None:
        """``Rollout.route_moved`` for this part, and ``routed`` from now on (its counts folded
        per expert, as a local survivor placement's are). ``barrier``: the rollout's new one
        (``Rollout.regroup``: over a new membership's group), or None to keep it."""
        if barrier is not None:
            self.rollout.regroup(barrier)
        self.rollout.route_moved(published, base)
        self._stepped(published)

    def _stepped(self, routed: PublishedPlacement) -> None:
        # A survivor placement computed here has a number of this rank's only (the service may
        # publish another map under it): its counts go per expert, as a half-switched map's.
        local = self.rollout.local_survivor
        self.routed, self._mixed = routed, self.rollout.mixed or (local is not None and routed is local)

    def record(self, counts: object, *, copy: bool = True) -> bool:
        """Reports ``counts [L, P]``: the tokens this rank sent to each slot in the step routed
        with ``routed`` (numpy or torch, any device; never blocks). Tagged with the routed
        version; while a chunked version is half switched, or a survivor placement this rank
        computed is routed, no service version describes the map, so they are folded to
        ``[L, E]`` per expert with the map routed and reported so.
        Returns ``LoadReporter.add``'s answer (False: the queue was full, counted)."""
        shape = tuple(getattr(counts, "shape", ()))
        want = (self.topology.num_layers, self.topology.num_slots)
        if shape != want:
            raise ValueError(
                f"{self.deployment}: record() takes slot counts [L, P] = {list(want)}, got {list(shape)} "
                f"(per-expert [L, E] counts go to reporter.add)"
            )
        if self._mixed:
            return self.reporter.add(fold_slot_counts(counts, self.routed.placement), copy=False)
        return self.reporter.add(counts, version=self.routed.version, copy=copy)


class BalancedRank:
    """One engine rank following deployment ``deployment`` at ``addresses``.

    ``rank``: this rank's index in the deployment (its rank in ``group``); ``topology``: the
    deployment's, checked against the service's (``None``: taken from it); ``layers``: this
    rank's expert tensors per MoE layer (``WeightMover``'s ``layers``: name -> ``[S, ...]``);
    ``group``: the engine's expert-parallel process group (``None``: the world).

    Per step: ``placement = rank.step(step).placement`` at the step boundary, route with it,
    then ``rank.record(slot_counts)`` (``[L, P]`` tokens per slot of that step). ``close()`` (or
    the context manager) flushes the loads and stops everything.

    ``barrier``: ``"group"`` (``ProcessGroupBarrier`` on ``group``: a switch agreed by one
    small all-reduce per step, chunked versions, acks sent to the service) or ``"service"``
    (``ServiceBarrier``: the service's ``AckPlacement`` fixes the step; whole versions only, so
    it needs ``staging_bytes=None``). ``mover_group``: the group the mover's transfers use
    (``None``: a new group of ``group``'s ranks, made here: then constructing is collective,
    every rank of the world must construct its ``BalancedRank`` in the same order).
    ``staging_bytes``, ``chunk_layers`` and ``mover_options`` (``verify``, ``layers_per_call``,
    ...) go to the ``MoverApplier``; ``applier``: one of your own instead (then ``layers`` and
    those options must be left out). ``timeout_s``, ``on_event``: the ``Rollout``'s;
    ``on_switch(step, layers, routing)``: write the rows ``layers`` of ``routing`` into the
    engine's maps (on the step thread, weights in place). ``ack_initial``: tell the service
    at start that this rank holds the current version (so its first re-plan moves from it).
    ``report_interval_s``: how often loads go to the service; ``node_agent``: the Unix socket of
    the host's node agent (``eplb agent``), so the host's ranks send one report per interval
    (``LoadReporter``'s). ``draft``: a ``Draft`` model on
    the same ranks, switched with this one (``barrier="group"`` only); its part is ``draft``.
    ``reads``: addresses of the service's reads-only instances (``eplb serve --reads-only``):
    the first placement and the watch go there first, the rest to ``addresses``.

    Its parts stay reachable: ``client``, ``barrier`` (the target's), ``target`` and ``draft``
    (``Part``: ``rollout``, ``applier``, ``watcher``, ``reporter``, ``record``; ``draft`` is
    ``None`` without one); ``rollout``, ``applier``, ``watcher`` and ``reporter`` are the
    target's.
    """

    def __init__(
        self,
        addresses: str | Sequence[str] | Endpoints,
        deployment: str,
        rank: int,
        topology: eplb.Topology | None,
        layers: object,
        group: object = None,
        *,
        barrier: str = "group",
        mover_group: object = None,
        staging_bytes: int | None = DEFAULT_STAGING_BYTES,
        chunk_layers: int | None = None,
        applier: Applier | None = None,
        timeout_s: float = 120.0,
        on_switch: OnSwitch | None = None,
        on_event: OnEvent | None = None,
        ack_initial: bool = True,
        report_interval_s: float = 1.0,
        node_agent: str | None = None,
        token: str | None = None,
        draft: Draft | None = None,
        reads: str | Sequence[str] | None = None,
        **mover_options: object,
    ) -> None:
        if barrier not in ("group", "service"):
            raise ValueError(f"barrier must be 'group' (the engine's process group) or 'service', got {barrier!r}")
        if applier is not None and (layers is not None or mover_options or chunk_layers is not None):
            raise ValueError(
                "applier= replaces the MoverApplier: leave layers (None), chunk_layers and the mover options "
                f"({', '.join(sorted(mover_options)) or 'none given'}) out, or drop applier="
            )
        if barrier == "service":
            if staging_bytes is not None or chunk_layers is not None:
                raise ValueError(
                    "barrier='service' agrees one switch step per version and fails a re-plan the MoverApplier "
                    f"cuts into chunks (staging_bytes={staging_bytes}, chunk_layers={chunk_layers}: large re-plans "
                    "fail at run time): pass staging_bytes=None (every incoming expert staged at once, and no "
                    "chunk_layers) or barrier='group'"
                )
        if draft is not None and barrier == "service":
            raise ValueError(
                "draft= switches the draft's placement with the target's at one step, which only the engine's "
                "process group agrees: use barrier='group' with a draft"
            )
        if draft is not None and draft.deployment == deployment:
            raise ValueError(f"the draft needs a deployment of its own, not {deployment!r} again")
        import torch.distributed as dist

        if not dist.is_initialized():
            raise ValueError("BalancedRank needs torch.distributed initialised (init_process_group) first")
        size, mine = dist.get_world_size(group), dist.get_rank(group)
        if mine != rank:
            raise ValueError(f"rank={rank} but this process is rank {mine} of the group: pass rank={mine}")
        if mover_group is not None and mover_group is group:
            raise ValueError(
                "mover_group must not be the group the barrier runs on: the mover's transfers run on a worker "
                "thread while the step thread runs the barrier, and two threads must not share one group; leave "
                "mover_group=None (a new group is made) or pass dist.new_group()"
            )

        with contextlib.ExitStack() as stack:
            self.client = ServiceClient(addresses, token=token, reads=reads)
            self.client.endpoints.prefer(deployment)  # a deployment's ranks on one instance
            if self.client.reads is not self.client.endpoints:
                self.client.reads.prefer(deployment)  # and its reads on one reader (its fallback spread too)
            stack.callback(self.client.close)
            self.rank, self.deployment = rank, deployment
            ranks = dist.get_process_group_ranks(group) if group is not None else list(range(size))
            specs = [(deployment, topology, layers, applier, on_switch, on_event, staging_bytes, chunk_layers)]
            if draft is not None:
                specs.append(
                    (draft.deployment, draft.topology, draft.layers, None, draft.on_switch, draft.on_event)
                    + (draft.staging_bytes, draft.chunk_layers)
                )
            built: list[Part] = []
            for name, given, tensors, part_applier, switched, event, budget, chunk in specs:
                topo = self._topology(name, given, size)
                if part_applier is None:
                    _check_layers(tensors, topo)
                    # The target may use mover_group; a draft gets a group of its own: the two
                    # deployments' prepares run at once, on their rollouts' workers.
                    movers = mover_group if mover_group is not None and not built else dist.new_group(ranks=ranks)
                    part_applier = MoverApplier(
                        tensors, movers, staging_bytes=budget, chunk_layers=chunk, **mover_options
                    )
                initial = self.client.get_placement(name, topology=topo)
                part_barrier: Barrier = (
                    ProcessGroupBarrier(group, acks=AckSender(self.client, name, rank))
                    if barrier == "group"
                    else ServiceBarrier(self.client, name, rank)
                )
                stack.callback(part_barrier.close)
                rollout = Rollout(
                    initial, part_applier, part_barrier, timeout_s=timeout_s, on_event=event, on_switch=switched
                )
                if ack_initial:
                    self.client.ack(name, rank, initial.version, "switched")
                watcher = PlacementWatcher(
                    self.client.endpoints,
                    name,
                    rollout.offer,
                    topology=topo,
                    rank=rank,
                    ack=False,  # the rollout acks prepared / switched / failed itself
                    since_version=initial.version,
                    reads=self.client.reads,
                )
                stack.callback(watcher.close)
                reporter = LoadReporter(
                    self.client.endpoints, name, rank, topo, interval_s=report_interval_s, node_agent=node_agent
                )
                stack.callback(reporter.close)
                built.append(Part(name, topo, rollout, part_applier, watcher, reporter))
            self.target = built[0]
            self.draft = built[1] if draft is not None else None
            self.barrier = self.target.rollout.barrier
            self._group = RolloutGroup([part.rollout for part in built]) if draft is not None else None
            self._closed = False
            stack.pop_all()

    def _topology(self, deployment: str, given: eplb.Topology | None, size: int) -> eplb.Topology:
        stored = self.client.topology(deployment)
        if given is not None and given != stored:
            raise ValueError(f"topology {given} differs from deployment {deployment!r}'s at the service: {stored}")
        if stored.num_gpus != size:
            raise ValueError(
                f"deployment {deployment!r} has num_gpus = {stored.num_gpus}; the process group has {size} ranks"
            )
        return stored

    # the target's parts, for the common case of one model
    @property
    def rollout(self) -> Rollout:
        return self.target.rollout

    @property
    def applier(self) -> Applier:
        return self.target.applier

    @property
    def watcher(self) -> PlacementWatcher:
        return self.target.watcher

    @property
    def reporter(self) -> LoadReporter:
        return self.target.reporter

    @property
    def parts(self) -> tuple[Part, ...]:
        """The target's ``Part``, then the draft's if there is one."""
        return (self.target,) if self.draft is None else (self.target, self.draft)

    def step(self, step: int) -> PublishedPlacement:
        """At a step boundary (every rank, every step): advances the rollouts and returns the
        target's placement to route with from this step on (``draft.routed``: the draft's).
        Never blocks on the network or the move; at a switch step it writes the staged
        weights (``commit``) before returning."""
        if self._group is None:
            self.target._stepped(self.target.rollout.step(step))
        else:
            for part, routed in zip(self.parts, self._group.step(step)):
                part._stepped(routed)
        return self.target.routed

    def ranks_down(
        self,
        down: Sequence[int],
        group: object,
        mover_group: object,
        *,
        restore: Callable[[int, int], object] | None = None,
        tell_service: bool = True,
        timeout_s: float = 30.0,
    ) -> PublishedPlacement:
        """Ranks ``down`` died (the engine's runtime said so: a collective that timed out, a
        heartbeat): carry on over the survivors. Call it on every survivor, on the step thread
        between two steps, after rebuilding ``group`` (the barrier's) and ``mover_group`` (the
        mover's) over the survivors, e.g. ``dist.new_group(survivors,
        use_local_synchronization=True)`` twice.

        The transition in flight is dropped, the rollout agrees through ``group`` from now on
        and moves weights through ``mover_group`` (``restore``: the loader of experts that no
        live rank holds, ``WeightMover``'s), and the survivor placement every survivor computes
        alike from the current version (``survivors.survivor_plan``) is offered: the next steps
        switch to it (with ``barrier="service"`` nothing is offered here: the service aborts the
        version in flight, and its own survivor placement, the same map, comes through the
        watcher). With ``tell_service`` the service hears of it too (``SetRanksDown``,
        idempotent, so every survivor may send it; an unreachable service is logged, the local
        plan stands). The local plan is known by its (base version, down ranks), not by its
        number (``base + 1``, which the service may give a normal plan in flight): the ranks
        adopt a service version without moving weights only when it is the service's survivor
        plan of that same pair and map (``Rollout`` event ``"adopted"``, acked as switched);
        any other version newer than the base is rolled out as usual, from the local map.
        Returns the survivor placement offered. Ranks are gpus here (the deployment's ranks
        0 .. num_gpus - 1)."""
        import grpc

        from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb

        from .survivors import survivor_plan

        if self.draft is not None:
            raise ValueError("ranks_down with a draft model is not supported: its rollouts share one barrier")
        part = self.target
        applier = part.applier
        if not isinstance(applier, MoverApplier):
            raise ValueError(f"ranks_down needs the MoverApplier, not {type(applier).__name__}: regroup your own")
        rollout = part.rollout
        on_group = isinstance(rollout.barrier, ProcessGroupBarrier)
        if on_group:
            barrier = ProcessGroupBarrier(group, acks=AckSender(self.client, part.deployment, self.rank))
            rollout.regroup(barrier, timeout_s)
            self.barrier = barrier
        applier.group = mover_group
        if restore is not None:
            applier.options["restore"] = restore
        base = rollout.current
        gone = sorted(set(int(r) for r in down) | set(base.down_ranks))
        survivor = survivor_plan(base, gone)
        if on_group:
            rollout.offer(survivor, supersede=True)
        # With the service barrier the switch is the service's to agree (it aborts the version
        # in flight and counts the live ranks): the ranks take its survivor placement, the same
        # map, through the watcher.
        if tell_service:
            try:
                self.client.endpoints.stub().SetRanksDown(
                    pb.SetRanksDownRequest(
                        deployment=part.deployment, down=gone, reason=f"rank {self.rank}: ranks {sorted(down)} died"
                    ),
                    metadata=self.client.endpoints.metadata,
                    timeout=5.0,
                )
            except grpc.RpcError as exc:
                log.warning("SetRanksDown of %s failed (%s): the survivors' own plan stands", part.deployment, exc)
        return survivor

    def record(self, counts: object, *, copy: bool = True) -> bool:
        """The target's ``Part.record``: ``counts [L, P]`` tokens per slot of the step just routed."""
        return self.target.record(counts, copy=copy)

    def close(self, timeout_s: float = 5.0) -> None:
        """Flushes the loads (up to ``timeout_s``), stops the watchers, finishes or rolls back a
        prepare in flight (collective: close every rank at the same step) and sends the acks
        still queued. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for part in self.parts:
            part.reporter.close(timeout_s)
            part.watcher.close()
        for part in self.parts:
            part.rollout.close()
        self.client.close()

    def __enter__(self) -> BalancedRank:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_layers(layers: object, topology: eplb.Topology) -> None:
    """``ValueError`` now, not at the first re-plan, when the tensors do not fit ``topology``."""
    from .mover import _check_layers as check

    if layers is None:
        raise ValueError("layers is needed: this rank's expert tensors per MoE layer (or pass applier=)")
    check(layers, topology.num_layers, topology.slots_per_gpu)
