"""WeightMover over real torch.distributed gloo process groups: 2 and 4 processes on 127.0.0.1."""

from __future__ import annotations

import traceback

import numpy as np
import pytest
import torch.distributed as dist
import torch.multiprocessing as mp
from mover_sim import check_layers, encoded_layers

import eplb
from eplb.transfer import staged_slots
from eplb_engine import WeightMover
from eplb_tools.ports import free_port


def _transitions(size: int, seed: int) -> list[tuple[eplb.Placement, eplb.Placement, str, int, int]]:
    """Random old -> new pairs over two nodes (when 4 ranks), with replica gains and losses."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(8):
        topo = eplb.Topology(3, 2 * size + 1, 3 * size, size, 2 if size == 4 else 1)
        L, E, P = topo.num_layers, topo.num_experts, topo.num_slots
        pl = []
        for _ in range(2):
            rows = np.concatenate([np.tile(np.arange(E), (L, 1)), rng.integers(0, E, (L, P - E))], axis=1)
            pl.append(eplb.Placement(rng.permuted(rows, axis=1), topo))
        mode = "direct" if i % 2 == 0 else "staged" if i % 4 == 1 else "chunked"
        out.append((pl[0], pl[1], mode, 1 + i % 3, 1 + i % 2))
    return out


def _worker(rank: int, size: int, port: int, seed: int, errors) -> None:
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
        # a subgroup, as an engine would give the mover its own group
        group = dist.new_group(list(range(size)), backend="gloo")
        chunked: list[int] = []
        for old, new, mode, per_call, round_experts in _transitions(size, seed):
            layers = encoded_layers(old, rank)
            storage = [t.data_ptr() for layer in layers for t in layer.values()]
            mover = WeightMover(
                layers, old, new, group, layers_per_call=per_call, round_experts=round_experts, verify=True
            )
            if mode == "staged":
                calls = 0
                while mover.prepare():
                    calls += 1
                assert calls == -(-old.topology.num_layers // per_call)
                check_layers(layers, old, rank)
                report = mover.commit()
                assert report.ok, report.mismatches
            elif mode == "chunked":  # the smallest budget: chunks of about a layer, buffers reused
                budget = int(staged_slots(mover.schedule).max()) * mover.slot_bytes
                mover = WeightMover(layers, old, new, group, staging_bytes=budget, verify=True)
                for chunk in mover.chunks:
                    while mover.prepare():
                        pass
                    assert mover.commit().ok
                    rows = old.phy2log.copy()
                    rows[: chunk.stop] = new.phy2log[: chunk.stop]
                    check_layers(layers, eplb.Placement(rows, old.topology), rank)
                chunked.append(len(mover.chunks))
            else:
                while not mover.done:
                    assert mover.step().ok
            check_layers(layers, new, rank)
            assert [t.data_ptr() for layer in layers for t in layer.values()] == storage
        assert max(chunked) > 1, chunked
        dist.destroy_process_group()
    except BaseException:  # reported to the parent, which fails the test with it
        errors.put(f"rank {rank}: {traceback.format_exc()}")
        raise


@pytest.mark.parametrize("size", [2, 4])
def test_mover_over_gloo_processes(size: int) -> None:
    ctx = mp.get_context("fork")
    errors = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, size, port, 100 + size, errors)) for r in range(size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    hung = [p.pid for p in procs if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
    assert errors.empty(), errors.get()
    assert not hung, f"ranks hung: {hung}"
    assert all(p.exitcode == 0 for p in procs)
