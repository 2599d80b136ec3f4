"""How long a rank's death takes to reach the engines as a survivor placement: ``SetRanksDown``
through a real server on 127.0.0.1, from the call to the published placement.

    python -m eplb_bench.set_ranks_down_bench [--scales v3-prefill,qwen3-64] [--repeats 5]

Per scale (docs/scales.md): a deployment planned once from lognormal loads (sigma 1, seed 0;
the placement then carries its loads snapshot), then ``--repeats`` times a rank of node 1 down
and up again (each a survivor placement published at once). Prints per scale and direction
the median call time (client side: validation, the plan in the server's worker process,
publication) and the plan's own ``solve_seconds``, and the last repeat's moves and restores
(each down/up starts from the placement the one before left).
In-process store (``--redis-url`` for Redis); one server, its plans on one worker.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
import uuid
from dataclasses import replace

import numpy as np

from eplb.workloads import SCALES, make_loads
from eplb_engine.aio import AsyncServiceClient
from eplb_service.balancer import BalancerConfig
from eplb_service.server import ServerConfig, start_server
from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb
from eplb_wire._gen.eplb.v1 import balancer_pb2_grpc as pb_grpc

from .harness.service import aio_channel, reports


async def _scale(stub, ch, name: str, repeats: int) -> list[dict]:
    topo = SCALES[name]
    d = pb.Deployment(
        name=name,
        topology=pb.Topology(
            num_layers=topo.num_layers,
            num_experts=topo.num_experts,
            num_slots=topo.num_slots,
            num_gpus=topo.num_gpus,
            num_nodes=topo.num_nodes,
            num_groups=topo.num_groups,
        ),
        expert_bytes=44_000_000,
    )
    await stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=d))
    loads = make_loads("lognormal-1.0", topo, seed=0)
    await AsyncServiceClient.over(ch).report(reports(name, 0, [np.rint(loads).astype(np.int64)]))
    await stub.Rebalance(pb.RebalanceRequest(deployment=name, force=True))
    rank = topo.gpus_per_node if topo.num_nodes > 1 else 0
    out: dict[str, list] = {"down": [], "up": []}
    for _ in range(repeats):
        for what in ("down", "up"):
            start = time.perf_counter()
            got = await stub.SetRanksDown(pb.SetRanksDownRequest(deployment=name, **{what: [rank]}))
            seconds = time.perf_counter() - start
            assert got.published
            st = got.placement.stats
            out[what].append((seconds, st.solve_seconds, st.moves, st.transfer.restored_experts))
    rows = []
    for what, runs in out.items():
        rows.append(
            {
                "scale": name,
                "change": f"rank {rank} {what}",
                "call_ms": round(1e3 * statistics.median(r[0] for r in runs), 1),
                "solve_ms": round(1e3 * statistics.median(r[1] for r in runs), 1),
                "moves": runs[-1][2],
                "restored": runs[-1][3],
            }
        )
    return rows


async def _main(args: argparse.Namespace) -> None:
    kw = {"redis_url": args.redis_url, "key_prefix": f"eplb-bench-{uuid.uuid4().hex[:8]}"} if args.redis_url else {}
    config = ServerConfig(port=0, balancer=replace(BalancerConfig(), replica_id="bench"), **kw)
    server = await start_server(config)
    try:
        async with aio_channel(server.target) as ch:
            stub = pb_grpc.ExpertLoadBalancerServiceStub(ch)
            for name in args.scales.split(","):
                for row in await _scale(stub, ch, name, args.repeats):
                    print(json.dumps(row), flush=True)
    finally:
        await server.stop(0)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scales", default="v3-prefill,qwen3-64")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--redis-url", default="")
    asyncio.run(_main(ap.parse_args(argv)))


if __name__ == "__main__":
    main()
