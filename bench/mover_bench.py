"""The weight mover on one GPU: intra-GPU rearrangements of DeepSeek-V3-sized experts.

    python -m eplb_bench.mover_bench [--layers 58] [--rank worst] [--repeats 3] [--json FILE]
    python -m eplb_bench.mover_bench --schedule-times     # no GPU: schedule build time per scale
    python -m eplb_bench.mover_bench --staging-chunks     # no GPU: staged chunks per receive-buffer budget

One rank of a DeepSeek-V3 deployment (58 layers, 256 experts, 288 slots on 32 gpus over 4
nodes: 9 slots per gpu) holds FP8 experts ``w13 [9, 4096, 7168]`` and ``w2 [9, 7168, 2048]``
with their block scales (44 MB per expert). Two transitions from the same old placement (our
fresh plan of one load window): a full re-plan (DeepSeek's eplb.py from scratch on the next,
drifted window) and a migration-aware re-plan (``eplb.rebalance(..., previous=old)``).

The other 31 ranks are played by a loopback transport on the same GPU: a receive is filled
with the sender's content (a write at HBM speed standing in for the network), a send is
dropped. So the figures are the rank's own GPU work: ``commit()`` is exactly the copies
within the gpu at the switch step (local moves, landings, fills, cycles) and is compared
with the device-to-device copy bandwidth measured first; ``step()`` per layer adds the
loopback receives. Printed: bytes, seconds per layer and in all, achieved GB/s against the
copy bandwidth (target >= 80 %), the schedule's prediction against the measurement, and
planning time (policy + schedule) against copy time. Weights encode (layer, expert, tensor)
and are checked after every move; a CUDA graph captured on the weights before the move must
read the new ones after it. Needs one CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace

import numpy as np
import torch

import eplb
from eplb.transfer import Bandwidth, staged_chunks, staged_slots
from eplb.workloads import SCALES, drift, make_loads
from eplb_engine.checksum import slot_checksum
from eplb_engine.mover import WeightMover
from eplb_engine.transport import P2P

from .harness.mover import TENSORS, check, fill_slot, make_layers, plans, reset


class LoopbackPeers:
    """Plays every other rank on this GPU: receives get the sender's content, sends are dropped.

    Receives arrive in the mover's order (layer, round, peer, slot, names sorted), so the
    expert of each is known from the new placement.
    """

    def __init__(self, mover_schedule, new: eplb.Placement, rank: int, size: int, verify: bool = False) -> None:
        self.rank, self.size = rank, size
        s = mover_schedule
        order = np.flatnonzero(s.recv_dst_gpu == rank)  # schedule order is the mover's
        self._queue = [(int(s.recv_layer[i]), int(new.phy2log[s.recv_layer[i], s.recv_dst_slot[i]])) for i in order]
        self._at = 0
        self._names = sorted(TENSORS)
        self._verify = verify  # then each receive ends with the sender's checksum

    def start(self, device: torch.device) -> None:
        pass

    def exchange(self, ops: list[P2P]) -> None:
        recvs = [op for op in ops if not op.send]
        n = len(self._names) + self._verify
        for k in range(0, len(recvs), n):
            layer, expert = self._queue[self._at]
            self._at += 1
            slot = {name: op.tensor.unsqueeze(0) for name, op in zip(self._names, recvs[k : k + n])}
            fill_slot(slot, 0, layer, expert)
            if self._verify:
                recvs[k + n - 1].tensor.copy_(slot_checksum(slot, 0))


def copy_bandwidth(device: torch.device, slot_bytes: int, repeats: int) -> dict[str, float]:
    """Device-to-device copy GB/s (bytes copied per second): one 4 GiB copy, and copies of
    one expert's size (the mover's unit)."""
    big = torch.empty(4 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(big)
    n = slot_bytes
    k = (4 << 30) // n

    def timed(fn) -> float:
        fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return statistics.median(times)

    one = timed(lambda: dst.copy_(big))
    chunks = timed(lambda: [dst[i * n : (i + 1) * n].copy_(big[i * n : (i + 1) * n]) for i in range(k)])
    big = dst = None  # free the 8 GiB before the runs
    torch.cuda.empty_cache()
    return {"copy_gb_s": (4 << 30) / one / 1e9, "expert_copy_gb_s": k * n / chunks / 1e9}


def run_transition(name, old, new, plan_s, rank, layers, device, bw, repeats) -> dict:
    topo = old.topology
    size = topo.num_gpus
    t = time.perf_counter()
    mover = WeightMover(layers, old, new, transport=_Placeholder(rank, size), bandwidth=bw)
    schedule_s = time.perf_counter() - t
    sched = mover.schedule
    out = {
        "transition": name,
        "moves": int((old.phy2log != new.phy2log).sum()),
        "rank_changed_slots": int((old.phy2log != new.phy2log).reshape(topo.num_layers, size, -1)[:, rank].sum()),
        "plan_seconds": plan_s,
        "schedule_seconds": schedule_s,
        "rank_local_copy_bytes": float(sched.local_copy_bytes[:, rank].sum()),
        "rank_received_bytes": float(sched.received_bytes[:, rank].sum()),
        "rank_predicted_local_seconds": float(sched.local_copy_bytes[:, rank].sum() / (bw.local_gb_s * 1e9)),
        "schedule": sched.stats(),
        "staging_bytes_staged": mover.staging_bytes_needed("staged"),
        "staging_bytes_direct": mover.staging_bytes_needed("direct"),
    }
    # staged: prepare (loopback receives) then commit (the copies within the gpu), timed apart;
    # commit both with batched scale copies (one _foreach_copy_ per wave and name) and with one copy_ per tensor
    for batch in (True, False):
        commits, gpu_commits, prepares = [], [], []
        for _ in range(repeats):
            reset(layers, old, rank)
            torch.cuda.synchronize()
            m = WeightMover(
                layers, old, new, transport=LoopbackPeers(sched, new, rank, size), bandwidth=bw, batch_copies=batch
            )
            t = time.perf_counter()
            m.prepare()
            torch.cuda.synchronize()
            prepares.append(time.perf_counter() - t)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t = time.perf_counter()
            start.record()
            m.commit()
            end.record()
            torch.cuda.synchronize()
            commits.append(time.perf_counter() - t)
            gpu_commits.append(start.elapsed_time(end) / 1e3)
            bad = check(layers, new, rank)
            assert bad == 0, f"{name}: {bad} slots wrong after commit"
            del m
        key = "commit" if batch else "commit_unbatched"
        out[f"{key}_seconds"] = statistics.median(commits)
        out[f"{key}_gpu_seconds"] = statistics.median(gpu_commits)
        out[f"{key}_gb_s"] = out["rank_local_copy_bytes"] / out[f"{key}_seconds"] / 1e9
        if batch:
            out["prepare_seconds"] = statistics.median(prepares)
    # the canary: checksums of every moved slot against its source's, once
    reset(layers, old, rank)
    torch.cuda.synchronize()
    m = WeightMover(
        layers, old, new, transport=LoopbackPeers(sched, new, rank, size, verify=True), bandwidth=bw, verify=True
    )
    m.prepare()
    torch.cuda.synchronize()
    t = time.perf_counter()
    report = m.commit()
    torch.cuda.synchronize()
    out["commit_verify_seconds"] = time.perf_counter() - t
    out["verify_checked_slots"] = report.checked_slots
    out["verify_mismatches"] = len(report.mismatches)
    del m
    # direct: layers per call 1, 4 and all; seconds per call (what one engine step would stall)
    for per_call in (1, 4, topo.num_layers):
        calls = []
        reset(layers, old, rank)
        torch.cuda.synchronize()
        m = WeightMover(
            layers, old, new, transport=LoopbackPeers(sched, new, rank, size), bandwidth=bw, layers_per_call=per_call
        )
        while not m.done:
            t = time.perf_counter()
            m.step()
            torch.cuda.synchronize()
            calls.append(time.perf_counter() - t)
        bad = check(layers, new, rank)
        assert bad == 0, f"{name}: {bad} slots wrong after direct steps of {per_call}"
        out[f"direct_{per_call}_calls"] = len(calls)
        out[f"direct_{per_call}_max_call_seconds"] = max(calls)
        out[f"direct_{per_call}_total_seconds"] = sum(calls)
    out["graph_reads_new_weights"] = _graph_check(layers, old, new, rank, sched, bw)
    out["chunked"] = [run_chunked(name, old, new, rank, layers, sched, bw, b) for b in CHUNK_BUDGETS]
    return out


# receive-buffer budgets of the chunked runs: one chunk, MoverApplier's default, the smallest sensible
CHUNK_BUDGETS = (None, 1 << 30, 512 << 20)


def _print_chunked(runs: list[dict]) -> None:
    for c in runs:
        label = "one chunk" if c["budget"] is None else f"staging_bytes {c['budget'] / 2**30:.2f} GiB"
        print(
            f"  staged, {label}: {c['chunks']} chunks ({min(c['layers_per_chunk'])}-{max(c['layers_per_chunk'])} layers), "
            f"receive buffers {c['staged_bytes'] / 1e9:.2f} GB, GPU memory added at peak {(c['peak_extra_bytes'] or 0) / 1e9:.2f} GB; "
            f"prepare {c['prepare_seconds'] * 1e3:.0f} ms, commits {c['commit_seconds'] * 1e3:.1f} ms in all, "
            f"longest {c['longest_commit_seconds'] * 1e3:.2f} ms"
        )


def run_chunked(name, old, new, rank, layers, sched, bw, budget: int | None) -> dict:
    """Staged mode in chunks within ``budget`` bytes of receive buffers (``None``: one chunk):
    the GPU memory the move adds (peak over the weights), each chunk's ``commit()`` stall,
    and the weights checked after a middle chunk (a mix of new and old layers) and at the end."""
    topo = old.topology
    cuda = next(iter(layers[0].values())).is_cuda  # the logic also runs on CPU tensors (no memory figure)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    reset(layers, old, rank)
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if cuda else 0
    m = WeightMover(
        layers, old, new, transport=LoopbackPeers(sched, new, rank, topo.num_gpus), bandwidth=bw, staging_bytes=budget
    )
    prepares, commits = [], []
    middle = len(m.chunks) // 2
    for k, chunk in enumerate(m.chunks):
        t = time.perf_counter()
        while m.prepare():
            pass
        sync()
        prepares.append(time.perf_counter() - t)
        t = time.perf_counter()
        m.commit()
        sync()
        commits.append(time.perf_counter() - t)
        if k == middle and k + 1 < len(m.chunks):
            rows = old.phy2log.copy()
            rows[: chunk.stop] = new.phy2log[: chunk.stop]
            bad = check(layers, eplb.Placement(rows, topo), rank)
            assert bad == 0, f"{name}: {bad} slots wrong after chunk {k}"
    assert check(layers, new, rank) == 0, f"{name}: slots wrong after the chunked move"
    return {
        "budget": budget,
        "chunks": len(m.chunks),
        "layers_per_chunk": [len(c) for c in m.chunks],
        "staged_bytes": m.staging_bytes_needed("staged"),
        "peak_extra_bytes": torch.cuda.max_memory_allocated() - base if cuda else None,
        "prepare_seconds": sum(prepares),
        "commit_seconds": sum(commits),
        "longest_commit_seconds": max(commits),
    }


class _Placeholder:
    """A transport for building a mover only to read its schedule (nothing is exchanged)."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size

    def start(self, device: torch.device) -> None:
        raise AssertionError("not for moving")

    def exchange(self, ops: list[P2P]) -> None:
        raise AssertionError("not for moving")


def _graph_check(layers, old, new, rank, sched, bw) -> bool:
    """Capture a graph summing every slot's scales of layer 0; move; replay: new sums?"""
    reset(layers, old, rank)
    torch.cuda.synchronize()
    scales = layers[0]["w13_scale"]
    out = torch.empty(scales.shape[0], device=scales.device)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        out.copy_(scales[:, 0, 0])
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(scales[:, 0, 0])
    WeightMover(layers, old, new, transport=LoopbackPeers(sched, new, rank, old.topology.num_gpus), bandwidth=bw).run()
    graph.replay()
    torch.cuda.synchronize()
    S = old.topology.slots_per_gpu
    want = [float(e) for e in new.phy2log[0, rank * S : (rank + 1) * S]]
    return out.tolist() == want


def schedule_times(repeats: int) -> None:
    """Build time of ``transfer_schedule`` at the standard DeepSeek-V3 scales (CPU only)."""
    for name in ("v3-prefill", "v3-decode-144", "v3-decode-320", "v3-512"):
        topo = SCALES[name]
        base = make_loads("lognormal-1.0", topo, 0)
        nxt = drift(base, 0.2, 1, 1)[0]
        old = eplb.rebalance(base, topo, "auto").placement
        news = {
            "full re-plan": eplb.rebalance(nxt, topo, "deepseek").placement,
            "migration-aware": eplb.rebalance(nxt, topo, "auto", previous=old).placement,
        }
        for label, new in news.items():
            times = []
            for _ in range(repeats):
                t = time.perf_counter()
                s = eplb.transfer.transfer_schedule(old, new, topo, expert_bytes=44e6)
                times.append(time.perf_counter() - t)
            print(
                f"{name} ({topo.num_gpus} gpus, {topo.num_nodes} nodes) {label}: schedule {statistics.median(times) * 1e3:.0f} ms; "
                f"{s.total_rounds} rounds (max {int(s.rounds.max(initial=0))} in a layer; lower bound {_round_bound(s)}), "
                f"{s.bytes / 1e9:.1f} GB between gpus, predicted {s.predicted_seconds:.3f} s"
            )


def staging_chunks(layers: int, seed: int) -> None:
    """Staged mode's chunks for a range of receive-buffer budgets (CPU only): the mover_bench
    transitions at v3-prefill scale; per budget the chunks, their layers, and the receive
    buffers of the rank that needs the most, the chunk that needs the most."""
    topo = SCALES["v3-prefill"].with_layers(layers)
    slot = sum(int(np.prod(shape)) * torch.empty(0, dtype=dt).element_size() for shape, dt in TENSORS.values())
    old, transitions = plans(topo, seed)
    print(f"topology: {topo}; one expert = {slot / 1e6:.2f} MB")
    for name, (new, _) in transitions.items():
        sched = eplb.transfer.transfer_schedule(old, new, topo, expert_bytes=float(slot))
        need = staged_slots(sched)  # [L, G]
        smallest = int(need.max()) * slot
        print(
            f"\n{name}: every receive at once: {int(need.sum(axis=0).max()) * slot / 1e9:.2f} GB on the busiest rank; "
            f"smallest budget (one layer): {smallest / 1e6:.0f} MB"
        )
        for budget in (None, 4 << 30, 2 << 30, 1 << 30, 512 << 20, smallest):
            chunks = staged_chunks(sched, slot, budget)
            per = [int(max(need[list(c)].sum(axis=0).max(), 0)) * slot for c in chunks]
            sizes = [len(c) for c in chunks]
            label = "None (one chunk)" if budget is None else f"{budget / 2**30:.2f} GiB"
            print(
                f"  staging_bytes {label:>17}: {len(chunks):>3} chunks of {min(sizes)}-{max(sizes)} layers; "
                f"receive buffers of the busiest rank: at most {max(per) / 1e9:.2f} GB, median chunk {statistics.median(per) / 1e9:.2f} GB"
            )


def _round_bound(s) -> int:
    """Sum over layers of the most distinct peers one gpu has: no schedule with one peer per
    gpu per round needs fewer rounds."""
    G, L = s.topology.num_gpus, s.topology.num_layers
    lo, hi = np.minimum(s.recv_src_gpu, s.recv_dst_gpu), np.maximum(s.recv_src_gpu, s.recv_dst_gpu)
    pairs = np.unique((s.recv_layer * G + lo) * G + hi)
    lay, a, b = pairs // (G * G), pairs // G % G, pairs % G
    deg = np.bincount(np.concatenate([lay * G + a, lay * G + b]), minlength=L * G).reshape(L, G)
    return int(deg.max(axis=1).sum())


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=58, help="MoE layers (DeepSeek-V3: 58)")
    p.add_argument(
        "--rank",
        default="worst",
        help="the rank to run: an id, or 'worst' (most bytes copied within its gpu in the full re-plan)",
    )
    p.add_argument("--repeats", type=int, default=3, help="timed repeats (medians are printed)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the figures to this file")
    p.add_argument(
        "--schedule-times", action="store_true", help="only time transfer_schedule at the standard scales (no GPU)"
    )
    p.add_argument(
        "--staging-chunks", action="store_true", help="only print staged chunks per receive-buffer budget (no GPU)"
    )
    p.add_argument(
        "--chunked-only", action="store_true", help="on the GPU, only the staged runs in chunks (memory, commit stalls)"
    )
    args = p.parse_args(argv)
    if args.staging_chunks:
        staging_chunks(args.layers, args.seed)
        return
    if args.schedule_times:
        schedule_times(args.repeats)
        return
    if not torch.cuda.is_available():
        raise SystemExit("mover_bench needs a CUDA GPU")
    device = torch.device("cuda", torch.cuda.current_device())
    topo = SCALES["v3-prefill"].with_layers(args.layers)
    slot_bytes = sum(int(np.prod(shape)) * torch.empty(0, dtype=dt).element_size() for shape, dt in TENSORS.values())
    print(f"device: {torch.cuda.get_device_name(device)}; torch {torch.__version__}")
    print(f"topology: {topo}; one expert = {slot_bytes / 1e6:.2f} MB ({', '.join(TENSORS)})")
    ceil = copy_bandwidth(device, slot_bytes, args.repeats)
    print(
        f"device-to-device copy: {ceil['copy_gb_s']:.0f} GB/s one 4 GiB copy, {ceil['expert_copy_gb_s']:.0f} GB/s in copies of one expert"
    )
    bw = replace(Bandwidth(), local_gb_s=ceil["expert_copy_gb_s"])
    old, transitions = plans(topo, args.seed)
    if args.rank == "worst":
        full = next(iter(transitions.values()))[0]
        s = eplb.transfer.transfer_schedule(old, full, topo, expert_bytes=float(slot_bytes))
        rank = int(s.local_copy_bytes.sum(axis=0).argmax())
    else:
        rank = int(args.rank)
    print(
        f"rank {rank}: {topo.num_layers} layers x {topo.slots_per_gpu} slots = {topo.num_layers * topo.slots_per_gpu * slot_bytes / 1e9:.1f} GB of experts"
    )
    layers = make_layers(old, rank, device)
    results = {
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "slot_bytes": slot_bytes,
        "rank": rank,
        **ceil,
        "transitions": [],
    }
    for name, (new, plan_s) in transitions.items():
        if args.chunked_only:
            sched = eplb.transfer.transfer_schedule(old, new, topo, expert_bytes=float(slot_bytes), bandwidth=bw)
            print(f"\n{name}: rank {rank}")
            runs = [run_chunked(name, old, new, rank, layers, sched, bw, b) for b in CHUNK_BUDGETS]
            _print_chunked(runs)
            results["transitions"].append({"transition": name, "chunked": runs})
            continue
        r = run_transition(name, old, new, plan_s, rank, layers, device, bw, args.repeats)
        results["transitions"].append(r)
        L = topo.num_layers
        print(
            f"\n{name}: {r['moves']} moves of {L * topo.num_slots} slots; rank {rank}: {r['rank_changed_slots']} slots change"
        )
        print(f"  planning: policy {r['plan_seconds'] * 1e3:.0f} ms + schedule {r['schedule_seconds'] * 1e3:.0f} ms")
        print(
            f"  schedule (all ranks): {r['schedule']['bytes'] / 1e9:.1f} GB between gpus, {r['schedule']['cross_node_bytes'] / 1e9:.1f} GB cross-node, "
            f"{r['schedule']['rounds']} rounds, max {r['schedule']['max_rank_round_bytes'] / 1e6:.0f} MB per rank per round, "
            f"predicted {r['schedule']['predicted_seconds']:.3f} s (default link speeds, measured local copy)"
        )
        print(
            f"  rank's copies within the gpu: {r['rank_local_copy_bytes'] / 1e9:.2f} GB; receive buffers staged {r['staging_bytes_staged'] / 1e9:.2f} GB, direct {r['staging_bytes_direct'] / 1e9:.2f} GB"
        )
        print(
            f"  commit (copies within the gpu): {r['commit_seconds'] * 1e3:.1f} ms = {r['commit_seconds'] / L * 1e3:.2f} ms per layer, "
            f"{r['commit_gb_s']:.0f} GB/s = {100 * r['commit_gb_s'] / ceil['expert_copy_gb_s']:.0f} % of the expert-sized copy bandwidth "
            f"({100 * r['commit_gb_s'] / ceil['copy_gb_s']:.0f} % of one big copy); predicted {r['rank_predicted_local_seconds'] * 1e3:.1f} ms"
        )
        print(
            f"  commit, one copy_ per tensor instead: {r['commit_unbatched_seconds'] * 1e3:.1f} ms ({r['commit_unbatched_gb_s']:.0f} GB/s); "
            f"stream time of the commits: batched {r['commit_gpu_seconds'] * 1e3:.1f} ms, one per tensor {r['commit_unbatched_gpu_seconds'] * 1e3:.1f} ms"
        )
        print(
            f"  commit with verify=True: {r['commit_verify_seconds'] * 1e3:.1f} ms, {r['verify_checked_slots']} slots checked, {r['verify_mismatches']} mismatches"
        )
        print(
            f"  prepare (loopback receives): {r['prepare_seconds'] * 1e3:.1f} ms for {r['rank_received_bytes'] / 1e9:.2f} GB"
        )
        for per_call in (1, 4, L):
            print(
                f"  direct, {per_call} layer(s) per call: {r[f'direct_{per_call}_calls']} calls, longest {r[f'direct_{per_call}_max_call_seconds'] * 1e3:.1f} ms, "
                f"all {r[f'direct_{per_call}_total_seconds'] * 1e3:.1f} ms"
            )
        print(
            f"  planning vs copying: {(r['plan_seconds'] + r['schedule_seconds']) * 1e3:.0f} ms vs commit {r['commit_seconds'] * 1e3:.1f} ms"
        )
        _print_chunked(r["chunked"])
        print(
            f"  weights checked after every move: ok; CUDA graph captured before the move reads the new weights: {r['graph_reads_new_weights']}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
