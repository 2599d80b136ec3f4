"""The SGLang drop-in (``eplb_engine.adapters.sglang_plugin``) against SGLang 0.5.23's real plugin
machinery (entry-point discovery, ``load_plugins``, ``HookRegistry``), its ``EPLBManager``
call sites' constructor arguments, its expert-distribution recorder and its global
``ExpertLocationMetadata``. What is patched for a CPU: see ``sglang_cpu``."""

from __future__ import annotations

import os
from datetime import timedelta
from types import SimpleNamespace
from unittest import mock

import numpy as np
import pytest
import torch
import torch.distributed as dist
from sglang_cpu import metadata, sglang_args
from test_sglang_maps import TENSORS, random_placement

import eplb
from eplb_engine.adapters import sglang_plugin
from eplb_engine.adapters.sglang import to_sglang
from eplb_engine.adapters.sglang_plugin import TARGET, EplbServiceManager
from eplb_tools.ports import free_port


@pytest.fixture
def hooks(monkeypatch):
    """SGLang's plugin state as a fresh process has it; restored (and EPLBManager put back) after."""
    import sglang.srt.plugins as plugins
    from sglang.srt.eplb import eplb_manager
    from sglang.srt.plugins.hook_registry import HookRegistry

    original = eplb_manager.EPLBManager
    monkeypatch.setattr(plugins, "_plugins_loaded", False)
    HookRegistry.reset()
    yield HookRegistry
    HookRegistry.reset()
    eplb_manager.EPLBManager = original


def test_sglang_discovers_the_entry_point_and_the_plugin_replaces_eplb_manager(hooks, monkeypatch):
    """SGLang's own discovery finds eplb's entry point in the group it loads
    (sglang.srt.plugins); load_plugins() runs it, and the model runner's EPLBManager becomes
    EplbServiceManager. Without EPLB_ADDRESSES the plugin registers nothing."""
    import sglang.srt.plugins as plugins
    from sglang.srt.eplb import eplb_manager

    found = plugins.load_plugins_by_group(plugins.GENERAL_PLUGINS_GROUP)
    assert found["eplb"][0] is sglang_plugin.register
    monkeypatch.delenv(sglang_plugin.ENV_ADDRESSES, raising=False)
    sglang_plugin.register()
    assert TARGET not in hooks._hooks
    monkeypatch.setenv(sglang_plugin.ENV_ADDRESSES, "127.0.0.1:1")
    plugins.load_plugins()
    assert [h for _, h, _ in hooks._hooks[TARGET]] == [EplbServiceManager]
    assert eplb_manager.EPLBManager is EplbServiceManager


class _Rank:
    """What the manager drives of a BalancedRank: step() and reporter.add()."""

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.reported: list[np.ndarray] = []
        self.reported_steps: list[int] = []
        self.reporter = SimpleNamespace(
            add=lambda loads, steps=1: self.reported.append(loads) or self.reported_steps.append(steps) or True
        )

    def step(self, step: int) -> None:
        self.steps.append(step)

    def close(self) -> None:
        pass


@pytest.fixture
def one_rank():
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1, timeout=timedelta(seconds=30))
    yield
    dist.destroy_process_group()


def test_manager_constructs_from_the_model_runners_arguments_reports_and_switches(one_rank):
    """Built as SGLang's model runner builds its EPLBManager, with SGLang's real stat recorder:
    it starts recording, wires at the first pass, steps every pass, reports the recorder's
    counts of the MoE rows every report_every passes, and at a switch reports first, then
    leaves SGLang's global metadata as its own update() would."""
    from sglang.srt.eplb import expert_distribution
    from sglang.srt.eplb.expert_distribution import (
        ExpertDistributionRecorder,
        get_global_expert_distribution_recorder,
        set_global_expert_distribution_recorder,
    )
    from sglang.srt.eplb.expert_location import (
        ExpertLocationMetadata,
        get_global_expert_location_metadata,
        set_global_expert_location_metadata,
    )

    moe = eplb.Topology(2, 8, 12, 1)
    model_topo = moe.with_layers(3)  # row 0 dense
    rows = [1, 2]
    rng = np.random.default_rng(5)
    initial = eplb.Placement.contiguous(model_topo)
    # Patched in this test only: the recorder's first dump empties the device cache, which
    # torch.cpu has not got (a no-op is given).
    with (
        mock.patch.object(torch.cpu, "empty_cache", lambda: None, create=True),
        sglang_args(
            model_topo,
            enable_eplb=True,
            expert_distribution_recorder_mode="stat",
            eplb_rebalance_num_iterations=4,
            # what SGLang's argument resolution (not run by override_server_args) sets it to
            expert_distribution_recorder_buffer_size=4,
            ep_dispatch_algorithm="static",
        ),
    ):
        set_global_expert_location_metadata(metadata(torch.from_numpy(initial.phy2log.copy()), 0), allow_overwrite=True)
        # Patched in this test only: the recorder's gatherer asks sglang.srt.utils.get_device(),
        # which refuses a machine without an accelerator; it is told "cpu".
        with mock.patch.object(expert_distribution, "get_device", lambda *args: "cpu"):
            recorder = ExpertDistributionRecorder.init_new(get_global_expert_location_metadata(), 0)
        set_global_expert_distribution_recorder(recorder)
        weights = {row: [torch.zeros(12, 3)] for row in rows}
        model = SimpleNamespace(routed_experts_weights_of_layer=weights)
        fake = _Rank()
        wired = []
        manager = EplbServiceManager(
            model_config=SimpleNamespace(model_path="fake-moe"),
            get_model=lambda: model,
            get_expert_location_updater=lambda: None,
            get_expert_backup_client=lambda: None,
            get_weight_updater=lambda: None,
            wire=lambda m: wired.append(m) or setattr(m, "rows", rows) or fake,
        )
        assert get_global_expert_distribution_recorder().recording
        assert manager.report_every == 4 and not manager.a2a
        for _ in range(8):
            manager.on_forward_pass_end()
        assert wired == [manager] and fake.steps == list(range(1, 9))
        assert len(fake.reported) == 2 and all(r.shape == (2, 8) for r in fake.reported)
        # Each dump is every rank's counts of the 4 steps since the last: 4 x 1 rank-steps here.
        assert fake.reported_steps == [4, 4]
        # A switch: SGLang's update() on a copy, ours through the manager's on_switch.
        new = random_placement(rng, moe)
        full = eplb.Placement(np.concatenate([initial.phy2log[:1], new.phy2log]), model_topo)
        theirs = metadata(torch.from_numpy(initial.phy2log.copy()), 0)
        theirs.update(ExpertLocationMetadata(**to_sglang(full, ep_rank=0).fields()), update_layer_ids=rows)
        manager.on_switch(9, (0, 1), new)
        assert len(fake.reported) == 3
        live = get_global_expert_location_metadata()
        assert [n for n in TENSORS if not torch.equal(getattr(live, n), getattr(theirs, n))] == []
        set_global_expert_distribution_recorder(None)
        set_global_expert_location_metadata(None, allow_overwrite=True)


def _drop_in_rank(rank: int, world: int, port: int, address: str, out: dict) -> None:
    """One SGLang rank with the drop-in wired to a real service: SGLang's recorder fed with
    routed experts, EplbServiceManager (its own wire_rank: BalancedRank), a forced re-plan."""
    import time
    import traceback

    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        os.environ[sglang_plugin.ENV_ADDRESSES] = address
        os.environ[sglang_plugin.ENV_DEPLOYMENT] = "drop-in"
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
        out[rank] = _drop_in(rank, world)
        dist.destroy_process_group()
    except BaseException:
        out[rank] = traceback.format_exc()
        raise
    finally:
        time.sleep(0)


def _drop_in(rank: int, world: int) -> dict:
    import time

    from sglang.srt.eplb import expert_distribution
    from sglang.srt.eplb.expert_distribution import (
        ExpertDistributionRecorder,
        get_global_expert_distribution_recorder,
        set_global_expert_distribution_recorder,
    )
    from sglang.srt.eplb.expert_location import (
        get_global_expert_location_metadata,
        set_global_expert_location_metadata,
    )

    from eplb_engine.client import ServiceClient

    S = 6
    moe = eplb.Topology(2, 8, world * S, world)
    model_topo = moe.with_layers(3)
    rows = [1, 2]
    initial = eplb.Placement.contiguous(model_topo)
    mine = slice(rank * S, (rank + 1) * S)
    with (
        mock.patch.object(torch.cpu, "empty_cache", lambda: None, create=True),
        sglang_args(
            model_topo,
            enable_eplb=True,
            expert_distribution_recorder_mode="stat",
            eplb_rebalance_num_iterations=2,
            expert_distribution_recorder_buffer_size=2,
            ep_dispatch_algorithm="static",
        ),
    ):
        set_global_expert_location_metadata(
            metadata(torch.from_numpy(initial.phy2log.copy()), rank), allow_overwrite=True
        )
        with mock.patch.object(expert_distribution, "get_device", lambda *args: "cpu"):  # see the test above
            recorder = ExpertDistributionRecorder.init_new(get_global_expert_location_metadata(), rank)
        set_global_expert_distribution_recorder(recorder)
        weights = {
            row: [(row * 1000 + torch.tensor(initial.phy2log[row, mine], dtype=torch.float32))[:, None].repeat(1, 2)]
            for row in rows
        }
        model = SimpleNamespace(routed_experts_weights_of_layer=weights)
        manager = EplbServiceManager(
            model_config=SimpleNamespace(model_path="fake-moe"),
            get_model=lambda: model,
            get_expert_location_updater=lambda: None,
            get_expert_backup_client=lambda: None,
            get_weight_updater=lambda: None,
        )
        # Expert 7 hot: every token of this rank goes to its slot (rank 1 holds expert 7's slot).
        hot = torch.full((64, 2), 7, dtype=torch.int64)
        deadline, step, forced = time.monotonic() + 60, 0, False
        client = ServiceClient(os.environ[sglang_plugin.ENV_ADDRESSES])
        while True:
            live = get_global_expert_location_metadata()
            physical = live.logical_to_rank_dispatch_physical_map[:, 7][rows]  # where this rank sends expert 7
            with recorder.with_forward_pass(step, SimpleNamespace()):
                for row, slot in zip(rows, physical.tolist()):
                    with recorder.with_current_layer(row):
                        recorder.on_select_experts(torch.full_like(hot, slot))
            manager.on_forward_pass_end()
            step += 1
            if step == 6:
                assert manager.rank.reporter.flush(10)
                dist.barrier()  # rank 0's reports are in
                if rank == 0:
                    forced = client.rebalance("drop-in", force=True).published
            stop = torch.tensor([int(manager.rank.rollout.current.version >= 2 or time.monotonic() > deadline)])
            dist.all_reduce(stop, op=dist.ReduceOp.MAX)
            if stop.item():
                break
            time.sleep(0.01)
        current = manager.rank.rollout.current
        stats = manager.rank.reporter.stats()
        new = current.placement
        live = get_global_expert_location_metadata()
        result = {
            "version": current.version,
            "forced": forced,
            "accepted": stats.accepted,
            "replicas_of_7": int(new.logcnt[:, 7].min()),
            "map_is_new": live.physical_to_logical_map_cpu[rows].tolist() == new.phy2log.tolist()
            and live.physical_to_logical_map[rows].tolist() == new.phy2log.tolist(),
            "weights_are_new": all(
                torch.equal(weights[row][0][:, 0], row * 1000 + torch.tensor(new.phy2log[i, mine], dtype=torch.float32))
                for i, row in enumerate(rows)
            ),
            "recorder_saw": bool(get_global_expert_distribution_recorder().recording),
        }
        manager.close()
        client.close()
        set_global_expert_distribution_recorder(None)
        return result


def test_drop_in_follows_a_real_service_through_a_replan():
    """The drop-in end to end on 2 gloo ranks with a real service: SGLang's recorder counts the
    routed tokens, rank 0 reports them (rank 1 reports nothing: the counts are all-reduced), a
    forced re-plan gives the hot expert more replicas, and every rank ends on version 2 with
    SGLang's global maps (host copies included) and its expert weights moved to it."""
    import sys
    from pathlib import Path

    import torch.multiprocessing as mp

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "engine"))  # the service harness
    from svc_thread import ServerThread

    server = ServerThread().start()
    try:
        with mp.Manager() as manager:
            out = manager.dict()
            try:
                mp.spawn(_drop_in_rank, args=(2, free_port(), server.address, out), nprocs=2, join=True)
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
        assert r["version"] == 2 and r["map_is_new"] and r["weights_are_new"] and r["recorder_saw"], (rank, r)
        assert r["replicas_of_7"] >= 2, r
