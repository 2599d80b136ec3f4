"""``eplb calibrate``: measure what one gpu's MoE layer costs on this GPU and fit ``eplb.kernel``'s model.

A gpu's layer is run as the engines run it: its slot set's tokens as one ``[T, hidden]`` bf16
matrix, one grouped GEMM for gate+up (``torch._grouped_mm`` with per-expert row offsets), SwiGLU,
one grouped GEMM for down. Each sample is captured in a CUDA graph that runs it ``R`` times over
different weight copies (so the weights come from HBM, not L2), replayed, and timed with CUDA
events; the median over replays, divided by ``R``, is the sample's time.

Training samples are homogeneous sets (k slots of n tokens, some with empty slots); held-out
samples are random heterogeneous sets the fit never sees, and the fit's error on them is reported.
torch is imported here only (the library stays numpy).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from eplb import kernel

from .args import OneLineParser

# Expert shapes (hidden, intermediate) of the models the issue names.
SHAPES: dict[str, tuple[int, int]] = {
    "deepseek-v3": (7168, 2048),
    "qwen3-235b-a22b": (4096, 1536),
    "qwen3-30b-a3b": (2048, 768),
}
MAX_SLOTS = 32
MAX_TOKENS = 16384


@dataclass(frozen=True)
class Shape:
    hidden: int
    intermediate: int
    dtype: str = "bfloat16"

    @property
    def expert_bytes(self) -> int:
        return 3 * self.hidden * self.intermediate * 2


def training_sets(shape: Shape, row_cap: int) -> list[np.ndarray]:
    """Homogeneous sets: k slots of n tokens each, and the same with every other slot empty."""
    ns = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 2048, 4096, 8192, 16384]
    out = []
    for k in (1, 2, 4, 8, 16, 32):
        for n in ns:
            if k * n <= row_cap:
                out.append(np.full(k, n, dtype=np.int64))
            if k >= 4 and n in (1, 4, 16, 64, 256, 1024) and k * n <= row_cap:
                half = np.full(k, n, dtype=np.int64)
                half[1::2] = 0
                out.append(half)
    return out


def heldout_sets(count: int, row_cap: int, seed: int = 1) -> list[np.ndarray]:
    """Random heterogeneous sets: 1-32 slots, token counts lognormal about a random scale, some empty."""
    rng = np.random.default_rng(seed)
    out = []
    while len(out) < count:
        k = int(rng.integers(1, MAX_SLOTS + 1))
        scale = 10 ** rng.uniform(0, 3.6)
        n = np.round(scale * rng.lognormal(0, 1.0, k)).astype(np.int64)
        n[rng.random(k) < rng.uniform(0, 0.5)] = 0
        n = np.minimum(n, MAX_TOKENS)
        if 0 < n.sum() <= row_cap:
            out.append(n)
    return out


class Timer:
    """Times slot sets of one expert shape on one CUDA device (one weight pool, reused)."""

    def __init__(self, shape: Shape, *, device: str = "cuda", replays: int = 7, row_cap: int = 1 << 17) -> None:
        import torch

        self.torch = torch
        self.shape = shape
        self.device = torch.device(device)
        self.replays = replays
        props = torch.cuda.get_device_properties(self.device)
        self.l2 = int(getattr(props, "L2_cache_size", 50 << 20))
        self.gpu = props.name
        h, i = shape.hidden, shape.intermediate
        dt = getattr(torch, shape.dtype)
        # Enough distinct experts that R rotations of the largest set never repeat one, and
        # at least 4x L2 of weights for the smallest sets.
        self.pool = max(2 * MAX_SLOTS, math.ceil(4 * self.l2 / shape.expert_bytes))
        g = torch.Generator(device=self.device).manual_seed(0)
        # Stored [E, N, K] and used transposed: the column-major B that the grouped GEMM takes.
        self.w13 = (torch.randn(self.pool, 2 * i, h, device=self.device, dtype=dt, generator=g) * 0.02).transpose(
            -2, -1
        )
        self.w2 = (torch.randn(self.pool, h, i, device=self.device, dtype=dt, generator=g) * 0.02).transpose(-2, -1)
        self.row_cap = row_cap
        self.x = torch.randn(row_cap, h, device=self.device, dtype=dt, generator=g) * 0.5
        self.kernel = self._choose_kernel()

    def _grouped(self, x, w, offs):  # noqa: ANN001
        return self.torch._grouped_mm(x, w, offs=offs)

    def _choose_kernel(self) -> str:
        torch = self.torch
        try:
            offs = torch.tensor([3, 3, 20], device=self.device, dtype=torch.int32)
            y = self._grouped(self.x[:20], self.w13[:3], offs)
            ref = self.x[3:20] @ self.w13[2]
            if not torch.allclose(y[3:20].float(), ref.float(), atol=0.05, rtol=0.05):
                raise RuntimeError("torch._grouped_mm disagrees with a plain matmul")
            return f"torch._grouped_mm (torch {torch.__version__})"
        except (AttributeError, RuntimeError, TypeError) as exc:
            print(f"torch._grouped_mm not usable here ({exc}); timing a per-expert loop", file=sys.stderr)
            return f"per-expert torch.mm loop (torch {torch.__version__})"

    def _layer(self, counts: np.ndarray, start: int) -> None:
        torch = self.torch
        k = counts.size
        rows = int(counts.sum())
        x = self.x[:rows]
        w13 = self.w13[start : start + k]
        w2 = self.w2[start : start + k]
        i = self.shape.intermediate
        if self.kernel.startswith("torch._grouped_mm"):
            offs = self._offs[k]
            h = self._grouped(x, w13, offs)
            a = torch.nn.functional.silu(h[:, :i]) * h[:, i:]
            self._grouped(a, w2, offs)
        else:
            lo = 0
            for e, n in enumerate(counts.tolist()):
                if n:
                    h = x[lo : lo + n] @ w13[e]
                    (torch.nn.functional.silu(h[:, :i]) * h[:, i:]) @ w2[e]
                    lo += n

    def time(self, counts: np.ndarray) -> float:
        """``counts``: ``[k]`` tokens per slot → microseconds of one layer (0 with no tokens)."""
        torch = self.torch
        counts = np.asarray(counts, dtype=np.int64)
        if counts.sum() == 0:
            return 0.0
        if counts.sum() > self.row_cap or counts.size > MAX_SLOTS:
            raise ValueError(f"a slot set of {counts.size} slots and {counts.sum()} tokens is over this timer's caps")
        k = counts.size
        per_call = k * self.shape.expert_bytes
        reps = int(min(16, max(2, math.ceil(3 * self.l2 / per_call)), self.pool // k))
        self._offs = {k: torch.tensor(np.cumsum(counts), device=self.device, dtype=torch.int32)}
        starts = [(r * k) % (self.pool - k + 1) for r in range(reps)]
        s = torch.cuda.Stream(self.device)
        s.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(s):
            for st in starts[:2]:
                self._layer(counts, st)
        torch.cuda.current_stream(self.device).wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for st in starts:
                self._layer(counts, st)
        graph.replay()
        times = []
        for _ in range(self.replays):
            a = torch.cuda.Event(enable_timing=True)
            b = torch.cuda.Event(enable_timing=True)
            a.record()
            graph.replay()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1000.0 / reps)
        del graph
        return float(np.median(times))


def calibrate(
    shape: Shape, *, heldout: int = 60, row_cap: int | None = None, device: str = "cuda", progress: bool = True
) -> dict:
    """Measure, fit and check: ``{"model": KernelModel, "train": [...], "heldout": [...]}``."""
    if row_cap is None:
        # Bound a sample's work: ~64k rows of DeepSeek-V3's expert is ~60 ms a layer.
        row_cap = 1 << 17 if shape.hidden <= 4096 else 1 << 16
    timer = Timer(shape, device=device, row_cap=row_cap)
    train = training_sets(shape, row_cap)
    held = heldout_sets(heldout, row_cap)
    t0 = time.perf_counter()
    measured = {}
    for name, sets in (("train", train), ("heldout", held)):
        us = []
        for j, n in enumerate(sets):
            us.append(timer.time(n))
            if progress and (j + 1) % 40 == 0:
                print(f"  {name}: {j + 1}/{len(sets)} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
        measured[name] = np.array(us)
    labels = dict(
        gpu=timer.gpu, kernel=timer.kernel, hidden=shape.hidden, intermediate=shape.intermediate, dtype=shape.dtype
    )
    model = kernel.fit(train, measured["train"], **labels)
    err = kernel.fit_error(model, held, measured["heldout"])
    model = kernel.KernelModel(**{**model.__dict__, "heldout": err})
    return {
        "model": model,
        "train": [(n.tolist(), float(u)) for n, u in zip(train, measured["train"])],
        "heldout": [(n.tolist(), float(u)) for n, u in zip(held, measured["heldout"])],
        "seconds": time.perf_counter() - t0,
    }


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(
        prog="eplb calibrate",
        description="Measure one gpu's MoE layer (grouped GEMMs, SwiGLU, bf16) on this GPU over slot sets and "
        "token counts, fit the kernel model the planner uses and print its error on held-out slot sets.",
    )
    ap.add_argument("--shape", choices=sorted(SHAPES), help="a known expert shape (or --hidden and --intermediate)")
    ap.add_argument("--hidden", type=int)
    ap.add_argument("--intermediate", type=int)
    ap.add_argument("--heldout", type=int, default=60, help="random held-out slot sets [60]")
    ap.add_argument("--out", type=Path, help="write the model (and every sample) to this .json")
    args = ap.parse_args(argv)
    if args.shape:
        h, i = SHAPES[args.shape]
    elif args.hidden is not None and args.intermediate is not None:
        h, i = args.hidden, args.intermediate
    else:
        ap.error("give --shape, or --hidden and --intermediate")
    if min(h, i) < 16 or h % 8 or i % 8:
        ap.error(f"--hidden ({h}) and --intermediate ({i}) must be multiples of 8, >= 16")
    if args.heldout < 4:
        ap.error(f"--heldout must be at least 4 slot sets, got {args.heldout}")
    if args.out and not os.access(args.out.parent if str(args.out.parent) else Path("."), os.W_OK):
        ap.error(f"--out {args.out}: its folder is not writable (checked before the measurement)")
    try:
        import torch
    except ImportError:
        print("eplb calibrate: needs torch with CUDA (pip install torch)", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("eplb calibrate: no CUDA device: the model is of this GPU's kernels, so it needs one", file=sys.stderr)
        return 2
    res = calibrate(Shape(h, i), heldout=args.heldout)
    m = res["model"]
    print(
        f"{m.gpu}, {m.kernel}, hidden {h}, intermediate {i}: call {m.call_us:.1f} us + per activated expert "
        f"{m.expert_us:.2f} us + {m.tile_us:.3f} us per {m.tile}-row tile + {m.token_us:.4f} us per token"
    )
    e = m.heldout
    print(f"held-out slot sets ({e['n']}): |error| median {e['median']:.1%}, p90 {e['p90']:.1%}, max {e['max']:.1%}")
    print(f"measured in {res['seconds']:.0f} s")
    if args.out:
        d = json.loads(m.to_json())
        d["samples"] = {"train": res["train"], "heldout": res["heldout"]}
        args.out.write_text(json.dumps(d))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
