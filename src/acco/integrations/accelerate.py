"""An ``accelerate`` loop with an :class:`~acco.AccoOptimizer`: one call after ``accelerator.prepare``.

The recipe (docs/integrations.md shows the whole loop)::

    model, loader = accelerator.prepare(model, loader)   # not the optimizer
    opt = AccoOptimizer(model.parameters(), torch.optim.AdamW, microbatches_per_update=4,
                        max_grad_norm=1.0, buffers=model.buffers(), lr=3e-4)
    acco.integrations.accelerate.prepare(accelerator, model, opt)
    scheduler = accelerator.prepare(torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda))
    for batch in loader:
        with accelerator.accumulate(model):
            accelerator.backward(model(**batch).loss)
            if accelerator.sync_gradients:
                opt.step(); scheduler.step(); opt.zero_grad()
    with opt.committed_weights():
        accelerator.save_state("ckpt")     # model weights committed; optimizer via acco.checkpoint, every rank

What :func:`prepare` does:

* switches off the gradient all-reduce of the DDP wrapper ``accelerator.prepare``
  made (the optimizer communicates the gradients);
* registers the optimizer for ``accelerator.save_state``/``load_state``: every
  rank writes its slice with :func:`acco.checkpoint.save` into
  ``<dir>/acco_optimizer``, and ``load_state`` restores it after the model's
  weights, so a resume is exact.

Do not pass the AccoOptimizer to ``accelerator.prepare``: accelerate would save
only the first rank's slice of it (:func:`prepare` refuses such an optimizer).
"""

from __future__ import annotations

import os
from typing import Any, Dict, Optional

from .. import checkpoint as acco_checkpoint
from ..ddp import disable_gradient_allreduce
from ..optimizer import AccoOptimizer
from ._given import refuse_regions

__all__ = ["CHECKPOINT_DIR", "prepare"]

CHECKPOINT_DIR = "acco_optimizer"


class _Checkpointer:
    """A custom accelerate checkpoint object: ``state_dict`` (called on every rank by ``save_state``) writes
    the optimizer with DCP, ``load_state_dict`` (every rank, after the model) reads it back."""

    def __init__(self, optimizer: AccoOptimizer) -> None:
        self.optimizer = optimizer
        self.folder: Optional[str] = None  # set by the save/load pre-hooks

    def on_save(self, models: Any, weights: Any, output_dir: str) -> None:
        self.folder = output_dir

    def on_load(self, models: Any, input_dir: str) -> None:
        self.folder = input_dir

    def state_dict(self) -> Dict[str, Any]:
        assert self.folder is not None, "accelerate called state_dict() outside save_state()"
        acco_checkpoint.save(os.path.join(self.folder, CHECKPOINT_DIR), self.optimizer)  # collective: every rank
        return {"acco_checkpoint": CHECKPOINT_DIR}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        assert self.folder is not None, "accelerate called load_state_dict() outside load_state()"
        acco_checkpoint.load(os.path.join(self.folder, state["acco_checkpoint"]), self.optimizer)


def prepare(accelerator: Any, model: Any, optimizer: AccoOptimizer) -> AccoOptimizer:
    """Make ``accelerator``'s loop right for ``optimizer``: no DDP all-reduce on ``model`` (the prepared
    model), and the optimizer saved and loaded by ``accelerator.save_state``/``load_state`` on every
    rank. Call once, after ``accelerator.prepare(model, ...)``, on every rank. Returns ``optimizer``."""
    if not isinstance(optimizer, AccoOptimizer):
        inner = getattr(optimizer, "optimizer", None)
        if isinstance(inner, AccoOptimizer):
            raise TypeError(
                "the AccoOptimizer went through accelerator.prepare(): accelerate would save only the first "
                "rank's slice of it and skip its steps by its own counter. Build it after prepare(model, ...) "
                "and pass it to acco.integrations.accelerate.prepare only; call opt.step() when "
                "accelerator.sync_gradients"
            )
        raise TypeError(f"optimizer must be an AccoOptimizer, got {type(optimizer).__name__}")
    refuse_regions(optimizer.options.outer.outer_every, "acco.integrations.accelerate.prepare",
                   "Call acco.disable_gradient_allreduce(model) instead of prepare, and save without save_state")
    disable_gradient_allreduce(model)
    checkpointer = _Checkpointer(optimizer)
    accelerator.register_save_state_pre_hook(checkpointer.on_save)
    accelerator.register_load_state_pre_hook(checkpointer.on_load)
    accelerator.register_for_checkpointing(checkpointer)
    return optimizer
