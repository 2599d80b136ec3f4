"""The deepseek policy and the compat function reproduce DeepSeek's eplb.py exactly."""

import json
from pathlib import Path

import numpy as np
import pytest

import eplb
from eplb.compat.deepseek import rebalance_experts

# A copy of shared/testdata/deepseek_golden.json: eplb.py (commit d52c72d) outputs on 13 inputs.
GOLDEN = Path(__file__).resolve().parents[1] / "data" / "deepseek_golden.json"
CASES = json.loads(GOLDEN.read_text())["cases"]


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_compat_matches_golden_exactly(case: dict) -> None:
    phy2log, log2phy, logcnt = rebalance_experts(
        np.array(case["weight"]), case["num_replicas"], case["num_groups"], case["num_nodes"], case["num_gpus"]
    )
    assert phy2log.tolist() == case["phy2log"]
    assert log2phy.tolist() == case["log2phy"]
    assert logcnt.tolist() == case["logcnt"]


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_deepseek_policy_matches_golden_phy2log(case: dict) -> None:
    weight = np.array(case["weight"])
    groups = case["num_groups"]
    if weight.shape[1] % groups:
        # eplb.py never checks this on its global fallback; Topology does, and the fallback
        # ignores groups, so one group plans the same.
        groups = 1
    topo = eplb.Topology(
        weight.shape[0], weight.shape[1], case["num_replicas"], case["num_gpus"], case["num_nodes"], groups
    )
    plan = eplb.rebalance(weight, topo, "deepseek")
    assert plan.phy2log.tolist() == case["phy2log"]
    assert plan.logcnt.tolist() == case["logcnt"]


def test_compat_rejects_what_eplb_py_asserts() -> None:
    with pytest.raises(ValueError, match="multiple of num_gpus"):
        rebalance_experts(np.ones((1, 8)), 10, 1, 1, 4)
    with pytest.raises(ValueError, match="num_replicas"):
        rebalance_experts(np.ones((1, 8)), 4, 1, 1, 4)
    with pytest.raises(ValueError, match="finite"):
        rebalance_experts(np.array([[1.0, np.nan]]), 2, 1, 1, 1)
