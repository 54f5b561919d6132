"""DDP + PowerSGD (rank 4) beyond the time-to-target study's longest search: a fully decayed run of
``--factor`` x DDP's 500 updates, branched from the study's own PowerSGD trunk (docs/studies/time-to-target.md,
"PowerSGD beyond 1.5x").

    nice -n 19 .venv/bin/python examples/nanogpt/powersgd_long.py --seeds 0 --factor 2.5

The trunk (constant LR after the warm-up) goes on from its latest kept checkpoint (in a fresh clone, from update
0) to the branch's start, then the branch cools down over the last 20%, as every branch of the study. Records:
docs/convergence_data/powersgd_long.jsonl.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import time_to_target as ttt  # noqa: E402

OUT = ttt.ROOT / "docs" / "convergence_data" / "powersgd_long.jsonl"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[0])
    p.add_argument("--factor", type=float, default=2.5)
    a = p.parse_args(argv)
    args = ttt.parse(["--methods", "ddp,ddp-powersgd", "--warmups", "100", "--lengths", "500", "--floors", "0.0",
                      "--acco-lrs=", "--no-plots"])
    script, _, flags = ttt.METHODS["ddp-powersgd"]
    t = int(round(500 * a.factor))
    start = ttt.start_of(t, args.cooldown_frac)
    for seed in a.seeds:
        line = {"method": "ddp-powersgd", "lr": args.lr, "warmup": 100, "seed": seed}
        trunk = ttt.trunk_dir(args, line)
        # the study's trunk's latest kept checkpoint, or none (a fresh clone: the trunk runs from update 0)
        kept = max((int(f.stem.split("-")[1]) for f in trunk.glob("ckpt-*.pt") if f.stem.split("-")[1].isdigit()),
                   default=0)
        base = ttt.overrides_of(args, line)
        long_trunk = trunk.parent / f"{trunk.name}-to{start}"
        if not (long_trunk / f"ckpt-{start}.pt").exists():
            print(f"seed {seed}: trunk from {kept} to {start}", flush=True)
            resume = (["--init_from=resume", f"--resume_from={(trunk / f'ckpt-{kept}.pt').resolve()}"] if kept
                      else [])
            ttt.launch(script, flags, base + [f"--max_iters={start}", "--cooldown_iters=0", f"--min_lr={args.lr}",
                                              f"--keep_ckpts={start}"] + resume, long_trunk)
        print(f"seed {seed}: branch T={t} from {start}", flush=True)
        evals, train, _, wall = ttt.launch(script, flags, base + [
            f"--max_iters={t}", f"--cooldown_iters={t - start}", "--min_lr=0.0", "--init_from=resume",
            f"--resume_from={(long_trunk / f'ckpt-{start}.pt').resolve()}"], long_trunk.parent / f"{trunk.name}-T{t}")
        record = ttt.record_of(args, {"kind": "branch", "line": line, "T": t, "floor": 0.0, "start": start}, evals,
                               train, wall)
        record["trunk_from"] = kept
        with open(OUT, "a") as f:
            f.write(json.dumps(record) + "\n")
        print(f"seed {seed}: T={t} final held-out loss {record['final_val_loss']:.4f}", flush=True)


if __name__ == "__main__":
    main()
