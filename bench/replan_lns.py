"""How many fewer slots heavy search finds than our re-plan, on full-scale layers.

    python -m eplb_bench.replan_lns [--scale kimi-64] [--sigmas 0.05,0.2] [--layers 6]
                                    [--rounds 30] [--size 16] [--time-limit 2] [--json FILE]

``moves_gap`` proves the fewest moves on small layers; full-scale layers are too big for that
(CP-SAT finds no better placement in a minute). Here a large-neighbourhood search starts from
our re-plan of one drift step (``global`` policy, ``tolerance`` 0.01) and, for ``--rounds``
rounds per layer, frees ``--size`` gpus (half of them among those our plan rewrote, half drawn
towards the lightest) and lets CP-SAT rewrite them with the fewest slots changed against the
previous placement: any experts (the hottest 40 may gain a replica), replica counts within one
of the current ones, every gpu (the fixed ones too, since counts change) at most our plan's
busiest gpu. Each improvement is kept. It prints our moves, the search's and the counts-kept
floor of ``drift_bench`` (``harness.floors.floor_at``) at the same cap, summed over the first ``--layers``
layers.

Needs OR-Tools (``pip install 'eplb[ilp]'``).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

import eplb
from eplb.workloads import SCALES, drift, make_loads

from .harness.floors import floor_at

_SCALE = 1e6  # loads in units of 1e-6 of a gpu's mean load
_HOT = 40  # the hottest experts may gain a replica in any neighbourhood


def improve_once(
    w: np.ndarray, prev: np.ndarray, cur: np.ndarray, limit: float, free: np.ndarray, time_limit: float
) -> np.ndarray | None:
    """``w`` ``[E]`` loads, ``prev`` and ``cur`` ``[G, S]`` experts per gpu (the placement in
    service and a re-plan of it with every gpu at most ``limit``), ``free`` gpu ids → ``cur``
    with the ``free`` gpus rewritten to keep most of ``prev`` (CP-SAT), or ``None`` if it found
    nothing. Replica counts stay within one of ``cur``'s, every expert keeps a replica, no gpu
    holds an expert twice, and every gpu stays at most ``limit``. Experts that stay on a gpu
    keep their slot."""
    from ortools.sat.python import cp_model

    G, S = prev.shape
    E = w.size
    unit = _SCALE * G / w.sum()
    cap_units = int(np.floor(limit * unit)) + S  # one unit of rounding per slot
    free_set = set(free.tolist())
    fixed = [g for g in range(G) if g not in free_set]
    cnt = np.bincount(cur.ravel(), minlength=E)
    c_fixed = np.bincount(cur[fixed].ravel(), minlength=E)
    cand = sorted(
        set(cur[free].ravel().tolist()) | set(prev[free].ravel().tolist()) | set(np.argsort(-w)[:_HOT].tolist())
    )
    m = cp_model.CpModel()
    x = {(e, g): m.NewBoolVar("") for e in cand for g in free}
    options: dict[int, list[tuple[int, object]]] = {}
    for e in cand:
        lo, hi = max(1, c_fixed[e], cnt[e] - 1), min(cnt[e] + 1, c_fixed[e] + len(free))
        ys = [(k, m.NewBoolVar("")) for k in range(lo, hi + 1)]
        m.AddExactlyOne([y for _, y in ys])
        m.Add(int(c_fixed[e]) + sum(x[e, g] for g in free) == sum(k * y for k, y in ys))
        options[e] = ys
    for g in free:
        m.Add(sum(x[e, g] for e in cand) == S)
        terms = []
        for e in cand:
            if len(options[e]) == 1:
                terms.append(int(round(w[e] / options[e][0][0] * unit)) * x[e, g])
                continue
            for k, y in options[e]:
                z = m.NewBoolVar("")  # z >= x and y: the load bound keeps it 0 otherwise
                m.AddBoolOr([x[e, g].Not(), y.Not(), z])
                terms.append(int(round(w[e] / k * unit)) * z)
        m.Add(sum(terms) <= cap_units)
    for g in fixed:
        moving = [e for e in cur[g] if e in options]
        if moving:
            const = sum(int(round(w[e] / cnt[e] * unit)) for e in cur[g] if e not in options)
            m.Add(const + sum(int(round(w[e] / k * unit)) * y for e in moving for k, y in options[e]) <= cap_units)
    m.Maximize(sum(x[e, g] for g in free for e in set(prev[g].tolist()) if (e, g) in x))
    for g in free:
        for e in cand:
            m.AddHint(x[e, g], int(e in cur[g]))
    for e in cand:
        for k, y in options[e]:
            m.AddHint(y, int(cnt[e] == k))
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit
    solver.parameters.num_workers = 2
    if solver.Solve(m) not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    out = cur.copy()
    for g in free:
        held = [e for e in cand if solver.Value(x[e, g])]
        stay = {e: list(prev[g]).index(e) for e in held if e in prev[g]}
        incoming = iter(e for e in held if e not in stay)
        out[g] = [prev[g, s] if prev[g, s] in stay else next(incoming) for s in range(S)]
    return out


def _gpu_loads(w: np.ndarray, phy: np.ndarray) -> np.ndarray:
    return (w / np.bincount(phy.ravel(), minlength=w.size))[phy].sum(axis=1)


def search(
    w: np.ndarray,
    prev: np.ndarray,
    start: np.ndarray,
    limit: float,
    rounds: int,
    size: int,
    time_limit: float,
    seed: int = 0,
) -> np.ndarray:
    """``start`` ``[G, S]`` (a re-plan of ``prev`` with every gpu at most ``limit``) → a re-plan
    rewriting no more slots, by ``rounds`` of ``improve_once`` on ``size`` gpus each."""
    rng = np.random.default_rng(seed)
    G = prev.shape[0]
    size = min(size, G)
    cur, best = start.copy(), int((start != prev).sum())
    for _ in range(rounds):
        changed = np.flatnonzero((cur != prev).any(axis=1))
        a = rng.choice(changed, min(changed.size, size // 2), replace=False)
        others = np.setdiff1d(np.arange(G), a)
        load = _gpu_loads(w, cur)[others]
        p = np.exp(-(load - load.min()) / (load.std() + 1e-12))  # lighter gpus have room to take load
        b = rng.choice(others, size - a.size, replace=False, p=p / p.sum())
        new = improve_once(w, prev, cur, limit, np.sort(np.concatenate([a, b])), time_limit)
        if new is None:
            continue
        moves = int((new != prev).sum())
        if (
            moves <= best
            and _gpu_loads(w, new).max() <= limit * (1 + 1e-6)
            and (np.bincount(new.ravel(), minlength=w.size) >= 1).all()
        ):
            cur, best = new, moves
    return cur


def run(scale: str, sigma: float, layers: int, rounds: int, size: int, time_limit: float) -> dict:
    topo = SCALES[scale]
    seq = drift(make_loads("lognormal-1.0", topo), sigma, 2)
    prev = eplb.rebalance(seq[0], topo, "global").placement
    ours = eplb.rebalance(seq[1], topo, "global", previous=prev, tolerance=0.01, layer_tolerance=0.05)
    G, S = topo.num_gpus, topo.slots_per_gpu
    rows = []
    for layer in range(min(layers, topo.num_layers)):
        w = seq[1][layer]
        p = prev.phy2log[layer].reshape(G, S)
        start = ours.placement.phy2log[layer].reshape(G, S)
        limit = float(ours.gpu_load[layer].max())
        t0 = time.perf_counter()
        found = search(w, p, start, limit, rounds, size, time_limit, seed=layer)
        items = (w / prev.logcnt[layer])[prev.phy2log[layer]].reshape(1, G, S)
        floor = float(floor_at(items, np.array([limit]))[0])
        rows.append(
            {
                "layer": layer,
                "ours": int((start != p).sum()),
                "search": int((found != p).sum()),
                "floor": floor,
                "seconds": time.perf_counter() - t0,
            }
        )
    return {"scale": scale, "sigma": sigma, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", default="kimi-64")
    ap.add_argument("--sigmas", default="0.05,0.2")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--size", type=int, default=16)
    ap.add_argument("--time-limit", type=float, default=2.0)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    out = [
        run(args.scale, float(s), args.layers, args.rounds, args.size, args.time_limit) for s in args.sigmas.split(",")
    ]
    slots = SCALES[args.scale].num_slots
    print(
        "| scale | drift | layers | ours | after search | floor, counts kept | ours / search | search, share of slots | s per layer |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in out:
        rs = r["rows"]
        ours, found = sum(x["ours"] for x in rs), sum(x["search"] for x in rs)
        floor = sum(x["floor"] for x in rs)
        print(
            f"| {r['scale']} | {r['sigma']} | {len(rs)} | {ours} | {found} | {floor:.0f} | {ours / max(found, 1):.3f} | "
            f"{100 * found / (slots * len(rs)):.1f} % | {np.mean([x['seconds'] for x in rs]):.0f} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
