"""Planning with gpus down: the live gpus' reduced problem, and the way back to the full topology.

A down gpu's slots are all empty (-1) in every layer (``Placement.down_gpus``). ``rebalance(...,
down_gpus=[...])`` plans on a reduced topology of the live gpus alone (the same slots per gpu,
live gpus renumbered in order) and writes the -1s only at the boundary (``Survivors.expand``):
the placement steps under ``eplb.planner`` and ``eplb.replan`` never see an empty slot.

Nodes: when every node that has a live gpu has as many as the others (a whole node down, or
the same number down on each), the reduced topology keeps them and ``hierarchical`` keeps
groups whole on the live nodes; otherwise the survivors are one node and plans are ``global``
over them (``Survivors.notes`` says which).

A previous placement (``previous=``) is carried onto the live gpus by ``restore``: its slots on
down gpus are dropped, each expert left without a live replica takes the slot of a redundant
replica (or an empty slot), and empty slots of live gpus (gpus coming back) take replicas by
water-filling. The migration-aware re-plan then starts from that placement.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import checks
from .layout import per_replica, replica_counts, slot_sums, take_rows
from .topology import Topology

__all__ = ["Survivors", "survivors", "live_topology", "restore"]


@dataclass(frozen=True, eq=False)
class Survivors:
    """The live gpus of ``topology`` with ``down`` gpus down.

    ``live_gpus`` int64 ``[G']`` and ``live_slots`` int64 ``[P']`` (ascending: reduced gpu
    ``i`` is ``live_gpus[i]``); ``reduced``: the live gpus' topology (nodes kept where equal,
    see the module doc); ``bound_topology``: the same slots as one node, what the lower bound
    is computed on; ``notes``: how nodes were treated.
    """

    topology: Topology
    down: tuple[int, ...]
    live_gpus: np.ndarray
    live_slots: np.ndarray
    reduced: Topology
    bound_topology: Topology
    notes: tuple[str, ...]

    @property
    def groups_on_nodes(self) -> bool:
        """Whether the reduced problem can keep expert groups whole on its nodes."""
        t = self.reduced
        return t.num_nodes > 1 and t.num_groups > 1 and t.hierarchical_ok

    def expand(self, phy: np.ndarray) -> np.ndarray:
        """``phy`` ``[L, P']`` of the reduced topology → int32 ``[L, P]``, -1 on down gpus."""
        out = np.full((phy.shape[0], self.topology.num_slots), -1, dtype=np.int32)
        out[:, self.live_slots] = phy
        return out

    def restrict(self, phy2log: np.ndarray) -> np.ndarray:
        """``phy2log`` ``[L, P]`` of the full topology → int64 ``[L, P']``: its live slots."""
        return np.asarray(phy2log, dtype=np.int64)[:, self.live_slots]


def _down_list(topology: Topology, down_gpus: object) -> tuple[int, ...]:
    if down_gpus is None:
        return ()
    try:
        items = list(down_gpus)  # type: ignore[call-overload]
    except TypeError:
        raise ValueError(f"down_gpus must be a list of gpu ids, got {type(down_gpus).__name__}") from None
    for g in items:
        if not (checks.is_int(g) and 0 <= int(g) < topology.num_gpus):
            raise ValueError(f"down_gpus holds {g!r}; gpu ids are integers in [0, {topology.num_gpus - 1}]")
    ids = [int(g) for g in items]
    if len(set(ids)) != len(ids):
        twice = sorted({g for g in ids if ids.count(g) > 1})
        raise ValueError(f"down_gpus lists gpu(s) {twice} more than once")
    return tuple(sorted(ids))


def _reduced(t: Topology, down: tuple[int, ...]) -> tuple[Topology, tuple[str, ...]]:
    """The live gpus' topology for the checked ``down`` ids, and the notes saying how nodes were
    treated; no array of the topology's size (``live_topology`` runs before the memory check)."""
    S, gpn = t.slots_per_gpu, t.gpus_per_node
    G = t.num_gpus - len(down)
    if G * S < t.num_experts:
        raise ValueError(
            f"only {G * S} live slots ({G} live gpus x {S} slots) for {t.num_experts} experts with "
            f"gpus {list(down)} down: every expert needs a slot on a live gpu"
        )
    per_node = gpn - np.bincount(np.asarray(down, dtype=np.int64) // gpn, minlength=t.num_nodes)
    kept = per_node[per_node > 0]
    if t.num_nodes > 1 and (kept == kept[0]).all():
        N = int(kept.size)
        where = f"{N} nodes of {G // N} gpus" if N > 1 else "one node"
        notes = (f"gpus {list(down)} down: planned over {G} live gpus on {where}",)
        return Topology(t.num_layers, t.num_experts, G * S, G, N, t.num_groups), notes
    short = ", ".join(f"node {n}: {int(c)} of {gpn}" for n, c in enumerate(per_node) if c < gpn)
    notes = (
        f"gpus {list(down)} down: planned over {G} live gpus"
        + (f" as one node (live gpus per node differ: {short})" if t.num_nodes > 1 else ""),
    )
    return _flat(t, G), notes


def live_topology(topology: Topology, down_gpus: object = ()) -> Topology:
    """``survivors(topology, down_gpus).reduced`` without the arrays: what a plan with
    ``down_gpus`` down plans for (``eplb.rebalance`` checks its memory on it first). Raises
    ``ValueError`` as ``survivors`` does."""
    down = _down_list(topology, down_gpus)
    return _reduced(topology, down)[0] if down else topology


def survivors(topology: Topology, down_gpus: object = ()) -> Survivors:
    """The live gpus' problem for ``topology`` with ``down_gpus`` (ids; ``None``: none) down.

    Raises ``ValueError`` for ids out of range or listed twice, and when the live gpus have
    fewer slots than there are experts (naming the live slots, the experts and the gpus down).
    """
    t = topology
    down = _down_list(t, down_gpus)
    if not down:
        return Survivors(t, (), np.arange(t.num_gpus), np.arange(t.num_slots), t, _flat(t, t.num_gpus), ())
    reduced, notes = _reduced(t, down)
    S = t.slots_per_gpu
    alive = np.ones(t.num_gpus, dtype=bool)
    alive[list(down)] = False
    live_gpus = np.flatnonzero(alive)
    live_slots = (live_gpus[:, None] * S + np.arange(S)[None]).ravel()
    return Survivors(t, down, live_gpus, live_slots, reduced, _flat(t, reduced.num_gpus), notes)


def _flat(t: Topology, gpus: int) -> Topology:
    return Topology(t.num_layers, t.num_experts, gpus * t.slots_per_gpu, gpus, 1, t.num_groups)


def _gpu_loads(loads: np.ndarray, phy: np.ndarray, cnt: np.ndarray, G: int) -> np.ndarray:
    """``[L, P']`` (-1: empty) → ``[L, G']`` gpu loads."""
    return slot_sums(take_rows(per_replica(loads, cnt), phy).reshape(phy.shape[0], G, -1))


def restore(loads: np.ndarray, phy: np.ndarray, topology: Topology, groups_on_nodes: bool) -> np.ndarray:
    """``loads`` ``[L, E]``, ``phy`` int64 ``[L, P']`` (a previous placement on the live slots,
    -1 for empty slots, experts possibly missing) → int64 ``[L, P']`` where every expert has a
    replica and no slot is empty, rewriting as few slots as that takes.

    Each expert without a replica, hottest first, takes an empty slot, else a slot of the
    expert that water-filling gave its last replica (the smallest load over one replica
    fewer), on the gpu that then carries least (on its group's node, where ``groups_on_nodes``
    and the group has one); then each empty slot, lowest first, takes a
    replica of the expert with the largest load per replica not yet on that gpu
    (water-filling). Vectorised across layers: one slot per layer per round.
    """
    t = topology
    L, E, P, G = t.num_layers, t.num_experts, t.num_slots, t.num_gpus
    S = t.slots_per_gpu
    phy = phy.copy()
    rows = np.arange(L)
    cnt = replica_counts(phy, E)
    slot_gpu = np.arange(P) // S
    allowed = np.ones((L, E, P), dtype=bool) if groups_on_nodes else None
    if groups_on_nodes:
        # Each group's home node: the one holding most of its live replicas (a group with none
        # may go anywhere, and the re-plan then takes the fresh plan on that layer).
        group = np.arange(E) // t.experts_per_group
        node = np.arange(P) // t.slots_per_node
        held = phy >= 0
        keys = (rows[:, None] * t.num_groups + group[np.maximum(phy, 0)]) * t.num_nodes + node[None]
        per = np.bincount(keys[held], minlength=L * t.num_groups * t.num_nodes).reshape(L, t.num_groups, -1)
        home = per.argmax(axis=2)
        homed = per.max(axis=2) > 0
        on_home = node[None, None, :] == home[:, :, None]  # [L, K, P]
        allowed = (on_home | ~homed[:, :, None])[:, group, :]
    while True:
        lost = cnt == 0
        need = lost.any(axis=1)
        if not need.any():
            break
        e = np.where(lost, loads, -1.0).argmax(axis=1)
        # The replica to give up: of the expert that water-filling gave its last replica
        # (smallest load over one replica fewer), so that the counts stay those it would pick.
        spare_cnt = np.concatenate([cnt, np.zeros((L, 1), np.int64)], axis=1)
        slot_cnt = take_rows(spare_cnt, phy)  # [L, P'], 0 for empty slots
        drop = np.where(slot_cnt >= 2, take_rows(np.concatenate([loads, np.zeros((L, 1))], axis=1), phy), np.inf)
        drop = drop / np.maximum(slot_cnt - 1, 1)
        if allowed is not None:
            on_home = allowed[rows, e]
            drop = np.where(on_home.any(axis=1, keepdims=True) & ~on_home, np.inf, drop)
        x_cost = drop.min(axis=1, keepdims=True)
        after = _gpu_loads(loads, phy, cnt, G)[:, slot_gpu] - take_rows(per_replica(loads, cnt), phy)
        # Empty slots first (nothing is given up), else the chosen expert's slot whose gpu
        # then carries least.
        empty = phy < 0
        if allowed is not None:
            empty &= allowed[rows, e] | ~(empty & allowed[rows, e]).any(axis=1, keepdims=True)
        ok = np.where(empty.any(axis=1, keepdims=True), empty, drop <= x_cost)
        s = np.where(ok, after, np.inf).argmin(axis=1)
        lay = np.flatnonzero(need)
        old = phy[lay, s[lay]]
        cnt[lay[old >= 0], old[old >= 0]] -= 1
        phy[lay, s[lay]] = e[lay]
        cnt[lay, e[lay]] += 1
    while True:
        empty = phy < 0
        need = empty.any(axis=1)
        if not need.any():
            break
        s = empty.argmax(axis=1)
        g = slot_gpu[s]
        on_gpu = phy.reshape(L, G, S)[rows, g]  # [L, S]
        free = np.ones((L, E + 1), dtype=bool)
        free[rows[:, None], np.where(on_gpu >= 0, on_gpu, E)] = False
        free = free[:, :E]
        if allowed is not None:
            free &= allowed[rows, :, s]
        score = np.where(free, loads / np.maximum(cnt, 1), -1.0)
        e = score.argmax(axis=1)
        lay = np.flatnonzero(need)
        phy[lay, s[lay]] = e[lay]
        cnt[lay, e[lay]] += 1
    return phy
