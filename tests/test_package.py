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
