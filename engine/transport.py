"""How a mover's peer-to-peer rounds reach other ranks.

A ``Transport`` runs one round's sends and receives of this rank and returns when they have
been issued in order on the caller's current CUDA stream (or completed, on CPU).
``DistTransport`` uses ``torch.distributed.batch_isend_irecv`` on a process group (gloo
on CPU, NCCL on GPU). Tests and simulations may pass their own transport.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

__all__ = ["P2P", "DistTransport", "Transport"]


@dataclass(frozen=True)
class P2P:
    """One point-to-point operation: send ``tensor`` to ``peer`` or receive into it from ``peer``.

    ``peer`` is a rank of the mover's group (= a gpu of the topology). Operations between two
    ranks match in the order both sides list them.
    """

    send: bool
    peer: int
    tensor: torch.Tensor


class Transport(Protocol):
    rank: int
    size: int

    def start(self, device: torch.device) -> None:
        """Called by every rank before its first round (collective)."""

    def exchange(self, ops: list[P2P]) -> None:
        """Run one round of this rank's operations (never empty)."""


class DistTransport:
    """``torch.distributed`` point-to-point through one ``batch_isend_irecv`` per round."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        if not dist.is_initialized():
            raise ValueError("torch.distributed is not initialised: call init_process_group first or pass a transport")
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.size = dist.get_world_size(self.group)
        self._global = [dist.get_global_rank(self.group, r) for r in range(self.size)]
        self._started = False

    def start(self, device: torch.device) -> None:
        # NCCL requires every rank of a group to join its first point-to-point batch; one
        # collective first makes later rounds, where only some ranks take part, safe.
        if not self._started:
            dist.all_reduce(torch.zeros(1, device=device), group=self.group)
            self._started = True

    def exchange(self, ops: list[P2P]) -> None:
        p2p = [
            dist.P2POp(dist.isend if op.send else dist.irecv, op.tensor, self._global[op.peer], self.group)
            for op in ops
        ]
        for work in dist.batch_isend_irecv(p2p):
            # On NCCL, wait() makes the current stream wait for the transfer (the host goes on).
            work.wait()
