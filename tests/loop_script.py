"""The most common script shape: ``main()`` trains and returns, with no ``finish()`` and no
``destroy_process_group()``. Four optimizers train side by side, one per loop: modes acco, dpu and sync, and acco
with ``accumulate_while_communicating``, so one launch ends all four the same way.

usage: loop_script.py UPDATES [--ckpt DIR]   (under torchrun; tests/ending.py ends it in other ways)
--ckpt DIR: after every update, ``acco.checkpoint.save(DIR/update_N)`` of the mode-acco optimizer.
"""

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from tinynet import loss_fn, make_model  # noqa: E402

import acco.checkpoint  # noqa: E402
from acco import AccoOptimizer  # noqa: E402

SETUPS = {"acco": {"mode": "acco"}, "dpu": {"mode": "dpu"}, "sync": {"mode": "sync"},
          "awc": {"mode": "acco", "accumulate_while_communicating": True}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("updates", type=int)
    parser.add_argument("--ckpt", default=None)
    cli = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    models = {name: make_model() for name in SETUPS}
    opts = {name: AccoOptimizer(models[name].parameters(), lr=1e-2, **kw) for name, kw in SETUPS.items()}
    for t in range(cli.updates):
        for name, model in models.items():
            for j in range(2):
                (loss_fn(model, rank, 2 * t + j) / 2).backward()
                if name == "awc":
                    opts[name].step()  # this loop steps after every micro-batch
            if name != "awc":
                opts[name].step()
            model.zero_grad()
        if cli.ckpt:
            acco.checkpoint.save(os.path.join(cli.ckpt, f"update_{t:04d}"), opts["acco"], model=models["acco"])
    print(f"rank {rank} trained {cli.updates} updates; rounds in flight: "
          f"{sum(o.scheduler.in_flight for o in opts.values())}", flush=True)
    # returns: no finish(), no destroy_process_group()


if __name__ == "__main__":
    main()
