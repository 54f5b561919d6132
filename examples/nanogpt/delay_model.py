"""The delay's linear model: what ACCO's estimate does to the largest stable step and to the noise floor.

    python examples/nanogpt/delay_model.py        # the tables of docs/algorithm.md and docs/studies/time-to-target.md

One direction of the loss with curvature ``H``; the wrapped optimizer taken
as heavy-ball momentum ``beta1`` with a fixed preconditioner ``P`` (AdamW
with its second moment frozen), and ``a = lr * P * H``. Each update has ``M``
micro-batches; the first ``f = h / M`` of them are computed at the estimate
``theta~``, the rest at ``theta`` (``docs/algorithm.md``, mode acco); ``f =
0`` is mode sync. A micro-batch's gradient at ``x`` is ``H x`` plus noise,
independent between micro-batches; the unit of variance is that of a whole
update's mean gradient, so the first part's mean carries noise of variance
``1/f`` and the rest ``1/(1 - f)``. With ``theta`` measured from the
minimum, one update is linear in the state ``s = (theta, m, theta~)`` and the
noise ``xi = (xi_1, xi_2)``: ``s' = A s + B xi``.

* the estimate: ``m~ = m + w (1 - beta1) (g_1 - m)``, ``theta~' = theta - c a m~``,
  with ``g_1 = theta~ + xi_1`` (the first part, extrapolated to the update);
  ``w = 1, c = 1`` is ACCO's ``Opt*``; ``w < 1`` blends in the momentum
  (``w = 0``: the momentum-only prediction) and ``c > 1`` extrapolates the
  estimate's step: the candidates of instrument.py's ``--estimate-blend`` and
  the library's ``estimate_extrapolation`` (``--acco-option=estimate_extrapolation=C``);
* the commit: ``m' = beta1 m + (1 - beta1) (f g_1 + (1 - f) g_2)``,
  ``theta' = theta - a m'``, with ``g_2 = theta + xi_2``.

The model gives three numbers for a setting: the **edge**, the largest ``a``
whose spectral radius stays below 1 (sync: ``2 (1 + beta1) / (1 - beta1)``);
the **rate**, the spectral radius at a given ``a`` (how fast the noiseless
error shrinks per update); and the **noise floor**, the stationary variance
of ``theta`` (so of the loss above the minimum), from the discrete Lyapunov
equation ``S = A S A^T + B Q B^T``, as a multiple of sync's at the same
``a``. A floor below sync's is no gain by itself if the rate is slower (a
smaller step lowers both). The model knows nothing of Adam's changing
preconditioner, of curvature that changes under the step, of when in a run
the noise matters, or of the bf16 rounding of the estimate: it compares
candidates before any CPU-hour is spent on them; the time-to-target study
judges them.
"""

from __future__ import annotations

import argparse
import math
from typing import Tuple

import torch

__all__ = ["edge", "matrices", "noise_floor", "spectral_radius"]

BETA1 = 0.9  # AdamW's default, the studies' setting


def matrices(a: float, f: float, beta1: float = BETA1, blend: float = 1.0,
             extrapolate: float = 1.0) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(A, B, Q)`` of one update, ``s' = A s + B xi`` with ``s = (theta, m, theta~)`` (sync, ``f = 0``:
    ``(theta, m)``) and ``xi``'s covariance ``Q``; ``f`` the share of micro-batches at ``theta~``, ``blend``
    ``w``, ``extrapolate`` ``c``."""
    if not 0.0 <= f < 1.0:
        raise ValueError(f"f is the share of an update's micro-batches before the estimate, in [0, 1); got {f}")
    k = 1.0 - beta1
    # the commit's momentum: beta1 m + k (f theta~ + (1 - f) theta) + k (f xi_1 + (1 - f) xi_2)
    m_row = torch.tensor([k * (1 - f), beta1, k * f], dtype=torch.float64)
    m_noise = torch.tensor([k * f, k * (1 - f)], dtype=torch.float64)
    # the estimate's momentum: m + w k (theta~ + xi_1 - m)
    e_row = torch.tensor([0.0, 1.0 - blend * k, blend * k], dtype=torch.float64)
    e_noise = torch.tensor([blend * k, 0.0], dtype=torch.float64)
    first = torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64)
    A = torch.stack([first - a * m_row, m_row, first - extrapolate * a * e_row])
    B = torch.stack([-a * m_noise, m_noise, -extrapolate * a * e_noise])
    Q = torch.diag(torch.tensor([1.0 / f if f > 0 else 0.0, 1.0 / (1.0 - f)], dtype=torch.float64))
    if f == 0:  # sync: no gradient is taken at theta~, which is then no part of the state
        return A[:2, :2], B[:2], Q
    return A, B, Q


def spectral_radius(A: torch.Tensor) -> float:
    """The largest modulus of ``A``'s eigenvalues: the recurrence is stable below 1."""
    return float(torch.linalg.eigvals(A).abs().max())


def edge(f: float, beta1: float = BETA1, blend: float = 1.0, extrapolate: float = 1.0,
         top: float = 200.0, steps: int = 4000) -> float:
    """The largest stable ``a``, as the first unstable point of a grid of ``steps`` points up to ``top``,
    refined by bisection (``top`` if none is unstable; an unstable window narrower than the grid is missed)."""
    def stable(a: float) -> bool:
        return spectral_radius(matrices(a, f, beta1, blend, extrapolate)[0]) < 1.0

    lo = 0.0
    for i in range(1, steps + 1):
        hi = top * i / steps
        if not stable(hi):
            break
        lo = hi
    else:
        return top
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if stable(mid) else (lo, mid)
    return lo


def noise_floor(a: float, f: float, beta1: float = BETA1, blend: float = 1.0, extrapolate: float = 1.0) -> float:
    """The stationary variance of ``theta`` (units: a whole update's gradient noise), ``inf`` if unstable."""
    A, B, Q = matrices(a, f, beta1, blend, extrapolate)
    if spectral_radius(A) >= 1.0:
        return math.inf
    n = A.shape[0]
    rhs = (B @ Q @ B.T).reshape(-1)
    S = torch.linalg.solve(torch.eye(n * n, dtype=torch.float64) - torch.kron(A, A), rhs).reshape(n, n)
    return float(S[0, 0])


CANDIDATES = (  # (label, f, blend, extrapolate)
    ("sync", 0.0, 1.0, 1.0),
    ("acco (h = M/2)", 0.5, 1.0, 1.0),
    ("h = M/4", 0.25, 1.0, 1.0),
    ("h = 3M/4", 0.75, 1.0, 1.0),
    ("blend 0.75", 0.5, 0.75, 1.0),
    ("blend 0.5", 0.5, 0.5, 1.0),
    ("blend 0 (momentum only)", 0.5, 0.0, 1.0),
    ("extrapolate 1.1", 0.5, 1.0, 1.1),
    ("extrapolate 1.2", 0.5, 1.0, 1.2),
    ("extrapolate 1.5", 0.5, 1.0, 1.5),
)


def table(points=(1.0, 2.0, 5.0, 10.0, 15.0), rate_at: float = 0.1) -> str:
    """Markdown: each candidate's edge, its rate at ``rate_at`` (a flat direction: where most of the progress
    is made), and its noise floor over sync's at each of ``points``."""
    head = (f"| setting | edge (largest stable a) | rate at a = {rate_at:g} | "
            + " | ".join(f"noise floor / sync's, a = {a:g}" for a in points))
    lines = [head + " |", "|---" * (3 + len(points)) + "|"]
    for label, f, w, c in CANDIDATES:
        cells = []
        for a in points:
            floor = noise_floor(a, f, blend=w, extrapolate=c)
            cells.append("unstable" if math.isinf(floor) else f"{floor / noise_floor(a, 0.0):.3f}")
        rate = spectral_radius(matrices(rate_at, f, blend=w, extrapolate=c)[0])
        lines.append(f"| {label} | {edge(f, blend=w, extrapolate=c):.1f} | {rate:.4f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    print(f"beta1 = {BETA1}; sync's edge 2(1 + beta1)/(1 - beta1) = {2 * (1 + BETA1) / (1 - BETA1):.1f}")
    print(table())
