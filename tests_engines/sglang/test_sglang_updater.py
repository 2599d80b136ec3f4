"""eplb's ``WeightMover`` against SGLang 0.5.23's own ``ExpertLocationUpdater`` on gloo ranks:
random transitions of a model with a dense first layer, each done by both (SGLang's weights
through its updater and its global metadata's ``update()``, ours through ``WeightMover`` and
``apply_to_sglang``), compared slot by slot. Our own test, written for this stage (SGLang's
repository has an updater test of its own; this is not it).

Patched for a CPU, in this test only: ``ExpertLocationUpdater.update`` empties the device
cache on its first call (``torch.get_device_module().empty_cache()``), which ``torch.cpu``
does not have: a no-op one is given. The rest: see ``sglang_cpu``."""

from __future__ import annotations

import os
import traceback
from datetime import timedelta
from unittest import mock

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from sglang_cpu import metadata, sglang_args
from test_sglang_maps import TENSORS, random_placement

import eplb

E, S, WIDTHS = 8, 5, (3, 2)  # experts, slots per gpu, the widths of the two expert tensors
ROWS = [1, 2]  # the MoE layers' rows in SGLang's maps (row 0: a dense layer)


def coded(row: int, experts: torch.Tensor | np.ndarray, width: int) -> torch.Tensor:
    """``[slots, width]`` float32 naming (row, expert) in every element."""
    experts = torch.as_tensor(np.array(experts), dtype=torch.float32)
    return (row * 1000 + experts)[:, None].repeat(1, width).contiguous()


def _rank(rank: int, world: int, port: int, seed: int, transitions: int, nnodes: int, out: dict) -> None:
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
        out[rank] = _transitions(rank, world, seed, transitions, nnodes)
        dist.destroy_process_group()
    except BaseException:
        out[rank] = traceback.format_exc()
        raise


def _transitions(rank: int, world: int, seed: int, transitions: int, nnodes: int) -> dict:
    from sglang.srt.eplb.expert_location import get_global_expert_location_metadata as live_metadata
    from sglang.srt.eplb.expert_location import set_global_expert_location_metadata
    from sglang.srt.eplb.expert_location_updater import ExpertLocationUpdater

    from eplb_engine.adapters.sglang import apply_to_sglang
    from eplb_engine.mover import WeightMover

    moe = eplb.Topology(len(ROWS), E, world * S, world)
    model = moe.with_layers(ROWS[-1] + 1)
    rng = np.random.default_rng(seed)  # the same sequence of placements on every rank
    old = random_placement(rng, moe)
    dense = eplb.Placement.contiguous(model).phy2log[:1]
    mine = slice(rank * S, (rank + 1) * S)
    counts = {"transitions": 0, "moved_slots": 0, "weight_mismatches": 0, "map_mismatches": 0}
    with (
        sglang_args(model, ep_dispatch_algorithm="static", nnodes=nnodes),
        mock.patch.object(torch.cpu, "empty_cache", lambda: None, create=True),
    ):
        full = lambda p: torch.from_numpy(np.concatenate([dense, p.phy2log]).astype(np.int64))
        set_global_expert_location_metadata(metadata(full(old), rank), allow_overwrite=True)
        ours_md = metadata(full(old), rank)
        theirs = {row: [coded(row, old.phy2log[i, mine], w) for w in WIDTHS] for i, row in enumerate(ROWS)}
        ours = [{f"t{k}": t.clone() for k, t in enumerate(theirs[row])} for row in ROWS]
        updater = ExpertLocationUpdater()
        for _ in range(transitions):
            new = random_placement(rng, moe)
            updater.update(theirs, metadata(full(new), rank), update_layer_ids=ROWS, nnodes=nnodes, rank=rank)
            WeightMover(ours, old, new).run()
            apply_to_sglang(ours_md, new, layer_ids=ROWS, ep_rank=rank, nnodes=nnodes)
            dist.barrier()
            for i, row in enumerate(ROWS):
                want = [coded(row, new.phy2log[i, mine], w) for w in WIDTHS]
                got = [ours[i][f"t{k}"] for k in range(len(WIDTHS))]
                counts["weight_mismatches"] += sum(
                    not (torch.equal(a, w) and torch.equal(b, w)) for a, b, w in zip(theirs[row], got, want)
                )
            live = live_metadata()
            counts["map_mismatches"] += sum(not torch.equal(getattr(live, n), getattr(ours_md, n)) for n in TENSORS)
            counts["moved_slots"] += int((old.phy2log != new.phy2log).sum())
            counts["transitions"] += 1
            old = new
    return counts


@pytest.mark.parametrize(("world", "nnodes", "transitions"), [(2, 1, 100), (4, 2, 25)])
def test_weight_mover_matches_sglangs_expert_location_updater(world, nnodes, transitions):
    """100 random transitions on 2 ranks, 25 on 4 ranks as 2 nodes (the updater's same-node and
    cross-node paths): SGLang's moved weights, ours and the expected ones agree slot by slot;
    its updated global metadata equals what apply_to_sglang wrote (host copies, table)."""
    from eplb_tools.ports import free_port

    with mp.Manager() as manager:
        out = manager.dict()
        try:
            mp.spawn(_rank, args=(world, free_port(), 7 + world, transitions, nnodes, out), nprocs=world, join=True)
        except Exception as exc:
            raise AssertionError("\n".join(v for v in dict(out).values() if isinstance(v, str)) or str(exc)) from None
        res = dict(out)
    for rank in range(world):
        r = res[rank]
        assert r["transitions"] == transitions and r["moved_slots"] > transitions, r
        assert r["weight_mismatches"] == 0 and r["map_mismatches"] == 0, (rank, r)
