"""What an estimate round's Opt* costs: computed into the all-gather's input (acco.functional) or, as before,
the real step on a snapshot of the master slice and the optimizer state.

    .venv/bin/python benchmarks/estimate.py [--elements 8000000] [--repeats 7]

One process, one rank's slice of ``--elements`` fp32 values, AdamW with state;
times ``run_round(ESTIMATE, ...)`` (its collectives are local copies with one
process), the two ways interleaved (A B A B ...), and prints the median time of
each, the median and range of their ratio, and the scratch each keeps.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from acco import functional, rounds  # noqa: E402
from acco.stats import nbytes  # noqa: E402
from acco.wrapped import WrappedOptimizers  # noqa: E402


def build(n: int):
    master = torch.randn(n)
    grad = torch.randn(n)
    master.grad = grad
    opt = torch.optim.AdamW([master], lr=1e-3, weight_decay=0.1)
    opt.step()  # state exists, as in any round after the first
    buffers = rounds.ShardBuffers(
        comm=torch.randn(n), weights=torch.empty(n), master=master, grad=grad, count=torch.zeros(1),
        rank_counts=torch.zeros(1), row=torch.zeros(3, dtype=torch.float64), rows=torch.zeros(3, dtype=torch.float64))
    return buffers, opt


def one(buffers, opt, snapshot, use_functional: bool) -> float:
    real = functional.supports
    if not use_functional:
        functional.supports = lambda optimizer: False
    try:
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
        t0 = time.perf_counter()
        rounds.run_round(rounds.RoundContext(buffers, WrappedOptimizers.around(opt, buffers.master), None, snapshot),
                         rounds.RoundSpec(rounds.RoundKind.ESTIMATE, 2, 0.5, hyper))
        return time.perf_counter() - t0
    finally:
        functional.supports = real


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--elements", type=int, default=8_000_000)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    buffers, opt = build(args.elements)
    snapshot = rounds.OptimizerSnapshot()
    one(buffers, opt, snapshot, True), one(buffers, opt, snapshot, False)  # warm-up: scratch allocated
    times = {"functional": [], "snapshot": []}
    for _ in range(args.repeats):
        times["functional"].append(one(buffers, opt, snapshot, True))
        times["snapshot"].append(one(buffers, opt, snapshot, False))
    ratios = [s / f for f, s in zip(times["functional"], times["snapshot"])]
    mib = 1 << 20
    print(f"slice of {args.elements:,} fp32 elements, AdamW, {args.repeats} interleaved repeats, 1 thread")
    for k, v in times.items():
        print(f"  {k:10s} median {statistics.median(v) * 1e3:8.1f} ms   (min {min(v) * 1e3:.1f}, max {max(v) * 1e3:.1f})")
    print(f"  snapshot/functional time: median {statistics.median(ratios):.2f}, range {min(ratios):.2f}-{max(ratios):.2f}")
    print("  scratch kept: functional 0.0 MiB (written into the gradient slice it reads), "
          f"snapshot {nbytes(snapshot.tensors()) / mib:.1f} MiB (master + state copies)")


if __name__ == "__main__":
    main()
