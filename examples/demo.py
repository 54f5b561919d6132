"""What ACCO buys, in about a minute on 2 CPU cores: `make demo`.

    torchrun --standalone --nproc_per_node=2 examples/demo.py [--updates 30] [--link-share 0.5]

Two ranks train the same small GPT on byte-level text (the Python standard library's sources) with the same
data, the same initial weights and the same AdamW settings, one method after the other:

* ``ddp``:  torch ``DistributedDataParallel`` + AdamW (what most loops run today);
* ``sync``: ``AccoOptimizer(mode="sync")``, plain ZeRO-1: reduce-scatter, sharded step, all-gather, then compute;
* ``acco``: ``AccoOptimizer()``: the same rounds, run while the next micro-batches compute (with its default
  ``estimate_dtype="auto"``, the estimate round travels in bf16: half its bytes);
* ``acco-int8``: ``AccoOptimizer(compression="int8")``: those rounds in 8-bit blocks both ways, with error
  feedback (``docs/compression.md``): about a quarter of the bytes, for the links slower than the compute.

**The link is simulated**, the same way for every method: before each collective of the gradients or weights
the sending thread sleeps ``bytes / bandwidth``, where ``bytes`` is what that collective moves per rank (ring
all-reduce ``2 (N-1)/N x size``; reduce-scatter and all-gather ``(N-1)/N x size`` each). The bandwidth is set
from a first, compute-only run so that one round (or one DDP all-reduce) lasts ``--link-share`` of an update's
compute: the situation of a cluster whose network is slower than its GPUs. ``--link-mbit`` fixes it instead.
Run as root with ``ip netns``, ``sudo make bench`` runs the real testbed (network namespaces behind ``tc``).
``make demo`` runs it twice: at ``--link-share 0.5`` (a round lasts half an update's compute: the plain rounds
hide) and at ``--link-share 3`` (the slow link: three times the compute, where only compressed rounds keep up).

The last column is each method's time to DDP's final training loss: the first update at which the method's
training loss (the mean over the ranks, smoothed by a running mean over a tenth of the run) is at or below DDP's
smoothed loss at its last update, and the wall time at that update; or "not reached" when it never gets there
within the run. Every method trains on the same batches in the same order, so the curves compare update for update.

Every number of the table is computed from ``OUT/records.jsonl``, which this run writes; the plot is
``OUT/loss_vs_time.png``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import queue
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "gpt"))
from data import eval_batches, load_corpus, sample_batch  # noqa: E402
from model import GPTConfig, build_model  # noqa: E402

import acco  # noqa: E402
import acco.compressed  # noqa: E402
import acco.round_checks  # noqa: E402
import acco.rounds  # noqa: E402
import acco.transport  # noqa: E402

METHODS = ("ddp", "sync", "acco", "acco-int8")
NAMES = {"ddp": "DDP + AdamW", "sync": "ZeRO-1 (acco sync)", "acco": "ACCO", "acco-int8": "ACCO + int8"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--methods", type=lambda s: s.split(","), default=list(METHODS),
                   help=f"which of {','.join(METHODS)} to run (ddp, sync and acco always: the table compares them)")
    p.add_argument("--updates", type=int, default=30, help="timed optimizer updates per method")
    p.add_argument("--microbatches", type=int, default=4, help="micro-batches per update (acco: 2 halves)")
    p.add_argument("--batch", type=int, default=8, help="sequences per micro-batch per rank")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--link-share", type=float, default=0.5,
                   help="a round's simulated transfer time as a share of an update's compute time")
    p.add_argument("--link-mbit", type=float, default=None, help="fix the simulated bandwidth (Mbit/s) instead")
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--out", type=Path, default=Path("runs/demo"))
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--data", default=None, help="text file or folder (default: the Python stdlib sources)")
    args = p.parse_args(argv)
    if args.updates < 2 or args.microbatches < 2:
        p.error(f"--updates and --microbatches must be at least 2, got {args.updates} and {args.microbatches}")
    if not 0 < args.link_share <= 10:
        p.error(f"--link-share must be in (0, 10], got {args.link_share}")
    unknown = sorted(set(args.methods) - set(METHODS))
    if unknown:
        p.error(f"--methods: unknown {unknown}; choose from {','.join(METHODS)}")
    return args


# ----------------------------------------------------------------------------- the simulated link


class Link:
    """The simulated link of this rank: transfers take ``bytes / bandwidth`` seconds, one after the other."""

    def __init__(self) -> None:
        self.bytes_per_s = math.inf
        self.busy_s = 0.0  # simulated transfer time so far (the table's "link time")

    def transfer(self, nbytes: float) -> None:
        if math.isfinite(self.bytes_per_s):
            seconds = nbytes / self.bytes_per_s
            self.busy_s += seconds
            time.sleep(seconds)


LINK = Link()


def delayed(collective: Callable, share: float) -> Callable:
    """A round's collective (acco.rounds' reduce-scatter or all-gather) that first waits for the link.
    ``share``: the part of the flat buffer each rank sends, (N-1)/N."""

    def run(a: torch.Tensor, b: torch.Tensor, group, *rest, **kw):
        flat = a if a.numel() >= b.numel() else b  # (out, flat) for the reduce-scatter, (flat, shard) for the gather
        if group is not None:
            LINK.transfer(share * flat.numel() * flat.element_size())
        return collective(a, b, group, *rest, **kw)

    return run


def delayed_all_to_all(collective: Callable, share: float) -> Callable:
    """A compressed round's all-to-all of packed chunks (acco.rounds' reduce_scatter_packed) that first waits
    for the link: ``share`` of the packed chunks each rank sends."""

    def run(out, x, packed, group, *rest, **kw):
        if group is not None:
            LINK.transfer(share * packed.send.numel() * packed.send.element_size())
        return collective(out, x, packed, group, *rest, **kw)

    return run


class DDPLinkHook:
    """DDP comm hook: each bucket's all-reduce waits for the link on a thread of its own (in bucket order, as
    NCCL would send them), so DDP still overlaps its all-reduce with the rest of the backward."""

    def __init__(self, group: dist.ProcessGroup, world: int) -> None:
        self.group, self.world = group, world
        self.jobs: "queue.Queue" = queue.Queue()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            buf, fut = self.jobs.get()
            try:
                LINK.transfer(2 * (self.world - 1) / self.world * buf.numel() * buf.element_size())
                dist.all_reduce(buf, group=self.group)  # the bucket's gradients, summed over ranks (own group)
                fut.set_result(buf.div_(self.world))
            except Exception as exc:  # noqa: BLE001 (handed to DDP, which raises it in backward)
                fut.set_exception(exc)

    def hook(self, state, bucket):  # DDP checks a hook's annotation: none here (annotations are strings)
        fut: torch.futures.Future = torch.futures.Future()
        self.jobs.put((bucket.buffer(), fut))
        return fut


# ----------------------------------------------------------------------------- training


def batch(train: torch.Tensor, args, rank: int, update: int, micro: int):
    """The same micro-batch for every method: a function of (rank, update, micro-batch)."""
    g = torch.Generator().manual_seed(1 + 1_000_000 * rank + 1000 * update + micro)
    return sample_batch(train, args.batch, args.seq_len, g)


def loss_of(model, x, y) -> torch.Tensor:
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def run_method(method: str, updates: int, args, rank: int, world: int, train, held, ddp_group, bar) -> Dict:
    torch.manual_seed(0)
    model = build_model("gpt", GPTConfig(seq_len=args.seq_len, d_model=args.d_model, n_layers=args.layers))
    kw = dict(lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    M = args.microbatches
    if method == "compute":  # no communication at all: the compute time of an update on this machine
        opt, net = torch.optim.AdamW(model.parameters(), **kw), model
    elif method == "ddp":
        net = torch.nn.parallel.DistributedDataParallel(model, broadcast_buffers=False)
        net.register_comm_hook(None, DDPLinkHook(ddp_group, world).hook)
        opt = torch.optim.AdamW(model.parameters(), **kw)
    else:
        net = model
        mode, compression = ("acco", "int8") if method == "acco-int8" else (method, None)
        opt = acco.AccoOptimizer(model.parameters(), mode=mode, microbatches_per_update=M, compression=compression,
                                 **kw)
    curve, link_start = [], LINK.busy_s
    warmup = 2  # untimed updates first (allocations, DDP's bucket rebuild)
    for update in range(warmup + updates):
        if update == warmup:
            if isinstance(opt, acco.AccoOptimizer):
                with opt.committed_weights():  # waits for the warm-up's last round: the timing starts with none in flight
                    pass
            dist.barrier()
            start, link_start = time.perf_counter(), LINK.busy_s
        update_loss = 0.0
        for micro in range(M):
            x, y = batch(train, args, rank, update, micro)
            sync_now = method != "ddp" or micro == M - 1  # DDP all-reduces once per update, as loops do
            with net.no_sync() if not sync_now else contextlib.nullcontext():
                loss = loss_of(net, x, y) / M
                loss.backward()
            update_loss += float(loss.detach())
        opt.step()
        opt.zero_grad(set_to_none=True)
        if update >= warmup:
            curve.append([round(time.perf_counter() - start, 4), round(update_loss, 5)])
            if bar is not None:
                bar.update(1)
    if isinstance(opt, acco.AccoOptimizer):
        opt.finish()  # waits for the last round: its time counts, and the model holds the committed weights
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slower rank's time: the run's
    elapsed = float(elapsed)
    losses = [None] * world
    dist.all_gather_object(losses, [loss for _, loss in curve])  # every rank's losses (after the timing): their mean
    curve = [[t, round(sum(ls[i] for ls in losses) / world, 5)] for i, (t, _) in enumerate(curve)]
    link_s = LINK.busy_s - link_start
    with torch.no_grad():
        model.eval()
        held_loss = sum(float(loss_of(model, x, y)) for x, y in held) / len(held)
    record = {"method": method, "updates": updates, "seconds": elapsed, "link_s": link_s, "curve": curve,
              "tokens": updates * M * args.batch * args.seq_len * world, "held_out_loss": held_loss,
              "params": sum(p.numel() for p in model.parameters())}
    if isinstance(opt, acco.AccoOptimizer):
        record["acco_hidden"] = opt.overlap_summary().get("hidden")
        record["estimate_dtype"] = str(opt.estimate_dtype)  # acco's default: bf16 here (fp32 gradients, 2 ranks)
    return record


# ----------------------------------------------------------------------------- the report (records only)


def load_records(path: Path) -> List[Dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def smoothed(values: List[float]) -> List[float]:
    """A running mean over a tenth of the values (at least one): the table's and the plot's smoothing."""
    k = max(1, len(values) // 10)
    return [sum(values[max(0, i - k + 1): i + 1]) / len(values[max(0, i - k + 1): i + 1]) for i in range(len(values))]


def time_to_reach(curve: List[List[float]], target: float) -> Optional[Dict]:
    """The first update (1-based) whose smoothed training loss is at or below ``target``, and its wall time."""
    for i, loss in enumerate(smoothed([loss for _, loss in curve])):
        if loss <= target:
            return {"updates": i + 1, "seconds": curve[i][0]}
    return None


def summarize(records: List[Dict]) -> Dict:
    """Every number of the table and the verdict, from the records alone."""
    setup = next(r for r in records if r.get("kind") == "setup")
    runs = {r["method"]: r for r in records if r.get("kind") == "run"}
    compute = runs["compute"]
    t_compute = compute["seconds"] / compute["updates"]
    rows = {}
    for m in METHODS:
        if m not in runs:
            continue
        r = runs[m]
        per_update, link = r["seconds"] / r["updates"], r["link_s"] / r["updates"]
        exposed = max(0.0, per_update - t_compute)
        rows[m] = {"tokens_per_s": r["tokens"] / r["seconds"], "s_per_update": per_update, "link_per_update": link,
                   "hidden": min(1.0, max(0.0, 1 - exposed / link)) if link > 0 else math.nan,
                   "held_out_loss": r["held_out_loss"]}
    for m, row in rows.items():
        row["vs_sync"] = row["tokens_per_s"] / rows["sync"]["tokens_per_s"] if "sync" in rows else math.nan
        row["vs_ddp"] = row["tokens_per_s"] / rows["ddp"]["tokens_per_s"] if "ddp" in rows else math.nan
        row["loss_vs_ddp"] = (row["held_out_loss"] / rows["ddp"]["held_out_loss"] - 1) if "ddp" in rows else math.nan
    target = smoothed([loss for _, loss in runs["ddp"]["curve"]])[-1] if runs.get("ddp", {}).get("curve") else None
    for m, row in rows.items():
        row["to_target"] = time_to_reach(runs[m]["curve"], target) if target is not None else None
    return {"setup": setup, "compute_s_per_update": t_compute, "rows": rows, "target": target}


def table(s: Dict) -> str:
    names = NAMES
    lines = ["| method | tokens/s | vs ZeRO-1 | vs DDP | communication hidden | held-out loss (vs DDP) "
             "| time to DDP's final loss |", "|---|---|---|---|---|---|---|"]
    ddp_to = s["rows"].get("ddp", {}).get("to_target")
    for m, r in s["rows"].items():
        to = r["to_target"]
        if to is None:
            reached = "not reached"
        else:
            vs = f" ({to['seconds'] / ddp_to['seconds']:.2f}x DDP)" if ddp_to else ""
            reached = f"{to['seconds']:.1f} s, update {to['updates']}{vs}"
        lines.append(f"| {names[m]} | {r['tokens_per_s']:,.0f} | {r['vs_sync']:.2f}x | {r['vs_ddp']:.2f}x | "
                     f"{r['hidden']:.0%} | {r['held_out_loss']:.4f} ({r['loss_vs_ddp']:+.2%}) | {reached} |")
    return "\n".join(lines)


def reached_sentence(s: Dict) -> str:
    """What the last column says about ACCO, in words."""
    a, ddp, n = s["rows"]["acco"].get("to_target"), s["rows"]["ddp"].get("to_target"), s["setup"]["updates"]
    if s["target"] is None or ddp is None:
        return ""
    what = f"DDP's final training loss ({s['target']:.4f}, smoothed)"
    if a is None:
        return f" ACCO did not reach {what} within the {n} updates."
    return (f" ACCO reached {what} in {a['seconds']:.1f} s at update {a['updates']}, "
            f"{a['seconds'] / ddp['seconds']:.2f}x DDP's {ddp['seconds']:.1f} s.")


def verdict(s: Dict) -> str:
    rows, setup = s["rows"], s["setup"]
    a = rows["acco"]
    best = max(rows["ddp"]["tokens_per_s"], rows["sync"]["tokens_per_s"])
    where = f"on this simulated {setup['link_mbit']:.0f} Mbit/s link"
    if a["tokens_per_s"] >= 1.05 * best:
        return (f"ACCO trained {a['vs_sync']:.2f}x as fast as ZeRO-1 and {a['vs_ddp']:.2f}x as fast as DDP {where}, "
                f"hiding {a['hidden']:.0%} of its communication, and ended {a['loss_vs_ddp']:+.2%} from DDP's "
                f"held-out loss after the same {setup['updates']} updates." + reached_sentence(s)
                + compressed_sentence(s))
    if setup["link_share"] > 1:  # the slow link: two rounds per update cannot hide behind one update's compute
        why = (f"a round lasts {setup['link_share']:g}x an update's compute, and ACCO's two rounds per update "
               "cannot hide behind it")
    else:
        why = "when the network keeps up with the compute there is little communication to hide. Try --link-share 1"
    return (f"ACCO was not faster here ({a['vs_sync']:.2f}x ZeRO-1, {a['vs_ddp']:.2f}x DDP {where}): {why}."
            + reached_sentence(s)) + compressed_sentence(s)


def compressed_sentence(s: Dict) -> str:
    """What the int8 rounds did here, against plain ACCO and DDP (empty when they did not run)."""
    rows = s["rows"]
    c = rows.get("acco-int8")
    if c is None:
        return ""
    vs_acco = c["tokens_per_s"] / rows["acco"]["tokens_per_s"]
    if vs_acco >= 1.05:
        return (f" With int8 rounds (compression=\"int8\") ACCO trained {vs_acco:.2f}x as fast as with full-width "
                f"ones and {c['vs_ddp']:.2f}x as fast as DDP, hiding {c['hidden']:.0%} of its communication, and "
                f"ended {c['loss_vs_ddp']:+.2%} from DDP's held-out loss.")
    return (f" Int8 rounds did not pay here ({vs_acco:.2f}x plain ACCO): quantizing costs compute, which only a "
            "link slower than the compute repays (try --link-share 3).")


def plot(records: List[Dict], path: Path) -> Optional[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(no plot: pip install matplotlib)")
        return None
    runs = {r["method"]: r for r in records if r.get("kind") == "run"}
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for m, label in NAMES.items():
        if m in runs:
            t, loss = zip(*runs[m]["curve"])
            ax.plot(t, smoothed(list(loss)), label=label)
    setup = next(r for r in records if r.get("kind") == "setup")
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel("training loss (mean of the ranks)")
    ax.set_title(f"2 CPU ranks, simulated {setup['link_mbit']:.0f} Mbit/s link", fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def report(out: Path, show_plot: bool = True) -> Dict:
    records = load_records(out / "records.jsonl")
    s = summarize(records)
    setup = s["setup"]
    print(f"\n{setup['params']:,}-parameter GPT, 2 ranks x {setup['microbatches']} micro-batches x {setup['batch']} x "
          f"{setup['seq_len']} tokens per update, {setup['updates']} timed updates per method; simulated link "
          f"{setup['link_mbit']:.0f} Mbit/s (a round: {setup['link_share']:g} x an update's compute of "
          f"{s['compute_s_per_update']:.3f} s)\n")
    print(table(s))
    print("\n" + verdict(s))
    if show_plot:
        png = plot(records, out / "loss_vs_time.png")
        if png:
            print(f"loss against wall time: {png}")
    print(f"records: {out / 'records.jsonl'}")
    if hasattr(os, "geteuid") and os.geteuid() == 0 and shutil.which("ip") and shutil.which("tc"):
        print("As root with ip netns and tc here, the real testbed is one command away: `make bench` runs the "
              "benchmarks of docs/benchmarks.md over network namespaces behind tc-limited links (about 70 minutes).")
    return s


# ----------------------------------------------------------------------------- main


def main(argv=None) -> None:
    args = parse_args(argv)
    if "RANK" not in os.environ:
        raise SystemExit("run under torchrun: torchrun --standalone --nproc_per_node=2 examples/demo.py (or make demo)")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ddp_group = dist.new_group(backend="gloo")  # DDP's all-reduces run on the link thread: a group of their own
    share = (world - 1) / world  # each rank sends (N-1)/N of the buffer in a ring reduce-scatter or all-gather
    # the round's transport (acco.transport) sends the gradients and the weights; the row's all-gather is rounds'
    acco.transport.reduce_scatter_flat = delayed(acco.transport.reduce_scatter_flat, share)
    acco.transport.all_gather_flat = delayed(acco.transport.all_gather_flat, share)
    acco.rounds.all_gather_flat = delayed(acco.rounds.all_gather_flat, share)
    # the exchange a public call (finish()) makes on the rounds' group crosses the link too
    acco.round_checks.all_gather_flat = delayed(acco.round_checks.all_gather_flat, share)
    # compressed rounds: the all-to-all of the gradients' packed chunks, the all-gather of the weights' ones
    acco.compressed.reduce_scatter_packed = delayed_all_to_all(acco.compressed.reduce_scatter_packed, share)
    acco.compressed.all_gather_flat = delayed(acco.compressed.all_gather_flat, share)
    train, held_data = load_corpus(args.data)
    held = eval_batches(held_data, args.eval_batches, args.batch, args.seq_len)
    if rank == 0:
        shutil.rmtree(args.out, ignore_errors=True)
        args.out.mkdir(parents=True)
    methods = [m for m in METHODS if m in {"ddp", "sync", "acco", *args.methods}]
    bar = None
    compute_updates = max(4, args.updates // 2)
    if rank == 0 and not args.no_progress:
        try:
            from tqdm import tqdm

            bar = tqdm(total=compute_updates + len(methods) * args.updates, unit="upd",
                       desc="compute-only, " + ", ".join(methods))
        except ImportError:
            pass
    records = [run_method("compute", compute_updates, args, rank, world, train, held, ddp_group, bar)]
    params = records[0]["params"]
    if args.link_mbit is not None:
        bytes_per_s = args.link_mbit * 1e6 / 8
    else:  # one round (reduce-scatter + all-gather) = one ring all-reduce: 2 (N-1)/N x the fp32 gradients
        bytes_per_s = 2 * share * params * 4 / (args.link_share * records[0]["seconds"] / records[0]["updates"])
    LINK.bytes_per_s = bytes_per_s
    for m in methods:
        records.append(run_method(m, args.updates, args, rank, world, train, held, ddp_group, bar))
    if bar is not None:
        bar.close()
    if rank == 0:
        setup = {"kind": "setup", "link_mbit": bytes_per_s * 8 / 1e6, "link_share": args.link_share,
                 "updates": args.updates, "microbatches": args.microbatches, "batch": args.batch,
                 "seq_len": args.seq_len, "params": params, "world_size": world, "torch": torch.__version__,
                 "date": time.strftime("%Y-%m-%d")}
        with open(args.out / "records.jsonl", "w") as f:
            for r in [setup] + [{"kind": "run", **r} for r in records]:
                f.write(json.dumps(r) + "\n")
        report(args.out, show_plot=not args.no_plot)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    if "--report-only" in sys.argv:  # the table and verdict from an existing OUT/records.jsonl, no training
        argv = [a for a in sys.argv[1:] if a != "--report-only"]
        report(parse_args(argv).out, show_plot="--no-plot" not in argv)
    else:
        main()
