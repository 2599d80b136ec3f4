"""Without redundant slots, spread the gpus under a pinned maximum: a secondary objective.

With as many slots as experts (vLLM's and SGLang's default), a hot expert's gpu often carries
more than any packing can move off it: the layer's maximum is pinned, and a search that lowers
only the maximum leaves the other gpus wherever its swaps left them, often bunched just under
that maximum. A step waits for the slowest gpu *of that step*, and routing noise lifts some of
the bunched gpus past the pinned one; DeepSeek's eplb.py, whose greedy deal leaves the others
near their mean, was faster in MoE time by 3-11 % with real grouped kernels (issue 34).

``settle`` swaps slots between two gpus of a node when that narrows the pair (the sum of squared
gpu loads falls, no load rises above the pair's heavier one), so the maximum never rises and the
rest spread to their mean. Deterministic; the best swap of the 16 heaviest gpus first.

Settling was not enough: on loads shaped like real routing (dead and hot experts,
``moe_time_bench --workload "mixed 16k"``), real grouped kernels on an H100 still ran the
settled default 0.2-1.8 % slower than eplb.py at every point, in layers where eplb.py's busiest
gpu carries no more tokens than ours. Tokens cannot tell those two apart, and eplb.py's deal (the
heaviest experts one to a gpu, each pack then filled lightest-first) is the arrangement whose
time is the reference. ``prefer_deal`` takes it there, and where eplb.py's busiest gpu is
within ``DEAL_SLACK`` (1 %) of ours: in such layers ours was lighter in tokens and still slower
in time (Qwen3-30B EP16, +0.3 to +0.9 % at 256 and 1,024 tokens per gpu on ``lognormal-1.0``
and ``hot 16k``; eplb.py's deal matched eplb.py there, of course, at up to 1 % more tokens on
the busiest gpu). Layers where ours is lighter by more keep ours.
"""

from __future__ import annotations

import numpy as np

from ..policies.deepseek import deepseek_rebalance

__all__ = ["settle", "prefer_deal", "DEAL_SLACK"]

# How much heavier (relative) eplb.py's busiest gpu may be than ours for its deal to be taken.
DEAL_SLACK = 0.01

# Heaviest gpus whose swaps each round scores (against every gpu of their node).
_HEAVY = 16


def settle(loads: np.ndarray, phy2log: np.ndarray, num_gpus: int, gpus_per_node: int) -> tuple[np.ndarray, int]:
    """``loads`` ``[L, E]``, ``phy2log`` ``[L, P]`` with one replica per expert → (``[L, P]``,
    swaps made). Each swap lowers the layer's sum of squared gpu loads; the heaviest gpu never
    gets heavier."""
    out = np.array(phy2log, dtype=np.int64)
    L, P = out.shape
    S = P // num_gpus
    total = 0
    node = np.arange(num_gpus) // gpus_per_node
    for layer in range(L):
        phy = out[layer].reshape(num_gpus, S)
        w = loads[layer][phy].astype(np.float64)  # [G, S]
        scale = max(float(w.sum()) / num_gpus, 1e-300)
        for _ in range(4 * num_gpus):
            load = w.sum(axis=1)
            heavy = np.argsort(-load, kind="stable")[: min(_HEAVY, num_gpus)]
            gap = load[heavy][:, None] - load[None, :]  # [H, G]
            d = w[heavy][:, None, :, None] - w[None, :, None, :]  # [H, G, S, S]
            gain = d * (gap[:, :, None, None] - d)
            ok = (d > 0) & (d < gap[:, :, None, None]) & (node[heavy][:, None] == node[None, :])[:, :, None, None]
            gain = np.where(ok, gain, 0.0)
            best = int(np.argmax(gain))
            if gain.flat[best] <= 1e-9 * scale * scale:
                break
            h, b, i, j = np.unravel_index(best, gain.shape)
            a = heavy[h]
            phy[a, i], phy[b, j] = phy[b, j], phy[a, i]
            w[a, i], w[b, j] = w[b, j], w[a, i]
            total += 1
        out[layer] = phy.ravel()
    return out, total


def prefer_deal(
    loads: np.ndarray,
    phy2log: np.ndarray,
    num_gpus: int,
    num_groups: int,
    num_nodes: int,
    slack: float = DEAL_SLACK,
) -> tuple[np.ndarray, np.ndarray]:
    """``loads`` ``[L, E]``, ``phy2log`` ``[L, P]`` with one replica per expert (``P == E``) →
    (``[L, P]``, ``[L]`` bool: the layers taken): eplb.py's placement of a layer (``deepseek_rebalance`` with these
    groups and nodes, hierarchical as eplb.py decides) wherever its busiest gpu carries at most
    ``1 + slack`` times the tokens of ``phy2log``'s; a layer's busiest gpu gets at most that much
    heavier, and never heavier than eplb.py's."""
    out = np.array(phy2log, dtype=np.int64)
    L, P = out.shape
    deal, *_ = deepseek_rebalance(loads, P, num_groups, num_nodes, num_gpus, exact_ranks=False)

    def busiest(p: np.ndarray) -> np.ndarray:
        return np.take_along_axis(loads, p, axis=1).reshape(L, num_gpus, -1).sum(axis=2).max(axis=1)

    ours = busiest(out)
    # Equal up to float64 rounding of the sums (eplb.py packs in float32; the comparison is ours).
    take = busiest(deal) <= ours * (1.0 + slack) + 1e-12 * np.maximum(ours, 1.0)
    out[take] = deal[take]
    return out, take
