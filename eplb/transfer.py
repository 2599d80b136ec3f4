"""Which weight copies turn one placement into another, and who sends them.

``transfer_plan(old, new, topology, expert_bytes=...)`` lists, for every slot whose expert
changes, the slot of the OLD placement to copy the expert's weights from: a slot on the same
gpu if one held the expert (a device-local copy), else one on the same node, else any gpu.
Among equally near sources it picks the gpu that has sent the least so far, so the senders
share the work. Sources refer to the old placement: a mover reads every source before it
overwrites any slot (or stages through a buffer), since a source slot may itself change.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .placement import Placement
from .topology import Topology

__all__ = ["TransferPlan", "transfer_plan", "LOCAL", "INTRA_NODE", "INTER_NODE"]

LOCAL, INTRA_NODE, INTER_NODE = 0, 1, 2
KIND_NAMES = ("local", "intra-node", "inter-node")


@dataclass(frozen=True, eq=False)
class TransferPlan:
    """``T`` copies, each an expert's weights from ``src_slot`` (old) to ``dst_slot`` (new).

    Per-transfer int64 ``[T]`` arrays, sorted by (layer, dst_slot): ``layer``, ``dst_slot``,
    ``src_slot``, ``expert``, ``kind`` (``LOCAL`` 0, ``INTRA_NODE`` 1, ``INTER_NODE`` 2), and
    ``src_gpu``, ``dst_gpu``. Per-gpu float64 ``[G]`` bytes over all layers: ``sent_bytes`` and
    ``received_bytes`` count copies between gpus (local copies cross no link and are in
    ``local_bytes``), ``cross_node_sent_bytes`` / ``cross_node_received_bytes`` the inter-node
    part of them.
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

    @property
    def num_transfers(self) -> int:
        return int(self.layer.size)

    @property
    def cross_node_bytes(self) -> float:
        """Total bytes that cross a node boundary."""
        return float(self.cross_node_sent_bytes.sum())

    def kind_counts(self) -> dict[str, int]:
        """Transfers of each kind, by name."""
        counts = np.bincount(self.kind, minlength=3)
        return {name: int(n) for name, n in zip(KIND_NAMES, counts)}


def transfer_plan(old: Placement, new: Placement, topology: Topology, *, expert_bytes: float = 1.0) -> TransferPlan:
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
    # held[l, e, g]: gpu g held expert e in the old placement; first_slot: its lowest such slot.
    old_gpu_exp = old.phy2log.reshape(L, G, S)
    held = np.zeros((L, E, G), dtype=bool)
    held[np.arange(L)[:, None, None], old_gpu_exp, gpu[None, :, None]] = True
    first_slot = np.full((L, E, G), P, dtype=np.int64)
    slot_ids = np.arange(P).reshape(G, S)
    np.minimum.at(first_slot, (np.arange(L)[:, None, None], old_gpu_exp, gpu[None, :, None]), slot_ids[None])

    changed = old.phy2log != new.phy2log  # [L, P]
    lay, dst = np.nonzero(changed)
    exp = new.phy2log[lay, dst].astype(np.int64)
    dgpu = dst // S
    cand = held[lay, exp]  # [T, G]
    # kind of each candidate gpu relative to the destination gpu; the nearest kind wins.
    cand_kind = np.where(gpu[None] == dgpu[:, None], LOCAL, np.where(gpu[None] // gpn == (dgpu // gpn)[:, None], INTRA_NODE, INTER_NODE))
    cand_kind = np.where(cand, cand_kind, 3)
    kind = cand_kind.min(axis=1)
    allowed = cand_kind == kind[:, None]  # [T, G]
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
        # Local copies load no link, so they do not count as sent.
        key = sent_layer[lay[idx]] * (G * (P + 1)) * L + sent_total[None] * G + gpu[None]
        pick = np.where(allowed[idx], key, np.iinfo(np.int64).max).argmin(axis=1)
        src_gpu[idx] = pick
        remote = kind[idx] != LOCAL
        sent_layer[lay[idx][remote], pick[remote]] += 1
        sent_total += np.bincount(pick[remote], minlength=G)

    src = first_slot[lay, exp, src_gpu]
    nbytes = size[lay]
    remote = kind != LOCAL
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
    )
