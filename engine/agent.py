"""``NodeAgent`` (``eplb agent``): one host's ranks send one summed report per interval.

The pattern of statsd and OpenTelemetry collectors: a small process per host that the ranks
reach over a Unix socket (``LoadReporter(node_agent=PATH)``). Every ``interval_s`` it sums the
reports it received into one node report per deployment (``ReportLoadRequest.covers`` names
each rank's ``(rank, seq)``), so a deployment of R ranks on N hosts sends N reports per
interval instead of R.

Exactly once, end to end. A rank keeps each report in its outbox until the agent says it was
counted, which the agent says only once the service answered the node report that holds it. The
service accepts a node report all together or not at all, so a node report re-sent after a lost
answer counts once. The agent sends each rank's reports in seq order and never one past a
report of that rank that was not counted: node reports keep every rank's order, and a refused
one (ABORTED: a rank's own report beat it) gives back every later one of its deployment and
ends those ranks' connections, so they send theirs on their own. So what the agent counted of a rank is always the oldest of
what it was handed, and a rank may leave it at any time (the agent died, said so, or answered
nothing for ``agent_timeout_s``): it sends its whole outbox, oldest first, on its own, and what
the agent had counted comes back as duplicates. It tries the agent again every interval.

The agent never blocks a rank: a rank's ``add`` only queues (``LoadReporter``); a dead rank's
connection only ends its own reports, and one that does not read its answers for a second is
let go (it reports on its own). The service sees every covered rank as alive. The socket file
is replaced only when it is a socket no agent listens on, and removed on close only if it is
still this agent's.

Wire between rank and agent, both ways length-prefixed (4 bytes, little-endian): rank → agent a
serialized ``ReportLoadRequest`` (its own rank and seq); agent → rank ``<QB``: a seq and a code,
``COUNTED`` (the service has it, as new or as a duplicate) or ``ON_YOUR_OWN`` (send it yourself).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
import stat
import struct
import sys
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc
import numpy as np

from eplb.limits import MAX_REPORT_COVERS, MAX_REPORT_STEPS
from eplb_wire import arrays
from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb

from .client import Endpoints, transient
from .report_stream import ReportStream

__all__ = ["ACK", "COUNTED", "ON_YOUR_OWN", "NodeAgent", "read_frame", "write_frame"]

log = logging.getLogger(__name__)

COUNTED = 0
ON_YOUR_OWN = 1
ACK = struct.Struct("<QB")
_LEN = struct.Struct("<I")
# A rank's frame: one report; the largest message the service takes.
_MAX_FRAME = 16 << 20
_INT32_MAX = np.iinfo(np.int32).max
# A rank that does not take its acks for this long is let go.
_SEND_TIMEOUT_S = 1
# Node reports of one deployment waiting for the service, at most (then its ranks go on their own).
_MAX_QUEUED = 64


def write_frame(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(_LEN.pack(len(payload)) + payload)


def read_frame(sock: socket.socket) -> bytes | None:
    """The next frame, or None at the end of the stream."""
    head = _read_exactly(sock, _LEN.size)
    if head is None:
        return None
    (n,) = _LEN.unpack(head)
    if n > _MAX_FRAME:
        raise ValueError(f"frame of {n} bytes, over {_MAX_FRAME}")
    return _read_exactly(sock, n)


def _read_exactly(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


class _Rank:
    """One rank's connection: acks go back on it, one writer at a time. A rank that does not
    read its acks for ``_SEND_TIMEOUT_S`` is let go (it reports on its own): the agent's one
    sending thread never waits on it longer."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.lock = threading.Lock()
        self.open = True
        # A send timeout only (SO_SNDTIMEO): the reader thread's recv keeps blocking.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", int(_SEND_TIMEOUT_S), 0))

    def tell(self, seq: int, code: int) -> None:
        if not self.open:
            return
        try:
            with self.lock:
                write_frame(self.sock, ACK.pack(seq, code))
        except OSError:
            self.end()

    def end(self) -> None:
        """Lets the rank go: its reader sees the end, the rank sees EOF and reports on its own."""
        self.open = False
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)


@dataclass
class _NodeReport:
    """A node report and whom to tell once the service answered it."""

    message: pb.ReportLoadRequest
    ranks: list[tuple[_Rank, int]] = field(default_factory=list)


class NodeAgent:
    """Listens on ``socket_path`` for a host's ranks and sends their reports summed, one node
    report per deployment every ``interval_s``, to the service at ``addresses``."""

    def __init__(
        self,
        socket_path: str,
        addresses: str | Sequence[str] | Endpoints,
        *,
        token: str | None = None,
        interval_s: float = 1.0,
        rpc_timeout_s: float = 10.0,
    ) -> None:
        if not (math.isfinite(interval_s) and interval_s > 0):
            raise ValueError(f"interval_s must be a number of seconds > 0, got {interval_s}")
        self.socket_path = socket_path
        self.endpoints = addresses if isinstance(addresses, Endpoints) else Endpoints(addresses, token=token)
        self.interval_s = interval_s
        self.rpc_timeout_s = rpc_timeout_s
        self._lock = threading.Lock()
        self._pending: list[tuple[_Rank, pb.ReportLoadRequest]] = []
        # Per deployment, node reports not answered yet, oldest first (sent in order).
        self._queues: dict[str, deque[_NodeReport]] = {}
        self._stop = threading.Event()
        self._server: socket.socket | None = None
        self.stats = dict(received=0, node_reports=0, covered=0, refused=0)
        self._threads: list[threading.Thread] = []
        self._ranks: set[_Rank] = set()
        self._inode: int | None = None
        # Node reports go one message each on a stream kept open (report_stream.py).
        self._stream = ReportStream(self.endpoints, rpc_timeout_s)

    def start(self) -> NodeAgent:
        """Listens on ``socket_path``: ``FileExistsError`` if something other than a socket is
        there or an agent already listens on it (a dead agent's socket file is replaced)."""
        path = self.socket_path
        if os.path.lexists(path):
            if not stat.S_ISSOCK(os.lstat(path).st_mode):
                raise FileExistsError(f"{path} exists and is not a socket: not replacing it")
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                try:
                    probe.connect(path)
                except OSError:
                    os.unlink(path)  # a dead agent's socket
                else:
                    raise FileExistsError(f"an agent already listens on {path}")
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(path)
        self._inode = os.stat(path).st_ino
        server.listen(1024)
        server.settimeout(0.2)
        self._server = server
        for target, name in ((self._accept, "accept"), (self._send_loop, "send")):
            t = threading.Thread(target=target, name=f"eplb-agent-{name}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def close(self) -> None:
        """Sends what it holds once more, then stops: its ranks see the end and report on their
        own what it did not answer."""
        self._stop.set()
        for t in self._threads:
            t.join(timeout=self.rpc_timeout_s + 1)
        self._stream.close()
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(OSError):
                if os.stat(self.socket_path).st_ino == self._inode:  # ours, not a later agent's
                    os.unlink(self.socket_path)
        with self._lock:
            ranks = list(self._ranks)
        for rank in ranks:
            rank.end()

    def __enter__(self) -> NodeAgent:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                sock, _ = self._server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            sock.settimeout(None)
            rank = _Rank(sock)
            with self._lock:
                self._ranks.add(rank)
            threading.Thread(target=self._read, args=(rank,), name="eplb-agent-rank", daemon=True).start()

    def _read(self, rank: _Rank) -> None:
        try:
            while (frame := read_frame(rank.sock)) is not None:
                msg = pb.ReportLoadRequest.FromString(frame)
                with self._lock:
                    self._pending.append((rank, msg))
                    self.stats["received"] += 1
        except (OSError, ValueError) as exc:
            log.debug("rank connection ended: %s", exc)
        finally:
            # Its reports not yet in a node report are dropped: the rank sends them on its own.
            rank.open = False
            with self._lock:
                self._pending = [(r, m) for r, m in self._pending if r is not rank]
                self._ranks.discard(rank)
            with contextlib.suppress(OSError):
                rank.sock.close()

    def _send_loop(self) -> None:
        while True:
            stopping = self._stop.wait(self.interval_s)
            self._sum()
            self._send()
            if stopping:
                return

    def _sum(self) -> None:
        """The reports received since the last round → node reports per deployment, appended to
        its queue in an order that keeps every rank's seqs in order: a node report holds one
        kind of counts (logical, or physical of one placement version) and at most
        MAX_REPORT_COVERS reports, and a rank's report goes in the first one of its kind not
        before the one its previous report went in (the service counts a rank's seq below one
        it counted as a duplicate: out of order, a report would be lost)."""
        with self._lock:
            items, self._pending = self._pending, []
        by_deployment: dict[str, list[tuple[_Rank, pb.ReportLoadRequest]]] = {}
        for rank, msg in items:
            by_deployment.setdefault(msg.deployment, []).append((rank, msg))
        for deployment, members in by_deployment.items():
            groups: list[tuple[tuple[str, int], list[tuple[_Rank, pb.ReportLoadRequest]]]] = []
            # Rank → its last group; by rank, not by connection: a rank that came back on a new
            # connection re-hands from its oldest report, after what its old one handed.
            at: dict[int, int] = {}
            for rank, msg in members:
                kind = msg.WhichOneof("counts") or ""
                key = (kind, msg.physical.placement_version if kind == "physical" else 0)
                who = msg.rank
                j = at.get(who, 0)
                while j < len(groups) and (groups[j][0] != key or len(groups[j][1]) >= MAX_REPORT_COVERS):
                    j += 1
                if j == len(groups):
                    groups.append((key, []))
                groups[j][1].append((rank, msg))
                at[who] = j
            queue = self._queues.setdefault(deployment, deque())
            if len(queue) >= _MAX_QUEUED:
                # The service has been away for that many rounds: the ranks keep their reports
                # (bounded by their max_pending) and send them on their own once it is back.
                log.warning("%d node reports of %s unanswered: its ranks report on their own", len(queue), deployment)
                self._give_back(deployment, queue, [(r, m.seq) for r, m in members])
                continue
            for (kind, version), chunk in groups:
                node = self._node_report(deployment, kind, version, [m for _, m in chunk])
                if node is None:
                    # Counts the agent cannot sum: this round's later node reports must not go
                    # on without them, so the deployment's whole round goes back to its ranks.
                    self._give_back(deployment, queue, [(r, m.seq) for r, m in members])
                    break
                queue.append(_NodeReport(node, [(rank, msg.seq) for rank, msg in chunk]))

    @staticmethod
    def _node_report(
        deployment: str, kind: str, version: int, msgs: list[pb.ReportLoadRequest]
    ) -> pb.ReportLoadRequest | None:
        try:
            parts = [arrays.decode(m.logical if kind == "logical" else m.physical.counts, "counts") for m in msgs]
        except ValueError:
            return None
        if not kind or len({p.shape for p in parts}) != 1:
            return None
        exact = all(p.dtype.kind == "i" for p in parts)
        total = np.sum(parts, axis=0, dtype=np.int64 if exact else np.float64)
        if exact and total.max(initial=0) <= _INT32_MAX:
            total = total.astype(np.int32)
        steps = [m.steps for m in msgs]
        node = pb.ReportLoadRequest(
            deployment=deployment,
            covers=[pb.ReportCover(rank=m.rank, seq=m.seq) for m in msgs],
            # Unknown if any report did not say.
            steps=0 if 0 in steps else min(sum(steps), MAX_REPORT_STEPS),
        )
        encoded = arrays.encode(total, widen=True)
        if kind == "logical":
            node.logical.CopyFrom(encoded)
        else:
            node.physical.counts.CopyFrom(encoded)
            node.physical.placement_version = version
        return node

    def _send(self) -> None:
        """Each deployment's node reports in order, until one fails transiently (kept for the
        next round: the same covers, so a repeat counts once)."""
        for deployment, queue in self._queues.items():
            # The instance the deployment's name picks (as its ranks' own reports go), once.
            self.endpoints.prefer(deployment)
            while queue:
                report = queue[0]
                try:
                    self._stream.send(report.message)
                except grpc.RpcError as exc:
                    # ABORTED: partly counted before, never worth a repeat (``transient`` has it
                    # for other calls). A server failure (INTERNAL not of the transport) goes
                    # back too: the same node report would fail again, and its ranks' own
                    # reports count once whether or not the service kept this one.
                    retry = transient(exc) or exc.code() == grpc.StatusCode.NOT_FOUND
                    if retry and exc.code() != grpc.StatusCode.ABORTED:
                        if exc.code() != grpc.StatusCode.NOT_FOUND and self._stream.stub is not None:
                            self.endpoints.failover(self._stream.stub)
                        log.warning("node report not sent (%s), kept for the next round", exc.code().name)
                        break
                    log.info("node report refused (%s: %s): ranks send their own", exc.code().name, exc.details())
                    self.stats["refused"] += 1
                    self._give_back(deployment, queue)
                    break
                queue.popleft()
                self.stats["node_reports"] += 1
                self.stats["covered"] += len(report.ranks)
                for rank, seq in report.ranks:
                    rank.tell(seq, COUNTED)

    def _give_back(
        self, deployment: str, queue: deque[_NodeReport], more: list[tuple[_Rank, int]] | None = None
    ) -> None:
        """A node report of ``deployment`` was refused (partly counted before, or invalid): it,
        every later one and every report received since go back to their ranks, which send them
        on their own. None may go on from here: a rank re-sends from its oldest report on, and a
        later seq of its counted first would make its earlier ones duplicates (lost)."""
        told = [(rank, seq) for report in queue for rank, seq in report.ranks] + (more or [])
        queue.clear()
        with self._lock:
            told += [(rank, msg.seq) for rank, msg in self._pending if msg.deployment == deployment]
            self._pending = [(rank, msg) for rank, msg in self._pending if msg.deployment != deployment]
        for rank, seq in told:
            rank.tell(seq, ON_YOUR_OWN)
        # And their connections end: a report a rank hands in before it read the answer must
        # not be counted ahead of the ones given back (it comes again from the rank's outbox).
        for rank in {rank for rank, _ in told}:
            rank.end()


def main(argv: list[str] | None = None, parser_class: type | None = None) -> int:
    """``eplb agent``: a host's node agent. ``parser_class``: the ``argparse.ArgumentParser``
    class to parse ``argv`` with (the ``eplb`` command passes its one-line-error parser)."""
    import argparse
    import signal

    ap = (parser_class or argparse.ArgumentParser)(
        prog="eplb agent",
        description="A host's node agent: its ranks (LoadReporter(node_agent=SOCKET), EPLB_NODE_AGENT in the "
        "drop-ins) hand it their reports over a Unix socket, and it sends one node report per deployment "
        "every interval, each rank's report counted exactly once.",
    )
    ap.add_argument("--socket", required=True, help="Unix socket path the host's ranks connect to")
    ap.add_argument("--address", required=True, help="the service, host:port[,host:port...] (instances)")
    ap.add_argument("--interval-seconds", type=float, default=1.0, help="how often node reports go (default 1)")
    ap.add_argument("--token-file", help="bearer token file (an engine token)")
    args = ap.parse_args(argv)
    if not (math.isfinite(args.interval_seconds) and args.interval_seconds > 0):
        ap.error(f"--interval-seconds must be a number of seconds > 0, got {args.interval_seconds}")
    token = None
    if args.token_file:
        try:
            with open(args.token_file) as f:
                token = f.read().strip()
        except OSError as exc:
            ap.error(f"--token-file {args.token_file}: cannot read it ({exc.strerror})")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        agent = NodeAgent(args.socket, args.address, token=token, interval_s=args.interval_seconds).start()
    except OSError as exc:
        print(f"eplb agent: error: --socket {args.socket}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    print(f"eplb agent: listening on {args.socket}", flush=True)
    while not stop.wait(1.0):
        pass
    agent.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
