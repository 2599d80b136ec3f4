"""How the ranks agree, at each step boundary, what their rollouts do: the ``Barrier``
protocol and its records (``Local``: one rank's side; ``Decision``: what was agreed), and its
two implementations, ``ServiceBarrier`` (through the service's ``AckPlacement``) and
``ProcessGroupBarrier`` (an all-reduce on the engine's own ``torch.distributed`` group), with
``AckSender``, which tells the service from a background thread."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import grpc

from ..client import ServiceClient

__all__ = ["AckSender", "Barrier", "Decision", "Local", "ProcessGroupBarrier", "ServiceBarrier"]

# The rollout logs under one name, eplb_engine.rollout, whichever of its modules speaks.
log = logging.getLogger(__package__)


@dataclass(frozen=True)
class Local:
    """One rank's side of a rollout at a step boundary.

    ``current``: version routed with now; ``offered``: newest version this rank has and would
    prepare (``current`` if none); ``target``: version being prepared (0: none; ``current``
    while moving the switched layers of an aborted version back); ``prepared``: the target's
    prepare (of its chunk ``chunk``) finished; ``failed``: why the target's prepare failed (""
    if not); ``final``: ``chunk`` is the target's last; ``revert``: nothing in flight, but
    layers of an aborted version switched here and wait to be moved back; ``local``: the
    target is a survivor placement this rank computed (not a service version: never acked).
    """

    current: int
    offered: int
    target: int
    prepared: bool
    failed: str
    chunk: int = 0
    final: bool = True
    revert: bool = False
    local: bool = False


@dataclass(frozen=True)
class Decision:
    """What the ranks agreed at a step boundary: start preparing ``start`` (0: nothing to
    start; the current version: move an aborted version's switched layers back), ``switch``
    to the target (its current chunk's layers) from this step on, ``abort`` it, or ``hold``
    its last switch (it is ready; another deployment of a ``RolloutGroup`` is changing)."""

    start: int = 0
    switch: bool = False
    abort: bool = False
    hold: bool = False  # ready, but the last switch waits for another deployment (RolloutGroup)


class Barrier(Protocol):
    """How a rollout's ranks agree: every rank hands its ``Local`` side at every step boundary
    and gets the same ``Decision`` back."""

    chunked: bool  # agrees a switch step per chunk (else: whole versions only)

    def sync(self, step: int, local: Local) -> Decision:
        """Called by every rank at every step boundary; returns the agreed decision."""

    def close(self) -> None: ...


class AckSender:
    """Acks to the service from a background thread, so a step never waits on the network."""

    def __init__(self, client: ServiceClient, deployment: str, rank: int) -> None:
        self.client, self.deployment, self.rank = client, deployment, rank
        self._queue: queue.Queue[tuple | None] = queue.Queue()
        self.failures = 0
        self._thread = threading.Thread(target=self._run, name=f"eplb-acks-{rank}", daemon=True)
        self._thread.start()

    def send(
        self, version: int, state: str, step: int = 0, error: str = "", on_reply: Callable[[object], None] | None = None
    ) -> None:
        self._queue.put((version, state, step, error, on_reply))

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            version, state, step, error, on_reply = item
            try:
                reply = self.client.ack(self.deployment, self.rank, version, state, step=step, error=error)
            except grpc.RpcError as exc:
                self.failures += 1
                log.warning("ack %s of version %d failed: %s", state, version, exc.details())
                continue
            if on_reply is not None:
                on_reply(reply)

    def close(self, timeout_s: float = 5.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout_s)


class ServiceBarrier:
    """The version-and-step barrier through the service's ``AckPlacement``.

    A rank that finished preparing acks PREPARED with its step and keeps asking (the same ack,
    every ``poll_s``, from a background thread) until the service answers with the switch step
    (every rank prepared) or ``aborted`` (one failed). The rank switches at the first step
    boundary at or after the switch step; the deployment's ``switch_margin_steps`` must cover
    the time an ack takes, or a rank learns of the switch late (counted in ``late``).
    It agrees one step per version: it cannot switch chunked versions (``chunked`` False).
    """

    chunked = False

    def __init__(self, client: ServiceClient, deployment: str, rank: int, *, poll_s: float = 0.01) -> None:
        self.acks = AckSender(client, deployment, rank)
        self.poll_s = poll_s
        self.late = 0
        self._lock = threading.Lock()
        self._version = 0
        self._switch_step = 0
        self._aborted = False
        self._asked_at = 0.0
        self._prepared_step = 0
        self._failed_sent = 0

    def _on_reply(self, version: int) -> Callable[[object], None]:
        def record(reply: object) -> None:
            with self._lock:
                if version == self._version:
                    self._switch_step = self._switch_step or reply.switch_step
                    self._aborted = self._aborted or reply.aborted

        return record

    def sync(self, step: int, local: Local) -> Decision:
        if local.target == 0:
            return Decision(start=local.offered) if local.offered > local.current else Decision()
        with self._lock:
            if local.target != self._version:
                self._version, self._switch_step, self._aborted, self._asked_at = local.target, 0, False, 0.0
            switch_step, aborted = self._switch_step, self._aborted
        if local.failed:
            if self._failed_sent != local.target:
                self._failed_sent = local.target
                self.acks.send(local.target, "failed", step, local.failed)
            return Decision(abort=True)
        if not local.prepared:
            return Decision()
        if aborted:
            return Decision(abort=True)
        if switch_step and step >= switch_step:
            if step > switch_step:
                self.late += 1
                log.warning(
                    "switching to version %d at step %d, after the agreed step %d", local.target, step, switch_step
                )
            self.acks.send(local.target, "switched", step)
            return Decision(switch=True)
        now = time.monotonic()
        if not switch_step and now - self._asked_at >= self.poll_s:
            # Re-asking with the step of the first PREPARED ack keeps the agreed step where it was.
            if self._asked_at == 0.0:
                self._prepared_step = step
            self._asked_at = now
            self.acks.send(local.target, "prepared", self._prepared_step, on_reply=self._on_reply(local.target))
        return Decision()

    def close(self) -> None:
        self.acks.close()


class ProcessGroupBarrier:
    """The barrier through the engine's own ``torch.distributed`` group: one all-reduce of ten
    int64 values per step boundary, so every rank gets the same decision at the same step.

    Preparing starts once every rank holds the same newest version; the switch (of the
    target's next chunk) comes at the first step boundary at which every rank finished
    preparing it; any rank's failure aborts it everywhere; once every rank has rolled back,
    ranks holding switched layers of the aborted version start moving them back together.
    ``acks`` (optional) tells the service what happened, for its counts.
    """

    chunked = True

    def __init__(self, group: object = None, acks: AckSender | None = None) -> None:
        import torch
        import torch.distributed as dist

        self._torch, self._dist, self.group, self.acks = torch, dist, group, acks
        self._failed_sent = 0

    def sync(self, step: int, local: Local) -> Decision:
        (reduced,) = self.reduce([local])
        decision = self.decide(local, reduced)
        self.report(step, local, decision)
        return decision

    def reduce(self, locals_: Sequence[Local]) -> list[list[int]]:
        """One all-reduce (MAX) of every ``Local``'s twelve values: what ``decide`` reads, per local."""
        values = []
        for local in locals_:
            # current too: after a local survivor placement a rank may relabel (or adopt) at
            # another step than its peers, and a start needs every rank to move from one version.
            pairs = (local.offered, local.target, local.chunk, int(local.revert), local.current)
            values += [v for x in pairs for v in (x, -x)]
            values += [int(local.target > 0 and not local.prepared), int(bool(local.failed))]
        t = self._torch.tensor(values, dtype=self._torch.int64)
        self._dist.all_reduce(t, op=self._dist.ReduceOp.MAX, group=self.group)
        v = [int(x) for x in t.tolist()]
        return [v[i : i + 12] for i in range(0, len(v), 12)]

    @staticmethod
    def decide(local: Local, v: Sequence[int]) -> Decision:
        """The decision every rank draws from the same reduced values ``v`` (no side effects)."""
        (max_offered, min_offered), (max_target, min_target), (max_chunk, min_chunk), (max_revert, min_revert) = (
            (v[i], -v[i + 1]) for i in range(0, 8, 2)
        )
        max_current, min_current = v[8], -v[9]
        not_ready, failed = v[10], v[11]
        if max_target == 0:
            if max_revert:  # layers of an aborted version to move back: once every rank rolled back
                return Decision(start=local.current) if min_revert else Decision()
            if min_offered == max_offered and min_current == max_current and min_offered > local.current:
                return Decision(start=min_offered)
            return Decision()
        if failed or min_target != max_target or min_chunk != max_chunk:
            return Decision(abort=True)
        return Decision(switch=True) if not_ready == 0 else Decision()

    def report(self, step: int, local: Local, decision: Decision) -> None:
        """Acks what was decided (after any coupling of deployments): FAILED with this rank's
        error, SWITCHED after a version's last chunk; moving layers back is not acked (acks are
        about versions, not about reverts)."""
        if self.acks is None or local.target in (0, local.current) or local.local:
            return
        if decision.abort and local.failed and self._failed_sent != local.target:
            self._failed_sent = local.target
            self.acks.send(local.target, "failed", step, local.failed)
        elif decision.switch and local.final:
            self.acks.send(local.target, "switched", step)

    def close(self) -> None:
        if self.acks is not None:
            self.acks.close()
