"""Plans for time: replica counts and slot swaps that lower the expected MoE time of a layer.

Given a kernel cost model (``eplb.kernel``) and the batch sizes a deployment runs, a layer's time
per step is the slowest gpu's ``gpu_us``; ``eplb.timing`` gives each slot's mean and variance of
cost over steps and the expected maximum over gpus of their (normal) sums. This module lowers that
objective, summed over the batch sizes with their weights:

- ``time_counts``: with redundant slots, replica counts chosen by time, not tokens. A replica of a
  hot expert halves its slots' tile work but, at decode sizes, is one more weight read whenever
  that expert gets two tokens; a replica of a cold expert costs almost nothing. Greedy: each
  redundant slot goes where it lowers ``max(mean gpu time, slowest single slot)`` most, or, when
  nothing lowers it, where it adds least time.
- ``time_pack``: the replicas onto gpus, heaviest expected time first, each to the gpu of least
  time with room and without a copy of that expert.
- ``time_swaps``: slot swaps between two gpus (of one node when there are several) that lower the
  expected maximum, from the gpus most likely to be the slowest; a re-plan's swaps never add a
  moved slot. Candidates are scored on a grid all at once, the best is checked exactly.

Everything is deterministic: no sampling, no clock.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from ..kernel import CostModel
from ..timing import Batches, expected_max, normal_cdf, slot_moments
from ..topology import Topology

__all__ = ["LayerCost", "time_counts", "time_pack", "time_swaps", "objective", "SWAP_WORK"]

# Work cap of one layer's swap search, in candidate x batch size x grid points scored: keeps a
# 58-layer v3-prefill plan (288 slots, 32 gpus) near a second on one core.
SWAP_WORK = 1_500_000
_GRID = 24
# The least relative gain of one swap: the last swaps of a long search gain less than the model
# can tell apart, and cost as much as the first (v3-prefill: 39 passes a layer at 1e-7).
MIN_STEP = 5e-4
# How much slower than the token plan a time plan may be expected at any one batch size of a mix.
MIX_SLACK = 0.01
# The least expected gain (over the batch sizes) for which a layer leaves its token plan: the
# kernel model's held-out error is a few percent, and on H100 kernels the layers changed for less
# than this gained nothing measurable (bench/moe_time_bench.py --kernels gpu).
MIN_GAIN = 0.01


@dataclass(frozen=True)
class LayerCost:
    """One layer's inputs: ``pi`` ``[E]`` inclusion probabilities, ``tokens`` ``[K]`` routed per
    step at each batch size, ``weights`` ``[K]``, ``cost`` and ``dispatch``. Slot moments are
    computed once per replica count for every expert, and kept."""

    pi: np.ndarray
    tokens: np.ndarray
    weights: np.ndarray
    cost: CostModel
    dispatch: str
    _by_count: dict[int, tuple[np.ndarray, ...]] = field(default_factory=dict, repr=False, compare=False)

    def only(self, k: int) -> LayerCost:
        """This layer at batch size ``k`` alone."""
        return LayerCost(self.pi, self.tokens[[k]], np.ones(1), self.cost, self.dispatch)

    def _at(self, r: int) -> tuple[np.ndarray, ...]:
        """``[K, E]`` slot mean, variance and probability of no tokens of every expert with ``r`` replicas."""
        if r not in self._by_count:
            full = np.full(self.pi.size, r)
            out = [slot_moments(self.pi, full, int(t), self.cost, self.dispatch) for t in self.tokens]
            self._by_count[r] = tuple(np.array([o[i] for o in out]) for i in range(3))
        return self._by_count[r]

    def moments(self, counts: np.ndarray, experts: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """``counts`` ``[E]`` (or ``[X]`` of ``experts``) → per-replica-slot mean and variance
        ``[K, E]`` (``[K, X]``)."""
        counts = np.maximum(np.asarray(counts, dtype=np.int64), 1)
        idx = np.arange(self.pi.size) if experts is None else np.asarray(experts)
        mean, var, _ = self.moments3(counts, idx)
        return mean, var

    def moments3(self, counts: np.ndarray, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Mean, variance and probability of no tokens, ``[K, X]`` each, of experts ``idx``."""
        counts = np.maximum(np.asarray(counts, dtype=np.int64), 1)
        out = [np.zeros((self.tokens.size, idx.size)) for _ in range(3)]
        for r in np.unique(counts):
            sel = counts == r
            at = self._at(int(r))
            for o, a in zip(out, at):
                o[:, sel] = a[:, idx[sel]]
        return out[0], out[1], out[2]


def _gpu_sums(x: np.ndarray, phy: np.ndarray, num_gpus: int) -> np.ndarray:
    """``x`` ``[K, E]``, ``phy`` ``[P]`` → ``[K, G]`` summed over each gpu's slots (0 for -1)."""
    held = phy >= 0
    v = np.where(held[None, :], x[:, np.maximum(phy, 0)], 0.0)
    return v.reshape(x.shape[0], num_gpus, -1).sum(axis=2)


def objective(lc: LayerCost, phy: np.ndarray, counts: np.ndarray, num_gpus: int, live: np.ndarray) -> float:
    """Expected slowest-gpu microseconds, summed over batch sizes with their weights."""
    mean, var = lc.moments(counts)
    mu, v = _gpu_sums(mean, phy, num_gpus), _gpu_sums(var, phy, num_gpus)
    return float((lc.weights * expected_max(mu[:, live], v[:, live])).sum())


def token_counts(pi: np.ndarray, extra: int, cap: int) -> np.ndarray:
    """``[E]`` counts: 1 each, then ``extra`` replicas one at a time to the expert of most
    tokens per replica (water-filling, as the token plan does), at most ``cap`` each."""
    counts = np.ones(pi.size, dtype=np.int64)
    for _ in range(extra):
        per = np.where(counts < cap, pi / counts, -np.inf)
        counts[int(np.argmax(per))] += 1
    return counts


def time_counts(
    lc: LayerCost, num_experts: int, num_slots: int, num_gpus: int, start: np.ndarray | None = None
) -> np.ndarray:
    """``[E]`` replica counts (each in ``[1, G]``, summing to ``P``) chosen by time, from
    ``start`` (default: one each)."""
    counts = np.ones(num_experts, dtype=np.int64) if start is None else np.array(start, dtype=np.int64)
    mean, var = lc.moments(counts)
    nxt_m, nxt_v = lc.moments(counts + 1)
    scale = 1.0 / np.maximum((mean.sum(axis=1) / num_gpus), 1e-9)  # [K]: each batch size counts alike
    w = lc.weights * scale

    def proxy(total: np.ndarray, slot_top: np.ndarray) -> np.ndarray:
        return (w[:, None] * np.maximum(total / num_gpus, slot_top)).sum(axis=0)

    for _ in range(num_slots - int(counts.sum())):
        total = (counts[None, :] * mean).sum(axis=1)  # [K]
        top = mean + 2 * np.sqrt(var)  # a slot's high cost over steps
        # Adding a replica to e changes the total by c'(r+1) - c(r) and e's slot cost.
        new_total = total[:, None] + (counts + 1)[None, :] * nxt_m - counts[None, :] * mean  # [K, E]
        new_top_e = nxt_m + 2 * np.sqrt(nxt_v)
        # The slowest slot after adding to e: the largest of the others' and e's new one.
        order = np.argsort(-top, axis=1)
        first, second = top[np.arange(top.shape[0]), order[:, 0]], top[np.arange(top.shape[0]), order[:, 1]]
        others = np.where(np.arange(num_experts)[None, :] == order[:, :1], second[:, None], first[:, None])
        score = proxy(new_total, np.maximum(others, new_top_e))
        score = np.where(counts < num_gpus, score, np.inf)
        best = np.flatnonzero(score <= score.min() * (1 + 1e-12))
        # Ties (nothing pins the time): the replica that adds the least time.
        add = (w[:, None] * (new_total - total[:, None])).sum(axis=0)
        e = int(best[np.argmin(add[best])])
        counts[e] += 1
        mean[:, e], var[:, e] = nxt_m[:, e], nxt_v[:, e]
        m2, v2 = lc.moments(counts[[e]] + 1, np.array([e]))
        nxt_m[:, e], nxt_v[:, e] = m2[:, 0], v2[:, 0]
    return counts


def time_pack(lc: LayerCost, counts: np.ndarray, num_gpus: int) -> np.ndarray | None:
    """``counts`` ``[E]`` → ``[P]`` phy2log: replicas onto gpus, heaviest first, each to the gpu
    of least expected time that has room and no copy of its expert (None when the last replicas
    find room only beside a copy of their own: many replicas on few gpus)."""
    mean, _ = lc.moments(counts)
    w = (lc.weights[:, None] * mean / np.maximum(mean.sum(axis=1, keepdims=True), 1e-12)).sum(axis=0)
    items = np.repeat(np.arange(counts.size), counts)
    # Replicated experts first (they need distinct gpus, which a late item may not find), each
    # group heaviest first.
    order = np.lexsort((-w[items], counts[items] == 1))
    per = items.size // num_gpus
    load = np.zeros(num_gpus)
    fill = np.zeros(num_gpus, dtype=np.int64)
    held = np.zeros((num_gpus, counts.size), dtype=bool)
    phy = np.full((num_gpus, per), -1, dtype=np.int64)
    for it in items[order]:
        ok = (fill < per) & ~held[:, it]
        if not ok.any():
            return None  # only gpus holding a copy have room left: no packing from this order
        g = int(np.flatnonzero(ok)[np.argmin(load[ok])])
        phy[g, fill[g]] = it
        fill[g] += 1
        held[g, it] = True
        load[g] += w[it]
    return phy.ravel()


def time_swaps(
    lc: LayerCost,
    phy: np.ndarray,
    num_gpus: int,
    *,
    gpus_per_node: int,
    live: np.ndarray,
    previous: np.ndarray | None = None,
    work: float = SWAP_WORK,
) -> tuple[np.ndarray, int]:
    """``phy`` ``[P]`` → (``[P]`` after swaps, swaps made). Counts never change; a swap keeps
    every gpu free of two copies of one expert, stays inside a node, and with ``previous``
    ``[P]`` never raises the number of slots that differ from it."""
    phy = np.array(phy, dtype=np.int64)
    P = phy.size
    spg = P // num_gpus
    counts = np.bincount(phy[phy >= 0], minlength=lc.pi.size)
    mean, var = lc.moments(np.maximum(counts, 1))
    K = mean.shape[0]
    gpu = np.arange(P) // spg
    slot_ok = live[gpu] & (phy >= 0)
    w = lc.weights
    swaps = 0
    spent = 0.0
    best_obj = None
    while spent < work:
        sm = np.where(phy >= 0, mean[:, np.maximum(phy, 0)], 0.0)  # [K, P]
        sv = np.where(phy >= 0, var[:, np.maximum(phy, 0)], 0.0)
        mu = sm.reshape(K, num_gpus, spg).sum(axis=2)
        v = sv.reshape(K, num_gpus, spg).sum(axis=2)
        mu_l, v_l = mu[:, live], v[:, live]
        if best_obj is None:
            best_obj = float((w * expected_max(mu_l, v_l)).sum())
        sd = np.sqrt(np.maximum(v, 1e-18))
        # A grid wide enough for the maximum after a swap that lowers the slowest gpu.
        top = (mu_l - 4 * np.sqrt(np.maximum(v_l, 1e-18))).max(axis=1)
        lo = np.minimum(top, np.sort(mu_l, axis=1)[:, -2]) - 1e-9
        hi = (mu_l + 5 * np.sqrt(np.maximum(v_l, 1e-18))).max(axis=1) + 1e-9
        t = lo[:, None] + (hi - lo)[:, None] * np.linspace(0.0, 1.0, _GRID)[None, :]  # [K, T]
        logphi = np.log(np.maximum(normal_cdf((t[:, None, :] - mu[:, :, None]) / sd[:, :, None]), 1e-300))  # [K, G, T]
        logphi[:, ~live, :] = 0.0
        logf = logphi.sum(axis=1)  # [K, T]
        # Source gpus: the likeliest to be the slowest (weighted high quantile, normalised per batch).
        crit = (w[:, None] * (mu + 2 * sd) / np.maximum(mu[:, live].mean(axis=1, keepdims=True), 1e-12)).sum(axis=0)
        crit[~live] = -np.inf
        # One scoring pass over every swap from the three likeliest slowest gpus.
        src = [int(g) for g in np.argsort(-crit)[:3] if np.isfinite(crit[g])]
        if not src:
            break
        ia = np.concatenate([np.arange(g * spg, (g + 1) * spg) for g in src])
        ia = ia[slot_ok[ia]]
        held = np.zeros((num_gpus, lc.pi.size), dtype=bool)
        held[gpu[slot_ok | (phy >= 0)], phy[slot_ok | (phy >= 0)]] = True
        i = np.repeat(ia, P)
        j = np.tile(np.arange(P), ia.size)
        a_, b = gpu[i], gpu[j]
        keep = slot_ok[j] & (a_ != b) & (a_ // gpus_per_node == b // gpus_per_node)
        i, j, a_, b = i[keep], j[keep], a_[keep], b[keep]
        ei, ej = phy[i], phy[j]
        keep = (ei != ej) & ~held[a_, ej] & ~held[b, ei]
        if previous is not None:
            before = (phy[i] != previous[i]).astype(int) + (phy[j] != previous[j])
            after = (ej != previous[i]).astype(int) + (ei != previous[j])
            keep &= after <= before
        # Only swaps that hand the source gpu something cheaper can lower the slowest gpu.
        keep &= (w[:, None] * (sm[:, i] - sm[:, j])).sum(axis=0) > 0
        i, j, a_, b = i[keep], j[keep], a_[keep], b[keep]
        if i.size == 0:
            break
        d_m = sm[:, j] - sm[:, i]  # [K, C]: change of the source gpu
        d_v = sv[:, j] - sv[:, i]
        na_m, na_v = mu[:, a_] + d_m, v[:, a_] + d_v
        nb_m, nb_v = mu[:, b] - d_m, v[:, b] - d_v
        za = (t[:, None, :] - na_m[:, :, None]) / np.sqrt(np.maximum(na_v, 1e-18))[:, :, None]
        zb = (t[:, None, :] - nb_m[:, :, None]) / np.sqrt(np.maximum(nb_v, 1e-18))[:, :, None]
        new_logf = (
            logf[:, None, :]
            - logphi[:, a_, :]
            - logphi[:, b, :]
            + np.log(np.maximum(normal_cdf(za), 1e-300))
            + np.log(np.maximum(normal_cdf(zb), 1e-300))
        )
        emax = lo[:, None] + np.trapezoid(1.0 - np.exp(np.minimum(new_logf, 0.0)), t[:, None, :], axis=-1)
        score = (w[:, None] * emax).sum(axis=0)
        spent += i.size * K * _GRID
        improved = False
        for c in np.argsort(score, kind="stable")[:4]:
            trial = phy.copy()
            trial[i[c]], trial[j[c]] = phy[j[c]], phy[i[c]]
            tm = np.where(trial >= 0, mean[:, np.maximum(trial, 0)], 0.0).reshape(K, num_gpus, spg).sum(axis=2)
            tv = np.where(trial >= 0, var[:, np.maximum(trial, 0)], 0.0).reshape(K, num_gpus, spg).sum(axis=2)
            obj = float((w * expected_max(tm[:, live], tv[:, live])).sum())
            if obj < best_obj * (1 - MIN_STEP):
                phy, best_obj, improved = trial, obj, True
                swaps += 1
                break
        if not improved:
            break
    return phy, swaps


def plan_for_time(
    loads: np.ndarray,
    phy2log: np.ndarray,
    topo: Topology,
    *,
    cost: CostModel,
    batches: Batches,
    top_k: int,
    dispatch: str,
    live: np.ndarray,
    previous: np.ndarray | None,
    fresh: bool,
    deadline: float | None = None,
    deal: np.ndarray | None = None,
) -> tuple[np.ndarray, tuple[str, ...], np.ndarray]:
    """``loads`` ``[L, E]``, the token plan's ``phy2log`` ``[L, P]`` → (``[L, P]`` planned for time,
    notes, ``[L, K]`` expected microseconds per layer and batch size).

    Per layer: with redundant slots in a fresh plan on one node and every gpu live, also a plan
    whose counts and packing are chosen by time (``time_counts``, ``time_pack``); both are swapped
    (``time_swaps``) and the faster kept, so the result is never slower than the token plan
    under the objective.

    ``deal`` ``[L, P]`` (eplb.py's placement of the same loads where its busiest gpu is nearly as
    light in tokens, else the token plan's; or None): a layer the search leaves as planned for
    tokens takes it where the model expects it within ``MIN_GAIN`` of the token plan over the
    batch sizes and within ``MIX_SLACK`` at each: the model cannot tell such layers apart, and on
    real grouped kernels eplb.py's deal was the faster there."""
    from ..simulate import inclusion_probabilities

    L, P = phy2log.shape
    G = topo.num_gpus
    gpn = G // topo.num_nodes
    out = np.array(phy2log, dtype=np.int64)
    per_layer = np.zeros((L, batches.sizes.size))
    tokens = batches.sizes * int(live.sum())
    skipped, recounted, swapped, dealt = 0, 0, 0, 0
    one_node = fresh and previous is None and topo.num_nodes == 1 and live.all() and P > topo.num_experts
    late = 0
    for layer in range(L):
        out_of_time = deadline is not None and time.perf_counter() > deadline
        if not loads[layer].any():
            skipped += 1  # no load: nothing routed, the layer costs nothing to model
            continue
        # Fewer loaded experts than top_k: every token picks all of them.
        pi = inclusion_probabilities(loads[layer], min(top_k, int((loads[layer] > 0).sum())))
        lc = LayerCost(pi, tokens, batches.weights, cost, dispatch)
        prev = None if previous is None else np.asarray(previous[layer], dtype=np.int64)
        token = out[layer].copy()
        base_k = _layer_us(lc, token, np.bincount(token[token >= 0], minlength=topo.num_experts), G, live)
        if out_of_time:
            # Past the plan's time_limit: the token plan, with its expected time.
            per_layer[layer] = base_k
            late += 1
            continue
        cands = [(time_swaps(lc, token, G, gpus_per_node=gpn, live=live, previous=prev)[0], False)]
        if one_node:
            # Counts by time for the last m redundant slots, the rest water-filled by tokens: the
            # time rule alone over-spends slots on cold experts, which packs badly at large
            # batches; each m is packed and judged on every batch size below.
            extra = P - topo.num_experts
            packed = []
            for m in sorted({extra, extra // 2, extra // 4, extra // 8} - {0}, reverse=True):
                tc = time_counts(lc, topo.num_experts, P, G, start=token_counts(pi, extra - m, G))
                phy = time_pack(lc, tc, G)
                if phy is not None:
                    packed.append((objective(lc, phy, tc, G, live), phy))
            if packed:
                # Only the most promising packing is searched: the search costs most of the plan.
                phy = min(packed, key=lambda x: x[0])[1]
                cands.append((time_swaps(lc, phy, G, gpus_per_node=gpn, live=live)[0], True))
        best, best_k, best_recount = token, base_k, False
        for cand, recount in cands:
            cand_k = _layer_us(lc, cand, np.bincount(cand[cand >= 0], minlength=topo.num_experts), G, live)
            # Kept only where the model expects a clear gain over the batch sizes, and no size of
            # a mix more than MIX_SLACK slower than under the token plan: a mix must not buy its
            # small batches with its large ones, and a gain within the model's error is none.
            total, ref = float((lc.weights * cand_k).sum()), float((lc.weights * best_k).sum())
            if (
                total < ref
                and total <= (lc.weights * base_k).sum() * (1 - MIN_GAIN)
                and (cand_k <= base_k * (1 + MIX_SLACK)).all()
            ):
                best, best_k, best_recount = cand, cand_k, recount
        took_deal = False
        if deal is not None and best is token and not (deal[layer] == token).all():
            d = np.asarray(deal[layer], dtype=np.int64)
            deal_k = _layer_us(lc, d, np.bincount(d[d >= 0], minlength=topo.num_experts), G, live)
            if (lc.weights * deal_k).sum() <= (lc.weights * base_k).sum() * (1 + MIN_GAIN) and (
                deal_k <= base_k * (1 + MIX_SLACK)
            ).all():
                best, best_k, took_deal = d, deal_k, True
        dealt += took_deal
        recounted += best_recount
        swapped += int((best != token).any() and not took_deal)
        out[layer] = best
        per_layer[layer] = best_k
    notes = [
        f"planned for time: {swapped} of {L} layers changed from the token plan, {recounted} of them with replica "
        "counts chosen by time"
    ]
    if deal is not None:
        notes.append(
            f"planned for time: {dealt} of the layers left as planned for tokens take eplb.py's deal (expected within "
            f"{MIN_GAIN:.0%} of them in time, its busiest gpu within 1 % in tokens)"
        )
    if late:
        notes.append(f"planned for time: time_limit reached, {late} layers kept as planned for tokens")
    if skipped:
        notes.append(
            f"planned for time: {skipped} layers with fewer loaded experts than top_k ({top_k}) kept as planned for tokens"
        )
    return out, tuple(notes), per_layer


def _layer_us(lc: LayerCost, phy: np.ndarray, counts: np.ndarray, num_gpus: int, live: np.ndarray) -> np.ndarray:
    """``[K]`` expected microseconds of the layer at each batch size, the launch cost included."""
    from ..timing import gpu_moments

    m, v, p0 = lc.moments3(counts, np.arange(lc.pi.size))
    out = np.zeros(lc.tokens.size)
    for k in range(lc.tokens.size):
        mu, var = gpu_moments(phy, m[k], v[k], p0[k], num_gpus, lc.cost.call_us)
        out[k] = expected_max(mu[live], var[live])
    return out
