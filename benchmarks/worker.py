"""One benchmark run: one method, one rank per process, timed updates.

Launched by ``overlap.py`` / ``hetero.py`` / ``memory.py`` through torchrun, one
rank per network namespace (or on loopback)::

    torchrun --standalone --nproc-per-node 2 benchmarks/worker.py --method acco --out r.json

Methods, all with AdamW on the same GPT (``examples/gpt/model.py``), random
tokens, and one *update* = two micro-batches per rank:

* ``acco``      AccoOptimizer(mode="acco", min=max_microbatches=1): two rounds per
                update, each overlapped with one micro-batch.
* ``acco-acc``  the same, accumulating while a round is in flight (no bound).
* ``dpu``       AccoOptimizer(mode="dpu", min=max_microbatches=1).
* ``dpu-ef``    the same with ``delay_correction=1.0`` (error feedback on the delayed update; the
                update loop only, as the library has it).
* ``sync``      AccoOptimizer(mode="sync", min_microbatches=2): ZeRO-1, one round
                per update after both micro-batches.
* ``acco-int8`` / ``acco-fp8`` / ``acco-int4``  mode acco with ``compression="int8"`` / ``"fp8"`` / ``"int4"`` (both directions, error
                feedback on the gradients; the estimate compressed like the commit).
* ``acco-int8e4`` mode acco with ``compression="int8", estimate_compression="int4"`` (the estimate round in 4 bits).
* ``acco-int8g`` mode acco with ``compression="int8", compression_weights=False`` (the gradients only).
* ``acco-auto`` mode acco with ``compression="auto"`` (the library's default rounds until it chooses, after its
                fourth update's first hand-off: time it with ``--warmup 4`` or more).
* ``ddp-fp16``  torch DDP + AdamW with torch's ``fp16_compress_hook`` (half the all-reduce's bytes; its
                ``bf16_compress_hook`` refuses gloo: "required CUDA 11+ and NCCL 2.10+").
* ``ddp-powersgd``  torch DDP + AdamW with torch's ``powerSGD_hook`` (rank 4, or ``--powersgd-rank``; error
                feedback, warm start, PowerSGD from the second all-reduce on).
* ``ddp-zero``  torch DDP + ZeroRedundancyOptimizer: the first micro-batch under
                ``no_sync()``, the second all-reduces in its backward, then the step.
* ``ddp``       torch DDP + AdamW (every rank steps the whole model): the same
                ``no_sync()`` loop; DDP's bucketed all-reduce overlaps the second backward.
* ``compute``   no communication: the two micro-batches and an fp32 AdamW step on
                a 1/N-sized slice (what every method computes), the denominator
                of the utilisation.

``--loop`` (library methods only; the others always run two micro-batches, then
one step): ``awc`` drives the library with ``accumulate_while_communicating=True``
and ``step()`` after every micro-batch, bounded as above; ``update`` is its
default loop, ``microbatches_per_update=2``: two ``backward()``, one ``step()``,
``zero_grad()``, as with a torch optimizer (``acco-acc`` needs ``awc``).

``--optimizer muon``: the Muon + AdamW split instead of AdamW (2-D hidden
matrices to ``torch.optim.Muon``, embeddings and 1-D tensors to AdamW): the
library's methods wrap both in one optimizer (each rank orthogonalises the
matrices it owns), ``ddp`` steps torch's Muon and AdamW on every rank (each
rank orthogonalises every matrix), ``compute`` as with AdamW.

``--dtype``: ``fp32``; ``bf16``: the library computes in bf16
(``compute_dtype``; fp32 master, fp32 gradient accumulation), the other methods
cast the model to bf16 (pure bf16: bf16 parameters, gradients and AdamW state);
``amp``: the other methods keep fp32 parameters and run forward and loss under
``torch.autocast("cpu", torch.bfloat16)`` (fp32 master and state, as the
library); the library as with ``bf16``.

Rank 0 writes a JSON record: tokens/s over the timed updates (tokens of
committed updates only; the window runs from one hand-off to the hand-off of
the last timed update, so the in-flight round is always one, as in a long run),
dtype and loop, the size of one parameter-sized copy (fp32 and compute dtype),
for the library's methods per-round statistics (``AccoOptimizer.overlap_summary``)
and the options the optimizer holds, every rank's peak RSS, and the buffer bytes
(``memory_report()``; for torch DDP, the tensors it holds).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import resource
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "gpt"))

from model import GPT, GPTConfig  # noqa: E402

import acco  # noqa: E402
from acco import AccoOptimizer  # noqa: E402
from acco.stats import nbytes, summarize  # noqa: E402

import _launch  # noqa: E402  (this folder: the methods that run in one loop only)

LIBRARY = ["acco", "acco-acc", "acco-int8", "acco-fp8", "acco-int4", "acco-int8e4", "acco-int8g", "acco-auto", "dpu",
           "dpu-ef", "sync"]
COMPRESSED = {"acco-int8": dict(compression="int8"), "acco-fp8": dict(compression="fp8"),
              "acco-int4": dict(compression="int4"), "acco-auto": dict(compression="auto"),
              "acco-int8e4": dict(compression="int8", estimate_compression="int4"),
              "acco-int8g": dict(compression="int8", compression_weights=False)}
DDP = ["ddp", "ddp-fp16", "ddp-powersgd", "ddp-zero"]
METHODS = LIBRARY + DDP + ["compute"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--method", choices=METHODS, required=True)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=0, help="attention heads (0: d_model // 64)")
    p.add_argument("--window", type=int, default=0, help="local attention window (0: seq_len // 2)")
    p.add_argument("--optimizer", choices=["adamw", "muon"], default="adamw")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=8, help="sequences per micro-batch (half a mini-batch)")
    p.add_argument("--warmup", type=int, default=3, help="updates before timing starts")
    p.add_argument("--updates", type=int, default=10, help="timed updates")
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--slow-factor", type=float, default=2.0, help="the slow rank sleeps (factor-1) x its compute")
    p.add_argument("--loop", choices=["awc", "update"], default="awc",
                   help="library methods: step() after every micro-batch (awc) or once per update (update)")
    p.add_argument("--dtype", choices=["fp32", "bf16", "amp"], default="fp32")
    p.add_argument("--reduce-dtype", choices=["default", "fp32", "bf16"], default="default",
                   help="the library's reduce_dtype (default: its accumulation dtype)")
    p.add_argument("--estimate-dtype", choices=["default", "bf16"], default="default",
                   help="the library's estimate_dtype (default: None, the estimate travels like the commit, as the "
                        "paper has it; the library's own default, 'auto', would send it in bf16 here)")
    p.add_argument("--powersgd-rank", type=int, default=4, help="ddp-powersgd's matrix_approximation_rank")
    p.add_argument("--out", type=Path, default=None, help="rank 0 writes its JSON record here")
    args = p.parse_args(argv)
    if args.optimizer == "muon" and args.method == "ddp-zero":
        p.error("--optimizer muon runs with the library's methods, ddp and compute (not ddp-zero)")
    refusal = _launch.loop_refusal(args.method, args.loop)
    if refusal:
        p.error(f"--method {refusal}: run it with --loop {_launch.ONE_LOOP[args.method][0]}")
    return args


def build(args, world: int):
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=256, seq_len=args.seq_len, d_model=args.d_model, n_layers=args.layers,
                    n_heads=args.heads or max(1, args.d_model // 64), local_window=args.window or args.seq_len // 2)
    return GPT(cfg)


MUON = dict(lr=0.02, momentum=0.95, weight_decay=0.01)


def muon_split(model):
    """(hidden 2-D matrices, the rest): Muon's share and AdamW's."""
    hidden = [p for n, p in model.named_parameters() if p.dim() == 2 and not n.startswith(("tok", "pos"))]
    ids = {id(p) for p in hidden}
    return hidden, [p for p in model.parameters() if id(p) not in ids]


class _Both:
    """torch's Muon and AdamW stepped together (DDP + the split, as torch's Muon documentation runs it)."""

    def __init__(self, *optimizers):
        self.optimizers = optimizers
        self.state = {k: v for o in optimizers for k, v in o.state.items()}

    def step(self):
        for o in self.optimizers:
            o.step()
        self.state = {k: v for o in self.optimizers for k, v in o.state.items()}

    def zero_grad(self):
        for o in self.optimizers:
            o.zero_grad()


class Runner:
    """One method behind ``micro_batch(x, y)``, ``updates_started`` and ``finish()``."""

    def __init__(self, model, args, rank: int, world: int):
        self.args, self.model, self.world, self.method = args, model, world, args.method
        self.net, self.opt, self.done_updates, self.mb = model, None, 0, 0
        kw = dict(lr=1e-4, weight_decay=0.1)
        m = args.method
        self.autocast = args.dtype == "amp" and m not in LIBRARY
        if m in LIBRARY:
            mode = m.split("-")[0]  # acco-acc: mode acco; dpu-ef: mode dpu
            if m == "dpu-ef":
                kw["delay_correction"] = 1.0
            if args.dtype != "fp32":
                kw["compute_dtype"] = torch.bfloat16
            kw["estimate_dtype"] = torch.bfloat16 if args.estimate_dtype == "bf16" else None
            if m in COMPRESSED:  # the estimate travels compressed like the commit
                kw.update(COMPRESSED[m])
                del kw["estimate_dtype"]
            if args.reduce_dtype != "default":
                kw["reduce_dtype"] = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.reduce_dtype]
            params = model.parameters()
            if args.optimizer == "muon":  # one optimizer, two classes: each rank orthogonalises its own matrices
                hidden, rest = muon_split(model)
                params = [{"params": hidden, "optimizer_class": torch.optim.Muon, **MUON}, {"params": rest}]
            if args.loop == "update":  # the default loop: two backward(), one step(), as any torch optimizer
                self.opt = AccoOptimizer(params, mode=mode, microbatches_per_update=2, **kw)
            else:
                lo, hi = (2, 2) if m == "sync" else (1, 1)
                self.opt = AccoOptimizer(params, mode=mode, accumulate_while_communicating=True,
                                         min_microbatches=lo, max_microbatches=None if m == "acco-acc" else hi, **kw)
            return
        if args.dtype == "bf16":
            model.to(torch.bfloat16)  # pure bf16: parameters, gradients and AdamW state
        if m in DDP:
            from torch.distributed.optim import ZeroRedundancyOptimizer
            from torch.nn.parallel import DistributedDataParallel

            self.net = DistributedDataParallel(model)
            if m == "ddp-fp16":
                from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

                self.net.register_comm_hook(None, default_hooks.fp16_compress_hook)
            elif m == "ddp-powersgd":
                from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

                state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=self.args.powersgd_rank,
                                               start_powerSGD_iter=2, use_error_feedback=True, warm_start=True)
                self.net.register_comm_hook(state, powersgd.powerSGD_hook)
            if m in ("ddp", "ddp-fp16", "ddp-powersgd") and args.optimizer == "muon":
                hidden, rest = muon_split(model)
                self.opt = _Both(torch.optim.Muon(hidden, **MUON), torch.optim.AdamW(rest, **kw))
            elif m != "ddp-zero":
                self.opt = torch.optim.AdamW(model.parameters(), **kw)
            else:
                self.opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, **kw)
        else:  # compute only: the sharded step's cost (an fp32 slice, as the library's master), no communication
            numel = sum(p.numel() for p in model.parameters())
            self.shard = torch.zeros((numel + world - 1) // world, requires_grad=True)
            self.shard.grad = torch.randn_like(self.shard)
            self.opt = torch.optim.AdamW([self.shard], **kw)

    @property
    def library(self) -> bool:
        return isinstance(self.opt, AccoOptimizer)

    @property
    def updates_started(self) -> int:
        return self.opt.next_update_index if self.library else self.done_updates

    def micro_batch(self, x, y) -> None:
        last = self.mb % 2 == 1
        if self.net is not self.model and not last:  # DDP: the first half accumulates locally
            with self.net.no_sync():
                self._backward(x, y)
        else:
            self._backward(x, y)
        if self.library and self.args.loop == "awc":  # a hand-off point after every micro-batch
            self.opt.step()
            self.opt.zero_grad()
        elif last:
            self.opt.step()
            if self.method != "compute":
                self.opt.zero_grad()
            self.done_updates += 1
        self.mb += 1

    def _backward(self, x, y) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast):
            logits = self.net(x)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))
        loss.backward()

    def committed_microbatches(self) -> int:
        """All ranks' micro-batches in the updates done so far (the non-library methods)."""
        return self.done_updates * 2 * self.world

    def finish(self) -> None:
        if self.library:
            self.opt.finish()


def ddp_memory(runner: Runner) -> dict:
    """Bytes this rank holds for DDP + AdamW or + ZeroRedundancyOptimizer, by buffer (as far as torch exposes them)."""
    params = list(runner.model.parameters())
    optim = getattr(runner.opt, "optim", runner.opt)  # ZeroRedundancyOptimizer: the AdamW of this rank's slice
    state = [v for st in optim.state.values() for v in st.values()]
    buckets = runner.net._get_ddp_logging_data().get("bucket_sizes", "")
    report = {"params": nbytes(params), "grads": nbytes([p.grad for p in params]), "optimizer_state": nbytes(state)}
    # DDP's reducer buckets: bucket_sizes are in bytes, e.g. "26214400, 1048576"
    report["ddp_buckets"] = sum(int(x) for x in str(buckets).replace(",", " ").split()) if buckets else None
    return report


def tx_bytes():
    """Bytes the testbed's interface has sent (``benchmarks/netns.py``: ``acco0`` in this rank's namespace)."""
    try:
        with open("/sys/class/net/acco0/statistics/tx_bytes") as f:
            return int(f.read())
    except OSError:
        return None


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    acco.init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build(args, world)
    numel = sum(p.numel() for p in model.parameters())
    runner = Runner(model, args, rank, world)
    g = torch.Generator().manual_seed(1234 + rank)
    data = [torch.randint(0, 256, (args.micro_batch, args.seq_len + 1), generator=g) for _ in range(4)]
    total = args.warmup + args.updates
    t0 = start_mb = start_rounds = tx0 = None
    compute_s = []
    while runner.updates_started < total:
        if t0 is None and runner.updates_started >= args.warmup:
            dist.barrier()  # the user's group, not the rounds': align the ranks before timing
            t0, start_mb = time.perf_counter(), 0 if runner.library else runner.committed_microbatches()
            tx0 = tx_bytes()
            start_rounds = runner.opt.num_rounds if runner.library else 0
        batch = data[runner.mb % len(data)]
        tc = time.perf_counter()
        runner.micro_batch(batch[:, :-1], batch[:, 1:])
        if rank == args.slow_rank:
            time.sleep((args.slow_factor - 1.0) * (time.perf_counter() - tc))  # a slower device
        if t0 is not None:
            compute_s.append(time.perf_counter() - tc)
    # Steady state: the window ends at the hand-off of the last timed update, as it began at a
    # hand-off; the final round's drain in finish() happens once per run, not once per update.
    elapsed = time.perf_counter() - t0
    tx1 = tx_bytes()
    runner.finish()
    if runner.library:  # micro-batches of the commits handed off after t0 (all ranks)
        rounds = [r for r in runner.opt.round_stats() if r["round"] >= start_rounds]
        mb = sum(r["total_microbatches"] for r in rounds if r["kind"] == "commit")
    else:
        mb = runner.committed_microbatches() - start_mb
    record = {
        "method": args.method, "world": world, "params": numel, "micro_batch": args.micro_batch,
        "seq_len": args.seq_len, "updates": args.updates, "elapsed_s": elapsed,
        "tokens_per_s": mb * args.micro_batch * args.seq_len / elapsed,
        "microbatches": mb, "slow_rank": args.slow_rank, "slow_factor": args.slow_factor,
        "acco_ring": os.environ.get("ACCO_RING", "default"), "dtype": args.dtype, "loop": args.loop,
        "optimizer": args.optimizer,
        # one parameter-sized copy, in fp32 and in the compute dtype (bf16 for bf16 and amp)
        "param_bytes_fp32": 4 * numel, "param_bytes_compute": (4 if args.dtype == "fp32" else 2) * numel,
        "step_call_s": sum(compute_s) / max(1, len(compute_s)),
        # what this rank's interface sent over the timed updates (netns testbed only), per update
        "tx_bytes_per_update": None if tx0 is None else (tx1 - tx0) / args.updates,
    }
    if runner.method in DDP:
        record["memory"] = ddp_memory(runner)
    if runner.library:
        record["rounds"] = rounds
        record["summary"] = summarize(rounds)
        record["memory"] = runner.opt.memory_report()
        record["options"] = {k: str(getattr(runner.opt, k, None)) for k in (  # as the optimizer holds them
            "mode", "accumulate_while_communicating", "microbatches_per_update", "compute_dtype", "accumulation_dtype",
            "reduce_dtype", "estimate_dtype", "estimate_extrapolation", "delay_correction", "compression_in_use")}
        auto = runner.opt._runtime.auto  # compression="auto": what it measured and predicted
        if auto is not None and auto.measured is not None:
            record["auto"] = {"chose": auto.decided, "measured": dataclasses.asdict(auto.measured),
                              "predicted_update_s": auto.predicted}
    maxrss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024], dtype=torch.float64)
    rss = [torch.zeros_like(maxrss) for _ in range(world)]
    dist.all_gather(rss, maxrss)
    record["peak_rss_bytes"] = [int(t.item()) for t in rss]
    if rank == 0 and args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record))
    del runner, model, rss, maxrss
    gc.collect()  # free gloo's tensors before the group goes (an abort at exit otherwise)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
