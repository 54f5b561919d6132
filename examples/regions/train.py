"""ACCO inside each region, an outer step across regions every H updates (``docs/regions.md``).

    torchrun --nproc_per_node=4 examples/regions/train.py --regions 2 --every 10            # CPU, gloo
    torchrun --nproc_per_node=4 examples/regions/train.py --regions 2 --every 10 --delay 2 --outer-compression int8
    torchrun --nproc_per_node=4 examples/regions/train.py --every 0                         # flat ACCO, one region

The mesh is ``("region", "dp")``: ``AccoOptimizer`` runs its rounds on ``mesh["dp"]`` (the ranks of one region,
over the fast links) and its outer round on ``mesh["region"]`` (this rank's peers in the other regions, over the
slow link). Across two clusters, start one torchrun per cluster with ``--nnodes 2`` and the same rendezvous: the
first ``N`` ranks are the first region. The model is ``examples/gpt``'s byte-level GPT; every rank reads its own
batches. Rank 0 prints ``update N loss X`` (the mean over every rank) and, at the end, each region's held-out loss
and whether the regions hold the same weights (after an undelayed outer round at the last update they do).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpt"))
from data import eval_batches, load_corpus, sample_batch  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402

from acco import AccoOptimizer  # noqa: E402


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--regions", type=int, default=2, help="regions (the world splits into this many equal groups)")
    p.add_argument("--every", type=int, default=10, help="H: updates between outer rounds (0: one flat region)")
    p.add_argument("--delay", type=int, default=0, help="tau: updates the outer round runs behind (< H)")
    p.add_argument("--outer-lr", type=float, default=0.7)
    p.add_argument("--outer-momentum", type=float, default=0.9)
    p.add_argument("--outer-compression", default=None, choices=["int8", "int4", "fp8"])
    p.add_argument("--compression", default=None, choices=["int8", "int4", "fp8"], help="inside a region")
    p.add_argument("--mode", default="acco", choices=["acco", "dpu", "sync"])
    p.add_argument("--updates", type=int, default=40)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--data", default=None, help="a text file or folder (default: Python's standard library)")
    return p.parse_args(argv)


def main(argv) -> None:
    args = parse(argv)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = GPT(GPTConfig(seq_len=args.seq_len, d_model=args.dim, n_layers=args.layers, n_heads=2,
                          local_window=args.seq_len))
    if args.every:
        if world % args.regions:
            raise SystemExit(f"--regions {args.regions} does not divide the {world} ranks")
        mesh = init_device_mesh("cpu", (args.regions, world // args.regions), mesh_dim_names=("region", "dp"))
        placement = dict(process_group=mesh["dp"], outer_group=mesh["region"], outer_every=args.every,
                         outer_delay=args.delay, outer_lr=args.outer_lr, outer_momentum=args.outer_momentum,
                         outer_compression=args.outer_compression)
    else:
        placement = {}
    opt = AccoOptimizer(model.parameters(), mode=args.mode, microbatches_per_update=args.microbatches, lr=args.lr,
                        compression=args.compression, **placement)
    train, held = load_corpus(args.data)
    gen = torch.Generator().manual_seed(1000 + rank)
    for update in range(1, args.updates + 1):
        total = torch.zeros(1)
        for _ in range(args.microbatches):
            x, y = sample_batch(train, args.batch, args.seq_len, gen)
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten()) / args.microbatches
            loss.backward()
            total += loss.detach()
        opt.step()
        opt.zero_grad()
        dist.all_reduce(total)
        if rank == 0:
            print(f"update {update} loss {(total.item() / world)!r}", flush=True)
    opt.finish()  # the model holds its region's last committed weights
    with torch.no_grad():
        held_out = sum(F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item()
                       for x, y in eval_batches(held, 4, 8, args.seq_len)) / 4
        weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        spread = weights.clone()
        dist.all_reduce(spread, op=dist.ReduceOp.MAX)
        spread -= weights
        gap = spread.abs().max().reshape(1)
        dist.all_reduce(gap, op=dist.ReduceOp.MAX)
    losses = [None] * world
    dist.all_gather_object(losses, held_out)
    if rank == 0:
        per = world // (args.regions if args.every else 1)
        print("held-out loss by region: " + ", ".join(f"{losses[r * per]:.4f}" for r in range(world // per)))
        print(f"regions hold the same weights: {gap.item() == 0.0} (largest difference {gap.item():.3g})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
