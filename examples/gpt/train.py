"""Train a small GPT on byte-level text with AccoOptimizer (or the baselines).

    torchrun --nproc_per_node=2 examples/gpt/train.py --optimizer acco --steps 300 --out runs/acco

CPU ranks use gloo (one thread each); with GPUs each rank takes cuda:LOCAL_RANK
and NCCL. Without torchrun it runs as one process. ``--optimizer``:

* ``acco``, ``dpu``, ``sync``: the modes of ``acco.AccoOptimizer`` (AdamW inside);
* ``torch-zero``: what users run today, ``DistributedDataParallel`` +
  ``torch.distributed.optim.ZeroRedundancyOptimizer`` (AdamW).

Every optimizer update sees the same number of tokens: ``--batch`` sequences per
rank, which ACCO takes as two halves (two ``step()`` calls) and the others as one
micro-batch. ``--steps`` counts optimizer updates. Metrics go to
``OUT/metrics.jsonl`` (one line per logged update) and ``OUT/summary.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from data import eval_batches, load_corpus, sample_batch  # noqa: E402
from model import GPTConfig, build_model  # noqa: E402

import acco  # noqa: E402
from acco import AccoOptimizer  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--optimizer", choices=["acco", "dpu", "sync", "torch-zero"], default="acco")
    p.add_argument("--model", choices=["gpt", "hf-gpt-neo"], default="gpt")
    p.add_argument("--data", default=None, help="text file or folder (default: the Python stdlib sources)")
    p.add_argument("--steps", type=int, default=300, help="optimizer updates")
    p.add_argument("--batch", type=int, default=16, help="sequences per rank per update (ACCO: two halves)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--min-lr-ratio", type=float, default=0.1, help="cosine decays to lr * this")
    p.add_argument("--warmup", type=int, default=20, help="linear warm-up updates")
    p.add_argument("--betas", type=float, nargs=2, default=(0.9, 0.95))
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--estimate-dtype", choices=["auto", "none", "bf16"], default="auto",
                   help="AccoOptimizer's estimate_dtype (mode acco): auto (the library's default: bf16 for an fp32 "
                        "model on more than one rank), none (the paper's exact estimate) or bf16")
    p.add_argument("--max-microbatches", type=int, default=1,
                   help="ACCO modes: micro-batches a rank may accumulate while a round is in flight (0: no bound)")
    p.add_argument("--global-microbatches", type=int, default=0,
                   help="ACCO modes: micro-batches per round over all ranks, kept when the number of ranks changes "
                        "(each rank takes exactly this / ranks: an elastic job keeps its global batch; 0: off)")
    p.add_argument("--slow-rank", type=int, default=-1, help="this rank is made slower (heterogeneous hardware)")
    p.add_argument("--slow-factor", type=float, default=2.0, help="slow rank's compute time multiplier (by sleeping)")
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank on CPU")
    p.add_argument("--out", default=None, help="folder for metrics.jsonl and summary.json")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--ckpt-dir", default=None, help="checkpoint folder: CKPT_DIR/update_NNNNNNN (ACCO modes)")
    p.add_argument("--ckpt-every", type=int, default=50, help="updates between checkpoints")
    p.add_argument("--ckpt-keep", type=int, default=2, help="checkpoints kept (the newest)")
    p.add_argument("--stop-at", type=int, default=-1, help="exit right after the checkpoint of this update, as if killed")
    p.add_argument("--slow-ckpt-write", type=float, default=0.0,
                   help="seconds each rank's checkpoint write takes longer, until a resume (a slow disk that the "
                        "kill-during-save tests kill into; the resumed run writes at full speed)")
    p.add_argument("--resume", default="none",
                   help="'auto': the latest complete checkpoint in --ckpt-dir (none: start fresh); a folder; 'none'")
    args = p.parse_args(argv)
    if (args.resume != "none" or args.ckpt_dir) and args.optimizer == "torch-zero":
        p.error("--ckpt-dir/--resume: checkpoints are written with acco.checkpoint (modes acco, dpu, sync)")
    if args.resume == "auto" and not args.ckpt_dir:
        p.error("--resume auto looks in --ckpt-dir: give it")
    if args.global_microbatches and args.optimizer == "torch-zero":
        p.error("--global-microbatches: ACCO modes only (acco, dpu, sync)")
    if args.global_microbatches < 0:
        p.error(f"--global-microbatches must be >= 0, got {args.global_microbatches}")
    return args


def lr_at(update: int, args) -> float:
    """Linear warm-up, then cosine decay to ``lr * min_lr_ratio`` at ``--steps``."""
    if update < args.warmup:
        return args.lr * (update + 1) / args.warmup
    frac = min(1.0, (update - args.warmup) / max(1, args.steps - args.warmup))
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


def param_groups(model, weight_decay):
    """Weight decay on matrices and embeddings, none on biases and LayerNorm."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def setup():
    if "RANK" in os.environ:
        acco.init_process_group()  # NCCL with GPUs, else gloo; safe under torchrun --max-restarts
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class Trainer:
    """Runs the four optimizers behind one interface: ``micro_step(x, y)`` and ``updates``."""

    def __init__(self, model, args, world):
        self.args, self.world, self.model = args, world, model
        groups = param_groups(model, args.weight_decay)
        kw = dict(lr=args.lr, betas=tuple(args.betas))
        if args.optimizer == "torch-zero":
            from torch.distributed.optim import ZeroRedundancyOptimizer
            from torch.nn.parallel import DistributedDataParallel as DDP

            self.net = DDP(model) if world > 1 else model
            self.opt = ZeroRedundancyOptimizer(groups[0]["params"], optimizer_class=torch.optim.AdamW,
                                               weight_decay=args.weight_decay, **kw)
            self.opt.add_param_group(groups[1])
            self.micro = args.batch
            self.updates_done = 0
        else:
            self.net = model
            min_mb, max_mb = 1, args.max_microbatches or None
            if args.global_microbatches:
                if args.global_microbatches % world:
                    raise SystemExit(f"--global-microbatches {args.global_microbatches} does not divide among "
                                     f"{world} ranks: give a multiple of every world size the job may run at")
                min_mb = max_mb = args.global_microbatches // world  # each round: exactly this many per rank
            self.opt = AccoOptimizer(groups, torch.optim.AdamW, mode=args.optimizer, accumulate_while_communicating=True,
                                     min_microbatches=min_mb, max_microbatches=max_mb,
                                     estimate_dtype={"auto": "auto", "none": None, "bf16": torch.bfloat16}[
                                         args.estimate_dtype] if args.optimizer == "acco" else None, **kw)
            self.micro = args.batch // 2 if args.optimizer == "acco" else args.batch
        if self.micro < 1:
            raise SystemExit(f"--batch {args.batch} is too small for {args.optimizer}")

    @property
    def acco(self):
        return isinstance(self.opt, AccoOptimizer)

    @property
    def updates(self) -> int:
        """Updates now in the model."""
        return self.opt.num_updates if self.acco else self.updates_done

    @property
    def started(self) -> int:
        """Updates handed off (the last may still be in flight; finish() commits it)."""
        return self.opt.next_update_index if self.acco else self.updates_done

    def tokens(self) -> int:
        """Tokens (all ranks) in the committed updates so far."""
        per_mb = self.micro * self.args.seq_len
        if self.acco:
            return self.opt.committed_microbatches * per_mb
        return self.updates_done * self.world * per_mb

    def micro_step(self, x, y) -> float:
        for g in self.opt.param_groups:
            g["lr"] = lr_at(self.started, self.args)  # the LR of the update this micro-batch belongs to
        logits = self.net(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))
        loss.backward()
        return loss.item()  # note: a CPU-GPU sync point on CUDA

    def after_backward(self):
        self.opt.step()
        self.opt.zero_grad()
        if not self.acco:
            self.updates_done += 1

    def holds_committed_weights(self) -> bool:
        return (not self.acco) or self.opt.holds_committed_weights

    def finish(self):
        if self.acco:
            self.opt.finish()


@torch.no_grad()
def evaluate(model, batches, rank, world, device) -> float:
    """Mean held-out loss; each rank takes a share of the batches. Collective when world > 1."""
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for x, y in batches[rank::world]:
        logits = model(x.to(device))
        total[0] += F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.to(device).reshape(-1)).item()
        total[1] += 1
    if world > 1:
        dist.all_reduce(total)
    model.train()
    return (total[0] / total[1]).item()


def save(args, trainer, model, gen, rank, world, train_time: float) -> None:
    """A checkpoint at an update boundary, on every rank, through acco.checkpoint (DCP: each rank writes its
    slice into a temporary folder, the folder is marked complete once every rank has written, then renamed into
    place). It holds the model (committed weights), the optimizer, the update index, every rank's data-stream
    position (its generator state), the torch RNG and the training time so far (``train_time``: seconds,
    evaluations excluded, every attempt before this one included; rank 0's, which metrics.jsonl logs)."""
    import shutil

    import acco.checkpoint

    streams, time_so_far = [gen.get_state()], torch.tensor(train_time, dtype=torch.float64)
    if world > 1:
        streams = [torch.empty_like(streams[0]) for _ in range(world)]
        dist.all_gather(streams, gen.get_state())  # every rank's data position, so each resumes its own stream
        # rank 0's training time, the clock of metrics.jsonl: the checkpoint keeps one rank's copy of an extra,
        # and another rank's clock can be behind rank 0's (a resumed run's time then went back)
        dist.broadcast(time_so_far, src=0)
    path = os.path.join(args.ckpt_dir, f"update_{trainer.started:07d}")
    if args.slow_ckpt_write > 0:  # a slow disk: every rank's write takes this much longer
        import torch.distributed.checkpoint as dcp

        if not getattr(dcp.save, "slowed", False):
            write = dcp.save

            def slow_save(*a, **kw):
                out = write(*a, **kw)
                time.sleep(args.slow_ckpt_write)
                return out

            slow_save.slowed = True
            dcp.save = slow_save
    with trainer.opt.committed_weights():  # the saved model is the committed one
        acco.checkpoint.save(path, trainer.opt, model=model,
                             extra={"update": torch.tensor(trainer.started), "data_streams": torch.stack(streams),
                                    "torch_rng": torch.get_rng_state(),
                                    "train_time": time_so_far})
    if rank == 0:  # keep the newest --ckpt-keep complete ones
        done = sorted(d for d in os.listdir(args.ckpt_dir) if d.startswith("update_") and not d.endswith((".tmp", ".old")))
        for old in done[: -args.ckpt_keep]:
            shutil.rmtree(os.path.join(args.ckpt_dir, old), ignore_errors=True)
        print(json.dumps({"checkpoint": path, "update": trainer.started}), flush=True)


def resume(args, trainer, model, gen, rank, world):
    """``--resume auto``: the latest complete checkpoint of --ckpt-dir, if any (none: a fresh start); a folder:
    that one. It may come from another number of ranks: DCP reshards the optimizer; a rank the checkpoint had
    no data stream for starts its own, and what that does to the global batch is said in words. Returns the
    folder (None: a fresh start) and the training time the checkpoint had seen."""
    import torch.distributed.checkpoint as dcp

    import acco.checkpoint

    if args.resume == "none":
        return None, 0.0
    path = acco.checkpoint.latest(args.ckpt_dir) if args.resume == "auto" else acco.checkpoint.resolve(args.resume)
    if path is None:
        return None, 0.0
    meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    saved_streams = meta["extra.data_streams"].size
    want = {"update": torch.tensor(0), "data_streams": torch.zeros(saved_streams, dtype=torch.uint8),
            "torch_rng": torch.get_rng_state()}
    if "extra.train_time" in meta:  # checkpoints of this example before it saved its time lack it
        want["train_time"] = torch.tensor(0.0, dtype=torch.float64)
    extra = acco.checkpoint.load(path, trainer.opt, model=model, extra=want)
    torch.set_rng_state(extra["torch_rng"])
    if rank < extra["data_streams"].shape[0]:
        gen.set_state(extra["data_streams"][rank].clone())
    if int(extra["update"]) != trainer.started:
        raise SystemExit(f"{path}: saved at update {int(extra['update'])}, the optimizer resumed at {trainer.started}")
    if rank == 0:
        print(json.dumps({"resumed_from": path, "update": trainer.started, "saved_ranks": saved_streams[0],
                          "ranks": world, "unix_time": time.time()}), flush=True)
        if saved_streams[0] != world:
            print(batch_note(args, saved_streams[0], world), flush=True)
    return path, float(extra.get("train_time", torch.tensor(0.0)))


def batch_note(args, saved: int, world: int) -> str:
    """What resuming on another number of ranks does to the global batch, in words."""
    head = f"resumed a checkpoint written by {saved} rank(s) on {world} rank(s): "
    if args.global_microbatches:
        return (head + f"the global batch is kept: every round holds {args.global_microbatches} micro-batches over "
                f"all ranks ({args.global_microbatches // world} per rank; --global-microbatches).")
    per_rank = max(1, args.max_microbatches or 1)
    return (head + f"each round now averages the micro-batches of {world} rank(s) instead of {saved}, so the global "
            f"batch is {world / saved:.2g}x what it was (a learning rate tuned for it may not fit). To keep it, pass "
            f"--global-microbatches {saved * per_rank} (a multiple of every number of ranks the job may run at: the "
            "micro-batches of all ranks in every round).")


def main(argv=None):
    args = parse_args(argv)
    rank, world = setup()
    train(args, rank, world)
    if world > 1:
        # Everything holding a process group was released when train() returned; collect
        # cycles now, so gloo never frees Python tensors during interpreter exit.
        gc.collect()
        dist.destroy_process_group()


def train(args, rank, world):
    device = torch.device(f"cuda:{torch.cuda.current_device()}") if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    train_data, held_out = load_corpus(args.data)
    evals = eval_batches(held_out, args.eval_batches, 16, args.seq_len)
    torch.manual_seed(args.seed)
    cfg = GPTConfig(seq_len=args.seq_len, d_model=args.d_model, n_layers=args.layers, n_heads=args.heads)
    model = build_model(args.model, cfg).to(device)
    trainer = Trainer(model, args, world)
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)  # each rank its own data stream
    resumed_from, prior_time = resume(args, trainer, model, gen, rank, world)
    if resumed_from is not None:
        args.slow_ckpt_write = 0.0  # --slow-ckpt-write: the first attempt only

    out = Path(args.out) if args.out and rank == 0 else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
        if resumed_from is None or not (out / "metrics.jsonl").exists():
            (out / "metrics.jsonl").write_text("")
    bar = None
    if rank == 0 and not args.no_progress:
        try:
            from tqdm import tqdm

            bar = tqdm(total=args.steps, initial=trainer.started, desc=args.optimizer, unit="upd", dynamic_ncols=True)
        except ImportError:
            pass

    def log(record):
        if rank != 0:
            return
        if out:
            with open(out / "metrics.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")
        if bar is None:
            print(json.dumps(record), flush=True)

    n_params = sum(p.numel() for p in model.parameters())
    if rank == 0:
        print(f"{args.optimizer}: {n_params/1e6:.2f}M parameters, {world} rank(s), {device}, "
              f"train {len(train_data)/1e6:.1f} MB, held-out {len(held_out)/1e6:.2f} MB", flush=True)
    eval_time, losses, last_logged, last_eval, last_saved = 0.0, [], trainer.updates, -1, trainer.started
    last_saved_at_start = trainer.updates
    start = time.perf_counter()
    first = evaluate(model, evals, rank, world, device)
    eval_time += time.perf_counter() - start
    # "time": training time, evaluations excluded, from the run's start: a resumed attempt goes on from the time
    # its checkpoint had seen (the restart itself is not counted)
    log({"step": trainer.updates, "tokens": trainer.tokens(), "time": round(prior_time, 3), "train_loss": None,
         "eval_loss": first, "lr": lr_at(trainer.started, args)})
    resumed_at, resumed_tokens = trainer.updates, trainer.tokens()
    while trainer.started < args.steps:
        x, y = sample_batch(train_data, trainer.micro, args.seq_len, gen)
        t0 = time.perf_counter()
        losses.append(trainer.micro_step(x.to(device), y.to(device)))
        if rank == args.slow_rank:
            time.sleep((args.slow_factor - 1.0) * (time.perf_counter() - t0))  # a slower device
        trainer.after_backward()
        u = trainer.updates
        if resumed_from is not None and rank == 0 and u > last_saved_at_start:
            print(json.dumps({"first_update_after_resume": u, "unix_time": time.time()}), flush=True)
            resumed_from = None
        if u != last_logged and (u % args.log_every == 0 or u == args.steps):
            wall = prior_time + time.perf_counter() - start - eval_time
            rec = {"step": u, "tokens": trainer.tokens(), "time": round(wall, 3),
                   "train_loss": sum(losses) / len(losses), "eval_loss": None, "lr": lr_at(u - 1, args)}
            if u % args.eval_every == 0 and u != last_eval and trainer.holds_committed_weights() and u != args.steps:
                t1 = time.perf_counter()
                rec["eval_loss"] = evaluate(model, evals, rank, world, device)
                eval_time += time.perf_counter() - t1
                last_eval = u
            log(rec)
            if bar is not None:
                bar.update(u - last_logged)
                bar.set_postfix(loss=f"{rec['train_loss']:.3f}", tok_s=f"{rec['tokens'] / max(wall, 1e-9):.0f}")
            losses, last_logged = [], u
        if (args.ckpt_dir and trainer.started % args.ckpt_every == 0 and trainer.started != last_saved
                and trainer.started < args.steps and trainer.opt.at_update_boundary):
            save(args, trainer, model, gen, rank, world, prior_time + time.perf_counter() - start - eval_time)
            last_saved = trainer.started
            if trainer.started == args.stop_at:
                os._exit(0)  # as if the host died here: no finish(), nothing flushed
    trainer.finish()  # the model now holds the last committed weights
    attempt = time.perf_counter() - start - eval_time
    wall = prior_time + attempt
    final = evaluate(model, evals, rank, world, device)
    # tokens/s over the whole run (every attempt's training time, not the restarts), and over this attempt alone
    summary = {"optimizer": args.optimizer, "model": args.model, "seed": args.seed, "world": world,
               "updates": trainer.updates, "tokens": trainer.tokens(), "time": round(wall, 3),
               "tokens_per_s": trainer.tokens() / wall, "final_eval_loss": final, "params": n_params,
               "this_attempt": {"from_update": resumed_at, "time": round(attempt, 3),
                                "tokens_per_s": (trainer.tokens() - resumed_tokens) / attempt},
               "slow_rank": args.slow_rank, "slow_factor": args.slow_factor, "max_microbatches": args.max_microbatches}
    if trainer.acco:
        history = trainer.opt.microbatch_history()
        per_rank = [[h["local_microbatches"] for h in history]]
        if world > 1:
            per_rank = [None] * world
            dist.all_gather_object(per_rank, [h["local_microbatches"] for h in history])
        # [rank][round]: micro-batches in each round's gradient (an acco commit's includes its estimate's)
        summary["microbatches_per_round"] = per_rank
        summary["mean_microbatches_per_round"] = [sum(c) / max(1, len(c)) for c in per_rank]
    log({"step": trainer.updates, "tokens": trainer.tokens(), "time": round(wall, 3), "train_loss": None,
         "eval_loss": final, "lr": None})
    if bar is not None:
        bar.close()
    if rank == 0:
        print(json.dumps({k: v for k, v in summary.items() if k != "microbatches_per_round"}), flush=True)
        if out:
            (out / "summary.json").write_text(json.dumps(summary, indent=1))
            torch.save(model.state_dict(), out / "final.pt")  # the committed weights, to compare runs
    if world > 1:
        dist.barrier()  # no rank tears down gloo while a peer still talks to it


if __name__ == "__main__":
    main()
