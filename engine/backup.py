"""``HostExpertBackup``: pinned host copies of the experts a rank may have to restore.

When a gpu dies, an expert whose only replica was there has no live source; the survivor that
gets it in the survivor placement loads it through ``WeightMover``'s ``restore(layer, expert)``.
Reading it from the checkpoint takes seconds; a pinned host copy is one host-to-device copy.
``HostExpertBackup`` is that loader: it keeps pinned copies of the experts ``at_risk`` names
(every replica on one other gpu: lost if that gpu fails), hottest first, within a byte
budget, and passes anything else to the engine's own ``source`` (the checkpoint).

Each rank backs up what it could be asked to restore, which the survivor plan decides only
after the failure; ``at_risk(placement, gpu, share=(i, n))`` splits the at-risk experts of the
other gpus over ``n`` ranks so that the ranks together hold each one once (``n = 1``: every
rank holds every one, within its budget).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import numpy as np
import torch

import eplb
from eplb import checks

__all__ = ["HostExpertBackup", "at_risk"]

Source = Callable[[int, int], Mapping[str, torch.Tensor]]


def at_risk(
    placement: eplb.Placement,
    gpu: int | None = None,
    loads: np.ndarray | None = None,
    share: tuple[int, int] = (0, 1),
) -> list[tuple[int, int]]:
    """``placement`` ``[L, P]`` → ``(layer, expert)`` pairs whose every replica is on one gpu
    (lost if that gpu fails), not ``gpu`` (None: any), hottest first by ``loads`` ``[L, E]`` (None: layer, expert order);
    ``share=(i, n)``: every ``n``-th of them from the ``i``-th."""
    i, n = share
    if not (checks.is_int(n) and checks.is_int(i) and 0 <= int(i) < int(n)):
        raise ValueError(f"share must be (i, n) with 0 <= i < n, got {share!r}")
    l2p = placement.log2phy  # [L, E, R], -1 padded
    S = placement.topology.slots_per_gpu
    home = l2p[:, :, 0] // S
    # Every replica on one gpu (one replica, or several on the same gpu): lost with that gpu.
    one_gpu = ((l2p // S == home[:, :, None]) | (l2p < 0)).all(axis=2) & (l2p[:, :, 0] >= 0)
    if gpu is not None:
        one_gpu &= home != gpu
    lay, exp = np.nonzero(one_gpu)
    order = np.lexsort((exp, lay)) if loads is None else np.lexsort((exp, lay, -np.asarray(loads)[lay, exp]))
    pairs = [(int(a), int(b)) for a, b in zip(lay[order], exp[order])]
    return pairs[i::n]


class HostExpertBackup:
    """A ``restore`` loader for ``WeightMover``: pinned host copies of chosen experts, the rest
    from ``source(layer, expert) -> {name: tensor}`` (the checkpoint, one slot's tensors).

    ``budget_bytes``: host bytes the copies may take. ``keep(pairs)`` makes the backup hold
    those experts (in order, until the budget is spent; what it held and is no longer asked
    for is dropped); ``pin``: page-locked memory (default: when CUDA is available), which the
    host-to-device copy needs for full speed. ``hits`` / ``misses``: restores served from the
    copies / passed to ``source``; ``held_bytes``: host bytes in use.
    """

    def __init__(self, source: Source, budget_bytes: int, *, pin: bool | None = None) -> None:
        self.source, self.budget_bytes = source, checks.nonneg_int("budget_bytes", budget_bytes)
        self.pin = torch.cuda.is_available() if pin is None else pin
        self._held: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        self.held_bytes = 0
        self.hits = self.misses = 0

    def keep(self, pairs: Iterable[tuple[int, int]]) -> int:
        """Holds the experts ``pairs`` (in order) within the budget; returns how many it holds."""
        wanted = [(int(a), int(b)) for a, b in pairs]
        keep = set(wanted)
        for key in [k for k in self._held if k not in keep]:
            self.held_bytes -= _nbytes(self._held.pop(key))
        for key in wanted:
            if key in self._held:
                continue
            got = self.source(*key)
            size = sum(t.numel() * t.element_size() for t in got.values())
            if self.held_bytes + size > self.budget_bytes:
                break
            self._held[key] = {name: self._host(t) for name, t in got.items()}
            self.held_bytes += size
        return len(self._held)

    def _host(self, t: torch.Tensor) -> torch.Tensor:
        out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=self.pin)
        out.copy_(t)
        return out

    def __contains__(self, key: tuple[int, int]) -> bool:
        return key in self._held

    def __call__(self, layer: int, expert: int) -> Mapping[str, torch.Tensor]:
        held = self._held.get((layer, expert))
        if held is not None:
            self.hits += 1
            return held
        self.misses += 1
        return self.source(layer, expert)


def _nbytes(tensors: Mapping[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())
