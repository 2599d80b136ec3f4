"""What one caller's oversized or malformed requests cost the service's log and statuses.

Starts a real server on 127.0.0.1 (embedded store, an auth file with an admin and a scoped
engine token), logs at INFO to a file as ``eplb serve`` does, and floods it from one client:

- ``names``: GetDeployment with distinct long names, from the engine token (out of its scope)
  and from the admin token (unknown names), and distinct valid names out of the engine token's
  scope;
- ``strings``: CreateDeployment with a long policy and planning effort (a valid name);
- ``undecodable``: GetDeployment with bytes that are no message.

For each flood it prints the calls, the status codes seen, the largest status (message plus
trailers) and how many bytes the log grew by::

    python -m eplb_bench.flood_bench [--size 1048576] [--calls 40]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import logging
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc

from eplb_engine.client import auth_metadata
from eplb_service.auth import token_sha256
from eplb_service.server import ServerConfig, start_server
from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb
from eplb_wire._gen.eplb.v1 import balancer_pb2_grpc as pb_grpc

ADMIN, ENGINE = "flood-admin", "flood-engine"


def _status_bytes(exc: grpc.aio.AioRpcError) -> int:
    return len(exc.details() or "") + sum(len(k) + len(v) for k, v in exc.trailing_metadata() or ())


async def _flood(
    calls: int, call: Callable[[int], Awaitable[object]], log: Path
) -> tuple[collections.Counter, int, int, float]:
    codes: collections.Counter = collections.Counter()
    largest = 0
    before = log.stat().st_size
    start = time.perf_counter()
    for i in range(calls):
        try:
            await call(i)
            codes["OK"] += 1
        except grpc.aio.AioRpcError as exc:
            codes[exc.code().name] += 1
            largest = max(largest, _status_bytes(exc))
    elapsed = time.perf_counter() - start
    for h in logging.getLogger().handlers:
        h.flush()
    return codes, largest, log.stat().st_size - before, elapsed


async def main(size: int, calls: int) -> None:
    with tempfile.TemporaryDirectory(prefix="eplb-flood-") as tmp:
        log_path = Path(tmp) / "serve.log"
        handler = logging.FileHandler(log_path)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logging.getLogger().addHandler(handler)
        logging.getLogger().setLevel(logging.INFO)
        auth = Path(tmp) / "auth.json"
        auth.write_text(
            json.dumps(
                {
                    "tokens": [
                        {"sha256": token_sha256(ADMIN), "role": "admin", "deployments": []},
                        {"sha256": token_sha256(ENGINE), "role": "engine", "deployments": ["team-a-*"]},
                    ]
                }
            )
        )
        server = await start_server(ServerConfig(port=0, auth_file=auth))
        channel = grpc.aio.insecure_channel(
            server.target, options=[("grpc.max_send_message_length", 64 << 20), ("grpc.max_metadata_size", 64 << 20)]
        )
        stub = pb_grpc.ExpertLoadBalancerServiceStub(channel)
        admin, engine = auth_metadata(ADMIN), auth_metadata(ENGINE)

        def name(i: int) -> str:
            return f"team-b-{i:08d}" + "n" * (size - 15)

        raw = channel.unary_unary("/eplb.v1.ExpertLoadBalancerService/GetDeployment")
        floods = {
            "names, engine token": lambda i: stub.GetDeployment(pb.GetDeploymentRequest(name=name(i)), metadata=engine),
            "names, admin token": lambda i: stub.GetDeployment(pb.GetDeploymentRequest(name=name(i)), metadata=admin),
            "short names out of scope": lambda i: stub.GetDeployment(
                pb.GetDeploymentRequest(name=f"team-b-{i}"), metadata=engine
            ),
            "create with long strings": lambda i: stub.CreateDeployment(
                pb.CreateDeploymentRequest(
                    deployment=pb.Deployment(
                        name=f"team-a-{i}",
                        topology=pb.Topology(num_layers=2, num_experts=8, num_slots=8, num_gpus=2),
                        policy=f"{i:08d}" + "p" * (size - 8),
                        planning=pb.Planning(effort="e" * size),
                    )
                ),
                metadata=admin,
            ),
            "undecodable bytes": lambda i: raw(b"\xff\xff\xff\xff", metadata=admin),
        }
        print(f"{calls} calls each, strings of {size} characters; log at INFO")
        print(f"{'flood':<26} {'codes':<40} {'largest status B':>17} {'log grew B':>11} {'ms/call':>8}")
        try:
            for what, call in floods.items():
                codes, largest, grew, elapsed = await _flood(calls, call, log_path)
                shown = ", ".join(f"{k} {v}" for k, v in codes.items())
                print(f"{what:<26} {shown:<40} {largest:>17} {grew:>11} {elapsed / calls * 1e3:>8.2f}")
        finally:
            await channel.close()
            await server.stop(0)
            logging.getLogger().removeHandler(handler)


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=1 << 20, help="characters of each long string")
    parser.add_argument("--calls", type=int, default=40, help="calls per flood")
    args = parser.parse_args()
    asyncio.run(main(args.size, args.calls))


if __name__ == "__main__":
    cli()
