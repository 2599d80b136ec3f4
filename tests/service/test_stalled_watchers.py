"""What watchers that do not read cost a real ``eplb serve`` (a child process, so that only the
server's memory is measured): ``bench/stalled_watchers_bench.py``, shortened.

A stalled stream's client takes the first few messages into its transport's window; then gRPC
core holds one message per stream, its own copy, until the client reads or cancels. The bound
below allows each stalled stream 1.5 messages, and the ring of 16 versions plus slack: a copy of
its own in Python for each stream (two messages a stream) or a queue of the versions it missed
breaks it. Once they cancel, the server gives the memory back (malloc_trim) but for the ring.
"""

from __future__ import annotations

import argparse

import pytest

from eplb_bench import stalled_watchers_bench

WATCHERS = 40
# Enough versions that every stalled client's window is full and the server holds one each.
VERSIONS = 20


@pytest.mark.slow
async def test_stalled_watchers_cost_one_message_each_and_the_memory_comes_back():
    args = argparse.Namespace(watchers=WATCHERS, versions=VERSIONS, experts=1024, slots=4096)
    out = await stalled_watchers_bench.main_async(args, 0.0)
    assert out["reader_in_order"], out["reader_versions"]
    assert out["error_lines"] == 0, out["first_error"]
    # The ring keeps 16 versions of the 1.25 MiB message (20 MB); 15 MB more for the rest.
    ring_mb = 16 * out["message_mib"]
    assert out["peak_grown_mb"] <= WATCHERS * 1.5 * out["message_mib"] + ring_mb + 15, out
    assert out["after_grown_mb"] <= ring_mb + 15, out


@pytest.mark.slow
async def test_stalled_watchers_in_parts_hold_a_part_each():
    # eplb's watchers ask for 64 KiB parts: a stalled stream then holds about a part and its
    # window, not a 1.25 MiB message (200 of them: +51 MB peak against +289 MB whole, the bench).
    args = argparse.Namespace(watchers=WATCHERS, versions=VERSIONS, experts=1024, slots=4096, part_bytes=65536)
    out = await stalled_watchers_bench.main_async(args, 0.0)
    assert out["reader_in_order"], out["reader_versions"]
    assert out["error_lines"] == 0, out["first_error"]
    ring_mb = 16 * out["message_mib"]
    assert out["peak_grown_mb"] <= WATCHERS * 0.25 + ring_mb + 15, out
