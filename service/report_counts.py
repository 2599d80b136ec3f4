"""A report's counts decoded and checked off the event loop.

``[L, E]`` (logical) or ``[L, P]`` (physical) counts → float64, checked as
:func:`.arrays.decode_counts` checks them, in a small thread pool: numpy releases the GIL in
these loops, so GetPlacement calls and watchers on the event loop are not queued behind the
decoding of a stream of large reports (about 0.1 ms each for ``[58, 256]``). Small reports are
decoded in place, where a thread hop would cost more than it saves.
"""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb

from . import arrays, limits

__all__ = ["decode"]

# Below this many counts a report is decoded on the loop.
OFF_LOOP_MIN = 4096
_POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="eplb-report-decode")


async def decode(msg: pb.Array, field: str, shape: tuple[int, int]) -> np.ndarray:
    """``msg`` of ``shape`` → float64 counts; ``InvalidArgument`` naming ``field`` as
    :func:`.arrays.decode_counts` raises it (capped at ``limits.MAX_REPORT_COUNT``)."""
    call = functools.partial(arrays.decode_counts, msg, field, shape, cap=limits.MAX_REPORT_COUNT)
    if shape[0] * shape[1] < OFF_LOOP_MIN:
        return call()
    return await asyncio.get_running_loop().run_in_executor(_POOL, call)
