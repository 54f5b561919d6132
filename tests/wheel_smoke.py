"""The installed wheel on its own (``make dist-check``): run with a fresh venv's python, outside the clone.

Checks that ``import acco`` comes from the venv, not from ``--source`` (the clone), that two gloo ranks take
ACCO steps and end with equal weights, and that the ``acco-probe`` command is installed. Not collected by pytest.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile


def _rank(rank: int, world: int, store: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    from acco import AccoOptimizer

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    opt = AccoOptimizer(model.parameters(), microbatches_per_update=2, lr=1e-2)
    g = torch.Generator().manual_seed(1 + rank)
    for _ in range(3):
        for _ in range(2):
            x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
            (((model(x) - y) ** 2).mean() / 2).backward()
        opt.step()
        opt.zero_grad()
    opt.finish()
    torch.save([p.detach() for p in model.parameters()], os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--source", required=True, help="the clone the wheel was built from (acco must not load from it)")
    args = p.parse_args()

    import torch
    import torch.multiprocessing as mp

    import acco

    clone_src = os.path.join(os.path.realpath(args.source), "src") + os.sep
    where = os.path.realpath(acco.__file__)
    assert not where.startswith(clone_src) and f"{os.sep}site-packages{os.sep}" in where, \
        f"acco imported from {where}, not from the wheel installed in the venv's site-packages"
    print(f"import acco: {where}")

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank, args=(2, os.path.join(tmp, "store"), tmp), nprocs=2, join=True)
        a, b = (torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(2))
    assert all(torch.equal(x, y) for x, y in zip(a, b)), "the two ranks ended with different weights"
    print("2 gloo ranks, mode acco, 3 updates: equal weights on both ranks")

    probe = os.path.join(os.path.dirname(sys.executable), "acco-probe")
    out = subprocess.run([probe, "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "usage" in out.stdout.lower(), out.stdout + out.stderr
    print("acco-probe --help: exit 0")


if __name__ == "__main__":
    main()
