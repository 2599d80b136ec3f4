"""``python -m eplb_bench.demo_recovery``: how long the demo's survivors take to route around a
killed rank, median over a few ``eplb demo --fail-rank`` runs.

Each run is ``eplb demo --ranks R --seconds S --fail-rank F --fail-at STEP`` in this process;
from its summary's ``failures`` entry it prints the time from the kill (SIGKILL, the parent's
clock) to the step the survivors route without the dead rank (``recovery_s``), the part spent
learning of it (``detect_s``) and rebuilding the groups (``regroup_s``), and the steps between.
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys

from eplb_tools.demo import DemoConfig, run

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m eplb_bench.demo_recovery", description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--fail-rank", type=int, default=1)
    ap.add_argument("--fail-at", type=int, default=200)
    ap.add_argument("--barrier", choices=("group", "service"), default="group")
    args = ap.parse_args(argv)
    rows = []
    for i in range(args.runs):
        cfg = DemoConfig(
            ranks=args.ranks,
            seconds=args.seconds,
            barrier=args.barrier,
            fail_rank=args.fail_rank,
            fail_at=args.fail_at,
            seed=i,
        )
        s = run(cfg, out=io.StringIO())
        (f,) = s["failures"]
        rows.append(f)
        print(
            f"run {i} (seed {i}): recovery {f['recovery_s']:.3f} s (detect {f['detect_s'] * 1e3:.1f} ms, regroup "
            f"{f['regroup_s'] * 1e3:.0f} ms), switched {f['recovered_step'] - f['step']} steps after the kill, "
            f"{f['experts_reloaded']} experts reloaded, {f['dispatches_lost']} dispatches lost, "
            f"{s['misrouted_dispatches']} misrouted",
            flush=True,
        )
    med = {k: statistics.median(r[k] for r in rows) for k in ("recovery_s", "detect_s", "regroup_s")}
    steps = statistics.median(r["recovered_step"] - r["step"] for r in rows)
    print(
        f"median over {len(rows)} runs: recovery {med['recovery_s']:.3f} s, detect {med['detect_s'] * 1e3:.1f} ms, "
        f"regroup {med['regroup_s'] * 1e3:.0f} ms, {steps:g} steps"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
