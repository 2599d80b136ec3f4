"""The Redis store's rollout script and ``rollout.apply_ack`` (the in-process store's rules)
answer every sequence of acks alike, on real Redis: one server and a Redis Cluster."""

from __future__ import annotations

import numpy as np
from svc_helpers import small_deployment

from eplb_service.memory_store import MemoryStore
from eplb_service.redis_store import RedisStore
from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb

STATES = (pb.ACK_STATE_UNSPECIFIED, pb.ACK_STATE_PREPARED, pb.ACK_STATE_SWITCHED, pb.ACK_STATE_FAILED)


async def test_redis_and_memory_rollouts_agree_on_random_acks(redis_url, prefix):
    redis_store, memory = RedisStore(redis_url, prefix()), MemoryStore()
    d = small_deployment()
    first = pb.Placement(deployment="d1", version=1)
    try:
        for store in (redis_store, memory):
            await store.create(d, first)
        rng = np.random.default_rng(11)
        ranks = [0, 1, 2, 3]
        seen = set()
        for _ in range(600):
            rank, version = int(rng.integers(0, 4)), int(rng.integers(1, 12))
            # FAILED rarely, so most versions get to a switch step before one aborts (and some
            # failures come after it, which must not abort).
            state, step = int(rng.choice(STATES, p=[0.2, 0.42, 0.3, 0.08])), int(rng.integers(0, 1000))
            got = [await s.ack("d1", rank, version, state, step, ranks, 5) for s in (redis_store, memory)]
            assert got[0] == got[1], (rank, version, state, step)
            seen |= {k for k in ("became_prepared", "became_switched", "became_failed") if getattr(got[0], k)}
            seen |= {"switch_step"} if got[0].switch_step else set()
        assert await redis_store.acks("d1") == await memory.acks("d1")
        # The sequence reached every transition, so every rule was compared.
        assert seen == {"became_prepared", "became_switched", "became_failed", "switch_step"}
    finally:
        await redis_store.delete("d1")
        await redis_store.close()
