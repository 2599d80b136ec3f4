"""A report's counts decoded and checked, off the event loop where they are large.

``[L, E]`` (logical) or ``[L, P]`` (physical) counts → a read-only view in the dtype they came
in (int32 counts stay int32: no float copy a report), checked as
:func:`.arrays.decode_counts` checks them. Reports of up to ``OFF_LOOP_MIN`` counts are decoded
on the loop: a thread hop costs more than it saves there. Measured with ``python -m
eplb_bench.ingest_bench --kinds redis --instances 1 --deployments 1`` (int32 ``[58, 256]``
reports, 14,848 counts): decoding them in the pool took the instance 0.41-0.50 ms of CPU a
report and 1,720-2,188 reports/s at most, on the loop 0.18-0.24 ms and 3,115-4,969 reports/s.
The decode itself is about 50 µs; the rest was the GIL passing between the loop and the pool's
threads (numpy releases it for each large operation, and each release let the other thread in:
the window add on the loop took 64 µs a report instead of 10). Larger reports (the documented
limits allow millions of counts: several ms of decoding) still go to the pool, so that
GetPlacement calls and watchers do not wait behind one.
"""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from eplb import limits
from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb

from . import arrays

__all__ = ["decode"]

# Up to this many counts (about 1 ms of decoding) a report is decoded on the loop.
OFF_LOOP_MIN = 262_144
_POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="eplb-report-decode")


async def decode(msg: pb.Array, field: str, shape: tuple[int, int]) -> np.ndarray:
    """``msg`` of ``shape`` → its counts in their own dtype (read-only); ``InvalidArgument``
    naming ``field`` as :func:`.arrays.decode_counts` raises it (capped at
    ``limits.MAX_REPORT_COUNT``)."""
    call = functools.partial(arrays.decode_counts, msg, field, shape, cap=limits.MAX_REPORT_COUNT, native=True)
    if shape[0] * shape[1] <= OFF_LOOP_MIN:
        return call()
    return await asyncio.get_running_loop().run_in_executor(_POOL, call)
