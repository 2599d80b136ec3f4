"""Re-planning: a fresh plan made migration-aware against the placement in service.

- ``choose``: the entry point (``choose``);
- ``migration``: ``Migration``, what a re-plan may trade (tolerances and move budgets);
- ``align``: the fresh plan relabelled onto the previous one;
- ``candidates``: the previous placement repaired towards targets, per layer;
- ``moves``: repair moves (ejection chains, count repairs);
- ``pick``: one candidate per layer, fewest moves within the imbalance allowed.

``eplb.rebalance`` applies it to every policy registered with ``replans=True``.
"""
