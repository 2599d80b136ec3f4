"""Placements sent in parts (``WatchPlacementsRequest.max_part_bytes``): the size the engine side
asks for, and the reassembly both faces of its client use."""

from __future__ import annotations

from ._gen.eplb.v1 import balancer_pb2 as pb

__all__ = ["WATCH_PART_BYTES", "PartAssembler"]

WATCH_PART_BYTES = 65536
"""The part size eplb's watchers ask for (and the one size the service keeps serialized parts of):
a stalled watcher then holds about this much of the server's memory, not a placement."""


class PartAssembler:
    """Feeds ``WatchPlacementsResponse`` messages, whole placements or parts, in stream order;
    ``feed`` returns the ``Placement`` a message completes, else None. Parts out of order (a
    server bug or a lost message) raise ``ValueError``: the caller's reconnect resumes from the
    last whole version."""

    def __init__(self) -> None:
        self._version = 0
        self._chunks: list[bytes] = []
        self._count = 0

    def feed(self, response: pb.WatchPlacementsResponse) -> pb.Placement | None:
        if not response.HasField("part"):
            self._chunks = []
            return response.placement
        part = response.part
        if part.index == 0:
            self._version, self._count, self._chunks = part.version, part.count, []
        if part.version != self._version or part.index != len(self._chunks) or part.count != self._count:
            raise ValueError(
                f"placement part {part.index} of {part.count} for version {part.version} arrived after "
                f"{len(self._chunks)} of {self._count} parts of version {self._version}"
            )
        self._chunks.append(part.data)
        if len(self._chunks) < self._count:
            return None
        placement = pb.Placement.FromString(b"".join(self._chunks))
        self._chunks = []
        return placement
