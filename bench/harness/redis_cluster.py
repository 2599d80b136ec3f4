"""A private Redis Cluster for tests and benchmarks: ``masters`` cluster-enabled ``redis-server``s
on free loopback ports, each with its own directory under ``directory``, joined by
``redis-cli --cluster create … --cluster-replicas 0`` with ``cluster-require-full-coverage no``
(a dead master takes down only its own slots). A master can be SIGKILLed and started again on
its port and directory (its ``nodes.conf`` brings it back into the cluster with its slots).

``.ci/run`` starts the same cluster from bash (``redis-server`` flags as in ``start_node``, a
pid file per node) and names it in ``EPLB_TEST_CLUSTER_DIR`` and ``EPLB_TEST_CLUSTER_PORTS``;
:meth:`ClusterProcesses.attach` takes that one over instead of starting another.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis

from eplb_tools.ports import free_port

from .processes import wait_loaded

__all__ = ["ClusterProcesses"]


def _cluster_port() -> int:
    """A free port whose cluster bus port (``port + 10000``) exists and is free too."""
    while True:
        port = free_port()
        if port + 10000 > 65535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port


@dataclass
class ClusterProcesses:
    """``appendfsync`` None runs without persistence (a restarted master comes back empty)."""

    directory: Path
    masters: int = 3
    appendfsync: str | None = "always"
    ports: list[int] = field(default_factory=list)
    procs: dict[int, subprocess.Popen] = field(default_factory=dict)
    _killed: set[int] = field(default_factory=set)

    @classmethod
    def attach(cls, directory: Path, ports: list[int]) -> ClusterProcesses:
        """A cluster started by someone else with ``start_node``'s flags (``.ci/run``): killed
        by the pid in its node's pid file, restarted by ``start_node``, stopped by its owner."""
        cluster = cls(directory, ports=list(ports))
        cluster.wait_ok()
        return cluster

    @property
    def url(self) -> str:
        """The service's ``--redis-url``: every master as a seed node."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def start(self, timeout: float = 20.0) -> None:
        self.ports = [_cluster_port() for _ in range(self.masters)]
        try:
            for port in self.ports:
                self.start_node(port)
            subprocess.run(
                ["redis-cli", "--cluster", "create", *(f"127.0.0.1:{p}" for p in self.ports)]
                + ["--cluster-replicas", "0", "--cluster-yes"],
                check=True,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                timeout=timeout,
            )
            self.wait_ok(timeout)
        except BaseException:
            self.stop()
            raise

    def start_node(self, port: int, timeout: float = 10.0) -> None:
        self._killed.discard(port)
        node_dir = self.directory / f"node-{port}"
        node_dir.mkdir(parents=True, exist_ok=True)
        persistence = (
            ["--appendonly", "yes", "--appendfsync", self.appendfsync] if self.appendfsync else ["--appendonly", "no"]
        )
        self.procs[port] = subprocess.Popen(
            ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", str(node_dir), "--save", ""]
            + persistence
            + ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
            + ["--cluster-require-full-coverage", "no", "--cluster-node-timeout", "1000"]
            + ["--logfile", str(node_dir / "redis.log"), "--pidfile", str(node_dir / "redis.pid")],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            wait_loaded(port, timeout, f" (see {node_dir / 'redis.log'})")
        except TimeoutError:
            if self.procs[port].poll() is not None:
                raise TimeoutError(f"redis-server on port {port} exited; see {node_dir / 'redis.log'}") from None
            raise

    def wait_ok(self, timeout: float = 20.0) -> None:
        """Until every live master says the cluster is ok and every slot has an owner."""
        deadline = time.monotonic() + timeout
        while True:
            states = []
            for port in self._live():
                with redis.Redis(port=port) as client:
                    try:
                        info = client.execute_command("CLUSTER INFO")
                    except redis.RedisError:
                        info = {}
                states.append(info.get("cluster_state") == "ok" and int(info.get("cluster_slots_assigned", 0)) == 16384)
            if all(states):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"redis cluster on {self.ports} not ok within {timeout:g}s")
            time.sleep(0.1)

    def port_of(self, key: str) -> int:
        """The port of the master that owns ``key``'s slot."""
        with redis.Redis(port=self._live()[0]) as client:
            slot = client.execute_command("CLUSTER KEYSLOT", key)
            for start, end, master, *_ in client.execute_command("CLUSTER SLOTS"):
                if start <= slot <= end:
                    return int(master[1])
        raise LookupError(f"no master owns the slot of {key!r}")

    def _live(self) -> list[int]:
        return [p for p in self.ports if p not in self._killed]

    def kill(self, port: int) -> None:
        """SIGKILL one master: no shutdown save, no goodbye to clients."""
        self._killed.add(port)
        proc = self.procs.pop(port, None)
        if proc is not None:
            proc.kill()
            proc.wait(10)
            return
        pid = int((self.directory / f"node-{port}" / "redis.pid").read_text())
        os.kill(pid, signal.SIGKILL)
        with redis.Redis(port=port) as client:
            while True:  # until the port refuses
                try:
                    client.ping()
                except redis.ConnectionError:
                    return
                time.sleep(0.02)

    def _pid(self, port: int) -> int:
        proc = self.procs.get(port)
        if proc is not None:
            return proc.pid
        return int((self.directory / f"node-{port}" / "redis.pid").read_text())

    def pause(self, port: int) -> None:
        """SIGSTOP one master: its sockets stay open and nothing answers (a hung master)."""
        os.kill(self._pid(port), signal.SIGSTOP)

    def resume(self, port: int) -> None:
        """SIGCONT a master ``pause`` stopped."""
        os.kill(self._pid(port), signal.SIGCONT)

    def stop(self) -> None:
        for port in list(self.procs):
            proc = self.procs.pop(port)
            proc.terminate()
            proc.wait(10)
