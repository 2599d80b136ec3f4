"""The weight mover over NCCL: one process per GPU on one machine (2 to 8 GPUs).

    python -m eplb_bench.mover_multi_gpu [--gpus N] [--layers 58] [--repeats 3] [--json FILE]
    python -m eplb_bench.mover_multi_gpu --cpu-check    # the same logic on gloo, tiny tensors

1. Correctness, on 2 GPUs and on all of them: random old -> new placements (replica gains
   and losses), weights that encode (layer, expert, tensor) in four small named tensors per
   slot (FP8 weights and float32 scales; the throughput run checks 44 MB ones too), one expert per pair per round (several rounds), layers
   per call 1 and 2, staged and direct, with the checksum canary; every slot is checked.
2. NCCL send/recv bandwidth between GPUs 0 and 1 (both directions at once, as the mover's
   rounds exchange), the ceiling the move is compared with.
3. Throughput with DeepSeek-V3-sized experts (44 MB: FP8 ``w13 [4096, 7168]``,
   ``w2 [7168, 2048]`` and block scales), 9 slots per GPU, 58 layers, 8 experts per GPU
   (DeepSeek-V3's 256 experts need 32 GPUs at 9 slots each): a full re-plan (eplb.py from
   scratch) and a migration-aware re-plan from the same old placement. Direct moves with 1,
   4 and all layers per call (the longest call is what one engine step would stall), and a
   staged prepare + commit. Bytes, seconds per layer and in all, GB/s per GPU against the
   measured send/recv bandwidth (target >= 80 % on full re-plans), and the schedule's
   prediction (with the measured bandwidths) against the measurement (target within 20 %).

NVLink multicast stays off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
NVSHMEM_DISABLE_NVLS=1), set before the worker processes start so they inherit them.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time
import traceback
from dataclasses import replace

# Before torch: the workers inherit these, and NCCL reads them at its first communicator.
for _name, _value in (
    ("NCCL_NVLS_ENABLE", "0"),
    ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
    ("NVSHMEM_DISABLE_NVLS", "1"),
):
    os.environ[_name] = _value

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import eplb
from eplb.transfer import Bandwidth, transfer_schedule
from eplb_engine.mover import WeightMover

from .harness import mover as mb

SMALL = {  # --cpu-check: the same four tensors, tiny
    "w13": ((8, 16), mb.FP8),
    "w2": ((16, 8), mb.FP8),
    "w13_scale": ((2, 3), torch.float32),
    "w2_scale": ((3, 1), torch.float32),
}


def _random_placement(topo: eplb.Topology, rng: np.random.Generator) -> eplb.Placement:
    L, E, P = topo.num_layers, topo.num_experts, topo.num_slots
    rows = np.concatenate([np.tile(np.arange(E), (L, 1)), rng.integers(0, E, (L, P - E))], axis=1)
    return eplb.Placement(rng.permuted(rows, axis=1), topo)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def correctness(rank: int, size: int, group, device, transitions: int, out: dict) -> None:
    """Random transitions on ``size`` ranks of ``group``; raises on the first wrong slot."""
    rng = np.random.default_rng(1000 + size)  # the same draws on every rank
    checked = 0
    for i in range(transitions):
        S = int(rng.integers(2, 6))
        P = S * size
        topo = eplb.Topology(3, int(rng.integers(max(1, P // 2), P + 1)), P, size)
        old, new = _random_placement(topo, rng), _random_placement(topo, rng)
        layers = mb.make_layers(old, rank, device, SMALL)  # correctness needs no 44 MB experts
        ptrs = [t.data_ptr() for layer in layers for t in layer.values()]
        mover = WeightMover(layers, old, new, group, round_experts=1, layers_per_call=1 + i % 2, verify=True)
        if i % 2:
            while mover.prepare():
                pass
            bad_before = mb.check(layers, old, rank)  # staged: old weights intact until commit
            assert bad_before == 0, f"rank {rank}: prepare wrote {bad_before} live slots"
            reports = [mover.commit()]
        else:
            reports = []
            while not mover.done:
                reports.append(mover.step())
        _sync(device)
        bad = mb.check(layers, new, rank)
        assert bad == 0, f"rank {rank}: {bad} slots wrong after transition {i}"
        assert all(r.ok for r in reports), [r.mismatches for r in reports]
        assert ptrs == [t.data_ptr() for layer in layers for t in layer.values()]
        checked += sum(r.checked_slots for r in reports)
    out[f"correctness_{size}_transitions"] = transitions
    out[f"correctness_{size}_slots_checked_rank0"] = checked


def sendrecv_bandwidth(rank: int, device, nbytes: int, repeats: int) -> float:
    """GB/s per direction between ranks 0 and 1 exchanging ``nbytes`` both ways at once."""
    if rank > 1:
        return 0.0
    peer = 1 - rank
    send = torch.empty(nbytes, dtype=torch.uint8, device=device)
    recv = torch.empty_like(send)
    times = []
    for i in range(repeats + 1):
        _sync(device)
        t = time.perf_counter()
        for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, send, peer), dist.P2POp(dist.irecv, recv, peer)]):
            w.wait()
        _sync(device)
        if i:  # the first is warm-up
            times.append(time.perf_counter() - t)
    return nbytes / statistics.median(times) / 1e9


def copy_bandwidth(device, nbytes: int, repeats: int) -> float:
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    _sync(device)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        b.copy_(a)
        _sync(device)
        times.append(time.perf_counter() - t)
    return nbytes / statistics.median(times) / 1e9


def throughput(rank: int, size: int, device, layers_n: int, repeats: int, bw: Bandwidth, out: dict) -> None:
    topo = eplb.Topology(layers_n, 8 * size, 9 * size, size)
    old, transitions = mb.plans(topo, 0)
    (full, t_full), (mig, t_mig) = transitions.values()
    layers = mb.make_layers(old, rank, device)
    slot_bytes = sum(int(np.prod(s)) * torch.empty(0, dtype=d).element_size() for s, d in mb.TENSORS.values())
    for name, new, plan_s in (("full", full, t_full), ("migration", mig, t_mig)):
        sched = transfer_schedule(old, new, topo, expert_bytes=float(slot_bytes), bandwidth=bw)
        res = {
            "plan_seconds": plan_s,
            "moves": int((old.phy2log != new.phy2log).sum()),
            "schedule": sched.stats(),
            "rank_received_bytes": float(sched.received_bytes[:, rank].sum()),
            "predicted_comm_seconds": float(sched.predicted_comm_seconds.sum()),
            "predicted_local_seconds": float(sched.predicted_local_seconds.sum()),
        }
        for per_call in (1, 4, layers_n):
            totals, longest = [], []
            for _ in range(repeats):
                mb.reset(layers, old, rank)
                _sync(device)
                dist.barrier()
                mover = WeightMover(layers, old, new, bandwidth=bw, layers_per_call=per_call)
                calls = []
                while not mover.done:
                    t = time.perf_counter()
                    mover.step()
                    _sync(device)
                    calls.append(time.perf_counter() - t)
                dist.barrier()
                totals.append(sum(calls))
                longest.append(max(calls))
                assert mb.check(layers, new, rank) == 0
            res[f"direct_{per_call}_seconds"] = statistics.median(totals)
            res[f"direct_{per_call}_longest_call_seconds"] = statistics.median(longest)
        prepares, commits = [], []
        for _ in range(repeats):
            mb.reset(layers, old, rank)
            _sync(device)
            dist.barrier()
            mover = WeightMover(layers, old, new, bandwidth=bw)
            t = time.perf_counter()
            mover.prepare()
            _sync(device)
            prepares.append(time.perf_counter() - t)
            dist.barrier()
            t = time.perf_counter()
            mover.commit()
            _sync(device)
            commits.append(time.perf_counter() - t)
            del mover
            assert mb.check(layers, new, rank) == 0
        res["staged_prepare_seconds"] = statistics.median(prepares)
        res["staged_commit_seconds"] = statistics.median(commits)
        # the slowest rank sets the pace: gather every rank's figures
        gathered = [None] * size
        dist.all_gather_object(gathered, res)
        if rank == 0:
            out[name] = gathered


def worker(rank: int, size: int, port: int, args, results) -> None:
    try:
        cpu = args.cpu_check
        device = torch.device("cpu") if cpu else torch.device("cuda", rank)
        if not cpu:
            torch.cuda.set_device(device)
        dist.init_process_group(
            "gloo" if cpu else "nccl",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=size,
            device_id=None if cpu else device,
        )
        out: dict = {}
        if cpu:
            mb.TENSORS.clear()
            mb.TENSORS.update(SMALL)
        pair = dist.new_group([0, 1])
        if rank < 2:
            correctness(rank, 2, pair, device, args.transitions, out)
        dist.barrier()
        if size > 2:
            correctness(rank, size, None, device, args.transitions, out)
        nbytes = 1 << 20 if cpu else 1 << 30
        out["sendrecv_gb_s"] = sendrecv_bandwidth(rank, device, nbytes, args.repeats)
        out["copy_gb_s"] = copy_bandwidth(device, nbytes, args.repeats)
        measured = [None] * size
        dist.all_gather_object(measured, (out["sendrecv_gb_s"], out["copy_gb_s"]))
        bw = replace(Bandwidth(), intra_node_gb_s=measured[0][0], local_gb_s=measured[0][1])
        throughput(rank, size, device, 3 if cpu else args.layers, 1 if cpu else args.repeats, bw, out)
        if rank == 0:
            results.put(out)
        dist.destroy_process_group()
    except BaseException:
        results.put({"error": f"rank {rank}: {traceback.format_exc()}"})
        raise


def report(out: dict, size: int, layers_n: int, slot_bytes: int) -> None:
    print(
        f"correctness: 2 ranks {out['correctness_2_transitions']} transitions ({out['correctness_2_slots_checked_rank0']} slots checked by rank 0)"
        + (f", {size} ranks {out[f'correctness_{size}_transitions']} transitions" if size > 2 else "")
        + ": every slot right, canary clean"
    )
    ceiling = out["sendrecv_gb_s"]
    print(
        f"send/recv between ranks 0 and 1: {ceiling:.0f} GB/s per direction (both at once); device copy {out['copy_gb_s']:.0f} GB/s"
    )
    for name in ("full", "migration"):
        ranks = out[name]
        r0 = ranks[0]
        print(
            f"\n{name} re-plan: {r0['moves']} moves; schedule: {r0['schedule']['bytes'] / 1e9:.1f} GB between gpus, {r0['schedule']['rounds']} rounds, "
            f"predicted {r0['predicted_comm_seconds'] * 1e3:.0f} ms rounds + {r0['predicted_local_seconds'] * 1e3:.0f} ms local; planning {r0['plan_seconds'] * 1e3:.0f} ms"
        )
        for per_call in (1, 4, layers_n):
            total = max(r[f"direct_{per_call}_seconds"] for r in ranks)
            longest = max(r[f"direct_{per_call}_longest_call_seconds"] for r in ranks)
            busiest = max(r["rank_received_bytes"] for r in ranks)
            gbs = busiest / total / 1e9
            print(
                f"  direct, {per_call} layer(s) per call: all {total * 1e3:.0f} ms ({total / layers_n * 1e3:.2f} ms per layer), longest call {longest * 1e3:.1f} ms; "
                f"busiest receiver {busiest / 1e9:.2f} GB at {gbs:.0f} GB/s = {100 * gbs / ceiling:.0f} % of send/recv; "
                f"predicted {(r0['predicted_comm_seconds'] + r0['predicted_local_seconds']) * 1e3:.0f} ms ({100 * (r0['predicted_comm_seconds'] + r0['predicted_local_seconds']) / total:.0f} % of measured)"
            )
        prep = max(r["staged_prepare_seconds"] for r in ranks)
        com = max(r["staged_commit_seconds"] for r in ranks)
        print(
            f"  staged: prepare {prep * 1e3:.0f} ms (serving goes on), commit {com * 1e3:.1f} ms (the stall at the switch)"
        )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpus", type=int, help="processes (default: every visible GPU; 2 with --cpu-check)")
    p.add_argument("--layers", type=int, default=58)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--transitions", type=int, default=20, help="random transitions per correctness world")
    p.add_argument(
        "--cpu-check", action="store_true", help="gloo on CPU with tiny tensors: the script's logic without GPUs"
    )
    p.add_argument("--json", help="write the figures to this file")
    args = p.parse_args(argv)
    size = args.gpus or (2 if args.cpu_check else torch.cuda.device_count())
    if size < 2:
        raise SystemExit(f"mover_multi_gpu needs >= 2 GPUs (found {size}); --cpu-check runs the logic on CPU")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, size, port, args, results)) for r in range(size)]
    for proc in procs:
        proc.start()
    out = results.get()
    for proc in procs:
        proc.join()
    if "error" in out:
        raise SystemExit(out["error"])
    slot_bytes = sum(
        int(np.prod(s)) * torch.empty(0, dtype=d).element_size()
        for s, d in (SMALL if args.cpu_check else mb.TENSORS).values()
    )
    print(
        f"{size} {'CPU processes (gloo)' if args.cpu_check else 'GPUs: ' + torch.cuda.get_device_name(0)}; one expert = {slot_bytes / 1e6:.3f} MB"
    )
    report(out, size, 3 if args.cpu_check else args.layers, slot_bytes)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
