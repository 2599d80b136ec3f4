"""What liveness (``Deployment.liveness``) costs an instance and Redis, for one deployment.

    python -m eplb_bench.liveness_bench [--ranks 320] [--repeats 200] [--redis-url redis://127.0.0.1:6379/0]

On Redis (a key prefix of its own, deleted afterwards): the store calls an instance makes once
per ``liveness_s`` (1 s) per deployment with liveness on, ``record_seen`` of every rank (the
most one round writes) and ``seen`` (the read behind the gauge and GetDeployment), their median
and p99 in ms; the ``MEMORY USAGE`` of the deployment's ``seen`` hash with every rank in it;
and through a real server on 127.0.0.1 the median ``GetDeployment`` call with liveness off and
on (the extra read). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
import uuid
from dataclasses import replace

import redis.asyncio as aioredis

from eplb_service.balancer import BalancerConfig
from eplb_service.redis_store import RedisStore
from eplb_service.server import ServerConfig, start_server
from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb
from eplb_wire._gen.eplb.v1 import balancer_pb2_grpc as pb_grpc

from .harness.service import aio_channel


def _deployment(name: str, ranks: int, after_s: float) -> pb.Deployment:
    d = pb.Deployment(
        name=name,
        # v3-prefill's shape; the ranks report (the first 32 hold its gpus).
        topology=pb.Topology(num_layers=58, num_experts=256, num_slots=288, num_gpus=32, num_nodes=4, num_groups=8),
        ranks=list(range(ranks)),
    )
    if after_s:
        d.liveness.suspect_after.FromSeconds(int(after_s))
    return d


def _ms(samples: list[float]) -> tuple[float, float]:
    s = sorted(samples)
    return round(statistics.median(s) * 1e3, 3), round(s[min(len(s) - 1, int(len(s) * 0.99))] * 1e3, 3)


async def _run(url: str, ranks: int, repeats: int) -> dict:
    prefix = f"eplb-bench-{uuid.uuid4().hex[:8]}"
    server = await start_server(
        ServerConfig(port=0, redis_url=url, key_prefix=prefix, balancer=replace(BalancerConfig(), plan_workers=1))
    )
    store = RedisStore(url, prefix)
    ch = aio_channel(server.target)
    stub = pb_grpc.ExpertLoadBalancerServiceStub(ch)
    try:
        for name, after in (("off", 0), ("on", 10)):
            await stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=_deployment(name, ranks, after)))
        writes, reads = [], []
        for _ in range(repeats):
            now = time.time()
            start = time.perf_counter()
            await store.record_seen("on", {r: now for r in range(ranks)})
            writes.append(time.perf_counter() - start)
            start = time.perf_counter()
            seen = await store.seen("on")
            reads.append(time.perf_counter() - start)
        assert len(seen.ranks) == ranks
        raw = aioredis.from_url(url)
        memory = await raw.memory_usage(store.keys.of("on", "seen"))
        await raw.aclose()
        calls = {}
        for name in ("off", "on"):
            samples = []
            for _ in range(repeats):
                start = time.perf_counter()
                response = await stub.GetDeployment(pb.GetDeploymentRequest(name=name))
                samples.append(time.perf_counter() - start)
            assert not response.status.suspect_ranks
            calls[name] = _ms(samples)[0]
        w, r = _ms(writes), _ms(reads)
        return {
            "ranks": ranks,
            "record_seen_ms": w[0],
            "record_seen_p99_ms": w[1],
            "seen_ms": r[0],
            "seen_p99_ms": r[1],
            "seen_hash_bytes": memory,
            "get_deployment_ms_off": calls["off"],
            "get_deployment_ms_on": calls["on"],
        }
    finally:
        await ch.close()
        await server.stop(0)
        raw = aioredis.from_url(url)
        keys = [k async for k in raw.scan_iter(match=f"{prefix}:*")]
        if keys:
            await raw.delete(*keys)
        await raw.aclose()
        await store.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=320)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    args = parser.parse_args()
    print(json.dumps(asyncio.run(_run(args.redis_url, args.ranks, args.repeats))))


if __name__ == "__main__":
    main()
