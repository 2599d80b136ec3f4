"""What a failed Redis call becomes (``StoreUnavailable``, or the error itself where it is a
bug), whether it timed out, and how often a call is retried: the same on one Redis and on a
Redis Cluster."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import redis.asyncio as redis
from redis import exceptions as redis_errors
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.exceptions import ClusterDownError, MasterDownError, RedisError, ResponseError, TryAgainError

from ..errors import StoreUnavailable

__all__ = ["no_retry", "retry", "timed_out", "unavailable"]


@contextlib.contextmanager
def unavailable() -> Iterator[None]:
    """Raises ``StoreUnavailable`` for what a call that may succeed later raises (a connection
    error, a timeout, a cluster that reshards), and lets an error answer (a bug) through."""
    try:
        yield
    except (ClusterDownError, TryAgainError, MasterDownError) as exc:
        # Redis Cluster answers while a master rejoins or slots move: transient, like a
        # connection error (they are ResponseErrors, which otherwise mean a bug, e.g. in a script).
        raise StoreUnavailable(f"redis cluster unavailable: {exc}") from exc
    except ResponseError:
        raise
    except (RedisError, OSError) as exc:
        raise StoreUnavailable(f"redis unavailable: {exc}") from exc
    except AttributeError as exc:
        # redis-py's asyncio cluster client, when a master rejoins: a call writes on a
        # connection that another call just closed ("'NoneType' object has no attribute
        # 'writelines'"): a broken connection, retried by the caller like any other.
        if "writelines" not in str(exc):
            raise
        raise StoreUnavailable(f"redis unavailable: connection closed under the call ({exc})") from exc


# Three quick retries (0.1 s at most) cover pooled connections broken by a Redis restart;
# anything longer would only delay the UNAVAILABLE the caller should see while Redis is down.
# Connection errors only: retried timeouts made a call to a hung Redis wait four socket
# timeouts (4.1 s) instead of one.
def retry() -> Retry:
    return Retry(ExponentialBackoff(cap=0.05, base=0.01), 3, supported_errors=(redis.ConnectionError,))


# The cluster client retries a command or a pipeline itself, on timeouts as on broken
# connections (its ERRORS_ALLOW_RETRY, whatever the retry's supported errors say), each time on
# the same master: a hung master cost a call four socket timeouts (4.1 s). So it retries
# nothing; a call on a broken connection (a master that restarted) fails UNAVAILABLE once, and
# the client reconnects the master's other connections before they are used.
def no_retry() -> Retry:
    return Retry(NoBackoff(), 0)


def timed_out(exc: BaseException) -> bool:
    """Whether ``exc`` (or what it was raised from) is a socket timeout: a master that did not
    answer in time, rather than one that refused or closed the connection."""
    return isinstance(exc, redis_errors.TimeoutError) or isinstance(exc.__cause__, redis_errors.TimeoutError)
