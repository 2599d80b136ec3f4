"""docs/integrate-vllm.md's code blocks, extracted and run as written (gloo for nccl, the
address of a real service on 127.0.0.1), against the vLLM release under test's real
``EplbState`` and ``EplbModelState`` (0.32.0, or 0.33.0's or 0.34.0's in the overlay runs) on two
gloo ranks, with the guide's ``--eplb-config`` and ``take_over``:
vLLM's ``step()`` records each pass, the guide's ``report_step`` reports it, a forced re-plan
is moved and switched by the guide's rollout, and vLLM's live maps and the expert weights end
on the new version. CPU patches as in ``vllm_world`` (tests only); the MoE model is
``vllm_world.fake_moe`` (vLLM's ``MixtureOfExperts`` protocol, with its real layer states)."""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import torch
from vllm_world import GUIDE_EPLB, coded, cpu_streams, fake_moe, model_config, run_ranks, vllm_world

import eplb

ROOT = Path(__file__).resolve().parents[2]
L, E, HOT = 2, 8, 7


def guide_blocks(address: str) -> list[str]:
    """The guide's ```python blocks, the address and the mover's backend swapped (gloo ranks)."""
    text = (ROOT / "docs" / "integrate-vllm.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    return [b.replace("127.0.0.1:50051", address).replace('"nccl"', '"gloo"') for b in blocks]


def test_the_guide_has_the_blocks_this_test_runs():
    blocks = guide_blocks("x")
    assert len(blocks) == 4 and "def report_step" in blocks[1] and "def before_step" in blocks[3]


def _guide(rank: int, world: int, port: int, address: str) -> dict:
    from eplb_engine.adapters.vllm import take_over, to_vllm

    with vllm_world(rank, world, port, **GUIDE_EPLB) as parallel, cpu_streams():
        import torch.distributed as dist
        from vllm.distributed.eplb.eplb_state import EplbState

        eplb_state = EplbState(parallel, torch.device("cpu"))
        model = fake_moe(L, E, GUIDE_EPLB["num_redundant_experts"], world, rank)
        eplb_state.add_model(model, model_config())
        take_over(eplb_state)  # the guide's section 1, on every rank after add_model
        state = next(iter(eplb_state.model_states.values()))
        P, S = model.num_physical_experts, model.num_local_physical_experts
        topo = eplb.Topology(model.num_moe_layers, model.num_logical_experts, P, world)
        ns = {"state": state, "model": model, "topo": topo, "rank": rank}
        for block in guide_blocks(address):
            exec(compile(block, "integrate-vllm.md", "exec"), ns)
        client, reporter, rollout = ns["client"], ns["reporter"], ns["rollout"]
        try:
            deadline, step, forced = time.monotonic() + 60, 0, False
            while True:
                ns["before_step"](step)
                for layer, moe in enumerate(model.moe_layers):  # expert HOT takes most tokens
                    tokens = torch.zeros(P, dtype=torch.int32)
                    slots = state.logical_to_physical_map[layer, HOT]
                    slots = slots[slots >= 0]
                    tokens[slots] = 100 // len(slots)
                    tokens[:E] += 1
                    moe.route(tokens)
                eplb_state.step()  # vLLM's own step writes the pass into expert_load_window
                ns["report_step"]()
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
            want = to_vllm(new)
            assert reporter.flush(10)
            stats = reporter.stats()
            return {
                "version": rollout.current.version,
                "forced": forced,
                "accepted": stats.accepted,
                "rejected": stats.rejected + stats.invalid_adds,
                "replicas_of_hot": int(new.logcnt[:, HOT].min()),
                "maps_are_new": torch.equal(state.physical_to_logical_map, want.physical_to_logical_map)
                and torch.equal(state.logical_to_physical_map, want.logical_to_physical_map)
                and torch.equal(state.logical_replica_count, want.logical_replica_count),
                "weights_are_new": all(
                    torch.equal(
                        model.expert_weights[layer][i],
                        coded(layer, torch.from_numpy(new.phy2log[layer, rank * S : (rank + 1) * S].copy()), w),
                    )
                    for layer in range(L)
                    for i, w in enumerate((4, 2))
                ),
                "window_zeroed": int(state.expert_load_window.abs().sum()) == 0,
            }
        finally:
            for name in ("watcher", "reporter", "rollout", "client"):
                ns[name].close()


def test_the_guide_runs_as_written_on_vllms_classes_through_a_replan():
    sys.path.insert(0, str(ROOT / "tests" / "engine"))  # the service harness
    from svc_thread import ServerThread

    server = ServerThread().start()
    try:
        out = run_ranks(_guide, 2, server.address)
    finally:
        server.stop()
    assert out[0]["forced"], out
    for rank in (0, 1):
        got = out[rank]
        assert got["version"] == 2 and got["accepted"] > 0 and got["rejected"] == 0, got
        assert got["replicas_of_hot"] > 1 and got["maps_are_new"] and got["weights_are_new"], got
        assert got["window_zeroed"], got
