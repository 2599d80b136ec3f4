"""What one gpu's MoE layer costs in kernel time, as a function of its slots' token counts.

A gpu runs its slot set as one grouped GEMM per projection (gate+up, then down). Measured on an
H100 (``eplb calibrate``; no H200 model is shipped yet), its time is close to a sum over the slots that got tokens::

    gpu_us(n[slots]) = call_us * any(n > 0)
                     + sum over n_s > 0 of (expert_us + tile_us * ceil(n_s / tile) + token_us * n_s)

``expert_us`` is the weight read an activated expert costs (the whole of its time at decode batch
sizes), ``tile_us`` the work of one tile of ``tile`` rows (the steps that decide at prefill
sizes), ``call_us`` the fixed cost of the launches. A plain curve for one expert (``Curve``:
``(tokens, microseconds)`` points) is the simple form: a gpu costs the sum of its slots' values,
interpolated.

Both answer ``slot_us(n)`` (``[...]`` token counts → ``[...]`` microseconds, 0 for no tokens) and
``call_us``; the planner (``eplb.timing``) needs nothing else. ``fit`` makes a ``KernelModel``
from measured slot sets; ``shipped()`` lists the models measured for common shapes, loaded with
``load(name)``.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import asdict, dataclass, field
from importlib import resources
from typing import Any

import numpy as np

from . import checks

__all__ = ["KernelModel", "Curve", "CostModel", "fit", "fit_error", "shipped", "load", "as_cost_model", "TILES"]

# Row tiles the fit tries: the M-tile sizes of Hopper grouped GEMM kernels (CUTLASS and Triton
# configurations use 64 or 128; smaller ones for decode-tuned configs).
TILES = (16, 32, 64, 128, 256)
"""Row tiles ``fit`` tries: the M-tile sizes of Hopper grouped GEMM kernels."""


@dataclass(frozen=True)
class KernelModel:
    """A gpu's MoE layer time: ``call_us`` once if any slot has tokens, and per slot with
    ``n > 0`` tokens ``expert_us + tile_us * ceil(n / tile) + token_us * n`` (microseconds).

    ``gpu``, ``kernel``, ``hidden``, ``intermediate`` and ``dtype`` say what was measured;
    ``heldout`` the fit's relative error on slot sets it was not fitted on (``median``, ``p90``,
    ``max``).
    """

    call_us: float
    expert_us: float
    tile_us: float
    tile: int
    token_us: float = 0.0
    gpu: str = ""
    kernel: str = ""
    hidden: int = 0
    intermediate: int = 0
    dtype: str = ""
    heldout: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("call_us", "expert_us", "tile_us", "token_us"):
            checks.nonneg_number(f"KernelModel.{name}", getattr(self, name), finite=True)
        checks.positive_int("KernelModel.tile", self.tile)
        if self.expert_us + self.tile_us + self.token_us <= 0:
            raise ValueError("KernelModel: expert_us, tile_us and token_us are all 0: a slot would cost nothing")

    def slot_us(self, n: np.ndarray) -> np.ndarray:
        """``n``: ``[...]`` tokens of a slot → ``[...]`` microseconds (0 where ``n == 0``)."""
        n = np.asarray(n, dtype=np.float64)
        cost = self.expert_us + self.tile_us * np.ceil(n / self.tile) + self.token_us * n
        return np.where(n > 0, cost, 0.0)

    def gpu_us(self, counts: np.ndarray) -> np.ndarray:
        """``counts``: ``[..., slots]`` tokens per slot → ``[...]`` microseconds of that gpu."""
        counts = np.asarray(counts)
        return self.slot_us(counts).sum(axis=-1) + self.call_us * (counts > 0).any(axis=-1)

    def to_json(self) -> str:
        return json.dumps({"kind": "kernel-model", **asdict(self)}, indent=1)

    @staticmethod
    def from_dict(d: dict[str, Any]) -> KernelModel:
        d = {k: v for k, v in d.items() if k != "kind" and k != "samples"}
        try:
            return KernelModel(**d)
        except TypeError as exc:
            raise ValueError(f"not a kernel model: {exc}") from None


@dataclass(frozen=True)
class Curve:
    """One expert's time at ``tokens`` (``[K]`` increasing, >= 1) is ``us`` (``[K]`` >= 0);
    linear between the points and beyond the last one (by the last segment's slope), 0 at 0
    tokens. A gpu costs the sum over its slots (``call_us`` is 0)."""

    tokens: np.ndarray
    us: np.ndarray
    call_us: float = 0.0

    def __post_init__(self) -> None:
        t = np.asarray(self.tokens, dtype=np.float64)
        u = np.asarray(self.us, dtype=np.float64)
        if t.ndim != 1 or u.shape != t.shape or t.size < 1:
            raise ValueError(
                f"a kernel curve is (tokens [K], microseconds [K]) of one length >= 1; got shapes {list(t.shape)} and {list(u.shape)}"
            )
        if not (np.isfinite(t).all() and np.isfinite(u).all()) or (u < 0).any() or (t < 1).any():
            raise ValueError("a kernel curve's tokens must be finite and >= 1, its microseconds finite and >= 0")
        if (np.diff(t) <= 0).any():
            raise ValueError("a kernel curve's tokens must be strictly increasing")
        if (np.diff(u) < 0).any() or u[-1] <= 0:
            raise ValueError(
                "a kernel curve's microseconds must not fall as tokens grow and must end above 0 "
                "(it is extended past its last point by its last slope)"
            )
        object.__setattr__(self, "tokens", t)
        object.__setattr__(self, "us", u)

    def slot_us(self, n: np.ndarray) -> np.ndarray:
        n = np.asarray(n, dtype=np.float64)
        t, u = self.tokens, self.us
        out = np.interp(n, t, u, left=u[0])
        if t.size > 1:
            slope = (u[-1] - u[-2]) / (t[-1] - t[-2])
            out = np.where(n > t[-1], u[-1] + slope * (n - t[-1]), out)
        return np.where(n > 0, out, 0.0)

    def gpu_us(self, counts: np.ndarray) -> np.ndarray:
        return self.slot_us(counts).sum(axis=-1)


CostModel = KernelModel | Curve
"""What the planner takes as ``kernel_curve``: a ``KernelModel`` or a ``Curve``."""


def as_cost_model(curve: object) -> CostModel:
    """``kernel_curve=`` as given to ``rebalance``: a ``KernelModel``, a ``Curve``, a shipped
    model's name, or a ``(tokens, microseconds)`` pair of arrays."""
    if isinstance(curve, (KernelModel, Curve)):
        return curve
    if isinstance(curve, str):
        return load(curve)
    if isinstance(curve, tuple) and len(curve) == 2:
        return Curve(np.asarray(curve[0]), np.asarray(curve[1]))
    raise ValueError(
        "kernel_curve must be an eplb.kernel.KernelModel, a shipped model's name "
        f"({', '.join(shipped()) or 'none shipped'}) or a (tokens, microseconds) pair of arrays; got {type(curve).__name__}"
    )


def _features(sets: list[np.ndarray], tile: int) -> np.ndarray:
    """``sets``: slot token counts of each sample → ``[S, 4]``: launch, activated experts, tiles, tokens."""
    rows = []
    for n in sets:
        n = np.asarray(n, dtype=np.float64)
        act = n > 0
        rows.append([float(act.any()), act.sum(), np.ceil(n[act] / tile).sum(), n.sum()])
    return np.array(rows)


def _nnls(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with coefficients >= 0 over 4 columns: the best of every column subset
    (16 small solves; exact, and no solver to depend on)."""
    best, best_err = np.zeros(a.shape[1]), np.inf
    for k in range(1, a.shape[1] + 1):
        for cols in itertools.combinations(range(a.shape[1]), k):
            c, *_ = np.linalg.lstsq(a[:, cols], y, rcond=None)
            if (c < 0).any():
                continue
            err = float(((a[:, cols] @ c - y) ** 2).sum())
            if err < best_err:
                best = np.zeros(a.shape[1])
                best[list(cols)] = c
                best_err = err
    return best


def fit(sets: list[np.ndarray], us: np.ndarray, *, tiles: tuple[int, ...] = TILES, **labels: Any) -> KernelModel:
    """``sets``: ``S`` arrays of slot token counts, ``us``: ``[S]`` measured microseconds →
    the ``KernelModel`` of least relative squared error (coefficients >= 0), over ``tiles``.
    ``labels`` (``gpu``, ``kernel``, ``hidden``, ...) are stored on the model."""
    us = np.asarray(us, dtype=np.float64)
    keep = np.array([np.asarray(n).sum() > 0 for n in sets]) & (us > 0)
    sets = [n for n, k in zip(sets, keep) if k]
    us = us[keep]
    if len(sets) < 4:
        raise ValueError(f"fit needs at least 4 measured slot sets with tokens, got {len(sets)}")
    best: tuple[float, KernelModel] | None = None
    for tile in tiles:
        a = _features(sets, tile) / us[:, None]  # relative error: each sample weighs alike
        c = _nnls(a, np.ones_like(us))
        if c[1] + c[2] + c[3] <= 0:
            continue
        model = KernelModel(float(c[0]), float(c[1]), float(c[2]), int(tile), float(c[3]), **labels)
        err = float(np.sqrt(np.mean((model_us(model, sets) / us - 1) ** 2)))
        if best is None or err < best[0]:
            best = (err, model)
    if best is None:
        raise ValueError("no tile gave a model with a positive per-slot cost")
    return best[1]


def model_us(model: CostModel, sets: list[np.ndarray]) -> np.ndarray:
    """``S`` slot sets → ``[S]`` the model's microseconds."""
    return np.array([float(model.gpu_us(np.asarray(n))) for n in sets])


def fit_error(model: CostModel, sets: list[np.ndarray], us: np.ndarray) -> dict[str, Any]:
    """Relative error of ``model`` on measured ``sets``: ``{"median", "p90", "max", "n"}``
    of ``|predicted / measured - 1|`` (sets with tokens only)."""
    us = np.asarray(us, dtype=np.float64)
    keep = np.array([np.asarray(n).sum() > 0 for n in sets]) & (us > 0)
    rel = np.abs(model_us(model, [n for n, k in zip(sets, keep) if k]) / us[keep] - 1)
    return {
        "median": round(float(np.median(rel)), 4),
        "p90": round(float(np.quantile(rel, 0.9)), 4),
        "max": round(float(rel.max()), 4),
        "n": int(rel.size),
    }


_PACKAGE = "eplb.kernels"


def shipped() -> tuple[str, ...]:
    """Names of the kernel models measured and shipped with eplb (``<shape>@<gpu>``)."""
    try:
        files = resources.files(_PACKAGE)
    except ModuleNotFoundError:
        return ()
    return tuple(sorted(f.name[: -len(".json")] for f in files.iterdir() if f.name.endswith(".json")))


def load(name: str) -> KernelModel:
    """A shipped model by name (``shipped()``), e.g. ``"qwen3-30b-a3b@h100"``."""
    names = shipped()
    if name not in names:
        raise ValueError(f"no shipped kernel model {name!r}; shipped: {', '.join(names) or 'none'}")
    text = resources.files(_PACKAGE).joinpath(f"{name}.json").read_text()
    return KernelModel.from_dict(json.loads(text))
