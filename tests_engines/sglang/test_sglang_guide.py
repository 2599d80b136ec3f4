"""docs/integrate-sglang.md's code blocks, extracted and run as written (gloo for nccl, the
address of a real service on 127.0.0.1), against SGLang 0.5.23's real global
``ExpertLocationMetadata`` (``init_by_mapping``, static dispatch) and its stat recorder on two
gloo ranks: the recorder counts the routed experts, the guide's ``report`` sends rank 0's
dumps, a forced re-plan is moved and switched by the guide's rollout, and SGLang's live maps
(host copies and dispatch table included) end as SGLang's own ``update()`` leaves them, the
expert weights moved. The model is a stand-in holding ``routed_experts_weights_of_layer``
(a dense row 0, MoE rows 1 and 2); CPU patches as in ``sglang_cpu`` and
``test_sglang_plugin`` (tests only)."""

from __future__ import annotations

import os
import re
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import numpy as np
import torch
import torch.distributed as dist
from sglang_cpu import metadata, sglang_args
from test_sglang_maps import TENSORS

import eplb
from eplb_tools.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
ROWS, S, HOT = [1, 2], 6, 7


def guide_blocks(address: str) -> list[str]:
    """The guide's ```python blocks, the address and the mover's backend swapped (gloo ranks)."""
    text = (ROOT / "docs" / "integrate-sglang.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    return [b.replace("127.0.0.1:50051", address).replace('"nccl"', '"gloo"') for b in blocks]


def test_the_guide_has_the_blocks_this_test_runs():
    blocks = guide_blocks("x")
    assert len(blocks) == 4 and "def report" in blocks[1] and "def before_step" in blocks[3]


def _rank(rank: int, world: int, port: int, address: str, out: dict) -> None:
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
        out[rank] = _guide(rank, world, address)
        dist.destroy_process_group()
    except BaseException:
        out[rank] = traceback.format_exc()
        raise


def _guide(rank: int, world: int, address: str) -> dict:
    from sglang.srt.eplb import expert_distribution
    from sglang.srt.eplb.expert_distribution import (
        ExpertDistributionRecorder,
        set_global_expert_distribution_recorder,
    )
    from sglang.srt.eplb.expert_location import (
        ExpertLocationMetadata,
        get_global_expert_location_metadata,
        set_global_expert_location_metadata,
    )

    from eplb_engine.adapters.sglang import to_sglang

    moe = eplb.Topology(2, 8, world * S, world)
    model_topo = moe.with_layers(3)
    initial = eplb.Placement.contiguous(model_topo)
    mine = slice(rank * S, (rank + 1) * S)
    # Patched in this test only, as in test_sglang_plugin: the recorder's dump empties the
    # device cache (torch.cpu has none) and its gatherer asks get_device(), which refuses a CPU.
    with (
        mock.patch.object(torch.cpu, "empty_cache", lambda: None, create=True),
        sglang_args(
            model_topo,
            expert_distribution_recorder_mode="stat",
            expert_distribution_recorder_buffer_size=2,
            ep_dispatch_algorithm="static",
        ),
    ):
        set_global_expert_location_metadata(
            metadata(torch.from_numpy(initial.phy2log.copy()), rank), allow_overwrite=True
        )
        with mock.patch.object(expert_distribution, "get_device", lambda *args: "cpu"):
            recorder = ExpertDistributionRecorder.init_new(get_global_expert_location_metadata(), rank)
        set_global_expert_distribution_recorder(recorder)
        weights = {
            row: [(row * 1000 + torch.tensor(initial.phy2log[row, mine], dtype=torch.float32))[:, None].repeat(1, 2)]
            for row in ROWS
        }
        model = SimpleNamespace(routed_experts_weights_of_layer=weights)
        ns = {"model": model, "topo": moe, "rank": rank}
        for block in guide_blocks(address):
            exec(compile(block, "integrate-sglang.md", "exec"), ns)
        client, reporter, rollout = ns["client"], ns["reporter"], ns["rollout"]
        try:
            deadline, step, forced, counted = time.monotonic() + 60, 0, False, 0
            hot = torch.full((64, 2), HOT, dtype=torch.int64)
            while True:
                ns["before_step"](step)
                live = get_global_expert_location_metadata()
                physical = live.logical_to_rank_dispatch_physical_map[:, HOT][ROWS]  # where this rank sends HOT
                with recorder.with_forward_pass(step, SimpleNamespace()):
                    for row, slot in zip(ROWS, physical.tolist()):
                        with recorder.with_current_layer(row):
                            recorder.on_select_experts(torch.full_like(hot, slot))
                if step % 2 == 1:  # every rank dumps at the same step (collective), rank 0 reports
                    dump = recorder.dump_record(output_mode="object")
                    counted += int(dump["logical_count"].sum())
                    ns["report"](dump)
                if step == 5:
                    assert reporter.flush(10)
                    dist.barrier()
                    if rank == 0:
                        forced = client.rebalance("my-model", force=True).published
                stop = torch.tensor([int(rollout.current.version >= 2 or time.monotonic() > deadline)])
                dist.all_reduce(stop, op=dist.ReduceOp.MAX)
                if stop.item():
                    break
                step += 1
                time.sleep(0.01)
            new = rollout.current.placement
            full = eplb.Placement(np.concatenate([initial.phy2log[:1], new.phy2log]), model_topo)
            theirs = metadata(torch.from_numpy(initial.phy2log.copy()), rank)
            theirs.update(ExpertLocationMetadata(**to_sglang(full, ep_rank=rank).fields()), update_layer_ids=ROWS)
            live = get_global_expert_location_metadata()
            assert reporter.flush(10)
            stats = reporter.stats()
            return {
                "version": rollout.current.version,
                "counted": counted,
                "forced": forced,
                "accepted": stats.accepted,
                "rejected": stats.rejected + stats.invalid_adds,
                "replicas_of_hot": int(new.logcnt[:, HOT].min()),
                "unlike_sglangs_update": [n for n in TENSORS if not torch.equal(getattr(live, n), getattr(theirs, n))],
                "weights_are_new": all(
                    torch.equal(
                        weights[row][0][:, 0], row * 1000 + torch.tensor(new.phy2log[i, mine], dtype=torch.float32)
                    )
                    for i, row in enumerate(ROWS)
                ),
            }
        finally:
            for name in ("watcher", "reporter", "rollout", "client"):
                ns[name].close()
            set_global_expert_distribution_recorder(None)


def test_the_guide_runs_as_written_on_sglangs_classes_through_a_replan():
    import torch.multiprocessing as mp

    sys.path.insert(0, str(ROOT / "tests" / "engine"))  # the service harness
    from svc_thread import ServerThread

    server = ServerThread().start()
    try:
        with mp.Manager() as manager:
            out = manager.dict()
            try:
                mp.spawn(_rank, args=(2, free_port(), server.address, out), nprocs=2, join=True)
            except Exception as exc:
                raise AssertionError(
                    "\n".join(v for v in dict(out).values() if isinstance(v, str)) or str(exc)
                ) from None
            res = dict(out)
    finally:
        server.stop()
    assert res[0]["forced"] and res[0]["accepted"] > 0 and res[1]["accepted"] == 0, res
    for rank in (0, 1):
        r = res[rank]
        assert r["counted"] > 0, (rank, r)  # the recorder recorded (the guide starts it)
        assert r["version"] == 2 and r["rejected"] == 0 and r["weights_are_new"], (rank, r)
        assert r["replicas_of_hot"] >= 2 and r["unlike_sglangs_update"] == [], (rank, r)
