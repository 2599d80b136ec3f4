"""``eplb demo``: the whole loop on one CPU in under a minute.

The balancer service runs on loopback (in-memory store). ``--ranks`` simulated engine ranks,
each its own process in one gloo group, route tokens whose expert popularity drifts and then
shifts (``eplb.workloads.shift``), report what they routed through the real ``LoadReporter``,
receive placements through the real ``PlacementWatcher``, move their expert weights with the
real ``WeightMover`` and switch maps at one step on every rank through the rollout protocol
(``Rollout`` with the process-group barrier, or ``--barrier service``), all wired by one
``BalancedRank`` per rank. With the process-group
barrier each re-plan is switched in chunks of at most two layers, each chunk's receives within
a budget of one gpu's worth of slots and each chunk switched at its own agreed step.

Every expert weight encodes its (layer, expert, tensor) in its values. At every step the
ranks all-reduce a histogram of where their tokens went (layer, slot, expert), like an
all-to-all dispatch, and each rank checks its own slots: every token must reach a slot whose
weights are its expert's. Misrouted dispatches are counted, and must be zero.

``--fail-rank R --fail-at STEP`` kills rank R at that step; the survivors detect it, regroup and
switch to the survivor placement (``demo_failure``; the gloo store is this process's).
``--rejoin-at STEP`` starts it again at that step: once up it joins them at a step they agree,
loads its weights and is planned in again (``demo_rejoin``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import multiprocessing as mp
import os
import queue
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path

import numpy as np

import eplb
from eplb.workloads import shift, zipf
from eplb_engine import membership

from . import extras
from .args import OneLineParser
from .demo_failure import Failure, lost_experts
from .demo_failure import summarize as summarize_failure
from .demo_rejoin import Rejoin
from .pipes import INTERRUPTED_STATUS

__all__ = ["DemoConfig", "run", "main"]

# Weight values encode (layer, expert, tensor): exact in float32 for these small ids.
_CODE_LAYER, _CODE_EXPERT = 4096, 4
_TENSORS = {"w13": (8, 4), "w2": (4, 4), "w13_scale": (2,)}  # name -> per-slot shape
_AFTER_STEPS = 25  # steps averaged for the measured imbalance before / after a switch
_MOVER_TIMEOUT_S = 10.0  # with --fail-rank: the mover groups' gloo timeout
_FLUSHED_KEY = "down/flushed"  # + "/R": rank R's results are flushed, the parent may kill it


@dataclass(frozen=True)
class DemoConfig:
    """Everything a run uses; the defaults are the README's ``eplb demo``."""

    ranks: int = 4
    seconds: float = 20.0
    step_ms: float = 20.0
    layers: int = 6
    experts: int = 32
    redundant: float = 0.25  # redundant slots, a share of the experts
    groups: int = 4
    tokens: int = 1024
    topk: int = 4
    zipf_s: float = 1.0
    drift_sigma: float = 0.05
    replan_s: float = 1.0
    window_s: float = 2.0
    min_gain_percent: float = 3.0
    barrier: str = "group"
    draft_layers: int = 0  # a draft model's MoE layers, its own deployment (0: none)
    # Service barrier: steps from the last PREPARED ack to the switch. 0.5 s at 20 ms steps: a
    # shared 2-core machine can hold up a rank's ack thread for longer than the default 8 steps.
    switch_margin_steps: int = 25
    seed: int = 0
    deployment: str = "demo"
    fail_rank: int = -1  # --fail-rank: the rank killed at step fail_at (-1: none)
    fail_at: int = 0
    rejoin_at: int = 0  # --rejoin-at: the step at which fail_rank is restarted (0: never)
    address: str = ""
    gloo_port: int = 0  # the parent's TCPStore (the gloo rendezvous)

    @property
    def topology(self) -> eplb.Topology:
        return self._topology(self.layers, self.experts)

    @property
    def draft_topology(self) -> eplb.Topology:
        """The draft model's MoE layers: ``draft_layers`` layers of half the experts (its own)."""
        return self._topology(self.draft_layers, self.experts // 2)

    @property
    def draft_deployment(self) -> str:
        return f"{self.deployment}-draft"

    def _topology(self, layers: int, experts: int) -> eplb.Topology:
        nodes = 2 if self.ranks % 2 == 0 else 1
        slots_per_gpu = -(-round(experts * (1 + self.redundant)) // self.ranks)
        if self.fail_rank >= 0:
            # The survivors must hold every expert: 40 slots on 4 gpus leave 30 for 32 experts.
            slots_per_gpu = max(slots_per_gpu, -(-experts // (self.ranks - 1)))
        groups = math.gcd(self.groups, experts)
        return eplb.Topology(layers, experts, slots_per_gpu * self.ranks, self.ranks, nodes, groups)

    @property
    def steps(self) -> int:
        return max(1, int(self.seconds * 1000 / self.step_ms))


def popularity(cfg: DemoConfig, topo: eplb.Topology | None = None, seed: int | None = None) -> np.ndarray:
    """``[T, L, E]`` expert popularity per phase (rows sum to 1) of ``topo``'s experts
    (default: the target's, with ``cfg.seed``): zipf drifting, reshuffled halfway."""
    topo = topo or cfg.topology
    seed = cfg.seed if seed is None else seed
    base = zipf(topo.num_layers, topo.num_experts, cfg.zipf_s, seed)
    seq = shift(base, 40, sigma=cfg.drift_sigma, seed=seed)
    return seq / seq.sum(axis=-1, keepdims=True)


def make_weights(topo: eplb.Topology, rank: int, placement: eplb.Placement) -> list[dict]:
    """This rank's expert tensors per layer, name -> ``[S, ...]``, each slot filled with its code."""
    import torch

    S = topo.slots_per_gpu
    out = []
    for layer in range(topo.num_layers):
        experts = torch.from_numpy(placement.phy2log[layer, rank * S : (rank + 1) * S].astype(np.float32))
        tensors = {}
        for t, (name, shape) in enumerate(sorted(_TENSORS.items())):
            code = layer * _CODE_LAYER + experts * _CODE_EXPERT + t
            tensors[name] = code.reshape(S, *([1] * len(shape))).expand(S, *shape).contiguous()
        out.append(tensors)
    return out


def slot_experts(layers: list[dict], topo: eplb.Topology) -> np.ndarray:
    """int64 ``[L, S]``: the expert whose weights each local slot holds, -1 where its tensors
    disagree with each other or within themselves (a torn or wrong copy)."""
    S = topo.slots_per_gpu
    out = np.empty((topo.num_layers, S), dtype=np.int64)
    for layer, tensors in enumerate(layers):
        found = None
        for t, name in enumerate(sorted(_TENSORS)):
            flat = tensors[name].reshape(S, -1)
            lo, hi = flat.amin(1).numpy(), flat.amax(1).numpy()
            expert = (lo - layer * _CODE_LAYER - t) / _CODE_EXPERT
            ok = (lo == hi) & (expert == np.round(expert)) & (expert >= 0)
            expert = np.where(ok, expert, -1).astype(np.int64)
            found = expert if found is None else np.where(found == expert, found, -1)
        out[layer] = found
    return out


def misrouted_here(dispatched: np.ndarray, layers: list[dict], topo: eplb.Topology, rank: int) -> int:
    """``dispatched [L, P, E]``: tokens every rank sent to each (layer, slot) for each expert →
    how many of those reaching this rank's slots found another expert's weights there (or a
    torn copy)."""
    S = topo.slots_per_gpu
    mine = dispatched[:, rank * S : (rank + 1) * S]
    holds = slot_experts(layers, topo)
    right = np.take_along_axis(mine, np.maximum(holds, 0)[..., None], axis=2)[..., 0] * (holds >= 0)
    return int(mine.sum() - right.sum())


def route(counts: np.ndarray, placement: eplb.Placement, offset: int) -> np.ndarray:
    """``counts [L, E]`` tokens per expert → ``[L, P, E]`` tokens per (layer, slot, expert): each
    expert's tokens split evenly over its replicas (``offset`` rotates who takes the remainder)."""
    topo = placement.topology
    L, E, P = topo.num_layers, topo.num_experts, topo.num_slots
    log2phy, cnt = placement.log2phy, placement.logcnt.astype(np.int64)
    r = np.arange(log2phy.shape[2])
    share = (counts // cnt)[..., None] + (((r - offset) % cnt[..., None]) < (counts % cnt)[..., None])
    valid = log2phy >= 0
    lay = np.broadcast_to(np.arange(L)[:, None, None], log2phy.shape)
    exp = np.broadcast_to(np.arange(E)[None, :, None], log2phy.shape)
    index = (lay[valid] * P + log2phy[valid]) * E + exp[valid]
    return np.bincount(index, weights=share[valid], minlength=L * P * E).reshape(L, P, E)


def _rank_main(rank: int, cfg: DemoConfig, events: mp.Queue, restarted: bool = False) -> None:
    """One simulated engine rank: route, report, watch, move, switch, verify; results to ``events``.
    ``restarted``: rank ``cfg.fail_rank`` started again (``--rejoin-at``): it joins the
    survivors at the step they agree (``demo_rejoin``) and routes from there."""
    import torch
    import torch.distributed as dist

    from eplb_engine import BalancedRank, Draft

    torch.set_num_threads(1)
    store = _connect(rank, cfg, restarted)
    events.put(("up", {"rank": rank}))  # torch imported and the group joined: seconds of start-up
    failing = cfg.fail_rank >= 0
    rejoining = cfg.rejoin_at > 0
    # The mover's transfers on a group with a short timeout: a prepare in flight when a rank
    # dies waits on a live peer that gave up at most that long (ranks_down waits for it). The
    # restarted rank's is set at the join (the world here only stands in for it).
    mover_group = None
    if failing:
        mover_group = dist.group.WORLD if restarted else dist.new_group(timeout=timedelta(seconds=_MOVER_TIMEOUT_S))
    # The models: the target, and the draft's MoE layers (their own deployment) with --draft-layers.
    models = [_Model("target", cfg.topology, cfg.deployment, cfg.seed)]
    if cfg.draft_layers:
        models.append(_Model("draft", cfg.draft_topology, cfg.draft_deployment, cfg.seed + 1))
    for model in models:
        # The rank's weights start as the service's version 1 (the contiguous map the demo
        # creates); a restarted rank's hold nothing (NaN: no expert's code) until the join.
        model.layers = make_weights(model.topo, rank, eplb.Placement.contiguous(model.topo))
        if restarted:
            for tensors in model.layers:
                for t in tensors.values():
                    t.fill_(float("nan"))
        model.pop = popularity(cfg, model.topo, model.seed)
    # Chunks of at most two layers within a small receive-buffer budget (one gpu's slots: any
    # one layer fits), so CI runs the chunked rollout; the service barrier agrees one step per
    # version, so it moves versions whole.
    slot_bytes = sum(4 * int(np.prod(shape)) for shape in _TENSORS.values())
    S = cfg.topology.slots_per_gpu
    staging, chunk_layers = (S * slot_bytes, 2) if cfg.barrier == "group" else (None, None)
    pending: list[dict] = []
    done_events: list[dict] = []

    def on_event(model: _Model) -> Callable[[object], None]:
        def record(event: object) -> None:
            item = {
                "model": model.name,
                "kind": event.kind,
                "version": event.version,
                "step": event.step,
                "prepare_s": event.prepare_seconds,
                "wait_s": event.wait_seconds,
                "error": event.error,
            }
            if event.kind == "switched":
                part = balanced.parts[models.index(model)]
                sched, report, stats = part.applier.schedule, part.applier.report, part.rollout.current.stats
                item.update(
                    bytes=sched.bytes,
                    rounds=sched.total_rounds,
                    predicted_s=sched.predicted_seconds,
                    commit_s=part.applier.commit_seconds,
                    checked_slots=report.checked_slots,
                    mismatches=len(report.mismatches),
                    chunks=event.chunks,
                    staged_bytes=part.applier.staged_bytes,
                    staging_bytes=staging,
                    planned_before=stats.imbalance_before,
                    planned_after=stats.imbalance_after,
                    moves=stats.moves,
                    survivor_of=part.rollout.current.survivor_of,
                )
            pending.append(item)

        return record

    draft = None
    if cfg.draft_layers:
        draft = Draft(
            cfg.draft_deployment,
            models[1].layers,
            cfg.draft_topology,
            on_event=on_event(models[1]),
            staging_bytes=staging,
            chunk_layers=chunk_layers,
        )
    # One object wires the client, the reporters, the watchers, the rollouts, their barrier and
    # the movers (on process groups of their own, so their transfers never hold up the steps'
    # collectives), and acks version 1 before any load is reported: the service's first
    # re-plan then keeps what it can (without an ack it plans v2 fresh: docs/service.md).
    balanced = BalancedRank(
        cfg.address,
        cfg.deployment,
        rank,
        cfg.topology,
        models[0].layers,
        barrier=cfg.barrier,
        staging_bytes=staging,
        chunk_layers=chunk_layers,
        timeout_s=30.0,
        on_event=on_event(models[0]),
        report_interval_s=0.25,
        draft=draft,
        mover_group=mover_group,
        verify=True,
        # A restarted rank holds no version yet: it acks the plan it joins with.
        ack_initial=not restarted,
    )
    rng = np.random.default_rng(cfg.seed * 1000 + rank + 1)
    live = list(range(cfg.ranks))
    # the steps' collectives: the world, the survivors' group, then the epoch's after a rejoin
    step_group = None
    failure: Failure | None = None
    backup, kept = None, -1
    if failing:
        from eplb_engine.backup import HostExpertBackup, at_risk

        from .demo_failure import checkpoint

        # The restore loader: host copies of the experts another gpu alone holds, refreshed at
        # each version; anything else from the "checkpoint" (the weights' code).
        backup = HostExpertBackup(checkpoint(_TENSORS, _code), budget_bytes=1 << 20, pin=False)
    rejoin = Rejoin() if restarted else None
    first_step = 0
    if restarted:
        membership.mark_ready(store)
        rejoin.ready_wall = time.time()
        go = membership.wait_join(store)
        if go is None:  # the run ended first
            empty = dict(rank=rank, seconds=0.0, steps_routed=0, events=[], late=0, models={})
            _leave(events, ("done", {**empty, "rejoin": rejoin.as_dict()}))
        first_step = go.step
        # Its series indexed by step as everyone's (the steps before it joined: none measured here).
        models[0].series.extend([float("nan")] * first_step)
        step_group, live = _join(balanced, models[0], store, rank, cfg, first_step, go=go, rejoin=rejoin)
    else:
        dist.barrier()
    join_next = False  # every survivor saw the restarted rank ready: join at the next step
    # Steps paced from the run's start (a restarted rank's, as if it had been there).
    start = time.perf_counter() - first_step * cfg.step_ms / 1000
    steps_routed = 0

    def tallies() -> dict:
        return {
            "rank": rank,
            "seconds": time.perf_counter() - start,
            "steps_routed": steps_routed,
            "events": done_events + pending,
            "late": getattr(balanced.barrier, "late", 0),
            "models": {
                m.name: {
                    "misrouted": m.misrouted,
                    "routed": m.routed,
                    "series": m.series,
                    "reporter": asdict(part.reporter.stats()),
                }
                for m, part in zip(models, balanced.parts)
            },
        }

    for step in range(first_step, cfg.steps):
        if join_next:
            join_next = False
            step_group, live = _join(balanced, models[0], store, rank, cfg, step, failure=failure)
        if rejoining and failure is not None and step == cfg.rejoin_at and rank == live[0]:
            events.put(("rejoin", {"rank": cfg.fail_rank, "step": step}))  # the parent restarts it
        if failing and not restarted and rank == cfg.fail_rank and step == cfg.fail_at:
            _die(events, store, rank, {**tallies(), "dead": True})
        if failing and failure is None and not restarted:
            dead = membership.detect_down(step_group, store)
            if dead is not None:
                live = [r for r in live if r not in dead]
                failure, step_group = _survive(balanced, dead, live, step, backup)
        balanced.step(step)
        if failing and failure is None and not restarted and balanced.rollout.current.version != kept:
            # A version switched: back up what another gpu alone holds now.
            kept = balanced.rollout.current.version
            backup.keep(at_risk(balanced.rollout.current.placement, gpu=rank))
        hists = []
        for model, part in zip(models, balanced.parts):
            counts = rng.multinomial(cfg.tokens * cfg.topk, model.pop[step * len(model.pop) // cfg.steps])
            hists.append(route(counts, part.routed.placement, offset=step + rank))
            # Tokens per slot; folded per expert while a chunked re-plan mixes versions.
            part.record(hists[-1].sum(axis=2), copy=False)
            model.routed += int(counts.sum())
        if failure is not None:
            # Tokens routed to the dead rank's slots: lost until the survivor placement switches.
            failure.routed(step, hists[0], balanced.target.routed, S)
        # The dispatch (both models in one all-reduce): every rank learns what reached the
        # slots it holds, and checks them.
        flat = [h.reshape(-1) for h in hists]
        if rejoining:
            # With the dispatch: whether this rank may join the restarted one now (all must).
            flat.append(np.array([_may_join(balanced, failure, store, step, cfg)]))
        total = torch.from_numpy(np.concatenate(flat).astype(np.int64))
        dist.all_reduce(total, group=step_group)
        steps_routed += 1
        if rejoining and failure is not None and failure.rejoined_step < 0:
            join_next = int(total[-1]) == len(live)
        offset = 0
        for model, hist in zip(models, hists):
            got = total.numpy()[offset : offset + hist.size].reshape(hist.shape)
            offset += hist.size
            model.misrouted += misrouted_here(got, model.layers, model.topo, rank)
            if rejoin is not None:
                rejoin.served += int(got[:, rank * S : (rank + 1) * S].sum())
            # Every rank measures (all alike): whichever survives reports the series.
            topo = model.topo
            gpu = got.reshape(topo.num_layers, topo.num_gpus, -1).sum(axis=2)[:, live]
            model.series.append(float((gpu.max(axis=1) / gpu.mean(axis=1)).mean()))
        # In the order they happened: a switch waits _AFTER_STEPS steps for its measurement, and
        # what came after it (the service's survivor version adopted, say) waits behind it.
        while pending and (pending[0]["kind"] != "switched" or step >= pending[0]["step"] + _AFTER_STEPS):
            item = pending.pop(0)
            if item["kind"] == "switched":
                s, series = item["step"], models[[m.name for m in models].index(item["model"])].series
                item["measured_before"] = float(np.mean(series[max(0, s - _AFTER_STEPS) : s] or [np.nan]))
                item["measured_after"] = float(np.mean(series[s : s + _AFTER_STEPS]))
            item["t"] = time.perf_counter() - start
            if rank == live[0]:  # the lowest live rank prints
                events.put(("event", item))
            done_events.append(item)
        # Pace the steps; every rank waits in the all-reduce for the slowest anyway.
        time.sleep(max(0.0, start + (step + 1) * cfg.step_ms / 1000 - time.perf_counter()))
    if rejoining and failure is not None and failure.rejoined_step < 0 and rank == live[0]:
        membership.cancel_join(store)  # the restarted rank never joined: it may stop waiting
    balanced.close(timeout_s=2.0)
    dist.barrier(group=step_group)
    result = tallies()
    if restarted:
        _leave(events, ("done", {**result, "rejoin": rejoin.as_dict()}))
    elif failure is None:
        dist.destroy_process_group()
        events.put(("done", result))
    else:
        restored = {"restored": backup.hits + backup.misses, "restored_from_host": backup.hits}
        _leave(events, ("done", {**result, "failure": {**failure.as_dict(), **restored}}))


def _connect(rank: int, cfg: DemoConfig, restarted: bool) -> object:
    """The parent's store (the rendezvous is not rank 0's: any rank may die) and this rank's
    default group: the gloo world, or on a restarted rank a placeholder (the epoch's groups come
    at the join)."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", cfg.gloo_port, is_master=False, timeout=timedelta(seconds=60))
    if restarted:
        membership.placeholder_world(rank, cfg.ranks)
    else:
        world = dist.PrefixStore("world", store)
        dist.init_process_group("gloo", store=world, rank=rank, world_size=cfg.ranks, timeout=timedelta(seconds=60))
    return store


def _die(events: mp.Queue, store: object, rank: int, tallies: dict) -> None:
    """The killed rank, at its step: hands the parent its ``tallies`` and waits for its SIGKILL."""
    events.put(("dying", tallies))
    events.close()
    events.join_thread()
    # Only now may it die: a process killed while its queue's feeder still held the queue's
    # write lock (just after the parent read the message) blocks every other rank's writes for
    # good (seen: no rank's results ever came).
    store.set(f"{_FLUSHED_KEY}/{rank}", "1")
    time.sleep(600)


def _leave(events: mp.Queue, item: tuple) -> None:
    """Sends ``item`` and exits at once. After a death the world group still holds the heartbeat
    abandoned then (until its timeout), and its destructor would wait for it; the results are
    flushed, so the process leaves without it."""
    events.put(item)
    events.close()
    events.join_thread()
    os._exit(0)


def _code(layer: int, expert: int, t: int) -> int:
    """The value every weight of (layer, expert)'s tensor ``t`` (name order) holds."""
    return layer * _CODE_LAYER + expert * _CODE_EXPERT + t


def _may_join(balanced: object, failure: Failure | None, store: object, step: int, cfg: DemoConfig) -> int:
    """1 when this survivor may take the restarted rank in at the next step: from --rejoin-at
    on, once it is ready, the survivor placement routed, and no transition in flight (the join
    moves weights outside the rollout)."""
    if failure is None or failure.rejoined_step >= 0 or step < cfg.rejoin_at or failure.recovered_step < 0:
        return 0
    from eplb_engine.rollout import Phase

    rollout = balanced.rollout
    return int(rollout.phase is Phase.IDLE and not rollout.mixed and membership.joiner_ready(store))


def _join(
    balanced: object,
    model: _Model,
    store: object,
    rank: int,
    cfg: DemoConfig,
    step: int,
    *,
    go: membership.JoinWord | None = None,
    rejoin: Rejoin | None = None,
    failure: Failure | None = None,
) -> tuple:
    """Between two steps, on every live rank at once: the restarted rank taken in (the
    ``demo_rejoin`` docstring says how). ``go``/``rejoin``: on the restarted rank, the
    survivors' word and its account; ``failure``: on a survivor. Returns the steps' group and
    the live ranks (all)."""
    from eplb_engine.mover import WeightMover
    from eplb_engine.rollout import AckSender, ProcessGroupBarrier

    from .demo_failure import checkpoint
    from .demo_rejoin import load_slots, rejoin_plan, staged, tell_service_up

    t0 = time.perf_counter()
    back = cfg.fail_rank
    if go is None:
        base, routing = balanced.rollout.current, balanced.rollout.routing
        if rank == min(r for r in range(cfg.ranks) if r != back):
            membership.announce_join(store, membership.JoinWord(step, base, routing.phy2log))
    else:
        base, routing = go.base, eplb.Placement(go.routing, model.topo)
    groups = membership.epoch_groups(store, 1, rank, cfg.ranks, mover_timeout_s=_MOVER_TIMEOUT_S)
    movers = groups.mover
    plan = rejoin_plan(base, routing)
    if rejoin is not None:
        rejoin.experts_loaded = load_slots(model.layers, plan.placement, rank, checkpoint(_TENSORS, _code))
    # The restarted rank holds its slots of the plan now; the mover moves what the plan
    # changes on the survivors (from them or from it).
    start = staged(routing, plan.placement, back)
    report = WeightMover(model.layers, start, plan.placement, movers, verify=True).run()
    if report.mismatches:
        raise RuntimeError(f"rank {rank}: the join's moves left slots unlike their sources: {report.mismatches[:4]}")
    barrier = None
    if cfg.barrier == "group":
        barrier = ProcessGroupBarrier(groups.barrier, acks=AckSender(balanced.client, balanced.deployment, rank))
        balanced.barrier = barrier
    balanced.target.route_moved(plan, base, barrier)
    balanced.target.applier.group = movers
    if rejoin is not None:
        rejoin.step, rejoin.version, rejoin.serving_wall = step, plan.version, time.time()
        rejoin.moves = int((start.phy2log != plan.placement.phy2log).sum())
        rejoin.join_s = time.perf_counter() - t0
        # Told once the plan is routed here: the service's plan of the same pair then finds
        # the local one to be adopted by (not a version to start moving to).
        rejoin.service_error = tell_service_up(balanced, rank)
    if failure is not None:
        failure.rejoined_step = step
    return groups.steps, list(range(cfg.ranks))


def _survive(balanced: object, dead: list[int], live: list[int], step: int, backup: object) -> tuple:
    """On a survivor, between two steps: groups rebuilt over ``live`` (the barrier's, the
    mover's and the steps'), then ``ranks_down``. Returns the ``Failure`` and the steps' group."""
    import torch.distributed as dist

    detected = time.time()
    t0 = time.perf_counter()
    timeout = timedelta(seconds=60)
    step_group = dist.new_group(live, use_local_synchronization=True, timeout=timeout)
    barrier_group = dist.new_group(live, use_local_synchronization=True, timeout=timeout)
    movers = dist.new_group(live, use_local_synchronization=True, timeout=timedelta(seconds=_MOVER_TIMEOUT_S))
    topo = balanced.target.topology
    lost = lost_experts(balanced.target.routed.placement.phy2log, topo.slots_per_gpu, dead)
    survivor = balanced.ranks_down(dead, barrier_group, movers, restore=backup)
    failure = Failure(dead, step, detected, lost, survivor.version, regroup_s=time.perf_counter() - t0)
    return failure, step_group


@dataclass
class _Model:
    """One model's side on a rank: its deployment, weights, popularity and tallies."""

    name: str
    topo: eplb.Topology
    deployment: str
    seed: int
    layers: list = field(default_factory=list)
    pop: np.ndarray | None = None
    misrouted: int = 0
    routed: int = 0
    series: list = field(default_factory=list)


class _Service:
    """The balancer on 127.0.0.1 (in-memory store) on an event loop in a thread."""

    def __init__(self) -> None:
        from eplb_service.balancer import BalancerConfig
        from eplb_service.server import ServerConfig, start_server

        # The service's audit lines (SetRanksDown when --fail-rank kills a rank) went to stderr
        # through logging's last-resort handler, in the middle of the report that already says
        # what happened; the demo is the entry point, so it decides where its logs go.
        audit = logging.getLogger("eplb_service.audit")
        audit.addHandler(logging.NullHandler())
        audit.propagate = False
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        config = ServerConfig(port=0, balancer=BalancerConfig(flush_s=0.2, tick_s=0.1))
        self.server = asyncio.run_coroutine_threadsafe(start_server(config), self.loop).result(10)
        self.address = self.server.target

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(0), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def _pb() -> object:
    from eplb_wire._gen.eplb.v1 import balancer_pb2

    return balancer_pb2


def _line(e: dict) -> str:
    who = "draft " if e.get("model") == "draft" else ""
    if e["kind"] == "adopted":  # the service's survivor placement is the one routed already
        return f"  {who}v{e['version']:<3} adopted: the service's survivor placement, the map routed already (no move)"
    if e["kind"] != "switched":
        return f"  {who}v{e['version']:<3} {e['kind']} at step {e['step']}: {e['error'] or 'another rank failed'}; kept the previous map"
    if e.get("survivor_of"):
        # A survivor placement is planned from its base version's loads, with no figure for
        # the map before it (whose dead gpu holds nothing): "0.000 -> ..." read as a gain.
        planned = f"(survivor placement of v{e['survivor_of']}) {e['planned_after']:.3f}"
    elif "planned_before" in e:
        planned = f"{e['planned_before']:.3f} -> {e['planned_after']:.3f}"
    else:
        planned = "?"
    return (
        f"  {who}v{e['version']:<3} t={e['t']:5.1f}s step {e['step']:<5} imbalance {planned} planned, "
        f"{e['measured_before']:.3f} -> {e['measured_after']:.3f} measured | moves {e.get('moves', '?')} "
        f"{e['bytes'] / 1e3:.1f} kB in {e['rounds']} rounds | move predicted {e['predicted_s'] * 1e3:.2f} ms (GPU model), "
        f"measured {e['prepare_s'] * 1e3:.0f} ms prepare, {e['wait_s'] * 1e3:.0f} ms to the switch, {e['commit_s'] * 1e3:.1f} ms commit"
        f"{_chunks(e)}"
    )


def _chunks(e: dict) -> str:
    if e.get("staging_bytes") is None:
        return f" | whole version, {e.get('staged_bytes', 0)} B staged"
    return f" | {e['chunks']} chunks, {e['staged_bytes']} B staged on rank 0 (budget {e['staging_bytes']} B)"


def run(cfg: DemoConfig, out: object = sys.stdout) -> dict:
    """Runs the demo, printing a line per applied re-plan; returns the summary. Interrupted
    (Ctrl-C), it stops the ranks and the service before the KeyboardInterrupt goes on."""
    wall = time.perf_counter()
    service = _Service()
    try:
        return _run(cfg, service, out, wall)
    finally:
        service.stop()


def _run(cfg: DemoConfig, service: _Service, out: object, wall: float) -> dict:
    topo = cfg.topology
    from eplb_engine.client import ServiceClient

    slot_bytes = sum(4 * int(np.prod(shape)) for shape in _TENSORS.values())
    cfg = DemoConfig(**{**asdict(cfg), "address": service.address})
    deployments = {cfg.deployment: topo}
    if cfg.draft_layers:
        deployments[cfg.draft_deployment] = cfg.draft_topology
    with ServiceClient(service.address) as client:
        for name, deployment_topo in deployments.items():
            client.create_deployment(
                name,
                deployment_topo,
                window_s=cfg.window_s,
                interval_s=cfg.replan_s,
                min_gain_percent=cfg.min_gain_percent,
                expert_bytes=slot_bytes,
                switch_margin_steps=cfg.switch_margin_steps,
            )
    draft = ""
    if cfg.draft_layers:
        dt = cfg.draft_topology
        draft = (
            f"; a draft model of {dt.num_layers} MoE layers x {dt.num_experts} experts on {dt.num_slots} slots "
            f"(deployment {cfg.draft_deployment})"
        )
    print(
        f"eplb demo: service on {service.address}; {cfg.ranks} engine ranks (gloo), {topo.num_layers} layers x "
        f"{topo.num_experts} experts on {topo.num_slots} slots{draft}; {cfg.steps} steps of {cfg.step_ms:g} ms, "
        f"popularity drifting then shifting at step {cfg.steps // 2}; {cfg.barrier} barrier"
        + (f"; rank {cfg.fail_rank} killed at step {cfg.fail_at}" if cfg.fail_rank >= 0 else "")
        + (f", restarted at step {cfg.rejoin_at}" if cfg.rejoin_at else ""),
        file=out,
        flush=True,
    )
    # The gloo rendezvous store lives here, in the parent, so that any rank can be killed.
    # Made after the first line, as the ranks were started before it had one: importing torch
    # takes seconds on a loaded machine.
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    cfg = DemoConfig(**{**asdict(cfg), "gloo_port": store.port})
    ctx = mp.get_context("spawn")
    events = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, cfg, events), daemon=True) for r in range(cfg.ranks)]
    # The ranks start with SIGINT ignored (a Python interpreter keeps an ignored SIGINT): a
    # Ctrl-C reaches the whole foreground process group, and each rank would print its own
    # KeyboardInterrupt traceback; this process stops them instead (the finally below).
    restore = _ignore_sigint()
    try:
        for p in procs:
            p.start()
    finally:
        restore()
    results: dict[int, dict] = {}
    killed: dict[int, float] = {}  # rank -> when it was killed (time.time())
    restarted: dict[int, float] = {}  # rank -> when it was started again (time.time())
    rejoined: dict[int, dict] = {}  # a restarted rank's results
    deadline = time.monotonic() + cfg.seconds + 120
    starting = _StartUp(cfg.ranks)
    try:
        while len(results) < cfg.ranks or len(rejoined) < len(restarted):
            try:
                kind, item = events.get(timeout=1.0)
            except queue.Empty:
                starting.waiting()
                exits = [None if r in killed and r not in restarted else p.exitcode for r, p in enumerate(procs)]
                if time.monotonic() > deadline or any(code not in (None, 0) for code in exits):
                    raise RuntimeError(f"engine ranks failed (exit codes {[p.exitcode for p in procs]})") from None
                continue
            if kind == "up":
                starting.up(item["rank"])
            elif kind == "event":
                print(_line(item), file=out, flush=True)
            elif kind == "rejoin":
                # The survivors reached --rejoin-at: the dead rank's process starts again, joins
                # them once it is up (demo_rejoin) and is planned in.
                rank = item["rank"]
                procs[rank] = ctx.Process(target=_rank_main, args=(rank, cfg, events, True), daemon=True)
                restore = _ignore_sigint()
                try:
                    procs[rank].start()
                finally:
                    restore()
                restarted[rank] = time.time()
                print(f"  rank {rank} restarted at step {item['step']}", file=out, flush=True)
            elif kind == "dying":
                # Its tallies so far are in; now it dies, and once it is gone the survivors
                # learn of it through the store (their heartbeat reads it).
                rank = item["rank"]
                store.wait([f"{_FLUSHED_KEY}/{rank}"], timedelta(seconds=30))
                os.kill(procs[rank].pid, signal.SIGKILL)
                procs[rank].join(10)
                killed[rank] = time.time()
                membership.mark_down(store, killed)
                results[rank] = item
                print(f"  rank {rank} killed at step {item['steps_routed']} (SIGKILL)", file=out, flush=True)
            elif "rejoin" in item:
                rejoined[item["rank"]] = item
            else:
                results[item["rank"]] = item
        for p in procs:
            p.join(10)
        # Where the service saw each rank end up (the ranks' acks, sent before they finished).
        with ServiceClient(service.address) as client:
            infos = {name: client.call("GetDeployment", _pb().GetDeploymentRequest(name=name)) for name in deployments}
            acks = {name: {a.rank: (a.version, a.failed_version) for a in info.acks} for name, info in infos.items()}
            down_ranks = sorted(infos[cfg.deployment].down_ranks)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            if p.pid is not None:
                p.join(5)
        for p in procs:
            # One that outlived SIGTERM would hold up this process's exit (multiprocessing joins
            # its children then, without a timeout): SIGKILL it.
            if p.is_alive():
                p.kill()
                p.join(5)
    summary = _summary(cfg, results, time.perf_counter() - wall, killed, rejoined, restarted)
    summary["service_down_ranks"] = down_ranks
    for key, name in (("", cfg.deployment), ("draft_", cfg.draft_deployment)):
        if name in acks:
            got = acks[name]
            summary[f"service_{key}acked_versions"] = [got.get(r, (0, 0))[0] for r in range(cfg.ranks)]
            summary[f"service_{key}failed_versions"] = sorted({got[r][1] for r in got if got[r][1]})
    _print_summary(summary, out)
    return summary


@contextmanager
def _said_if_slow(message: str, after_s: float = 3.0) -> Iterator[None]:
    """Prints ``message`` on stderr once the block has run ``after_s``: a slow start-up is not
    silent, a quick one (or one that fails at once, whose error is then the only line) says nothing."""
    timer = threading.Timer(after_s, lambda: print(message, file=sys.stderr, flush=True))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


class _StartUp:
    """The ranks' start-up on stderr (importing torch and joining the gloo group takes 9-21 s on
    a loaded machine, in which the demo printed nothing): a line every ``EVERY_S`` until every
    rank is up, then one saying so. A rank restarted later (``--rejoin-at``) says nothing."""

    EVERY_S = 3.0

    def __init__(self, ranks: int) -> None:
        self.ranks = ranks
        self.started = self.said = time.monotonic()
        self.ranks_up: set[int] = set()

    def waiting(self) -> None:
        now = time.monotonic()
        if len(self.ranks_up) < self.ranks and now - self.said >= self.EVERY_S:
            print(
                f"eplb demo: starting {self.ranks} engine ranks (importing torch, joining the gloo group): "
                f"{len(self.ranks_up)} up, {now - self.started:.0f} s",
                file=sys.stderr,
                flush=True,
            )
            self.said = now

    def up(self, rank: int) -> None:
        if len(self.ranks_up) == self.ranks:
            return
        self.ranks_up.add(rank)
        if len(self.ranks_up) == self.ranks:
            print(
                f"eplb demo: {self.ranks} engine ranks up in {time.monotonic() - self.started:.0f} s",
                file=sys.stderr,
                flush=True,
            )


def _ignore_sigint() -> Callable[[], object]:
    """Ignores SIGINT in this process (so in the processes it starts now); returns the undo.
    Outside the main thread (where handlers cannot be set) it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    return lambda: signal.signal(signal.SIGINT, previous)


def _summary(
    cfg: DemoConfig,
    results: dict[int, dict],
    wall_s: float,
    killed: dict[int, float] | None = None,
    rejoined: dict[int, dict] | None = None,
    restarted: dict[int, float] | None = None,
) -> dict:
    """``results``: each rank's tallies (a killed rank's up to its death); ``rejoined``: a
    restarted rank's (from its join on), counted with them."""
    # The series and events are read from the lowest rank that ran to the end, by rank (results
    # arrive in the order the ranks finish: under load rank 1 can finish first, and the summary
    # then read an empty series, "0 tokens routed", seen once in CI when only rank 0 measured).
    killed, rejoined, restarted = killed or {}, rejoined or {}, restarted or {}
    lead = min(r for r in results if not results[r].get("dead"))
    runs = [results[r] for r in sorted(results)] + [rejoined[r] for r in sorted(rejoined)]
    model = {name: [run["models"][name] for run in runs if name in run["models"]] for name in results[lead]["models"]}
    series = np.asarray(results[lead]["models"]["target"]["series"])
    events = {name: [e for e in results[lead]["events"] if e.get("model") == name] for name in model}
    switched = [e for e in events["target"] if e["kind"] == "switched"]
    # An adoption moved nothing and failed nothing: not a rollback.
    others = [e for r in runs for e in r["events"] if e["kind"] not in ("switched", "adopted")]
    shift_step = cfg.steps // 2
    first = switched[0]["step"] if switched else len(series)
    last_q = series[int(0.8 * len(series)) :]
    balanced = series[first + _AFTER_STEPS // 5 : shift_step] if first < shift_step else series[first:]
    reporters = [m["reporter"] for ranks in model.values() for m in ranks]
    everything = [e for r in runs for e in r["events"]]
    failures = []
    for rank, when in sorted(killed.items()):
        views = {r: v["failure"] for r, v in results.items() if "failure" in v and rank in v["failure"]["dead"]}
        back = rejoined[rank]["rejoin"] if rank in rejoined else None
        entry = summarize_failure(
            rank, results[rank]["steps_routed"], when, views, lead, back, restarted.get(rank, 0.0)
        )
        failures.append(entry)
    lost = sum(f["dispatches_lost"] for f in failures)
    summary = {
        "config": {k: v for k, v in asdict(cfg).items() if k not in ("address", "gloo_port")},
        "seconds": round(wall_s, 2),
        "routing_seconds": round(max(r["seconds"] for r in runs), 2),
        "steps": int(len(series)),
        "tokens_routed": int(sum(r.get("steps_routed", len(series)) for r in runs) * cfg.tokens),
        # every model's (token, layer, expert) dispatches, the target's and the draft's if any,
        # less those lost with a dead rank (routed to its slots before the survivors switched)
        "dispatches_checked": int(sum(m["routed"] for ranks in model.values() for m in ranks)) - lost,
        "misrouted_dispatches": int(sum(m["misrouted"] for ranks in model.values() for m in ranks)),
        "failures": failures,
        "replans_applied": len(switched),
        "rollouts_failed": len(others),
        "late_switches": int(sum(r["late"] for r in runs)),
        "imbalance_initial": float(series[:first].mean()) if first else float("nan"),
        "imbalance_balanced": float(balanced.mean()) if balanced.size else float("nan"),
        "imbalance_final": float(last_q.mean()),
        "shift_step": shift_step,
        "moves": int(sum(e.get("moves", 0) for e in switched)),
        "bytes_moved": float(sum(e["bytes"] for e in switched)),
        "move_seconds_measured": float(sum(e["prepare_s"] + e["commit_s"] for e in switched)),
        "move_seconds_predicted": float(sum(e["predicted_s"] for e in switched)),
        "chunks_per_replan": [int(e.get("chunks", 1)) for e in switched],
        "staged_bytes_max": int(max((e.get("staged_bytes", 0) for e in switched), default=0)),
        "checksum_mismatches": int(sum(e.get("mismatches", 0) for e in everything)),
        "reports_accepted": int(sum(r["accepted"] for r in reporters)),
        "reports_dropped": int(sum(r["dropped_reports"] + r["dropped_adds"] for r in reporters)),
        "replans": switched,
        "series": series.tolist(),
    }
    if "draft" in model:
        drafted = [e for e in events["draft"] if e["kind"] == "switched"]
        target_steps = {e["step"] for e in switched}
        dseries = np.asarray(model["draft"][0]["series"])
        summary["draft"] = {
            "dispatches_checked": int(sum(m["routed"] for m in model["draft"])),
            "misrouted_dispatches": int(sum(m["misrouted"] for m in model["draft"])),
            "replans_applied": len(drafted),
            # a draft switch at a step where the target's version switched too (its last chunk)
            "switched_with_target": sum(e["step"] in target_steps for e in drafted),
            "imbalance_initial": float(dseries[: drafted[0]["step"]].mean()) if drafted else float("nan"),
            "imbalance_final": float(dseries[int(0.8 * len(dseries)) :].mean()),
            "replans": drafted,
        }
    return summary


def _print_summary(s: dict, out: object) -> None:
    print(
        f"summary: {s['steps']} steps in {s['routing_seconds']:.1f} s ({s['seconds']:.1f} s with start-up), "
        f"{s['tokens_routed']} tokens routed through "
        f"{s['config']['layers']} layers: {s['dispatches_checked']} (token, layer, expert) dispatches checked, "
        f"{s['misrouted_dispatches']} reached a slot without their expert's weights\n  {s['replans_applied']} re-plans applied on every rank at the same steps, "
        f"{s['rollouts_failed']} rolled back, {s['late_switches']} late\n"
        f"  mean imbalance (max / mean gpu load): {s['imbalance_initial']:.3f} on the contiguous placement, "
        f"{s['imbalance_balanced']:.3f} once balanced, {s['imbalance_final']:.3f} over the last fifth "
        f"(popularity shifted at step {s['shift_step']})\n"
        f"  {s['moves']} slots moved, {s['bytes_moved'] / 1e3:.1f} kB, {s['move_seconds_measured'] * 1e3:.0f} ms measured, "
        f"switched in {s['chunks_per_replan']} chunks, at most {s['staged_bytes_max']} B of receive buffers; "
        f"{s['reports_accepted']} load reports accepted, {s['reports_dropped']} dropped; "
        f"{s['checksum_mismatches']} checksum mismatches; the service has the ranks at versions "
        f"{s['service_acked_versions']}",
        file=out,
        flush=True,
    )
    for f in s.get("failures", []):
        recovered = (
            f"switched to the survivor placement (v{f['survivor_version']}) at step {f['recovered_step']}, "
            f"{f['recovery_s']:.2f} s after the kill ({f['detect_s'] * 1e3:.0f} ms to learn of it)"
            if f["recovered_step"] >= 0
            else "never switched to the survivor placement"
        )
        print(
            f"  rank {f['rank']} killed at step {f['step']}: {recovered}; {f['experts_reloaded']} experts reloaded "
            f"({f['experts_lost']} had no replica left{_then(f)}, {f['experts_from_host_copies']} from host copies); "
            f"{f['dispatches_lost']} dispatches lost to the dead rank before the switch, "
            f"{f['dispatches_to_dead_after_recovery']} after it",
            file=out,
            flush=True,
        )
        if "rejoined_step" in f:
            print(f"  rank {f['rank']} {_rejoined(f)}", file=out, flush=True)
    d = s.get("draft")
    if d:
        print(
            f"  draft: {d['dispatches_checked']} dispatches checked, {d['misrouted_dispatches']} misrouted; "
            f"{d['replans_applied']} re-plans applied, {d['switched_with_target']} at the same step as the target's; "
            f"imbalance {d['imbalance_initial']:.3f} -> {d['imbalance_final']:.3f}; the service has the ranks at "
            f"versions {s.get('service_draft_acked_versions')}",
            file=out,
            flush=True,
        )


def _then(f: dict) -> str:
    """The lost experts counted again where a version switched between the death and the
    survivor placement (with the service barrier, a switch step fixed before the death
    stands): it may have copied some of them to the survivors, who then reload fewer."""
    if f["experts_lost_at_switch"] == f["experts_lost"]:
        return ""
    return f" at the death, {f['experts_lost_at_switch']} in the map the survivor move started from"


def _rejoined(f: dict) -> str:
    if f["rejoined_step"] < 0:
        return f"restarted but never joined (up {f['rejoin_ready_s']:.2f} s after the restart)"
    return (
        f"rejoined at step {f['rejoined_step']} (v{f['rejoin_version']}), serving {f['rejoin_s']:.2f} s after its "
        f"restart ({f['rejoin_ready_s']:.2f} s to start up, {f['rejoin_stall_s'] * 1e3:.0f} ms join); "
        f"{f['experts_loaded_on_rejoin']} experts loaded, {f['rejoin_moves']} slots moved on the survivors; "
        f"{f['dispatches_served_by_rejoined']} dispatches served by it since"
    )


def write_plot(summary: dict, directory: Path) -> Path:
    """``imbalance.png``: measured imbalance per step, with the switches and the shift marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    step_s = summary["config"]["step_ms"] / 1000
    series = np.asarray(summary["series"])
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.plot(np.arange(len(series)) * step_s, series, lw=0.8, label="measured imbalance (mean over layers)")
    for i, e in enumerate(summary["replans"]):
        ax.axvline(
            e["step"] * step_s, color="tab:green", ls="--", lw=0.8, label="placement switched" if i == 0 else None
        )
    ax.axvline(summary["shift_step"] * step_s, color="tab:red", lw=0.8, label="popularity shift")
    ax.set_xlabel("seconds")
    ax.set_ylabel("max / mean gpu load")
    ax.set_title("eplb demo")
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    path = directory / "imbalance.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _unwritable(flag: str, path: Path, *, file: bool = False) -> str:
    """What stops the demo writing ``path`` (a directory, or with ``file`` a file), "" if nothing:
    creates a missing directory (not a file's missing parent) and writes a scratch file in it."""
    directory = path.parent if file else path
    if file and path.is_dir():
        return f"{flag} {path}: is a directory; give a file path"
    if file and not directory.is_dir():
        # As eplb place --out and eplb-bench --json: a mistyped directory is not made.
        return f"{flag} {path}: directory {directory} does not exist"
    if not file and path.exists() and not path.is_dir():
        return f"{flag} {path}: is a file; give a directory"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as exc:
        return f"{flag} {path}: cannot write in {directory} ({exc.strerror or exc}); give a writable {'file path' if file else 'directory'}"
    return ""


def _check_failure_flags(ap: argparse.ArgumentParser, args: argparse.Namespace, steps: int) -> None:
    """One line for each wrong --fail-rank / --fail-at / --rejoin-at (argparse's error: status 2)."""
    if (args.fail_rank is None) != (args.fail_at is None):
        ap.error("--fail-rank R and --fail-at STEP go together: give both or neither")
    if args.fail_rank is None:
        if args.rejoin_at is not None:
            ap.error("--rejoin-at STEP restarts the rank --fail-rank R killed at --fail-at STEP: give those too")
        return
    if not 0 <= args.fail_rank < args.ranks:
        ap.error(f"--fail-rank must be in [0, {args.ranks - 1}] (a rank of --ranks {args.ranks}), got {args.fail_rank}")
    if not 1 <= args.fail_at < steps:
        ap.error(
            f"--fail-at must be in [1, {steps - 1}] (a step of the run: --seconds {args.seconds:g} is {steps} steps), "
            f"got {args.fail_at}"
        )
    if args.draft_layers:
        ap.error("--fail-rank runs without --draft-layers: ranks_down does not carry a draft model over yet")
    if args.rejoin_at is not None and not args.fail_at < args.rejoin_at < steps:
        ap.error(
            f"--rejoin-at must be in [{args.fail_at + 1}, {steps - 1}] (after --fail-at {args.fail_at}, a step of "
            f"the run: --seconds {args.seconds:g} is {steps} steps), got {args.rejoin_at}"
        )


def main(argv: list[str] | None = None) -> int:
    d = DemoConfig()
    ap = OneLineParser(
        prog="eplb demo",
        description="The balancer service, simulated engine ranks and the "
        "weight mover on loopback, on CPU, in under a minute.",
    )
    ap.add_argument("--ranks", type=int, default=d.ranks, help=f"engine ranks (processes, one gpu each) [{d.ranks}]")
    ap.add_argument("--seconds", type=float, default=d.seconds, help=f"how long the ranks route tokens [{d.seconds:g}]")
    ap.add_argument(
        "--barrier",
        choices=("group", "service"),
        default=d.barrier,
        help="agree the switch step through the ranks' process group or the service's AckPlacement [group]",
    )
    ap.add_argument(
        "--draft-layers",
        type=int,
        default=d.draft_layers,
        metavar="N",
        help="also run a draft model (MTP) of N MoE layers as its own deployment, switched with the target [0]",
    )
    ap.add_argument(
        "--fail-rank",
        type=int,
        metavar="R",
        help="kill rank R's process (SIGKILL) at step --fail-at; the survivors carry on without it",
    )
    ap.add_argument("--fail-at", type=int, metavar="STEP", help="the step at which --fail-rank dies")
    ap.add_argument(
        "--rejoin-at",
        type=int,
        metavar="STEP",
        help="restart --fail-rank's process at this step (after --fail-at); once it is up it loads its weights "
        "and is planned in again",
    )
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--plots", type=Path, metavar="DIR", help="write DIR/imbalance.png")
    ap.add_argument("--json", type=Path, metavar="FILE", help="write the summary as JSON")
    args = ap.parse_args(argv)
    if not 2 <= args.ranks <= 16:
        ap.error(f"--ranks must be in [2, 16], got {args.ranks}")
    if not (math.isfinite(args.seconds) and args.seconds > 0):
        ap.error(f"--seconds must be a finite number > 0, got {args.seconds:g}")
    if not 0 <= args.draft_layers <= 8:
        ap.error("--draft-layers must be in [0, 8]")
    if args.draft_layers and args.barrier == "service":
        ap.error("--draft-layers needs --barrier group: the draft switches with the target through the process group")
    _check_failure_flags(ap, args, DemoConfig(ranks=args.ranks, seconds=args.seconds).steps)
    # The extras the run imports (in its rank processes too), found out before it starts.
    needed = [
        "torch",
        "torch.distributed",
        "eplb_service.server",
        "eplb_engine.balanced_rank",
    ]
    try:
        with _said_if_slow("eplb demo: importing torch and the service (seconds on a loaded machine)"):
            extras.require(*needed, *(["matplotlib"] if args.plots else []))
    except ImportError as exc:
        print(f"eplb demo: error: {extras.missing('the demo', 'demo', exc)}", file=sys.stderr)
        return 2
    # Checked before the run, not found out after it: one line on stderr, like a usage error.
    problem = (args.plots and _unwritable("--plots", args.plots)) or (
        args.json and _unwritable("--json", args.json, file=True)
    )
    if problem:
        print(f"eplb demo: error: {problem}", file=sys.stderr)
        return 2
    try:
        summary = run(
            DemoConfig(
                ranks=args.ranks,
                seconds=args.seconds,
                barrier=args.barrier,
                seed=args.seed,
                draft_layers=args.draft_layers,
                fail_rank=-1 if args.fail_rank is None else args.fail_rank,
                fail_at=args.fail_at or 0,
                rejoin_at=args.rejoin_at or 0,
            )
        )
    except KeyboardInterrupt:
        # run() has stopped the ranks and the service on its way out (its finally).
        # A terminal echoed "^C" on the current line: end it first. A log file gets no blank line.
        lead = "\n" if sys.stderr.isatty() else ""
        print(f"{lead}eplb demo: interrupted; ranks stopped, nothing written", file=sys.stderr)
        return INTERRUPTED_STATUS
    if args.plots:
        print(f"wrote {write_plot(summary, args.plots)}")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
        print(f"wrote {args.json}")
    return 0 if summary["misrouted_dispatches"] == 0 and summary["checksum_mismatches"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
