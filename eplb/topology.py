"""The shape of one expert-parallel deployment: layers, experts, slots, GPUs, nodes, groups."""

from __future__ import annotations

from dataclasses import dataclass

from . import checks

__all__ = ["Topology"]


@dataclass(frozen=True)
class Topology:
    """One MoE model on one expert-parallel group.

    Slots are numbered gpu-major: slot ``p`` lives on gpu ``p // slots_per_gpu`` and gpu ``g``
    on node ``g // gpus_per_node``. Experts form ``num_groups`` contiguous groups (DeepSeek's
    group-limited routing).
    """

    num_layers: int
    num_experts: int
    num_slots: int
    num_gpus: int
    num_nodes: int = 1
    num_groups: int = 1

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_experts", "num_slots", "num_gpus", "num_nodes", "num_groups"):
            object.__setattr__(self, name, checks.positive_int(name, getattr(self, name), allowed="a positive integer"))
        if self.num_slots < self.num_experts:
            raise ValueError(
                f"num_slots ({self.num_slots}) must be >= num_experts ({self.num_experts}): "
                "every expert needs at least one slot"
            )
        if self.num_slots % self.num_gpus:
            raise ValueError(
                f"num_slots ({self.num_slots}) must be a multiple of num_gpus ({self.num_gpus}) "
                "so every gpu has the same number of slots"
            )
        if self.num_gpus % self.num_nodes:
            raise ValueError(f"num_gpus ({self.num_gpus}) must be a multiple of num_nodes ({self.num_nodes})")
        if self.num_experts % self.num_groups:
            raise ValueError(
                f"num_experts ({self.num_experts}) must be a multiple of num_groups ({self.num_groups}) "
                "because groups are contiguous and equal-sized"
            )

    @property
    def slots_per_gpu(self) -> int:
        return self.num_slots // self.num_gpus

    @property
    def gpus_per_node(self) -> int:
        return self.num_gpus // self.num_nodes

    @property
    def slots_per_node(self) -> int:
        return self.num_slots // self.num_nodes

    @property
    def experts_per_group(self) -> int:
        return self.num_experts // self.num_groups

    @property
    def hierarchical_ok(self) -> bool:
        """Whether groups can be packed whole onto nodes (``num_groups % num_nodes == 0``)."""
        return self.num_groups % self.num_nodes == 0

    @property
    def max_replicas(self) -> int:
        """Fixed ``log2phy`` width: the most replicas any expert can get under this topology.

        One expert keeps >= 1 slot for each of the others, so no count exceeds
        ``num_slots - num_experts + 1``; our policies also cap counts at ``num_gpus`` unless
        there are more slots than ``num_experts * num_gpus``. A fixed width means ``log2phy``
        has the same shape for every plan of a deployment.
        """
        return self.num_slots - self.num_experts + 1

    def with_layers(self, num_layers: int) -> Topology:
        return Topology(num_layers, self.num_experts, self.num_slots, self.num_gpus, self.num_nodes, self.num_groups)
