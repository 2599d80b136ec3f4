"""``LoadReporter``: per-step expert counts in on the engine's thread, streamed to the service
in the background.

``add`` checks the shape and the values and appends to a bounded queue, so a step never waits
on the network. Counts must be finite and in ``[0, MAX_REPORT_COUNT]`` (the service's limit): one
bad array summed into a report would make the service refuse the whole report, and the valid
counts of the interval with it. Host arrays are checked in ``add`` (a min and a max, vectorised:
``ValueError``, nothing queued); a CUDA tensor is checked on the reporter's thread (checking it in
``add`` would wait for the device), and dropped there, counted in ``stats().invalid_adds``.

A background thread sums the queue every ``interval_s`` into one report per placement version
(logical ``[L, E]`` counts in one report, physical ``[L, P]`` counts one per version they were
recorded under; int32 on the wire when every sum is a whole number that fits, as engines'
token counts are, else float64), gives each report the next ``seq`` and keeps it in a bounded outbox until
the service has acknowledged it on the ``StreamLoad`` stream the reporter keeps open (one message
a report, not one call: report_stream.py). A report whose ack did not come is sent again
with the same seqs (the service drops a ``(rank, seq)`` it has accepted, so nothing counts
twice), at the next address after an unavailable one, with exponential backoff. While the
service is away the outbox fills; past ``max_pending`` reports the oldest is dropped and
counted in ``stats().dropped_reports`` / ``dropped_tokens``: never silently.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
import numpy as np

import eplb
from eplb import checks
from eplb.limits import MAX_REPORT_COUNT, MAX_REPORT_STEPS
from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb
from eplb_wire.errors import READS_ONLY, reason

from . import wire
from .agent import ACK as AGENT_ACK
from .agent import COUNTED as AGENT_COUNTED
from .agent import read_frame as agent_read
from .agent import write_frame as agent_frame
from .client import Backoff, Endpoints, transient
from .report_stream import ReportStream

__all__ = ["LoadReporter", "ReporterStats"]

log = logging.getLogger(__name__)

# ReportLoadRequest.steps: the service refuses more.
_MAX_STEPS = MAX_REPORT_STEPS


@dataclass(frozen=True)
class ReporterStats:
    """Counters since the reporter started.

    ``added``: arrays accepted by ``add``; ``dropped_adds``: arrays refused because the queue
    was full (the background thread fell ``max_queued`` arrays behind); ``invalid_adds``: arrays
    refused for their values (negative, non-finite or above ``MAX_REPORT_COUNT``: raised by
    ``add`` for host arrays, dropped by the reporter's thread for CUDA tensors); ``sent``: reports the
    service answered for; ``accepted`` / ``duplicates``: what it said of them (a duplicate is a
    retry of a report it already had); ``rejected``: reports it refused as invalid (e.g.
    counts tagged with a version it no longer keeps), dropped; ``dropped_reports`` /
    ``dropped_tokens``: reports (and the tokens in them) dropped from the full outbox while the
    service was away; ``pending`` / ``pending_tokens``: reports (and their tokens) waiting to be
    sent; ``failovers``: address changes; ``via_agent``: reports the node agent had counted
    (``node_agent``; also in ``sent`` and ``accepted``, a duplicate among them too).
    """

    added: int
    dropped_adds: int
    invalid_adds: int
    sent: int
    accepted: int
    duplicates: int
    rejected: int
    dropped_reports: int
    dropped_tokens: float
    pending: int
    pending_tokens: float
    failovers: int
    address: str
    last_error: str
    via_agent: int = 0


class LoadReporter:
    """Streams one engine rank's expert counts to deployment ``deployment``.

    ``topology`` fixes the shapes ``add`` accepts: logical ``[L, E]`` or physical ``[L, P]``.
    Start it once per rank; ``close()`` (or the context manager) flushes what is left.
    """

    def __init__(
        self,
        addresses: str | Sequence[str] | Endpoints,
        deployment: str,
        rank: int,
        topology: eplb.Topology,
        *,
        token: str | None = None,
        interval_s: float = 1.0,
        max_queued: int = 4096,
        max_pending: int = 256,
        max_batch: int = 32,
        rpc_timeout_s: float = 10.0,
        node_agent: str | None = None,
        agent_timeout_s: float = 30.0,
        start: bool = True,
    ) -> None:
        if interval_s <= 0 or max_queued < 1 or max_pending < 1 or max_batch < 1:
            raise ValueError("interval_s must be > 0 and max_queued, max_pending, max_batch >= 1")
        if isinstance(addresses, Endpoints):
            self.endpoints, self._owned = addresses, False
        else:
            self.endpoints, self._owned = Endpoints(addresses, token=token), True
            self.endpoints.prefer(deployment)  # a deployment's ranks on one instance
        self.deployment, self.rank, self.topology = deployment, rank, topology
        self.interval_s, self.max_queued, self.max_pending, self.max_batch = (
            interval_s,
            max_queued,
            max_pending,
            max_batch,
        )
        self.rpc_timeout_s = rpc_timeout_s
        self._logical = (topology.num_layers, topology.num_experts)
        self._physical = (topology.num_layers, topology.num_slots)
        # (counts, version or None, CUDA event or None); appended by add() on the engine's
        # thread, drained by ours.
        self._queue: deque[tuple[object, int | None, object, int]] = deque()
        self._outbox: deque[pb.ReportLoadRequest] = deque()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._idle = threading.Condition(self._lock)
        self._stop = False
        # Microseconds since the epoch: a restarted rank's seqs keep increasing past its last run's.
        self._seq = time.time_ns() // 1000
        self._counts = dict(
            added=0,
            dropped_adds=0,
            invalid_adds=0,
            sent=0,
            accepted=0,
            duplicates=0,
            rejected=0,
            dropped_reports=0,
            via_agent=0,
        )
        self._dropped_tokens = 0.0
        self._pending_tokens = 0.0
        self._last_error = ""
        self._told_reads_only = False
        # The host's node agent (engine/agent.py): its Unix socket path; ``_handed`` leading
        # outbox reports are with it; ``_agent`` is None while reports go on our own.
        self.node_agent = node_agent
        self._agent: socket.socket | None = None
        self._handed = 0
        self._agent_tried = 0.0
        self._acked_at = 0.0
        # Seqs dropped from the full outbox while the agent had them → their tokens.
        self._dropped_handed: dict[int, float] = {}
        self.agent_timeout_s = agent_timeout_s
        # Reports go one message each on a stream kept open (report_stream.py), not one call each.
        self._stream = ReportStream(self.endpoints, rpc_timeout_s)
        self._thread = threading.Thread(target=self._run, name=f"eplb-reporter-{rank}", daemon=True)
        if start:
            self._thread.start()

    def start(self) -> None:
        self._thread.start()

    def add(self, counts: object, version: int | None = None, *, copy: bool = True, steps: int = 1) -> bool:
        """Queues one step's counts: ``[L, E]`` per logical expert (``version`` None), or ``[L, P]``
        per slot recorded under placement ``version``. A numpy array or a torch tensor (on any
        device; copied there without a sync, moved to the host in the background). ``copy=False``
        hands the array over: the caller must not write to it afterwards. ``steps``: the rank-steps
        the counts cover: a rank's own counts of one step are 1, of an interval its steps, and
        counts summed over ranks (an all-reduced dump) the steps times the ranks; each report says
        how many it sums (``ReportLoadRequest.steps``), from which a deployment planned for time
        learns its tokens per gpu per step. 0: not known.

        Every count must be finite and in ``[0, MAX_REPORT_COUNT]``: a numpy array or a CPU
        tensor that breaks the rule raises ``ValueError`` here (nothing queued, the pending sum
        untouched); a CUDA tensor is checked on the reporter's thread and dropped there if it
        breaks it (``stats().invalid_adds``, ``last_error``), so ``add`` never waits for the device.

        O(1) on the caller's thread (plus a vectorised min and max of host arrays); returns
        False (and counts it) if the queue is full.
        """
        if not (checks.is_int(steps) and 0 <= int(steps) <= _MAX_STEPS):
            raise ValueError(
                f"steps must be an integer in [0, {_MAX_STEPS}] (forward steps the counts cover), got {steps!r}"
            )
        steps = int(steps)
        shape = tuple(getattr(counts, "shape", ()))
        if version is None:
            if shape != self._logical:
                raise ValueError(
                    f"logical counts must be [L, E] = {list(self._logical)}, got {list(shape)} "
                    f"(physical [L, P] = {list(self._physical)} counts need version=)"
                )
        else:
            if shape != self._physical:
                raise ValueError(
                    f"physical counts (version={version}) must be [L, P] = {list(self._physical)}, got {list(shape)}"
                )
            if version < 1:
                raise ValueError(
                    f"version must be the placement version (>= 1) the counts were recorded under, got {version}"
                )
        ready = None
        if hasattr(counts, "detach"):  # a torch tensor; clone() is queued on its device's stream
            item = counts.detach().clone() if copy else counts.detach()
            if item.is_cuda:
                # The reporter's thread reads it on another stream: it waits for this event, which
                # marks the end of the work queued so far on the caller's stream (the clone).
                import torch

                ready = torch.cuda.Event()
                ready.record(torch.cuda.current_stream(item.device))
        else:
            item = np.array(counts, copy=True) if copy else np.asarray(counts)
        if ready is None:
            problem = _bad_values(item)
            if problem:
                with self._lock:
                    self._counts["invalid_adds"] += 1
                raise ValueError(f"counts{'' if version is None else f' (version={version})'}: {problem}")
        with self._lock:
            if len(self._queue) >= self.max_queued:
                self._counts["dropped_adds"] += 1
                return False
            self._queue.append((item, version, ready, steps))
            self._counts["added"] += 1
            filling = len(self._queue) * 2 >= self.max_queued
        if filling:  # sum it now rather than at the next interval, before the queue runs over
            self._wake.set()
        return True

    def stats(self) -> ReporterStats:
        with self._lock:
            return ReporterStats(
                **self._counts,
                dropped_tokens=self._dropped_tokens,
                pending=len(self._outbox) + (1 if self._queue else 0),
                pending_tokens=self._pending_tokens,
                failovers=self.endpoints.failovers,
                address=self.endpoints.address,
                last_error=self._last_error,
            )

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Sends everything queued now; True once the service answered for all of it."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            self._wake.set()
            while self._queue or self._outbox:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(min(left, 0.1))
                self._wake.set()
        return True

    def close(self, timeout_s: float = 5.0) -> bool:
        """Flushes for up to ``timeout_s`` and stops; True if nothing was left unsent."""
        done = self.flush(timeout_s) if self._thread.is_alive() else not (self._queue or self._outbox)
        self._stop = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        if self._agent is not None:
            self._leave_agent(self._agent)
        self._stream.close()
        if self._owned:
            self.endpoints.close()
        return done

    def __enter__(self) -> LoadReporter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # background thread

    def _run(self) -> None:
        backoff = Backoff(max_s=min(2.0, self.interval_s * 4))
        retry_at = 0.0
        while not self._stop:
            self._wake.wait(self.interval_s)
            self._wake.clear()
            self._aggregate()
            if self._through_agent():
                with self._lock:
                    self._idle.notify_all()
                continue
            while self._outbox and not self._stop and time.monotonic() >= retry_at:
                if self._send():
                    backoff.reset()
                else:
                    retry_at = time.monotonic() + backoff.delay()
                    break
            with self._lock:
                self._idle.notify_all()

    def _aggregate(self) -> None:
        """Sums the queue into one report per version and appends them to the outbox."""
        with self._lock:
            items, self._queue = self._queue, deque()
        if not items:
            return
        sums: dict[int | None, np.ndarray] = {}
        steps: dict[int | None, int] = {}
        for counts, version, ready, n in items:
            if ready is not None:
                ready.synchronize()
            arr = counts.cpu().numpy() if hasattr(counts, "cpu") else counts
            arr = np.asarray(arr, dtype=np.float64)
            if ready is not None and (problem := _bad_values(arr)):  # host arrays were checked in add()
                log.warning("rank %d: dropped a CUDA counts tensor: %s", self.rank, problem)
                with self._lock:
                    self._counts["invalid_adds"] += 1
                    self._last_error = f"counts: {problem}"
                continue
            if version in sums:
                sums[version] += arr
            else:
                sums[version] = arr.copy()
            # A sum with any add of unknown steps has unknown steps.
            steps[version] = 0 if n == 0 or steps.get(version, 1) == 0 else steps.get(version, 0) + n
        with self._lock:
            for version, total in sums.items():
                total = _narrow(total)
                self._seq += 1
                msg = pb.ReportLoadRequest(
                    deployment=self.deployment, rank=self.rank, seq=self._seq, steps=min(steps[version], _MAX_STEPS)
                )
                if version is None:
                    msg.logical.CopyFrom(wire.encode_array(total))
                else:
                    msg.physical.counts.CopyFrom(wire.encode_array(total))
                    msg.physical.placement_version = version
                self._outbox.append(msg)
                self._pending_tokens += float(total.sum())
            while len(self._outbox) > self.max_pending:
                if self._handed:
                    # With the agent, which may still count it: settled if its ack comes.
                    self._handed -= 1
                    self._dropped_handed[self._outbox[0].seq] = _tokens(self._outbox[0])
                tokens = self._pop()
                self._counts["dropped_reports"] += 1
                self._dropped_tokens += tokens

    def _through_agent(self) -> bool:
        """Hands the new outbox reports to the node agent; False when they go on our own.

        Safe at any time, both ways: the agent sends a rank's reports in seq order and never one
        past a report of it that was not counted (a refused node report gives back everything
        after it: engine/agent.py), so whatever it counts is the oldest of what it was handed; a
        rank that leaves it sends its whole outbox from the oldest on, and what the agent had
        counted comes back as duplicates. So the rank leaves when the agent is gone, says so, or
        answers nothing for ``agent_timeout_s``, and tries it again every ``interval_s``,
        handing it the whole outbox."""
        if self.node_agent is None or self._stop:
            return False
        if self._agent is None:
            if time.monotonic() - self._agent_tried < self.interval_s:
                return False
            self._agent_tried = time.monotonic()
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(self.node_agent)
            except OSError as exc:
                sock.close()
                log.debug(
                    "rank %d: node agent %s not reachable (%s): reporting on our own", self.rank, self.node_agent, exc
                )
                return False
            with self._lock:
                self._agent, self._handed, self._acked_at = sock, 0, time.monotonic()
            threading.Thread(
                target=self._read_acks, args=(sock,), name=f"eplb-reporter-acks-{self.rank}", daemon=True
            ).start()
        with self._lock:
            sock = self._agent
            if sock is not None and self._handed and time.monotonic() - self._acked_at > self.agent_timeout_s:
                stalled = True
                fresh = []
            else:
                stalled = False
                fresh = list(self._outbox)[self._handed :] if sock is not None else []
                self._handed += len(fresh)
                if not self._handed:
                    self._acked_at = time.monotonic()  # nothing owed: the clock starts at a hand-over
        if sock is None:
            return False
        if stalled:
            log.warning(
                "rank %d: node agent %s answered nothing for %.0fs: reporting on our own",
                self.rank,
                self.node_agent,
                self.agent_timeout_s,
            )
            self._leave_agent(sock)
            return False
        try:
            for msg in fresh:
                agent_frame(sock, msg.SerializeToString())
        except OSError:
            self._leave_agent(sock)
            return False
        return True

    def _read_acks(self, sock: socket.socket) -> None:
        """The agent's answers, in the order it was handed the reports: counted ones leave the
        outbox; at ON_YOUR_OWN, or when the agent is gone, the outbox goes on our own."""
        try:
            while (frame := agent_read(sock)) is not None:
                seq, code = AGENT_ACK.unpack(frame)
                with self._lock:
                    if self._agent is not sock:
                        return
                    if code == AGENT_COUNTED and seq in self._dropped_handed:
                        # Dropped from the full outbox, yet the agent had it counted.
                        tokens = self._dropped_handed.pop(seq)
                        self._counts["dropped_reports"] -= 1
                        self._dropped_tokens -= tokens
                    elif code != AGENT_COUNTED or not self._outbox or self._outbox[0].seq != seq:
                        break
                    else:
                        self._pop()
                        self._handed -= 1
                        if not self._outbox:
                            self._idle.notify_all()
                    self._acked_at = time.monotonic()
                    self._counts["sent"] += 1
                    self._counts["accepted"] += 1
                    self._counts["via_agent"] += 1
        except (OSError, ValueError):
            pass
        self._leave_agent(sock)

    def _leave_agent(self, sock: socket.socket) -> None:
        with self._lock:
            if self._agent is sock:
                self._agent, self._handed = None, 0
                self._agent_tried = time.monotonic()
                self._dropped_handed.clear()
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)  # wakes the ack thread's recv
        with contextlib.suppress(OSError):
            sock.close()
        self._wake.set()

    def _send(self) -> bool:
        """Up to ``max_batch`` outbox reports, oldest first, each on the kept-open ``StreamLoad``
        stream and forgotten once acknowledged; False on a transient failure (the rest kept).
        A report the service refuses is dropped (counted in ``rejected``) and the next sent."""
        with self._lock:
            batch = list(self._outbox)[: self.max_batch]
        for msg in batch:
            try:
                fresh = self._stream.send(msg)
            except grpc.RpcError as exc:
                self._note_error(exc)
                if transient(exc) or exc.code() == grpc.StatusCode.NOT_FOUND:
                    # NOT_FOUND: a replica whose store restarted empty answers it until the
                    # deployment is written back, so keep the reports and try again.
                    if exc.code() != grpc.StatusCode.NOT_FOUND and self._stream.stub is not None:
                        self.endpoints.failover(self._stream.stub)
                    return False
                log.warning("service refused report seq %d of rank %d: %s", msg.seq, self.rank, exc.details())
                with self._lock:
                    self._pop()
                    self._counts["rejected"] += 1
                continue
            self._done([msg], int(fresh), int(not fresh))
        return True

    def _done(self, batch: list[pb.ReportLoadRequest], accepted: int, duplicates: int) -> None:
        with self._lock:
            for _ in batch:
                self._pop()
            self._counts["sent"] += len(batch)
            self._counts["accepted"] += accepted
            self._counts["duplicates"] += duplicates

    def _pop(self) -> float:
        """Removes the oldest outbox report (under the lock); returns its tokens."""
        tokens = _tokens(self._outbox.popleft())
        self._pending_tokens -= tokens
        return tokens

    def _note_error(self, exc: grpc.RpcError) -> None:
        with self._lock:
            self._last_error = f"{exc.code().name}: {exc.details()}"
        # The reason in the trailing metadata; a 1.0.0 instance names none, only its text.
        refused = reason(exc) == READS_ONLY or "reads only" in (exc.details() or "")
        if refused and not self._told_reads_only:
            # A misconfiguration, not an outage: say it once (the reports go to the next address).
            self._told_reads_only = True
            log.warning(
                "reporting %s: %s is a reads-only instance (eplb serve --reads-only), which takes no reports: "
                "list it in reads=, not among the addresses reports go to",
                self.deployment,
                self.endpoints.address,
            )


def _bad_values(counts: object) -> str:
    """``counts`` (a numpy array or a CPU tensor, any shape) → what breaks the rule, "" if none."""
    if counts.shape and 0 in counts.shape:
        return ""
    lo, hi = float(counts.min()), float(counts.max())
    if lo >= 0 and hi <= MAX_REPORT_COUNT:  # False for NaN too
        return ""
    found = "NaN" if np.isnan(lo) or np.isnan(hi) else f"values from {lo:g} to {hi:g}"
    return f"every count must be finite and in [0, {MAX_REPORT_COUNT:g}] tokens; got {found}"


_INT32_MAX = np.iinfo(np.int32).max


def _narrow(total: np.ndarray) -> np.ndarray:
    """``total`` as int32 when every count is a whole number that fits (what engines count:
    half the bytes of float64 on the wire and in the service's hands), else as it is."""
    if total.size and total.max() <= _INT32_MAX and np.array_equal(total, np.trunc(total)):
        return total.astype(np.int32)
    return total


def _tokens(msg: pb.ReportLoadRequest) -> float:
    array = msg.logical if msg.WhichOneof("counts") == "logical" else msg.physical.counts
    return float(wire.decode_array(array).sum())
