"""docs/integrate-vllm.md's and docs/integrate-sglang.md's code blocks run as written (gloo for
nccl), on two ranks in separate processes holding fake engine state with the engines' shapes
and dtypes, against a real service, through a re-plan: the live maps and each rank's expert
weights end on the new version, and the service has both ranks' acks."""

from __future__ import annotations

import os
import re
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from svc_thread import ServerThread, free_port

import eplb
from eplb_engine.adapters.sglang import rank_dispatch_map, to_sglang
from eplb_engine.adapters.vllm import to_vllm
from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb

DOCS = Path(__file__).resolve().parents[2] / "docs"
TOPO = eplb.Topology(num_layers=2, num_experts=8, num_slots=12, num_gpus=2)
S = TOPO.slots_per_gpu
HOT = np.array([1.0] * 7 + [40.0])  # expert 7 (on gpu 1 in the contiguous map) takes most tokens
SGLANG_MOE_ROWS = [1, 2]  # a model whose layer 0 is dense


def doc_blocks(name: str, address: str) -> list[str]:
    blocks = re.findall(r"```python\n(.*?)```", (DOCS / name).read_text(), flags=re.S)
    return [b.replace("127.0.0.1:50051", address).replace('"nccl"', '"gloo"') for b in blocks]


def coded(layer: int, experts: np.ndarray, width: int) -> torch.Tensor:
    """``[slots, width]`` float32: every slot's values encode (layer, expert)."""
    return torch.from_numpy((layer * 100 + experts).astype(np.float32))[:, None].repeat(1, width).contiguous()


def slot_tokens(phy2log: np.ndarray, step: int) -> np.ndarray:
    """``[L, P]`` tokens one step routes to each slot: ``HOT`` per expert, split over its replicas."""
    placement = eplb.Placement(phy2log, TOPO)
    rows = np.arange(TOPO.num_layers)[:, None]
    return (HOT * (10 + step % 3))[phy2log] / placement.logcnt[rows, phy2log]


def vllm_engine(rank: int) -> tuple[dict, object, object]:
    """Fake vLLM state: ``EplbModelState``'s maps and window, ``model.expert_weights``."""
    initial = eplb.Placement.contiguous(TOPO)
    maps = to_vllm(initial)
    state = SimpleNamespace(
        physical_to_logical_map=maps.physical_to_logical_map.clone(),
        logical_to_physical_map=maps.logical_to_physical_map.clone(),
        logical_replica_count=maps.logical_replica_count.clone(),
        expert_load_window=torch.zeros((4, TOPO.num_layers, TOPO.num_slots), dtype=torch.int32),
    )
    mine = initial.phy2log[:, rank * S : (rank + 1) * S]
    model = SimpleNamespace(
        expert_weights=[[coded(layer, mine[layer], w) for w in (4, 2)] for layer in range(TOPO.num_layers)]
    )
    ns = {"state": state, "model": model}

    def step_done(step: int) -> None:  # what vLLM's EplbState.step() leaves in the window, then the guide's report
        state.expert_load_window[step % 4] = torch.from_numpy(
            slot_tokens(state.physical_to_logical_map.numpy(), step).round().astype(np.int32)
        )
        ns["report_step"]()

    def check(new: eplb.Placement) -> None:
        want = to_vllm(new)
        assert torch.equal(state.physical_to_logical_map, want.physical_to_logical_map)
        assert torch.equal(state.logical_to_physical_map, want.logical_to_physical_map)
        assert torch.equal(state.logical_replica_count, want.logical_replica_count)
        assert int(state.expert_load_window.abs().sum()) == 0  # zeroed after every report
        weights = model.expert_weights
        assert all(
            torch.equal(t, coded(layer, new.phy2log[layer, rank * S : (rank + 1) * S], t.shape[1]))
            for layer in range(TOPO.num_layers)
            for t in weights[layer]
        )

    return ns, step_done, check


class StandInRecorder:
    """SGLang's expert-distribution recorder as the guide uses it: ``dump_record`` returns the
    ``[layers, experts]`` counts since the last dump and resets them."""

    def __init__(self) -> None:
        self.pending = torch.zeros((3, TOPO.num_experts), dtype=torch.int64)
        self.dumps, self.recording = 0, False

    def start_record(self) -> None:
        self.recording = True

    def dump_record(self, output_mode: str = "file") -> dict:
        assert output_mode == "object" and self.recording
        out, self.pending = self.pending, torch.zeros_like(self.pending)
        self.dumps += 1
        return {"logical_count": out}


def stand_in_sglang(live: object, recorder: StandInRecorder) -> None:
    """The two SGLang modules the guide imports, in this process only (SGLang is not installed
    in the main suite; tests_engines/sglang/test_sglang_guide.py runs the guide on the real ones)."""
    import sys
    import types

    for name in ("sglang", "sglang.srt", "sglang.srt.eplb"):
        sys.modules.setdefault(name, types.ModuleType(name))
    location = types.ModuleType("sglang.srt.eplb.expert_location")
    location.get_global_expert_location_metadata = lambda: live
    distribution = types.ModuleType("sglang.srt.eplb.expert_distribution")
    distribution.get_global_expert_distribution_recorder = lambda: recorder
    sys.modules[location.__name__], sys.modules[distribution.__name__] = location, distribution


def sglang_engine(rank: int) -> tuple[dict, object, object]:
    """Fake SGLang state: the global ``ExpertLocationMetadata`` (a dense row 0, then the MoE
    rows) and ``model.routed_experts_weights_of_layer``."""
    initial = eplb.Placement.contiguous(TOPO)
    live = SimpleNamespace(**to_sglang(eplb.Placement.contiguous(TOPO.with_layers(3)), ep_rank=rank).fields())
    mine = initial.phy2log[:, rank * S : (rank + 1) * S]
    model = SimpleNamespace(
        routed_experts_weights_of_layer={
            row: [coded(layer, mine[layer], w) for w in (4, 2)] for layer, row in enumerate(SGLANG_MOE_ROWS)
        }
    )
    recorder = StandInRecorder()
    stand_in_sglang(live, recorder)
    ns = {"model": model}

    def step_done(step: int) -> None:  # the recorder counted this pass: [layers of the model, experts]
        recorder.pending[SGLANG_MOE_ROWS] += torch.from_numpy((HOT * (10 + step % 3)).astype(np.int64))
        ns["report"](recorder.dump_record(output_mode="object"))
        passes.append(step)

    passes: list[int] = []

    def check(new: eplb.Placement) -> None:
        want = to_sglang(new, ep_rank=rank).fields()
        # SGLang draws its static dispatch table over every row of its maps, the dense one too
        dense = eplb.Placement.contiguous(TOPO.with_layers(3)).phy2log[:1]
        model_map = eplb.Placement(np.concatenate([dense, new.phy2log]), TOPO.with_layers(3))
        want["logical_to_rank_dispatch_physical_map"] = torch.from_numpy(rank_dispatch_map(model_map, rank)[1:])
        for name, tensor in want.items():
            if isinstance(tensor, torch.Tensor):
                assert torch.equal(getattr(live, name)[SGLANG_MOE_ROWS], tensor), name
        assert live.physical_to_logical_map[0].tolist() == list(range(TOPO.num_experts)) + list(
            range(4)
        )  # dense row kept
        assert recorder.dumps > len(passes)  # the guide's on_switch dumped before the switch too
        weights = model.routed_experts_weights_of_layer
        assert all(
            torch.equal(t, coded(layer, new.phy2log[layer, rank * S : (rank + 1) * S], t.shape[1]))
            for layer, row in enumerate(SGLANG_MOE_ROWS)
            for t in weights[row]
        )

    return ns, step_done, check


def acks(client: object) -> list[tuple[int, int]]:
    return [(a.rank, a.version) for a in client.call("GetDeployment", pb.GetDeploymentRequest(name="my-model")).acks]


def _rank(rank: int, guide: str, address: str, port: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    ns, step_done, check = (vllm_engine if guide == "vllm" else sglang_engine)(rank)
    ns.update(topo=TOPO, rank=rank)
    try:
        for block in doc_blocks(f"integrate-{guide}.md", address):
            exec(compile(block, f"integrate-{guide}.md", "exec"), ns)
        client, reporter, rollout = ns["client"], ns["reporter"], ns["rollout"]
        dist.barrier()
        out[f"acks_at_start_{rank}"] = acks(client)  # both ranks acked the version they start on
        # The guide's loop until version 2 is live. Every rank leaves at the same step: the
        # switch step is agreed, and a rank past its deadline stops the others too.
        deadline, step = time.monotonic() + 40, 0
        while True:
            ns["before_step"](step)
            step_done(step)
            if step == 5:
                assert reporter.flush(10)
                dist.barrier()  # both ranks' loads are in the window
                if rank == 0:
                    assert client.rebalance("my-model", force=True).published
            stop = torch.tensor([int(rollout.current.version >= 2 or time.monotonic() > deadline)])
            dist.all_reduce(stop, op=dist.ReduceOp.MAX)
            if stop.item():
                break
            step += 1
            time.sleep(0.01)
        assert rollout.current.version == 2, f"rank {rank} still routes version {rollout.current.version}"
        new = rollout.current.placement
        assert not np.array_equal(new.phy2log, eplb.Placement.contiguous(TOPO).phy2log)
        check(new)
        assert reporter.flush(10)
        stats = reporter.stats()
        # SGLang's recorder sums the counts over the ranks: its guide reports from rank 0 only
        reports = stats.accepted > 0 if guide == "vllm" or rank == 0 else stats.accepted == 0
        assert reports and stats.rejected == 0 and stats.invalid_adds == 0
        out[f"moves_{rank}"] = int(client.get_placement("my-model", 2).stats.moves)
        ns["rollout"].close()  # sends the SWITCHED acks still queued
        dist.barrier()
        out[f"acks_at_end_{rank}"] = acks(client)
    finally:
        for name in ("watcher", "reporter", "rollout", "client"):
            if name in ns:
                ns[name].close()
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("guide", ["vllm", "sglang"])
def test_integration_guide_runs_as_written_through_a_replan(guide):
    server = ServerThread().start()
    try:
        with mp.Manager() as manager:
            out = manager.dict()
            mp.spawn(_rank, args=(guide, server.address, free_port(), out), nprocs=2, join=True)
            out = dict(out)
    finally:
        server.stop()
    assert out["acks_at_start_0"] == out["acks_at_start_1"] == [(0, 1), (1, 1)]
    assert out["acks_at_end_0"] == out["acks_at_end_1"] == [(0, 2), (1, 2)]
    # Acked v1, so the re-plan kept what it could: a fresh plan would rewrite most of the 24 slots.
    assert 0 < out["moves_0"] == out["moves_1"] <= 8, out
