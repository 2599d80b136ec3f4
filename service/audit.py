"""``AuditLog``: the interceptor's hook that writes one audit line (logger ``eplb_service.audit``)
per CreateDeployment and DeleteDeployment call, successful or refused; refused ones throttled."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .clip import clip, plain
from .decoding import Undecodable
from .log_throttle import LogThrottle

if TYPE_CHECKING:
    from .calls import Call

__all__ = ["AuditLog"]

audit = logging.getLogger("eplb_service.audit")

# Successful or refused, these are written as one audit line each: the deployment each names.
_AUDITED: dict[str, Callable[[Any], str]] = {
    "/eplb.v1.ExpertLoadBalancerService/CreateDeployment": lambda request: request.deployment.name,
    "/eplb.v1.ExpertLoadBalancerService/DeleteDeployment": lambda request: request.name,
}


class AuditLog:
    """Audit lines of deployment changes; refused ones share ``throttle`` with the other lines
    about what callers sent."""

    def __init__(self, throttle: LogThrottle | None = None) -> None:
        self._throttle = throttle if throttle is not None else LogThrottle()

    def bind(self, method: str, label: str) -> Callable[[Call], None] | None:
        """The hook for ``method``'s calls; None for the methods not audited."""
        name_of = _AUDITED.get(method)
        if name_of is None:
            return None
        return lambda call: self.finish(call, name_of)

    def finish(self, call: Call, name_of: Callable[[Any], str]) -> None:
        # A refused token is audited by auth (throttled), not once per call here.
        if call.code in ("UNAUTHENTICATED", "PERMISSION_DENIED"):
            return
        request = call.request
        if request is None or isinstance(request, Undecodable):
            return  # no message (a stream), or one logged (throttled) where it was refused
        held = 0
        if call.code != "OK":
            # Every change is audited; refused ones (a bad name, an existing deployment) at most
            # one line a minute per method and code, with the count of the others.
            held = self._throttle.admit((call.label, call.code))
            if held is None:
                return
        name = name_of(request)
        shown = clip(name)
        peer = call.context.peer()
        audit.info(
            "audit: %s %s by %s: %s%s",
            call.label.rpartition("/")[2],
            shown,
            peer,
            call.code,
            f" ({held} more like it in the last minute)" if held else "",
            extra={
                "audit": call.label.rpartition("/")[2],
                # The name itself when it is a valid one (JSON logs keep it a plain value);
                # anything else clipped, so no raw control or line-break characters.
                "deployment": name if plain(name) else shown,
                "peer": peer,
                "code": call.code,
            },
        )
