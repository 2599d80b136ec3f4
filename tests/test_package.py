"""What ``import eplb`` gives a new user."""

import subprocess
import sys

import pytest

import eplb


def test_tool_modules_are_attributes_after_import_eplb() -> None:
    # A fresh interpreter: this test process has imported most modules already.
    code = (
        "import sys, eplb\n"
        "lazy = ('compat', 'formats', 'simulate', 'traces', 'transfer', 'workloads')\n"
        "print(sorted(m for m in lazy if f'eplb.{m}' in sys.modules))\n"
        "print(eplb.workloads.SCALES['small'].num_slots, eplb.transfer.transfer_schedule.__name__,\n"
        "      eplb.compat.deepseek.rebalance_experts.__name__, eplb.formats.__name__,\n"
        "      eplb.simulate.__name__, eplb.traces.__name__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.splitlines()
    assert out[0] == "[]"  # loaded on first use, so `import eplb` does not pay for them
    assert out[1] == "20 transfer_schedule rebalance_experts eplb.formats eplb.simulate eplb.traces"


def test_unknown_attributes_still_raise_attribute_error() -> None:
    assert "workloads" in dir(eplb)
    with pytest.raises(AttributeError, match="module 'eplb' has no attribute 'workload'"):
        eplb.workload  # noqa: B018


def test_the_engine_side_imports_no_service_module() -> None:
    # A fresh interpreter: the engine needs eplb_wire (stubs, codec) and eplb, never eplb_service.
    code = (
        "import sys, eplb_engine, eplb_engine.client, eplb_engine.aio, eplb_engine.wire, eplb_engine.reporter\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'eplb_service'))\n"
        "print('eplb_wire._gen.eplb.v1.balancer_pb2' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.splitlines()
    assert out == ["[]", "True"]


def test_one_codec_raises_the_field_and_the_service_maps_it_to_invalid_argument() -> None:
    import numpy as np

    from eplb_service import arrays as service_arrays
    from eplb_service.errors import InvalidArgument, to_status
    from eplb_wire import arrays
    from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb

    short = pb.Array(dtype=pb.DTYPE_INT32, shape=[2, 3], data=b"\0" * 20)
    with pytest.raises(
        arrays.ArrayError, match=r"^loads.data: holds 20 bytes; shape \[2, 3\] of int32 needs 24$"
    ) as info:
        arrays.decode(short, "loads", (2, 3))
    assert (info.value.field, isinstance(info.value, ValueError)) == ("loads.data", True)
    assert to_status(info.value).code == 3  # INVALID_ARGUMENT, with the field violation
    with pytest.raises(InvalidArgument) as got:
        service_arrays.decode(short, "loads", (2, 3))
    assert [(v.field, v.description) for v in got.value.violations] == [("loads.data", info.value.description)]
    with pytest.raises(InvalidArgument, match=r"loads.data: counts must be >= 0 \(found -1.0\)"):
        service_arrays.decode_counts(arrays.encode(np.array([[-1.0]])), "loads", (1, 1))
    # Strict by default (the service's rule); the engine side widens other integers and floats.
    with pytest.raises(ValueError, match="cannot encode dtype uint8; allowed: int32, int64, float32, float64"):
        arrays.encode(np.zeros(2, np.uint8))
    assert arrays.encode(np.zeros(2, np.uint8), widen=True).dtype == pb.DTYPE_INT64
    assert arrays.encode(np.zeros(2, np.float16), widen=True).dtype == pb.DTYPE_FLOAT32
    with pytest.raises(ValueError, match="cannot encode a boolean array"):
        arrays.encode(np.zeros(2, bool), widen=True)


def test_a_plan_prints_as_one_line_of_figures_not_its_arrays() -> None:
    # print(plan) dumped every [L] and [L, P] array (hundreds of lines at DeepSeek-V3's scale).
    import numpy as np

    topo = eplb.Topology(58, 256, 288, 32, 4, 8)
    loads = np.random.default_rng(0).lognormal(0, 1, (58, 256))
    plan = eplb.rebalance(loads, topo, "global", effort="fast")
    text = repr(plan)
    assert str(plan) == text and "\n" not in text and "array" not in text and len(text) < 300
    assert text.startswith(
        "Plan(58 layers x 256 experts in 288 slots on 32 gpus (4 nodes, 8 groups), policy global, imbalance mean "
        f"{plan.mean_imbalance:.4f} max {plan.max_imbalance:.4f} (lower bound {plan.imbalance_lb.mean():.4f}), "
        f"0 moves, {plan.solve_seconds:.3f} s"
    )
    down = eplb.rebalance(loads, topo, "auto", previous=plan.placement, down_gpus=[3], effort="fast")
    assert "gpus down [3], policy auto -> " in repr(down) and f"{down.total_moves} moves" in repr(down)
    assert down.total_moves > 0 and repr(down).endswith(f"{len(down.notes)} note{'s' if len(down.notes) > 1 else ''})")
