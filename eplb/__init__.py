"""eplb: expert-parallel load balancing for mixture-of-experts inference.

``rebalance(loads [L, E], topology, policy="auto", previous=None, **options) -> Plan``
is the entry point; ``policies()`` lists what ``policy`` accepts.
"""

from . import policies as _policies  # noqa: F401  (registers the built-in policies)
from .metrics import balancedness, gpu_loads, imbalance, imbalance_lb, lower_bound, moves
from .placement import Placement
from .plan import Plan
from .registry import PolicyResult, get_policy, policies, rebalance, register_policy
from .topology import Topology

__all__ = [
    "Topology",
    "Placement",
    "Plan",
    "PolicyResult",
    "rebalance",
    "policies",
    "get_policy",
    "register_policy",
    "gpu_loads",
    "imbalance",
    "balancedness",
    "lower_bound",
    "imbalance_lb",
    "moves",
]
