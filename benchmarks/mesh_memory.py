"""Memory per rank on a (2, 2) mesh: FSDP2-HSDP + AdamW (what users run today) against FSDP2 + ACCO across hosts,
and against ACCO alone over the 4 ranks (no FSDP2).

    .venv/bin/python benchmarks/mesh_memory.py --repeats 2 --out runs/bench/mesh_memory.jsonl
    .venv/bin/python benchmarks/mesh_memory.py --smoke          # tiny model (CI: the script runs)

The model is examples/mesh/train.py's decoder (``--dim 512 --layers 8``: 33.6M parameters, fp32), 4 micro-batches
of one 64-token sequence per update, 3 updates. Each method runs under torchrun on 4 CPU ranks (gloo) in fresh
processes, the methods interleaved in every repeat. FSDP2's models are built on the meta device, sharded, then
materialised (``to_empty`` and ``reset_parameters``), as torchtitan does, so that no rank ever holds the whole
model; ACCO alone builds the whole model, which it keeps on every rank.

Per rank: ``peak_rss`` is ``ru_maxrss`` at the end less the resident memory after ``init_process_group`` and
the mesh (the interpreter, torch, gloo), and ``built_rss`` the same once the model and the optimizer are made
(before the first micro-batch); ``expected`` is what the method's own buffers must take: for AdamW under FSDP2,
the sharded parameters, gradients and AdamW's two moments (4 x 4 bytes per local element); for ACCO, the local
parameters plus ``memory_report()["library_total"]`` (docs/algorithm.md's table). Activations, FSDP2's
unsharded layer and allocator slack come on top.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
METHODS = ["hsdp-adamw", "fsdp2-acco", "acco"]


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def worker(method: str, dim: int, layers: int, out: str) -> None:
    """One rank of one method (under torchrun): train 3 updates, append this rank's figures to ``out``."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    sys.path.insert(0, str(ROOT / "src"))
    sys.path.insert(0, str(ROOT / "examples" / "mesh"))
    from train import Decoder, sharded_on_meta  # examples/mesh/train.py

    from acco import AccoOptimizer

    import torch._dynamo  # noqa: F401  (torch.optim's first step imports it: not the method's memory)

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "shard"))
    base = _rss()
    torch.manual_seed(0)
    seq, m = 64, 4
    if method == "acco":
        model = Decoder(256, dim, layers, 8, seq)
        opt = AccoOptimizer(model.parameters(), torch.optim.AdamW, microbatches_per_update=m, lr=1e-4)
    else:
        shard_mesh = mesh if method == "hsdp-adamw" else mesh["shard"]  # HSDP: FSDP2 reduces across hosts too
        model = sharded_on_meta(lambda: Decoder(256, dim, layers, 8, seq), shard_mesh)
        if method == "hsdp-adamw":
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        else:
            opt = AccoOptimizer(model.parameters(), torch.optim.AdamW, microbatches_per_update=m,
                                process_group=mesh["dp"], lr=1e-4)
    built = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base  # the model and optimizer made
    local = sum((p._local_tensor if hasattr(p, "_local_tensor") else p).numel() for p in model.parameters())
    total = sum(p.numel() for p in model.parameters())
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(3):
        for _ in range(m):
            x = torch.randint(256, (1, seq + 1), generator=g)
            (F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()) / m).backward()
        opt.step()
        opt.zero_grad()
    if method == "hsdp-adamw":
        expected = 4 * 4 * local  # sharded parameters, gradients, exp_avg, exp_avg_sq (fp32)
        library = None
    else:
        report = opt.memory_report()
        library = report["library_total"]
        expected = 4 * local + library
        opt.finish()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    row = {"method": method, "rank": dist.get_rank(), "params": total, "local_params": local,
           "peak_rss": peak, "built_rss": built, "expected": expected, "library_total": library}
    with open(out, "a") as f:
        f.write(json.dumps(row) + "\n")
    dist.destroy_process_group()


def launch(method: str, dim: int, layers: int, out: str) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4", __file__,
           "--worker", method, "--dim", str(dim), "--layers", str(layers), "--out", out]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(cmd, check=True, timeout=900, env=env, stdout=subprocess.DEVNULL)


def table(rows) -> str:
    mib = 2 ** 20
    lines = ["| method | parameters (local per rank) | expected per rank, MiB | peak RSS once built, MiB | peak RSS per rank, MiB (median over ranks and repeats; range) | peak / expected |",
             "|---|---|---|---|---|---|"]
    for method in METHODS:
        mine = [r for r in rows if r["method"] == method]
        if not mine:
            continue
        peaks = [r["peak_rss"] / mib for r in mine]
        exp = statistics.median(r["expected"] for r in mine) / mib
        lines.append(f"| {method} | {mine[0]['params'] / 1e6:.1f}M ({statistics.median(r['local_params'] for r in mine) / 1e6:.1f}M) "
                     f"| {exp:.0f} | {statistics.median(r['built_rss'] for r in mine) / mib:.0f} "
                     f"| {statistics.median(peaks):.0f} ({min(peaks):.0f}–{max(peaks):.0f}) "
                     f"| {statistics.median(peaks) / exp:.2f} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", choices=METHODS, help=argparse.SUPPRESS)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--smoke", action="store_true", help="a tiny model, one repeat")
    p.add_argument("--out", default=None, help="JSON lines, one per rank and run (appended)")
    args = p.parse_args()
    if args.worker:
        worker(args.worker, args.dim, args.layers, args.out)
        return
    if args.smoke:
        args.dim, args.layers, args.repeats = 32, 2, 1
    out = args.out or os.path.join(tempfile.mkdtemp(), "mesh_memory.jsonl")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    start = sum(1 for _ in open(out)) if os.path.exists(out) else 0
    for _ in range(args.repeats):
        for method in METHODS:  # interleaved
            launch(method, args.dim, args.layers, out)
    rows = [json.loads(line) for line in open(out).read().splitlines()[start:]]
    print(table(rows))


if __name__ == "__main__":
    main()
