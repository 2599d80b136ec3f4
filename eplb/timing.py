"""Expected MoE time of a placement: what a step waits for, from a kernel cost model.

At ``b`` tokens per gpu and ``G`` live gpus a step routes ``B = G * b`` tokens; a token picks expert
``e`` with probability ``pi[e]`` (``eplb.simulate.inclusion_probabilities`` of the layer's loads and
``top_k``), so expert ``e`` gets ``n_e ~ Binomial(B, pi[e])`` tokens. ``dispatch`` says how its
replicas share them:

- ``"even"``: split evenly over the ``r`` replicas, as vLLM's modulo does (replica ``j`` gets
  ``floor((n_e + j) / r)``; with few tokens only some replicas are activated);
- ``"static"``: each replica serves ``1 / r`` of the source ranks, as SGLang's static dispatch
  does: ``Binomial(B / r, pi[e])`` each.

A gpu's time is ``cost.gpu_us`` of its slots' counts; the layer waits for the slowest gpu. The
planner's surrogate (``layer_moments``, ``expected_max``) takes each slot's mean and variance of
cost over steps, sums them per gpu and reads the expected maximum of independent normals: minimising
the maximum over sampled steps instead over-fits those steps. ``sample_layer_us`` samples steps
(token by token, seeded) for judging a placement on steps it was not planned on.

Shapes: ``L`` layers, ``E`` experts, ``P`` slots, ``G`` gpus; times in microseconds.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import checks
from .kernel import CostModel, as_cost_model
from .limits import MAX_TOKENS_PER_GPU
from .placement import Placement
from .simulate import inclusion_probabilities, systematic_subsets

__all__ = [
    "DISPATCHES",
    "Batches",
    "batches_from",
    "slot_moments",
    "expected_max",
    "normal_cdf",
    "gpu_moments",
    "predicted_layer_us",
    "sample_layer_us",
    "sample_slot_counts",
]

DISPATCHES = ("even", "static")
"""How an engine splits an expert's tokens over its replicas: ``even`` (vLLM) or ``static`` (SGLang)."""
# Points of a slot's token distribution the moments are summed over (strided beyond this).
_POINTS = 64
# Grid of the expected-maximum integral.
_GRID = 48


@dataclass(frozen=True)
class Batches:
    """Tokens per gpu per step the plan is for, with weights summing to 1: ``sizes`` ``[K]`` ints
    >= 1, ``weights`` ``[K]``."""

    sizes: np.ndarray
    weights: np.ndarray


def batches_from(tokens_per_gpu: object) -> Batches:
    """``tokens_per_gpu=``: one int, a list of ints (equal weights) or a list of
    ``(tokens, weight)`` pairs → ``Batches`` (``ValueError`` says what is allowed)."""
    msg = (
        f"tokens_per_gpu must be an int in 1..{MAX_TOKENS_PER_GPU}, a list of them, or a list of (tokens, weight) "
        f"pairs with weights >= 0 and a positive sum; got {tokens_per_gpu!r}"
    )
    if isinstance(tokens_per_gpu, (dict, str, bytes, set)):
        raise ValueError(msg + " (a dict's weights would be lost: give [(tokens, weight), ...])")
    items = [tokens_per_gpu] if isinstance(tokens_per_gpu, (int, np.integer)) else tokens_per_gpu
    try:
        # Any object: one that is not iterable raises the TypeError turned into ``msg`` here.
        items = list(items)  # type: ignore[call-overload]
    except TypeError:
        raise ValueError(msg) from None
    if not items:
        raise ValueError(msg)
    sizes, weights = [], []
    for it in items:
        b, w = it if isinstance(it, (tuple, list)) and len(it) == 2 else (it, 1.0)
        if not (checks.is_int(b) and 1 <= int(b) <= MAX_TOKENS_PER_GPU):
            raise ValueError(msg)
        if int(b) in sizes:
            raise ValueError(f"tokens_per_gpu names {int(b)} twice; give each size once, with its weight")
        if not (checks.is_number(w) and np.isfinite(float(w)) and float(w) >= 0):
            raise ValueError(msg)
        sizes.append(int(b))
        weights.append(float(w))
    wt = np.array(weights)
    if wt.sum() <= 0:
        raise ValueError(msg)
    return Batches(np.array(sizes, dtype=np.int64), wt / wt.sum())


def _check_top_k(top_k: object, num_experts: int) -> None:
    if not (checks.is_int(top_k) and 1 <= int(top_k) <= num_experts):
        raise ValueError(f"top_k must be an integer in 1..num_experts ({num_experts}), got {top_k!r}")


def normal_cdf(z: np.ndarray) -> np.ndarray:
    """Standard normal CDF, vectorised (Abramowitz & Stegun 7.1.26 erf, |error| < 1.5e-7):
    numpy has no erf and the library takes no scipy."""
    x = np.abs(z) / np.sqrt(2.0)
    t = 1.0 / (1.0 + 0.3275911 * x)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    erf = 1.0 - poly * np.exp(-x * x)
    return 0.5 * (1.0 + np.sign(z) * erf)


def _count_grid(mean: np.ndarray, var: np.ndarray, limit: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``[X]`` means and variances of a token count → ``[X, K]`` count points and weights.

    Small means: the binomial's own probabilities (``limit`` trials); larger ones: a discretised
    normal with the binomial's variance, strided so no more than ``_POINTS`` points are summed."""
    x = mean.size
    sd = np.sqrt(np.maximum(var, 1e-12))
    small = mean < 24
    pts = np.zeros((x, _POINTS))
    wts = np.zeros((x, _POINTS))
    k = np.arange(_POINTS, dtype=np.float64)
    if small.any():
        # Binomial(n, p) probabilities by the ratio of successive terms (n = limit, p = mean / n).
        n = limit[small][:, None]
        p = np.clip(mean[small][:, None] / np.maximum(n, 1e-300), 0.0, 1.0)
        q = np.maximum(1.0 - p, 1e-300)
        ratio = np.maximum(n - k[None, :-1], 0.0) / (k[None, :-1] + 1.0) * (p / q)
        with np.errstate(divide="ignore"):
            logw = n * np.log(q) + np.concatenate(
                [np.zeros((ratio.shape[0], 1)), np.cumsum(np.log(ratio), axis=1)], axis=1
            )
        w = np.exp(logw - logw.max(axis=1, keepdims=True))
        pts[small] = k[None, :]
        wts[small] = w * (k[None, :] <= n)
    big = ~small
    if big.any():
        m, s = mean[big][:, None], sd[big][:, None]
        lo = np.maximum(0.0, np.floor(m - 6 * s))
        hi = np.minimum(limit[big][:, None], np.ceil(m + 6 * s))
        step = np.maximum(1.0, np.ceil((hi - lo + 1) / _POINTS))
        p = lo + k[None, :] * step
        w = np.exp(-0.5 * ((p - m) / s) ** 2) * (p <= hi)
        pts[big] = p
        wts[big] = w
    # No variance (an expert every token picks) can leave a row's grid without weight: all of
    # it then sits on the point nearest the mean.
    empty = wts.sum(axis=1) <= 0
    if empty.any():
        near = np.argmin(np.abs(pts[empty] - mean[empty][:, None]), axis=1)
        wts[empty] = 0.0
        wts[np.flatnonzero(empty), near] = 1.0
    wts /= wts.sum(axis=1, keepdims=True)
    return pts, wts


def slot_moments(
    pi: np.ndarray, counts: np.ndarray, tokens: int, cost: CostModel, dispatch: str = "even"
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``pi``: ``[E]`` inclusion probabilities, ``counts``: ``[E]`` replicas (>= 1 where used),
    ``tokens``: tokens routed per step → ``[E]`` mean, variance and probability of no tokens of
    the cost of one replica slot of each expert."""
    r = np.maximum(np.asarray(counts, dtype=np.float64), 1.0)
    pi = np.asarray(pi, dtype=np.float64)
    if dispatch == "static":
        n_src = tokens / r
        pts, wts = _count_grid(n_src * pi, n_src * pi * (1 - pi), n_src)
        f = cost.slot_us(np.round(pts))
        mean = (f * wts).sum(axis=1)
        sq = (f * f * wts).sum(axis=1)
        p0 = (wts * (pts < 0.5)).sum(axis=1)
        return mean, np.maximum(sq - mean * mean, 0.0), p0
    if dispatch != "even":
        raise ValueError(f"dispatch must be one of {', '.join(DISPATCHES)}; got {dispatch!r}")
    pts, wts = _count_grid(tokens * pi, tokens * pi * (1 - pi), np.full(pi.size, float(tokens)))
    mean = np.zeros(pi.size)
    sq = np.zeros(pi.size)
    p0 = np.zeros(pi.size)
    rmax = int(r.max())
    for j in range(rmax):
        on = (j < r)[:, None]
        n = np.floor((pts + j) / r[:, None])
        f = cost.slot_us(n)
        mean += ((f * wts) * on).sum(axis=1)
        sq += ((f * f * wts) * on).sum(axis=1)
        p0 += ((wts * (n < 0.5)) * on).sum(axis=1)
    mean /= r
    sq /= r
    p0 /= r
    return mean, np.maximum(sq - mean * mean, 0.0), p0


def expected_max(mu: np.ndarray, var: np.ndarray) -> np.ndarray:
    """``mu``, ``var``: ``[..., G]`` → ``[...]`` expected maximum of independent normals
    (``E[max] = lo + integral from lo of (1 - prod_g Phi_g(t)) dt``, on a grid)."""
    sd = np.sqrt(np.maximum(var, 1e-18))
    lo = (mu - 4 * sd).max(axis=-1, keepdims=True)
    hi = (mu + 5 * sd).max(axis=-1, keepdims=True)
    t = lo + (hi - lo) * np.linspace(0.0, 1.0, _GRID)  # [..., T]
    z = (t[..., None, :] - mu[..., :, None]) / sd[..., :, None]  # [..., G, T]
    logf = np.log(np.maximum(normal_cdf(z), 1e-300)).sum(axis=-2)  # [..., T]
    tail = 1.0 - np.exp(logf)
    return lo[..., 0] + np.trapezoid(tail, t, axis=-1)


def gpu_moments(
    phy2log: np.ndarray, mean: np.ndarray, var: np.ndarray, p0: np.ndarray, num_gpus: int, call_us: float
) -> tuple[np.ndarray, np.ndarray]:
    """``phy2log``: ``[P]`` (-1 for an empty slot), per-expert slot moments ``[E]`` → per gpu
    ``[G]`` mean and variance of its time (the launch cost once if any slot has tokens)."""
    held = phy2log >= 0
    e = np.where(held, phy2log, 0)
    m = np.where(held, mean[e], 0.0).reshape(num_gpus, -1)
    v = np.where(held, var[e], 0.0).reshape(num_gpus, -1)
    z = np.where(held, p0[e], 1.0).reshape(num_gpus, -1)
    idle = np.exp(np.log(np.maximum(z, 1e-300)).sum(axis=1))
    return m.sum(axis=1) + call_us * (1 - idle), v.sum(axis=1) + call_us**2 * idle * (1 - idle)


def predicted_layer_us(
    placement: Placement,
    loads: np.ndarray,
    kernel_curve: object,
    tokens_per_gpu: object,
    top_k: int,
    dispatch: str = "even",
) -> np.ndarray:
    """``loads``: ``[L, E]`` → ``[L, K]`` expected microseconds of each layer per step at each of
    the ``K`` batch sizes of ``tokens_per_gpu`` (the surrogate: normal per-gpu times)."""
    cost = as_cost_model(kernel_curve)
    batches = batches_from(tokens_per_gpu)
    topo = placement.topology
    loads = np.asarray(loads, dtype=np.float64)
    if loads.shape != (topo.num_layers, topo.num_experts):
        raise ValueError(
            f"loads has shape {list(loads.shape)}; expected [num_layers, num_experts] = "
            f"[{topo.num_layers}, {topo.num_experts}]"
        )
    _check_top_k(top_k, topo.num_experts)
    live = placement.live
    out = np.zeros((topo.num_layers, batches.sizes.size))
    phy = placement.phy2log
    for layer in range(topo.num_layers):
        if not loads[layer].any():
            continue  # no load, no routing: the layer costs nothing
        # Fewer loaded experts than top_k: every token picks all of them.
        pi = inclusion_probabilities(loads[layer], min(top_k, int((loads[layer] > 0).sum())))
        for k, b in enumerate(batches.sizes):
            mean, var, p0 = slot_moments(pi, placement.logcnt[layer], int(b) * int(live.sum()), cost, dispatch)
            mu, v = gpu_moments(phy[layer], mean, var, p0, topo.num_gpus, cost.call_us)
            out[layer, k] = expected_max(mu[live], v[live])
    return out


def sample_layer_us(
    popularity: np.ndarray,
    placement: Placement,
    kernel_curve: object,
    tokens_per_gpu: int,
    top_k: int,
    steps: int,
    *,
    layer: int = 0,
    dispatch: str = "even",
    seed: int = 0,
) -> np.ndarray:
    """``popularity``: ``[E]`` → ``[steps]`` microseconds of ``layer`` in sampled steps (max over
    gpus of ``cost.gpu_us``), routing token by token as ``eplb.simulate`` does."""
    counts = sample_slot_counts(
        popularity, placement, tokens_per_gpu, top_k, steps, layer=layer, dispatch=dispatch, seed=seed
    )
    cost = as_cost_model(kernel_curve)
    topo = placement.topology
    per_gpu = cost.gpu_us(counts.reshape(steps, topo.num_gpus, topo.slots_per_gpu))
    return per_gpu.max(axis=1)


def sample_slot_counts(
    popularity: np.ndarray,
    placement: Placement,
    tokens_per_gpu: int,
    top_k: int,
    steps: int,
    *,
    layer: int = 0,
    dispatch: str = "even",
    seed: int = 0,
) -> np.ndarray:
    """``popularity``: ``[E]`` → int64 ``[steps, P]`` tokens of each slot in sampled steps
    (token by token; ``dispatch`` as in the module's doc; a down gpu's slots get none)."""
    if dispatch not in DISPATCHES:
        raise ValueError(f"dispatch must be one of {', '.join(DISPATCHES)}; got {dispatch!r}")
    topo = placement.topology
    batches_from(tokens_per_gpu)  # an int in 1 .. MAX_TOKENS_PER_GPU
    checks.positive_int("steps", steps)
    if not 0 <= layer < topo.num_layers:
        raise ValueError(f"layer ({layer}) must be in [0, {topo.num_layers - 1}]")
    _check_top_k(top_k, topo.num_experts)
    pi = inclusion_probabilities(np.asarray(popularity, dtype=np.float64), top_k)
    rng = np.random.default_rng(seed)
    live_gpus = np.flatnonzero(placement.live)
    B = tokens_per_gpu * live_gpus.size
    logcnt = placement.logcnt[layer]
    log2phy = placement.log2phy[layer]
    out = np.zeros((steps, topo.num_slots), dtype=np.int64)
    for s in range(steps):
        picks = systematic_subsets(rng, B, pi, top_k)  # [B, k]
        if dispatch == "even":
            # Each expert's visits in token order, dealt round-robin over its replicas (vLLM's
            # modulo), starting at a random replica so no replica is always the fuller one.
            flat = picks.ravel()
            order = np.argsort(flat, kind="stable")
            e_sorted = flat[order]
            first = np.searchsorted(e_sorted, e_sorted, side="left")
            rank = np.arange(flat.size) - first
            cnt = logcnt[e_sorted]
            offset = rng.integers(0, 1 << 30, topo.num_experts)[e_sorted]
            rep = (rank + offset) % cnt
        else:
            # The token's source rank picks the replica: ranks split evenly over replicas.
            src = np.repeat(np.arange(B) // tokens_per_gpu, top_k)
            e_sorted = picks.ravel()
            cnt = logcnt[e_sorted]
            rep = (src * cnt) // live_gpus.size
        slot = log2phy[e_sorted, rep]
        out[s] = np.bincount(slot, minlength=topo.num_slots)
    return out
