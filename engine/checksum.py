"""Cheap content checksums of expert slots, to compare a moved slot with its source."""

from __future__ import annotations

from collections.abc import Mapping

import torch

__all__ = ["slot_checksum"]


def slot_checksum(tensors: Mapping[str, torch.Tensor], slot: int) -> torch.Tensor:
    """``tensors``: name -> ``[S, ...]`` → int64 ``[2 * T]`` for slot ``slot``, names in sorted order.

    Per tensor: the sum of its 32-bit words (bytes when the size is not a multiple of 4) and
    the sum of every other word, accumulated in int64 on the tensor's device. Replicas of one
    expert hold identical bytes, so equal sums are what a correct copy gives; the second sum
    catches words moved within the slot.
    """
    sums = []
    for name in sorted(tensors):
        flat = tensors[name][slot].reshape(-1).view(torch.uint8)
        if flat.numel() % 4 == 0:
            flat = flat.view(torch.int32)
        sums.append(flat.sum(dtype=torch.int64))
        sums.append(flat[1::2].sum(dtype=torch.int64))
    return torch.stack(sums)
