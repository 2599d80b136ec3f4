"""eplb.timing: a placement's expected MoE time, checked against sampling."""

from __future__ import annotations

import numpy as np
import pytest

import eplb
from eplb import kernel, timing
from eplb.simulate import inclusion_probabilities
from eplb.workloads import make_loads

MODEL = kernel.KernelModel(20.0, 3.0, 2.0, 128)


@pytest.mark.parametrize("dispatch", ["even", "static"])
@pytest.mark.parametrize("tokens", [64, 4096, 200_000])
def test_slot_moments_match_sampled_counts(dispatch, tokens):
    rng = np.random.default_rng(0)
    pi = np.array([0.0005, 0.01, 0.05, 0.3])
    counts = np.array([1, 3, 2, 4])
    mean, var, p0 = timing.slot_moments(pi, counts, tokens, MODEL, dispatch)
    draws = 20_000
    for e in range(pi.size):
        r = counts[e]
        if dispatch == "even":
            n = rng.binomial(tokens, pi[e], draws)
            j = rng.integers(0, r, draws)
            per = (n + j) // r
        else:
            per = rng.binomial(tokens // r, pi[e], draws)
        f = MODEL.slot_us(per)
        assert mean[e] == pytest.approx(f.mean(), rel=0.03, abs=0.02)
        assert np.sqrt(var[e]) == pytest.approx(f.std(), rel=0.08, abs=0.05)
        assert p0[e] == pytest.approx((per == 0).mean(), abs=0.02)


def test_expected_max_matches_sampled_normals():
    rng = np.random.default_rng(1)
    mu = rng.uniform(80, 100, 32)
    var = rng.uniform(1, 30, 32)
    samples = rng.normal(mu, np.sqrt(var), (200_000, 32)).max(axis=1)
    assert float(timing.expected_max(mu, var)) == pytest.approx(samples.mean(), rel=0.002)
    # No variance: the largest mean.
    assert float(timing.expected_max(mu, np.zeros(32))) == pytest.approx(mu.max(), rel=1e-6)


def test_predicted_time_is_close_to_sampled_steps():
    topo = eplb.Topology(2, 64, 80, 8, 1, 1)
    loads = make_loads("lognormal-1.0", topo, seed=3)
    plan = eplb.rebalance(loads, topo)
    for b in (4, 256):
        pred = timing.predicted_layer_us(plan.placement, loads, MODEL, b, 8)[:, 0]
        for layer in range(2):
            sampled = timing.sample_layer_us(loads[layer], plan.placement, MODEL, b, 8, 400, layer=layer, seed=5)
            assert pred[layer] == pytest.approx(sampled.mean(), rel=0.05)


@pytest.mark.parametrize("dispatch", ["even", "static"])
def test_sampled_counts_route_every_visit_and_split_replicas(dispatch):
    topo = eplb.Topology(1, 16, 24, 4, 1, 1)
    loads = make_loads("zipf-1.0", topo, seed=0)
    plan = eplb.rebalance(loads, topo)
    c = timing.sample_slot_counts(loads[0], plan.placement, 32, 4, 6, dispatch=dispatch, seed=2)
    assert c.shape == (6, 24)
    assert (c.sum(axis=1) == 32 * 4 * 4).all()
    if dispatch == "even":
        # An expert's replicas share its visits within one token of each other.
        phy = plan.phy2log[0]
        for e in np.flatnonzero(plan.placement.logcnt[0] > 1):
            per = c[:, phy == e]
            assert (per.max(axis=1) - per.min(axis=1) <= 1).all()


def test_batches_and_inclusion_inputs_are_checked():
    b = timing.batches_from([(4, 3), (64, 1)])
    assert b.sizes.tolist() == [4, 64] and b.weights.tolist() == [0.75, 0.25]
    assert timing.batches_from(16).sizes.tolist() == [16]
    for bad in (0, [], [1.5], [(4, -1)], "64", [(4, 0)]):
        with pytest.raises(ValueError, match="tokens_per_gpu must be"):
            timing.batches_from(bad)
    with pytest.raises(ValueError, match="dispatch must be one of even, static"):
        timing.slot_moments(inclusion_probabilities(np.ones(8), 2), np.ones(8), 64, MODEL, "random")
