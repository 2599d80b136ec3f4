"""WeightMover with gpus down: the group of the survivors alone (or every gpu, a down one idle),
experts lost with a dead gpu restored through the engine's loader, a gpu coming back."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from mover_sim import TENSORS, ThreadWorld, check_layers, encoded_layers, expected_slots

import eplb
from eplb.transfer import transfer_schedule
from eplb_engine import WeightMover
from eplb_engine.wire import placement_from_pb

TOPO = eplb.Topology(3, 8, 12, 4, 2)  # 3 slots per gpu, 2 nodes of 2 gpus


def _loads(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).gamma(1.0, 100.0, (3, 8))


def _restore(calls: list):
    """A loader that rebuilds an expert's slot as ``encoded_layers`` would (what a host copy or
    the checkpoint gives), recording each call."""

    def restore(layer: int, expert: int) -> dict[str, torch.Tensor]:
        calls.append((layer, expert))
        return {
            name: expected_slots(layer, np.array([expert]), k, shape, dtype)[0]
            for k, (name, (shape, dtype)) in enumerate(sorted(TENSORS.items()))
        }

    return restore


def _run(old: eplb.Placement, new: eplb.Placement, gpus: list[int], mode: str, **kw):
    """Group rank i is gpu ``gpus[i]``: every one moves old -> new; per rank (layers, report, calls)."""
    world = ThreadWorld(len(gpus))

    def rank(i: int):
        g = gpus[i]
        layers = encoded_layers(old, g)
        calls: list = []
        mover = WeightMover(layers, old, new, transport=world.transport(i), restore=_restore(calls), verify=True, **kw)
        if mode == "staged":
            while mover.prepare():
                pass
            check_layers(layers, old, g)  # the live slots are untouched until the commit
            report = mover.commit()
        else:
            report = mover.run()
        return layers, report, calls

    return world.run(rank)


@pytest.mark.parametrize("mode", ["staged", "direct"])
def test_survivors_alone_move_and_restore_the_lost_experts(mode):
    old = eplb.Placement.contiguous(TOPO)  # gpu 1 holds experts 3, 4, 5; slots 8..11 repeat 0..3
    new = eplb.rebalance(_loads(0), TOPO, previous=old, down_gpus=[1]).placement
    schedule = transfer_schedule(old, new, TOPO)
    assert schedule.restore_layer.size > 0  # experts 4 and 5 lived on gpu 1 alone
    live = [0, 2, 3]
    out = _run(old, new, live, mode)
    for g, (layers, report, calls) in zip(live, out):
        check_layers(layers, new, g)
        mine = schedule.restore_dst_gpu == g
        assert sorted(calls) == sorted(
            zip(schedule.restore_layer[mine].tolist(), schedule.restore_expert[mine].tolist())
        )
        assert report.restored == int(mine.sum()) and report.ok and report.checked_slots > 0
        assert report.restored_bytes == report.restored * sum(
            int(np.prod(shape)) * torch.empty(0, dtype=dt).element_size() for shape, dt in TENSORS.values()
        )
    assert sum(r.restored for _, r, _ in out) == schedule.restore_layer.size


def test_a_down_gpu_in_a_full_group_takes_no_part():
    old = eplb.rebalance(_loads(1), TOPO).placement
    new = eplb.rebalance(_loads(1), TOPO, previous=old, down_gpus=[2]).placement
    out = _run(old, new, [0, 1, 2, 3], "direct")
    for g in (0, 1, 3):
        check_layers(out[g][0], new, g)
    _, report, calls = out[2]
    assert report.received_bytes == report.sent_bytes == report.local_copy_bytes == 0 and calls == []


def test_a_gpu_coming_back_is_filled_from_its_peers():
    down = eplb.rebalance(_loads(2), TOPO, down_gpus=[3]).placement
    back = eplb.rebalance(_loads(2), TOPO, previous=down).placement
    assert back.down_gpus == () and (back.phy2log[:, 9:] >= 0).all()
    out = _run(down, back, [0, 1, 2, 3], "staged")
    for g in range(4):
        check_layers(out[g][0], back, g)
    assert all(r.restored == 0 for _, r, _ in out)  # every expert had a live replica


def test_group_and_restore_misfits_are_refused_before_anything_moves():
    old = eplb.Placement.contiguous(TOPO)
    new = eplb.rebalance(_loads(0), TOPO, previous=old, down_gpus=[1]).placement
    world = ThreadWorld(2)
    with pytest.raises(ValueError, match=r"2 ranks; the topology has num_gpus = 4 and 3 live .*gpus \[1\] down"):
        WeightMover(encoded_layers(old, 0), old, new, transport=world.transport(0))
    world = ThreadWorld(3)
    with pytest.raises(ValueError, match=r"gpus \[3\] are live in the new placement but not in the mover's group"):
        WeightMover(encoded_layers(old, 0), old, new, transport=world.transport(0), gpus=[0, 1, 2])
    needs = int(transfer_schedule(old, new, TOPO).restore_dst_gpu[0])
    i = [0, 2, 3].index(needs)
    with pytest.raises(ValueError, match=rf"gpu {needs} must restore .* pass restore="):
        WeightMover(encoded_layers(old, needs), old, new, transport=world.transport(i))
    schedule = transfer_schedule(old, new, TOPO)
    layer = int(schedule.restore_layer[schedule.restore_dst_gpu == needs][0])
    bad = {"w13": torch.zeros(4, 3), "w2": torch.zeros(3, 2)}  # w13_scale missing
    mover = WeightMover(encoded_layers(old, needs), old, new, transport=world.transport(i), restore=lambda *_: bad)
    with pytest.raises(ValueError, match=r"restore\(\d+, \d+\) returned \['w13', 'w2'\]; the mover needs"):
        mover._plan.load_layer(layer)  # what prepare() and step() call once the layer's rounds are done


def test_a_placement_with_a_gpu_down_decodes_from_the_wire():
    from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb

    new = eplb.rebalance(_loads(0), TOPO, down_gpus=[1]).placement
    a = new.phy2log.astype("<i4")
    msg = pb.Placement(
        deployment="d", version=4, phy2log=pb.Array(dtype=pb.DTYPE_INT32, shape=list(a.shape), data=a.tobytes())
    )
    got = placement_from_pb(msg, TOPO)
    assert got.placement.down_gpus == (1,) and np.array_equal(got.placement.phy2log, new.phy2log)


def test_host_backup_serves_the_restores_it_holds_and_passes_the_rest_on():
    from eplb_engine.backup import HostExpertBackup, at_risk

    old = eplb.Placement.contiguous(TOPO)  # experts 4..7 have one replica (gpus 1 and 2)
    assert at_risk(old) == [(lay, e) for lay in range(3) for e in range(4, 8)]
    assert at_risk(old, gpu=1) == [(lay, e) for lay in range(3) for e in (6, 7)]
    hot = np.zeros((3, 8))
    hot[2, 7] = 5.0
    assert at_risk(old, gpu=1, loads=hot)[0] == (2, 7)
    assert at_risk(old, share=(1, 2)) == at_risk(old)[1::2]
    new = eplb.rebalance(_loads(0), TOPO, previous=old, down_gpus=[1]).placement
    schedule = transfer_schedule(old, new, TOPO)
    slot = sum(int(np.prod(shape)) * torch.empty(0, dtype=dt).element_size() for shape, dt in TENSORS.values())
    world = ThreadWorld(3)
    backups = []

    def rank(i: int):
        g = [0, 2, 3][i]
        source_calls: list = []
        backup = HostExpertBackup(_restore(source_calls), budget_bytes=100 * slot)
        assert backup.keep(at_risk(old, gpu=g)) == len(at_risk(old, gpu=g)) and backup.held_bytes > 0
        held = len(source_calls)
        layers = encoded_layers(old, g)
        report = WeightMover(layers, old, new, transport=world.transport(i), restore=backup, verify=True).run()
        check_layers(layers, new, g)
        backups.append((g, backup, len(source_calls) - held, report))

    world.run(rank)
    for g, backup, later, report in backups:
        mine = int((schedule.restore_dst_gpu == g).sum())
        # gpu 1's experts were in every other gpu's backup: every restore a hit, none from the source.
        assert report.restored == mine and backup.hits == mine and backup.misses == later == 0 and report.ok
    small = HostExpertBackup(_restore([]), budget_bytes=2 * slot, pin=False)
    assert small.keep(at_risk(old)) == 2 and small.held_bytes == 2 * slot and (0, 4) in small
    assert small(0, 6)["w2"].shape == (3, 2) and small.misses == 1
    assert small.keep([(1, 5)]) == 1 and (0, 4) not in small and small.held_bytes == slot
    with pytest.raises(ValueError, match="budget_bytes must be an integer >= 0"):
        HostExpertBackup(_restore([]), budget_bytes=-1)


def test_experts_whose_replicas_share_one_gpu_are_at_risk():
    from eplb_engine.backup import at_risk

    # expert 0 twice on gpu 0, expert 1 on gpus 0 and 1, expert 2 twice on gpu 1
    placement = eplb.Placement(np.array([[0, 0, 1, 1, 2, 2]]), eplb.Topology(1, 3, 6, 2))
    assert at_risk(placement) == [(0, 0), (0, 2)]
    assert at_risk(placement, gpu=0) == [(0, 2)]


def test_restore_bench_restores_half_the_experts_from_both_sources(capsys):
    import json

    from eplb_bench import restore_bench

    restore_bench.main(["--layers", "2", "--experts", "4", "--hidden", "256", "--inter", "128", "--repeats", "1"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["source"] for r in rows] == ["pinned HostExpertBackup", "pageable host"]
    assert [r["restored"] for r in rows] == [4, 4] and rows[0]["bytes"] == rows[1]["bytes"] > 0
    assert rows[0]["backup_host_bytes"] == rows[0]["bytes"] > 0 and rows[1]["backup_host_bytes"] == 0
