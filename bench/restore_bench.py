"""How fast a survivor restores experts that died with a gpu: ``WeightMover``'s restores from a
``HostExpertBackup`` (pinned host copies) against the same loader over pageable host memory.

One rank survives a gpu: the old placement has experts ``E/2 .. E-1`` only on gpu 1; gpu 1
goes down and the new placement puts them on gpu 0 in place of its redundant replicas, so the
transition is restores only (no peer traffic, no local copies). Each restore is one slot of
DeepSeek-V3's shapes by default (w13 ``[2 x 2048, 7168]`` and w2 ``[7168, 2048]`` in FP8 as
uint8, scales as float32: 44 MB). Prints one JSON line per source: restored experts, bytes,
the median seconds of ``--repeats`` runs of ``WeightMover.run()`` (synchronised) and GB/s,
and the host bytes the backup holds.

    python -m eplb_bench.restore_bench --layers 4 --experts 16 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

import eplb
from eplb_engine import WeightMover
from eplb_engine.backup import HostExpertBackup, at_risk


class _Alone:
    """The transport of a group of one rank: the transition has no peer round."""

    rank, size = 0, 1

    def start(self, device: torch.device) -> None:
        pass

    def exchange(self, ops: list) -> None:
        raise AssertionError("a transition of restores only has no peer round")


def _shapes(hidden: int, inter: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    return {
        "w13": ((2 * inter, hidden), torch.uint8),
        "w2": ((hidden, inter), torch.uint8),
        "w13_scale": ((2 * inter // 128, hidden // 128), torch.float32),
        "w2_scale": ((hidden // 128, inter // 128), torch.float32),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=16, help="experts (even); half of them are restored per layer")
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--inter", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    L, E = args.layers, args.experts
    if E < 2 or E % 2:
        ap.error("--experts must be even and >= 2")
    device = torch.device(args.device)
    half = E // 2
    topo = eplb.Topology(L, E, 2 * E, 2)  # E slots a gpu
    lo, hi = np.arange(half), np.arange(half, E)
    old = eplb.Placement(np.tile(np.concatenate([lo, lo, hi, hi]), (L, 1)), topo)
    new = eplb.Placement(np.tile(np.concatenate([lo, hi, np.full(E, -1)]), (L, 1)), topo)
    shapes = _shapes(args.hidden, args.inter)
    slot = sum(int(np.prod(s)) * torch.empty(0, dtype=dt).element_size() for s, dt in shapes.values())
    # The checkpoint stand-in: one pageable host copy per expert, made once.
    gen = torch.Generator().manual_seed(0)
    pageable = {
        (layer, e): {
            n: (torch.randint(0, 255, s, generator=gen, dtype=torch.uint8) if dt == torch.uint8 else torch.rand(s)).to(
                dt
            )
            for n, (s, dt) in shapes.items()
        }
        for layer in range(L)
        for e in hi.tolist()
    }
    layers = [{n: torch.zeros((E, *s), dtype=dt, device=device) for n, (s, dt) in shapes.items()} for _ in range(L)]
    backup = HostExpertBackup(lambda layer, e: pageable[(layer, e)], budget_bytes=len(pageable) * slot)
    assert backup.keep(at_risk(old, gpu=0)) == len(pageable)
    for name, loader in (("pinned HostExpertBackup", backup), ("pageable host", lambda la, e: pageable[(la, e)])):
        times = []
        for _ in range(args.repeats + 1):
            mover = WeightMover(layers, old, new, transport=_Alone(), gpus=[0], restore=loader)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            report = mover.run()
            mover.synchronize()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
        seconds = statistics.median(times[1:])  # the first run warms the allocator and the copy engines
        print(
            json.dumps(
                {
                    "source": name,
                    "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                    "restored": report.restored,
                    "bytes": report.restored_bytes,
                    "expert_mb": round(slot / 1e6, 2),
                    "seconds": round(seconds, 5),
                    "gb_s": round(report.restored_bytes / seconds / 1e9, 2),
                    "backup_host_bytes": backup.held_bytes if loader is backup else 0,
                    "pinned": backup.pin if loader is backup else False,
                }
            ),
            flush=True,
        )
    got = layers[0]["w2"][half].cpu()
    assert torch.equal(got, pageable[(0, half)]["w2"]), "restored weights differ from the source"


if __name__ == "__main__":
    main()
