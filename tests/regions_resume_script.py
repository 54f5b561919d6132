"""Run by test_regions.py under torchrun: 2 regions x 2 ranks with checkpoints, optionally killing rank 3 (in the
second region) once, while an outer round is in flight.

    torchrun --standalone --nproc_per_node=4 --max-restarts=1 tests/regions_resume_script.py OUT UPDATES EVERY KILL_AT
"""

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from tinynet import flat, loss_fn, make_model  # noqa: E402

import acco  # noqa: E402
import acco.checkpoint as ckpt  # noqa: E402
from acco import AccoOptimizer  # noqa: E402

M = 2


def main(out, updates, every, kill_at):
    torch.set_num_threads(1)
    acco.init_process_group("gloo")  # a store prefix per restart attempt
    rank = dist.get_rank()
    regions = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    across = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    model = make_model()
    opt = AccoOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, microbatches_per_update=M,
                        process_group=regions[rank // 2], outer_group=across[rank % 2], outer_every=3, outer_delay=2,
                        outer_compression="int8", compression_block=16)
    path = os.path.join(out, "ckpt")
    start = 0
    if os.path.exists(path) or os.path.exists(path + ".old"):
        start = int(ckpt.load(path, opt, model=model, extra={"t": torch.tensor(0)})["t"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    for t in range(start, updates):
        if attempt == 0 and rank == 3 and t == kill_at:
            os._exit(17)  # killed: no clean-up, no exception
        for j in range(M):
            (loss_fn(model, rank, t * M + j) / M).backward()
        opt.step()
        opt.zero_grad()
        if (t + 1) % every == 0:
            ckpt.save(path, opt, model=model, extra={"t": torch.tensor(t + 1)})
    opt.finish()
    torch.save({"w": flat(model), "attempt": attempt, "start": start}, os.path.join(out, f"final{rank}.pt"))
    dist.barrier()
    del opt, model
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
