"""The wire contract ``eplb.v1``, shared by the service and the engine side.

``eplb_wire._gen``: the code generated from ``proto/`` (``scripts/gen_proto.sh``; never edited by
hand), :mod:`eplb_wire.arrays`: ``Array`` messages ↔ numpy, and :mod:`eplb_wire.topology`:
``Topology`` messages ↔ ``eplb.Topology``; their errors are :class:`eplb_wire.errors.WireError`
naming the field path. Both sides depend on this package and on ``eplb``, never on each other; it
needs ``protobuf`` and ``grpcio`` only.
"""

# The modules a client imports (loaded on `from eplb_wire import arrays`); the generated stubs
# are `eplb_wire._gen.eplb.v1`, whose contract is the proto's.
__all__ = ["arrays", "errors", "parts", "topology"]
