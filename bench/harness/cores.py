"""Cores and processes for the service benchmarks: core lists (``--cpus-*``), pinning this
process (and what it starts next), the CPU of ``eplb serve`` processes with their serving
processes (``--processes``), and a ``grpc.aio`` channel on a connection of its own."""

from __future__ import annotations

import os
from pathlib import Path

from eplb_service.processes import WORKER_ENV

__all__ = ["cpu_list", "own_channel", "pin", "proc_cpu", "serving"]


def cpu_list(text: str) -> list[int]:
    """``"0,2-4"`` → ``[0, 2, 3, 4]``; ``ValueError`` naming the part that is not a core or a range."""
    cores: list[int] = []
    for part in filter(None, text.split(",")):
        lo, _, hi = part.partition("-")
        try:
            cores.extend(range(int(lo), int(hi or lo) + 1))
        except ValueError:
            raise ValueError(f"cpu list {text!r}: {part!r} is not a core number or a range such as 2-15") from None
    return cores


def pin(cores: list[int] | None) -> None:
    """This process (and so what it starts next) on ``cores``; None: all this process may use."""
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cores or _ALL_CORES)


_ALL_CORES = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


def own_channel(target: str):
    """A ``grpc.aio`` channel on a connection of its own (the engine client's options)."""
    from eplb_engine.client import channel_options, open_channel

    return open_channel(target, None, [*channel_options(16 << 20), ("grpc.use_local_subchannel_pool", 1)], aio=True)


def serving(pid: int) -> list[int]:
    """``pid`` and, where it supervises ``eplb serve --processes``, its serving processes (not
    the plan and compute workers under those)."""
    out = [pid]
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            if int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1]) != pid:
                continue
            if WORKER_ENV.encode() + b"=" in Path(f"/proc/{entry}/environ").read_bytes():
                out.append(int(entry))
        except OSError:
            continue
    return out


def proc_cpu(pids: list[int]) -> float:
    """CPU seconds (user + system) the processes ``pids`` used so far, each with its serving
    processes (``--serve-args "--processes N"``); 0 where /proc is absent."""
    total = 0.0
    for pid in (p for top in pids for p in serving(top)):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total
