"""WatchPlacements in parts (max_part_bytes): reassembled, checked, and taken whole from a server
that sends whole placements."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from svc_helpers import report_some_load, small_deployment, status_details

from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb
from eplb_wire.parts import PartAssembler


def _wide(name: str = "wide") -> pb.Deployment:
    d = small_deployment(name)
    # 16 layers x 256 slots of int32: a 16 KiB phy2log, five parts of 4 KiB at least.
    d.topology.CopyFrom(
        pb.Topology(num_layers=16, num_experts=128, num_slots=256, num_gpus=8, num_nodes=1, num_groups=1)
    )
    return d


async def test_parts_reassemble_to_the_placement_of_each_version(serve, connect):
    c = connect(await serve())
    await c.stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=_wide()))
    await report_some_load(c.stub, "wide", shape=(16, 128))
    call = c.stub.WatchPlacements(pb.WatchPlacementsRequest(deployment="wide", max_part_bytes=4096))
    parts, got = PartAssembler(), []
    counts = []
    async for response in call:
        assert response.HasField("part") and not response.HasField("placement")
        assert len(response.part.data) <= 4096
        counts.append(response.part.count)
        placement = parts.feed(response)
        if placement is not None:
            got.append(placement)
            if len(got) == 1:
                await c.stub.Rebalance(pb.RebalanceRequest(deployment="wide", force=True), timeout=60)
            else:
                break
    call.cancel()
    assert [p.version for p in got] == [1, 2]
    assert min(counts) >= 5
    now = (await c.stub.GetPlacement(pb.GetPlacementRequest(deployment="wide"))).placement
    assert got[1] == now


@pytest.mark.parametrize("size", [1, 4095, (4 << 20) + 1])
async def test_part_sizes_out_of_range_are_refused(serve, connect, size):
    c = connect(await serve())
    await c.stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=small_deployment()))
    call = c.stub.WatchPlacements(pb.WatchPlacementsRequest(deployment="d1", max_part_bytes=size))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for _ in call:
            pass
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert [f for f, _ in status_details(info.value)] == ["max_part_bytes"]


def test_the_assembler_takes_whole_placements_and_refuses_parts_out_of_order():
    whole = pb.Placement(deployment="d", version=3)
    parts = PartAssembler()
    assert parts.feed(pb.WatchPlacementsResponse(placement=whole)) == whole
    data = pb.Placement(deployment="d", version=4, phy2log=pb.Array(data=bytes(range(200)) * 50)).SerializeToString()
    chunks = [data[i : i + 4096] for i in range(0, len(data), 4096)]
    msgs = [
        pb.WatchPlacementsResponse(part=pb.PlacementPart(version=4, index=i, count=len(chunks), data=d))
        for i, d in enumerate(chunks)
    ]
    out = [parts.feed(m) for m in msgs]
    assert out[:-1] == [None] * (len(chunks) - 1) and out[-1].version == 4
    with pytest.raises(ValueError, match="arrived after"):
        PartAssembler().feed(msgs[1])
    fresh = PartAssembler()
    fresh.feed(msgs[0])
    with pytest.raises(ValueError, match="arrived after"):
        fresh.feed(msgs[2])
    assert np.frombuffer(out[-1].phy2log.data, np.uint8)[:3].tolist() == [0, 1, 2]
