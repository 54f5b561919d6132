"""transformers.Trainer (AdamW, DDP) or acco's AccoTrainer on a tiny GPT-2, under torchrun (2 gloo ranks).

usage: hf_trainer_script.py OUT {adamw|acco|split|split-sync} [RESUME_CHECKPOINT]
split / split-sync: the Muon + AdamW split (the blocks' 2-D weights to Muon, lr 0.02), built by the user as one
AccoOptimizer and passed as AccoTrainer(optimizers=(opt, None)), in mode acco / sync (docs/integrations.md).
Writes OUT/result.json (eval loss, large all-reduces seen in backward) and OUT/final.pt (rank 0).
ACCO_TEST_CUDA=1: on the GPU with bf16 autocast (TrainingArguments(bf16=True)), as GPU users run it
(tests/test_cuda.py).
"""

import json
import os
import sys

import torch
from bytes_data import SEQ, Bytes
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

out, variant = sys.argv[1], sys.argv[2]
resume = sys.argv[3] if len(sys.argv) > 3 else None
cuda = os.environ.get("ACCO_TEST_CUDA") == "1"


class CountAllReduces(TrainerCallback):
    """Profile two training steps; count the all-reduces issued inside backward passes (DDP's gradient buckets),
    not Trainer's own (logging, token counts)."""

    def __init__(self) -> None:
        self.prof, self.count = None, None

    def on_step_begin(self, args, state, control, **kw):
        if state.global_step == 2:
            self.prof = torch.profiler.profile()
            self.prof.__enter__()

    def on_step_end(self, args, state, control, **kw):
        if self.prof is not None and state.global_step == 4:
            self.prof.__exit__(None, None, None)
            # host-side events only: on CUDA a record_function range appears a second time, as a GPU annotation
            events = [e for e in self.prof.events() if e.device_type == torch.autograd.DeviceType.CPU]
            backward = [e.time_range for e in events if e.name == "backward_pass"]
            assert len(backward) == 2 * args.gradient_accumulation_steps, len(backward)
            self.count = sum(1 for e in events if "allreduce" in e.name.lower()
                             and any(b.start <= e.time_range.start <= b.end for b in backward))
            self.prof = None


def labelled_backward(backward):
    def run(*args, **kwargs):
        with torch.profiler.record_function("backward_pass"):
            return backward(*args, **kwargs)
    return run


torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=SEQ, n_embd=64, n_layer=2, n_head=2))
args = TrainingArguments(
    output_dir=out, use_cpu=not cuda, bf16=cuda, per_device_train_batch_size=4, gradient_accumulation_steps=2,
    max_steps=30, learning_rate=1e-3, lr_scheduler_type="cosine", warmup_steps=3, weight_decay=0.1,
    max_grad_norm=1.0, save_steps=10, save_strategy="steps", logging_steps=10, report_to="none", seed=0,
    dataloader_num_workers=0, disable_tqdm=True,
    ddp_find_unused_parameters=False,  # else DDP all-reduces a small used-parameter map every backward
)
counter = CountAllReduces()
kw = dict(model=model, args=args, train_dataset=Bytes(0, 480), eval_dataset=Bytes(480 * SEQ, 64), callbacks=[counter])
if variant in ("acco", "acco-int8"):
    from acco.integrations.hf import AccoTrainer

    trainer = AccoTrainer(**kw, acco_kwargs={"compression": "int8"} if variant == "acco-int8" else None)
elif variant.startswith("split"):
    from acco import AccoOptimizer
    from acco.integrations.hf import AccoTrainer

    mode = "sync" if variant == "split-sync" else "acco"
    hidden = [p for n, p in model.named_parameters() if p.ndim == 2 and ".h." in n]
    others = [p for n, p in model.named_parameters() if not (p.ndim == 2 and ".h." in n)]
    opt = AccoOptimizer.from_optimizer([torch.optim.Muon(hidden, lr=0.02),
                                        torch.optim.AdamW(others, lr=1e-3, weight_decay=0.1)],
                                       mode=mode, microbatches_per_update=2 if mode == "acco" else None,
                                       max_grad_norm=1.0)
    trainer = AccoTrainer(**kw, optimizers=(opt, None), acco_mode=mode)
else:
    trainer = Trainer(**kw)
trainer.accelerator.backward = labelled_backward(trainer.accelerator.backward)
trainer.train(resume_from_checkpoint=resume)
metrics = trainer.evaluate()
if trainer.args.process_index == 0:
    torch.save(trainer.model.state_dict(), os.path.join(out, "final.pt"))
    with open(os.path.join(out, "result.json"), "w") as f:
        acco_opt = getattr(trainer, "acco_optimizer", None)
        json.dump({"eval_loss": metrics["eval_loss"], "allreduces": counter.count,
                   "residual_bytes": acco_opt.memory_report()["residual"] if acco_opt is not None else None,
                   "log": trainer.state.log_history}, f)
torch.distributed.barrier()
torch.distributed.destroy_process_group()  # a clean shutdown for the baseline too (gloo at interpreter exit)
