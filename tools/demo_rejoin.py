"""``eplb demo --fail-rank R --fail-at STEP --rejoin-at STEP2``: the killed rank restarted and
planned in again.

At step STEP2 the lowest survivor tells the parent, which starts rank R's process again. The
restarted rank connects to the parent's store, builds its ``BalancedRank`` (on a placeholder
world of its own: nothing of the old world is left for it to join) and writes ``READY_KEY``.
The survivors route on meanwhile; each step they add "I saw it, and my rollout is idle" to the
dispatch all-reduce, and at the step after the one where every survivor said so (join step
J, the same on all) they stop routing for the join:

- the lowest survivor writes ``GO_KEY``: J and the version the survivors route (``base``);
- every live rank, the restarted one included, builds the groups of membership epoch 1 over
  ``PrefixStore("epoch1/...", store)`` (``epoch_groups``). The old world group is not
  destroyed: it still holds the heartbeat abandoned at the death, and destroying it waits
  out the gloo timeout;
- every rank computes the same plan ``survivor_plan(base, [])``: ``eplb.rebalance(loads,
  topology, previous=base, down_gpus=[])`` (deterministic), the restarted rank loads its
  slots of it from the demo's checkpoint (the loader behind the lost experts' restores),
  and the mover moves, from that half-way map (``staged``), only what the plan changes on
  the survivors;
- every rank routes the plan from J on, known by its (base version, no rank down) as the
  local survivor plan after a death is (``Part.route_moved``): the service's own plan of the
  same pair, published once the restarted rank tells it ``SetRanksDown(up=[R])``, is then
  adopted without a move.
"""

from __future__ import annotations

import contextlib
import pickle
import time
from dataclasses import dataclass, replace
from datetime import timedelta

import eplb

__all__ = [
    "CANCEL_KEY",
    "GO_KEY",
    "READY_KEY",
    "Rejoin",
    "cancel",
    "epoch_groups",
    "go_payload",
    "load_slots",
    "rejoin_plan",
    "staged",
    "tell_service_up",
    "wait_go",
]

READY_KEY = "rejoin/ready"  # the restarted rank is up, its BalancedRank built
GO_KEY = "rejoin/go"  # the survivors' answer: the join step and the version they route
CANCEL_KEY = "rejoin/cancel"  # the run ended before the join


def epoch_groups(store: object, epoch: int, rank: int, size: int, mover_timeout_s: float) -> tuple:
    """The groups of membership epoch ``epoch`` over ``rank`` 0 .. ``size - 1``: (steps,
    barrier, mover), each over its own ``PrefixStore`` of the parent's ``store``; collective
    over every live rank. A rank of group ``g`` is gpu ``g`` (and this process's global rank:
    the restarted rank's placeholder world has its rank too)."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    out = []
    for name, timeout_s in (("steps", 60.0), ("barrier", 60.0), ("mover", mover_timeout_s)):
        group_name = f"epoch{epoch}-{name}"
        # new_group() cannot do it: it keys its rendezvous by the default world's store and
        # members, and the restarted rank is in no world with the survivors.
        pg, _ = c10d._new_process_group_helper(
            size,
            rank,
            list(range(size)),
            "gloo",
            dist.PrefixStore(f"epoch{epoch}/{name}", store),
            group_name=group_name,
            timeout=timedelta(seconds=timeout_s),
        )
        c10d._world.pg_group_ranks[pg] = {r: r for r in range(size)}
        out.append(pg)
    return tuple(out)


def rejoin_plan(base: object, routing: eplb.Placement) -> object:
    """``base``: the version the survivors route (a ``PublishedPlacement``, the rank down in
    it); ``routing``: the map they route (``base``'s, or mixed) → every gpu planned in again,
    as ``survivor_plan`` makes it: the same on every rank and at the service."""
    from eplb_engine.survivors import survivor_plan

    start = base if routing is base.placement else replace(base, placement=routing)
    return survivor_plan(start, [])


def staged(routing: eplb.Placement, plan: eplb.Placement, rank: int) -> eplb.Placement:
    """``[L, P]``: ``routing`` with gpu ``rank``'s slots as ``plan`` has them: what the ranks
    hold once the restarted rank has loaded its slots, the mover's start."""
    S = plan.topology.slots_per_gpu
    phy2log = routing.phy2log.copy()
    phy2log[:, rank * S : (rank + 1) * S] = plan.phy2log[:, rank * S : (rank + 1) * S]
    return eplb.Placement(phy2log, plan.topology)


def load_slots(layers: list[dict], plan: eplb.Placement, rank: int, load: object) -> int:
    """Writes gpu ``rank``'s slots of ``plan`` into ``layers`` (name -> ``[S, ...]`` per layer)
    through ``load(layer, expert) -> {name: one slot's tensor}``; returns the slots loaded."""
    S = plan.topology.slots_per_gpu
    loaded = 0
    for layer, tensors in enumerate(layers):
        for s, expert in enumerate(plan.phy2log[layer, rank * S : (rank + 1) * S].tolist()):
            if expert < 0:
                continue
            for name, t in load(layer, expert).items():
                tensors[name][s].copy_(t)
            loaded += 1
    return loaded


def tell_service_up(balanced: object, rank: int) -> str:
    """``SetRanksDown(up=[rank])``: the service plans the rank in again. Returns "" or the error
    (logged by the caller; the ranks' own plan stands)."""
    import grpc

    from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb

    endpoints = balanced.client.endpoints
    try:
        endpoints.stub().SetRanksDown(
            pb.SetRanksDownRequest(deployment=balanced.deployment, up=[rank], reason=f"rank {rank} restarted"),
            metadata=endpoints.metadata,
            timeout=5.0,
        )
    except grpc.RpcError as exc:
        return str(exc)
    return ""


def go_payload(step: int, base: object, routing: eplb.Placement) -> bytes:
    """``GO_KEY``'s value: the join step, ``base`` (its wire stats as bytes: a generated message
    class does not pickle) and the routed map ``[L, P]``."""
    stats = base.stats.SerializeToString()
    return pickle.dumps({"step": step, "base": replace(base, stats=None), "stats": stats, "routing": routing.phy2log})


def wait_go(store: object, poll_s: float = 0.002) -> dict | None:
    """On the restarted rank: the survivors' ``GO_KEY`` (``None``: ``CANCEL_KEY``, the run ended)."""
    from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb

    while True:
        if store.check([GO_KEY]):
            go = pickle.loads(store.get(GO_KEY))
            go["base"] = replace(go["base"], stats=pb.PlanStats.FromString(go.pop("stats")))
            return go
        if store.check([CANCEL_KEY]):
            return None
        time.sleep(poll_s)


@dataclass
class Rejoin:
    """The restarted rank's account of its return (times on ``time.time()``'s clock, as the
    parent's restart time)."""

    step: int = -1  # the join step: routed over every rank from it on (-1: never joined)
    ready_wall: float = 0.0  # its BalancedRank built, READY_KEY written
    serving_wall: float = 0.0  # the join done: its slots loaded, the mover's moves made
    join_s: float = 0.0  # the survivors' stall: epoch groups, load, moves
    experts_loaded: int = 0  # its slots of the plan, loaded through the checkpoint loader
    moves: int = 0  # slots the mover wrote on the survivors (the plan's changes there)
    version: int = 0  # the plan routed from the join step
    served: int = 0  # dispatches that reached its slots from the join step on
    service_error: str = ""

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def cancel(store: object) -> None:
    with contextlib.suppress(Exception):
        store.set(CANCEL_KEY, "1")
