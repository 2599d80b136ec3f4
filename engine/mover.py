"""The reference weight mover: executes ``eplb.transfer.transfer_schedule`` on this rank's tensors.

Two ways to run one old -> new transition (one mover per transition, one per rank; every
rank of the group makes the same calls in the same order):

- staged (the rollout protocol): ``prepare()`` receives the experts this rank lacks into
  receive buffers, a few layers per call, while the engine keeps serving with the old map:
  no live slot is written, sends only read live slots. ``commit()`` (at the agreed switch
  step, engine between steps) writes the live slots with copies within the gpu only: local
  moves, landings from the receive buffers, fills. ``rollback()`` drops the buffers; the
  live weights of uncommitted layers were never touched. With ``staging_bytes`` the layers
  go in **chunks** (``chunks``: consecutive layers whose receives fit the budget on every
  rank): prepare chunk k, commit it (those layers switch maps), reuse the buffers for chunk
  k + 1. Each MoE layer routes with its own map, so switching chunk by chunk is correct.
- direct (engine paused, or switching maps layer by layer): ``step()`` moves the next layers
  completely in place; a receive lands straight in its slot when nothing reads that slot's
  old content, else in the staging buffer, which is reused layer after layer.

``WeightMover`` is the face of both: its first ``prepare()`` or ``step()`` picks the mode
(``_StagedMove`` or ``_DirectMove``), and both run over one per-rank plan (``_RankPlan``: the
slot views, the schedule and this rank's work per layer, the receive buffers, the exchanges
and copies). In both, the tensors are written in place (same storage: CUDA graphs stay valid), copies
within a gpu copy each byte once (cycles through one spare slot), and on a GPU the work runs
on the mover's own CUDA stream.

**Gpus down.** A gpu whose slots are all empty (-1) in ``new`` takes no part: the group may be
the live gpus alone (rebuilt over the survivors, ``group rank i`` = the ``i``-th live gpu of
``new``) or every gpu of the topology. An expert that no live gpu held in ``old`` has no
source: ``eplb.transfer`` lists it as a restore, and the mover loads it through the engine's
``restore(layer, expert) -> {name: tensor}`` (a host copy, ``HostExpertBackup``, or the
checkpoint): in the prepare (staged) or the step (direct), kept where the loader returned it
until the slot is written, with the other copies within the gpu.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

try:
    import torch
    import torch.distributed as dist
except ImportError as exc:  # the client half of eplb_engine works without torch; the mover does not
    raise ImportError("eplb_engine's WeightMover needs torch: pip install 'eplb[engine]'") from exc

from eplb import Placement, checks
from eplb.transfer import Bandwidth, TransferSchedule, staged_chunks, transfer_schedule

from .checksum import slot_checksum
from .local_order import SPARE, order_local_copies
from .survivors import GroupMismatch
from .transport import P2P, DistTransport, Transport

__all__ = ["MoveReport", "WeightMover"]

# Below this many bytes a slot's copy is launch-bound: batch such copies into one kernel.
_SMALL_SLOT_BYTES = 1 << 20


@dataclass(frozen=True)
class MoveReport:
    """What one ``commit()`` / ``step()`` did on this rank.

    ``layers``: the layers written; ``received_bytes`` / ``sent_bytes``: peer traffic of those
    layers; ``local_copy_bytes``: bytes copied within the gpu; ``checked_slots``: slots whose
    checksum was compared with the source's (``verify=True``); ``mismatches``: ``(layer, slot)``
    pairs whose content differs from the source's; ``restored`` / ``restored_bytes``: experts
    loaded through ``restore`` (no live gpu held them) and their bytes.
    """

    layers: tuple[int, ...]
    received_bytes: int
    sent_bytes: int
    local_copy_bytes: int
    checked_slots: int = 0
    mismatches: tuple[tuple[int, int], ...] = ()
    restored: int = 0
    restored_bytes: int = 0

    @property
    def ok(self) -> bool:
        return not self.mismatches


@dataclass
class _LayerWork:
    """This rank's part of one layer, as slot indices (python ints; a layer has a few)."""

    # per round: [(peer, src_slot)] sends and [(peer, dst_slot)] receives, schedule order
    sends: list[list[tuple[int, int]]]
    recvs: list[list[tuple[int, int]]]
    copies: list[tuple[int, int]]  # (old slot, slot) copies within the gpu
    local: list[tuple[int, int]]  # the same in in-place order, SPARE = the spare slot
    fills: list[tuple[int, int]]  # (received slot, other slot needing the expert)
    read_slots: set[int]  # slots whose old content is read by a send or a local copy
    restores: list[tuple[int, int]] = field(default_factory=list)  # (expert, slot) loaded via restore
    expected: dict[int, torch.Tensor] = field(default_factory=dict)  # slot -> checksum (verify)
    launches: list = field(default_factory=list)  # (fused, dsts, srcs) built by _plan_local


class WeightMover:
    """Moves this rank's expert weights from ``old`` to ``new``, in place.

    ``layers``: this rank's tensors, one mapping per MoE layer (``L`` of them), name ->
    tensor ``[S, ...]`` with ``S = topology.slots_per_gpu`` local slots in the leading
    dimension (weights and their scales alike, e.g. ``w13 [S, 2I, H]``, ``w2 [S, H, I]``,
    ``w13_scale [S, ...]``); each name has the same shape and dtype in every layer, all
    tensors contiguous on one device. ``old``, ``new``: placements ``[L, P]`` of one
    topology. ``group``: the process group whose rank ``g`` is gpu ``g`` of the topology
    (default: the world); or ``transport`` to bring your own. With gpus down in ``new`` the
    group may hold the live gpus alone (rank ``i`` is the ``i``-th live gpu of ``new``), or
    ``gpus`` says which gpu each group rank is (every live gpu of ``new`` among them).

    ``restore(layer, expert) -> {name: tensor}``: the weights of an expert that no live gpu
    held in ``old`` (its replicas were all on gpus now down), one slot's worth per name (the
    shape of ``layers[l][name][0]``; any device: copied in). Needed only when the transition
    has restores (``schedule.restore_*``); without it such a mover raises ``ValueError`` at
    construction, naming the experts.

    ``staging_bytes``: budget for the receive buffers. Staged mode cuts the layers into
    ``chunks`` whose receives fit it on every rank (``staged_chunks``; ``None``: one chunk,
    every receive of the transition held at once); one layer that alone does not fit raises
    ``ValueError`` with the bytes it needs, before anything moves. Direct mode: a cap, below
    ``staging_bytes_needed("direct")`` raises ``ValueError`` before anything moves.
    ``chunk_layers``: at most this many layers a chunk (``None``: as many as fit), which
    spreads the switch's copies within the gpu (``commit()``, a stall between two steps)
    over several steps. ``layers_per_call``: layers per ``prepare()`` / ``step()`` (``None``:
    all; ``prepare()`` never goes past the end of the current chunk).
    ``round_experts``: cap on the experts a pair exchanges each way per round.
    ``verify``: compare a checksum of every written slot with its source's.
    ``batch_copies``: copy the small tensors (under 1 MiB a slot: scales) of each wave of
    independent copies with one ``torch._foreach_copy_`` per name instead of one launch per
    slot (the default). Large tensors always go one ``copy_`` (a memcpy) each: on an H200 the
    fused kernel moved 44 MB FP8 experts at a quarter of memcpy speed (bench/mover_bench.py).

    ``schedule`` (the whole transition, all ranks) is available right after construction,
    before anything moves.
    """

    def __init__(
        self,
        layers: Sequence[Mapping[str, torch.Tensor]],
        old: Placement,
        new: Placement,
        group: dist.ProcessGroup | None = None,
        *,
        transport: Transport | None = None,
        staging_bytes: int | None = None,
        chunk_layers: int | None = None,
        layers_per_call: int | None = None,
        round_experts: int | None = None,
        bandwidth: Bandwidth | None = None,
        verify: bool = False,
        batch_copies: bool = True,
        restore: Callable[[int, int], Mapping[str, torch.Tensor]] | None = None,
        gpus: Sequence[int] | None = None,
    ) -> None:
        if layers_per_call is not None:
            checks.positive_int("layers_per_call", layers_per_call, allowed="a positive integer or None")
        self._plan = plan = _RankPlan(
            layers,
            old,
            new,
            group,
            transport,
            round_experts,
            bandwidth,
            verify=verify,
            batch_copies=batch_copies,
            restore=restore,
            gpus=gpus,
        )
        self.schedule: TransferSchedule = plan.schedule
        self.rank, self.topology, self.device, self.slot_bytes = plan.rank, plan.topology, plan.device, plan.slot_bytes
        self.verify, self.batch_copies = verify, batch_copies
        self.layers_per_call = layers_per_call or plan.topology.num_layers
        self._staging_cap = staging_bytes
        self._chunk_layers = chunk_layers
        self._chunks: tuple[range, ...] | None = None
        self._move: _StagedMove | _DirectMove | None = None  # the mode, once the first call picked it

    # -- sizes ---------------------------------------------------------------------------

    @property
    def chunks(self) -> tuple[range, ...]:
        """Staged mode's chunks of consecutive layers (the same on every rank): each is
        prepared into the receive buffers, then committed, before the next reuses them.
        ``ValueError`` when one layer alone does not fit ``staging_bytes``."""
        if self._chunks is None:
            self._chunks = staged_chunks(self.schedule, self.slot_bytes, self._staging_cap, self._chunk_layers)
        return self._chunks

    def staging_bytes_needed(self, mode: str) -> int:
        """Receive-buffer bytes this rank allocates: ``"staged"`` the receives of the largest
        chunk (every receive of the transition when ``staging_bytes`` is ``None``);
        ``"direct"`` only one layer's receives whose slot is still read, the layer with the
        most. Both add one spare slot when a cycle of local moves needs it."""
        return self._pool_slots(mode) * self.slot_bytes

    def _pool_slots(self, mode: str) -> int:
        if mode == "staged":
            return max((self._plan.chunk_slots(chunk) for chunk in self.chunks), default=0)
        if mode == "direct":
            return self._plan.direct_slots()
        raise ValueError(f"mode must be 'staged' or 'direct', got {mode!r}")

    @property
    def prepared_layers(self) -> int:
        """Layers prepared (staged) or moved (direct) so far."""
        return self._move.next if self._move is not None else 0

    @property
    def done(self) -> bool:
        """Every layer is in place (direct), or committed (staged)."""
        return self._move is not None and self._move.done

    @property
    def committed_layers(self) -> int:
        """Staged: layers ``0 .. committed_layers - 1`` hold the new placement (whole chunks)."""
        return self._move.committed_layers if isinstance(self._move, _StagedMove) else 0

    @property
    def fully_prepared(self) -> bool:
        """Every layer is prepared (with several chunks: the last chunk is)."""
        return isinstance(self._move, _StagedMove) and self._move.next == self.topology.num_layers

    @property
    def chunk_prepared(self) -> bool:
        """The current chunk is prepared: ``commit()`` may run."""
        return isinstance(self._move, _StagedMove) and self._move.chunk_prepared

    # -- staged: prepare / commit / rollback ----------------------------------------------

    def prepare(self, num_layers: int | None = None) -> int:
        """Receive the next ``num_layers`` (default ``layers_per_call``) layers of the current
        chunk into receive buffers and send what peers need from this rank; live slots are
        only read. Collective over the group. Returns the layers prepared by this call (0 once
        the current chunk is prepared: ``commit()`` it, then prepare the next)."""
        return self._enter("staged").prepare(self._count(num_layers))

    def commit(self) -> MoveReport:
        """Write the current chunk's live slots (copies within this gpu only, no peer
        traffic): call it at the chunk's switch step, between two engine steps, on every rank;
        from that step on those layers route with the new map. The engine's current stream
        waits for the writes, so the next step reads new weights. The receive buffers are then
        free for the next chunk; after the last, the mover is ``done``."""
        move = self._move
        if not isinstance(move, _StagedMove) or move.committed or move.closed:
            raise ValueError("commit() needs a prepared, not yet committed or rolled back mover")
        return move.commit()

    def rollback(self) -> None:
        """Drop the receive buffers of a prepare that will not be committed; the live weights
        of uncommitted layers were never written, so the old map stays correct for them.
        Layers of chunks already committed keep the new placement (``committed_layers``):
        the mover is then finished; moving them back is a new transition. Not possible after
        the last ``commit()``."""
        move = self._move
        if isinstance(move, _StagedMove) and move.committed:
            raise ValueError("rollback() after commit(): the live weights already hold the new placement")
        if isinstance(move, _DirectMove) and move.next:
            raise ValueError("rollback() after direct step(): those layers were written in place")
        self._plan.drop()
        if isinstance(move, _StagedMove) and move.chunk:
            move.close()
            return
        self._move = None  # nothing written: the mover is as new

    # -- direct: step / run ---------------------------------------------------------------

    def step(self, num_layers: int | None = None) -> MoveReport:
        """Move the next ``num_layers`` (default ``layers_per_call``) layers in place: peer rounds,
        then the copies within the gpu. Collective over the group. The engine must not run
        those layers until this returns (its current stream waits for the writes)."""
        return self._enter("direct").step(self._count(num_layers))

    def run(self) -> MoveReport:
        """Every remaining layer in place (``step`` over all of them)."""
        return self.step(self.topology.num_layers - self.prepared_layers)

    def synchronize(self) -> None:
        """Block the host until the mover's queued GPU work is done."""
        self._plan.synchronize()

    # -- internals ------------------------------------------------------------------------

    def _count(self, num_layers: int | None) -> int:
        return checks.nonneg_int("num_layers", self.layers_per_call if num_layers is None else num_layers)

    def _enter(self, mode: str) -> _StagedMove | _DirectMove:
        """The mode's move: made (its buffers allocated within the budget) by the first call."""
        move = self._move
        if move is not None and (isinstance(move, _StagedMove) and (move.committed or move.closed)):
            raise ValueError(
                "this mover already committed or rolled back committed chunks; make a new WeightMover for the next transition"
            )
        if move is not None and move.mode != mode:
            raise ValueError(f"this mover runs {move.mode}; prepare()/commit() and step() do not mix")
        if move is None:
            need = self.staging_bytes_needed(mode)
            if self._staging_cap is not None and need > self._staging_cap:
                raise ValueError(
                    f"staging_bytes={self._staging_cap} is below what {mode} mode needs on rank {self.rank}: "
                    f"{need} bytes ({need // self.slot_bytes} slots of {self.slot_bytes} bytes)"
                )
            self._plan.allocate(self._pool_slots(mode))
            move = self._move = _StagedMove(self._plan, self.chunks) if mode == "staged" else _DirectMove(self._plan)
        return move


class _StagedMove:
    """Staged mode over a plan: chunk by chunk, ``prepare`` into the buffers, ``commit`` in place."""

    mode = "staged"

    def __init__(self, plan: _RankPlan, chunks: tuple[range, ...]) -> None:
        self.plan, self.chunks = plan, chunks
        self.chunk = 0  # the chunk being prepared / committed next
        self.next = 0  # the next layer to prepare
        self.committed = False  # every chunk committed
        self.closed = False  # rolled back after committing chunks: nothing more to do

    @property
    def done(self) -> bool:
        return self.committed

    @property
    def committed_layers(self) -> int:
        return self.chunks[self.chunk - 1].stop if self.chunk else 0

    @property
    def chunk_prepared(self) -> bool:
        return self.chunk < len(self.chunks) and self.next == self.chunks[self.chunk].stop

    def prepare(self, n: int) -> int:
        if self.chunk >= len(self.chunks):
            return 0
        start, self.next = self.next, min(self.chunks[self.chunk].stop, self.next + n)
        with self.plan.on_stream():
            for layer in range(start, self.next):
                self.plan.exchange_layer(layer, direct=False)
                self.plan.load_layer(layer)
                self.plan.plan_local(layer)
        return self.next - start

    def commit(self) -> MoveReport:
        chunk = self.chunks[self.chunk]
        if self.next != chunk.stop:
            raise ValueError(
                f"commit() before chunk {self.chunk} (layers {chunk.start}..{chunk.stop - 1}) is prepared "
                f"({self.next - chunk.start} of {len(chunk)} layers)"
            )
        plan = self.plan
        with plan.on_stream():
            for layer in chunk:
                plan.local_layer(layer)
                plan.pool_index[layer] = {}
        plan.finish()
        self.chunk += 1
        plan.free = 0  # the next chunk's receives reuse the buffers (stream order keeps it safe)
        if self.chunk == len(self.chunks):
            self.committed = True
            plan.pool = None
        return plan.report(chunk)

    def close(self) -> None:
        self.closed = True
        self.next = self.committed_layers


class _DirectMove:
    """Direct mode over a plan: layer by layer, in place."""

    mode = "direct"
    committed_layers = 0

    def __init__(self, plan: _RankPlan) -> None:
        self.plan = plan
        self.next = 0  # the next layer to move

    @property
    def done(self) -> bool:
        return self.next == self.plan.topology.num_layers

    def step(self, n: int) -> MoveReport:
        plan = self.plan
        layers = range(self.next, min(plan.topology.num_layers, self.next + n))
        self.next = layers.stop
        with plan.on_stream():
            for layer in layers:
                plan.pool_index[layer] = {}
                plan.exchange_layer(layer, direct=True)
                plan.load_layer(layer)
                plan.plan_local(layer)
                plan.local_layer(layer)
        plan.finish()
        return plan.report(layers)


class _RankPlan:
    """One rank's part of one transition, shared by both modes: the tensors' slot views, the
    transfer schedule and this rank's work per layer, the receive buffers, and the three
    kinds of work (peer exchanges, copies within the gpu, the report) on the mover's stream."""

    def __init__(
        self,
        layers: Sequence[Mapping[str, torch.Tensor]],
        old: Placement,
        new: Placement,
        group: dist.ProcessGroup | None,
        transport: Transport | None,
        round_experts: int | None,
        bandwidth: Bandwidth | None,
        *,
        verify: bool,
        batch_copies: bool,
        restore: Callable[[int, int], Mapping[str, torch.Tensor]] | None = None,
        gpus: Sequence[int] | None = None,
    ) -> None:
        if not isinstance(old, Placement) or not isinstance(new, Placement):
            raise ValueError("old and new must be eplb.Placement objects")
        if old.topology != new.topology:
            raise ValueError(f"old placement is for {old.topology}, new for {new.topology}: they must match")
        topo = old.topology
        self.names, self.slot_shapes, self.dtypes, self.device = _check_layers(
            layers, topo.num_layers, topo.slots_per_gpu
        )
        # slot views made once (unbind is one call per tensor), not per copy
        self.views = [{name: layer[name].unbind(0) for name in self.names} for layer in layers]
        self.batch_copies, self.verify = batch_copies, verify
        self.small = {
            n
            for n, shape, dt in zip(self.names, self.slot_shapes, self.dtypes)
            if math.prod(shape) * torch.empty(0, dtype=dt).element_size() < _SMALL_SLOT_BYTES
        }
        self.transport = transport if transport is not None else DistTransport(group)
        # gpu_of[i]: the gpu of group rank i; group_rank: the inverse (gpu -> group rank).
        self.gpu_of = _group_gpus(self.transport.size, new, gpus)
        self.group_rank = {g: i for i, g in enumerate(self.gpu_of)}
        self.rank = self.gpu_of[self.transport.rank]  # this rank's gpu of the topology
        self.topology = topo
        self.slot_bytes = sum(
            math.prod(shape) * torch.empty(0, dtype=dt).element_size()
            for shape, dt in zip(self.slot_shapes, self.dtypes)
        )
        self.schedule = transfer_schedule(
            old, new, topo, expert_bytes=float(self.slot_bytes), bandwidth=bandwidth, round_experts=round_experts
        )
        self.work = _rank_work(self.schedule, self.rank)
        self.restore = restore
        mine = self.schedule.restore_dst_gpu == self.rank
        if mine.any() and restore is None:
            s = self.schedule
            lost = sorted({(int(a), int(b)) for a, b in zip(s.restore_layer[mine], s.restore_expert[mine])})
            raise ValueError(
                f"gpu {self.rank} must restore {len(lost)} expert(s) that no live gpu holds ((layer, expert): "
                f"{lost[:8]}{' ...' if len(lost) > 8 else ''}); pass restore=(layer, expert) -> {{name: tensor}}"
            )
        self.loaded: list[dict[int, Mapping[str, torch.Tensor]]] = [{} for _ in range(topo.num_layers)]
        self.spare_needed = int(any(dst == SPARE for work in self.work for _, dst in work.local))
        self.pool: dict[str, tuple[torch.Tensor, ...]] | None = None  # name -> buffer slot views
        self.pool_index: list[dict[int, int]] = [{} for _ in range(topo.num_layers)]  # layer -> {dst slot: buffer}
        self.spare = self.free = 0
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.verified: list[tuple[int, int, bool]] = []

    def chunk_slots(self, chunk: range) -> int:
        """Buffer slots staged mode needs for ``chunk``: its receives, plus a spare for a cycle."""
        works = [self.work[layer] for layer in chunk]
        recvs = sum(len(rnd) for w in works for rnd in w.recvs)
        return recvs + int(any(dst == SPARE for w in works for _, dst in w.local))

    def direct_slots(self) -> int:
        """Buffer slots direct mode needs: the most receives of one layer whose slot is still read."""
        reads = max((sum(1 for rnd in w.recvs for _, d in rnd if d in w.read_slots) for w in self.work), default=0)
        return reads + self.spare_needed

    def allocate(self, n: int) -> None:
        """``n`` buffer slots per tensor name (the last is the spare); starts the transport."""
        with self.on_stream():
            self.pool = {
                name: torch.empty((n, *shape), dtype=dt, device=self.device).unbind(0)
                for name, shape, dt in zip(self.names, self.slot_shapes, self.dtypes)
            }
        self.spare, self.free = n - 1, 0
        self.transport.start(self.device)

    def drop(self) -> None:
        """Frees the buffers and forgets the work planned in them."""
        self.synchronize()
        self.pool = None
        self.pool_index = [{} for _ in range(self.topology.num_layers)]
        self.loaded = [{} for _ in range(self.topology.num_layers)]
        for work in self.work:
            work.expected.clear()
            work.launches = []

    def synchronize(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()

    def on_stream(self):
        if self.stream is None:
            return _nullcontext()
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        return torch.cuda.stream(self.stream)

    def finish(self) -> None:
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def exchange_layer(self, layer: int, direct: bool) -> None:
        work, tensors = self.work[layer], self.views[layer]
        if direct:
            self.free = 0
        index = self.pool_index[layer]
        for sends, recvs in zip(work.sends, work.recvs):
            ops: list[P2P] = []
            checks: list[tuple[int, torch.Tensor]] = []
            # Both sides list a pair's operations in schedule order, names sorted: they match.
            for gpu, slot in sends:
                peer = self.group_rank[gpu]
                for name in self.names:
                    ops.append(P2P(True, peer, tensors[name][slot]))
                if self.verify:
                    ops.append(P2P(True, peer, slot_checksum(tensors, slot)))
            for gpu, slot in recvs:
                peer = self.group_rank[gpu]
                if direct and slot not in work.read_slots:
                    target = tensors  # nothing reads this slot's old content: land in place
                    at = slot
                else:
                    at = index[slot] = self.free
                    self.free += 1
                    target = self.pool
                for name in self.names:
                    ops.append(P2P(False, peer, target[name][at]))
                if self.verify:
                    cks = torch.empty(2 * len(self.names), dtype=torch.int64, device=self.device)
                    ops.append(P2P(False, peer, cks))
                    checks.append((slot, cks))
            if ops:
                self.transport.exchange(ops)
            for slot, cks in checks:
                work.expected[slot] = cks

    def load_layer(self, layer: int) -> None:
        """Loads the layer's restored experts through ``restore`` (kept where the loader put
        them until ``local_layer`` writes their slots); ``ValueError`` on a misfit."""
        work = self.work[layer]
        for expert, slot in work.restores:
            # Not None: a mover whose transition has restores is refused without it (__init__).
            got = self.restore(layer, expert)  # type: ignore[misc]
            if not isinstance(got, Mapping) or sorted(got) != self.names:
                have = sorted(got) if isinstance(got, Mapping) else type(got).__name__
                raise ValueError(f"restore({layer}, {expert}) returned {have}; the mover needs tensors {self.names}")
            for name, shape, dt in zip(self.names, self.slot_shapes, self.dtypes):
                t = got[name]
                if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != dt:
                    what = f"{list(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
                    raise ValueError(
                        f"restore({layer}, {expert})[{name!r}] is {what}; a slot of it is {list(shape)} {dt}"
                    )
            self.loaded[layer][slot] = got

    def plan_local(self, layer: int) -> None:
        """Build the layer's copy launches (host work) ahead of running them: in staged mode at
        the end of its prepare, so ``commit()`` only launches."""
        work, tensors, pool = self.work[layer], self.views[layer], self.pool
        loaded = self.loaded[layer]
        spare = ("pool", self.spare)
        copies = [(spare if s == SPARE else ("slot", s), spare if d == SPARE else ("slot", d)) for s, d in work.local]
        copies += [(("pool", buf), ("slot", dst)) for dst, buf in self.pool_index[layer].items()]
        # Restored experts land after the local copies (which read the slots' old content) and
        # before the fills (which may copy a restored slot to the gpu's other slots needing it).
        copies += [(("host", dst), ("slot", dst)) for dst in loaded]
        copies += [(("slot", s), ("slot", d)) for s, d in work.fills]

        def view(kind: str, i: int, name: str) -> torch.Tensor:
            return loaded[i][name] if kind == "host" else (pool if kind == "pool" else tensors)[name][i]

        launches: list[tuple[bool, list[torch.Tensor], list[torch.Tensor]]] = []
        for wave in _waves(copies) if self.batch_copies else [[c] for c in copies]:
            host = any(sk == "host" for (sk, _), _ in wave)
            for name in self.names:
                srcs = [view(sk, s, name) for (sk, s), _ in wave]
                dsts = [view(dk, d, name) for _, (dk, d) in wave]
                # A loaded expert may sit on another device: one copy_ each, never fused.
                launches.append((self.batch_copies and name in self.small and not host, dsts, srcs))
        work.launches = launches

    def local_layer(self, layer: int) -> None:
        work, tensors = self.work[layer], self.views[layer]
        if self.verify:
            for src, dst in work.copies:  # old content of the sources, before any write
                work.expected[dst] = slot_checksum(tensors, src)
            for dst, got in self.loaded[layer].items():
                one = {name: got[name].to(self.device).unsqueeze(0) for name in self.names}
                work.expected[dst] = slot_checksum(one, 0)
        for fused, dsts, srcs in work.launches:
            if fused:
                torch._foreach_copy_(dsts, srcs)
            else:
                for a, b in zip(dsts, srcs):
                    a.copy_(b)
        work.launches = []
        self.loaded[layer] = {}
        if self.verify:
            for src, dst in work.fills:
                work.expected[dst] = work.expected[src]
            for slot, want in work.expected.items():
                got = slot_checksum(tensors, slot)
                self.verified.append((layer, slot, bool(torch.equal(got, want))))
            work.expected.clear()

    def report(self, layers: range) -> MoveReport:
        s, g = self.schedule, self.rank
        sel = list(layers)
        wanted = set(sel)
        checked = [(layer, slot, ok) for layer, slot, ok in self.verified if layer in wanted]
        restored = int(np.isin(s.restore_layer[s.restore_dst_gpu == g], sel).sum())
        return MoveReport(
            layers=tuple(sel),
            received_bytes=int(s.received_bytes[sel, g].sum()),
            sent_bytes=int(s.sent_bytes[sel, g].sum()),
            local_copy_bytes=int(s.local_copy_bytes[sel, g].sum()),
            checked_slots=len(checked),
            mismatches=tuple((layer, slot) for layer, slot, ok in checked if not ok),
            restored=restored,
            restored_bytes=restored * self.slot_bytes,
        )


class _nullcontext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


# A copy's source or destination: ("slot" | "pool" | "host", index).
_End = tuple[str, int]


def _waves(copies: list[tuple[_End, _End]]) -> list[list[tuple[_End, _End]]]:
    """``copies`` ``[(src, dst)]`` in a correct sequential order → consecutive groups that may
    run at once: within a group no copy reads or writes what another writes."""
    waves: list[list[tuple[_End, _End]]] = []
    read: set[object] = set()
    written: set[object] = set()
    for src, dst in copies:
        if not waves or src in written or dst in read or dst in written:
            waves.append([])
            read, written = set(), set()
        waves[-1].append((src, dst))
        read.add(src)
        written.add(dst)
    return waves


def _check_layers(layers: Sequence[Mapping[str, torch.Tensor]], num_layers: int, slots: int):
    """→ names (sorted), per-name slot shapes and dtypes, and the device; ``ValueError`` on misfit."""
    if len(layers) != num_layers:
        raise ValueError(f"layers has {len(layers)} entries; the topology has num_layers = {num_layers}")
    if not layers or not layers[0]:
        raise ValueError("layers must map at least one tensor name per layer")
    names = sorted(layers[0])
    first = layers[0]
    device = first[names[0]].device
    for i, layer in enumerate(layers):
        if sorted(layer) != names:
            raise ValueError(
                f"layer {i} has tensors {sorted(layer)}; layer 0 has {names}: every layer needs the same names"
            )
        for name in names:
            t = layer[name]
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"layers[{i}][{name!r}] must be a torch.Tensor, got {type(t).__name__}")
            if t.dim() < 1 or t.shape[0] != slots:
                raise ValueError(
                    f"layers[{i}][{name!r}] has shape {list(t.shape)}; its leading dimension must be the {slots} local slots"
                )
            if t.shape != first[name].shape or t.dtype != first[name].dtype:
                raise ValueError(
                    f"layers[{i}][{name!r}] is {list(t.shape)} {t.dtype}; layer 0 has {list(first[name].shape)} {first[name].dtype}"
                )
            if t.device != device:
                raise ValueError(f"layers[{i}][{name!r}] is on {t.device}; the others on {device}: one device per rank")
            if not t.is_contiguous():
                raise ValueError(f"layers[{i}][{name!r}] must be contiguous: slots are sent as contiguous views")
    return names, [tuple(first[n].shape[1:]) for n in names], [first[n].dtype for n in names], device


def _rank_work(s: TransferSchedule, rank: int) -> list[_LayerWork]:
    """This rank's sends, receives, local copies and fills per layer, slots made local."""
    topo = s.topology
    S = topo.slots_per_gpu
    base = rank * S
    out = []
    for layer in range(topo.num_layers):
        n_rounds = int(s.rounds[layer])
        sends: list[list[tuple[int, int]]] = [[] for _ in range(n_rounds)]
        recvs: list[list[tuple[int, int]]] = [[] for _ in range(n_rounds)]
        sel = np.flatnonzero((s.recv_layer == layer) & ((s.recv_src_gpu == rank) | (s.recv_dst_gpu == rank)))
        for i in sel:  # already in (round, src, dst, dst_slot) order
            r = int(s.recv_round[i])
            if s.recv_src_gpu[i] == rank:
                sends[r].append((int(s.recv_dst_gpu[i]), int(s.recv_src_slot[i]) - base))
            if s.recv_dst_gpu[i] == rank:
                recvs[r].append((int(s.recv_src_gpu[i]), int(s.recv_dst_slot[i]) - base))
        mine = (s.local_layer == layer) & (s.local_dst_slot // S == rank)
        local = [(int(a) - base, int(b) - base) for a, b in zip(s.local_src_slot[mine], s.local_dst_slot[mine])]
        fm = (s.fill_layer == layer) & (s.fill_dst_slot // S == rank)
        fills = [(int(a) - base, int(b) - base) for a, b in zip(s.fill_src_slot[fm], s.fill_dst_slot[fm])]
        read = {src for src, _ in local} | {src for rnd in sends for _, src in rnd}
        rm = (s.restore_layer == layer) & (s.restore_dst_gpu == rank)
        restores = [(int(e), int(d) - base) for e, d in zip(s.restore_expert[rm], s.restore_dst_slot[rm])]
        out.append(_LayerWork(sends, recvs, local, order_local_copies(local), fills, read, restores=restores))
    return out


def _group_gpus(size: int, new: Placement, gpus: Sequence[int] | None) -> list[int]:
    """The gpu of each rank of a mover group of ``size`` ranks: ``gpus`` when given, else every
    gpu of the topology (``size == num_gpus``) or the live gpus of ``new`` in order."""
    G = new.topology.num_gpus
    live = [int(g) for g in np.flatnonzero(new.live)]
    if gpus is None:
        if size == G:
            return list(range(G))
        if size == len(live):
            return live
        raise GroupMismatch(
            f"the process group has {size} ranks; the topology has num_gpus = {G}"
            + (f" and {len(live)} live in the new placement (gpus {list(new.down_gpus)} down)" if len(live) < G else "")
        )
    out = [int(g) for g in gpus]
    if len(out) != size or len(set(out)) != size or not all(0 <= g < G for g in out):
        raise ValueError(f"gpus must list {size} distinct gpu ids in [0, {G - 1}] (one per group rank), got {out}")
    missing = sorted(set(live) - set(out))
    if missing:
        raise GroupMismatch(f"gpus {missing} are live in the new placement but not in the mover's group (gpus={out})")
    return out
