"""Deprecated: the generated stubs live in ``eplb_wire._gen``; this alias goes after one release.

``eplb_service._gen.eplb.v1.balancer_pb2`` (and ``balancer_pb2_grpc``) still import: they are the
very module objects of ``eplb_wire._gen`` (aliased in ``sys.modules``, not re-generated), so the
protobuf descriptors are registered once and messages from either name are the same classes.
"""

import sys

import eplb_wire._gen.eplb.v1.balancer_pb2
import eplb_wire._gen.eplb.v1.balancer_pb2_grpc  # noqa: F401

for _name in ("eplb", "eplb.v1", "eplb.v1.balancer_pb2", "eplb.v1.balancer_pb2_grpc"):
    sys.modules[f"{__name__}.{_name}"] = sys.modules[f"eplb_wire._gen.{_name}"]
eplb = sys.modules["eplb_wire._gen.eplb"]
