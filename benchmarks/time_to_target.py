"""Time to target on the netns testbed: the nanoGPT-style loops' time per update, and whole runs end to end.

    sudo .venv/bin/python benchmarks/time_to_target.py speed --rate 50 --repeats 3 \\
        --out docs/benchmarks_data/time_to_target_speed.jsonl
    sudo .venv/bin/python benchmarks/time_to_target.py e2e --rate 50 --seed 0 --run ddp:1500 --run acco-bf16:1542 \\
        --out docs/benchmarks_data/time_to_target_e2e.jsonl

Both run the time-to-target study's loops (``examples/nanogpt/train_ddp.py`` and ``train_acco.py``, its model,
batch and warm-up-stable-decay schedule; ``examples/nanogpt/time_to_target.py``) with one rank per network
namespace (``benchmarks/netns.py``), every link rate-limited to ``--rate`` Mbit/s each way: a round of the
0.84M-parameter model (a ring's reduce-scatter and all-gather of fp32: 3.4 MB sent per rank) lasts about
half an update's compute at 50 Mbit/s on this project's machine (``--calibrate`` measures it here).

* ``speed``: ``--updates`` updates of each method, the methods interleaved, ``--repeats`` times; each record
  holds the training time per update over the updates after ``--warmup`` (from the loop's own log:
  evaluations and checkpoints excluded) and tokens/s, labelled as ``benchmarks/overlap.py``'s records are,
  which the time-to-target report composes with the updates ratio.
* ``e2e``: whole runs, ``--run METHOD:T`` each (a run of T updates, warm-up and cool-down as the study's),
  at one seed: their training time and final held-out loss, to check the composition end to end.
* ``--calibrate``: one short DDP run on loopback (no rate limit) and the rate at which a round would last half
  an update's compute.

Needs root (namespaces, tc), like the other testbed benchmarks.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
NANOGPT = ROOT / "examples" / "nanogpt"
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(NANOGPT))

import _launch  # noqa: E402
import netns  # noqa: E402


def _study_methods() -> dict:
    """The study's methods (examples/nanogpt/time_to_target.py, loaded by path: this file has its name):
    method -> (script, the script's settings, instrument.py's flags)."""
    import importlib.util  # noqa: PLC0415

    spec = importlib.util.spec_from_file_location("nanogpt_time_to_target", NANOGPT / "time_to_target.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.METHODS


METHODS = _study_methods()
# the records' labels of the methods measured before the records named their method (as overlap.py labels them);
# a method added to the study since is labelled by its name
LABELS = {"ddp": "ddp", "acco": "acco", "acco-bf16": "acco:estimate-bf16",
          "acco-bf16-h3": "acco:estimate-bf16-after-3"}
ROUND_BYTES = 2 * 0.5 * 834_304 * 4  # one round, per rank: reduce-scatter + all-gather of the fp32 buffer (N=2)


def settings(args, method: str, lr: float, seed: int, steps: int, warmup: int) -> list:
    """The study's loop settings (examples/nanogpt/time_to_target.py), for ``steps`` updates."""
    return [f"--seed={seed}", f"--learning_rate={lr}", "--min_lr=0.0", f"--warmup_iters={warmup}",
            "--n_layer=4", "--n_head=4", "--n_embd=128", "--block_size=64", "--batch_size=32",
            "--gradient_accumulation_steps=4", f"--eval_interval={steps}", "--eval_iters=16", "--schedule=wsd",
            f"--max_iters={steps}", f"--cooldown_iters={round(0.2 * steps)}"]


def run(method: str, extra: list, out: Path, loopback: bool, timeout: float) -> dict:
    """One run of ``method`` on 2 ranks (one per namespace, or loopback); its logs."""
    script, settings_of_method, flags = METHODS[method]
    out.mkdir(parents=True, exist_ok=True)
    cmds = _launch.torchrun_commands([*flags, str(NANOGPT / script), f"--out_dir={out}", *extra, *settings_of_method],
                                     2, loopback,
                                     script=NANOGPT / "instrument.py")
    logs, failed = _launch.run_processes(cmds, timeout=timeout)
    if failed or not (out / "train_log.json").exists():
        raise RuntimeError(f"{method} failed:\n" + "\n".join(text[-3000:] for text in logs))
    return {"train": json.loads((out / "train_log.json").read_text()), "val": json.loads((out / "log.json").read_text())}


def per_update(train: list, warmup: int) -> float:
    """Training seconds per update over the updates after ``warmup``."""
    return (train[-1]["time"] - train[warmup - 1]["time"]) / (len(train) - warmup)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["speed", "e2e"])
    p.add_argument("--rate", type=float, default=50.0, help="Mbit/s per rank and direction")
    p.add_argument("--methods", default="ddp,acco,acco-bf16")
    p.add_argument("--updates", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10, help="updates not timed (speed)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--schedule-warmup", type=int, default=100, help="the schedule's warm-up (the study's main)")
    p.add_argument("--run", action="append", default=[], help="e2e: METHOD:T, a whole run of T updates")
    p.add_argument("--loopback", action="store_true", help="no namespaces, no rate limit")
    p.add_argument("--calibrate", action="store_true", help="print the rate at which a round lasts half an update")
    p.add_argument("--timeout", type=float, default=7200.0)
    p.add_argument("--out", type=Path, required=False)
    args = p.parse_args(argv)
    if args.calibrate:
        with tempfile.TemporaryDirectory() as tmp:
            logs = run("ddp", settings(args, "ddp", args.lr, 0, 40, 10), Path(tmp), True, args.timeout)
        t = per_update(logs["train"], 10)
        print(f"DDP on loopback: {t:.3f} s per update; a round of {ROUND_BYTES / 1e6:.2f} MB per rank lasts half of "
              f"it at {ROUND_BYTES * 8 / (t / 2) / 1e6:.0f} Mbit/s")
        return
    if not args.loopback and os.geteuid() != 0:
        sys.exit("benchmarks/time_to_target.py builds a network namespace per rank: run it as root, or --loopback")
    if not args.loopback:
        netns.up(2, args.rate)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    try:
        with tempfile.TemporaryDirectory() as tmp, args.out.open("a") as f:
            if args.what == "speed":
                for repeat in range(args.repeats):
                    for method in args.methods.split(","):
                        logs = run(method, settings(args, method, args.lr, args.seed, args.updates, args.schedule_warmup),
                                   Path(tmp) / f"{method}-{repeat}", args.loopback, args.timeout)
                        t = per_update(logs["train"], args.warmup)
                        rec = {"label": LABELS.get(method, method), "method": method, "repeat": repeat,
                               "rate_mbit": args.rate, "seconds_per_update": t, "tokens_per_s": 16384 / t,
                               "updates": args.updates, "date": time.strftime("%Y-%m-%d")}
                        f.write(json.dumps(rec) + "\n")
                        f.flush()
                        print(f"repeat {repeat + 1}/{args.repeats} {method:10s} {t:.3f} s per update", flush=True)
            else:
                for spec in args.run:
                    method, steps = spec.split(":")
                    logs = run(method, settings(args, method, args.lr, args.seed, int(steps), args.schedule_warmup),
                               Path(tmp) / f"e2e-{method}", args.loopback, args.timeout)
                    rec = {"method": method, "T": int(steps), "seed": args.seed, "rate_mbit": args.rate,
                           "train_s": logs["train"][-1]["time"], "final_val_loss": logs["val"][-1]["val_loss"],
                           "date": time.strftime("%Y-%m-%d")}
                    f.write(json.dumps(rec) + "\n")
                    f.flush()
                    print(json.dumps(rec), flush=True)
                    shutil.rmtree(Path(tmp) / f"e2e-{method}", ignore_errors=True)
    finally:
        if not args.loopback:
            netns.down()


if __name__ == "__main__":
    main()
