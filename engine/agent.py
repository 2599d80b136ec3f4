"""``NodeAgent`` (``eplb agent``): one host's ranks send one summed report per interval.

The pattern of statsd and OpenTelemetry collectors: a small process per host that the ranks
reach over a Unix socket (``LoadReporter(node_agent=PATH)``). Every ``interval_s`` it sums the
reports it received into one node report per deployment (``ReportLoadRequest.covers`` names
each rank's ``(rank, seq)``), so a deployment of R ranks on N hosts sends N reports per
interval instead of R.

Exactly once, end to end. A rank keeps each report in its outbox until the agent says it was
counted, which the agent says only once the service answered the node report that holds it. The
service accepts a node report all together or not at all, so a node report re-sent after a
lost answer counts once. When the agent dies (or says so) a rank sends what it still holds on
its own, with the same seqs: those the agent's last node report had counted are duplicates,
the rest are counted; and where a rank's own report beat the agent's node report holding it,
the service refuses that node report whole (ABORTED) and the agent tells its other ranks to
send theirs on their own. A rank goes back to the agent only once its outbox is empty, so its
seqs reach the service in order.

The agent never blocks a rank: a rank's ``add`` only queues (``LoadReporter``), and a dead
rank's connection only ends its own reports. The service sees every covered rank as alive.

Wire between rank and agent, both ways length-prefixed (4 bytes, little-endian): rank → agent a
serialized ``ReportLoadRequest`` (its own rank and seq); agent → rank ``<QB``: a seq and a code,
``COUNTED`` (the service has it, as new or as a duplicate) or ``ON_YOUR_OWN`` (send it yourself).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import struct
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc
import numpy as np

from eplb.limits import MAX_REPORT_COVERS, MAX_REPORT_STEPS
from eplb_wire import arrays
from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb

from .client import TRANSIENT, Endpoints

__all__ = ["ACK", "COUNTED", "ON_YOUR_OWN", "NodeAgent", "read_frame", "write_frame"]

log = logging.getLogger(__name__)

COUNTED = 0
ON_YOUR_OWN = 1
ACK = struct.Struct("<QB")
_LEN = struct.Struct("<I")
# A rank's frame: one report; the largest message the service takes.
_MAX_FRAME = 16 << 20
_INT32_MAX = np.iinfo(np.int32).max


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
    """One rank's connection: acks go back on it, one writer at a time."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.lock = threading.Lock()
        self.open = True

    def tell(self, seq: int, code: int) -> None:
        if not self.open:
            return
        try:
            with self.lock:
                write_frame(self.sock, ACK.pack(seq, code))
        except OSError:
            self.open = False


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
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
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

    def start(self) -> NodeAgent:
        if os.path.exists(self.socket_path):
            os.unlink(self.socket_path)  # a dead agent's socket file
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(self.socket_path)
        server.listen(1024)
        server.settimeout(0.2)
        self._server = server
        for target, name in ((self._accept, "accept"), (self._send_loop, "send")):
            t = threading.Thread(target=target, name=f"eplb-agent-{name}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def close(self) -> None:
        """Sends what it holds once more, then stops."""
        self._stop.set()
        for t in self._threads:
            t.join(timeout=self.rpc_timeout_s + 1)
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(OSError):
                os.unlink(self.socket_path)

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
        """The reports received since the last round → one node report per deployment and kind
        of counts (logical, or physical per placement version), at most MAX_REPORT_COVERS each."""
        with self._lock:
            items, self._pending = self._pending, []
        groups: dict[tuple[str, str, int], list[tuple[_Rank, pb.ReportLoadRequest]]] = {}
        for rank, msg in items:
            kind = msg.WhichOneof("counts") or ""
            version = msg.physical.placement_version if kind == "physical" else 0
            groups.setdefault((msg.deployment, kind, version), []).append((rank, msg))
        for (deployment, kind, version), members in groups.items():
            for start in range(0, len(members), MAX_REPORT_COVERS):
                chunk = members[start : start + MAX_REPORT_COVERS]
                node = self._node_report(deployment, kind, version, [m for _, m in chunk])
                if node is None:  # counts the agent cannot sum: each rank sends its own
                    for rank, msg in chunk:
                        rank.tell(msg.seq, ON_YOUR_OWN)
                    continue
                report = _NodeReport(node, [(rank, msg.seq) for rank, msg in chunk])
                self._queues.setdefault(deployment, deque()).append(report)

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
            while queue:
                report = queue[0]
                stub = self.endpoints.stub()
                try:
                    stub.ReportLoad(
                        iter([report.message]), timeout=self.rpc_timeout_s, metadata=self.endpoints.metadata
                    )
                except grpc.RpcError as exc:
                    # ABORTED: partly counted before, never worth a repeat (TRANSIENT has it
                    # for other calls).
                    retry = exc.code() in TRANSIENT or exc.code() == grpc.StatusCode.NOT_FOUND
                    if retry and exc.code() != grpc.StatusCode.ABORTED:
                        if exc.code() != grpc.StatusCode.NOT_FOUND:
                            self.endpoints.failover(stub)
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

    def _give_back(self, deployment: str, queue: deque[_NodeReport]) -> None:
        """A node report of ``deployment`` was refused (partly counted before, or invalid): it,
        every later one and every report received since go back to their ranks, which send them
        on their own. None may go on from here: a rank re-sends from its oldest report on, and a
        later seq of its counted first would make its earlier ones duplicates (lost)."""
        told = [(rank, seq) for report in queue for rank, seq in report.ranks]
        queue.clear()
        with self._lock:
            told += [(rank, msg.seq) for rank, msg in self._pending if msg.deployment == deployment]
            self._pending = [(rank, msg) for rank, msg in self._pending if msg.deployment != deployment]
        for rank, seq in told:
            rank.tell(seq, ON_YOUR_OWN)


def main(argv: list[str] | None = None) -> int:
    """``eplb agent``: a host's node agent."""
    import argparse
    import signal

    ap = argparse.ArgumentParser(prog="eplb agent", description=__doc__.split("\n\n")[0])
    ap.add_argument("--socket", required=True, help="Unix socket path the host's ranks connect to")
    ap.add_argument("--address", required=True, help="the service, host:port[,host:port...] (replicas)")
    ap.add_argument("--interval-seconds", type=float, default=1.0, help="how often node reports go (default 1)")
    ap.add_argument("--token-file", help="bearer token file (an engine token)")
    args = ap.parse_args(argv)
    if args.interval_seconds <= 0:
        ap.error(f"--interval-seconds must be > 0, got {args.interval_seconds}")
    token = open(args.token_file).read().strip() if args.token_file else None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    agent = NodeAgent(args.socket, args.address, token=token, interval_s=args.interval_seconds).start()
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
