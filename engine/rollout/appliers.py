"""What a rank does to its weights during a rollout: the ``Applier`` protocol, its chunked
form, and ``MoverApplier`` over ``WeightMover``'s staged mode."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import eplb

__all__ = ["DEFAULT_STAGING_BYTES", "Applier", "ChunkedApplier", "MoverApplier"]

# MoverApplier's receive-buffer budget: 1 GiB holds 24 DeepSeek-V3 experts (44 MB), at least
# two layers of a full re-plan (9 slots a layer per gpu); a small model fits in one chunk.
DEFAULT_STAGING_BYTES = 1 << 30


class Applier(Protocol):
    """What a rank does to its weights; ``WeightMover``-backed appliers live in the engine.
    It moves whole versions (one chunk of every layer) unless it is a ``ChunkedApplier``."""

    def prepare(self, old: eplb.Placement, new: eplb.Placement) -> None:
        """Moves this rank's weights for ``new`` (on the rollout's worker thread) without
        disturbing any slot ``old`` routes to; raises on failure."""

    def commit(self) -> None:
        """Makes the prepared weights live (at the switch step, on the step thread)."""

    def rollback(self) -> None:
        """Drops whatever the prepare in flight did; the layers not yet committed keep the
        weights ``old`` routes to."""


@runtime_checkable
class ChunkedApplier(Applier, Protocol):
    """An applier that switches a version in chunks of layers: ``prepare`` prepares chunk 0
    and sets ``chunks`` (the layers of each chunk, the same on every rank), each ``commit``
    makes one chunk live, ``prepare_next`` prepares the chunk after the last committed one.
    ``Rollout`` tells one apart by these two members (``isinstance``), once, at construction."""

    chunks: tuple[tuple[int, ...], ...]

    def prepare_next(self) -> None:
        """Prepares the chunk after the last committed one (on the rollout's worker)."""


class MoverApplier:
    """An ``Applier`` over ``WeightMover``'s staged mode, in chunks of layers whose receive
    buffers fit ``staging_bytes`` (``DEFAULT_STAGING_BYTES``; ``None``: one chunk, every
    incoming expert of the transition held at once): ``prepare`` makes a mover for the
    transition and receives chunk 0's incoming experts into its buffers (live slots only
    read), ``commit`` writes the chunk's live slots within each gpu, ``prepare_next``
    receives the next chunk into the same buffers, ``rollback`` drops them.

    ``layers``: this rank's tensors per layer (``WeightMover``'s ``layers``); ``group``: the
    process group the mover talks through. With the service barrier the ranks start preparing
    at different moments, so give the mover a group of its own (``dist.new_group()``): its
    transfers then wait for the late ranks without holding up the engine's collectives.
    ``mover_options``: other ``WeightMover`` keywords (``layers_per_call``, ``verify``, ...).
    After a version switched, ``schedule`` and ``report`` (summed over its chunks) describe
    the move (with ``verify=True``, ``report.mismatches`` lists slots whose checksum differs
    from the source's); ``commit_seconds`` is the longest ``commit()``, the stall of one step.
    """

    def __init__(
        self,
        layers: object,
        group: object = None,
        *,
        staging_bytes: int | None = DEFAULT_STAGING_BYTES,
        **mover_options: object,
    ) -> None:
        self.layers, self.group, self.staging_bytes, self.options = layers, group, staging_bytes, mover_options
        self.mover = None
        self.schedule = None
        self.chunks: tuple[tuple[int, ...], ...] = ()
        self.report = None
        self.commit_seconds = 0.0
        self.staged_bytes = 0  # receive-buffer bytes of the last mover

    def prepare(self, old: eplb.Placement, new: eplb.Placement) -> None:
        # Imported here: the mover needs torch, and importing eplb_engine.rollout must not.
        from ..mover import WeightMover

        self.mover = WeightMover(self.layers, old, new, self.group, staging_bytes=self.staging_bytes, **self.options)
        self.schedule = self.mover.schedule
        self.chunks = tuple(tuple(chunk) for chunk in self.mover.chunks)  # ValueError: a layer does not fit
        self.staged_bytes = self.mover.staging_bytes_needed("staged")
        self._reports = []
        self._commits = []
        self.prepare_next()

    def prepare_next(self) -> None:
        while self.mover.prepare():
            pass
        # PREPARED is acked after this returns: the received weights must have landed, and a
        # transfer that failed must fail here (rolled back), not at commit() on the step thread.
        self.mover.synchronize()

    def commit(self) -> None:
        start = time.perf_counter()
        self._reports.append(self.mover.commit())
        self._commits.append(time.perf_counter() - start)
        if self.mover.done:
            self.report = _sum_reports(self._reports)
            self.commit_seconds = max(self._commits)
            self.mover = None

    def rollback(self) -> None:
        if self.mover is not None:
            self.mover.rollback()
        self.mover = None


def _sum_reports(reports: Sequence[object]) -> object:
    from ..mover import MoveReport

    return MoveReport(
        layers=tuple(layer for r in reports for layer in r.layers),
        received_bytes=sum(r.received_bytes for r in reports),
        sent_bytes=sum(r.sent_bytes for r in reports),
        local_copy_bytes=sum(r.local_copy_bytes for r in reports),
        checked_slots=sum(r.checked_slots for r in reports),
        mismatches=tuple(m for r in reports for m in r.mismatches),
        restored=sum(r.restored for r in reports),
        restored_bytes=sum(r.restored_bytes for r in reports),
    )
