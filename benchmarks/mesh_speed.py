"""Tokens/s of FSDP2-HSDP + AdamW (what users run today) against FSDP2 + ACCO across hosts, on the netns testbed:
two hosts of two ranks each, a fast link inside a host and a rate-limited one between hosts.

    sudo .venv/bin/python benchmarks/mesh_speed.py --calibrate          # loopback: compute time, bytes per round
    sudo .venv/bin/python benchmarks/netns.py up --ranks 2 --rate-mbit R  # one namespace per host
    sudo .venv/bin/python benchmarks/mesh_speed.py --rate-mbit R --repeats 3 --out runs/bench/mesh_speed.jsonl
    .venv/bin/python benchmarks/mesh_speed.py --loopback --smoke        # CI: the script runs

Each host is one namespace of ``benchmarks/netns.py`` (``acco-r0``, ``acco-r1``), holding a torchrun of two
ranks; the two ranks of a host talk over the namespace's own local route (not rate-limited), the hosts over
the veth pair and its token bucket. The model is examples/mesh/train.py's decoder, built on the meta device
and sharded by FSDP2 on ``mesh["shard"]`` (each host's two ranks). ``hsdp-adamw``: FSDP2 on the 2-D
``("dp", "shard")`` mesh (HSDP) and torch's AdamW, with ``set_requires_all_reduce(False)`` on all but each
update's last micro-batch, so the cross-host all-reduce runs once per update (its best case);
``fsdp2-acco``: FSDP2 on ``mesh["shard"]`` and ``AccoOptimizer(process_group=mesh["dp"])`` (mode acco, the
defaults: a bf16 estimate between hosts). Each run: 2 warm-up updates, then ``--updates`` timed ones; the
methods interleaved in every repeat; rank 0 records tokens/s (all ranks' tokens).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _launch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
METHODS = ["hsdp-adamw", "fsdp2-acco"]


def worker(args) -> None:
    """One rank of one method (under torchrun)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    sys.path.insert(0, str(ROOT / "src"))
    sys.path.insert(0, str(ROOT / "examples" / "mesh"))
    from train import Decoder, sharded_on_meta  # examples/mesh/train.py

    from acco import AccoOptimizer

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "shard"))
    torch.manual_seed(0)
    hsdp = args.worker == "hsdp-adamw"
    model = sharded_on_meta(lambda: Decoder(256, args.dim, args.layers, 4, args.seq_len),
                            mesh if hsdp else mesh["shard"])  # HSDP: FSDP2 on the 2-D mesh
    m = args.microbatches
    opt = (torch.optim.AdamW(model.parameters(), lr=1e-4) if hsdp else
           AccoOptimizer(model.parameters(), torch.optim.AdamW, microbatches_per_update=m, process_group=mesh["dp"],
                         lr=1e-4))
    g = torch.Generator().manual_seed(dist.get_rank())
    data = [torch.randint(256, (args.batch, args.seq_len + 1), generator=g) for _ in range(m)]

    def update() -> None:
        for j, x in enumerate(data):
            if hsdp:
                model.set_requires_all_reduce(j == m - 1)  # across hosts once per update
            (F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()) / m).backward()
        opt.step()
        opt.zero_grad()

    for _ in range(2):
        update()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(args.updates):
        update()
    if not hsdp:
        opt.finish()  # the last round's weights are in place: its time counts
    dist.barrier()
    elapsed = time.perf_counter() - t0
    local = sum(p._local_tensor.numel() for p in model.parameters())
    if dist.get_rank() == 0:
        tokens = args.updates * m * args.batch * args.seq_len * dist.get_world_size()
        Path(args.out).write_text(json.dumps({
            "method": args.worker, "tokens_per_s": tokens / elapsed, "s_per_update": elapsed / args.updates,
            "params": sum(p.numel() for p in model.parameters()), "local_params": local}))
    dist.destroy_process_group()


def commands(worker_args, loopback: bool):
    """One torchrun per host: loopback, one torchrun of 4; else one per namespace, 2 ranks each."""
    return _launch.two_hosts([str(Path(__file__).resolve()), *worker_args], loopback)


def one_run(method: str, args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "record.json"
        wargs = ["--worker", method, "--dim", str(args.dim), "--layers", str(args.layers), "--batch", str(args.batch),
                 "--seq-len", str(args.seq_len), "--microbatches", str(args.microbatches), "--updates",
                 str(args.updates), "--out", str(out)]
        logs, failed = _launch.run_processes(commands(wargs, args.loopback), timeout=900)
        if failed or not out.exists():
            raise RuntimeError(f"{method} failed:\n" + "\n".join(t[-3000:] for t in logs))
        return json.loads(out.read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", choices=METHODS, help=argparse.SUPPRESS)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--updates", type=int, default=6)
    _launch.testbed_options(p, "loopback, fsdp2-acco once: compute time and bytes", "tiny model, one repeat, loopback")
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    if args.smoke:
        args.dim, args.layers, args.batch, args.seq_len, args.updates, args.repeats = 32, 2, 1, 16, 2, 1
        args.loopback = True
    if args.calibrate:
        args.loopback = True
        r = one_run("fsdp2-acco", args)
        # A round across 2 hosts: reduce-scatter and all-gather of the local shard, half of it each way
        # (fp32; the default's estimate round in bf16, half that).
        round_bytes = 2 * 4 * r["local_params"] / 2
        per_update_bits = 1.5 * round_bytes * 8  # the commit's fp32 round and the estimate's bf16 one
        rate = per_update_bits / (r["s_per_update"] / 2) / 1e6  # the rounds take half an update
        print(f"loopback fsdp2-acco: {r['s_per_update']:.3f} s per update, {r['local_params'] / 1e6:.2f}M local "
              f"parameters: the rounds take half an update at about {rate:.0f} Mbit/s")
        return
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for rep in range(args.repeats):
        for method in METHODS:  # interleaved
            r = one_run(method, args)
            r.update(repeat=rep, rate_mbit=None if args.loopback else args.rate_mbit, loopback=args.loopback)
            rows.append(r)
            _launch.record_row(r, args.out)
    _launch.print_speedup(rows, METHODS, "fsdp2-acco", "hsdp-adamw")

if __name__ == "__main__":
    main()
