"""Expert weights that name their expert, for the weight-mover benchmarks (``mover_bench``,
``mover_multi_gpu``): DeepSeek-V3-sized FP8 tensors per slot, filled with a code of (layer,
expert) and checked after a move, and the placements of the transitions they time."""

from __future__ import annotations

import time

import torch

import eplb
from eplb.workloads import drift, make_loads

FP8 = torch.float8_e4m3fn
HIDDEN, INTER, BLOCK = 7168, 2048, 128
# name -> per-slot shape and dtype: DeepSeek-V3's FP8 experts with 128 x 128 block scales.
TENSORS = {
    "w13": ((2 * INTER, HIDDEN), FP8),
    "w2": ((HIDDEN, INTER), FP8),
    "w13_scale": ((2 * INTER // BLOCK, HIDDEN // BLOCK), torch.float32),
    "w2_scale": ((HIDDEN // BLOCK, INTER // BLOCK), torch.float32),
}


def _code(layer: int, expert: int) -> tuple[int, float]:
    """The byte filling a weight slot and the value filling a scale slot of (layer, expert)."""
    return (layer * 31 + expert * 7) % 251 + 1, float(layer * 1000 + expert)


_HEADERS: dict[tuple[torch.device, int, int], torch.Tensor] = {}


def _header(device: torch.device, layer: int, expert: int) -> torch.Tensor:
    """uint8 ``[16]`` on ``device``: (layer, expert) as two int64, made once (no copy per fill)."""
    key = (device, layer, expert)
    if key not in _HEADERS:
        _HEADERS[key] = torch.tensor([layer, expert], dtype=torch.int64).view(torch.uint8).to(device)
    return _HEADERS[key]


def fill_slot(tensors: dict[str, torch.Tensor], slot: int, layer: int, expert: int) -> None:
    byte, value = _code(layer, expert)
    for t in tensors.values():
        if t.dtype == FP8:
            raw = t[slot].view(torch.uint8).reshape(-1)
            raw.fill_(byte)
            # a header in the first 16 bytes names the expert exactly (the fill byte repeats)
            raw[:16].copy_(_header(t.device, layer, expert))
        else:
            t[slot].fill_(value)


def check(layers: list[dict[str, torch.Tensor]], placement: eplb.Placement, rank: int) -> int:
    """Slots whose content is not their expert's (header, a sample of bytes, scales)."""
    S = placement.topology.slots_per_gpu
    bad = 0
    for layer, tensors in enumerate(layers):
        for s in range(S):
            expert = int(placement.phy2log[layer, rank * S + s])
            byte, value = _code(layer, expert)
            for t in tensors.values():
                raw = t[s].view(torch.uint8).reshape(-1)
                if t.dtype == FP8:
                    head = raw[:16].view(torch.int64).tolist()
                    tail = raw[16:][-4096:]
                    ok = head == [layer, expert] and bool((tail == byte).all())
                else:
                    ok = bool((t[s] == value).all())
                bad += not ok
    return bad


def make_layers(
    old: eplb.Placement, rank: int, device: torch.device, kinds: dict | None = None
) -> list[dict[str, torch.Tensor]]:
    """This rank's tensors per layer (``kinds``: name -> (slot shape, dtype), default ``TENSORS``),
    every slot filled with its expert's code."""
    topo = old.topology
    S = topo.slots_per_gpu
    layers = []
    for layer in range(topo.num_layers):
        tensors = {
            name: torch.empty((S, *shape), dtype=dt, device=device) for name, (shape, dt) in (kinds or TENSORS).items()
        }
        for s in range(S):
            fill_slot(tensors, s, layer, int(old.phy2log[layer, rank * S + s]))
        layers.append(tensors)
    return layers


def reset(layers: list[dict[str, torch.Tensor]], old: eplb.Placement, rank: int) -> None:
    S = old.topology.slots_per_gpu
    for layer, tensors in enumerate(layers):
        for s in range(S):
            fill_slot(tensors, s, layer, int(old.phy2log[layer, rank * S + s]))


def plans(topo: eplb.Topology, seed: int) -> tuple[eplb.Placement, dict[str, tuple[eplb.Placement, float]]]:
    """The old placement and each transition's new placement with its planning seconds."""
    base = make_loads("lognormal-1.0", topo, seed)
    nxt = drift(base, 0.2, 1, seed + 1)[0]
    old = eplb.rebalance(base, topo, "auto").placement
    t = time.perf_counter()
    full = eplb.rebalance(nxt, topo, "deepseek").placement
    t_full = time.perf_counter() - t
    t = time.perf_counter()
    mig = eplb.rebalance(nxt, topo, "auto", previous=old).placement
    t_mig = time.perf_counter() - t
    return old, {"full re-plan (eplb.py from scratch)": (full, t_full), "migration-aware re-plan": (mig, t_mig)}
