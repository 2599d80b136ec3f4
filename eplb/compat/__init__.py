"""Drop-ins for other projects' balancers: ``eplb.compat.deepseek.rebalance_experts``."""

from . import deepseek  # noqa: F401  (eplb.compat.deepseek after `import eplb`)

__all__ = ["deepseek"]
