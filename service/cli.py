"""``eplb serve``: flags, ``EPLB_*`` environment defaults, logging, signals.

The token is read, first found first, from ``--token-file``/``EPLB_TOKEN_FILE``, ``--token``, or
``EPLB_TOKEN``; ``--token`` shows in ``ps`` and shell history, so prefer the file or the variable.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from pathlib import Path

from .balancer import BalancerConfig
from .logs import LOG_FORMATS, setup_logging
from .server import ServerConfig, StartError, start_server

__all__ = ["main", "parse_args"]


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(f"EPLB_{name}", default)


def _read_token(path: Path) -> str:
    try:
        token = path.read_text().strip()
    except OSError as exc:
        raise ValueError(f"--token-file {path}: cannot read it ({exc.strerror})") from None
    if not token or any(c.isspace() for c in token):
        raise ValueError(f"--token-file {path}: must hold one token (non-empty, no whitespace inside)")
    return token


def parse_args(argv: list[str]) -> tuple[ServerConfig, str, str]:
    """``argv`` → the server's config, the log level and the log format."""
    ap = argparse.ArgumentParser(prog="eplb serve", description="Run the eplb balancer service (gRPC, package eplb.v1).")
    ap.add_argument("--host", default=_env("HOST", "127.0.0.1"),
                    help="bind address; 0.0.0.0 or :: to serve other hosts [EPLB_HOST, 127.0.0.1]")
    ap.add_argument("--port", type=int, default=int(_env("PORT", "50051")), help="gRPC port, 0 picks one [EPLB_PORT, 50051]")
    ap.add_argument("--redis-url", default=_env("REDIS_URL"),
                    help="redis://… for state shared by replicas; unset: embedded in-memory store [EPLB_REDIS_URL]")
    ap.add_argument("--key-prefix", default=_env("KEY_PREFIX", "eplb"), help="Redis key prefix [EPLB_KEY_PREFIX, eplb]")
    ap.add_argument("--token", default=None,
                    help="require 'authorization: Bearer <token>'; visible in ps, prefer --token-file [EPLB_TOKEN]")
    ap.add_argument("--token-file", type=Path, default=_env("TOKEN_FILE"),
                    help="read the token from this file (surrounding whitespace stripped) [EPLB_TOKEN_FILE]")
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
    ap.add_argument("--log-format", default=_env("LOG_FORMAT", "plain"), choices=LOG_FORMATS,
                    help="plain text, or one JSON object per line [EPLB_LOG_FORMAT, plain]")
    args = ap.parse_args(argv)
    if bool(args.tls_cert) != bool(args.tls_key):
        ap.error("--tls-cert and --tls-key go together")
    if args.token is not None and args.token_file is not None:
        ap.error("give --token or --token-file, not both")
    token = args.token or _env("TOKEN") or None
    if args.token_file is not None:
        try:
            token = _read_token(args.token_file)
        except ValueError as exc:
            ap.error(str(exc))
    config = ServerConfig(
        host=args.host, port=args.port, redis_url=args.redis_url, key_prefix=args.key_prefix, token=token,
        tls_cert=args.tls_cert, tls_key=args.tls_key, max_message_bytes=args.max_message_bytes,
        metrics_port=None if args.metrics_port < 0 else args.metrics_port, grace_s=args.grace_seconds,
        balancer=BalancerConfig(lease_s=args.lease_seconds, flush_s=args.flush_seconds),
    )
    return config, args.log_level, args.log_format


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
    config, level, fmt = parse_args(argv)
    setup_logging(level, fmt)
    try:
        asyncio.run(_serve(config))
    except StartError as exc:
        print(f"eplb serve: error: --{exc.field.replace('_', '-')}: {exc}", file=sys.stderr)
        return 2
    return 0
