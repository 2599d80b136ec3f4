"""Test helpers: engine ranks as gloo processes (spawned: a service thread in the parent is
safe), and the check that every rank routes with the same map."""

from __future__ import annotations

import os
import traceback
import zlib
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from svc_thread import free_port

import eplb


def _entry(rank: int, world: int, port: int, body: Callable[..., object], args: tuple, out: dict) -> None:
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
        out[rank] = body(rank, *args)
        dist.destroy_process_group()
    except BaseException:  # reported to the parent, which fails the test with it
        out[rank] = traceback.format_exc()
        raise


def spawn_ranks(body: Callable[..., object], world: int, *args: object) -> list:
    """``body(rank, *args)`` on ``world`` gloo processes (a module-level function); their results."""
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_entry, args=(world, free_port(), body, args, out), nprocs=world, join=True)
        res = dict(out)
    return [res[r] for r in range(world)]


def assert_same_map(placement: eplb.Placement, step: int) -> None:
    """Collective: fails on every rank unless all route with ``placement``'s map."""
    crc = zlib.crc32(placement.phy2log.tobytes())
    agree = torch.tensor([crc, -crc], dtype=torch.int64)
    dist.all_reduce(agree, op=dist.ReduceOp.MAX)
    assert agree[0] == -agree[1], f"ranks route with different maps at step {step}"
