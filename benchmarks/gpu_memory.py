"""GPU memory per optimizer on one GPU, in copies of the parameters (fp32), with memory_report's parts.

    python benchmarks/gpu_memory.py             # on a GPU (docs/studies/gpu-runs.md records its output)
    python benchmarks/gpu_memory.py --dry-run   # CPU, tiny model: the script runs, memory not measured (CI)

gpu_check.py's model, no process group (one rank: the master slice is the whole model). "steady": allocated
after 3 updates, synchronised; "peak": the most allocated during 2 more. Both above what was allocated before
the model was built.
"""
import argparse
import gc
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from gpu_check import batches, make_model, synchronize, train  # noqa: E402
from gpu_time import CONFIGS, build  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true")
    args = p.parse_args()
    if not args.dry_run and not torch.cuda.is_available():
        p.error("no CUDA device: run on a GPU machine, or pass --dry-run")
    device = "cpu" if args.dry_run else "cuda"
    cuda = device == "cuda"
    width, layers, batch, m = (64, 2, 4, 4) if args.dry_run else (4096, 8, 16, 4)
    data = batches(width, batch, device, 8)
    size = sum(p.numel() for p in make_model(width, layers, "cpu").parameters()) * 4
    print(f"params {size / 2**20:.1f} MiB; figures below in parameter copies"
          + ("" if cuda else " (dry run: memory not measured, memory_report only)"))
    for name in CONFIGS:
        gc.collect()  # the previous configuration's optimizer and model
        if cuda:
            torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated() if cuda else 0
        model, opt = build(name, width, layers, device, m)
        train(model, opt, data, 3, m)
        synchronize(device)
        steady = (torch.cuda.memory_allocated() - base) if cuda else 0
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        train(model, opt, data, 2, m)
        synchronize(device)
        peak = (torch.cuda.max_memory_allocated() - base) if cuda else 0
        rep = opt.memory_report() if hasattr(opt, "memory_report") else {}
        parts = {k: round(v / size, 2) for k, v in rep.items() if isinstance(v, (int, float)) and v}
        print(f"{name:12s} steady {steady / size:5.2f}  peak {peak / size:5.2f}  report {parts}")
        if hasattr(opt, "finish"):
            opt.finish()
        del model, opt


if __name__ == "__main__":
    main()
