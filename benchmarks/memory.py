"""Memory per rank: the library's buffers and the peak process memory, next to torch DDP and DDP+ZeRO.

    .venv/bin/python benchmarks/memory.py --out runs/bench/memory.jsonl
    .venv/bin/python benchmarks/report.py runs/bench/memory.jsonl

Ranks on loopback (memory does not depend on the network), a GPT of about 26M
parameters with tiny micro-batches so that parameter-sized buffers dominate.
The library's methods run its default loop (``worker.py --loop update``: two
``backward()``, one ``step()``). For every rank count and dtype, every method
runs once per repeat in fresh processes, the methods interleaved; with bf16,
torch DDP+ZeRO runs twice: pure bf16 (``ddp-zero``) and fp32 parameters under
autocast (``ddp-zero-amp``, fp32 master and state as the library keeps).
``peak_rss_bytes`` is every rank's ``ru_maxrss``. The compute-only run (model,
activations, AdamW on a 1/N slice) is the baseline.
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


def plan(methods, dtype: str):
    """(label, method, worker dtype) of one repeat: the methods in order, ddp-zero also under amp for bf16."""
    runs = []
    for m in methods:
        runs.append((m, m, dtype))
        if m == "ddp-zero" and dtype == "bf16":
            runs.append(("ddp-zero-amp", m, "amp"))
    return runs


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", default="compute,acco,dpu,sync,ddp,ddp-zero")
    p.add_argument("--ranks", default="2,4", help="rank counts, comma-separated")
    p.add_argument("--dtypes", default="fp32,bf16", help="worker.py dtypes, comma-separated (fp32, bf16)")
    p.add_argument("--repeats", type=int, default=3, help="runs of every method per rank count and dtype, interleaved")
    p.add_argument("--loop", choices=["awc", "update"], default="update", help="worker.py --loop (library methods)")
    p.add_argument("--smoke", action="store_true", help="a tiny model: checks the script runs")
    p.add_argument("--out", type=Path, default=Path("runs/bench/memory.jsonl"))
    args = p.parse_args(argv)
    methods = args.methods.split(",")
    _launch.check_loop(methods, args.loop)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("a") as f:
        for ranks in [int(x) for x in args.ranks.split(",")]:
            for dtype in args.dtypes.split(","):
                for repeat in range(args.repeats):
                    for label, method, wdtype in plan(methods, dtype):
                        wargs = ["--method", method, "--dtype", wdtype, "--loop", args.loop,
                                 *(SMOKE if args.smoke else MODEL)]
                        rec = _launch.run_worker(wargs, ranks, loopback=True)
                        # point_dtype: the dtype of the comparison this run belongs to (bf16 for ddp-zero-amp)
                        rec.update(tag="memory", rate_mbit=None, label=label, ranks=ranks, point_dtype=dtype,
                                   repeat=repeat)
                        f.write(json.dumps(rec) + "\n")
                        f.flush()
                        mem = rec.get("memory") or {}
                        print(f"{ranks} ranks {dtype} repeat {repeat + 1}/{args.repeats}  {label:12s} peak RSS "
                              f"{max(rec['peak_rss_bytes']) / 2**20:7.0f} MiB (max over ranks)  "
                              + ", ".join(f"{k} {v / 2**20:.1f}" for k, v in mem.items() if v), flush=True)


if __name__ == "__main__":
    main()
