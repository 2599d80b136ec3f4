"""What ``LoadReporter.add`` costs the engine's step, and what the reporter sustains.

``python -m eplb_bench.client_bench [--scale v3-prefill] [--adds 20000]`` starts a service on
loopback (in-memory store), then:

- times ``add`` of one step's physical counts ``[L, P]`` (numpy int64 and a torch CPU tensor,
  copied and handed over) on the caller's thread: median and 99th percentile;
- adds at ``--rate`` per second, then as fast as it can, for ``--seconds`` each, and reports
  how many arrays the reporter's thread summed and streamed and how many it had to drop.
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time

import numpy as np

from eplb.workloads import SCALES


def _serve():
    from eplb_service.balancer import BalancerConfig
    from eplb_service.server import ServerConfig, start_server

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    server = asyncio.run_coroutine_threadsafe(
        start_server(ServerConfig(port=0, balancer=BalancerConfig())), loop
    ).result(10)
    return loop, server


def main(argv: list[str] | None = None) -> int:
    import torch

    from eplb_engine import LoadReporter, ServiceClient

    ap = argparse.ArgumentParser(prog="python -m eplb_bench.client_bench", description=__doc__.splitlines()[0])
    ap.add_argument("--scale", default="v3-prefill", choices=sorted(SCALES))
    ap.add_argument("--adds", type=int, default=20000, help="adds timed per variant")
    ap.add_argument("--seconds", type=float, default=5.0, help="how long the throughput runs add")
    ap.add_argument("--rate", type=int, default=2000, help="adds per second of the paced run (a 0.5 ms step)")
    args = ap.parse_args(argv)
    topo = SCALES[args.scale]
    loop, server = _serve()
    try:
        with ServiceClient(server.target) as client:
            client.create_deployment("bench", topo)
        counts = np.random.default_rng(0).integers(0, 100, (topo.num_layers, topo.num_slots))
        tensor = torch.from_numpy(counts)
        print(
            f"scale {args.scale}: one add is [L, P] = [{topo.num_layers}, {topo.num_slots}] counts; machine shared, medians of {args.adds}"
        )
        for name, arr, copy in (
            ("numpy int64, copied", counts, True),
            ("numpy int64, handed over", counts, False),
            ("torch int64 (CPU), cloned", tensor, True),
        ):
            reporter = LoadReporter(server.target, "bench", 0, topo, interval_s=0.05, max_queued=args.adds + 1)
            times = np.empty(args.adds)
            for i in range(args.adds):
                start = time.perf_counter()
                reporter.add(arr, version=1, copy=copy)
                times[i] = time.perf_counter() - start
            reporter.close(timeout_s=60)
            print(
                f"  add, {name:28s} median {np.median(times) * 1e6:6.1f} us   p99 {np.percentile(times, 99) * 1e6:6.1f} us"
            )
        for rate in (args.rate, None):
            reporter = LoadReporter(server.target, "bench", 0, topo, interval_s=1.0)
            start = time.perf_counter()
            n = 0
            while (now := time.perf_counter()) < start + args.seconds:
                reporter.add(counts, version=1)
                n += 1
                if rate:
                    time.sleep(max(0.0, start + n / rate - now))
            done = reporter.flush(60)
            took = time.perf_counter() - start
            st = reporter.stats()
            reporter.close()
            what = f"paced at {rate}/s" if rate else "unpaced (a tight loop)"
            print(
                f"  {what:24s} {n} adds in {args.seconds:g} s, all sent after {took:.1f} s: {done}; "
                f"{st.added} summed into {st.accepted} reports accepted; {st.dropped_adds} adds and {st.dropped_reports} reports dropped"
            )
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(0), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
