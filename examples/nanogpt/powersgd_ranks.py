"""Is DDP + PowerSGD's gap in the time-to-target study its rank? 150 updates of seed 0 at the study's trunk
settings (DDP's best LR 4e-3, warm-up 100, constant after it), DDP against PowerSGD at ranks 4, 16 and 32
(docs/studies/time-to-target.md, "PowerSGD beyond 1.5x").

    nice -n 19 .venv/bin/python examples/nanogpt/powersgd_ranks.py none powersgd powersgd:16 powersgd:32

Writes docs/convergence_data/powersgd_ranks.json: per hook, the held-out curve and the mean train loss of
updates 101-150.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import time_to_target as ttt  # noqa: E402

OUT = ttt.ROOT / "docs" / "convergence_data" / "powersgd_ranks.json"


def main(hooks) -> None:
    args = ttt.parse(["--methods", "ddp,ddp-powersgd", "--warmups", "100", "--lengths", "500", "--floors", "0.0",
                      "--acco-lrs=", "--no-plots"])
    out = {}
    for hook in hooks:
        line = {"method": "ddp", "lr": args.lr, "warmup": 100, "seed": 0}
        flags = [] if hook == "none" else [f"--ddp-hook={hook}"]
        overrides = ttt.overrides_of(args, line) + ["--max_iters=150", "--cooldown_iters=0", f"--min_lr={args.lr}"]
        evals, train, _, wall = ttt.launch("train_ddp.py", flags, overrides, args.workdir / f"powersgd-ranks-{hook}")
        losses = [t["train_loss"] for t in train]
        out[hook] = {"val": [[e["iter"], e["val_loss"]] for e in evals],
                     "train_101_150": statistics.fmean(losses[100:150]), "wall": wall}
        print(hook, out[hook]["val"][-1], flush=True)
    OUT.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:] or ["none", "powersgd", "powersgd:16", "powersgd:32"])
