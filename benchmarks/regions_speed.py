"""Tokens/s across two regions (issue 80): two namespaces of two ranks each, the ranks of a region on the
namespace's own route (fast), the regions over one rate-limited link (slow), against DDP, flat ACCO + int8 and
the same 4 ranks without any communication.

    sudo .venv/bin/python benchmarks/regions_speed.py --calibrate        # loopback: compute time, the rate for x
    sudo .venv/bin/python benchmarks/netns.py up --ranks 2 --rate-mbit R  # one namespace per region
    sudo .venv/bin/python benchmarks/regions_speed.py --rate-mbit R --repeats 3 --out runs/bench/regions.jsonl
    .venv/bin/python benchmarks/regions_speed.py --loopback --smoke      # CI: the script runs

Each region is one namespace of ``benchmarks/netns.py`` (``acco-r0``, ``acco-r1``) holding a torchrun of two
ranks (``_launch.two_hosts``). The model is ``examples/gpt``'s byte-level GPT, 2 micro-batches per update, AdamW.
Methods, interleaved in every repeat:

- ``compute-only``: each rank trains alone (torch's AdamW, no collective in the timed window);
- ``ddp``: ``DistributedDataParallel`` over the 4 ranks, ``no_sync`` on the first micro-batch (one fp32
  all-reduce per update);
- ``acco-int8``: ``AccoOptimizer(compression="int8")`` over the 4 ranks (flat ACCO);
- ``region-only``: ``AccoOptimizer`` inside each region and nothing across (what the regions' own rounds cost
  on this machine, the ceiling of ``regions-hH``);
- ``regions-hH``: ``AccoOptimizer`` inside each region (the default, fp32 over the fast route), an outer round
  every ``H`` updates over the slow link, its pseudo-gradient in int8 (``outer_compression``) and merged
  ``min(--delay, H - 1)`` updates after its launch;
- ``torchft-hH`` (with ``--torchft-python``, an interpreter with torchft installed): torchft's ``DiLoCo`` as its
  tests run it, each region a replica group (its own torchrun; DDP over its two ranks, torch's AdamW inside), a
  ``Manager`` per rank (gloo across regions, synchronous quorum, ``init_sync=False``: every rank starts from one
  seed), the lighthouse in the first region, DiLoCo's outer SGD 0.7 / Nesterov 0.9 every ``H`` updates; fp32
  pseudo-gradients (its 8-bit path is triton's, GPU only), ``fragment_sync_delay`` 0. It warms up ``H`` updates
  (one sync aligns the regions) and times ``2H`` (whole periods); rank 0 of the first region records.

After 2 warm-up updates, ``ddp`` and ``acco-int8`` time ``--updates`` updates, ``regions-hH`` whole outer periods
of at least 60 updates (its last round, in flight at ``finish()``, is waited for), the others 60. Rank 0 records
tokens/s (every rank's tokens). No delay line: this kernel has no ``netem`` (``netns.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _launch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
METHODS = ["compute-only", "region-only", "ddp", "acco-int8", "regions-h10", "regions-h30", "regions-h100"]
TORCHFT = ["torchft-h10", "torchft-h30", "torchft-h100"]  # with --torchft-python: torchft's DiLoCo, same H
LIGHTHOUSE_PORT = 29510


def timed_updates(method: str, per_update: int) -> int:
    """Updates in a run's timed window: ``per_update`` for the methods bound by the slow link (DDP, flat ACCO),
    whole outer periods (at least 60 updates) for ``regions-hH``, 60 for the others."""
    if method.startswith("regions-h"):
        every = int(method[len("regions-h"):])
        return max(2 * every, -(-60 // every) * every)
    return per_update if method in ("ddp", "acco-int8") else 60


def torchft_worker(args) -> None:
    """One rank of torchft's DiLoCo (under one region's torchrun, in torchft's interpreter)."""
    import datetime
    import os

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel
    from torchft._torchft import LighthouseServer
    from torchft.local_sgd import DiLoCo
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    sys.path.insert(0, str(ROOT / "examples" / "gpt"))
    from model import GPT, GPTConfig  # examples/gpt/model.py

    dist.init_process_group("gloo")  # this region's ranks
    rank, region, every = dist.get_rank(), args.region, int(args.worker[len("torchft-h"):])
    host = "127.0.0.1" if args.loopback else f"10.77.0.{region + 1}"
    first = "127.0.0.1" if args.loopback else "10.77.0.1"
    lighthouse = LighthouseServer(bind=f"[::]:{LIGHTHOUSE_PORT}", min_replicas=2) if region == rank == 0 else None
    minutes = datetime.timedelta(minutes=10)
    manager = Manager(pg=ProcessGroupGloo(timeout=minutes), load_state_dict=None, state_dict=None, min_replica_size=2,
                      use_async_quorum=False, init_sync=False, replica_id=f"region{region}", rank=rank,
                      world_size=dist.get_world_size(), store_addr=os.environ["MASTER_ADDR"],
                      store_port=int(os.environ["MASTER_PORT"]), lighthouse_addr=f"http://{first}:{LIGHTHOUSE_PORT}",
                      hostname=host, timeout=minutes, quorum_timeout=minutes, connect_timeout=minutes)
    torch.manual_seed(0)
    model = GPT(GPTConfig(seq_len=args.seq_len, d_model=args.dim, n_layers=args.layers, n_heads=4,
                          local_window=args.seq_len))
    ddp = DistributedDataParallel(model)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-4)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    m = args.microbatches
    g = torch.Generator().manual_seed(100 * region + rank)
    data = [torch.randint(256, (args.batch, args.seq_len + 1), generator=g) for _ in range(m)]

    def update() -> None:
        for j, x in enumerate(data):
            quiet = ddp.no_sync() if j < m - 1 else contextlib.nullcontext()
            with quiet:
                (F.cross_entropy(ddp(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()) / m).backward()
        inner.step()
        inner.zero_grad()

    with DiLoCo(manager, [model], inner, outer, sync_every=every, backup_device=torch.device("cpu"),
                pin_memory=False):
        for _ in range(every):  # one sync at the end: the regions start the timed window together
            update()
        n = 2 * every
        t0 = time.perf_counter()
        for _ in range(n):
            update()
        elapsed = time.perf_counter() - t0
    if rank == 0 and region == 0:
        tokens = n * m * args.batch * args.seq_len * 2 * dist.get_world_size()
        Path(args.out).write_text(json.dumps({
            "method": args.worker, "tokens_per_s": tokens / elapsed, "s_per_update": elapsed / n, "updates": n,
            "params": sum(p.numel() for p in model.parameters())}))
    manager.shutdown(wait=False)
    if lighthouse is not None:
        lighthouse.shutdown()
    dist.destroy_process_group()


def torchft_commands(script, loopback: bool, python: str):
    """One torchrun per region (a replica group of its own), each in its namespace (or on loopback)."""
    out = []
    for k in range(2):
        run = [python, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2", "--node-rank", "0",
               "--master-port", str(29400 + k)]
        if loopback:
            out.append(run + ["--master-addr", "127.0.0.1", *script, "--region", str(k)])
        else:
            out.append(_launch.netns.exec_prefix(k) + ["env", f"GLOO_SOCKET_IFNAME={_launch.netns.IFACE}"] + run
                       + ["--master-addr", _launch.netns.rank_addr(k), *script, "--region", str(k)])
    return out


def worker(args) -> None:
    """One rank of one method (under torchrun)."""
    if args.worker.startswith("torchft"):
        torchft_worker(args)
        return
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel

    sys.path.insert(0, str(ROOT / "src"))
    sys.path.insert(0, str(ROOT / "examples" / "gpt"))
    from model import GPT, GPTConfig  # examples/gpt/model.py

    from acco import AccoOptimizer

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("region", "dp"))
    torch.manual_seed(0)
    model = GPT(GPTConfig(seq_len=args.seq_len, d_model=args.dim, n_layers=args.layers, n_heads=4,
                          local_window=args.seq_len))
    method, m = args.worker, args.microbatches
    step_model = model
    if method == "ddp":
        step_model = DistributedDataParallel(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    elif method == "compute-only":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    elif method == "acco-int8":
        opt = AccoOptimizer(model.parameters(), microbatches_per_update=m, compression="int8", lr=1e-4)
    elif method == "region-only":
        opt = AccoOptimizer(model.parameters(), microbatches_per_update=m, process_group=mesh["dp"], lr=1e-4)
    else:
        every = int(method[len("regions-h"):])
        opt = AccoOptimizer(model.parameters(), microbatches_per_update=m, process_group=mesh["dp"],
                            outer_group=mesh["region"], outer_every=every, outer_delay=min(args.delay, every - 1),
                            outer_compression="int8", lr=1e-4)
    g = torch.Generator().manual_seed(dist.get_rank())
    data = [torch.randint(256, (args.batch, args.seq_len + 1), generator=g) for _ in range(m)]

    def update() -> None:
        for j, x in enumerate(data):
            quiet = step_model.no_sync() if method == "ddp" and j < m - 1 else contextlib.nullcontext()
            with quiet:
                (F.cross_entropy(step_model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()) / m).backward()
        opt.step()
        opt.zero_grad()

    for _ in range(2):
        update()
    dist.barrier()
    n = timed_updates(method, args.updates)
    t0 = time.perf_counter()
    for _ in range(n):
        update()
    if hasattr(opt, "finish"):
        opt.finish()  # the last rounds' weights are in place (and the last outer round ended): their time counts
    dist.barrier()
    elapsed = time.perf_counter() - t0
    # after the timed window: the outer state per rank, and the master slice beside it (the buffers outlive finish)
    memory = opt.memory_report() if hasattr(opt, "finish") else {}
    if dist.get_rank() == 0:
        tokens = n * m * args.batch * args.seq_len * dist.get_world_size()
        Path(args.out).write_text(json.dumps({
            "method": method, "tokens_per_s": tokens / elapsed, "s_per_update": elapsed / n, "updates": n,
            "params": sum(p.numel() for p in model.parameters()),
            **({"outer_bytes": memory.get("outer", 0), "master_bytes": memory["master"]} if hasattr(opt, "finish")
               else {})}))
    dist.destroy_process_group()


def one_run(method: str, args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "record.json"
        wargs = ["--worker", method, "--dim", str(args.dim), "--layers", str(args.layers), "--batch", str(args.batch),
                 "--seq-len", str(args.seq_len), "--microbatches", str(args.microbatches), "--updates",
                 str(args.updates), "--delay", str(args.delay), "--out", str(out)]
        script = [str(Path(__file__).resolve()), *wargs]
        if method.startswith("torchft"):
            cmds = torchft_commands(script + (["--loopback"] if args.loopback else []), args.loopback,
                                    args.torchft_python)
        else:
            cmds = _launch.two_hosts(script, args.loopback)
        logs, failed = _launch.run_processes(cmds, timeout=1800)
        if failed or not out.exists():
            raise RuntimeError(f"{method} failed:\n" + "\n".join(t[-3000:] for t in logs))
        return json.loads(out.read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", choices=METHODS + TORCHFT, help=argparse.SUPPRESS)
    p.add_argument("--region", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--methods", nargs="+", choices=METHODS + TORCHFT, default=METHODS)
    p.add_argument("--torchft-python", default=None,
                   help="an interpreter with torchft installed (docs/studies/torchft-diloco.md): for torchft-hH")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--updates", type=int, default=6, help="timed updates of the per-update methods")
    p.add_argument("--delay", type=int, default=8, help="outer_delay of regions-hH (at most H - 1)")
    _launch.testbed_options(p, "loopback, compute-only once: the rate for x = 50",
                            "tiny model, one repeat, loopback, H = 10 only")
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    if any(m in TORCHFT for m in args.methods) and not args.torchft_python:
        p.error("the torchft-hH methods need --torchft-python (an interpreter with torchft installed)")
    if args.smoke:
        args.dim, args.layers, args.batch, args.seq_len, args.updates, args.repeats = 32, 1, 1, 16, 2, 1
        args.loopback, args.methods = True, ["compute-only", "region-only", "ddp", "acco-int8", "regions-h10"]
    if args.calibrate:
        args.loopback = True
        r = one_run("compute-only", args)
        # x: the model's fp32 bytes once over the link, over half an update's compute
        bits = 4 * r["params"] * 8
        for x in (10, 50, 100):
            print(f"x = {x}: {bits / (x * r['s_per_update'] / 2) / 1e6:.1f} Mbit/s")
        print(f"compute-only: {r['s_per_update']:.3f} s per update, {r['params'] / 1e6:.2f}M parameters")
        return
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for rep in range(args.repeats):
        for method in args.methods:  # interleaved
            r = one_run(method, args)
            r.update(repeat=rep, rate_mbit=None if args.loopback else args.rate_mbit, loopback=args.loopback,
                     delay=args.delay)
            rows.append(r)
            _launch.record_row(r, args.out)
    if "compute-only" in args.methods:
        for method in args.methods:
            _launch.print_speedup(rows, [], method, "compute-only")


if __name__ == "__main__":
    main()
