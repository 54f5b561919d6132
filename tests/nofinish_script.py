"""A torchrun script that trains in mode acco and exits without finish(), as Trainer-less loops do."""

import logging
import os
import sys

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from tinynet import loss_fn, make_model  # noqa: E402

from acco import AccoOptimizer  # noqa: E402

logging.basicConfig(level=logging.INFO, format="%(message)s")  # the exit handler says what it did
dist.init_process_group("gloo")
rank = dist.get_rank()
model = make_model()
opt = AccoOptimizer(model.parameters(), lr=1e-2)
for t in range(int(sys.argv[1]) if len(sys.argv) > 1 else 6):
    for j in range(2):
        (loss_fn(model, rank, 2 * t + j) / 2).backward()
    opt.step()
    model.zero_grad()
print(f"rank {rank} done, a round in flight: {opt.scheduler.in_flight}", flush=True)
# no opt.finish(), no destroy_process_group(): the process must still exit cleanly
