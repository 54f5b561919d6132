"""Memory per rank: the library's buffers and the peak process memory, next to torch DDP+ZeRO.

    .venv/bin/python benchmarks/memory.py --out runs/bench/memory.jsonl
    .venv/bin/python benchmarks/report.py runs/bench/memory.jsonl

Two ranks on loopback (memory does not depend on the network), a GPT of about
26M parameters with tiny micro-batches so that parameter-sized buffers dominate.
Each method runs in fresh processes; ``peak_rss_bytes`` is ``ru_maxrss``. The
compute-only run (model, activations, AdamW on a 1/N slice) is the baseline.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _launch  # noqa: E402

MODEL = ["--d-model", "512", "--layers", "8", "--seq-len", "64", "--micro-batch", "1", "--updates", "2", "--warmup", "1"]
SMOKE = ["--d-model", "64", "--layers", "2", "--seq-len", "32", "--micro-batch", "1", "--updates", "1", "--warmup", "1"]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", default="compute,acco,dpu,sync,ddp-zero")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--smoke", action="store_true", help="a tiny model: checks the script runs")
    p.add_argument("--out", type=Path, default=Path("runs/bench/memory.jsonl"))
    args = p.parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("a") as f:
        for method in args.methods.split(","):
            rec = _launch.run_worker(["--method", method, *(SMOKE if args.smoke else MODEL)], args.ranks, loopback=True)
            rec.update(tag="memory", rate_mbit=None, label=method)
            f.write(json.dumps(rec) + "\n")
            mem = rec.get("memory") or {}
            print(f"{method:9s} peak RSS rank 0 {rec['peak_rss_bytes'][0] / 2**20:7.0f} MiB  "
                  + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in mem.items() if v), flush=True)


if __name__ == "__main__":
    main()
