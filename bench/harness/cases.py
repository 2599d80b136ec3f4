"""The benchmarks' case tables: ``default_bench``'s target table (``cases``, also read by
``pair_optimum``) and the ``--cases``/``--list`` choice every table-driven bench shares
(``select``)."""

from __future__ import annotations

import argparse
from collections.abc import Callable

import numpy as np

import eplb
from eplb.workloads import SCALES, lognormal, make_loads, zipf

from .shapes import SHAPES, make_shape


def hot_mix(num_layers: int, num_experts: int, seed: int = 0) -> np.ndarray:
    """``[L, E]``: lognormal(1.0) loads with four experts per layer taking 3-5 % of it each."""
    rng = np.random.default_rng(seed)
    x = rng.lognormal(0.0, 1.0, (num_layers, num_experts))
    x /= x.sum(axis=1, keepdims=True)
    hot = np.argsort(rng.random((num_layers, num_experts)), axis=1)[:, :4]
    share = rng.uniform(0.03, 0.05, (num_layers, 4))
    x *= 1 - share.sum(axis=1, keepdims=True)
    np.put_along_axis(x, hot, np.take_along_axis(x, hot, axis=1) + share, axis=1)
    return x * (1 << 20)


Case = tuple[eplb.Topology, np.ndarray, str]


def cases(seed: int = 0) -> dict[str, Callable[[], Case]]:
    """Name → a loader of (topology, loads ``[L, E]``, policy); ``seed`` shifts every case's
    seed. Loaders, so that a run draws only the loads it measures (the routing-count rows take
    seconds to sample)."""
    out: dict[str, Callable[[], Case]] = {}

    def scaled(scale: str, workload: str, policy: str = "global") -> Callable[[], Case]:
        return lambda: (SCALES[scale], make_loads(workload, SCALES[scale], seed), policy)

    for scale in ("v3-64", "v3-prefill"):
        out[f"{scale} group-limited"] = scaled(scale, "group-limited")
    out["v3-512 zipf-1.0"] = scaled("v3-512", "zipf-1.0")
    for scale in ("v3-prefill", "v3-64", "qwen3-64", "kimi-64"):
        out[f"{scale} zipf-1.5"] = scaled(scale, "zipf-1.5")
    out["v3-prefill lognormal-1.0 auto"] = scaled("v3-prefill", "lognormal-1.0", "auto")
    L = 58
    for E, P, G in ((128, 256, 128), (256, 512, 256), (256, 384, 192)):
        t = eplb.Topology(L, E, P, G)
        tag = f"{E}e/{G}gpu/{P // G}spg"
        draws = {
            "zipf-0.8": lambda E=E: zipf(L, E, 0.8, 11 + seed),
            "zipf-1.0": lambda E=E: zipf(L, E, 1.0, 12 + seed),
            "zipf-1.2": lambda E=E: zipf(L, E, 1.2, 13 + seed),
            "lognormal-1.0": lambda E=E: lognormal(L, E, 1.0, 14 + seed),
            "lognormal-1.5": lambda E=E: lognormal(L, E, 1.5, 15 + seed),
            "hot-mix": lambda E=E: hot_mix(L, E, 16 + seed),
        }
        for kind, draw in draws.items():
            out[f"{tag} {kind}"] = lambda t=t, draw=draw: (t, draw(), "global")
    # The realistic large decode deployment at full depth: a Qwen3-235B-like model (94 layers,
    # 128 experts, top-8) on 128 gpus with two slots each, routing counts of 16k-token windows
    # (eplb_bench.harness.shapes).
    t = eplb.Topology(94, 128, 256, 128)

    def counts(shape: str) -> Callable[[], Case]:
        return lambda: (t, make_shape(SHAPES[shape], 94, 128, seed=1 + seed).astype(np.float64), "global")

    for shape in ("mixed 16k", "zipf1.0 16k", "dead15 logn1.0 16k"):
        out[f"q235-94L/128gpu {shape}"] = counts(shape)
    return out


def select(ap: argparse.ArgumentParser, table: dict, chosen: str | None, list_only: bool) -> list[str] | None:
    """The case names a bench run measures: ``chosen`` (comma separated) or all of ``table``;
    ``None`` after printing them for ``--list``; an unknown name is the parser's error."""
    if list_only:
        print("\n".join(table))
        return None
    names = list(table) if not chosen else chosen.split(",")
    unknown = [n for n in names if n not in table]
    if unknown:
        ap.error(f"unknown case(s) {unknown}; --list shows the names")
    return names
