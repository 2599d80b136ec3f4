"""``eplb serve``: flags, ``EPLB_*`` environment defaults, logging, signals.

The token is read, first found first, from ``--token-file``/``EPLB_TOKEN_FILE``, ``--token``, or
``EPLB_TOKEN``; ``--token`` shows in ``ps`` and shell history, so prefer the file or the variable.
It is one admin token; ``--auth-file`` adds scoped tokens (auth.py), re-read on SIGHUP.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn
from urllib.parse import urlsplit

from eplb import limits

from . import plugins
from .balancer import BalancerConfig
from .cluster import parse_cluster_url
from .logs import LOG_FORMATS, JsonFormatter, setup_logging
from .processes import WORKER_ENV, free_port, supervise
from .server import ServerConfig, StartError, start_server

__all__ = ["main", "parse_args"]


class _Parser(argparse.ArgumentParser):
    """Errors as one line on stderr, exit 2: the message names the flag and what it takes."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _int_in(lo: int, hi: int, allowed: str) -> Callable[[str], int]:
    def convert(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {text!r}")
        return value

    return convert


def _seconds(zero_ok: bool) -> Callable[[str], float]:
    allowed = "a number of seconds >= 0" if zero_ok else "a number of seconds > 0"

    def convert(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < 0 or (value == 0 and not zero_ok):
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {text!r}")
        return value

    return convert


def _one_of(names: tuple[str, ...], normalise: Callable[[str], str] = str) -> Callable[[str], str]:
    def convert(text: str) -> str:
        if normalise(text) not in names:
            raise argparse.ArgumentTypeError(f"must be one of {', '.join(names)}, got {text!r}")
        return normalise(text)

    return convert


def _redis_url(text: str) -> str:
    try:
        if parse_cluster_url(text) is not None:
            return text
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if urlsplit(text).scheme not in ("redis", "rediss", "unix"):
        raise argparse.ArgumentTypeError(
            f"must be a redis://, rediss://, unix://, redis+cluster:// or rediss+cluster:// URL, got {text!r}"
        )
    return text


_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
# grpc.max_*_message_length is a C int; below a few KiB not even health checks fit.
_MESSAGE_BYTES = (4096, 2**31 - 1)

# dest: (flag, EPLB_ variable, default as text or None for unset, converter, help).
_OPTIONS: dict[str, tuple[str, str, str | None, Callable[[str], object], str]] = {
    "host": ("--host", "HOST", "127.0.0.1", str, "bind address; 0.0.0.0 or :: to serve other hosts"),
    "port": (
        "--port",
        "PORT",
        "50051",
        _int_in(0, 65535, "a port 0-65535 (0 picks a free one)"),
        "gRPC port 0-65535, 0 picks one",
    ),
    "redis_url": (
        "--redis-url",
        "REDIS_URL",
        None,
        _redis_url,
        "redis://… for state shared by instances, redis+cluster://HOST:PORT[,HOST:PORT…] for a Redis "
        "Cluster's seed nodes; unset: embedded in-memory store",
    ),
    "key_prefix": ("--key-prefix", "KEY_PREFIX", "eplb", str, "Redis key prefix"),
    "token_file": (
        "--token-file",
        "TOKEN_FILE",
        None,
        Path,
        "read the token from this file (surrounding whitespace stripped)",
    ),
    "auth_file": (
        "--auth-file",
        "AUTH_FILE",
        None,
        Path,
        'JSON {"tokens": [{"sha256", "role", "deployments"}]}: scoped tokens (docs/service.md); re-read on SIGHUP',
    ),
    "tls_cert": ("--tls-cert", "TLS_CERT", None, Path, "PEM certificate chain"),
    "tls_key": ("--tls-key", "TLS_KEY", None, Path, "PEM private key"),
    "max_message_bytes": (
        "--max-message-bytes",
        "MAX_MESSAGE_BYTES",
        str(16 << 20),
        _int_in(*_MESSAGE_BYTES, f"a number of bytes {_MESSAGE_BYTES[0]}-{_MESSAGE_BYTES[1]}"),
        "largest gRPC message either way, 4096-2147483647 bytes (16777216 = 16 MiB)",
    ),
    "metrics_port": (
        "--metrics-port",
        "METRICS_PORT",
        "-1",
        _int_in(-1, 65535, "-1 (off) or a port 0-65535"),
        "Prometheus /metrics port 0-65535, -1 off",
    ),
    "lease_seconds": (
        "--lease-seconds",
        "LEASE_SECONDS",
        "10",
        _seconds(zero_ok=False),
        "planning lease (> 0); a crashed planner is replaced within it",
    ),
    "flush_seconds": (
        "--flush-seconds",
        "FLUSH_SECONDS",
        "1",
        _seconds(zero_ok=False),
        "how often windows are flushed to the store (> 0)",
    ),
    "report_linger_seconds": (
        "--report-linger-seconds",
        "REPORT_LINGER_SECONDS",
        "0.005",
        _seconds(zero_ok=True),
        "group commit: report batches (one pipeline for all deployments on a store shard) go to the "
        "store at least this far apart while reports keep coming (>= 0; 0: each batch as soon as "
        "the last one is stored)",
    ),
    "grace_seconds": (
        "--grace-seconds",
        "GRACE_SECONDS",
        "5",
        _seconds(zero_ok=True),
        "graceful shutdown time on SIGTERM (>= 0)",
    ),
    "plan_workers": (
        "--plan-workers",
        "PLAN_WORKERS",
        str(limits.REPLAN_WORKERS),
        _int_in(1, 256, "a number of processes 1-256"),
        "processes for the re-plans of deployments, one re-plan each (1-256)",
    ),
    "small_plan_workers": (
        "--small-plan-workers",
        "SMALL_PLAN_WORKERS",
        str(limits.SMALL_PLAN_WORKERS),
        _int_in(0, 256, "a number of processes 0-256"),
        f"processes only re-plans below {limits.SMALL_PLAN_CELLS} layers x slots take, so they never wait "
        "behind large ones (0-256, 0 off)",
    ),
    "layer_workers": (
        "--layer-workers",
        "LAYER_WORKERS",
        "1",
        _int_in(1, 256, "a number of processes 1-256"),
        "processes one re-plan plans its layers in (1-256); same plan for any number",
    ),
    "compute_workers": (
        "--compute-workers",
        "COMPUTE_WORKERS",
        str(limits.COMPUTE_WORKERS),
        _int_in(1, 256, "a number of processes 1-256"),
        "processes for stateless ComputePlacement calls and dry runs (1-256)",
    ),
    "plugins": (
        "--plugins",
        "PLUGINS",
        None,
        str,
        "modules to import first, comma separated: the policies they register can be named",
    ),
    "processes": (
        "--processes",
        "PROCESSES",
        "1",
        _int_in(1, 256, "a number of processes 1-256"),
        "serving processes sharing the port (SO_REUSEPORT; Linux), each an instance of its own that "
        "shares state through Redis as instances do; above 1 needs --redis-url; /metrics on "
        "--metrics-port + the process's index (1-256)",
    ),
    "log_level": ("--log-level", "LOG_LEVEL", "INFO", _one_of(_LOG_LEVELS, str.upper), "/".join(_LOG_LEVELS)),
    "log_format": (
        "--log-format",
        "LOG_FORMAT",
        "plain",
        _one_of(LOG_FORMATS),
        "plain text, or one JSON object per line",
    ),
}


def _read_token(path: Path) -> str:
    try:
        token = path.read_text().strip()
    except OSError as exc:
        raise ValueError(f"--token-file {path}: cannot read it ({exc.strerror})") from None
    if not token or any(c.isspace() for c in token):
        raise ValueError(f"--token-file {path}: must hold one token (non-empty, no whitespace inside)")
    return token


def parse_args(argv: list[str]) -> tuple[ServerConfig, str, str]:
    """``argv`` → the server's config, the log level and the log format.

    A flag wins over its ``EPLB_*`` variable; a variable set to nothing (or only whitespace) is
    unset, as in a compose file's ``EPLB_PORT=``; a bad value of either exits 2 with one line
    naming it.
    """
    ap = _Parser(prog="eplb serve", description="Run the eplb balancer service (gRPC, package eplb.v1).")
    for dest, (flag, env, default, convert, help_) in _OPTIONS.items():
        ap.add_argument(flag, dest=dest, type=convert, default=None, help=f"{help_} [EPLB_{env}, {default or 'unset'}]")
        if dest == "key_prefix":
            ap.add_argument(
                "--token",
                default=None,
                help="require 'authorization: Bearer <token>'; visible in ps, prefer --token-file [EPLB_TOKEN]",
            )
    ap.add_argument(
        "--reads-only",
        action="store_true",
        default=None,
        help="serve reads only: refuse reports (UNAVAILABLE, so clients report to their next address) and "
        "plan nothing on a timer (calls such as create, delete, rebalance and acks are still served); engines "
        "send GetPlacement and WatchPlacements here (reads=, EPLB_READ_ADDRESSES) so that reads never wait "
        "behind reports; needs --redis-url [EPLB_READS_ONLY, unset]",
    )
    args = ap.parse_args(argv)
    if args.reads_only is None:
        raw = os.environ.get("EPLB_READS_ONLY", "").strip().lower()
        if raw not in ("", "0", "1", "false", "true", "no", "yes"):
            ap.error(f"EPLB_READS_ONLY: must be 1/true/yes or 0/false/no (or unset), got {raw!r}")
        args.reads_only = raw in ("1", "true", "yes")
    # Defaults and variables are converted only now, so a bad variable is reported like a bad flag.
    for dest, (_, env, default, convert, _) in _OPTIONS.items():
        if getattr(args, dest) is not None:
            continue
        raw = os.environ.get(f"EPLB_{env}")
        # Empty means unset, for every variable alike (EPLB_PLUGINS= and EPLB_TOKEN= already did).
        if raw is None or not raw.strip():
            raw = default
        try:
            setattr(args, dest, None if raw is None else convert(raw))
        except argparse.ArgumentTypeError as exc:
            ap.error(f"EPLB_{env}: {exc}")
    if bool(args.tls_cert) != bool(args.tls_key):
        ap.error("--tls-cert and --tls-key go together")
    if args.token is not None and args.token_file is not None:
        ap.error("give --token or --token-file, not both")
    token = args.token or os.environ.get("EPLB_TOKEN") or None
    if args.token_file is not None:
        try:
            token = _read_token(args.token_file)
        except ValueError as exc:
            ap.error(str(exc))
    if args.processes > 1 and args.metrics_port > 0 and args.metrics_port + args.processes - 1 > 65535:
        ap.error(
            f"--metrics-port {args.metrics_port} with --processes {args.processes}: process i serves /metrics on "
            f"the port + i, so the port must be at most {65536 - args.processes} (or 0: each picks one)"
        )
    if args.reads_only and not args.redis_url:
        ap.error(
            "--reads-only needs --redis-url: a reads-only instance serves what the instances that take "
            "reports store, and the in-memory store is one process's"
        )
    if args.processes > 1 and not args.redis_url:
        ap.error(
            "--processes above 1 needs --redis-url: the processes share state through Redis, and the "
            "in-memory store is one process's"
        )
    modules = plugins.parse(args.plugins)
    try:
        plugins.load(modules)
    except ValueError as exc:
        ap.error(f"--plugins (EPLB_PLUGINS): {exc}")
    config = ServerConfig(
        host=args.host,
        port=args.port,
        redis_url=args.redis_url,
        key_prefix=args.key_prefix,
        token=token,
        auth_file=args.auth_file,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        max_message_bytes=args.max_message_bytes,
        metrics_port=None if args.metrics_port < 0 else args.metrics_port,
        grace_s=args.grace_seconds,
        processes=args.processes,
        reuse_port=os.environ.get(WORKER_ENV) is not None,
        balancer=BalancerConfig(
            lease_s=args.lease_seconds,
            flush_s=args.flush_seconds,
            report_linger_s=args.report_linger_seconds,
            plan_workers=args.plan_workers,
            small_plan_workers=args.small_plan_workers,
            compute_workers=args.compute_workers,
            layer_workers=args.layer_workers,
            plugins=modules,
            reads_only=args.reads_only,
        ),
    )
    return config, args.log_level, args.log_format


def _listening_line(fmt: str, host: str, port: int) -> str:
    """The stdout line that says the server is up (scripts read the port from it), in ``fmt``."""
    if ":" in host:  # IPv6: brackets, as in a URL, so the port is not read as part of it
        host = f"[{host}]"
    if fmt == "plain":
        return f"eplb serve: listening on {host}:{port}"
    record = logging.getLogger(__name__).makeRecord(
        __name__,
        logging.INFO,
        __file__,
        0,
        "listening on %s:%d",
        (host, port),
        None,
        extra={"host": host, "port": port},
    )
    return JsonFormatter().format(record)


async def _serve(config: ServerConfig, fmt: str) -> None:
    running = await start_server(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if config.auth_file is not None:
        # Without an auth file SIGHUP keeps its default (the process ends), as before.
        loop.add_signal_handler(signal.SIGHUP, running.reload_auth)
    print(_listening_line(fmt, config.host, running.port), flush=True)
    await stop.wait()
    logging.getLogger(__name__).info("shutting down (grace %.1fs)", config.grace_s)
    await running.stop()


def main(argv: list[str]) -> int:
    config, level, fmt = parse_args(argv)
    setup_logging(level, fmt)
    if config.processes > 1:
        return _supervise(config, argv, fmt)
    try:
        asyncio.run(_serve(config, fmt))
    except StartError as exc:
        print(f"eplb serve: error: {_source(exc.field, argv)}: {exc}", file=sys.stderr)
        return 2
    return 0


def _supervise(config: ServerConfig, argv: list[str], fmt: str) -> int:
    """``--processes`` N > 1: this process supervises N serving processes (:mod:`.processes`)."""
    from .server import _probe

    host = config.host.strip("[]")
    try:
        if config.port == 0:
            port = free_port(host)
        else:
            _probe(host, config.port)
            port = config.port
    except StartError as exc:
        print(f"eplb serve: error: {_source(exc.field, argv)}: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # binding port 0 on the host: the host is at fault
        print(
            f"eplb serve: error: {_source('host', argv)}: cannot listen on {config.host} ({exc.strerror or exc})",
            file=sys.stderr,
        )
        return 2
    return supervise(
        config.processes,
        port,
        argv,
        config.metrics_port,
        lambda p: _listening_line(fmt, config.host, p),
        reload_on_hup=config.auth_file is not None,
    )


def _source(field: str, argv: list[str]) -> str:
    """Where the value of ServerConfig ``field`` came from: its flag, or its ``EPLB_*`` variable
    when the flag was not given (a bad EPLB_HOST used to be reported as --host)."""
    flag = f"--{field.replace('_', '-')}"
    env = next((f"EPLB_{e}" for d, (fl, e, *_) in _OPTIONS.items() if fl == flag), None)
    given = any(a == flag or a.startswith(flag + "=") for a in argv)
    return env if env and not given and os.environ.get(env, "").strip() else flag
