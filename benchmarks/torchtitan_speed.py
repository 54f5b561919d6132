"""Tokens/s of torchtitan's HSDP against torchtitan + ACCO across replicas, on the netns testbed: two hosts of two
ranks each (FSDP2 inside a host), a rate-limited link between them.

    sudo .venv/bin/python benchmarks/torchtitan_speed.py --calibrate            # loopback: compute, bytes per round
    sudo .venv/bin/python benchmarks/netns.py up --ranks 2 --rate-mbit R        # one namespace per host
    sudo .venv/bin/python benchmarks/torchtitan_speed.py --rate-mbit R --repeats 3 --out runs/bench/torchtitan.jsonl
    .venv/bin/python benchmarks/torchtitan_speed.py --loopback --smoke           # the script runs

Each run is torchtitan's own entry point through ``tests/torchtitan_cpu.py`` (its CPU work-arounds), the
``llama3_debugmodel`` at ``--seq-len`` and ``--batch``, two micro-batches per update, fp32, no activation
checkpointing, no checkpoints: ``hsdp`` is ``--module llama3 --config llama3_debugmodel_ce_loss`` (FSDP2 on the
2-D replicate x shard mesh), ``acco`` is ``--module acco.integrations.torchtitan --config llama3_debugmodel``
(the defaults: mode acco, a bf16 estimate), ``acco-int8`` the same with ``--acco.compression int8`` (both rounds
across replicas in 8 bits, docs/compression.md). All take the same loss (not chunked). The methods (``--methods``,
default hsdp and acco) are interleaved in every repeat. A run's tokens/s is torchtitan's own ``tps`` (tokens per
second per rank, each step's) averaged over the steps after ``--warmup``, times the 4 ranks.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _launch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = ROOT / "tests" / "torchtitan_cpu.py"
ACCO = ["--module", "acco.integrations.torchtitan", "--config", "llama3_debugmodel"]
METHODS = {"hsdp": ["--module", "llama3", "--config", "llama3_debugmodel_ce_loss"],
           "acco": ACCO,
           "acco-int8": ACCO + ["--acco.compression", "int8"]}  # the rounds across replicas in 8 bits


def torchtitan_args(method: str, args, dump: Path) -> list:
    return [*METHODS[method], "--parallelism.data_parallel_replicate_degree", "2",
            "--parallelism.data_parallel_shard_degree", "2", "--parallelism.spmd_backend", "partial_dtensor",
            "--training.steps", str(args.steps), "--training.seq_len", str(args.seq_len),
            "--training.local_batch_size", str(args.batch), "--training.global_batch_size", str(args.batch * 4 * 2),
            "--training.mixed_precision_param", "float32", "--validator.no-enable", "--checkpoint.no-enable",
            "--comm.init_timeout_seconds", "600", "--dump_folder", str(dump), "activation-checkpoint:none"]


def commands(targs: list, assets: Path, loopback: bool) -> list:
    """One torchrun per host (``_launch.two_hosts``) of torchtitan through its CPU work-arounds."""
    return _launch.two_hosts([str(LAUNCH), "--assets", str(assets), "--", *targs], loopback)


def parse(log: str, warmup: int) -> dict:
    """Rank 0's per-step records (loss, grad norm, tps) from torchtitan's log."""
    plain = re.sub(r"\x1b\[[0-9;]*m", "", log)
    steps = {}
    for s, loss, norm, tps in re.findall(r"step:\s+(\d+)\s+loss:\s+(\S+)\s+grad_norm:\s+(\S+).*?tps:\s+([\d,]+)",
                                         plain):
        steps.setdefault(int(s), (float(loss), float(norm), float(tps.replace(",", ""))))
    timed = [v[2] for k, v in sorted(steps.items()) if k > warmup]
    if not timed:
        raise RuntimeError(f"no timed steps in the log:\n{log[-3000:]}")
    return {"tps_per_rank": statistics.fmean(timed), "tokens_per_s": 4 * statistics.fmean(timed),
            "steps": len(steps), "final_loss": steps[max(steps)][0]}


def one_run(method: str, args, assets: Path) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        logs, failed = _launch.run_processes(
            commands(torchtitan_args(method, args, Path(tmp) / "out"), assets, args.loopback), timeout=1200)
        if failed:
            raise RuntimeError(f"{method} failed:\n" + "\n".join(t[-3000:] for t in logs))
        return {"method": method, **parse(logs[0], args.warmup)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3, help="steps left out of the timing")
    _launch.testbed_options(p, "loopback, each method once: compute time per update", "4 steps, one repeat, loopback")
    p.add_argument("--assets", type=Path, default=ROOT / "runs" / "torchtitan-assets")
    p.add_argument("--methods", default="hsdp,acco", help=f"comma-separated, from {', '.join(METHODS)}")
    args = p.parse_args()
    methods = args.methods.split(",")
    unknown = [m for m in methods if m not in METHODS]
    if unknown or "hsdp" not in methods:
        p.error(f"--methods {args.methods}: {'unknown ' + ', '.join(unknown) if unknown else 'hsdp missing'} "
                f"(each from {', '.join(METHODS)}, hsdp among them: every ratio is against it)")
    if not (args.assets / "tokenizer" / "tokenizer.json").exists():
        logs, failed = _launch.run_processes([[sys.executable, str(LAUNCH), "--assets", str(args.assets),
                                               "--make-assets"]])
        if failed:
            raise RuntimeError("making the tokenizer and the dataset failed:\n" + logs[0][-3000:])
    if args.smoke:
        args.steps, args.warmup, args.repeats, args.loopback = 4, 2, 1, True
    if args.calibrate:
        args.loopback, args.repeats = True, 1
    rows = []
    for rep in range(args.repeats):
        for method in methods:  # interleaved
            r = one_run(method, args, args.assets)
            r.update(repeat=rep, rate_mbit=None if args.loopback else args.rate_mbit, loopback=args.loopback,
                     seq_len=args.seq_len, batch=args.batch, steps=args.steps, warmup=args.warmup)
            rows.append(r)
            _launch.record_row(r, args.out)
    for k, new in enumerate(m for m in methods if m != "hsdp"):  # every method's tokens/s once, then each ratio
        _launch.print_speedup(rows, methods if k == 0 else [], new, "hsdp")


if __name__ == "__main__":
    main()
