"""A round's collectives on the rate-limited testbed: gloo's own against the ring ones.

    sudo .venv/bin/python benchmarks/collectives.py --rate-mbit 200 --out runs/bench/collectives.json

Times, on the flat buffer of the benchmarks' GPT (3.26M fp32 elements, 13 MB)
and 2 ranks: gloo's ``reduce_scatter_tensor`` (an all-reduce inside) and
``all_gather_into_tensor``, the library's ``ring_reduce_scatter`` and
``ring_all_gather``, an all-reduce, and a one-way send of one rank's half (the
link's limit for either collective: each rank must send half the buffer).
Needs root for the testbed; ``--loopback`` runs without it (no rate limit).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


def measure(numel: int, repeats: int) -> dict:
    import torch
    import torch.distributed as dist

    import acco
    from acco import collectives as C

    acco.init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    numel -= numel % world
    flat, out = torch.randn(numel), torch.empty(numel // world)
    world_group = dist.group.WORLD

    def one_way():
        if rank == 0:
            dist.send(out, 1)
        elif rank == 1:
            dist.recv(out, 0)

    cases = {
        "reduce_scatter gloo": lambda: C.reduce_scatter_flat(out, flat, world_group, "native"),
        "reduce_scatter ring": lambda: C.reduce_scatter_flat(out, flat.clone(), world_group, "ring"),
        "all_gather gloo": lambda: C.all_gather_flat(flat, out, world_group, "native"),
        "all_gather ring": lambda: C.all_gather_flat(flat, out, world_group, "ring"),
        "all_reduce gloo": lambda: dist.all_reduce(flat),
        "send 1/N one way": one_way,
    }
    result = {"numel": numel, "bytes": numel * 4, "world": world}
    for name, fn in cases.items():
        fn()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        dist.barrier()
        result[name] = (time.perf_counter() - t0) / repeats
    dist.destroy_process_group()
    return result


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--numel", type=int, default=3257856)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--rate-mbit", type=float, default=200.0)
    p.add_argument("--loopback", action="store_true")
    p.add_argument("--out", type=Path, default=Path("runs/bench/collectives.json"))
    args = p.parse_args(argv)
    if "RANK" in os.environ:  # a rank, launched by the driver below
        result = measure(args.numel, args.repeats)
        if int(os.environ["RANK"]) == 0:
            args.out.write_text(json.dumps(result))
        return
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import _launch
    import netns

    if not args.loopback and os.geteuid() != 0:
        sys.exit("collectives.py builds a network namespace per rank and rate-limits it with tc: run it as root, "
                 "or pass --loopback (no rate limit) to run without root.")
    if not args.loopback:
        netns.up(2, args.rate_mbit)
    try:
        rec = _launch.run_worker(["--numel", str(args.numel), "--repeats", str(args.repeats)], 2, args.loopback,
                                 script=Path(__file__).resolve())
    finally:
        if not args.loopback:
            netns.down()
    rec["rate_mbit"] = None if args.loopback else args.rate_mbit
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rec, indent=1))
    for key, value in rec.items():
        if isinstance(value, float) and key != "rate_mbit":
            print(f"{key:22s} {value * 1e3:8.1f} ms")


if __name__ == "__main__":
    main()
