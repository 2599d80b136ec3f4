"""``eplb serve --processes N``: one instance served by N processes on one port.

gRPC's own pattern for using several cores from Python: each process runs a whole server (its
event loop, its balancer, as separate instances have) bound to the same port with
``SO_REUSEPORT``, and the kernel spreads connections over them. They share their state through
Redis exactly as separate instances do, so every guarantee across instances holds unchanged:
durability and dedup by ``(rank, seq)`` in the store, version safety by the publish script and
the planning lease, tenancy per call, and draining on SIGTERM in each process.

This process is only the supervisor: it checks that the port is free (``SO_REUSEPORT`` lets
any process of the same user bind it too, so the check comes first), starts the serving
processes (each told the port, ``SO_REUSEPORT`` on, and its own ``/metrics`` port: the given
one plus its index), prints the one ``listening on`` line once all listen, forwards SIGTERM,
SIGINT and SIGHUP (with an auth file; without one SIGHUP stops the instance) to them, and
starts again one that dies while the instance runs. A serving
process ends with its supervisor (``PR_SET_PDEATHSIG``), so a killed supervisor leaves no
process serving the port behind.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable

__all__ = ["WORKER_ENV", "supervise"]

log = logging.getLogger(__name__)

# Set in a serving process's environment: its index (SO_REUSEPORT on, the port as given).
WORKER_ENV = "_EPLB_SERVE_PROCESS"
# A serving process that dies within this of its start is not started again (a start error).
_START_S = 30.0
_RESTART_BACKOFF_S = 1.0


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the supervisor dies (Linux ``prctl``)."""
    libc = ctypes.CDLL(None, use_errno=True)
    PR_SET_PDEATHSIG = 1
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class _Worker:
    """One serving process: its index, its ``Popen``, when it started."""

    def __init__(self, index: int, argv: list[str]) -> None:
        self.index = index
        self.argv = argv
        self.proc: subprocess.Popen | None = None
        self.started = 0.0
        self.listening = threading.Event()

    def start(self) -> None:
        env = dict(os.environ, **{WORKER_ENV: str(self.index)})
        self.listening.clear()
        self.proc = subprocess.Popen(
            self.argv,
            env=env,
            stdout=subprocess.PIPE,
            text=True,
            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
        )
        self.started = time.monotonic()
        threading.Thread(target=self._read, args=(self.proc,), daemon=True, name=f"serve-{self.index}").start()

    def _read(self, proc: subprocess.Popen) -> None:
        # Its stdout says only "listening on"; read to the end so it never blocks on a full pipe.
        assert proc.stdout is not None
        for line in proc.stdout:
            if "listening on" in line:
                self.listening.set()


def free_port(host: str) -> int:
    """A port nothing listens on at ``host`` (for ``--port 0``: the processes must share one)."""
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host.strip("[]"), 0))
        return s.getsockname()[1]


def _status(code: int) -> int:
    """A child's return code as an exit status: a signal's death is 128 + the signal, as in a shell."""
    return 128 - code if code < 0 else code


def supervise(
    processes: int,
    port: int,
    argv: list[str],
    metrics_port: int | None,
    listening_line: Callable[[int], str],
    reload_on_hup: bool = False,
) -> int:
    """Runs ``processes`` serving processes of ``eplb serve`` ``argv`` on ``port`` until SIGTERM
    or SIGINT; their exit status (the first non-zero), or that of one that could not start.
    SIGHUP is forwarded where it reloads the auth file (``reload_on_hup``); without one it stops
    the instance gracefully (one process without an auth file ends at SIGHUP too)."""
    base = [sys.executable, "-m", "eplb_tools.cli", "serve", *argv, "--processes", "1", "--port", str(port)]
    workers = []
    for i in range(processes):
        extra = [] if metrics_port is None else ["--metrics-port", str(metrics_port + i if metrics_port else 0)]
        workers.append(_Worker(i, base + extra))
    stopping = threading.Event()

    def forward(sig: int, _frame: object) -> None:
        if sig == signal.SIGHUP and not reload_on_hup:
            sig = signal.SIGTERM
        if sig in (signal.SIGTERM, signal.SIGINT):
            stopping.set()
        for w in workers:
            if w.proc is not None and w.proc.poll() is None:
                w.proc.send_signal(sig)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    for w in workers:
        w.start()
    # Up when every process listens; a process that exits first is a start error (its own
    # message is on stderr): stop the others and exit with its status.
    while not all(w.listening.is_set() for w in workers):
        failed = next((w for w in workers if w.proc.poll() is not None), None)
        if failed is not None or stopping.is_set():
            forward(signal.SIGTERM, None)
            codes = [w.proc.wait() for w in workers]
            if failed is None:
                return 0
            return _status(failed.proc.returncode) or 2
        time.sleep(0.02)
    print(listening_line(port), flush=True)
    log.info("%d serving processes on port %d", processes, port)
    while not stopping.is_set():
        for w in workers:
            code = w.proc.poll()
            if code is None or stopping.is_set():
                continue
            # An error exit before it listened again: a start error, which another try repeats.
            # A death by a signal (the OOM killer, an operator) is started again like any other.
            if code > 0 and time.monotonic() - w.started < _START_S and not w.listening.is_set():
                log.error("serving process %d could not start again (exit %s); stopping", w.index, code)
                forward(signal.SIGTERM, None)
                break
            log.error("serving process %d (pid %d) exited with %s; starting it again", w.index, w.proc.pid, code)
            if stopping.wait(_RESTART_BACKOFF_S):
                w.proc = None  # stopped meanwhile: nothing to start (its death was said above)
                break
            w.start()
        stopping.wait(0.2)
    forward(signal.SIGTERM, None)  # (again: one started just before the stop got none)
    # One killed by the signal it was sent before it set its handler (starting) had nothing to drain.
    codes = [w.proc.wait() for w in workers if w.proc is not None]
    return next((_status(c) for c in codes if c not in (0, -signal.SIGTERM, -signal.SIGINT)), 0)
