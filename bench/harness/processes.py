"""Service instances and a private Redis as child processes, for shutdown and chaos runs.

``ServeProcess`` runs ``eplb serve`` on a fixed port (so a restarted instance keeps its address)
with its stderr appended to a log file; ``RedisProcess`` runs a private ``redis-server`` on a
free port in its own directory, with AOF ``appendfsync always`` by default so every write Redis
acknowledged survives a kill of Redis (without persistence a kill loses the state by design).
"""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis

from eplb_tools.ports import free_port

__all__ = ["RedisProcess", "ServeProcess", "serve_argv", "wait_loaded"]


def serve_argv(port: int, redis_url: str, prefix: str, *args: str) -> list[str]:
    """The command line of an ``eplb serve`` instance on 127.0.0.1:``port`` sharing ``redis_url``
    (``""``: the embedded in-memory store) under ``prefix``, with extra flags ``args``."""
    store = ["--redis-url", redis_url] if redis_url else []  # "": the embedded in-memory store
    return [
        sys.executable, "-m", "eplb_tools.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
        *store, "--key-prefix", prefix, *args,
    ]  # fmt: skip


@dataclass
class ServeProcess:
    """One ``eplb serve`` instance on ``127.0.0.1:port``; ``args`` are extra flags."""

    redis_url: str
    prefix: str
    log_path: Path
    args: tuple[str, ...] = ()
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        """Starts the process; it serves once its stdout says ``listening on`` (see ``wait_listening``)."""
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                serve_argv(self.port, self.redis_url, self.prefix, *self.args),
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
            )

    def wait_listening(self, timeout: float = 30.0) -> None:
        """Blocks until the instance prints its ``listening on`` line."""
        assert self.proc is not None and self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if "listening on" in line:
                return
            if not line and self.proc.poll() is not None:
                raise RuntimeError(f"eplb serve exited with {self.proc.returncode}; see {self.log_path}")
        raise TimeoutError(f"eplb serve on port {self.port} did not listen within {timeout:g}s")

    def signal(self, sig: int) -> None:
        if self.running:
            self.proc.send_signal(sig)

    def wait(self, timeout: float = 30.0) -> int:
        """The exit code (SIGKILL: -9)."""
        assert self.proc is not None
        code = self.proc.wait(timeout)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        return code

    def stop(self) -> None:
        """Kills the process if it still runs (clean-up)."""
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.wait()
            self.proc = None


def wait_loaded(port: int, timeout: float, why: str = "") -> None:
    """Until the ``redis-server`` on ``port`` serves data (PING answers while the AOF is still
    loading); ``TimeoutError`` after ``timeout`` seconds, with ``why`` appended."""
    client = redis.Redis(port=port)
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                if client.info("persistence").get("loading", 0) == 0:
                    return
            except (redis.ConnectionError, redis.BusyLoadingError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"redis-server on port {port} did not answer within {timeout:g}s{why}")
            time.sleep(0.02)
    finally:
        client.close()


@dataclass
class RedisProcess:
    """A private ``redis-server`` in ``directory``; ``appendfsync`` None runs without persistence."""

    directory: Path
    appendfsync: str | None = "always"
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> None:
        persistence = (
            ["--appendonly", "yes", "--appendfsync", self.appendfsync] if self.appendfsync else ["--appendonly", "no"]
        )
        self.proc = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(self.directory),
                "--save",
                "",
                *persistence,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_loaded(self.port, timeout)

    def kill(self) -> None:
        """SIGKILL: no shutdown save, no goodbye to clients."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(10)
            self.proc = None

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)
            self.proc = None
