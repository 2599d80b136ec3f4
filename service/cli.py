"""``eplb serve``: flags, ``EPLB_*`` environment defaults, logging, signals."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
from pathlib import Path

from .balancer import BalancerConfig
from .server import ServerConfig, start_server

__all__ = ["main", "parse_args"]


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(f"EPLB_{name}", default)


def parse_args(argv: list[str]) -> tuple[ServerConfig, str]:
    ap = argparse.ArgumentParser(prog="eplb serve", description="Run the eplb balancer service (gRPC, package eplb.v1).")
    ap.add_argument("--host", default=_env("HOST", "0.0.0.0"), help="bind address [EPLB_HOST, 0.0.0.0]")
    ap.add_argument("--port", type=int, default=int(_env("PORT", "50051")), help="gRPC port, 0 picks one [EPLB_PORT, 50051]")
    ap.add_argument("--redis-url", default=_env("REDIS_URL"),
                    help="redis://… for state shared by replicas; unset: embedded in-memory store [EPLB_REDIS_URL]")
    ap.add_argument("--key-prefix", default=_env("KEY_PREFIX", "eplb"), help="Redis key prefix [EPLB_KEY_PREFIX, eplb]")
    ap.add_argument("--token", default=_env("TOKEN"), help="require 'authorization: Bearer <token>' [EPLB_TOKEN]")
    ap.add_argument("--tls-cert", type=Path, default=_env("TLS_CERT"), help="PEM certificate chain [EPLB_TLS_CERT]")
    ap.add_argument("--tls-key", type=Path, default=_env("TLS_KEY"), help="PEM private key [EPLB_TLS_KEY]")
    ap.add_argument("--max-message-bytes", type=int, default=int(_env("MAX_MESSAGE_BYTES", str(16 << 20))),
                    help="largest gRPC message either way [EPLB_MAX_MESSAGE_BYTES, 16 MiB]")
    ap.add_argument("--metrics-port", type=int, default=int(_env("METRICS_PORT", "-1")),
                    help="Prometheus /metrics port, -1 off [EPLB_METRICS_PORT, -1]")
    ap.add_argument("--lease-seconds", type=float, default=float(_env("LEASE_SECONDS", "10")),
                    help="planning lease; a crashed planner is replaced within it [EPLB_LEASE_SECONDS, 10]")
    ap.add_argument("--flush-seconds", type=float, default=float(_env("FLUSH_SECONDS", "1")),
                    help="how often windows are flushed to the store [EPLB_FLUSH_SECONDS, 1]")
    ap.add_argument("--grace-seconds", type=float, default=float(_env("GRACE_SECONDS", "5")),
                    help="graceful shutdown time on SIGTERM [EPLB_GRACE_SECONDS, 5]")
    ap.add_argument("--log-level", default=_env("LOG_LEVEL", "INFO"), help="[EPLB_LOG_LEVEL, INFO]")
    args = ap.parse_args(argv)
    if bool(args.tls_cert) != bool(args.tls_key):
        ap.error("--tls-cert and --tls-key go together")
    config = ServerConfig(
        host=args.host, port=args.port, redis_url=args.redis_url, key_prefix=args.key_prefix, token=args.token,
        tls_cert=args.tls_cert, tls_key=args.tls_key, max_message_bytes=args.max_message_bytes,
        metrics_port=None if args.metrics_port < 0 else args.metrics_port, grace_s=args.grace_seconds,
        balancer=BalancerConfig(lease_s=args.lease_seconds, flush_s=args.flush_seconds),
    )
    return config, args.log_level


async def _serve(config: ServerConfig) -> None:
    running = await start_server(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"eplb serve: listening on {config.host}:{running.port}", flush=True)
    await stop.wait()
    logging.getLogger(__name__).info("shutting down (grace %.1fs)", config.grace_s)
    await running.stop()


def main(argv: list[str]) -> int:
    config, level = parse_args(argv)
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(_serve(config))
    return 0
