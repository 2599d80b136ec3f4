"""The service's documented limits (docs/service.md, "Limits"), checked before any state is written.

The figures live in ``eplb.limits``, shared with the tools (which do not import the service);
this module re-exports them under their old names.
"""

from __future__ import annotations

from eplb.limits import (
    COMPUTE_QUEUE,
    COMPUTE_WORKERS,
    ILP_MAX_CELLS,
    ILP_MAX_SECONDS,
    MAX_DEPLOYMENTS,
    MAX_EXPERTS,
    MAX_GPUS,
    MAX_LAYERS,
    MAX_PLACEMENT_BYTES,
    MAX_REPORT_COUNT,
    MAX_SLOTS,
    MAX_SUSPECT_AFTER_S,
    MAX_WINDOW_BYTES,
    MIN_SUSPECT_AFTER_S,
    MIN_TRIGGER_INTERVAL_S,
    REPLAN_WORKERS,
    SMALL_PLAN_CELLS,
    SMALL_PLAN_WORKERS,
)

# Planning.tokens_per_gpu: at most this many batch sizes, each 1 .. MAX_TOKENS_PER_GPU; a plan
# for time costs about one search per size. Planning.top_k: 1 .. MAX_TOP_K (and num_experts).
MAX_BATCH_SIZES = 16
MAX_TOKENS_PER_GPU = 1 << 20
MAX_TOP_K = 64

__all__ = [
    "MAX_BATCH_SIZES",
    "MAX_TOKENS_PER_GPU",
    "MAX_TOP_K",
    "COMPUTE_QUEUE",
    "COMPUTE_WORKERS",
    "ILP_MAX_CELLS",
    "ILP_MAX_SECONDS",
    "MAX_DEPLOYMENTS",
    "MAX_EXPERTS",
    "MAX_GPUS",
    "MAX_LAYERS",
    "MAX_PLACEMENT_BYTES",
    "MAX_REPORT_COUNT",
    "MAX_SLOTS",
    "MAX_SUSPECT_AFTER_S",
    "MAX_WINDOW_BYTES",
    "MIN_SUSPECT_AFTER_S",
    "MIN_TRIGGER_INTERVAL_S",
    "REPLAN_WORKERS",
    "SMALL_PLAN_CELLS",
    "SMALL_PLAN_WORKERS",
]
