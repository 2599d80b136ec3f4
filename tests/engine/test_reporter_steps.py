"""LoadReporter's steps: summed per report, and what a deployment planned for time learns from."""

from __future__ import annotations

import numpy as np
import pytest
from svc_thread import ServerThread

import eplb
from eplb_engine import wire
from eplb_engine.client import ServiceClient
from eplb_engine.reporter import LoadReporter

TOPO = eplb.Topology(num_layers=2, num_experts=32, num_slots=48, num_gpus=8, num_nodes=1, num_groups=1)


@pytest.fixture
def server():
    s = ServerThread().start()
    yield s
    s.stop()


def test_reported_steps_give_the_batch_sizes_a_plan_for_time_uses(server):
    counts = np.full((2, 32), 16, dtype=np.int64)  # 512 visits a layer: 64 tokens at top-8
    with ServiceClient(server.address) as client:
        client.create_deployment("d1", TOPO, kernel_model="qwen3-30b-a3b@h100")
        with LoadReporter(server.address, "d1", rank=0, topology=TOPO, interval_s=10) as reporter:
            for _ in range(4):
                assert reporter.add(counts)  # one step each: 64 tokens per step
            assert reporter.flush(10)
        dry = client.rebalance("d1", dry_run=True)
    assert sorted(dry.placement.stats.predicted_ms) == [64]


def test_steps_are_checked_on_the_callers_thread(server):
    reporter = LoadReporter(server.address, "d1", rank=0, topology=TOPO, start=False)
    for bad in (-1, 1.5, True, 1 << 21):
        with pytest.raises(ValueError, match="steps must be an integer"):
            reporter.add(np.zeros((2, 32)), steps=bad)
    msg = wire.deployment_pb(
        "d",
        TOPO,
        kernel_model="qwen3-30b-a3b@h100",
        tokens_per_gpu=[4, 16],
        top_k=4,
        dispatch="static",
        max_payback_steps=1000,
    )
    assert msg.trigger.max_payback_steps == 1000
    assert (
        list(msg.planning.tokens_per_gpu) == [4, 16] and msg.planning.top_k == 4 and msg.planning.dispatch == "static"
    )


def test_whole_counts_go_as_int32_and_fractions_as_float64():
    from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb

    reporter = LoadReporter("127.0.0.1:1", "d1", rank=0, topology=TOPO, start=False)
    reporter.add(np.full((2, 32), 7, dtype=np.int64))
    reporter.add(np.full((2, 32), 3.0))
    reporter._aggregate()
    whole = reporter._outbox[-1].logical
    assert whole.dtype == pb.DTYPE_INT32 and len(whole.data) == 2 * 32 * 4
    assert (wire.decode_array(whole) == 10).all()
    reporter.add(np.full((2, 32), 0.5))
    reporter._aggregate()
    assert reporter._outbox[-1].logical.dtype == pb.DTYPE_FLOAT64
    reporter.add(np.full((2, 32), 2.0**31))  # whole, but past int32
    reporter._aggregate()
    assert reporter._outbox[-1].logical.dtype == pb.DTYPE_FLOAT64
    assert float(wire.decode_array(reporter._outbox[-1].logical).max()) == 2.0**31
