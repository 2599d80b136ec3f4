"""Re-plans of a hierarchical deployment keep its groups on one node, as a fresh plan does
(docs/algorithms.md), whatever placement they start from: the made-up contiguous version 1 that
the engines acknowledged, and every re-plan after it."""

from __future__ import annotations

import numpy as np
import pytest

from eplb_bench.harness.service import reports
from eplb_engine.aio import AsyncServiceClient
from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb

L, E, P, G, N, GROUPS = 4, 32, 48, 8, 2, 4


def straddling(phy2log: np.ndarray) -> list[tuple[int, int]]:
    """(layer, group) pairs whose experts sit on more than one node."""
    node_of_slot = np.arange(P) // (P // N)
    group_of = phy2log // (E // GROUPS)
    return [(layer, g) for layer in range(L) for g in range(GROUPS) if len(set(node_of_slot[group_of[layer] == g])) > 1]


@pytest.mark.parametrize("policy", ["hierarchical", "auto"])
async def test_re_plans_keep_every_group_on_one_node(serve, connect, policy):
    c = connect(await serve())
    d = pb.Deployment(
        name="h",
        policy=policy,
        topology=pb.Topology(num_layers=L, num_experts=E, num_slots=P, num_gpus=G, num_nodes=N, num_groups=GROUPS),
    )
    await c.stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=d))
    rank = AsyncServiceClient.over(c.channel)
    await rank.ack("h", 0, 1)  # the engines run the contiguous version 1: re-plans start from it
    rng = np.random.default_rng(3)
    for step in range(4):
        loads = (rng.lognormal(0, 1.5, (L, E)) * 100).astype(np.int32)
        await rank.report(reports("h", 0, [loads]))
        out = await c.stub.Rebalance(pb.RebalanceRequest(deployment="h", force=True))
        assert out.published
        phy2log = np.frombuffer(out.placement.phy2log.data, "<i4").reshape(L, P)
        used = out.placement.stats.policy_used
        if used == "global":
            # auto may choose global (hierarchical's plan more than its tolerance worse); then
            # groups are free to spread, and the notes say why.
            assert policy == "auto" and any("global" in n for n in out.placement.stats.notes)
            continue
        assert used == "hierarchical"
        assert straddling(phy2log) == [], f"re-plan {step + 1} ({used})"
