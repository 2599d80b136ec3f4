"""The service's documented limits (docs/service.md, "Limits"), checked before any state is written.

They keep one tenant's input from making a deployment unreadable, the store or a replica run out
of memory, or a window sum overflow. Each is a module constant so operators and tests read the
same figure the checks use.
"""

from __future__ import annotations

__all__ = ["MAX_REPORT_COUNT"]

# Largest count one report may carry in one [layer, expert] (or slot) entry. A window sums at
# most a few million reports, so its sums stay far below float64's range (and exact far beyond
# any realistic token count): no report can make a window infinite.
MAX_REPORT_COUNT = 1e12
