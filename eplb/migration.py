"""Migration-aware re-planning: keep experts where they are unless moving them pays.

A step waits for the busiest gpu of every layer, so what costs time is the imbalance summed
over layers. A re-plan moves as few slots as it can while the mean imbalance over layers stays
within ``(1 + tolerance)`` of a fresh plan's and no layer goes beyond ``(1 + layer_tolerance)``
of fresh's for that layer (``choose``). Per layer it picks one of these candidates, all
vectorised across layers:
- kept: the current placement as it is (zero moves);
- repaired: the current placement changed only on gpus above the target, by ejection chains
  (``k + 1`` slots for ``k`` gpus above it), rotations (three slots for two), swaps (two for
  one) and count moves (one slot that gives an expert another replica, relieving every gpu
  holding it; see ``eplb.repair`` and ``eplb.refine``), in three orders, the best per layer;
- recounted: replica counts first set to the fresh plan's (within each node: water-filling),
  touching only the slots of experts that lose or gain a replica, then repaired;
- regrouped (hierarchical plans): groups swapped between nodes until the busiest node is
  below the target, then recounted and repaired within the nodes;
- replanned: the fresh plan relabelled onto the current one. Gpus of a plan are
  interchangeable (within a node for the hierarchical policy, and nodes among themselves), as
  are slots within a gpu, so each fresh gpu takes the place of the current gpu holding most of
  the same experts and each surviving expert keeps its slot. Balance is the fresh plan's; only
  the slots whose expert really changes move.

Repairs aim at ``(1 + k tolerance)`` of fresh's busiest gpu for k = 0.5, 1 and 3 (where the
layer bound allows); one that falls short is still a candidate. In every candidate an expert
that stays on a gpu keeps its slot.
"""

from __future__ import annotations

import numpy as np

from .metrics import gpu_loads, imbalance
from .placement import Placement
from .refine import _bin_loads, _counts, refine_counts, rotate_improve, swap_improve
from .repair import chain_improve, count_repair
from .replicate import replica_cap, waterfill
from .topology import Topology
from .workers import worker_pool

_REL_TOL = 1e-12
# Repair targets above fresh's busiest gpu, in units of the tolerance: the Lagrangian pick gets
# a deeper repair for layers whose balance makes up for others, and a looser, cheaper one
# (measured on drift_bench: adding 0.5 saves 0.9 % of slots per re-plan at v3-prefill drift 0.2).
_TARGETS = (0.5, 1.0, 3.0)
# When move budgets bind: repairs going this share of the way from the current busiest gpu to
# fresh's, the cheaper steps a tight budget can still afford.
_PARTIAL = (0.75, 0.5, 0.25)

__all__ = ["align_to_previous", "repair_previous", "choose"]


def _presence(groups: np.ndarray, num_experts: int) -> np.ndarray:
    """``groups``: ``[L, B, k]`` expert ids → ``[L, B, E]`` float32 counts of each expert per bin."""
    L, B, _ = groups.shape
    out = np.zeros((L, B, num_experts), dtype=np.float32)
    np.add.at(out, (np.arange(L)[:, None, None], np.arange(B)[None, :, None], groups), 1.0)
    return out


def _match(overlap: np.ndarray) -> np.ndarray:
    """``overlap``: ``[X, B, B]`` (new bin × old bin) → ``[X, B]``: the old bin for each new bin.

    Greedy: new bins in order of their best overlap, each takes its best free old bin.
    One vectorised step per bin.
    """
    X, B, _ = overlap.shape
    order = np.argsort(-overlap.max(axis=2), axis=1, kind="stable")
    taken = np.zeros((X, B), dtype=bool)
    out = np.empty((X, B), dtype=np.int64)
    rows = np.arange(X)
    for step in range(B):
        nb = order[:, step]
        score = np.where(taken, -1.0, overlap[rows, nb])
        ob = score.argmax(axis=1)
        out[rows, nb] = ob
        taken[rows, ob] = True
    return out


def _align_bins(new: np.ndarray, old: np.ndarray, num_experts: int) -> np.ndarray:
    """``new``, ``old``: ``[X, B, k]`` → ``new``'s bins reordered to sit where ``old`` has most in common."""
    overlap = np.einsum("xbe,xce->xbc", _presence(new, num_experts), _presence(old, num_experts))
    target = _match(overlap)
    out = np.empty_like(new)
    np.put_along_axis(out, target[:, :, None], new, axis=1)
    return out


def _align_slots(new: np.ndarray, old: np.ndarray) -> np.ndarray:
    """``new``, ``old``: ``[X, S]`` experts of matched gpus → ``new`` reordered so experts that
    stay keep their slot and the incoming ones fill the freed slots in order."""
    S = new.shape[1]
    # As multisets, so a gpu holding an expert twice keeps as many copies as the new one has:
    # the r-th copy of an expert stays if the other side has more than r of it.
    earlier = np.tril(np.ones((S, S), dtype=bool), -1)
    same_old = old[:, :, None] == old[:, None, :]
    same_new = new[:, :, None] == new[:, None, :]
    cross = old[:, :, None] == new[:, None, :]  # [X, old slot, new slot]
    stays = (same_old & earlier).sum(axis=2) < cross.sum(axis=2)  # old slot keeps its expert
    incoming = (same_new & earlier).sum(axis=2) >= cross.sum(axis=1)  # new copy not there yet
    out = np.where(stays, old, -1)
    # Free slots, in order, get the incoming experts, in order.
    free_rank = np.cumsum(~stays, axis=1) - 1
    inc_sorted = np.take_along_axis(new, np.argsort(~incoming, axis=1, kind="stable"), axis=1)
    fill = np.take_along_axis(inc_sorted, np.clip(free_rank, 0, S - 1), axis=1)
    return np.where(stays, out, fill)


def align_to_previous(phy2log: np.ndarray, previous: Placement, topology: Topology, by_node: bool) -> np.ndarray:
    """``phy2log``: ``[L, P]`` fresh plan → the same plan relabelled to move fewest slots from ``previous``.

    ``by_node``: keep the fresh plan's node contents together (hierarchical plans), matching
    nodes first and gpus within each node; otherwise any gpu may take any gpu's place.
    Replicas of one expert on one gpu are not expected (our policies avoid them).
    """
    t = topology
    L, S = t.num_layers, t.slots_per_gpu
    old = previous.phy2log
    if by_node and t.num_nodes > 1:
        new_nodes = phy2log.reshape(L, t.num_nodes, t.slots_per_node)
        aligned = _align_bins(new_nodes, old.reshape(L, t.num_nodes, t.slots_per_node), t.num_experts)
        gpus_new = aligned.reshape(L * t.num_nodes, t.gpus_per_node, S)
        gpus_old = old.reshape(L * t.num_nodes, t.gpus_per_node, S)
    else:
        gpus_new = phy2log.reshape(L, t.num_gpus, S)
        gpus_old = old.reshape(L, t.num_gpus, S)
    gpus = _align_bins(gpus_new, gpus_old, t.num_experts)
    slots = _align_slots(gpus.reshape(-1, S), gpus_old.reshape(-1, S))
    return slots.reshape(L, t.num_slots).astype(np.int32)


def repair_previous(
    loads: np.ndarray,
    previous: Placement,
    topology: Topology,
    target: np.ndarray,
    by_node: bool,
    fresh: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    """``loads`` ``[L, E]``, ``target`` ``[L]`` busiest-gpu load to reach → candidate
    ``phy2log`` arrays ``[L, P]`` by name, each changed from ``previous`` only until each
    layer's busiest gpu is at most its target (or as far as it got; the caller checks):

    - swaps of two slots between gpus (within a node when ``by_node``), then count moves (one
      slot rewritten with another expert, see ``eplb.refine``) with swaps after them;
    - a recount: replica counts changed in one go to those of ``fresh`` ``[L, P]`` (for
      ``by_node``, water-filling within each node), each lost replica taken from the busiest
      gpu holding it and each new one written into a freed slot on the lightest gpu that lacks
      it, then the same swaps and count moves. With few slots per gpu the balance hangs on
      the counts and one count move at a time stalls: the donor's replicas often share gpus
      with the expert that needs one more.
    """
    t = topology
    L, S = t.num_layers, t.slots_per_gpu
    prev = previous.phy2log
    node_exp = _node_experts(prev, t) if by_node and t.num_nodes > 1 else None
    if node_exp is None:
        phy = prev.reshape(L, t.num_gpus, S).astype(np.int64)
        counts = None
        if fresh is not None:
            counts = _counts(fresh.reshape(L, t.num_gpus, S).astype(np.int64), t.num_experts)
        out = {"repaired": _repair_rows(loads, phy, target, None, None, prev, t)}
        if counts is not None:
            out["recounted"] = _repair_rows(loads, phy, target, counts, None, prev, t)
        return out
    rows, bins = L * t.num_nodes, t.gpus_per_node
    phy = _to_local(prev.reshape(rows, bins, S), node_exp, t.num_experts)
    out = {
        "repaired": _repair_rows(loads, phy, target, None, node_exp, prev, t),
        "recounted": _repair_rows(loads, phy, target, True, node_exp, prev, t),
    }
    # When the busiest node itself is above the target no repair within nodes can reach it:
    # swap groups between nodes (each time the swap that most lowers the busiest node, until
    # it is below the target), the incoming group's experts taking the outgoing group's
    # slots, then recount and repair.
    swapped = None
    for _ in range(t.num_groups // 2):
        nxt = _swap_groups(loads, node_exp if swapped is None else swapped, t, target)
        if nxt is None:
            break
        swapped = nxt
    if swapped is not None:
        out["regrouped"] = _repair_rows(loads, phy, target, True, swapped, prev, t)
    return out


def _repairs(
    loads: np.ndarray,
    previous: Placement,
    topology: Topology,
    targets: list,
    by_node: bool,
    fresh: np.ndarray,
    pad: bool = False,
) -> tuple[list[tuple[str, np.ndarray]], bool]:
    """``repair_previous`` for each of ``targets`` (``[L]`` arrays) → (name, ``phy2log`` ``[L, P]``)
    pairs, target by target, and whether any layer swapped groups between nodes. The targets
    run as one stacked problem of ``K * L`` layers (rows are independent): one pass of each step
    instead of ``K`` keeps numpy's per-call cost down. With ``pad``, hierarchical repairs always
    carry a ``regrouped`` candidate (the ``recounted`` one where no layer swapped), so every
    chunk of layers has the same candidates; the caller drops them when no chunk swapped."""
    K, L = len(targets), topology.num_layers
    stacked = topology.with_layers(K * L)
    prev = Placement(np.tile(previous.phy2log, (K, 1)), stacked)
    out = repair_previous(
        np.tile(loads, (K, 1)), prev, stacked, np.concatenate(targets), by_node, np.tile(fresh, (K, 1))
    )
    swapped = "regrouped" in out
    if pad and not swapped and "recounted" in out and by_node and topology.num_nodes > 1:
        out["regrouped"] = out["recounted"]
    return [(name, cand[k * L : (k + 1) * L]) for k in range(K) for name, cand in out.items()], swapped


def _ways(job: tuple) -> tuple[list, np.ndarray, np.ndarray, np.ndarray, bool]:
    """One chunk of layers' candidates, scored (see ``_score``): ``job`` is ``loads`` ``[l, E]``,
    ``old`` and ``fresh`` ``[l, P]``, their topology, repair ``targets`` (``[l]`` arrays), ``by_node``
    ``ends`` (kept first and fresh aligned last) and ``pad`` (see ``_repairs``). Also whether
    any layer swapped groups.
    Layers are independent here, so a chunk's rows equal those of all layers at once."""
    loads, old, fresh, topology, targets, by_node, ends, pad = job
    previous = Placement(old, topology)
    ways = [("kept", old)] if ends else []
    swapped = False
    if targets:
        repaired, swapped = _repairs(loads, previous, topology, targets, by_node, fresh, pad)
        ways += repaired
    if ends:
        ways.append(("replanned", align_to_previous(fresh, previous, topology, by_node)))
    return (*_score(ways, loads, old, topology), swapped)


def _candidates(
    loads: np.ndarray,
    old: np.ndarray,
    fresh: np.ndarray,
    topology: Topology,
    targets: list,
    by_node: bool,
    ends: bool,
    workers: int,
) -> tuple[list, np.ndarray, np.ndarray, np.ndarray]:
    """``_ways`` over all layers → names, candidates ``[C, L, P]``, imbalance and moves ``[C, L]``:
    in this process, or in ``workers`` processes, each taking an equal share of the layers (the
    same result: any split gives it)."""
    L = topology.num_layers
    step = -(-L // min(workers, L))
    jobs, pad = [], step < L
    for a in range(0, L, step):
        b = min(a + step, L)
        chunk = topology.with_layers(b - a)
        jobs.append((loads[a:b], old[a:b], fresh[a:b], chunk, [t[a:b] for t in targets], by_node, ends, pad))
    parts = list(worker_pool(workers).map(_ways, jobs)) if len(jobs) > 1 else [_ways(jobs[0])]
    names = parts[0][0]
    keep = np.ones(len(names), dtype=bool)
    if not any(p[4] for p in parts):
        keep = np.array([n != "regrouped" for n in names])
    names = [n for n, k in zip(names, keep) if k]
    cands, imb, moves = (np.concatenate([p[i][keep] for p in parts], axis=1) for i in (1, 2, 3))
    return names, cands, imb, moves


def _repair_rows(
    loads: np.ndarray,
    phy: np.ndarray,
    target: np.ndarray,
    counts: np.ndarray | bool | None,
    node_exp: np.ndarray | None,
    prev: np.ndarray,
    t: Topology,
) -> np.ndarray:
    """One repair from ``phy`` ``[R, B, S]`` (rows are layers, or (layer, node) pairs with
    local expert ids into ``node_exp`` ``[R, E/N]``): optionally a recount to ``counts``
    ``[R, E]`` (``True``: water-filling within each row), then the best per row of three
    orders of rotations, ejection chains, count repairs, swaps and count moves.
    Returns global ``phy2log`` ``[L, P]`` with staying experts in their old slots."""
    L, S = t.num_layers, t.slots_per_gpu
    rows, bins = phy.shape[:2]
    if node_exp is not None:
        tgt = np.repeat(target, t.num_nodes)
        row_loads = np.take_along_axis(np.repeat(loads, t.num_nodes, axis=0), node_exp, axis=1)
    else:
        tgt, row_loads = target, loads
    cap = replica_cap(row_loads.shape[1], bins * S, bins)
    can_move = cap is not None and _distinct_per_bin(phy)
    cand = phy.copy()
    if counts is not None and can_move:
        if counts is True:
            counts = waterfill(row_loads, bins * S, cap)
        recount, ok = _recount(row_loads, phy, counts)
        cand = np.where(ok[:, None, None], recount, phy)
    # Three orders, the best per row: rotations first (two bins above the target fixed with
    # three slots), ejection chains first (k bins with k + 1), or count moves that relieve
    # every gpu of an expert that grew (one slot, see ``eplb.repair``) before the chains; each
    # then swaps (one bin with two) and count moves. Chains use the room below the target
    # tightly and can strand a bin far above it that then costs several swaps, and count moves
    # can leave donors' gpus in the way, so no order wins every row (measured).
    outs = [_finish(row_loads, cand.copy(), tgt, cap, chains=False)]
    outs.append(_finish(row_loads, cand.copy(), tgt, cap, chains=True))
    counted = outs[1].copy()
    if cap is not None and _distinct_per_bin(cand):
        c = cand.copy()
        count_repair(row_loads, c, tgt, cap)
        # Rows without a count move would only repeat the chains-first order.
        moved = np.flatnonzero((c != cand).any(axis=(1, 2)))
        if moved.size:
            counted[moved] = _finish(row_loads[moved], c[moved], tgt[moved], cap, chains=True)
    outs.append(counted)
    # Rows that reach the target first, then fewer rewritten slots, then the lower busiest bin;
    # compared per row (a sort by keys), so a row's pick never depends on the other rows.
    busiest = np.stack([_bin_loads(row_loads, c).max(axis=1) for c in outs])  # [3, R]
    moved_slots = np.stack([(c != phy).sum(axis=(1, 2)) for c in outs])
    missed = busiest > tgt * (1 + _REL_TOL)
    best = np.lexsort((busiest, moved_slots, missed), axis=0)[0]
    cand = np.stack(outs)[best, np.arange(rows)]
    if node_exp is not None:
        cand = np.take_along_axis(node_exp, cand.reshape(rows, -1), axis=1)
    # A run of swaps can take an expert off a gpu and bring it back to another slot.
    return _align_slots(cand.reshape(-1, S), prev.reshape(-1, S)).reshape(L, t.num_slots)


def _finish(loads: np.ndarray, c: np.ndarray, tgt: np.ndarray, cap: int | None, chains: bool) -> np.ndarray:
    """``c`` ``[R, B, S]`` repaired towards ``tgt`` ``[R]``: chains (or not), rotations, swaps,
    count moves and swaps again."""
    if _distinct_per_bin(c):
        if chains:
            chain_improve(loads, c, tgt)
        rotate_improve(loads, c, tgt)
    everything = np.arange(c.shape[0])
    swap_improve(loads, c, everything, 64, tgt)
    if cap is not None and _distinct_per_bin(c):
        c = refine_counts(loads, c, cap, iterations=32, target=tgt)
        swap_improve(loads, c, everything, 64, tgt)
    return c


def _swap_groups(loads: np.ndarray, node_exp: np.ndarray, t: Topology, target: np.ndarray) -> np.ndarray | None:
    """``node_exp`` ``[L * N, E/N]`` (each node's experts, group blocks in order) → the same with
    one group swapped between two nodes in every layer whose busiest node's mean gpu load is
    above ``target`` ``[L]`` and where a swap lowers it; ``None`` when no layer swaps."""
    L, N, gs = t.num_layers, t.num_nodes, t.experts_per_group
    K = t.num_groups // N
    groups = node_exp.reshape(L, N * K, gs)[:, :, 0] // gs  # [L, N*K] group at each position
    gload = loads.reshape(L, t.num_groups, gs).sum(axis=2)
    pos_load = np.take_along_axis(gload, groups, axis=1)  # [L, N*K]
    node_of = np.repeat(np.arange(N), K)
    node_load = pos_load.reshape(L, N, K).sum(axis=2)
    # Swapping positions i and j: node_of[i] gains load[j] - load[i], node_of[j] the opposite.
    delta = pos_load[:, None, :] - pos_load[:, :, None]  # [L, i, j]
    new = np.broadcast_to(node_load[:, None, None, :], (L, N * K, N * K, N)).copy()
    ii, jj = np.meshgrid(np.arange(N * K), np.arange(N * K), indexing="ij")
    new[:, ii, jj, node_of[ii]] += delta
    new[:, ii, jj, node_of[jj]] -= delta
    worst = new.max(axis=3).reshape(L, -1)
    worst[:, (node_of[ii] == node_of[jj]).ravel()] = np.inf
    best = worst.argmin(axis=1)
    now = node_load.max(axis=1)
    act = (now / t.gpus_per_node > target) & (worst[np.arange(L), best] < now)
    if not act.any():
        return None
    blocks = node_exp.reshape(L, N * K, gs)
    out = blocks.copy()
    la = np.flatnonzero(act)
    i, j = np.unravel_index(best[la], (N * K, N * K))
    out[la, i] = _by_rank(loads[la], blocks[la, j], blocks[la, i])
    out[la, j] = _by_rank(loads[la], blocks[la, i], blocks[la, j])
    return out.reshape(L * N, -1)


def _by_rank(loads: np.ndarray, incoming: np.ndarray, outgoing: np.ndarray) -> np.ndarray:
    """``incoming``, ``outgoing``: ``[X, gs]`` experts → ``incoming`` reordered so its k-th
    busiest expert takes the place (and so the slots and replica count) of ``outgoing``'s."""
    rx = np.arange(len(loads))[:, None]
    inc = np.take_along_axis(incoming, np.argsort(-loads[rx, incoming], axis=1, kind="stable"), axis=1)
    rank_out = np.argsort(np.argsort(-loads[rx, outgoing], axis=1, kind="stable"), axis=1)
    return np.take_along_axis(inc, rank_out, axis=1)


def _recount(loads: np.ndarray, phy: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``loads`` ``[R, E]``, ``phy`` ``[R, B, S]``, ``counts`` ``[R, E]`` → ``phy`` with those
    replica counts and ``[R]`` whether each row could be rewritten without putting two replicas
    of one expert on one gpu. Only slots whose expert loses or gains a replica change."""
    R, B, S = phy.shape
    E = loads.shape[1]
    flat = phy.reshape(R, B * S).copy()
    w = loads / np.maximum(counts, 1)
    ra = np.arange(R)
    slot_w = w[ra[:, None], flat]
    gpu_load = slot_w.reshape(R, B, S).sum(axis=2)
    have = _counts(phy, E)
    # Replicas to drop: each losing expert's replicas on its busiest gpus first. Rank every
    # slot within its (row, expert) by the load of its gpu, heaviest first.
    slot_gpu_load = np.repeat(gpu_load, S, axis=1)
    r_, e_ = np.repeat(ra, B * S), flat.ravel()
    order = np.lexsort((-slot_gpu_load.ravel(), e_, r_))
    key = r_[order] * E + e_[order]
    pos = np.arange(order.size)
    first = np.maximum.accumulate(np.where(np.r_[True, key[1:] != key[:-1]], pos, 0))
    rank = np.empty_like(pos)
    rank[order] = pos - first
    free = (rank < np.maximum(have - counts, 0)[r_, e_]).reshape(R, B * S)
    gpu_load -= np.where(free, slot_w, 0.0).reshape(R, B, S).sum(axis=2)
    holds = np.zeros((R, B, E), dtype=bool)
    kept = ~free.reshape(R, B, S)
    rk, bk, sk = np.nonzero(kept)
    holds[rk, bk, phy[rk, bk, sk]] = True
    # Replicas to add, heaviest first, each into the freed slot on the lightest gpu lacking it.
    gain = np.maximum(counts - have, 0)
    K = int(gain.sum(axis=1).max(initial=0))
    ids = np.full((R, max(K, 1)), -1, dtype=np.int64)
    for r in np.flatnonzero(gain.sum(axis=1)):
        g = np.repeat(np.arange(E), gain[r])
        ids[r, : g.size] = g[np.argsort(-w[r, g], kind="stable")]
    ok = np.ones(R, dtype=bool)
    for k in range(K):
        e = ids[:, k]
        act = e >= 0
        fits = free.reshape(R, B, S) & ~holds[ra, :, np.maximum(e, 0)][:, :, None]
        score = np.where(fits, gpu_load[:, :, None], np.inf).reshape(R, B * S)
        pick = score.argmin(axis=1)
        placed = act & np.isfinite(score[ra, pick])
        ok &= ~act | placed
        r, p, x = ra[placed], pick[placed], e[placed]
        flat[r, p] = x
        free[r, p] = False
        gpu_load[r, p // S] += w[r, x]
        holds[r, p // S, x] = True
    ok &= ~free.any(axis=1)
    return flat.reshape(R, B, S), ok


def _groups_whole(phy2log: np.ndarray, t: Topology) -> np.ndarray:
    """``[L, P]`` → ``[L]`` bool: every node holds only whole groups, ``num_groups / num_nodes`` of
    them, each expert of those groups at least once (what a hierarchical plan guarantees)."""
    L, N, K, gs = phy2log.shape[0], t.num_nodes, t.num_groups // t.num_nodes, t.experts_per_group
    nodes = phy2log.reshape(L * N, t.slots_per_node)
    present = np.zeros((L * N, t.num_experts), dtype=bool)
    present[np.arange(L * N)[:, None], nodes] = True
    per_group = present.reshape(L * N, t.num_groups, gs)
    touched = per_group.any(axis=2)
    full = per_group.all(axis=2)
    ok = (touched == full).all(axis=1) & (full.sum(axis=1) == K)
    return ok.reshape(L, N).all(axis=1)


def _distinct_per_bin(phy: np.ndarray) -> bool:
    srt = np.sort(phy, axis=2)
    return not (srt[:, :, 1:] == srt[:, :, :-1]).any()


def _node_experts(prev: np.ndarray, t: Topology) -> np.ndarray | None:
    """``[L, P]`` → ``[L * N, E/N]``: each node's experts ascending, or ``None`` when some node
    does not hold exactly ``num_groups / num_nodes`` whole groups (not a hierarchical plan)."""
    L, N, K = prev.shape[0], t.num_nodes, t.num_groups // t.num_nodes
    g = np.sort(prev.reshape(L * N, t.slots_per_node) // t.experts_per_group, axis=1)
    first = np.ones_like(g, dtype=bool)
    first[:, 1:] = g[:, 1:] != g[:, :-1]
    if not (first.sum(axis=1) == K).all():
        return None
    groups = g[first].reshape(L * N, K)
    return (groups[:, :, None] * t.experts_per_group + np.arange(t.experts_per_group)).reshape(L * N, -1)


def _to_local(phy: np.ndarray, node_exp: np.ndarray, num_experts: int) -> np.ndarray:
    """Global expert ids ``[R, B, S]`` → positions in each row's ``node_exp`` ``[R, E/N]``."""
    R = phy.shape[0]
    inv = np.zeros((R, num_experts), dtype=np.int64)
    inv[np.arange(R)[:, None], node_exp] = np.arange(node_exp.shape[1])
    return inv[np.arange(R)[:, None, None], phy]


def choose(
    loads: np.ndarray,
    previous: Placement,
    fresh: np.ndarray,
    topology: Topology,
    tolerance: float,
    layer_tolerance: float,
    by_node: bool,
    max_moves: int | None = None,
    max_layer_moves: int | None = None,
    workers: int = 1,
) -> tuple[np.ndarray, dict, tuple[str, ...]]:
    """``loads`` ``[L, E]``, ``fresh`` ``[L, P]`` (a fresh plan) → ``phy2log`` ``[L, P]`` moving as
    few slots from ``previous`` as it can while the mean imbalance over layers stays within
    ``(1 + tolerance)`` of fresh's and every layer's within ``(1 + layer_tolerance)`` of fresh's
    for that layer; and how many layers took each way.

    A step waits for its busiest gpu in every layer, so the sum over layers is what costs time:
    moves go where they buy the most balance. Each layer picks one candidate (kept, the
    repairs of ``repair_previous`` aiming at ``(1 + 0.5 tolerance)``, ``(1 + tolerance)`` and
    ``(1 + 3 tolerance)`` of fresh's busiest gpu, or fresh aligned onto ``previous``); the pick
    minimises ``moves + lambda * imbalance`` per layer, with the smallest ``lambda`` that meets
    the mean, then cheaper candidates are taken greedily while the mean allows. Ties go to the
    earlier candidate, so a layer keeps its placement when that is as good.

    Move budgets are hard limits, the tolerances goals: no layer rewrites more than
    ``max_layer_moves`` slots and the re-plan no more than ``max_moves`` in all. When they
    stop the tolerances from being met, repairs that go only part of the way from the current
    busiest gpu to fresh's (a quarter, half, three quarters) join the candidates and the pick
    turns round: the lowest mean imbalance the budgets allow (``budget_limited`` in the result).

    ``workers`` > 1: that many processes make the candidates, each for a share of the layers
    (a layer's candidates depend on that layer alone); only the pick, which couples layers
    through the mean and ``max_moves``, runs here. The result is the same for any ``workers``.
    """
    old = previous.phy2log
    L = topology.num_layers
    fresh_load = gpu_loads(loads, Placement(fresh, topology))
    fresh_imb, fresh_max = imbalance(fresh_load), fresh_load.max(axis=1)
    kept_load = gpu_loads(loads, previous)
    keep_imb = imbalance(kept_load)
    budget = (1.0 + tolerance) * fresh_imb.sum() * (1 + _REL_TOL)
    cap = (1.0 + layer_tolerance) * fresh_imb * (1 + _REL_TOL)
    # A hierarchical plan keeps every group whole on one node; a previous placement that does
    # not (e.g. the contiguous first version) cannot be kept or repaired within nodes, so
    # those layers take the fresh plan aligned onto it.
    whole = _groups_whole(old, topology) if by_node and topology.num_nodes > 1 else np.ones(L, dtype=bool)
    if not whole.all():
        names, cands, imb, moves = _candidates(loads, old, fresh, topology, [], by_node, True, workers)
    elif keep_imb.sum() > budget or (keep_imb > cap).any():
        # Repairs aim at (1 + k * tolerance) of fresh for each k of _TARGETS that a layer may go
        # to: deeper ones make up for layers left cheaper.
        ks = [k for k in _TARGETS if k == 1.0 or (tolerance > 0 and k * tolerance <= layer_tolerance)]
        targets = [(1.0 + k * tolerance) * fresh_max for k in ks]
        names, cands, imb, moves = _candidates(loads, old, fresh, topology, targets, by_node, True, workers)
    else:
        names, cands, imb, moves = _score([("kept", old)], loads, old, topology)
    if not whole.all():
        # Only the fresh plan keeps groups whole there: no move budget can hold it back.
        pick = np.where(whole, _pick_within(moves, imb, cap, budget, max_layer_moves), len(names) - 1)
        return _result(names, cands, pick, imb, moves, fresh_imb, tolerance, max_moves, max_layer_moves, False, whole)
    pick = _pick_within(moves, imb, cap, budget, max_layer_moves)
    cols = np.arange(L)
    limited = False
    if max_moves is not None or max_layer_moves is not None:
        missed = imb[pick, cols].sum() > budget or (imb[pick, cols] > cap).any()
        if missed or (max_moves is not None and moves[pick, cols].sum() > max_moves):
            # Budgets bind: partial repairs are the cheap steps a tight budget can still take.
            kept_max = kept_load.max(axis=1)
            targets = [
                np.maximum(fresh_max + f * (kept_max - fresh_max), (1.0 + tolerance) * fresh_max) for f in _PARTIAL
            ]
            more = _candidates(loads, old, fresh, topology, targets, by_node, False, workers)
            # Fresh aligned stays last.
            names = names[:-1] + more[0] + names[-1:]
            cands, imb, moves = (np.concatenate([x[:-1], y, x[-1:]]) for x, y in zip((cands, imb, moves), more[1:]))
            pick = _pick_within(moves, imb, cap, budget, max_layer_moves)
            if max_moves is not None and moves[pick, cols].sum() > max_moves:
                fits = np.ones_like(moves, dtype=bool) if max_layer_moves is None else moves <= max_layer_moves
                fits[0] = True  # kept: no moves
                pick = _pick(np.where(fits, imb, np.inf), moves, max_moves)
            limited = True
    return _result(names, cands, pick, imb, moves, fresh_imb, tolerance, max_moves, max_layer_moves, limited, whole)


def _result(
    names: list,
    cands: np.ndarray,
    pick: np.ndarray,
    imb: np.ndarray,
    moves: np.ndarray,
    fresh_imb: np.ndarray,
    tolerance: float,
    max_moves: int | None,
    max_layer_moves: int | None,
    limited: bool,
    whole: np.ndarray,
) -> tuple[np.ndarray, dict, tuple[str, ...]]:
    """The picked candidate per layer, how many layers took each way, and notes."""
    cols = np.arange(pick.size)
    out = cands[pick, cols]
    taken = {f"layers_{n}": 0 for n in ("kept", "repaired", "recounted", "regrouped", "replanned")}
    for i, name in enumerate(names):
        taken[f"layers_{name}"] += int((pick == i).sum())
    taken["budget_limited"] = int(limited)
    notes: tuple[str, ...] = ()
    if not whole.all():
        notes += (
            f"previous placement splits expert groups across nodes in {int((~whole).sum())} layers: "
            "those layers take the fresh hierarchical plan, whatever the move budget",
        )
    if limited:
        got = imb[pick, cols]
        notes += (
            f"move budget (max_moves={max_moves}, max_layer_moves={max_layer_moves}) held the re-plan to "
            f"{int(moves[pick, cols].sum())} moves: mean imbalance {got.mean():.4f} against "
            f"{(1 + tolerance) * fresh_imb.mean():.4f} allowed by the tolerance (fresh plan {fresh_imb.mean():.4f})",
        )
    return out, taken, notes


def _score(
    ways: list, loads: np.ndarray, old: np.ndarray, topology: Topology
) -> tuple[list, np.ndarray, np.ndarray, np.ndarray]:
    """``ways`` (name, ``phy2log`` ``[L, P]``) pairs → names, candidates ``[C, L, P]``, their
    imbalance and moves ``[C, L]``."""
    names = [name for name, _ in ways]
    cands = np.stack([c for _, c in ways])
    # A repair from a previous placement with two replicas of an expert on one gpu can lose an
    # expert; such a layer falls back to the kept one rather than publish an invalid plan.
    E = topology.num_experts
    C, L, P = cands.shape
    keys = (np.arange(C * L)[:, None] * E + cands.reshape(C * L, P)).ravel()
    lost = (np.bincount(keys, minlength=C * L * E).reshape(C, L, E) == 0).any(axis=2)
    cands = np.where(lost[:, :, None], old[None], cands)
    imb = np.stack([imbalance(gpu_loads(loads, Placement(c, topology))) for c in cands])
    moves = (cands != old[None]).sum(axis=2).astype(np.float64)
    return names, cands, imb, moves


def _pick_within(
    moves: np.ndarray, imb: np.ndarray, cap: np.ndarray, budget: float, max_layer_moves: int | None
) -> np.ndarray:
    """``moves``, ``imb`` ``[C, L]`` (row 0 kept, the last fresh aligned) → the fewest moves that
    meet the mean ``budget`` with every layer within ``cap`` ``[L]`` and ``max_layer_moves``; a
    layer where nothing within its move budget meets its cap may take anything within it."""
    allowed = imb <= cap
    allowed[-1] = True  # fresh aligned has fresh's balance (and is "kept" when alone)
    if max_layer_moves is not None:
        fits = moves <= max_layer_moves
        fits[0] = True
        allowed &= fits
        stuck = ~allowed.any(axis=0)
        allowed[:, stuck] = fits[:, stuck]
    return _pick(np.where(allowed, moves, np.inf), imb, budget)


def _pick(cost: np.ndarray, imb: np.ndarray, budget: float) -> np.ndarray:
    """``cost``, ``imb``: ``[C, L]`` (``inf`` cost: not allowed) → ``[L]`` candidate per layer with
    the least total cost whose ``imb`` sums to at most ``budget`` (Lagrangian, then greedy)."""
    C, L = cost.shape
    cols = np.arange(L)

    def at(lam: float) -> np.ndarray:
        return np.argmin(cost + lam * imb, axis=0)  # first minimum: the earlier candidate

    best = np.argmin(np.where(np.isfinite(cost), imb, np.inf), axis=0)
    if imb[best, cols].sum() > budget:
        return best  # nothing meets the budget; the most balanced allowed candidates
    lo, hi = -3.0, 15.0  # log10 of lambda
    pick = at(10.0**hi)
    if imb[pick, cols].sum() > budget:
        pick = best
    for _ in range(50):
        mid = (lo + hi) / 2
        trial = at(10.0**mid)
        if imb[trial, cols].sum() <= budget:
            hi, pick = mid, trial
        else:
            lo = mid
    # Spend what the Lagrangian left of the budget on the cheapest swaps to fewer moves.
    left = budget - imb[pick, cols].sum()
    while True:
        saved = cost[pick, cols][None, :] - cost  # [C, L]
        extra = imb - imb[pick, cols][None, :]
        ok = (saved > 0) & np.isfinite(saved) & (extra <= left)
        if not ok.any():
            return pick
        rate = np.where(ok, saved / np.maximum(extra, 1e-300), -np.inf)
        c, layer = np.unravel_index(np.argmax(rate), rate.shape)
        left -= max(extra[c, layer], 0.0)
        pick[layer] = c
