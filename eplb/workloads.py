"""The standard scales and seeded synthetic workloads of ``docs/scales.md``.

Every generator returns float64 loads ``[L, E]`` (or ``[T, L, E]`` for sequences) and is
reproducible from its ``seed``.
"""

from __future__ import annotations

import numpy as np

from .topology import Topology

__all__ = ["SCALES", "WORKLOADS", "zipf", "lognormal", "group_limited", "drift", "shift", "make_loads"]

SCALES: dict[str, Topology] = {
    "v3-prefill": Topology(58, 256, 288, 32, 4, 8),
    "v3-decode-144": Topology(58, 256, 288, 144, 18, 8),
    "v3-decode-320": Topology(58, 256, 320, 320, 40, 8),
    "v3-512": Topology(58, 256, 512, 256, 32, 8),
    "v3-64": Topology(58, 256, 320, 64, 8, 8),
    "qwen3-64": Topology(94, 128, 192, 64, 8, 1),
    "kimi-64": Topology(61, 384, 448, 64, 8, 1),
    "v4flash-ep64": Topology(40, 384, 448, 64, 1, 1),
    "small": Topology(1, 16, 20, 4, 2, 4),
}
"""The standard scales (docs/scales.md): name -> ``Topology``."""

# Tokens routed per layer in one window; scales popularity into counts.
_TOKENS = 1 << 20


def zipf(num_layers: int, num_experts: int, s: float, seed: int = 0) -> np.ndarray:
    """``[L, E]``: per layer, popularity ∝ 1 / rank**s over a random permutation of experts."""
    rng = np.random.default_rng(seed)
    pop = 1.0 / np.arange(1, num_experts + 1, dtype=np.float64) ** s
    pop *= _TOKENS / pop.sum()
    perm = np.argsort(rng.random((num_layers, num_experts)), axis=1)
    return pop[perm]


def lognormal(num_layers: int, num_experts: int, sigma: float, seed: int = 0) -> np.ndarray:
    """``[L, E]``: i.i.d. lognormal(0, sigma) per (layer, expert), scaled to token counts."""
    rng = np.random.default_rng(seed)
    x = rng.lognormal(0.0, sigma, (num_layers, num_experts))
    return x * (_TOKENS / x.sum(axis=1, keepdims=True))


def group_limited(
    num_layers: int,
    num_experts: int = 256,
    num_groups: int = 8,
    *,
    tokens: int = 4096,
    topk_group: int = 4,
    topk: int = 8,
    bias_scale: float = 0.15,
    seed: int = 0,
) -> np.ndarray:
    """``[L, E]`` counts from DeepSeek-V3-style group-limited routing simulated token by token.

    Per expert bias ~ N(0, 1); token score = U(0, 1) + bias_scale * bias; a group scores the
    sum of its top-2 experts; a token keeps the top ``topk_group`` groups and picks its top
    ``topk`` experts among them.
    """
    if num_experts % num_groups:
        raise ValueError(f"num_experts ({num_experts}) must be a multiple of num_groups ({num_groups})")
    rng = np.random.default_rng(seed)
    size = num_experts // num_groups
    out = np.zeros((num_layers, num_experts))
    for layer in range(num_layers):  # one layer at a time keeps memory at tokens x experts
        bias = rng.standard_normal(num_experts)
        score = rng.random((tokens, num_experts)) + bias_scale * bias
        grouped = score.reshape(tokens, num_groups, size)
        top2 = np.sort(grouped, axis=2)[:, :, -2:].sum(axis=2)
        keep = np.argsort(-top2, axis=1)[:, :topk_group]
        mask = np.zeros((tokens, num_groups), dtype=bool)
        np.put_along_axis(mask, keep, True, axis=1)
        masked = np.where(np.repeat(mask, size, axis=1), score, -np.inf)
        chosen = np.argpartition(-masked, topk - 1, axis=1)[:, :topk]
        out[layer] = np.bincount(chosen.ravel(), minlength=num_experts)
    return out


def drift(base: np.ndarray, sigma: float, steps: int, seed: int = 0) -> np.ndarray:
    """``[steps, L, E]``: each snapshot is the last times lognormal(0, sigma) noise per expert."""
    rng = np.random.default_rng(seed)
    out = np.empty((steps, *base.shape))
    cur = np.asarray(base, dtype=np.float64)
    for t in range(steps):
        cur = cur * rng.lognormal(0.0, sigma, base.shape)
        out[t] = cur
    return out


def shift(base: np.ndarray, steps: int, sigma: float = 0.05, seed: int = 0) -> np.ndarray:
    """``[steps, L, E]``: ``drift`` whose popularity ranking is reshuffled halfway (a domain switch)."""
    rng = np.random.default_rng(seed + 1)
    seq = drift(base, sigma, steps, seed)
    perm = np.argsort(rng.random(base.shape), axis=-1)
    half = steps // 2
    seq[half:] = np.take_along_axis(seq[half:], np.broadcast_to(perm, seq[half:].shape), axis=-1)
    return seq


WORKLOADS: tuple[str, ...] = (
    "zipf-0.5",
    "zipf-1.0",
    "zipf-1.5",
    "lognormal-0.5",
    "lognormal-1.0",
    "lognormal-1.5",
    "group-limited",
)
"""The seeded workloads ``make_loads`` knows by name."""


def make_loads(workload: str, topology: Topology, seed: int = 0) -> np.ndarray:
    """``[L, E]`` loads of a named workload (``WORKLOADS``) for ``topology``."""
    if not isinstance(workload, str):
        swapped = " (the arguments are (workload, topology): swapped?)" if isinstance(topology, str) else ""
        raise ValueError(f"workload must be a name such as {WORKLOADS[0]!r}, got {type(workload).__name__}{swapped}")
    if not isinstance(topology, Topology):
        raise ValueError(f"topology must be a Topology, got {type(topology).__name__}")
    L, E = topology.num_layers, topology.num_experts
    kind, _, arg = workload.partition("-")
    if kind == "zipf" and arg:
        return zipf(L, E, float(arg), seed)
    if kind == "lognormal" and arg:
        return lognormal(L, E, float(arg), seed)
    if workload == "group-limited":
        groups = topology.num_groups if topology.num_groups > 1 else 8
        if E % groups:
            groups = 1
        return group_limited(L, E, groups, seed=seed, topk_group=min(4, groups))
    raise ValueError(f"unknown workload {workload!r}; known: {', '.join(WORKLOADS)}")
