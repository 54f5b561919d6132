"""An accelerate loop with torch AdamW (the accelerate idiom) or AccoOptimizer (the recipe of docs/integrations.md),
on a tiny GPT-2, under torchrun (2 gloo ranks).

usage: accelerate_script.py OUT {adamw|acco|split} [--save-at N] [--resume DIR]
split: the Muon + AdamW split (the blocks' 2-D weights to Muon, lr 0.02) as one AccoOptimizer (docs/integrations.md).
Writes OUT/result.json (eval loss, all-reduces inside backward passes) and OUT/final.pt (rank 0).
ACCO_TEST_CUDA=1: on the GPU with bf16 autocast (Accelerator(mixed_precision="bf16")), as GPU users run it
(tests/test_cuda.py).
"""

import argparse
import json
import math
import os

import torch
from bytes_data import SEQ, Bytes
from accelerate import Accelerator
from transformers import GPT2Config, GPT2LMHeadModel

import acco.integrations.accelerate
from acco import AccoOptimizer

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("variant", choices=["adamw", "acco", "split"])
parser.add_argument("--save-at", type=int, default=-1)
parser.add_argument("--resume", default=None)
cli = parser.parse_args()
os.makedirs(cli.out, exist_ok=True)
UPDATES, ACCUM = 30, 2


def lr_lambda(t):
    return min(1.0, (t + 1) / 4) * 0.5 * (1 + math.cos(math.pi * t / UPDATES))


cuda = os.environ.get("ACCO_TEST_CUDA") == "1"
accelerator = Accelerator(cpu=not cuda, mixed_precision="bf16" if cuda else "no", gradient_accumulation_steps=ACCUM)
torch.manual_seed(0)
config = GPT2Config(vocab_size=256, n_positions=SEQ, n_embd=64, n_layer=2, n_head=2,
                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
model = GPT2LMHeadModel(config)
loader = torch.utils.data.DataLoader(Bytes(0, 480), batch_size=4)
if cli.variant == "adamw":
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
else:
    model, loader = accelerator.prepare(model, loader)  # not the optimizer
    if cli.variant == "split":
        hidden = [p for n, p in model.named_parameters() if p.ndim == 2 and ".h." in n]
        others = [p for n, p in model.named_parameters() if not (p.ndim == 2 and ".h." in n)]
        opt = AccoOptimizer.from_optimizer([torch.optim.Muon(hidden, lr=0.02),
                                            torch.optim.AdamW(others, lr=1e-3, weight_decay=0.1)],
                                           microbatches_per_update=ACCUM, max_grad_norm=1.0, buffers=model.buffers())
    else:
        opt = AccoOptimizer(model.parameters(), torch.optim.AdamW, microbatches_per_update=ACCUM, max_grad_norm=1.0,
                            buffers=model.buffers(), lr=1e-3, weight_decay=0.1)
    acco.integrations.accelerate.prepare(accelerator, model, opt)
    sched = accelerator.prepare(torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda))

done = 0
if cli.resume:
    accelerator.load_state(cli.resume)
    done = int(open(os.path.join(cli.resume, "updates.txt")).read())
backward_ranges, allreduces = [], None
prof = None
batches = accelerator.skip_first_batches(loader, done * ACCUM) if done else loader
for batch in batches:
    if done == 2 and prof is None and allreduces is None:
        prof = torch.profiler.profile()
        prof.__enter__()
    with accelerator.accumulate(model):
        loss = model(**batch).loss
        with torch.profiler.record_function("backward_pass"):
            accelerator.backward(loss)
        if cli.variant == "adamw":
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad()
        elif accelerator.sync_gradients:
            opt.step()
            sched.step()
            opt.zero_grad()
    if accelerator.sync_gradients:
        done += 1
        if prof is not None and done == 4:
            prof.__exit__(None, None, None)
            # host-side events only: on CUDA a record_function range appears a second time, as a GPU annotation
            events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU]
            ranges = [e.time_range for e in events if e.name == "backward_pass"]
            allreduces = sum(1 for e in events if "allreduce" in e.name.lower()
                             and any(r.start <= e.time_range.start <= r.end for r in ranges))
            prof = None
        if done == cli.save_at:
            ctx = opt.committed_weights() if cli.variant != "adamw" else torch.no_grad()
            with ctx:
                accelerator.save_state(os.path.join(cli.out, "ckpt"))
            if accelerator.is_main_process:
                open(os.path.join(cli.out, "ckpt", "updates.txt"), "w").write(str(done))
        if done == UPDATES:
            break

if cli.variant != "adamw":
    opt.finish()  # the model now holds the last committed weights
unwrapped = accelerator.unwrap_model(model)
unwrapped.eval()
with torch.no_grad():
    held = Bytes(480 * SEQ, 64)
    rows = [torch.stack(held.rows[i:i + 16]).to(accelerator.device) for i in range(0, 64, 16)]
    eval_loss = sum(unwrapped(input_ids=r, labels=r).loss.item() for r in rows) / 4
if accelerator.is_main_process:
    torch.save(unwrapped.state_dict(), os.path.join(cli.out, "final.pt"))
    with open(os.path.join(cli.out, "result.json"), "w") as f:
        json.dump({"eval_loss": eval_loss, "allreduces": allreduces, "updates": done}, f)
accelerator.end_training()
