"""Routing-count loads shaped like real traces (``shapes_bench``'s shapes, also rows of
``default_bench``): integer counts of a few thousand tokens routed top-8, with ties, zeros,
dead experts and a few hot experts."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

TOPK = 8
# Tokens per chunk of the Gumbel top-k draw: keeps the [tokens, E] keys near 16 MB.
_CHUNK = 1 << 14


@dataclass(frozen=True)
class Shape:
    """How one shape's layers are drawn: ``tokens`` per layer, the popularity law per layer
    (``kinds``, cycled over layers), the share of dead experts."""

    tokens: int
    kinds: tuple[str, ...]
    dead: float = 0.0


def routing_counts(pop: np.ndarray, hot_rate: np.ndarray, tokens: int, rng: np.random.Generator) -> np.ndarray:
    """``pop``, ``hot_rate`` ``[E]`` → int64 counts ``[E]`` of ``tokens`` tokens routed top-8:
    expert ``e`` with ``hot_rate[e] > 0`` is picked by a token with that probability, the other
    picks are drawn without replacement with probability ∝ ``pop`` (0: never)."""
    E = pop.size
    # Gumbel top-k as the k smallest of exponential / popularity (no logarithms: faster).
    inv = (1.0 / np.maximum(pop, 1e-30)).astype(np.float32)
    dead = pop <= 0
    hot = np.flatnonzero(hot_rate > 0)
    out = np.zeros(E, dtype=np.int64)
    for a in range(0, tokens, _CHUNK):
        n = min(_CHUNK, tokens - a)
        keys = rng.standard_exponential((n, E), dtype=np.float32) * inv
        keys[:, dead] = np.inf
        if hot.size:
            keys[:, hot] = np.where(rng.random((n, hot.size)) < hot_rate[hot], -1.0, np.inf)
        pick = np.argpartition(keys, TOPK - 1, axis=1)[:, :TOPK]
        ok = np.take_along_axis(keys, pick, axis=1) < np.inf  # too few live experts: fewer picks
        out += np.bincount(pick[ok], minlength=E)
    return out


def _layer(kind: str, E: int, dead: float, tokens: int, rng: np.random.Generator) -> np.ndarray:
    """One layer's counts ``[E]`` of popularity law ``kind`` (see ``SHAPES``)."""
    perm = rng.permutation(E)
    hot_rate = np.zeros(E)
    if kind == "flat":  # near uniform
        pop = rng.lognormal(0.0, 0.3, E)
    elif kind.startswith("zipf"):
        pop = (1.0 / np.arange(1, E + 1) ** float(kind[4:]))[perm]
    elif kind.startswith("logn"):
        pop = rng.lognormal(0.0, float(kind[4:]), E)
    elif kind == "hot":  # 1-8 hot experts taking 3-12 % each over a lognormal tail
        pop = rng.lognormal(0.0, 1.0, E)
        k = int(rng.integers(1, 9))
        share = rng.uniform(0.03, 0.12, k)
        share *= min(1.0, 0.6 / share.sum())  # the hot ones leave the tail 40 % at least
        hot_rate[perm[:k]] = share * TOPK
    elif kind == "big":  # one expert taking 10-12 % (picked by 80-96 % of tokens)
        pop = rng.lognormal(0.0, 1.0, E)
        hot_rate[perm[0]] = rng.uniform(0.10, 0.12) * TOPK
    else:
        raise ValueError(f"unknown layer kind {kind!r}")
    if dead:
        n_dead = int(round(E * dead))
        pop[perm[E - n_dead :]] = 0.0  # never the hot ones (perm[:8])
    return routing_counts(pop, np.minimum(hot_rate, 1.0), tokens, rng)


SHAPES: dict[str, Shape] = {
    "zipf1.0 2k": Shape(2048, ("zipf1.0",)),
    "zipf1.0 16k": Shape(16384, ("zipf1.0",)),
    "logn1.5 256k": Shape(262144, ("logn1.5",)),
    "dead15 logn1.0 16k": Shape(16384, ("logn1.0",), dead=0.15),
    "mixed 2k": Shape(2048, ("flat", "hot", "zipf1.2", "logn1.0", "hot", "big", "flat", "hot")),
    "mixed 16k": Shape(16384, ("flat", "hot", "zipf1.2", "logn1.0", "hot", "big", "flat", "hot")),
    "mixed dead20 256k": Shape(262144, ("hot", "logn1.5", "big", "hot", "flat", "zipf1.0"), dead=0.2),
    "hot 16k": Shape(16384, ("hot",)),
    "big 16k": Shape(16384, ("big",)),
}


def make_shape(shape: Shape, num_layers: int, num_experts: int, seed: int) -> np.ndarray:
    """int64 counts ``[L, E]`` of ``shape``, seeded."""
    rng = np.random.default_rng(seed)
    kinds = [shape.kinds[i % len(shape.kinds)] for i in range(num_layers)]
    return np.stack([_layer(k, num_experts, shape.dead, shape.tokens, rng) for k in kinds])
