"""``eplb demo --fail-rank R --fail-at STEP --rejoin-at STEP2``: the killed rank restarted and
planned in again.

At step STEP2 the lowest survivor tells the parent, which starts rank R's process again. The
restarted rank connects to the parent's store, builds its ``BalancedRank`` (on a placeholder
world of its own: nothing of the old world is left for it to join) and says it is ready
(``eplb_engine.membership.mark_ready``).
The survivors route on meanwhile; each step they add "I saw it, and my rollout is idle" to the
dispatch all-reduce, and at the step after the one where every survivor said so (join step
J, the same on all) they stop routing for the join:

- the lowest survivor writes the ``JoinWord``: J and the version the survivors route
  (``base``; ``membership.announce_join``);
- every live rank, the restarted one included, builds the groups of membership epoch 1
  over ``PrefixStore("epoch1/...", store)`` (``membership.epoch_groups``). The old world
  group is not destroyed: it still holds the heartbeat abandoned at the death, and
  destroying it waits out the gloo timeout;
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

from dataclasses import dataclass, replace

import eplb

__all__ = ["Rejoin", "load_slots", "rejoin_plan", "staged", "tell_service_up"]


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


@dataclass
class Rejoin:
    """The restarted rank's account of its return (times on ``time.time()``'s clock, as the
    parent's restart time)."""

    step: int = -1  # the join step: routed over every rank from it on (-1: never joined)
    ready_wall: float = 0.0  # its BalancedRank built, marked ready
    serving_wall: float = 0.0  # the join done: its slots loaded, the mover's moves made
    join_s: float = 0.0  # the survivors' stall: epoch groups, load, moves
    experts_loaded: int = 0  # its slots of the plan, loaded through the checkpoint loader
    moves: int = 0  # slots the mover wrote on the survivors (the plan's changes there)
    version: int = 0  # the plan routed from the join step
    served: int = 0  # dispatches that reached its slots from the join step on
    service_error: str = ""

    def as_dict(self) -> dict:
        return dict(self.__dict__)
