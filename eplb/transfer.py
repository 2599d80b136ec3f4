"""Which weight copies turn one placement into another, and who sends them.

``transfer_plan(old, new, topology, expert_bytes=...)`` lists, for every slot whose expert
changes, the slot of the OLD placement to copy the expert's weights from: a slot on the same
gpu if one held the expert (a device-local copy), else one on the same node, else any gpu.
Among equally near sources it picks the gpu that has sent the least so far, so the senders
share the work. Sources refer to the old placement (a slot that keeps the expert first): a mover reads every
source before it overwrites any slot (or stages through a buffer), since a source may change.

``transfer_schedule(old, new, topology, expert_bytes=..., bandwidth=...)`` turns the plan
into what a mover executes: one incoming copy per (layer, gpu, expert), local copies and
fills within each gpu, and peer-to-peer rounds in which each gpu exchanges with at most one
peer (same-node pairs matched first), with byte counts and a predicted time from a
bandwidth model (``Bandwidth``).

Down gpus (every slot -1 in ``new``) neither send nor receive; a slot that empties copies
nothing. An expert that no live gpu held in ``old`` (its replicas were all on gpus now down)
has no source: its copies are ``RESTORE`` transfers (``src_slot`` and ``src_gpu`` -1), which
the engine loads from a host copy or the checkpoint.

``staged_chunks(schedule, slot_bytes, staging_bytes)`` cuts the layers into consecutive chunks
whose incoming copies fit a receive-buffer budget on every gpu (``staged_slots``: the buffer
slots per layer and gpu), so a mover can switch a transition chunk by chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import checks
from .placement import Placement
from .topology import Topology

__all__ = [
    "INTER_NODE",
    "INTRA_NODE",
    "LOCAL",
    "RESTORE",
    "Bandwidth",
    "TransferPlan",
    "TransferSchedule",
    "staged_chunks",
    "staged_slots",
    "transfer_plan",
    "transfer_schedule",
]

LOCAL = 0
"""A copy's kind: within one gpu."""
INTRA_NODE = 1
"""A copy's kind: between two gpus of one node."""
INTER_NODE = 2
"""A copy's kind: between nodes."""
RESTORE = 3
"""A copy's kind: from a host backup (no live gpu holds the expert)."""
KIND_NAMES = ("local", "intra-node", "inter-node", "restore")


@dataclass(frozen=True, eq=False)
class TransferPlan:
    """``T`` copies, each an expert's weights from ``src_slot`` (old) to ``dst_slot`` (new).

    Per-transfer int64 ``[T]`` arrays, sorted by (layer, dst_slot): ``layer``, ``dst_slot``,
    ``src_slot``, ``expert``, ``kind`` (``LOCAL`` 0, ``INTRA_NODE`` 1, ``INTER_NODE`` 2,
    ``RESTORE`` 3: no live gpu holds the expert, ``src_slot`` and ``src_gpu`` are -1), and
    ``src_gpu``, ``dst_gpu``. Per-gpu float64 ``[G]`` bytes over all layers: ``sent_bytes`` and
    ``received_bytes`` count copies between gpus (local copies cross no link and are in
    ``local_bytes``; restores in ``restored_bytes``), ``cross_node_sent_bytes`` /
    ``cross_node_received_bytes`` the inter-node part of them.
    """

    topology: Topology
    layer: np.ndarray
    dst_slot: np.ndarray
    src_slot: np.ndarray
    expert: np.ndarray
    kind: np.ndarray
    src_gpu: np.ndarray
    dst_gpu: np.ndarray
    sent_bytes: np.ndarray
    received_bytes: np.ndarray
    local_bytes: np.ndarray
    cross_node_sent_bytes: np.ndarray
    cross_node_received_bytes: np.ndarray
    restored_bytes: np.ndarray

    @property
    def num_transfers(self) -> int:
        return int(self.layer.size)

    @property
    def cross_node_bytes(self) -> float:
        """Total bytes that cross a node boundary."""
        return float(self.cross_node_sent_bytes.sum())

    def kind_counts(self) -> dict[str, int]:
        """Transfers of each kind, by name."""
        counts = np.bincount(self.kind, minlength=len(KIND_NAMES))
        return {name: int(n) for name, n in zip(KIND_NAMES, counts)}


def transfer_plan(
    old: Placement, new: Placement, topology: Topology, *, expert_bytes: float | np.ndarray = 1.0
) -> TransferPlan:
    """``old``, ``new``: placements ``[L, P]`` of ``topology`` → the copies that turn old into new.

    ``expert_bytes``: one expert's weights in bytes (a scalar, or ``[L]`` per layer); the
    default 1 makes the byte figures count copies.

    Greedy, vectorised across layers: each layer's changed slots are taken in order of how
    few gpus could send them (forced ones first), and each goes to the candidate gpu of the
    nearest kind that has sent the least in that layer, ties to the one that has sent the
    least over all layers so far, then to the lowest id.
    """
    for name, p in (("old", old), ("new", new)):
        if not isinstance(p, Placement):
            raise ValueError(f"{name} must be a Placement, got {type(p).__name__}")
        if p.topology != topology:
            raise ValueError(f"{name} placement is for {p.topology}, not {topology}")
    L, E, P, G = topology.num_layers, topology.num_experts, topology.num_slots, topology.num_gpus
    S, gpn = topology.slots_per_gpu, topology.gpus_per_node
    size = np.broadcast_to(np.asarray(expert_bytes, dtype=np.float64), (L,))
    if size.shape != (L,) or not np.isfinite(size).all() or (size < 0).any():
        raise ValueError(f"expert_bytes must be a finite number >= 0 or an [L] = [{L}] array of them")

    gpu = np.arange(G)
    # held[l, e, g]: gpu g held expert e in the old placement and is live in the new one (a
    # down gpu sends nothing); first_slot: its lowest such slot. Empty slots (-1) index a
    # column E of their own, dropped.
    source = (old.phy2log >= 0) & np.repeat(new.live, S)[None]
    old_gpu_exp = np.where(source, old.phy2log, E).reshape(L, G, S)
    held = np.zeros((L, E + 1, G), dtype=bool)
    held[np.arange(L)[:, None, None], old_gpu_exp, gpu[None, :, None]] = True
    held = held[:, :E]
    # A slot that keeps its expert is the best source: its content never changes, so a mover
    # may read it at any time; among changed slots the lowest id. A slot that empties needs
    # no copy.
    changed = (old.phy2log != new.phy2log) & (new.phy2log >= 0)  # [L, P]
    first_key = np.full((L, E + 1, G), 2 * P, dtype=np.int64)
    slot_key = np.arange(P)[None] + P * (old.phy2log != new.phy2log).astype(np.int64)  # [L, P]
    np.minimum.at(first_key, (np.arange(L)[:, None, None], old_gpu_exp, gpu[None, :, None]), slot_key.reshape(L, G, S))
    first_slot = first_key[:, :E] % P

    lay, dst = np.nonzero(changed)
    exp = new.phy2log[lay, dst].astype(np.int64)
    dgpu = dst // S
    cand = held[lay, exp]  # [T, G]
    # kind of each candidate gpu relative to the destination gpu; the nearest kind wins.
    cand_kind = np.where(
        gpu[None] == dgpu[:, None], LOCAL, np.where(gpu[None] // gpn == (dgpu // gpn)[:, None], INTRA_NODE, INTER_NODE)
    )
    cand_kind = np.where(cand, cand_kind, RESTORE)
    kind = cand_kind.min(axis=1)  # RESTORE: no live gpu holds the expert
    allowed = (cand_kind == kind[:, None]) & cand  # [T, G]
    T = lay.size

    # Rank transfers within their layer: fewest candidate senders first (they have no choice).
    order = np.lexsort((dst, allowed.sum(axis=1), lay))
    rank = np.empty(T, dtype=np.int64)
    starts = np.searchsorted(lay[order], np.arange(L))
    rank[order] = np.arange(T) - starts[lay[order]]
    src_gpu = np.empty(T, dtype=np.int64)
    sent_layer = np.zeros((L, G), dtype=np.int64)
    sent_total = np.zeros(G, dtype=np.int64)
    by_rank = order[np.argsort(rank[order], kind="stable")]
    bounds = np.searchsorted(rank[by_rank], np.arange(int(rank.max(initial=-1)) + 2))
    for k in range(len(bounds) - 1):  # one pass per rank; each pass covers every layer at once
        idx = by_rank[bounds[k] : bounds[k + 1]]
        # Local copies load no link, so they do not count as sent; restores have no sender.
        key = sent_layer[lay[idx]] * (G * (P + 1)) * L + sent_total[None] * G + gpu[None]
        pick = np.where(allowed[idx], key, np.iinfo(np.int64).max).argmin(axis=1)
        src_gpu[idx] = pick
        remote = (kind[idx] != LOCAL) & (kind[idx] != RESTORE)
        sent_layer[lay[idx][remote], pick[remote]] += 1
        sent_total += np.bincount(pick[remote], minlength=G)

    restore = kind == RESTORE
    src_gpu[restore] = -1
    src = np.where(restore, -1, first_slot[lay, exp, np.maximum(src_gpu, 0)])
    nbytes = size[lay]
    remote = (kind != LOCAL) & ~restore
    cross = kind == INTER_NODE
    return TransferPlan(
        topology=topology,
        layer=lay.astype(np.int64),
        dst_slot=dst.astype(np.int64),
        src_slot=src,
        expert=exp,
        kind=kind.astype(np.int64),
        src_gpu=src_gpu,
        dst_gpu=dgpu.astype(np.int64),
        sent_bytes=np.bincount(src_gpu[remote], nbytes[remote], minlength=G),
        received_bytes=np.bincount(dgpu[remote], nbytes[remote], minlength=G),
        local_bytes=np.bincount(dgpu[~remote], nbytes[~remote], minlength=G),
        cross_node_sent_bytes=np.bincount(src_gpu[cross], nbytes[cross], minlength=G),
        cross_node_received_bytes=np.bincount(dgpu[cross], nbytes[cross], minlength=G),
        restored_bytes=np.bincount(dgpu[restore], nbytes[restore], minlength=G),
    )


@dataclass(frozen=True)
class Bandwidth:
    """The bandwidth model that predicts a schedule's time; speeds in GB/s (1e9 bytes/s).

    ``local_gb_s``: bytes copied per second by one device-to-device copy within a gpu;
    ``intra_node_gb_s`` / ``inter_node_gb_s``: one direction of a peer-to-peer transfer
    between two gpus of one node / of two nodes (links are full duplex);
    ``round_latency_s``: fixed cost of one round (launch and synchronisation).
    The defaults are round figures for H100/H200 nodes (NVLink 4, one 400 Gb/s NIC per gpu);
    pass measured values (``bench/mover_bench.py`` and ``bench/mover_multi_gpu.py`` print them).
    """

    local_gb_s: float = 2000.0
    intra_node_gb_s: float = 350.0
    inter_node_gb_s: float = 45.0
    round_latency_s: float = 30e-6

    def __post_init__(self) -> None:
        for name in ("local_gb_s", "intra_node_gb_s", "inter_node_gb_s"):
            checks.positive_number(f"Bandwidth.{name}", getattr(self, name), "GB/s", finite=True)
        checks.nonneg_number("Bandwidth.round_latency_s", self.round_latency_s, "seconds", finite=True)

    def link_bytes_per_s(self) -> np.ndarray:
        """float64 ``[3]``: bytes per second by transfer kind (``LOCAL``, ``INTRA_NODE``, ``INTER_NODE``)."""
        return np.array([self.local_gb_s, self.intra_node_gb_s, self.inter_node_gb_s]) * 1e9


@dataclass(frozen=True, eq=False)
class TransferSchedule:
    """What a mover executes to turn ``old`` into ``new``, layer by layer, and what it costs.

    Receives, int64 ``[M]``, one per (layer, destination gpu, expert) the gpu did not hold,
    sorted by (layer, round, src_gpu, dst_gpu, dst_slot): ``recv_layer``, ``recv_expert``,
    ``recv_src_gpu``, ``recv_src_slot`` (old placement), ``recv_dst_gpu``, ``recv_dst_slot``
    (the first slot of the gpu that needs the expert), ``recv_kind`` (``INTRA_NODE`` /
    ``INTER_NODE``) and ``recv_round`` (the layer's round it travels in).
    Local copies, int64 ``[K]``: ``local_layer``, ``local_src_slot`` (old content of a slot
    of the same gpu), ``local_dst_slot``. Restores, int64 ``[Q]``, one per (layer, gpu,
    expert) that no live gpu held (the engine loads it: host copy or checkpoint):
    ``restore_layer``, ``restore_expert``, ``restore_dst_gpu``, ``restore_dst_slot``. Fills,
    int64 ``[F]``: ``fill_layer``, ``fill_src_slot`` (a received or restored slot, new
    content), ``fill_dst_slot`` (another slot of the same gpu that needs the same expert).
    Every changed slot that holds an expert in ``new`` is the destination of exactly one
    receive, local copy, restore or fill; unchanged slots and slots that empty appear nowhere.

    Per layer: ``rounds`` int64 ``[L]``; ``predicted_comm_seconds`` and
    ``predicted_local_seconds`` float64 ``[L]`` (peer rounds; the copies within each gpu,
    slowest gpu). Per layer and gpu, float64 ``[L, G]``: ``sent_bytes``,
    ``received_bytes`` (receive buffers a mover needs), ``local_copy_bytes`` (bytes copied
    within the gpu: local copies, fills, one landing copy per receive and one extra copy per
    cycle of local copies), and int64 ``cycles``.
    ``max_rank_round_bytes``: the most bytes one gpu sends or receives in one round
    (max of the two directions, over gpus, rounds and layers).
    """

    topology: Topology
    bandwidth: Bandwidth
    expert_bytes: np.ndarray
    round_experts: int | None
    recv_layer: np.ndarray
    recv_expert: np.ndarray
    recv_src_gpu: np.ndarray
    recv_src_slot: np.ndarray
    recv_dst_gpu: np.ndarray
    recv_dst_slot: np.ndarray
    recv_kind: np.ndarray
    recv_round: np.ndarray
    local_layer: np.ndarray
    local_src_slot: np.ndarray
    local_dst_slot: np.ndarray
    restore_layer: np.ndarray
    restore_expert: np.ndarray
    restore_dst_gpu: np.ndarray
    restore_dst_slot: np.ndarray
    fill_layer: np.ndarray
    fill_src_slot: np.ndarray
    fill_dst_slot: np.ndarray
    rounds: np.ndarray
    cycles: np.ndarray
    sent_bytes: np.ndarray
    received_bytes: np.ndarray
    local_copy_bytes: np.ndarray
    max_rank_round_bytes: float
    predicted_comm_seconds: np.ndarray
    predicted_local_seconds: np.ndarray

    @property
    def bytes(self) -> float:
        """Bytes copied between gpus, summed over layers (same-gpu copies excluded)."""
        return float(self.sent_bytes.sum())

    @property
    def cross_node_bytes(self) -> float:
        return float(self.expert_bytes[self.recv_layer[self.recv_kind == INTER_NODE]].sum())

    @property
    def total_rounds(self) -> int:
        return int(self.rounds.sum())

    @property
    def predicted_seconds(self) -> float:
        """Predicted wall time of the whole move: every layer's rounds, then its local copies."""
        return float(self.predicted_comm_seconds.sum() + self.predicted_local_seconds.sum())

    def stats(self) -> dict[str, float | int]:
        """The figures of the wire's ``TransferStats``, by field name."""
        return {
            "bytes": int(round(self.bytes)),
            "cross_node_bytes": int(round(self.cross_node_bytes)),
            "rounds": self.total_rounds,
            "max_rank_round_bytes": int(round(self.max_rank_round_bytes)),
            "predicted_seconds": self.predicted_seconds,
        }


def transfer_schedule(
    old: Placement,
    new: Placement,
    topology: Topology,
    *,
    expert_bytes: float | np.ndarray = 1.0,
    bandwidth: Bandwidth | None = None,
    round_experts: int | None = None,
) -> TransferSchedule:
    """``old``, ``new``: placements ``[L, P]`` of ``topology`` → the mover's schedule.

    Sources come from ``transfer_plan`` (nearest holder, senders balanced). Slots of one gpu
    that need the same missing expert share one receive: it lands in the lowest of them and
    fills the others. Each layer's receives go in rounds; a round is a matching of gpus
    (each gpu exchanges with at most one peer, both directions at once), built greedily
    with the busiest gpus first and same-node partners before cross-node ones.
    ``round_experts`` caps the experts a pair sends each way in one round (``None``: all it
    has), which bounds the bytes in flight per round at the price of more rounds.
    """
    if round_experts is not None:
        checks.positive_int("round_experts", round_experts, allowed="a positive integer or None")
    bandwidth = Bandwidth() if bandwidth is None else bandwidth
    if not isinstance(bandwidth, Bandwidth):
        raise ValueError(f"bandwidth must be a Bandwidth, got {type(bandwidth).__name__}")
    tp = transfer_plan(old, new, topology, expert_bytes=expert_bytes)
    L, G, S = topology.num_layers, topology.num_gpus, topology.slots_per_gpu
    size = np.broadcast_to(np.asarray(expert_bytes, dtype=np.float64), (L,)).copy()
    size.setflags(write=False)

    # One receive (or restore) per (layer, dst gpu, expert): the lowest destination slot; the
    # rest are fills.
    remote = np.flatnonzero(tp.kind != LOCAL)
    order = remote[np.lexsort((tp.dst_slot[remote], tp.expert[remote], tp.dst_gpu[remote], tp.layer[remote]))]
    group = np.stack([tp.layer[order], tp.dst_gpu[order], tp.expert[order]])
    first = np.ones(order.size, dtype=bool)
    first[1:] = (group[:, 1:] != group[:, :-1]).any(axis=0)
    prim, dup = order[first], order[~first]
    primary_of_dup = order[np.flatnonzero(first)[np.cumsum(first) - 1]][~first]
    local = np.flatnonzero(tp.kind == LOCAL)
    restores = prim[tp.kind[prim] == RESTORE]
    prim = prim[tp.kind[prim] != RESTORE]

    rl, rs, rd = tp.layer[prim], tp.src_gpu[prim], tp.dst_gpu[prim]
    rank_in_pair = _rank_within(np.stack([rl, rs, rd]), tp.dst_slot[prim])
    cap = int(round_experts) if round_experts is not None else max(S, 1)
    counts = np.zeros((L, G, G), dtype=np.int64)
    np.add.at(counts, (rl, rs, rd), 1)
    pair_layer, pair_lo, pair_hi, pair_round, rounds = _match_rounds(counts, cap, topology.gpus_per_node)
    # A pair's k-th receive (in dst-slot order) goes in the (k // cap)-th round the pair meets.
    pair_key = (pair_layer * G + pair_lo) * G + pair_hi
    by_key = np.lexsort((pair_round, pair_key))
    key = (rl * G + np.minimum(rs, rd)) * G + np.maximum(rs, rd)
    start = np.searchsorted(pair_key[by_key], key)
    rround = pair_round[by_key][start + rank_in_pair // cap]

    sort = np.lexsort((tp.dst_slot[prim], rd, rs, rround, rl))
    prim, rround, rl, rs, rd = prim[sort], rround[sort], rl[sort], rs[sort], rd[sort]
    kind = tp.kind[prim]
    nbytes = size[rl]

    # Bytes each gpu sends and receives in each (layer, round), and the time of that round.
    R = max(int(rounds.max(initial=0)), 1)
    cell_s = (rl * R + rround) * G + rs
    cell_d = (rl * R + rround) * G + rd
    n_cells = L * R * G
    speed = bandwidth.link_bytes_per_s()[kind]
    sent_r = np.bincount(cell_s, nbytes, minlength=n_cells)
    recv_r = np.bincount(cell_d, nbytes, minlength=n_cells)
    busy = np.maximum(
        np.bincount(cell_s, nbytes / speed, minlength=n_cells), np.bincount(cell_d, nbytes / speed, minlength=n_cells)
    )
    comm = busy.reshape(L, R, G).max(axis=2).sum(axis=1) + rounds * bandwidth.round_latency_s
    max_round = float(np.maximum(sent_r, recv_r).max(initial=0.0))

    cycles = _local_cycles(tp, local, topology)
    copies = np.zeros((L, G), dtype=np.float64)
    np.add.at(copies, (tp.layer[local], tp.dst_gpu[local]), 1)
    np.add.at(copies, (tp.layer[remote], tp.dst_gpu[remote]), 1)  # one landing per receive, one per fill
    copies += cycles
    local_bytes = copies * size[:, None]

    return TransferSchedule(
        topology=topology,
        bandwidth=bandwidth,
        expert_bytes=size,
        round_experts=None if round_experts is None else int(round_experts),
        recv_layer=rl,
        recv_expert=tp.expert[prim],
        recv_src_gpu=rs,
        recv_src_slot=tp.src_slot[prim],
        recv_dst_gpu=rd,
        recv_dst_slot=tp.dst_slot[prim],
        recv_kind=kind,
        recv_round=rround,
        local_layer=tp.layer[local],
        local_src_slot=tp.src_slot[local],
        local_dst_slot=tp.dst_slot[local],
        restore_layer=tp.layer[restores],
        restore_expert=tp.expert[restores],
        restore_dst_gpu=tp.dst_gpu[restores],
        restore_dst_slot=tp.dst_slot[restores],
        fill_layer=tp.layer[dup],
        fill_src_slot=tp.dst_slot[primary_of_dup],
        fill_dst_slot=tp.dst_slot[dup],
        rounds=rounds,
        cycles=cycles,
        sent_bytes=np.bincount(rl * G + rs, nbytes, minlength=L * G).reshape(L, G),
        received_bytes=np.bincount(rl * G + rd, nbytes, minlength=L * G).reshape(L, G),
        local_copy_bytes=local_bytes,
        max_rank_round_bytes=max_round,
        predicted_comm_seconds=comm,
        predicted_local_seconds=local_bytes.max(axis=1, initial=0.0) / (bandwidth.local_gb_s * 1e9),
    )


def staged_slots(schedule: TransferSchedule) -> np.ndarray:
    """int64 ``[L, G]``: receive-buffer slots gpu ``g`` needs to stage layer ``l``: its
    receives, plus one spare slot where its local copies of the layer form a cycle."""
    return _staged_receives(schedule) + (schedule.cycles > 0)


def staged_chunks(
    schedule: TransferSchedule, slot_bytes: int, staging_bytes: int | None, chunk_layers: int | None = None
) -> tuple[range, ...]:
    """The layers ``0..L-1`` cut greedily into consecutive chunks whose staged receives (plus
    one spare slot where a cycle needs it) fit ``staging_bytes`` on every gpu, at most
    ``chunk_layers`` layers each; every rank computes the same chunks from the schedule.
    ``None``: no limit (one chunk of every layer when both are ``None``). ``ValueError``
    when one layer alone does not fit on some gpu (with the bytes it needs)."""
    L = schedule.topology.num_layers
    if chunk_layers is not None:
        chunk_layers = checks.positive_int("chunk_layers", chunk_layers, allowed="a positive integer or None")
    if staging_bytes is None:
        step = chunk_layers or max(L, 1)
        return tuple(range(a, min(a + step, L)) for a in range(0, L, step))
    staging_bytes = checks.nonneg_int("staging_bytes", staging_bytes, none="")
    G = schedule.topology.num_gpus
    recv = _staged_receives(schedule)
    spare = schedule.cycles > 0
    chunks: list[range] = []
    start = 0
    held = np.zeros(G, dtype=np.int64)
    cyc = np.zeros(G, dtype=bool)
    for layer in range(L):
        alone = recv[layer] + spare[layer]
        if int(alone.max()) * slot_bytes > staging_bytes:
            g = int(alone.argmax())
            raise ValueError(
                f"staging_bytes={staging_bytes} is below what layer {layer} alone needs staged on gpu {g}: "
                f"{int(alone[g]) * slot_bytes} bytes ({int(alone[g])} slots of {slot_bytes} bytes); the smallest budget "
                f"for this transition is {int((recv + spare).max()) * slot_bytes} bytes"
            )
        full = chunk_layers is not None and layer - start == chunk_layers
        if full or int((held + recv[layer] + (cyc | spare[layer])).max()) * slot_bytes > staging_bytes:
            chunks.append(range(start, layer))
            start, held, cyc = layer, np.zeros(G, dtype=np.int64), np.zeros(G, dtype=bool)
        held = held + recv[layer]
        cyc = cyc | spare[layer]
    chunks.append(range(start, L))
    return tuple(chunks)


def _staged_receives(schedule: TransferSchedule) -> np.ndarray:
    """int64 ``[L, G]``: the incoming copies gpu ``g`` receives for layer ``l``."""
    L, G = schedule.topology.num_layers, schedule.topology.num_gpus
    keys = schedule.recv_layer.astype(np.int64) * G + schedule.recv_dst_gpu
    return np.bincount(keys, minlength=L * G).reshape(L, G)


def _rank_within(keys: np.ndarray, order_by: np.ndarray) -> np.ndarray:
    """``keys`` ``[k, n]``, ``order_by`` ``[n]`` → int64 ``[n]``: each item's index among items
    with the same key columns, in ``order_by`` order."""
    n = order_by.size
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    order = np.lexsort((order_by, *keys[::-1]))
    k = keys[:, order]
    new_group = np.ones(n, dtype=bool)
    new_group[1:] = (k[:, 1:] != k[:, :-1]).any(axis=0)
    group_start = np.flatnonzero(new_group)[np.cumsum(new_group) - 1]
    out = np.empty(n, dtype=np.int64)
    out[order] = np.arange(n) - group_start
    return out


def _match_rounds(counts: np.ndarray, cap: int, gpus_per_node: int) -> tuple[np.ndarray, ...]:
    """``counts`` int64 ``[L, G, G]`` (experts gpu i sends gpu j) → the rounds of every layer.

    Returns int64 ``[Q]`` arrays ``pair_layer``, ``pair_lo``, ``pair_hi``, ``pair_round`` (one
    row per pair meeting in a round; it moves up to ``cap`` experts each way) and ``rounds``
    ``[L]``. Vectorised across layers: each round visits gpus busiest first, and a free gpu
    takes its free partner with the most left to exchange, same-node partners first.
    """
    L, G, _ = counts.shape
    rem = counts.copy()
    node = np.arange(G) // gpus_per_node
    same_node = node[:, None] == node[None, :]
    layers = np.arange(L)
    rounds = np.zeros(L, dtype=np.int64)
    out: list[tuple[np.ndarray, ...]] = []
    while True:
        # Units a pair still needs: the larger direction, in rounds of `cap`.
        need = np.maximum(rem, rem.transpose(0, 2, 1))
        active = need.any(axis=(1, 2))
        if not active.any():
            break
        partner = np.full((L, G), -1, dtype=np.int64)
        busiest = np.argsort(-need.sum(axis=2), axis=1, kind="stable")
        for near in (True, False):
            allowed = same_node if near else ~same_node
            for k in range(G):
                i = busiest[:, k]
                w = np.where(allowed[i] & (partner < 0) & (need[layers, i] > 0), need[layers, i], 0)
                j = w.argmax(axis=1)
                take = (partner[layers, i] < 0) & (w[layers, j] > 0)
                partner[layers[take], i[take]] = j[take]
                partner[layers[take], j[take]] = i[take]
        lay, lo = np.nonzero(partner > np.arange(G)[None])
        hi = partner[lay, lo]
        out.append((lay, lo, hi, rounds[lay]))
        rem[lay, lo, hi] = np.maximum(rem[lay, lo, hi] - cap, 0)
        rem[lay, hi, lo] = np.maximum(rem[lay, hi, lo] - cap, 0)
        rounds[active] += 1
    if not out:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty, empty, rounds
    lay, lo, hi, rnd = (np.concatenate(a).astype(np.int64) for a in zip(*out))
    return lay, lo, hi, rnd, rounds


def _local_cycles(tp: TransferPlan, local: np.ndarray, topology: Topology) -> np.ndarray:
    """int64 ``[L, G]``: cycles among each gpu's local copies (slot a takes b's old expert, b
    takes a's, ...); an in-place mover breaks each through one spare slot, one extra copy."""
    L, P, G = topology.num_layers, topology.num_slots, topology.num_gpus
    # f[l, d] = the slot d copies from when that slot is itself overwritten by a local copy;
    # P (a sink pointing to itself) otherwise. Cycles of f are the copy cycles.
    f = np.full((L, P + 1), P, dtype=np.int64)
    f[tp.layer[local], tp.dst_slot[local]] = tp.src_slot[local]
    is_dst = np.zeros((L, P + 1), dtype=bool)
    is_dst[tp.layer[local], tp.dst_slot[local]] = True
    f = np.where(np.take_along_axis(is_dst, f, axis=1), f, P)
    # After >= P steps every path sits on its cycle; f^(2^k) with 2^k >= P maps all nodes onto
    # cycle nodes, and a cycle is counted once, at its lowest slot (min over a full turn).
    low = np.where(f < P, np.arange(P + 1)[None], P)
    jump = f.copy()
    for _ in range(int(np.ceil(np.log2(P + 1))) + 1):
        low = np.minimum(low, np.take_along_axis(low, jump, axis=1))
        jump = np.take_along_axis(jump, jump, axis=1)
    on_cycle = np.zeros((L, P + 1), dtype=bool)
    np.put_along_axis(on_cycle, jump, True, axis=1)
    on_cycle[:, P] = False
    heads = on_cycle & (low == np.arange(P + 1)[None])
    out = np.zeros((L, G), dtype=np.int64)
    lay, slot = np.nonzero(heads[:, :P])
    np.add.at(out, (lay, slot // topology.slots_per_gpu), 1)
    return out
