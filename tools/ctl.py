"""``eplb ctl``: a running balancer service's deployments, from creating one to deleting it, and
what the service is doing with them, for operators (no grpcurl, no Python needed).

    eplb ctl [--address HOST:PORT[,HOST:PORT...]] [--token-file F] [--tls-ca PEM] [--timeout S] COMMAND

``create [NAME] [-f SPEC] [flags]`` (a deployment from flags and/or a TOML or JSON spec file
whose fields are the wire's ``Deployment``), ``delete NAME [--yes]``, ``list`` (every
deployment: version, ranks acked, last plan), ``show NAME`` (topology, options,
rollout per rank, the current version's plan stats), ``placement NAME`` (a version in a
placement format, or ``--plot FILE``: the heatmap of ``eplb place --plot`` under the
deployment's load window), ``rebalance NAME [--dry-run] [--force]``, ``watch NAME`` (a line per
version until Ctrl-C) and ``health``.

``list``, ``show``, ``placement`` and ``watch`` take ``-o json``: the wire's messages in
protobuf's JSON mapping, for scripts (docs/tools.md, "-o json"). ``--address`` defaults to
``EPLB_ADDRESS``, else ``127.0.0.1:50051`` (where ``eplb serve`` listens); nothing listening
there fails at once.

The token, as for the service's other clients: ``--token-file F``, else ``EPLB_TOKEN_FILE``,
else ``EPLB_TOKEN``. Errors are one line ``eplb ctl: error: ...``, exit 2 (as ``eplb place``);
``health`` exits 1 when no address answers SERVING; Ctrl-C exits 130.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import socket
import sys
import time
import tomllib
from collections.abc import Callable
from pathlib import Path

import numpy as np

from . import extras
from . import io as eio
from .args import OneLineParser
from .pipes import INTERRUPTED_STATUS, quiet_on_broken_pipe

__all__ = ["build_parser", "main"]

PROG = "eplb ctl"
# Where `eplb serve` listens by default, so the two work together with no flags.
DEFAULT_ADDRESS = "127.0.0.1:50051"


class CtlError(Exception):
    """One line for the user; ``code`` is the exit status."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


def _read_token(path: str, flag: str) -> str:
    try:
        token = Path(path).read_text().strip()
    except OSError as exc:
        raise CtlError(f"{flag} {path}: cannot read it ({exc.strerror})") from None
    if not token or any(c.isspace() for c in token):
        raise CtlError(f"{flag} {path}: must hold one token (non-empty, no whitespace inside)")
    return token


def _token(args: argparse.Namespace) -> str | None:
    """``--token-file``, else ``EPLB_TOKEN_FILE``, else ``EPLB_TOKEN`` (empty: unset)."""
    if args.token_file:
        return _read_token(args.token_file, "--token-file")
    if os.environ.get("EPLB_TOKEN_FILE", "").strip():
        return _read_token(os.environ["EPLB_TOKEN_FILE"].strip(), "EPLB_TOKEN_FILE")
    return os.environ.get("EPLB_TOKEN", "").strip() or None


def _root_certificates(args: argparse.Namespace) -> bytes | None:
    if not args.tls_ca:
        return None
    try:
        return Path(args.tls_ca).read_bytes()
    except OSError as exc:
        raise CtlError(f"--tls-ca {args.tls_ca}: cannot read it ({exc.strerror})") from None


# Reaching the service

# gRPC goes through a proxy these name; a direct connection then says nothing about the service.
_PROXY_VARIABLES = ("grpc_proxy", "https_proxy", "http_proxy")


def _connect_error(address: str, timeout_s: float) -> str | None:
    """Why nothing answers a TCP connection to ``address`` (``"connection refused"``, an unknown
    host), or None when something does or the answer is not known within ``timeout_s`` (a host
    that drops packets: the call's own deadline then says so)."""
    host, _, port = address.strip().rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return None
    except TimeoutError:
        return None
    except socket.gaierror as exc:
        return f"unknown host ({exc.strerror})"
    except OSError as exc:
        return (exc.strerror or str(exc)).lower()


def check_reachable(addresses: str, timeout_s: float) -> None:
    """``CtlError`` at once when no address of ``addresses`` (comma-separated) takes a TCP
    connection: the client's retries would otherwise wait out the whole ``--timeout`` on a
    refused connection. One address that answers is enough (the client fails over to it)."""
    if any(os.environ.get(name) or os.environ.get(name.upper()) for name in _PROXY_VARIABLES):
        return
    errors = []
    for address in addresses.split(","):
        error = _connect_error(address, min(timeout_s, 2.0))
        if error is None:
            return
        errors.append(f"{address.strip()}: {error}")
    raise CtlError(
        f"nothing answers at {'; '.join(errors)}; is eplb serve running there? "
        "(--address HOST:PORT or EPLB_ADDRESS names another)"
    )


# Time


def _utc(seconds: float) -> str:
    return dt.datetime.fromtimestamp(seconds, dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _ago(seconds: float, now: float | None = None) -> str:
    age = max(0.0, (time.time() if now is None else now) - seconds)
    if age < 120:
        return f"{age:.0f} s ago"
    if age < 7200:
        return f"{age / 60:.0f} min ago"
    if age < 172800:
        return f"{age / 3600:.1f} h ago"
    return f"{age / 86400:.1f} days ago"


def _stamp(ts: object, never: str = "never") -> str:
    """A ``google.protobuf.Timestamp`` as ``2026-12-02 15:20:01 UTC (12 s ago)``; unset: ``never``."""
    if not ts.seconds and not ts.nanos:
        return never
    seconds = ts.ToNanoseconds() / 1e9
    return f"{_utc(seconds)} ({_ago(seconds)})"


def _duration(d: object) -> str:
    return f"{d.ToNanoseconds() / 1e9:g} s"


# What a deployment's options say, in words


def _window(d: object) -> str:
    w = d.window
    kind = w.WhichOneof("kind")
    if kind == "decay":
        return f"decay, half-life {_duration(w.decay.half_life)}"
    if kind == "sliding":
        s = w.sliding
        parts = []
        if s.HasField("duration") and s.duration.ToNanoseconds():
            parts.append(f"last {_duration(s.duration)}")
        if s.report_count:
            parts.append(f"last {s.report_count} reports")
        return "sliding, " + (" and ".join(parts) or "unbounded") + f", {s.buckets or 10} buckets"
    return "the service's default"


def _trigger(d: object) -> str:
    t = d.trigger
    parts = []
    if t.HasField("interval") and t.interval.ToNanoseconds():
        parts.append(f"every {_duration(t.interval)}")
    if t.report_count:
        parts.append(f"after {t.report_count} reports")
    if not parts:
        return "off (plans only on Rebalance)"
    return " or ".join(parts) + f", publish at >= {t.min_gain_percent:g} % gain"


def _migration(d: object) -> str:
    m = d.migration
    parts = [
        f"{name.replace('_', ' ')} {getattr(m, name):g}"
        for name in ("tolerance", "layer_tolerance", "max_moves", "max_layer_moves")
        if m.HasField(name)
    ]
    return ", ".join(parts) or "defaults"


def _planning(d: object) -> str:
    p = d.planning
    parts = [f"effort {p.effort or 'default'}"]
    if p.HasField("work_budget"):
        parts.append(f"work budget {p.work_budget}")
    if p.HasField("time_limit") and p.time_limit.ToNanoseconds():
        parts.append(f"time limit {_duration(p.time_limit)}")
    if p.kernel_model:
        sizes = ",".join(map(str, p.tokens_per_gpu)) or "from the reports"
        top_k = p.top_k if p.HasField("top_k") else 8
        parts.append(
            f"for time: {p.kernel_model}, {sizes} tokens per gpu, top-{top_k}, {p.dispatch or 'even'} dispatch"
        )
    return ", ".join(parts)


def _count_of(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _topology(t: object) -> str:
    return (
        f"{_count_of(t.num_layers, 'layer')}, {_count_of(t.num_experts, 'expert')}, "
        f"{_count_of(t.num_slots, 'slot')} on {_count_of(t.num_gpus, 'gpu')}, "
        f"{_count_of(t.num_nodes or 1, 'node')}, {_count_of(t.num_groups or 1, 'group')}"
    )


def _bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def _stats_line(s: object) -> str:
    """A version's plan stats on one line: imbalance before -> after, moves, bytes, stall."""
    if s.policy == "initial":
        return "the initial placement (no plan yet)"
    line = (
        f"imbalance {s.imbalance_before:.4f} -> {s.imbalance_after:.4f} (lower bound {s.imbalance_lb:.4f}, "
        f"worst layer {s.max_imbalance_after:.4f}), gain {s.gain_percent:.1f} %, {s.moves} slots moved"
    )
    if s.HasField("transfer"):
        line += f", {_bytes(s.transfer.bytes)} copied, predicted stall {s.transfer.predicted_seconds:.3f} s"
    if s.predicted_ms:
        line += ", predicted MoE " + ", ".join(f"{s.predicted_ms[b]:.3f} ms at {b}" for b in sorted(s.predicted_ms))
    return line + f", policy {s.policy} -> {s.policy_used}"


def _ranks(status: object) -> str:
    text = f"{status.ranks_acked}/{status.num_ranks}"
    if status.ranks_failed:
        text += f" ({status.ranks_failed} failed)"
    elif status.ranks_prepared > status.ranks_acked:
        text += f" ({status.ranks_prepared} prepared)"
    return text


def _ranges(values: list[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` → ``0-2, 5, 7-8``."""
    out, start = [], None
    for i, v in enumerate(values):
        if start is None:
            start = v
        if i + 1 == len(values) or values[i + 1] != v + 1:
            out.append(str(start) if start == v else f"{start}-{v}")
            start = None
    return ", ".join(out)


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


# A deployment to create: a spec file (the wire's Deployment) and the flags over it

# flag dest -> (the Deployment field it sets, as a path of names). The rest of a deployment
# (ranks, planning for time, liveness, ...) is for the spec file.
_CREATE_FLAGS: dict[str, tuple[str, ...]] = {
    "layers": ("topology", "num_layers"),
    "experts": ("topology", "num_experts"),
    "slots": ("topology", "num_slots"),
    "gpus": ("topology", "num_gpus"),
    "nodes": ("topology", "num_nodes"),
    "groups": ("topology", "num_groups"),
    "policy": ("policy",),
    "report_count": ("trigger", "report_count"),
    "min_gain": ("trigger", "min_gain_percent"),
    "max_moves": ("migration", "max_moves"),
    "expert_bytes": ("expert_bytes",),
    "effort": ("planning", "effort"),
}
# Flags of seconds -> the Duration field they set.
_CREATE_SECONDS: dict[str, tuple[str, ...]] = {
    "window": ("window", "sliding", "duration"),
    "half_life": ("window", "decay", "half_life"),
    "interval": ("trigger", "interval"),
}


def read_spec(path: str) -> dict:
    """The spec file at ``path`` as a dict: TOML (``.toml``) or JSON (``.json``)."""
    suffix = Path(path).suffix.lower()
    if suffix not in (".toml", ".json"):
        raise CtlError(f"--file {path}: a spec is .toml or .json, not {suffix or 'a file without a suffix'!r}")
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise CtlError(f"--file {path}: cannot read it ({exc.strerror})") from None
    try:
        doc = tomllib.loads(text) if suffix == ".toml" else json.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
        raise CtlError(f"--file {path}: not valid {suffix[1:].upper()}: {exc}") from None
    if not isinstance(doc, dict):
        raise CtlError(f"--file {path}: must hold one table (the Deployment's fields), not a {type(doc).__name__}")
    return doc


def deployment_spec(args: argparse.Namespace, pb: object) -> object:
    """The ``Deployment`` message ``create`` sends: the spec file (``--file``) parsed by
    protobuf's JSON mapping (the codec of grpcurl and of ``show -o json``: proto field names,
    durations as ``"30s"``), then NAME and each flag given over it. The service checks it."""
    from google.protobuf import json_format

    msg = pb.Deployment()
    if args.file:
        try:
            json_format.ParseDict(read_spec(args.file), msg)
        except json_format.ParseError as exc:
            raise CtlError(f"--file {args.file}: {' '.join(str(exc).split()).rstrip('.')}") from None
    if args.name:
        msg.name = args.name
    for dest, path in _CREATE_FLAGS.items():
        value = getattr(args, dest)
        if value is not None:
            *parents, field = path
            target = msg
            for parent in parents:
                target = getattr(target, parent)
            setattr(target, field, value)
    for dest, path in _CREATE_SECONDS.items():
        value = getattr(args, dest)
        if value is not None:
            if path[0] == "window":
                msg.ClearField("window")  # a flag's window replaces the spec's, sliding or decay
            target = msg
            for part in path:
                target = getattr(target, part)
            target.FromNanoseconds(round(value * 1e9))
    if not msg.name:
        raise CtlError("name the deployment: eplb ctl create NAME ... (or name = ... in the spec file)")
    if not msg.HasField("topology"):
        raise CtlError(
            "give the topology: --layers L --experts E --slots P --gpus G [--nodes N --groups K] "
            "(or a [topology] table in the spec file)"
        )
    return msg


# -o json: the wire's messages in protobuf's JSON mapping


def as_json(msg: object) -> dict:
    """``msg`` as ``-o json`` prints it: protobuf's JSON mapping with the proto's field names,
    every field present (0, "" and [] included, so a script need not guess a default), 64-bit
    integers as numbers, timestamps RFC 3339, durations ``"30s"``."""
    from google.protobuf import json_format

    return json_format.MessageToDict(
        msg,
        preserving_proto_field_name=True,
        always_print_fields_with_no_presence=True,
        unquote_int64_if_possible=True,
    )


def _print_json(doc: dict) -> None:
    print(json.dumps(doc, sort_keys=True))


def _count(value: str) -> int:
    """An argparse type: an integer >= 0."""
    try:
        n = int(value)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {value!r}")
    return n


def _number(value: str) -> float:
    """An argparse type: a finite number >= 0."""
    try:
        x = float(value)
    except ValueError:
        x = math.nan
    if not (math.isfinite(x) and x >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {value!r}")
    return x


# Commands


class _Ctl:
    """The calls of one ``eplb ctl`` run, on the engine side's client (failover, retries)."""

    def __init__(self, args: argparse.Namespace) -> None:
        from eplb_engine.client import ServiceClient
        from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb

        self.pb = pb
        self.args = args
        self.client = ServiceClient(
            args.address, token=_token(args), root_certificates=_root_certificates(args), timeout_s=args.timeout
        )

    def call(self, method: str, request: object, timeout_s: float | None = None) -> object:
        import grpc

        try:
            return self.client.call(method, request, timeout_s)
        except grpc.RpcError as exc:
            raise CtlError(self.explain(exc)) from None

    def explain(self, exc: object) -> str:
        import grpc

        code, details = exc.code(), " ".join((exc.details() or "").split())
        where = self.client.endpoints.address
        if code == grpc.StatusCode.UNAVAILABLE:
            return f"cannot reach the service at {self.args.address} within {self.args.timeout:g} s ({details})"
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return f"{where} did not answer within {self.args.timeout:g} s (--timeout S waits longer)"
        if code == grpc.StatusCode.UNAUTHENTICATED:
            return f"{where} refused the call: {details}; give the service's token with --token-file F or EPLB_TOKEN"
        if code == grpc.StatusCode.ALREADY_EXISTS and self.args.ctl_command == "create":
            return f"{details} (ALREADY_EXISTS; eplb ctl delete NAME removes it first)"
        if code == grpc.StatusCode.NOT_FOUND and details.endswith("not found"):
            return f"{details} (NOT_FOUND; eplb ctl list shows the deployments)"
        return f"{details} ({code.name})"

    def close(self) -> None:
        self.client.close()

    # create, delete

    def create(self, d: object) -> int:
        r = self.call("CreateDeployment", self.pb.CreateDeploymentRequest(deployment=d))
        d = r.deployment
        print(f"created deployment {d.name}, version {r.placement.version}: {_topology(d.topology)}")
        print(f"policy {d.policy or 'auto'}; window {_window(d)}; trigger {_trigger(d)}")
        return 0

    def delete(self, name: str, yes: bool) -> int:
        d = self.call("GetDeployment", self.pb.GetDeploymentRequest(name=name)).deployment
        question = (
            f"delete deployment {name!r} (version {d.version}, {d.topology.num_gpus} gpus) and all its state: "
            "placements, load window, acks?"
        )
        if not yes and not _confirm(question):
            print(f"{PROG} delete: {name!r} not deleted", file=sys.stderr)
            return 1
        self.call("DeleteDeployment", self.pb.DeleteDeploymentRequest(name=name))
        print(f"deleted deployment {name}")
        return 0

    # list

    def list(self, output: str = "text") -> int:
        r = self.call("ListDeployments", self.pb.ListDeploymentsRequest())
        if output == "json":
            # Each deployment beside its status (the wire sends two lists in the same order).
            statuses = list(r.statuses) or [self.pb.DeploymentStatus()] * len(r.deployments)
            pairs = [{"deployment": as_json(d), "status": as_json(st)} for d, st in zip(r.deployments, statuses)]
            _print_json({"deployments": pairs})
            return 0
        if not r.deployments:
            print("no deployments")
            return 0
        statuses = list(r.statuses) or [self.pb.DeploymentStatus()] * len(r.deployments)
        rows = [["NAME", "VERSION", "RANKS ACKED", "PUBLISHED", "LAST PLAN", "POLICY", "TOPOLOGY (L x E, P on G)"]]
        for d, s in zip(r.deployments, statuses):
            t = d.topology
            rows.append(
                [
                    d.name,
                    str(d.version),
                    _ranks(s) if s.num_ranks else "?",
                    _stamp(s.version_time, "?"),
                    _stamp(s.last_plan_time),
                    d.policy or "auto",
                    f"{t.num_layers} x {t.num_experts}, {t.num_slots} on {t.num_gpus}",
                ]
            )
        print(_table(rows))
        return 0

    # show

    def show(self, name: str, ranks_table: bool = False, output: str = "text") -> int:
        r = self.call("GetDeployment", self.pb.GetDeploymentRequest(name=name))
        if output == "json":
            _print_json(as_json(r))  # GetDeploymentResponse: deployment, acks, down_ranks, status
            return 0
        d, s = r.deployment, r.status
        say = print
        say(f"deployment {d.name}, created {_stamp(d.create_time)}")
        say(f"topology:   {_topology(d.topology)}")
        say(f"policy:     {d.policy or 'auto'}")
        say(f"window:     {_window(d)}")
        say(f"trigger:    {_trigger(d)}")
        say(f"migration:  {_migration(d)}")
        say(f"planning:   {_planning(d)}")
        say(f"expert:     {_bytes(d.expert_bytes) if d.expert_bytes else 'size unknown (no transfer figures)'}")
        margin = d.switch_margin_steps if d.HasField("switch_margin_steps") else 8
        say(f"switch:     {margin} steps after the last rank prepared")
        say(f"version:    {d.version}, published {_stamp(s.version_time, '?')}")
        say(f"last plan:  {_stamp(s.last_plan_time)}")
        say(f"stats:      {_stats_line(s.stats)}")
        for note in s.stats.notes:
            say(f"  note: {note}")
        say(
            f"rollout of version {d.version}: {s.ranks_acked} of {s.num_ranks} ranks switched, "
            f"{s.ranks_prepared} prepared, {s.ranks_failed} failed"
        )
        if r.down_ranks:
            say(f"down:       ranks {_ranges(list(r.down_ranks))} (SetRanksDown; not in the rollout)")
        for suspect in s.suspect_ranks:
            silent = f"silent {suspect.seconds_since_seen:.0f} s" if suspect.ever_seen else "never heard from"
            say(f"suspect:    rank {suspect.rank}, {silent} (no report or ack; still planned for)")
        acks = {a.rank: a for a in r.acks}
        down = set(r.down_ranks)
        ranks = list(d.ranks) or list(range(d.topology.num_gpus))
        rows = [["RANK", "SWITCHED", "PREPARED", "FAILED", "STATE"]]
        by_state: dict[str, list[int]] = {}
        for rank in ranks:
            a = acks.get(rank)
            if rank in down:
                state = "down"
                rows.append([str(rank), "-", "-", "-", state])
            elif a is None:
                state = "never acked"
                rows.append([str(rank), "-", "-", "-", state])
            else:
                if a.version >= d.version:
                    state = "switched"
                elif a.failed_version == d.version:
                    state = "failed (keeps its previous map)"
                elif a.prepared_version >= d.version:
                    state = "prepared"
                else:
                    state = f"behind (on version {a.version})" if a.version else "behind"
                rows.append(
                    [
                        str(rank),
                        str(a.version or "-"),
                        str(a.prepared_version or "-"),
                        str(a.failed_version or "-"),
                        state,
                    ]
                )
            by_state.setdefault(state, []).append(rank)
        if ranks_table:
            say(_table(rows))
        else:
            # One line per state, ranks as ranges: readable for 128 ranks (--ranks: the table).
            for state, members in by_state.items():
                say(f"  {state} ({len(members)}): {_ranges(members)}")
        return 0

    # placement

    def _topology_of(self, name: str) -> object:
        import eplb_engine.wire as wire

        return wire.topology_from_pb(
            self.call("GetDeployment", self.pb.GetDeploymentRequest(name=name)).deployment.topology
        )

    def placement(self, args: argparse.Namespace) -> int:
        from google.protobuf import json_format

        import eplb_engine.wire as wire

        from .plots_check import plot_target

        plot = plot_target("--plot", args.plot) if args.plot else None
        if args.output == "json" and (args.format or args.out):
            flag = "--format" if args.format else "--out"
            raise CtlError(f"-o json prints the version to stdout; {flag} is for a placement format (not both)")
        out, fmt = None, args.format or "listing"
        if args.out:
            out = Path(args.out)
            if out.is_dir():
                raise CtlError(f"--out {out}: is a directory; give a file name such as {out / 'placement.json'}")
            if not out.parent.is_dir():
                raise CtlError(f"--out {args.out}: directory {out.parent} does not exist")
            fmt = eio.placement_output_format(out, args.format)
        elif fmt == "vllm":
            raise CtlError("--format vllm writes an .npz archive, which is not for a terminal: give --out FILE.npz")
        topo = self._topology_of(args.name)
        request = self.pb.GetPlacementRequest(
            deployment=args.name, version=args.version, include_window_loads=bool(plot)
        )
        r = self.call("GetPlacement", request)
        published = wire.placement_from_pb(r.placement, topo)
        loads = wire.decode_array(r.window_loads, "window_loads") if r.HasField("window_loads") else None
        stats = json_format.MessageToDict(r.placement.stats, preserving_proto_field_name=True)
        stats |= {"deployment": args.name, "version": published.version}
        if args.output == "json":
            # The version's fields as watch -o json prints them, and its phy2log [L, P] as rows.
            _print_json(_watch_json(r.placement) | {"phy2log": published.placement.phy2log.tolist()})
        if plot is not None:
            self._plot(plot, args.name, published, loads, r.window_reports, topo)
            print(f"wrote plot of {args.name} version {published.version} to {plot}", file=sys.stderr)
            if args.format is None and out is None:
                return 0
        if args.output == "json":
            return 0
        if out is not None:
            kind = eio.write_placement(out, published.placement, fmt, stats=stats, loads=loads)
            print(f"wrote {kind} placement of {args.name} version {published.version} to {out}", file=sys.stderr)
        else:
            text = eio.placement_text(published.placement, fmt, stats, loads)
            if fmt == "listing":
                # Under the format's line, a comment saying which placement this is (listings
                # read back skip comment lines).
                head, _, rest = text.partition("\n")
                when = _utc(r.placement.create_time.ToNanoseconds() / 1e9)
                text = (
                    f"{head}\n# deployment {args.name}, placement version {published.version}, published {when}\n{rest}"
                )
            sys.stdout.write(text)
        return 0

    def _plot(
        self, path: Path, name: str, published: object, loads: np.ndarray | None, reports: int, topo: object
    ) -> None:
        import eplb_engine.wire as wire

        from . import plots

        if loads is None or not float(loads.sum()) > 0:
            raise CtlError(
                f"--plot: the load window of {name!r} is empty (no reports in it yet), so there is no load to "
                "colour the gpus by; plot once engines have reported"
            )
        previous = None
        if published.version > 1:
            try:
                msg = self.client.call(
                    "GetPlacement", self.pb.GetPlacementRequest(deployment=name, version=published.version - 1)
                )
                previous = wire.placement_from_pb(msg.placement, topo).placement
            except Exception:  # noqa: BLE001  (an older version no longer kept: the plan alone)
                previous = None
        plots.placement_heatmap(
            path,
            loads,
            published.placement,
            previous,
            title=f"{name}: the load window now ({reports} reports), version {published.version}"
            + (f" beside {published.version - 1}" if previous is not None else ""),
            label=f"version {published.version}",
            previous_label=f"version {published.version - 1}",
        )

    # rebalance

    def rebalance(self, args: argparse.Namespace) -> int:
        request = self.pb.RebalanceRequest(deployment=args.name, dry_run=args.dry_run, force=args.force)
        # A plan takes longer than a read: up to a minute unless --timeout says otherwise.
        r = self.call("Rebalance", request, timeout_s=args.timeout if args.timeout_given else 60.0)
        window = f"window of {r.window_reports} reports, {r.window_tokens:.4g} tokens"
        if r.published:
            print(f"published {args.name} version {r.placement.version} ({window})")
        elif args.dry_run:
            print(f"dry run of {args.name}, nothing published ({window})")
        else:
            print(f"not published: {r.reason} ({window})")
        print(f"plan: {_stats_line(r.placement.stats)}")
        for note in r.placement.stats.notes:
            print(f"  note: {note}")
        return 0

    # watch

    def watch(self, args: argparse.Namespace) -> int:
        import grpc

        seen = 0 if args.since is None else args.since
        lines = 0
        lost = False
        while True:
            stub = self.client.endpoints.stub()
            try:
                stream = stub.WatchPlacements(
                    self.pb.WatchPlacementsRequest(deployment=args.name, since_version=seen),
                    metadata=self.client.endpoints.metadata,
                )
                for response in stream:
                    p = response.placement
                    if lost:
                        print(f"{PROG} watch: reconnected to {self.client.endpoints.address}", file=sys.stderr)
                        lost = False
                    seen = p.version
                    if args.output == "json":
                        _print_json(_watch_json(p))
                    else:
                        print(
                            f"{_utc(p.create_time.ToNanoseconds() / 1e9)}  {args.name} version {p.version}: "
                            f"{_stats_line(p.stats)}"
                        )
                    sys.stdout.flush()
                    lines += 1
                    if args.count and lines >= args.count:
                        stream.cancel()
                        return 0
                raise CtlError(f"the service ended the watch of {args.name!r}")
            except grpc.RpcError as exc:
                if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL) or (
                    lines == 0 and not lost
                ):
                    # Never connected (or the request's fault): say why, as the other commands do.
                    raise CtlError(self.explain(exc)) from None
                if not lost:
                    print(
                        f"{PROG} watch: lost the service ({' '.join((exc.details() or '').split())}); reconnecting",
                        file=sys.stderr,
                    )
                    lost = True
                self.client.endpoints.failover(stub)
                time.sleep(0.5)

    # health

    def health(self) -> int:
        import eplb_engine.wire as wire

        ok = False
        for address in self.client.endpoints.addresses:
            from eplb_engine.client import Endpoints

            one = Endpoints(address, root_certificates=_root_certificates(self.args))
            try:
                serving = wire.check_health(one.channel(), timeout_s=self.args.timeout)
            finally:
                one.close()
            print(f"{address}: {'SERVING' if serving else 'NOT SERVING (or unreachable)'}")
            ok |= serving
        return 0 if ok else 1


def _watch_json(p: object) -> dict:
    """A version as ``watch -o json`` prints it: the ``Placement`` without its arrays (phy2log and
    loads, which ``placement NAME --version V -o json`` gives in full)."""
    q = type(p)()
    q.CopyFrom(p)
    q.ClearField("phy2log")
    q.ClearField("loads")
    doc = as_json(q)
    doc.pop("phy2log", None)
    doc.pop("loads", None)
    return doc


def _confirm(question: str) -> bool:
    """Asks ``question`` on the terminal (stderr, so stdout stays the command's); True on y or yes."""
    if not sys.stdin.isatty():
        raise CtlError("stdin is not a terminal to ask on; pass --yes to delete without asking")
    sys.stderr.write(f"{question} [y/N] ")
    sys.stderr.flush()
    return sys.stdin.readline().strip().lower() in ("y", "yes")


def _create_parser(sub: argparse._SubParsersAction) -> None:
    c = sub.add_parser(
        "create",
        help="create a deployment from flags and/or a spec file (TOML or JSON: the wire's Deployment)",
        description="Create a deployment and publish its version 1 (the contiguous placement). The spec file's "
        "fields are the wire's Deployment message (proto/eplb/v1/balancer.proto) in protobuf's JSON mapping: "
        "durations as strings such as '600s'. Flags set their field over the file's. The service checks the "
        "result and names the field it refuses.",
    )
    c.add_argument("name", nargs="?", help="the deployment's name [the spec's name]")
    c.add_argument("-f", "--file", metavar="SPEC", help="a spec file, .toml or .json (docs/tools.md, 'eplb ctl')")
    for flag, field in (("layers", "num_layers"), ("experts", "num_experts"), ("slots", "num_slots")):
        c.add_argument(f"--{flag}", type=_count, metavar="N", help=f"topology.{field}")
    c.add_argument("--gpus", type=_count, metavar="N", help="topology.num_gpus (the ranks are 0 .. N-1)")
    c.add_argument("--nodes", type=_count, metavar="N", help="topology.num_nodes [1]")
    c.add_argument("--groups", type=_count, metavar="N", help="topology.num_groups [1]")
    c.add_argument("--policy", help="a policy the service has registered [auto]")
    window = c.add_mutually_exclusive_group()
    window.add_argument("--window", type=_number, metavar="S", help="a sliding load window of S seconds [600]")
    window.add_argument("--half-life", type=_number, metavar="S", help="a decaying load window instead")
    c.add_argument("--interval", type=_number, metavar="S", help="re-plan every S seconds [0: only on rebalance]")
    c.add_argument("--report-count", type=_count, metavar="N", help="re-plan after N reports [0: off]")
    c.add_argument("--min-gain", type=_number, metavar="PCT", help="publish at >= PCT %% gain [0]")
    c.add_argument("--max-moves", type=_count, metavar="N", help="at most N slots rewritten per re-plan [no limit]")
    c.add_argument("--expert-bytes", type=_count, metavar="B", help="bytes of one expert's weights [0: unknown]")
    c.add_argument("--effort", help="planning.effort: fast, default or high [default]")
    d = sub.add_parser("delete", help="delete a deployment and all its state (asks first, unless --yes)")
    d.add_argument("name")
    d.add_argument("-y", "--yes", action="store_true", help="do not ask")


def _output(parser: argparse.ArgumentParser, json_is: str = "the wire's messages") -> None:
    parser.add_argument(
        "-o",
        "--output",
        choices=("text", "json"),
        default="text",
        help=f"text for people, or json for scripts ({json_is}; fields: docs/tools.md) [text]",
    )


def build_parser() -> argparse.ArgumentParser:
    ap = OneLineParser(
        prog=PROG,
        description="Create, inspect and delete the deployments of a running eplb service (docs/tools.md, 'eplb ctl').",
    )
    ap.add_argument(
        "--address",
        default=os.environ.get("EPLB_ADDRESS") or DEFAULT_ADDRESS,
        help="HOST:PORT of the service, or several comma-separated (replicas; failover) "
        f"[EPLB_ADDRESS, else {DEFAULT_ADDRESS}: where eplb serve listens by default]",
    )
    ap.add_argument("--token-file", help="the service's bearer token, from this file [EPLB_TOKEN_FILE, EPLB_TOKEN]")
    ap.add_argument("--tls-ca", metavar="PEM", help="root certificates to verify a TLS service by (default: plaintext)")
    ap.add_argument("--timeout", type=float, help="seconds a call may take, retries included [5; rebalance 60]")
    sub = ap.add_subparsers(dest="ctl_command", required=True, metavar="COMMAND")
    _create_parser(sub)
    _output(sub.add_parser("list", help="every deployment: version, ranks acked, last plan"))
    s = sub.add_parser("show", help="one deployment: topology, options, rollout per rank, the current plan's stats")
    s.add_argument("name")
    _output(s)
    s.add_argument("--ranks", action="store_true", help="a table row per rank (default: ranks grouped by state)")
    p = sub.add_parser("placement", help="a version's placement in a placement format, or its heatmap")
    p.add_argument("name")
    _output(p, "json: the version's fields, as watch's, and its phy2log")
    p.add_argument("--version", type=int, default=0, help="a recent version (the last 16 are kept) [current]")
    p.add_argument(
        "--format", choices=eio.PLACEMENT_FORMATS, help="placement format [listing; with --out: by its suffix]"
    )
    p.add_argument("--out", help="write it here (.json native, .npz vllm, .txt listing) instead of stdout")
    p.add_argument(
        "--plot",
        metavar="FILE",
        help="a layer x gpu heatmap of gpu load / mean under the deployment's load window, beside the previous "
        "version with moved slots marked (.png .svg .pdf; the bench extra)",
    )
    r = sub.add_parser("rebalance", help="plan now from the load window; publish unless gated")
    r.add_argument("name")
    r.add_argument("--dry-run", action="store_true", help="plan and report, publish nothing")
    r.add_argument("--force", action="store_true", help="publish even if the gain gate or the move budget refuses")
    w = sub.add_parser("watch", help="a line per placement version (the current one first) until Ctrl-C")
    w.add_argument("name")
    _output(w, "json: one object per line (JSON Lines)")
    w.add_argument("--since", type=int, help="start after this version [0: with the current one]")
    w.add_argument("--count", type=int, help="stop after this many lines")
    sub.add_parser("health", help="the gRPC health check of each address; exit 1 if none is SERVING")
    return ap


_COMMANDS: dict[str, Callable[[_Ctl, argparse.Namespace], int]] = {
    "create": lambda c, a: c.create(a.deployment),
    "delete": lambda c, a: c.delete(a.name, a.yes),
    "list": lambda c, a: c.list(a.output),
    "show": lambda c, a: c.show(a.name, a.ranks, a.output),
    "placement": lambda c, a: c.placement(a),
    "rebalance": lambda c, a: c.rebalance(a),
    "watch": lambda c, a: c.watch(a),
    "health": lambda c, a: c.health(),
}


def _check(args: argparse.Namespace) -> None:
    for address in args.address.split(","):
        host, _, port = address.strip().rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise CtlError(f"--address {args.address}: {address.strip()!r} is not HOST:PORT (port 1-65535)")
    args.timeout_given = args.timeout is not None
    if args.timeout is None:
        args.timeout = 5.0
    if not (np.isfinite(args.timeout) and args.timeout > 0):
        raise CtlError(f"--timeout must be a number of seconds > 0, got {args.timeout}")
    for flag in ("version", "since", "count"):
        value = getattr(args, flag, None)
        if value is not None and value < 0:
            raise CtlError(f"--{flag} must be >= 0, got {value}")


@quiet_on_broken_pipe
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    command = f"{PROG} {args.ctl_command}"
    ctl = None
    try:
        _check(args)
        try:
            extras.require("grpc", "google.protobuf", "grpc_health")
        except ImportError as exc:
            raise CtlError(extras.missing(PROG, "service", exc)) from None
        if args.ctl_command == "create":  # a bad spec fails before anything is asked of the service
            from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb

            args.deployment = deployment_spec(args, pb)
        if args.ctl_command != "health":  # health reports each address, reachable or not
            check_reachable(args.address, args.timeout)
        ctl = _Ctl(args)
        return _COMMANDS[args.ctl_command](ctl, args)
    except BrokenPipeError:
        raise
    except CtlError as exc:
        print(f"{command}: error: {exc}", file=sys.stderr)
        return exc.code
    except (ValueError, OSError) as exc:  # a file that cannot be written, a placement that does not fit
        print(f"{command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\n{command}: interrupted", file=sys.stderr)
        return INTERRUPTED_STATUS
    finally:
        if ctl is not None:
            ctl.close()


if __name__ == "__main__":
    sys.exit(main())
