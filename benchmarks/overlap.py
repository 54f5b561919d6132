"""Overlap sweep: tokens/s and utilisation of acco, dpu, sync, torch DDP and torch
DDP+ZeRO as the network gets slower, on the netns testbed (``netns.py``).

    sudo .venv/bin/python benchmarks/overlap.py --rates 400,200,100,67,50 --out runs/bench/overlap.jsonl
    .venv/bin/python benchmarks/report.py runs/bench/overlap.jsonl      # tables + plot

For every rate (Mbit/s per rank and direction) the same ranks run every method
once per repeat, the methods interleaved (A B C A B C ...: a noisy moment on a
shared machine hits one repeat of every method, not every repeat of one);
utilisation = tokens/s / compute-only tokens/s of the same repeat. Every record
carries its ``repeat``; ``report.py`` gives the median and min-max over repeats.
The testbed is built for the run and torn down after it. Needs root
(namespaces, tc); ``--loopback`` runs everything on 127.0.0.1 instead (no rate
limit, no root: what the CI smoke test does).

A method written ``acco:estimate-bf16@/tmp/old/src`` imports ``acco`` from that source tree (a ``git worktree``
of an older commit), so one sweep compares the library against itself across a change, interleaved.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _launch  # noqa: E402
import netns  # noqa: E402

DEFAULT_METHODS = "compute,acco,dpu,sync,ddp,ddp-zero"
SMOKE = ["--d-model", "64", "--layers", "2", "--seq-len", "32", "--micro-batch", "2", "--updates", "2", "--warmup", "1"]


def parse_args(argv=None, **defaults):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", default="400,200,100,67,50", help="Mbit/s, comma-separated")
    p.add_argument("--methods", default=DEFAULT_METHODS,
                   help="worker.py methods; 'acco:ring0' runs acco with ACCO_RING=0 (gloo's own collectives), "
                        "'acco:reduce-bf16' / 'acco:reduce-fp32' with that reduce_dtype, 'acco:estimate-bf16' with "
                        "estimate_dtype=torch.bfloat16, 'ddp-powersgd:rank32' PowerSGD at rank 32")
    p.add_argument("--repeats", type=int, default=3, help="runs of every method at every rate, interleaved")
    p.add_argument("--loop", choices=["awc", "update"], default="awc", help="worker.py --loop (library methods)")
    p.add_argument("--dtype", choices=["fp32", "bf16", "amp"], default="fp32", help="worker.py --dtype")
    p.add_argument("--optimizer", choices=["adamw", "muon"], default="adamw", help="worker.py --optimizer")
    p.add_argument("--model", default="", help="worker.py model options, e.g. '--d-model 128 --heads 4 --seq-len 64'")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--micro-batch", type=int, default=24)
    p.add_argument("--updates", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--slow-factor", type=float, default=2.0)
    p.add_argument("--loopback", action="store_true", help="no namespaces, no rate limit (no root needed)")
    p.add_argument("--smoke", action="store_true", help="a tiny model and 2 updates: checks the script runs")
    p.add_argument("--tag", default="overlap")
    p.add_argument("--out", type=Path, default=Path("runs/bench/overlap.jsonl"))
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    p.set_defaults(**defaults)
    return p.parse_args(argv)


def worker_args(args, method: str, variant: str = ""):
    base = SMOKE if args.smoke else ["--micro-batch", str(args.micro_batch), "--updates", str(args.updates),
                                     "--warmup", str(args.warmup)]
    reduce = ["--reduce-dtype", variant.split("-", 1)[1]] if variant.startswith("reduce-") else []
    reduce += ["--estimate-dtype", "bf16"] if variant == "estimate-bf16" else []
    reduce += ["--powersgd-rank", variant[4:]] if variant.startswith("rank") else []  # ddp-powersgd:rank32
    model = [] if args.smoke else args.model.split()
    return ["--method", method, *base, *model, "--slow-rank", str(args.slow_rank), "--slow-factor",
            str(args.slow_factor), "--loop", args.loop, "--dtype", args.dtype, "--optimizer", args.optimizer, *reduce]


def run_point(args, rate, repeat: int) -> list:
    """One repeat at one rate: every method once, in the order given."""
    records = []
    for spec in args.methods.split(","):
        name, _, src = spec.partition("@")  # "@path": this method imports acco from another source tree
        method, _, variant = name.partition(":")
        env = {"ACCO_RING": "0"} if variant == "ring0" else {}
        if src:
            env["PYTHONPATH"] = str(Path(src).resolve())
        t0 = time.time()
        rec = _launch.run_worker(worker_args(args, method, variant), args.ranks, args.loopback, env, args.timeout)
        rec.update(tag=args.tag, rate_mbit=rate, label=spec, repeat=repeat, wall_s=time.time() - t0)
        records.append(rec)
        s = rec.get("summary") or {}
        extra = f"  round {s['round_s'] * 1e3:.0f} ms  hidden {s['hidden']:.2f}" if s.get("rounds") else ""
        print(f"rate {rate} Mbit/s  repeat {repeat + 1}/{args.repeats}  {spec:10s} {rec['tokens_per_s']:9.0f} tokens/s"
              f"{extra}  ({rec['wall_s']:.0f} s)", flush=True)
    base = next((r["tokens_per_s"] for r in records if r["method"] == "compute"), None)
    for r in records:
        r["utilisation"] = r["tokens_per_s"] / base if base else None
    return records


def main(argv=None, **defaults) -> None:
    args = parse_args(argv, **defaults)
    _launch.check_loop(args.methods.split(","), args.loop)
    if not args.loopback and os.geteuid() != 0:
        sys.exit(f"{Path(sys.argv[0]).name} builds a network namespace per rank and rate-limits it with tc: "
                 "run it as root, or pass --loopback (no rate limit) to run without root.")
    rates = [None] if args.loopback else [float(x) for x in args.rates.split(",")]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if not args.loopback:
        netns.up(args.ranks, rates[0])
    try:
        with args.out.open("a") as f:
            for rate in rates:
                if rate is not None:
                    netns.set_rate(rate, args.ranks)
                for repeat in range(args.repeats):
                    for rec in run_point(args, rate, repeat):
                        f.write(json.dumps(rec) + "\n")
                        f.flush()
    finally:
        if not args.loopback:
            netns.down()


if __name__ == "__main__":
    main()
