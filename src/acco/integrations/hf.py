"""Hugging Face ``transformers.Trainer`` with an :class:`~acco.AccoOptimizer`.

``AccoTrainer`` is a drop-in ``Trainer``: the same arguments, plus ``acco_mode``
and ``acco_kwargs``. What it changes, and why:

* **The optimizer.** Built in ``create_optimizer`` (after Trainer has placed the
  model), from Trainer's own choice (``args.optim``, learning rate, betas,
  weight-decay groups), as an ``AccoOptimizer`` around that class, with
  ``microbatches_per_update=args.gradient_accumulation_steps``. Or built by
  you (the Muon + AdamW split: ``AccoOptimizer.from_optimizer([muon, adamw],
  ...)``) and passed as ``optimizers=(opt, None)``: taken as it is, once its
  mode, ``max_grad_norm`` and ``microbatches_per_update`` are found to agree
  with ``acco_mode`` and ``TrainingArguments`` (else ``ValueError`` naming both).
* **One gradient communication.** Trainer wraps the model in DDP; its
  all-reduce is switched off (:func:`acco.disable_gradient_allreduce`) before
  the first backward: the optimizer averages the gradients as DDP would.
* **Clipping.** ``args.max_grad_norm`` becomes the optimizer's
  ``max_grad_norm`` (the global norm of the averaged gradient); Trainer no
  longer clips the local ``.grad``. The logged ``grad_norm`` is absent
  (``trainer.acco_optimizer.last_grad_norm`` holds the last collected update's).
* **Checkpoints.** The optimizer is saved by every rank with
  :func:`acco.checkpoint.save` (folder ``acco_optimizer`` in the checkpoint),
  the model's weights are the committed ones, and ``resume_from_checkpoint``
  continues exactly.
* **Evaluation and the end of training.** ``evaluate``/``predict`` see the
  committed weights (not the estimate the model holds between updates), and
  ``train()`` ends with ``finish()``, so the model then holds the last
  committed weights (a later ``train()`` on the same trainer builds a new
  optimizer and scheduler; ``resume_from_checkpoint`` restores them).
* Not covered: Ray Tune's checkpointing (``_tune_save_checkpoint``) still
  saves only the first rank's optimizer shard.
* **Buffers** (BatchNorm statistics) are broadcast from the first rank at every
  update, as DDP does.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any, Dict, Optional

import torch

from .. import checkpoint as acco_checkpoint
from .._validation import without_default_kernel_flags
from ..ddp import disable_gradient_allreduce
from ..modes import Mode
from ..optimizer import AccoOptimizer
from ._given import check_given_optimizer, refuse_regions

try:
    from transformers import Trainer
except ImportError as exc:
    if exc.name == "transformers":  # transformers itself is missing
        raise ImportError("acco.integrations.hf needs transformers: pip install 'transformers>=5.23' 'accelerate>=1.15' (the extra 'torch-acco[hf]'; in acco's clone, pip install -e '.[hf]')") from exc
    # transformers is there but its Trainer failed to import: say what failed, not that it is missing
    raise ImportError(f"acco.integrations.hf: importing transformers.Trainer failed: {exc}") from exc

__all__ = ["AccoTrainer", "CHECKPOINT_DIR"]

logger = logging.getLogger("acco")

# The Trainer methods AccoTrainer overrides (transformers 5.x; tested with 5.23.0).
_OVERRIDDEN = ("create_optimizer", "training_step", "_clip_grad_norm", "_get_grad_norm", "evaluate", "predict",
               "_save_checkpoint", "_finalize_training", "_save_optimizer_and_scheduler", "_load_optimizer_and_scheduler")
_missing = [name for name in _OVERRIDDEN if not hasattr(Trainer, name)]
if _missing:  # pragma: no cover - depends on the installed transformers
    raise ImportError(
        f"acco.integrations.hf.AccoTrainer overrides Trainer methods that this transformers lacks: {_missing}. "
        "It is tested with transformers 5.23: pip install 'transformers>=5.23' (or, in acco's clone, pip install -e '.[hf]')"
    )

CHECKPOINT_DIR = "acco_optimizer"  # inside each Trainer checkpoint folder
SCHEDULER_NAME = "scheduler.pt"


class AccoTrainer(Trainer):
    """A ``transformers.Trainer`` whose optimizer is an :class:`~acco.AccoOptimizer`.

    Args:
        acco_mode: ``"acco"`` (needs ``gradient_accumulation_steps >= 2``),
            ``"dpu"`` or ``"sync"``.
        acco_kwargs: more :class:`~acco.AccoOptimizer` arguments (``timeout``,
            ``nonfinite``, ``compute_dtype``, ...).
        Everything else: as ``Trainer``.
    """

    def __init__(self, *args: Any, acco_mode: str = "acco", acco_kwargs: Optional[Dict[str, Any]] = None,
                 **kwargs: Any) -> None:
        self.acco_mode = acco_mode
        self.acco_kwargs = dict(acco_kwargs or {})
        super().__init__(*args, **kwargs)
        steps = self.args.gradient_accumulation_steps
        if Mode.parse(acco_mode).estimates and steps < 2 and "microbatches_per_update" not in self.acco_kwargs:
            raise ValueError(
                f"AccoTrainer(acco_mode='acco') with TrainingArguments(gradient_accumulation_steps={steps}): ACCO "
                "takes an estimate from the first half of each update's micro-batches, so it needs "
                "gradient_accumulation_steps >= 2. Set gradient_accumulation_steps=2 and halve "
                "per_device_train_batch_size (the same batch per update), or pass acco_mode='sync' (ZeRO-1) or "
                "acco_mode='dpu'"
            )
        if self.optimizer is not None and not isinstance(self.optimizer, AccoOptimizer):
            raise TypeError(
                f"AccoTrainer builds its own AccoOptimizer, but optimizers=({type(self.optimizer).__name__}, ...) "
                "was passed: choose the wrapped optimizer with TrainingArguments(optim=..., learning_rate=...), "
                "or pass an AccoOptimizer"
            )
        if isinstance(self.optimizer, AccoOptimizer):  # built by the user (the Muon + AdamW split): taken as it is
            check_given_optimizer(self.optimizer, "AccoTrainer(optimizers=(...))", mode=acco_mode,
                                  mode_setting="AccoTrainer(acco_mode)", clip=self.args.max_grad_norm,
                                  clip_setting="TrainingArguments(max_grad_norm)", microbatches=steps,
                                  microbatches_setting="TrainingArguments(gradient_accumulation_steps)",
                                  options=self.acco_kwargs, options_setting="AccoTrainer(acco_kwargs)",
                                  model_buffers=self.model.buffers(), held_buffers=self.optimizer.model_buffers)
        self._given = isinstance(self.optimizer, AccoOptimizer)
        if getattr(self.args.save_strategy, "value", self.args.save_strategy) != "no":
            given = self.acco_optimizer.options.outer.outer_every if self._given else None
            refuse_regions(self.acco_kwargs.get("outer_every") or given, "AccoTrainer",
                           "Pass TrainingArguments(save_strategy='no')")

    # ----------------------------------------------------------------- optimizer

    @property
    def acco_optimizer(self) -> Optional[AccoOptimizer]:
        """The AccoOptimizer (Trainer may hold it inside accelerate's wrapper), or None before training."""
        opt = self.optimizer
        while opt is not None and not isinstance(opt, AccoOptimizer):
            opt = getattr(opt, "optimizer", None)
        return opt

    def create_optimizer(self, model: Optional[torch.nn.Module] = None) -> torch.optim.Optimizer:
        if self.acco_optimizer is not None and self.acco_optimizer.finished and self._given:
            raise RuntimeError(
                "AccoTrainer: train() again, but the AccoOptimizer passed as optimizers=(...) was finished by the "
                "previous train() (the model holds its last committed weights). Build a new one and set "
                "trainer.optimizer, trainer.lr_scheduler = new_optimizer, None before train(); "
                "resume_from_checkpoint=... then restores its state"
            )
        if self.acco_optimizer is not None and self.acco_optimizer.finished:
            # A later train() on this Trainer: the last one ended its optimizer with finish(). Build a new one
            # (and a new scheduler for it); resume_from_checkpoint then restores both, else they start afresh.
            logger.warning("AccoTrainer: train() again: a new AccoOptimizer (the previous train() finished its own)")
            self.optimizer, self.lr_scheduler = None, None
        if self.optimizer is None:
            plain = super().create_optimizer(model)  # Trainer's choice of class, hyper-parameters and groups
            # torch's own kernel flags in them (fused=None, ...) are no choice: the device's default applies
            groups = [without_default_kernel_flags(g, type(plain)) for g in plain.param_groups if g["params"]]
            model = self.model if model is None else model
            kwargs: Dict[str, Any] = dict(
                mode=self.acco_mode,
                max_grad_norm=self.args.max_grad_norm if self.args.max_grad_norm and self.args.max_grad_norm > 0 else None,
                buffers=list(model.buffers()),
                microbatches_per_update=self.args.gradient_accumulation_steps,  # in every mode, as Lightning's
            )
            kwargs.update(self.acco_kwargs)
            self.optimizer = AccoOptimizer(groups, type(plain), **kwargs)
        return self.optimizer

    # ------------------------------------------------------- one communication, no local clipping

    def training_step(self, model: torch.nn.Module, *args: Any, **kwargs: Any) -> torch.Tensor:
        disable_gradient_allreduce(model)  # Trainer's DDP wrapper: the optimizer communicates (idempotent)
        return super().training_step(model, *args, **kwargs)

    def _clip_grad_norm(self, model: torch.nn.Module) -> None:
        return None  # the optimizer clips the averaged gradient (max_grad_norm); .grad is local here

    def _get_grad_norm(self, model: torch.nn.Module, grad_norm: Any = None) -> Any:
        return grad_norm  # computing it from .grad would read (and rescale) the local gradient

    # ------------------------------------------------------- committed weights

    def _committed(self):
        opt = self.acco_optimizer
        return contextlib.nullcontext() if opt is None or opt.finished else opt.committed_weights()

    def evaluate(self, *args: Any, **kwargs: Any) -> Dict[str, float]:
        with self._committed():
            return super().evaluate(*args, **kwargs)

    def predict(self, *args: Any, **kwargs: Any) -> Any:
        with self._committed():
            return super().predict(*args, **kwargs)

    def _save_checkpoint(self, model: torch.nn.Module, trial: Any) -> None:
        with self._committed():  # the saved model holds the committed weights
            super()._save_checkpoint(model, trial)

    def _finalize_training(self, *args: Any, **kwargs: Any) -> Any:
        opt = self.acco_optimizer
        if opt is not None:
            opt.finish()  # the model now holds the last committed weights (before any best-model reload)
        return super()._finalize_training(*args, **kwargs)

    # ------------------------------------------------------- checkpoints on every rank

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        acco_checkpoint.save(os.path.join(output_dir, CHECKPOINT_DIR), self.acco_optimizer)  # every rank its slice
        if self.args.should_save and self.lr_scheduler is not None:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_optimizer_and_scheduler(self, checkpoint: Optional[str]) -> None:
        if checkpoint is None:
            return
        path = os.path.join(checkpoint, CHECKPOINT_DIR)
        if not os.path.isdir(path):
            raise FileNotFoundError(
                f"{checkpoint!r} holds no {CHECKPOINT_DIR}/ folder: it was not written by AccoTrainer, so its "
                "optimizer state (if any) is not this optimizer's. Resume from an AccoTrainer checkpoint, or "
                "load only the model's weights (Trainer(model=...) from the checkpoint) and start a new optimizer."
            )
        acco_checkpoint.load(path, self.acco_optimizer)
        sched = os.path.join(checkpoint, SCHEDULER_NAME)
        if self.lr_scheduler is not None and os.path.isfile(sched):
            self.lr_scheduler.load_state_dict(torch.load(sched, weights_only=True))
