"""Run by test_faults.py under torchrun: train with checkpoints, optionally killing rank 1 once.

    torchrun --standalone --nproc_per_node=2 --max-restarts=1 tests/resume_script.py OUT TOTAL EVERY KILL_AT
"""

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from test_checkpoint import KW, global_loss  # noqa: E402
from tinynet import flat, make_model  # noqa: E402

import acco  # noqa: E402
import acco.checkpoint as ckpt  # noqa: E402
from acco import AccoOptimizer  # noqa: E402


def main(out, total, every, kill_at):
    torch.set_num_threads(1)
    acco.init_process_group("gloo")  # a store prefix per restart attempt
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model()
    opt = AccoOptimizer(model.parameters(), mode="acco", accumulate_while_communicating=True, max_microbatches=1, **KW)
    path = os.path.join(out, "ckpt")
    start = 0
    if os.path.exists(path) or os.path.exists(path + ".old"):
        start = int(ckpt.load(path, opt, extra={"i": torch.tensor(0)})["i"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    for i in range(start, total):
        if attempt == 0 and rank == 1 and i == kill_at:
            os._exit(17)  # killed: no clean-up, no exception
        global_loss(model, rank, world, i).backward()
        opt.step()
        opt.zero_grad()
        if opt.at_update_boundary and (i + 1) % every == 0:
            ckpt.save(path, opt, extra={"i": torch.tensor(i + 1)})
    opt.finish()
    if rank == 0:
        torch.save({"w": flat(model), "attempt": attempt, "start": start}, os.path.join(out, "final.pt"))
    dist.barrier()
    del opt, model
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
