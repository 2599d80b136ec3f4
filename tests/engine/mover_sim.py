"""Test helpers for the weight mover: weights that encode (layer, expert, tensor), and ranks
simulated as threads of one process exchanging through queues (a fake transport)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

import numpy as np
import torch

import eplb
from eplb_engine.transport import P2P

# name -> (per-slot shape, dtype): weights and a scale of another shape and dtype.
TENSORS = {"w13": ((4, 3), torch.float32), "w2": ((3, 2), torch.float32), "w13_scale": ((5,), torch.int64)}


def encoded_layers(
    placement: eplb.Placement, gpu: int, tensors=TENSORS, device: str = "cpu"
) -> list[dict[str, torch.Tensor]]:
    """This gpu's tensors per layer, slot ``s`` holding ``code(layer, expert, name) + arange``."""
    topo = placement.topology
    S = topo.slots_per_gpu
    out = []
    for layer in range(topo.num_layers):
        experts = placement.phy2log[layer, gpu * S : (gpu + 1) * S]
        out.append(
            {
                name: expected_slots(layer, experts, k, shape, dtype, device)
                for k, (name, (shape, dtype)) in enumerate(sorted(tensors.items()))
            }
        )
    return out


def expected_slots(layer: int, experts: np.ndarray, k: int, shape, dtype, device="cpu") -> torch.Tensor:
    n = int(np.prod(shape))
    base = (layer * 100_000 + torch.as_tensor(experts.astype(np.int64)) * 10 + k) * 1000
    return (base[:, None] + torch.arange(n)[None]).reshape(len(experts), *shape).to(dtype).to(device)


def check_layers(layers: list[dict[str, torch.Tensor]], placement: eplb.Placement, gpu: int, tensors=TENSORS) -> None:
    topo = placement.topology
    S = topo.slots_per_gpu
    for layer, named in enumerate(layers):
        experts = placement.phy2log[layer, gpu * S : (gpu + 1) * S]
        for k, (name, (shape, dtype)) in enumerate(sorted(tensors.items())):
            want = expected_slots(layer, experts, k, shape, dtype)
            got = named[name].cpu()
            bad = [s for s in range(S) if not torch.equal(got[s], want[s])]
            assert not bad, f"gpu {gpu} layer {layer} {name}: slots {bad} wrong (want experts {experts[bad].tolist()})"


class ThreadWorld:
    """``size`` ranks as threads; a send copies into a queue per (src, dst), a receive takes
    from it in order, so a mismatch between both sides' operation lists shows as a shape or
    content error or a timeout."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.queues = {(a, b): queue.Queue() for a in range(size) for b in range(size) if a != b}
        self.rounds: list[tuple[int, frozenset[int]]] = []  # (rank, peers) per exchange
        self._lock = threading.Lock()

    def transport(self, rank: int) -> ThreadTransport:
        return ThreadTransport(self, rank)

    def run(self, fn: Callable[[int], object]) -> list[object]:
        results: list[object] = [None] * self.size
        errors: list[BaseException] = []

        def body(rank: int) -> None:
            try:
                results[rank] = fn(rank)
            except BaseException as e:  # surfaced to the test below
                errors.append(e)

        threads = [threading.Thread(target=body, args=(r,)) for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        if errors:
            raise errors[0]
        assert not any(t.is_alive() for t in threads), "a simulated rank hung"
        return results


class ThreadTransport:
    def __init__(self, world: ThreadWorld, rank: int) -> None:
        self.world, self.rank, self.size = world, rank, world.size
        self.started = False

    def start(self, device: torch.device) -> None:
        self.started = True

    def exchange(self, ops: list[P2P]) -> None:
        assert ops, "the mover never sends an empty round"
        with self.world._lock:
            self.world.rounds.append((self.rank, frozenset(op.peer for op in ops)))
        sent = [(op.peer, op.tensor.clone()) for op in ops if op.send]
        if any(t.is_cuda for _, t in sent):
            torch.cuda.current_stream().synchronize()  # the clones are done before a peer reads them
        for peer, tensor in sent:
            self.world.queues[(self.rank, peer)].put(tensor)
        for op in ops:
            if not op.send:
                got = self.world.queues[(op.peer, self.rank)].get(timeout=20)
                assert got.shape == op.tensor.shape and got.dtype == op.tensor.dtype, (got.shape, op.tensor.shape)
                op.tensor.copy_(got)
