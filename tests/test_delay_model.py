"""examples/nanogpt/delay_model.py: its matrices against the algorithm simulated step by step, and sync's edge
against its closed form (the model ranks candidate estimates in docs/studies/time-to-target.md)."""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples", "nanogpt"))
import delay_model as dm  # noqa: E402

sys.path.pop(0)


def one_step(s, xi, a, f, blend=1.0, extrapolate=1.0, beta1=dm.BETA1):
    """One update of the scalar algorithm from state ``s = (theta, m, theta~)`` with the parts' mean noises
    ``xi``: the estimate from theta_t and m_t and the first part at theta~, the commit from both parts."""
    theta, m, est = s
    k = 1.0 - beta1
    g1, g2 = est + xi[0], theta + xi[1]
    new_est = theta - extrapolate * a * (m + blend * k * (g1 - m))
    m = beta1 * m + k * (f * g1 + (1.0 - f) * g2)
    return (theta - a * m, m, new_est)


@pytest.mark.parametrize("f, blend, extrapolate", [(0.5, 1.0, 1.0), (0.25, 1.0, 1.0), (0.75, 0.3, 1.0),
                                                   (0.5, 1.0, 1.4), (0.75, 0.6, 1.2)])
def test_one_update_is_the_matrices(f, blend, extrapolate):
    """The matrices are the algorithm's update exactly, for any state and noise (not only on average)."""
    g = torch.Generator().manual_seed(1)
    for a in (0.3, 4.0, 17.0):
        A, B, _ = dm.matrices(a, f, blend=blend, extrapolate=extrapolate)
        for _ in range(5):
            s = torch.randn(3, generator=g, dtype=torch.float64)
            xi = torch.randn(2, generator=g, dtype=torch.float64)
            want = torch.tensor(one_step(tuple(s.tolist()), tuple(xi.tolist()), a, f, blend, extrapolate),
                                dtype=torch.float64)
            torch.testing.assert_close(A @ s + B @ xi, want, rtol=0, atol=1e-12)
    A, B, _ = dm.matrices(2.0, 0.0)  # sync: (theta, m) only, the noise of the whole update
    s, xi = torch.tensor([0.7, -0.2], dtype=torch.float64), torch.tensor([0.0, 0.4], dtype=torch.float64)
    theta, m, _ = one_step((0.7, -0.2, 123.0), (0.0, 0.4), 2.0, 0.0)  # theta~ carries no weight at f = 0
    torch.testing.assert_close(A @ s + B @ xi, torch.tensor([theta, m], dtype=torch.float64), rtol=0, atol=1e-12)


def simulated_floor(a, f, blend=1.0, extrapolate=1.0, beta1=dm.BETA1, chains=256, steps=3000, burn=500, seed=0):
    """The variance of theta, from the scalar algorithm run as written (docs/algorithm.md's order: the estimate
    from theta_t and m_t, the commit from both parts' gradients), over independent chains."""
    g = torch.Generator().manual_seed(seed)
    k = 1.0 - beta1
    theta, m, est = (torch.zeros(chains, dtype=torch.float64) for _ in range(3))
    seen = []
    for t in range(steps):
        xi2 = torch.randn(chains, generator=g, dtype=torch.float64) / math.sqrt(1.0 - f)
        if f > 0:
            xi1 = torch.randn(chains, generator=g, dtype=torch.float64) / math.sqrt(f)
            g1 = est + xi1  # the first part, at the estimate, extrapolated to the update
            m_est = m + blend * k * (g1 - m)
            new_est = theta - extrapolate * a * m_est
            grad = f * g1 + (1.0 - f) * (theta + xi2)
        else:
            new_est, grad = theta, theta + xi2
        m = beta1 * m + k * grad
        theta = theta - a * m
        est = new_est
        if t >= burn:
            seen.append(theta)
    return float(torch.stack(seen).pow(2).mean())


@pytest.mark.parametrize("a, f, blend, extrapolate", [
    (5.0, 0.0, 1.0, 1.0),    # sync
    (5.0, 0.5, 1.0, 1.0),    # acco
    (10.0, 0.75, 1.0, 1.0),  # a later hand-off
    (2.0, 0.5, 0.5, 1.0),    # the momentum blend
    (5.0, 0.5, 1.0, 1.2),    # the extrapolated estimate
])
def test_the_noise_floor_is_the_simulated_algorithms(a, f, blend, extrapolate):
    model = dm.noise_floor(a, f, blend=blend, extrapolate=extrapolate)
    assert simulated_floor(a, f, blend, extrapolate) == pytest.approx(model, rel=0.05)


def test_sync_edge_is_heavy_balls_and_the_estimate_moves_it():
    beta1 = dm.BETA1
    assert dm.edge(0.0) == pytest.approx(2 * (1 + beta1) / (1 - beta1), rel=1e-6)
    assert dm.edge(0.5) == pytest.approx(20.0, abs=0.05)  # docs/algorithm.md's figures
    assert dm.edge(0.25) == pytest.approx(13.3, abs=0.05)
    assert dm.edge(0.75) == pytest.approx(38.0, abs=0.05)
    a = dm.edge(0.5, blend=0.5)
    assert dm.noise_floor(a * 0.99, 0.5, blend=0.5) < math.inf == dm.noise_floor(a * 1.01, 0.5, blend=0.5)


def test_a_bad_share_is_refused():
    with pytest.raises(ValueError, match="share of an update's micro-batches"):
        dm.matrices(1.0, 1.0)
