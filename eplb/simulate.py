"""Per-step realized imbalance: routing sampled token by token on one layer's placement.

A placement is judged by its average gpu load, but a decode step waits for the busiest gpu
of *that* step. With ``b`` tokens per gpu and ``G`` gpus, a step routes ``N = G * b`` tokens;
each token picks ``topk`` distinct experts and each visit goes to one of the expert's
replicas chosen uniformly. Which gpu a token starts on does not matter (all-to-all
dispatch), so a step is ``N`` independent tokens.

Sampling keeps the popularity exact: expert ``e`` is in a token's top-k with probability
``pi[e] = topk * p[e]`` (capped at 1, see :func:`inclusion_probabilities`), so the expected
gpu load equals :func:`eplb.gpu_loads` of the popularity and the per-step spread sits on top
of the placement's average imbalance. Uniform popularity (with topk**2 <= E) draws a uniform
k-subset by rejection (O(N k)); any other popularity uses systematic sampling in a random order per
token (Madow), whose inclusion probabilities are exactly ``pi``.

A down gpu (``Placement.down_gpus``) takes no tokens: ``G`` above counts the live gpus, the
routing never reaches an empty slot, and a down gpu's expected load is NaN (absent).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .placement import Placement

__all__ = [
    "StepStats",
    "inclusion_probabilities",
    "systematic_subsets",
    "expected_gpu_load",
    "sample_gpu_loads",
    "simulate_steps",
]

# Tokens routed per vectorised chunk: bounds memory at chunk x num_experts keys.
_CHUNK = 8192


@dataclass(frozen=True)
class StepStats:
    """Per-step figures of one simulated layer.

    - ``ratio``: ``[S]`` max / mean gpu load of each step;
    - ``mean_load``: tokens-visits per gpu per step, exactly ``tokens_per_gpu * topk``;
    - ``expected_ratio``: max / mean of the *expected* gpu load (the placement's average
      imbalance under this popularity).
    """

    ratio: np.ndarray
    mean_load: float
    expected_ratio: float
    tokens_per_gpu: int
    topk: int

    @property
    def mean(self) -> float:
        return float(self.ratio.mean())

    @property
    def p99(self) -> float:
        return float(np.percentile(self.ratio, 99))

    def summary(self) -> dict[str, Any]:
        return {
            "tokens_per_gpu": self.tokens_per_gpu,
            "topk": self.topk,
            "steps": int(self.ratio.size),
            "mean_load": self.mean_load,
            "expected_ratio": self.expected_ratio,
            "ratio_mean": self.mean,
            "ratio_p99": self.p99,
        }


def inclusion_probabilities(popularity: np.ndarray, topk: int) -> np.ndarray:
    """``popularity``: ``[E]`` >= 0 → ``[E]`` probability that a token picks each expert.

    ``pi = topk * p`` with ``p`` the normalised popularity; an expert that would exceed 1 is
    capped at 1 (every token picks it) and the excess is spread over the rest in proportion,
    so ``pi.sum() == topk`` and ``0 <= pi <= 1``.
    """
    pop = np.asarray(popularity, dtype=np.float64)
    if pop.ndim != 1 or not np.isfinite(pop).all() or (pop < 0).any() or pop.sum() <= 0:
        raise ValueError("popularity must be a [num_experts] array of finite values >= 0 with a positive sum")
    if not 1 <= topk <= pop.size or (pop > 0).sum() < topk:
        raise ValueError(
            f"topk ({topk}) must be between 1 and the number of experts with popularity > 0 ({int((pop > 0).sum())})"
        )
    pi = np.zeros_like(pop)
    capped = np.zeros(pop.size, dtype=bool)
    # At most topk experts can be capped, so this loop runs at most topk + 1 times.
    while True:
        free = ~capped
        pi[capped] = 1.0
        pi[free] = (topk - capped.sum()) * pop[free] / pop[free].sum()
        over = pi > 1.0 + 1e-12
        if not over.any():
            return np.minimum(pi, 1.0)
        capped |= over


def expected_gpu_load(
    popularity: np.ndarray, placement: Placement, tokens_per_gpu: int, topk: int, layer: int = 0
) -> np.ndarray:
    """``popularity``: ``[E]`` → ``[G]`` expected visits per gpu per step (replicas split
    evenly; NaN for a down gpu)."""
    topo = placement.topology
    pi = inclusion_probabilities(popularity, topk)
    tokens = int(placement.live.sum()) * tokens_per_gpu
    phy = placement.phy2log[layer]
    held = phy >= 0
    per_slot = np.zeros(topo.num_slots)
    per_slot[held] = tokens * pi[phy[held]] / placement.logcnt[layer][phy[held]]
    out = per_slot.reshape(topo.num_gpus, topo.slots_per_gpu).sum(axis=1)
    out[~placement.live] = np.nan
    return out


def _uniform_subsets(rng: np.random.Generator, n: int, num_experts: int, topk: int) -> np.ndarray:
    """``[n, topk]`` uniform random k-subsets: draw with replacement, redraw rows with repeats."""
    picks = rng.integers(0, num_experts, (n, topk))
    bad = np.arange(n)
    while bad.size:  # each pass redraws only the rows with a repeat (a few percent)
        picks[bad] = rng.integers(0, num_experts, (bad.size, topk))
        s = np.sort(picks[bad], axis=1)
        bad = bad[(s[:, 1:] == s[:, :-1]).any(axis=1)]
    return picks


def systematic_subsets(rng: np.random.Generator, n: int, pi: np.ndarray, topk: int) -> np.ndarray:
    """``[n, topk]``: Madow's systematic sampling over a random expert order per token.

    Lay the experts end to end in a random order, each taking ``pi[e]`` of a line of length
    ``topk``; points ``u, u + 1, ..., u + topk - 1`` land in ``topk`` distinct experts (each
    ``pi <= 1``) and expert ``e`` is hit with probability exactly ``pi[e]``.
    """
    order = rng.permuted(np.broadcast_to(np.arange(pi.size), (n, pi.size)), axis=1)
    edges = np.cumsum(pi[order], axis=1)
    edges[:, -1] = topk  # float rounding must not leave the last point past the end
    points = rng.random((n, 1)) + np.arange(topk)[None, :]
    # Row-wise searchsorted: offset each row so one flat search serves all rows.
    offset = np.arange(n)[:, None] * (topk + 1.0)
    idx = np.searchsorted((edges + offset).ravel(), (points + offset).ravel(), side="right")
    idx = idx.reshape(n, topk) - np.arange(n)[:, None] * pi.size
    return np.take_along_axis(order, np.minimum(idx, pi.size - 1), axis=1)


def sample_gpu_loads(
    popularity: np.ndarray,
    placement: Placement,
    tokens_per_gpu: int,
    topk: int,
    steps: int,
    *,
    layer: int = 0,
    seed: int = 0,
) -> np.ndarray:
    """``popularity``: ``[E]`` → int64 ``[steps, G]`` expert visits per gpu in each sampled step
    (``tokens_per_gpu`` per live gpu; a down gpu gets none)."""
    topo = placement.topology
    if tokens_per_gpu < 1 or steps < 1:
        raise ValueError(f"tokens_per_gpu ({tokens_per_gpu}) and steps ({steps}) must be >= 1")
    if not 0 <= layer < topo.num_layers:
        raise ValueError(f"layer ({layer}) must be in [0, {topo.num_layers - 1}]")
    pop = np.asarray(popularity, dtype=np.float64)
    if pop.shape != (topo.num_experts,):
        raise ValueError(f"popularity has shape {list(pop.shape)}; expected [num_experts] = [{topo.num_experts}]")
    pi = inclusion_probabilities(pop, topk)
    # Rejection only pays while repeats are rare (birthday bound: about topk**2 / 2E of rows).
    uniform = bool(np.all(pop == pop[0])) and topk * topk <= topo.num_experts
    rng = np.random.default_rng(seed)
    logcnt = placement.logcnt[layer]
    log2phy = placement.log2phy[layer]
    spg = topo.slots_per_gpu
    per_step = int(placement.live.sum()) * tokens_per_gpu
    total = steps * per_step
    out = np.zeros(steps * topo.num_gpus, dtype=np.int64)
    for start in range(0, total, _CHUNK):
        n = min(_CHUNK, total - start)
        experts = _uniform_subsets(rng, n, topo.num_experts, topk) if uniform else systematic_subsets(rng, n, pi, topk)
        replica = (rng.random(experts.shape) * logcnt[experts]).astype(np.int64)
        gpu = log2phy[experts, replica] // spg
        key = ((start + np.arange(n)) // per_step)[:, None] * topo.num_gpus + gpu
        out += np.bincount(key.ravel(), minlength=out.size)
    return out.reshape(steps, topo.num_gpus)


def simulate_steps(
    popularity: np.ndarray,
    placement: Placement,
    tokens_per_gpu: int,
    topk: int,
    steps: int,
    *,
    layer: int = 0,
    seed: int = 0,
) -> StepStats:
    """``popularity``: ``[E]`` → :class:`StepStats` of ``steps`` sampled steps on ``layer``."""
    loads = sample_gpu_loads(popularity, placement, tokens_per_gpu, topk, steps, layer=layer, seed=seed)
    mean_load = float(tokens_per_gpu * topk)  # every token makes exactly topk visits, on live gpus
    expected = expected_gpu_load(popularity, placement, tokens_per_gpu, topk, layer)
    return StepStats(
        ratio=loads.max(axis=1) / mean_load,
        mean_load=mean_load,
        expected_ratio=float(np.nanmax(expected) / np.nanmean(expected)),
        tokens_per_gpu=tokens_per_gpu,
        topk=topk,
    )
