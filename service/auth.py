"""Bearer tokens and what each may do: ``authorization: Bearer <token>`` on every call.

Two sources, either or both: ``--token`` / ``--token-file`` / ``EPLB_TOKEN`` (one token, admin),
and ``--auth-file`` (JSON, reloaded on SIGHUP), scoped tokens stored only as hashes::

    {"tokens": [{"sha256": "<hex sha256 of the token>", "role": "admin" | "engine" | "reader",
                 "deployments": ["<glob>", ...]}]}

``admin`` may do everything on every deployment (its globs are ignored); ``engine`` may call
ReportLoad, StreamLoad, AckPlacement, GetPlacement, WatchPlacements, GetDeployment and SetRanksDown on the
deployments its globs match, and the stateless ComputePlacement; ``reader`` GetDeployment, ListDeployments,
GetPlacement and WatchPlacements on its deployments, and ``/metrics``. A method not named here
(one added to the service later) is admin only.

:class:`AuthInterceptor` authenticates each call (UNAUTHENTICATED for a missing or unknown token)
and puts the caller's token hash in a context variable; handlers then call
:meth:`Access.check` for each deployment they touch (PERMISSION_DENIED naming the deployment and
the role). The grant is looked up again at every check, so a reload applies at once, also to the
next message of an open ReportLoad or StreamLoad stream; an open watch whose token a reload revokes (or whose
deployment it takes out of the token's scope) ends at once (:meth:`Access.guard`). Health and
reflection stay open: they reveal nothing a token protects.

Refused calls are written to the audit log (logger ``eplb_service.audit``) at most once per
caller (token hash prefix, and status code) per minute, with the count of the others
(:class:`RefusalLog`); never the token itself, and client strings only clipped (clip.py).
Per-deployment health (``<service>/<deployment>``) answers as for an unknown name unless the
caller's token may see that deployment (:class:`ScopedHealth`); the overall health stays open.
"""

from __future__ import annotations

import asyncio
import contextvars
import enum
import fnmatch
import hashlib
import json
import logging
import re
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2

from .clip import cap, clip
from .errors import PermissionDenied, Unauthenticated

__all__ = [
    "OPEN_METHODS_PREFIXES",
    "Access",
    "AuthFileError",
    "AuthInterceptor",
    "Grant",
    "RefusalLog",
    "ScopedHealth",
    "Role",
    "parse_auth_file",
    "token_sha256",
]

log = logging.getLogger(__name__)
audit = logging.getLogger("eplb_service.audit")

# Probes and grpcurl discovery stay open: they reveal nothing a token protects.
OPEN_METHODS_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")

_MESSAGE = "missing or wrong bearer token (metadata 'authorization: Bearer <token>')"


class Role(enum.Enum):
    ADMIN = "admin"
    ENGINE = "engine"
    READER = "reader"


# What each role but admin may call (admin: everything). Anything else is admin only.
ROLE_METHODS: Mapping[Role, frozenset[str]] = {
    Role.ENGINE: frozenset(
        {
            "ReportLoad",
            "StreamLoad",
            "AckPlacement",
            "GetPlacement",
            "WatchPlacements",
            "GetDeployment",
            "ComputePlacement",
            # The engine that detected a death says so (BalancedRank(tell_service=True)).
            "SetRanksDown",
        }
    ),
    Role.READER: frozenset({"GetDeployment", "ListDeployments", "GetPlacement", "WatchPlacements"}),
}
# The service's methods whose handlers check the call's scope (servicer.py): ComputePlacement
# (stateless) the role alone, ListDeployments by filtering, the others the deployment they name.
# Any other method (one added later) is refused to non-admins by the interceptor itself.
_SERVICE = "/eplb.v1.ExpertLoadBalancerService/"
HANDLER_CHECKED = frozenset(
    f"{_SERVICE}{m}"
    for m in (
        "CreateDeployment",
        "GetDeployment",
        "ListDeployments",
        "DeleteDeployment",
        "ReportLoad",
        "StreamLoad",
        "GetPlacement",
        "WatchPlacements",
        "AckPlacement",
        "Rebalance",
        "ComputePlacement",
        "SetRanksDown",
    )
)

# Deployment names are 1-64 of [A-Za-z0-9._-] (validation.check_name); a glob adds * ? [ ] !.
_GLOB = re.compile(r"[A-Za-z0-9._\-*?\[\]!]{1,128}")
_HEX64 = re.compile(r"[0-9a-fA-F]{64}")


def _a(word: str) -> str:
    return f"{'an' if word[0] in 'aeiou' else 'a'} {word}"


def token_sha256(token: str | bytes) -> str:
    """The hex SHA-256 of ``token`` (what the auth file stores): ``printf %s TOKEN | sha256sum``."""
    return hashlib.sha256(token.encode() if isinstance(token, str) else token).hexdigest()


@dataclass(frozen=True)
class Grant:
    """One token's rights: ``role`` on the deployments ``globs`` match (``fnmatch``, case-sensitive;
    ignored for admin). ``source`` says where it was given (``tokens[2]`` or ``--token``)."""

    sha256: str
    role: Role
    globs: tuple[str, ...]
    source: str
    _match: re.Pattern[str] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        # One compiled pattern for all globs: a check per ReportLoad message must stay cheap.
        pattern = "|".join(fnmatch.translate(g) for g in self.globs) if self.globs else r"(?!)"
        object.__setattr__(self, "_match", re.compile(pattern))

    @property
    def label(self) -> str:
        """The hash prefix that names the token in logs."""
        return self.sha256[:8]

    def may_call(self, method: str) -> bool:
        return self.role is Role.ADMIN or method in ROLE_METHODS[self.role]

    def sees(self, deployment: str) -> bool:
        return self.role is Role.ADMIN or self._match.fullmatch(deployment) is not None

    def refusal(self, method: str, deployment: str | None) -> str | None:
        """Why this token may not call ``method`` (on ``deployment``), or None when it may."""
        if not self.may_call(method):
            roles = [r.value for r in Role if r is Role.ADMIN or method in ROLE_METHODS[r]]
            allowed = "admin only" if len(roles) == 1 else f"allowed for {', '.join(roles)} tokens"
            where = f" (deployment {clip(deployment)})" if deployment is not None else ""
            return f"{_a(self.role.value)} token may not call {method}{where}: {allowed}"
        if deployment is not None and not self.sees(deployment):
            return (
                f"deployment {clip(deployment)} is outside this {self.role.value} token's deployments "
                f"({', '.join(repr(g) for g in self.globs)})"
            )
        return None


class AuthFileError(ValueError):
    """The auth file is unreadable or malformed; the message names the file, entry and field."""


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise AuthFileError(f"the key {key!r} appears twice in one object")
        out[key] = value
    return out


def parse_auth_file(text: str, source: str) -> dict[str, Grant]:
    """The auth file's JSON ``text`` → grants by token hash; ``AuthFileError`` naming ``source``,
    the entry and the field at fault. Hashes are never echoed: a token pasted in place of its
    hash would otherwise end up in the logs."""

    def fail(where: str, why: str) -> AuthFileError:
        return AuthFileError(f"{source}: {where}: {why}")

    try:
        doc = json.loads(text, object_pairs_hook=_no_duplicate_keys)
    except AuthFileError as exc:
        raise fail("JSON", str(exc)) from None
    except json.JSONDecodeError as exc:
        raise fail("JSON", f"not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
    if not isinstance(doc, dict):
        raise fail("top level", f'must be an object {{"tokens": [...]}}, got {type(doc).__name__}')
    if set(doc) != {"tokens"}:
        extra = sorted(set(doc) - {"tokens"})
        raise fail("top level", f"unknown field {extra[0]!r} (allowed: tokens)" if extra else "missing field 'tokens'")
    entries = doc["tokens"]
    if not isinstance(entries, list):
        raise fail("tokens", f"must be a list of token entries, got {type(entries).__name__}")
    grants: dict[str, Grant] = {}
    for i, entry in enumerate(entries):
        where = f"tokens[{i}]"
        if not isinstance(entry, dict):
            raise fail(where, f"must be an object with sha256, role and deployments, got {type(entry).__name__}")
        unknown = sorted(set(entry) - {"sha256", "role", "deployments"})
        if unknown:
            raise fail(f"{where}.{unknown[0]}", "unknown field (allowed: sha256, role, deployments)")
        digest = entry.get("sha256")
        if not isinstance(digest, str) or not _HEX64.fullmatch(digest):
            got = f"{len(digest)} characters" if isinstance(digest, str) else type(digest).__name__
            raise fail(
                f"{where}.sha256",
                f"must be the 64 hex digits of the token's SHA-256 (printf %s TOKEN | sha256sum), got {got}",
            )
        digest = digest.lower()
        if digest in grants:
            raise fail(f"{where}.sha256", f"the same token as {grants[digest].source}: give each token once")
        role_name = entry.get("role")
        try:
            role = Role(role_name)
        except ValueError:
            raise fail(
                f"{where}.role", f"must be one of {', '.join(repr(r.value) for r in Role)}, got {role_name!r}"
            ) from None
        globs = entry.get("deployments", [] if role is Role.ADMIN else None)
        if not isinstance(globs, list):
            raise fail(
                f"{where}.deployments",
                f"must be a list of deployment name globs, got {'nothing' if globs is None else type(globs).__name__}",
            )
        if role is not Role.ADMIN and not globs:
            raise fail(f"{where}.deployments", f'a {role.value} token needs at least one glob (e.g. "team-a-*")')
        for j, glob in enumerate(globs):
            if not isinstance(glob, str) or not _GLOB.fullmatch(glob):
                raise fail(
                    f"{where}.deployments[{j}]",
                    f"must be a glob of 1-128 letters, digits, '-', '_', '.' and * ? [ ] !, got {glob!r}",
                )
        grants[digest] = Grant(digest, role, () if role is Role.ADMIN else tuple(globs), where)
    return grants


def load_auth_file(path: Path, admin_token: str | None = None) -> dict[str, Grant]:
    """The file at ``path`` parsed, plus ``admin_token`` (``--token``) as one admin grant."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise AuthFileError(f"{path}: cannot read it ({exc.strerror})") from None
    except UnicodeDecodeError as exc:
        raise AuthFileError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    grants = parse_auth_file(text, str(path))
    return _with_admin_token(grants, admin_token, str(path))


def _with_admin_token(grants: dict[str, Grant], admin_token: str | None, source: str) -> dict[str, Grant]:
    if admin_token is None:
        return grants
    digest = token_sha256(admin_token)
    if digest in grants:
        raise AuthFileError(
            f"{source}: {grants[digest].source}.sha256: is the --token / EPLB_TOKEN admin token: give each token once"
        )
    return {**grants, digest: Grant(digest, Role.ADMIN, (), "--token")}


def _bearer(value: object) -> bytes | None:
    """The credentials of an ``authorization`` value ``Bearer <token>`` (scheme case-insensitive, RFC
    7235; the token is not), or None."""
    raw = value.encode() if isinstance(value, str) else bytes(value or b"")
    scheme, _, credentials = raw.partition(b" ")
    return credentials if scheme.lower() == b"bearer" and credentials else None


# The caller's token hash, set by the interceptor for the call it lets through (each call runs in
# its own task, so its own copy of the context).
_caller: contextvars.ContextVar[str | None] = contextvars.ContextVar("eplb_caller", default=None)


@dataclass(eq=False)
class _Watch:
    sha256: str
    method: str
    deployment: str
    peer: str
    ended: asyncio.Future


class Access:
    """Who may do what, from ``--token`` and ``--auth-file``; reloads the file on :meth:`reload`."""

    def __init__(
        self,
        admin_token: str | None = None,
        auth_file: Path | None = None,
        refusals: RefusalLog | None = None,
    ) -> None:
        """``AuthFileError`` when ``auth_file`` is unreadable or malformed."""
        self.admin_token = admin_token
        self.auth_file = Path(auth_file) if auth_file is not None else None
        if self.auth_file is not None:
            self._grants = load_auth_file(self.auth_file, admin_token)
        else:
            self._grants = _with_admin_token({}, admin_token, "--token")
        self.refusals = refusals or RefusalLog()
        self._watches: set[_Watch] = set()
        if not self._grants:
            log.warning("%s lists no token: every call but health and reflection is refused", self.auth_file)

    @property
    def grants(self) -> Mapping[str, Grant]:
        return self._grants

    def describe(self) -> str:
        counts = {r: sum(g.role is r for g in self._grants.values()) for r in Role}
        return ", ".join(f"{n} {r.value}" for r, n in counts.items())

    # reload

    def reload(self) -> bool:
        """Re-reads the auth file (SIGHUP). A bad file keeps the tokens in force (logged as an
        ERROR); a good one applies at once: open watches of tokens that stay valid go on, those
        of revoked tokens (or of deployments out of their new scope) end now."""
        if self.auth_file is None:
            log.info("no --auth-file to reload; the --token stays")
            return False
        try:
            grants = load_auth_file(self.auth_file, self.admin_token)
        except AuthFileError as exc:
            log.error("reloading the auth file failed, the %d tokens in force stay: %s", len(self._grants), exc)
            return False
        self._grants = grants
        ended = 0
        for watch in list(self._watches):
            error = self._error(watch.sha256, watch.method, watch.deployment)
            if error is not None and not watch.ended.done():
                watch.ended.set_result(error)
                self._refused(watch.sha256, error, watch.method, watch.peer)
                ended += 1
        log.info(
            "reloaded the auth file %s: %d tokens (%s); %d open watches ended by it",
            self.auth_file,
            len(grants),
            self.describe(),
            ended,
        )
        return True

    # checks

    def authenticate(self, metadata: Iterable[tuple[str, object]] | None) -> tuple[Grant | None, str]:
        """The grant of the call's bearer token, or None; and the token's label for logs."""
        value = next((v for k, v in metadata or () if k == "authorization"), None)
        credentials = _bearer(value) if value is not None else None
        if credentials is None:
            return None, "none"
        # A dict lookup of the token's SHA-256: timing reveals nothing of a token (the attacker
        # would have to choose hash values), and only hashes are kept.
        digest = token_sha256(credentials)
        return self._grants.get(digest), digest[:8]

    def _error(self, sha256: str | None, method: str, deployment: str | None) -> Exception | None:
        if sha256 is None:  # every call the service serves passed the interceptor: a bug, refuse
            return Unauthenticated("no authenticated caller for this call")
        grant = self._grants.get(sha256)
        if grant is None:
            return Unauthenticated("this token is not (or no longer) valid: it is not in the auth file in force")
        why = grant.refusal(method, deployment)
        return PermissionDenied(why) if why is not None else None

    def check(self, context: grpc.aio.ServicerContext, method: str, deployment: str | None = None) -> None:
        """Raises PermissionDenied (or Unauthenticated, for a token a reload revoked) unless the
        call's token may call ``method`` on ``deployment``."""
        sha256 = _caller.get()
        error = self._error(sha256, method, deployment)
        if error is not None:
            self._refused(sha256, error, method, context.peer())
            raise error

    def visible(self, names: Iterable[str]) -> set[str]:
        """Those of ``names`` the call's token may see (ListDeployments)."""
        grant = self._grants.get(_caller.get() or "")
        return set() if grant is None else {n for n in names if grant.sees(n)}

    def metrics_refusal(self, authorization: str | None, peer: str) -> str | None:
        """Why an HTTP ``/metrics`` request with this ``Authorization`` header is refused, or None."""
        credentials = _bearer(authorization) if authorization else None
        if credentials is None:
            why, label = "no bearer token (header 'Authorization: Bearer <admin or reader token>')", "none"
        else:
            digest = token_sha256(credentials)
            label = digest[:8]
            grant = self._grants.get(digest)
            if grant is None:
                why, label = f"unknown token {label}", "unknown"
            elif grant.role is Role.ENGINE:
                why = "an engine token may not read /metrics: admin and reader tokens only"
            else:
                return None
        self.refusals.refused(label, why, "HTTP 401", "GET /metrics", peer)
        return why

    def _refused(self, sha256: str | None, error: Exception, method: str, peer: str) -> None:
        code = "UNAUTHENTICATED" if isinstance(error, Unauthenticated) else "PERMISSION_DENIED"
        self.refusals.refused((sha256 or "none")[:8], str(error), code, f"{_SERVICE}{method}", peer)

    async def guard(
        self, context: grpc.aio.ServicerContext, method: str, deployment: str, items: AsyncIterator[Any]
    ) -> AsyncIterator[Any]:
        """``items`` (a watch's stream), ended with PERMISSION_DENIED or UNAUTHENTICATED as soon as a
        reload takes ``deployment`` away from the call's token (not only at the next version)."""
        sha256 = _caller.get()
        watch = _Watch(sha256 or "", method, deployment, context.peer(), asyncio.get_running_loop().create_future())
        self._watches.add(watch)
        pending: asyncio.Future | None = None
        try:
            while True:
                pending = asyncio.ensure_future(anext(items))
                await asyncio.wait({pending, watch.ended}, return_when=asyncio.FIRST_COMPLETED)
                if not pending.done():
                    raise watch.ended.result()
                nxt, pending = pending, None
                try:
                    item = nxt.result()
                except StopAsyncIteration:
                    return
                yield item
        finally:
            self._watches.discard(watch)
            if pending is not None and not pending.done():
                pending.cancel()
                await asyncio.wait({pending})
            await items.aclose()


# Why the interceptor refused the call in hand (token label, reason), for the refusal handler.
_denial: contextvars.ContextVar[tuple[str, str]] = contextvars.ContextVar("eplb_denial", default=("none", ""))


def _refusing(
    handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str, on_call: Callable[[str], None]
) -> grpc.RpcMethodHandler:
    """A handler of ``handler``'s kind that aborts with ``code`` (requests left undecoded)."""

    async def abort(request: object, context: grpc.aio.ServicerContext) -> None:
        on_call(context.peer())
        await context.abort(code, message)

    async def abort_stream(request: object, context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
        on_call(context.peer())
        await context.abort(code, message)
        yield  # pragma: no cover  (abort raises)

    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(abort)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(abort)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(abort_stream)
    return grpc.stream_stream_rpc_method_handler(abort_stream)


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Authenticates every call but health and reflection; the handlers check the scope."""

    def __init__(self, access: Access) -> None:
        self.access = access
        # One refusal handler per (method, code, message), as few as the service's methods and
        # roles: the error interceptor caches a wrapper per handler it is given. The token
        # label and reason of each call reach the handler through ``_denial``.
        self._deny: dict[tuple[str, grpc.StatusCode, str], grpc.RpcMethodHandler] = {}

    def _refusal(
        self, handler: grpc.RpcMethodHandler, method: str, code: grpc.StatusCode, message: str
    ) -> grpc.RpcMethodHandler:
        key = (method, code, message)
        deny = self._deny.get(key)
        if deny is None:

            def on_call(peer: str) -> None:
                label, why = _denial.get()
                self.access.refusals.refused(label, why, code.name, method, peer)

            deny = self._deny[key] = _refusing(handler, code, message, on_call)
        return deny

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        if details.method.startswith(OPEN_METHODS_PREFIXES):
            return await continuation(details)
        grant, label = self.access.authenticate(details.invocation_metadata)
        handler = await continuation(details)
        if handler is None:  # no such method: UNIMPLEMENTED, as without auth
            return None
        if grant is None:
            # Every token not in the file is one caller, "unknown": random tokens cannot open a
            # log window each, nor push a known token's refusals out under "other".
            _denial.set(("none", "no bearer token") if label == "none" else ("unknown", f"unknown token {label}"))
            return self._refusal(handler, details.method, grpc.StatusCode.UNAUTHENTICATED, _MESSAGE)
        if details.method not in HANDLER_CHECKED and grant.role is not Role.ADMIN:
            why = f"{_a(grant.role.value)} token may not call {details.method}: admin only"
            _denial.set((label, why))
            return self._refusal(handler, details.method, grpc.StatusCode.PERMISSION_DENIED, why)
        _caller.set(grant.sha256)
        return handler


@dataclass
class _Window:
    start: float
    reason: str
    method: str
    peer: str
    more: int = 0


class RefusalLog:
    """Audit lines for refused calls: the first per caller (token label and status code) at
    once, then one line with the count of the others when its ``window_s`` ends (:meth:`flush`,
    which the server runs every second). Thread-safe: ``/metrics`` refusals come from the HTTP
    server's threads.

    Keyed by caller, not by reason: a reason names the deployment asked for, so a caller
    cycling through names would otherwise write a line a call. The callers are the auth file's
    tokens, ``none`` (no token) and ``unknown`` (every token not in the file, its hash prefix in
    the reason), so random tokens open no windows and cannot push a known token's refusals out.
    Reasons are capped at ``MAX_REASON`` characters. At most ``max_keys`` windows are open (an
    auth file of more tokens); refusals beyond them are counted under ``other``."""

    MAX_REASON = 512

    def __init__(self, window_s: float = 60.0, max_keys: int = 256, clock: Callable[[], float] = time.monotonic):
        self.window_s = window_s
        self.max_keys = max_keys
        self._clock = clock
        self._lock = threading.Lock()
        self._open: dict[tuple[str, str], _Window] = {}

    def refused(self, label: str, reason: str, code: str, method: str, peer: str) -> None:
        now = self._clock()
        reason = cap(reason, self.MAX_REASON)
        with self._lock:
            key = (label, code)
            if key not in self._open and len(self._open) >= self.max_keys:
                key = ("other", code)
            window = self._open.get(key)
            if window is not None:
                window.more += 1
                window.reason = reason
                window.method = method
                window.peer = peer
                return
            self._open[key] = _Window(now, reason, method, peer)
        kind = "auth_failure" if code in ("UNAUTHENTICATED", "HTTP 401") else "permission_denied"
        audit.warning(
            "audit: refused %s from %s, token %s: %s: %s (more like it are counted for %gs)",
            method,
            peer,
            key[0],
            code,
            reason,
            self.window_s,
            extra={
                "audit": kind,
                "method": method,
                "peer": peer,
                "token": key[0],
                "code": code,
                "reason": reason,
                "count": 1,
            },
        )

    def flush(self, everything: bool = False) -> None:
        """Ends the windows older than ``window_s`` (all of them with ``everything``), writing one
        line for each that counted more refusals."""
        now = self._clock()
        with self._lock:
            ended = [(k, w) for k, w in self._open.items() if everything or now - w.start >= self.window_s]
            for k, _ in ended:
                del self._open[k]
        for (label, code), w in ended:
            if w.more == 0:
                continue
            audit.warning(
                "audit: %d more calls refused in the last %.0fs, token %s: %s (last: %s from %s: %s)",
                w.more,
                now - w.start,
                label,
                code,
                w.method,
                w.peer,
                w.reason,
                extra={
                    "audit": "auth_failure" if code in ("UNAUTHENTICATED", "HTTP 401") else "permission_denied",
                    "method": w.method,
                    "peer": w.peer,
                    "token": label,
                    "code": code,
                    "reason": w.reason,
                    "count": w.more,
                },
            )


class ScopedHealth(health.aio.HealthServicer):
    """gRPC health whose per-deployment entries (``<service>/<deployment>``, set while a Redis
    Cluster master is down or after) are shown only to callers whose token may see the
    deployment. To anyone else an existing deployment answers as an unknown name does (``Check``
    NOT_FOUND, ``Watch`` SERVICE_UNKNOWN), so health is no token-less oracle of names. The
    overall entries (``""`` and the service's name) stay open for load balancers and probes.
    Without ``access`` (no tokens) every caller may list every name anyway: nothing is hidden.

    A service name over ``MAX_SERVICE`` characters (no deployment's: telling it apart tells
    nothing) is INVALID_ARGUMENT at once, ``Watch`` included: an open watch keeps its request,
    and megabyte names would pin memory for as long as anyone keeps them open."""

    MAX_SERVICE = 256

    def __init__(self, access: Access | None, deployment_prefix: str) -> None:
        super().__init__()
        self._access = access
        self._prefix = deployment_prefix

    async def _check_length(self, service: str, context: grpc.aio.ServicerContext) -> None:
        if len(service) > self.MAX_SERVICE:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"a health service name is at most {self.MAX_SERVICE} characters; this one has {len(service)}",
            )

    def _hidden(self, service: str, context: grpc.aio.ServicerContext) -> bool:
        if self._access is None or not service.startswith(self._prefix):
            return False
        grant, _ = self._access.authenticate(context.invocation_metadata())
        return grant is None or not grant.sees(service[len(self._prefix) :])

    async def Check(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> health_pb2.HealthCheckResponse:
        await self._check_length(request.service, context)
        if self._hidden(request.service, context):
            await context.abort(grpc.StatusCode.NOT_FOUND)  # as the stock servicer answers an unknown name
        return await super().Check(request, context)

    async def Watch(self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext) -> None:
        await self._check_length(request.service, context)
        if not self._hidden(request.service, context):
            await super().Watch(request, context)
            return
        # What the stock servicer sends for a name never set; the stream stays open as it would
        # (until the client goes or the server ends its streams), but never changes.
        await context.write(health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVICE_UNKNOWN))
        await asyncio.get_running_loop().create_future()
