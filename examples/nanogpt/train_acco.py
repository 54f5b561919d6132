"""The same nanoGPT-style loop ported to AccoOptimizer: the "after" of the porting guide.

Run: torchrun --standalone --nproc_per_node=2 examples/nanogpt/train_acco.py --out_dir=runs/acco
Settings are `--key=value` overrides of the globals below, as in nanoGPT.
"""

import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch.distributed import destroy_process_group, init_process_group

import acco

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "gpt"))
sys.path.insert(0, os.path.dirname(__file__))
from data import load_corpus  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from optim import configure_optimizers  # noqa: E402

out_dir = "runs/nanogpt"
eval_interval = 20
eval_iters = 4
init_from = "scratch"  # or "resume"
gradient_accumulation_steps = 4
batch_size = 4
block_size = 64
n_layer, n_head, n_embd = 2, 2, 64
learning_rate, min_lr, warmup_iters, max_iters = 1e-3, 1e-4, 5, 60
optimizer_name, muon_lr = "adamw", 0.02  # or "muon": 2-D hidden matrices to torch.optim.Muon at muon_lr, the rest AdamW
schedule, cooldown_iters = "cosine", 0  # or "wsd": warm-up, constant, then linear to min_lr over the last cooldown_iters
keep_ckpts = ""  # comma-separated iterations whose checkpoint is also kept as ckpt-<iter>.pt (to branch from)
resume_from = "ckpt.pt"  # the checkpoint --init_from=resume loads (relative to out_dir)
weight_decay, beta1, beta2, grad_clip = 0.1, 0.9, 0.95, 1.0
stop_at = -1  # stop (as if killed) after this iteration, for resume tests
seed = 0  # model init and data order
mode = "acco"  # or the baselines: "sync" (ZeRO-1, no overlap), "dpu" (delayed, uncompensated)
for arg in sys.argv[1:]:
    key, val = arg[2:].split("=", 1)
    globals()[key] = type(globals()[key])(val)

init_process_group(backend="gloo")
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
master_process = rank == 0
if master_process:
    os.makedirs(out_dir, exist_ok=True)
torch.manual_seed(1337 + seed)
train_data, val_data = load_corpus(None)


def get_batch(split, it, micro):
    # a pure function of (split, iteration, micro-step, rank): a resumed run sees the same batches
    data = train_data if split == "train" else val_data
    g = torch.Generator().manual_seed(1 + 100_000 * it + 100 * micro + rank + 10**9 * seed if split == "train" else 7 + micro)
    ix = torch.randint(len(data) - block_size - 1, (batch_size,), generator=g)
    x = torch.stack([data[i : i + block_size] for i in ix.tolist()]).long()
    y = torch.stack([data[i + 1 : i + 1 + block_size] for i in ix.tolist()]).long()
    return x, y


def loss_of(model, x, y):
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


model = GPT(GPTConfig(seq_len=block_size, d_model=n_embd, n_layers=n_layer, n_heads=n_head, local_window=block_size))
optimizers = configure_optimizers(model, optimizer_name, learning_rate, muon_lr, weight_decay, (beta1, beta2))
optimizer = acco.AccoOptimizer.from_optimizer(optimizers, mode=mode, microbatches_per_update=gradient_accumulation_steps,
                                              max_grad_norm=grad_clip or None)
iter_num = 0
if init_from == "resume":
    checkpoint = torch.load(os.path.join(out_dir, resume_from), weights_only=True)
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    iter_num = checkpoint["iter_num"]
raw_model = model


def get_lr(it):
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if schedule == "wsd":
        return learning_rate - (learning_rate - min_lr) * max(0, it - max_iters + cooldown_iters) / max(1, cooldown_iters)
    ratio = (it - warmup_iters) / (max_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)


@torch.no_grad()
def estimate_loss():
    model.eval()
    losses = torch.tensor([loss_of(raw_model, *get_batch("val", 0, k)).item() for k in range(eval_iters)])
    model.train()
    return losses.mean().item()


log, train_log, keep, train_time = [], [], {int(i) for i in keep_ckpts.split(",") if i}, 0.0
while True:
    lr = get_lr(iter_num)
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr * param_group.get("lr_scale", 1.0)
    save = iter_num > 0 and (iter_num % eval_interval == 0 or iter_num in keep)
    if save:  # every rank: the committed model, every rank's shard
        state = acco.checkpoint.gather(optimizer, model=raw_model)
    if (iter_num % eval_interval == 0 or iter_num == max_iters) and master_process:
        with optimizer.committed_weights():
            val_loss = estimate_loss()
        log.append({"iter": iter_num, "val_loss": val_loss})
        print(f"iter {iter_num}: val loss {val_loss:.4f}", flush=True)
    if save and master_process:
        checkpoint = {"model": state["model"], "optimizer": state["optimizer"], "iter_num": iter_num}
        torch.save(checkpoint, os.path.join(out_dir, "ckpt.pt"))
        if iter_num in keep:
            torch.save(checkpoint, os.path.join(out_dir, f"ckpt-{iter_num}.pt"))
    if iter_num == max_iters or iter_num == stop_at:
        break
    train_loss, t0 = 0.0, time.perf_counter()
    for micro_step in range(gradient_accumulation_steps):
        x, y = get_batch("train", iter_num, micro_step)
        loss = loss_of(model, x, y) / gradient_accumulation_steps
        loss.backward()
        train_loss += loss.item()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    train_time += time.perf_counter() - t0  # training only: evaluations and checkpoints are not counted
    train_log.append({"iter": iter_num, "train_loss": train_loss, "time": train_time})
    iter_num += 1

optimizer.finish()
if master_process:
    torch.save(raw_model.state_dict(), os.path.join(out_dir, "final.pt"))
    with open(os.path.join(out_dir, "log.json"), "w") as f:
        json.dump(log, f)
    with open(os.path.join(out_dir, "train_log.json"), "w") as f:
        json.dump(train_log, f)
destroy_process_group()
