"""Time per update of ACCO's modes against torch's AdamW on one GPU, and where the host's time goes.

    python benchmarks/gpu_time.py                       # on a GPU (docs/studies/gpu-runs.md records its output)
    SRC=/other/checkout/src python benchmarks/gpu_time.py   # the same for another version of the library
    python benchmarks/gpu_time.py --dry-run             # CPU, tiny model: the script runs (CI)

gpu_check.py's model (8 Linear layers of 4096, batch 16, 4 micro-batches per update), no process group.
Per configuration, three interleaved repeats of 3 warm-up and 10 timed updates: the wall time per update
(synchronised), and the host's time inside ``backward()`` (where mode acco hands off its estimate round)
and inside ``step()``. ``--tables`` adds torch.profiler's top kernels of ACCO and AdamW.
"""
import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.environ.get("SRC") or os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import acco  # noqa: E402
from acco import AccoOptimizer  # noqa: E402
from gpu_check import batches, make_model, synchronize  # noqa: E402

CONFIGS = ["adamw", "adamw-fused", "sync", "dpu", "acco", "acco-fused", "acco-cap", "acco-nocap", "acco-extrap",
           "acco-fused-extrap"]


def build(name: str, width: int, layers: int, device: str, m: int):
    """``adamw[-fused]``: torch's AdamW; ``MODE[-fused|-cap|-nocap][-extrap]``: AccoOptimizer over AdamW (the
    default: on CUDA the fused kernel; ``fused=True``; ``foreach=True``, capturable foreach kernels; ``foreach=True,
    capturable=False``: the host decides a skipped round, one sync per round; ``-extrap``: the estimate extrapolated
    by 1.2, without it by 1.0, both named: "auto", the default, is 1.2 for AdamW since the records of docs/gpu.md)."""
    model = make_model(width, layers, device)
    cuda = device.startswith("cuda")
    if name.startswith("adamw"):
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=name.endswith("fused") and cuda or None)
    mode, *rest = name.split("-")
    kw = {"fused": True} if "fused" in rest and cuda else {}
    if "cap" in rest and cuda:
        kw["foreach"] = True  # capturable added by the library
    if "nocap" in rest and cuda:
        kw.update(foreach=True, capturable=False)
    kw["estimate_extrapolation"] = 1.2 if "extrap" in rest else 1.0
    return model, AccoOptimizer(model.parameters(), mode=mode, microbatches_per_update=m, lr=1e-4, **kw)


def run(model, opt, data, updates: int, m: int, host: dict) -> None:
    for t in range(updates):
        for j in range(m):
            x, y = data[(t * m + j) % len(data)]
            t0 = time.perf_counter()
            (((model(x) - y) ** 2).mean() / m).backward()
            host["backward"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        opt.step()
        host["step"] += time.perf_counter() - t0
        opt.zero_grad()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="CPU, a tiny model")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tables", action="store_true", help="print the profiler's top kernels of acco and adamw")
    args = p.parse_args()
    if not args.dry_run and not torch.cuda.is_available():
        p.error("no CUDA device: run on a GPU machine, or pass --dry-run")
    device = "cpu" if args.dry_run else "cuda"
    width, layers, m = (64, 2, 4) if args.dry_run else (4096, 8, 4)
    configs = args.configs.split(",")
    data = batches(width, args.batch, device, 8)
    res = {c: [] for c in configs}
    for _ in range(args.repeats):
        for c in configs:  # interleaved: A B C ... A B C ...
            model, opt = build(c, width, layers, device, m)
            run(model, opt, data, 3, m, {"backward": 0.0, "step": 0.0})
            synchronize(device)
            host = {"backward": 0.0, "step": 0.0}
            n = 10
            t0 = time.perf_counter()
            run(model, opt, data, n, m, host)
            synchronize(device)
            res[c].append(((time.perf_counter() - t0) / n, host["backward"] / n, host["step"] / n))
            if hasattr(opt, "finish"):
                opt.finish()
            del model, opt
            if device == "cuda":
                torch.cuda.empty_cache()
    print("acco from", os.path.dirname(acco.__file__))
    print(f"batch {args.batch}: median over {args.repeats} repeats, ms per update: wall | host in backward() | host in step()")
    for c in configs:
        w, b, s = (statistics.median(x[i] for x in res[c]) * 1e3 for i in range(3))
        lo, hi = min(x[0] for x in res[c]) * 1e3, max(x[0] for x in res[c]) * 1e3
        print(f"  {c:18s} {w:8.2f} | {b:8.2f} | {s:8.2f}   (wall range {lo:.2f}-{hi:.2f})")
    for c in ("acco", "adamw") if args.tables else ():
        from torch.profiler import ProfilerActivity, profile

        model, opt = build(c, width, layers, device, m)
        run(model, opt, data, 3, m, {"backward": 0.0, "step": 0.0})
        synchronize(device)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
        with profile(activities=activities) as prof:
            run(model, opt, data, 4, m, {"backward": 0.0, "step": 0.0})
            synchronize(device)
        if hasattr(opt, "finish"):
            opt.finish()
        key = "self_device_time_total" if device == "cuda" else "self_cpu_time_total"
        print(f"\n===== {c}: 4 updates, by {key}")
        print(prof.key_averages().table(sort_by=key, row_limit=22, max_name_column_width=70))


if __name__ == "__main__":
    main()
