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
    MAX_BATCH_SIZES,
    MAX_DEPLOYMENTS,
    MAX_EXPERTS,
    MAX_GPUS,
    MAX_LAYERS,
    MAX_PLACEMENT_BYTES,
    MAX_REPORT_COUNT,
    MAX_REPORT_COVERS,
    MAX_REPORT_STEPS,
    MAX_SLOTS,
    MAX_SUSPECT_AFTER_S,
    MAX_TOKENS_PER_GPU,
    MAX_TOP_K,
    MAX_WINDOW_BYTES,
    MIN_SUSPECT_AFTER_S,
    MIN_TRIGGER_INTERVAL_S,
    REPLAN_WORKERS,
    SMALL_PLAN_CELLS,
    SMALL_PLAN_WORKERS,
)

__all__ = [
    "MAX_BATCH_SIZES",
    "MAX_REPORT_COVERS",
    "MAX_REPORT_STEPS",
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
