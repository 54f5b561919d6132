"""Lightning: ``Trainer(strategy="acco")``, an :class:`AccoStrategy` built on Lightning's ``DDPStrategy``.

::

    import acco.integrations.lightning     # registers strategy="acco" with Lightning
    trainer = lightning.Trainer(accelerator="cpu", devices=2, strategy="acco",
                                accumulate_grad_batches=4, gradient_clip_val=1.0)

What it changes, and why (Lightning owns the loop, so the strategy does what a
hand-written loop does around the optimizer):

* **No DDP all-reduce.** The model is not wrapped in ``DistributedDataParallel``:
  the optimizer averages the gradients itself (reduce-scatter), and its
  construction broadcasts the first rank's parameters, as DDP's does; the
  model's buffers are broadcast at every update (``buffers=``), as DDP does.
* **The optimizer.** The one optimizer ``configure_optimizers`` returns is
  wrapped (``AccoOptimizer.from_optimizer``: its class, groups and
  hyper-parameters), or taken as it is if it is already an ``AccoOptimizer``
  (the Muon + AdamW split: ``AccoOptimizer.from_optimizer([muon, adamw], ...)``).
  Its LR schedulers are re-pointed at the wrapper.
* **The loop.** ``accumulate_grad_batches`` is the micro-batches per update
  (mode acco needs 2 or more: its estimate is the first half's);
  ``gradient_clip_val`` (by norm) becomes ``max_grad_norm``, the global norm of
  the averaged gradient, and Lightning no longer clips the local ``.grad``;
  clipping by value is refused (it has no averaged-gradient equivalent here).
* **Committed weights.** Validation, test, predict and
  ``trainer.save_checkpoint`` see the committed weights, not the estimate the
  model holds between updates; the end of ``fit`` leaves the last committed
  weights (``finish()``).
* **Checkpoints.** Lightning asks every rank for the optimizer's state and
  writes on rank 0: every rank's shard is gathered to rank 0
  (:func:`acco.checkpoint.gather`) and saved in the ``.ckpt``; on resume each
  rank takes its own from it, so a resume on the same number of ranks is
  bit-identical.
* **Options.** ``AccoStrategy(mode=..., estimate_dtype=..., ...)`` passes any
  :class:`~acco.AccoOptimizer` option through; ``timeout`` bounds both the
  process group's and the rounds' collectives.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import inspect
import logging
import weakref
from datetime import timedelta
from typing import Any, Dict, Optional

import torch

from ..modes import Mode
from ..optimizer import AccoOptimizer
from ._given import check_given_optimizer, refuse_regions

try:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
except ImportError as exc:
    if exc.name in ("lightning", "lightning.pytorch"):
        raise ImportError("acco.integrations.lightning needs Lightning: pip install 'lightning>=2.6' (the extra 'torch-acco[lightning]'; in acco's clone, pip install -e '.[lightning]')") from exc
    raise ImportError(f"acco.integrations.lightning: importing lightning.pytorch failed: {exc}") from exc

__all__ = ["AccoStrategy"]

logger = logging.getLogger("acco")

_OPTIONS = {name for name, p in inspect.signature(AccoOptimizer.__init__).parameters.items()
            if p.kind is inspect.Parameter.KEYWORD_ONLY}
_SET_BY_STRATEGY = {"microbatches_per_update", "max_grad_norm", "buffers", "process_group",
                    "accumulate_while_communicating", "min_microbatches", "max_microbatches"}


class AccoStrategy(DDPStrategy):
    """Data parallelism through an :class:`~acco.AccoOptimizer` (``strategy="acco"``).

    Args:
        mode: ``"acco"`` (needs ``accumulate_grad_batches >= 2``), ``"dpu"`` or ``"sync"``.
        timeout: the process group's and the rounds' (``AccoOptimizer(timeout=...)``).
        **options: more :class:`~acco.AccoOptimizer` keyword arguments (``estimate_dtype``,
            ``compute_dtype``, ``nonfinite``, ``synchronous_updates``, ...); Lightning's own strategy
            arguments (``accelerator``, ``parallel_devices``, ``cluster_environment``, ``checkpoint_io``,
            ``precision_plugin``, ``process_group_backend``) go to ``DDPStrategy``.
    """

    strategy_name = "acco"

    def __init__(self, mode: str = "acco", timeout: Optional[timedelta] = None, **options: Any) -> None:
        strategy_args = {k: options.pop(k) for k in ("accelerator", "parallel_devices", "cluster_environment",
                                                     "checkpoint_io", "precision_plugin", "process_group_backend",
                                                     "start_method") if k in options}
        unknown = sorted(set(options) - _OPTIONS)
        if unknown:
            raise TypeError(
                f"AccoStrategy got {unknown}, which are neither AccoOptimizer options nor Lightning strategy "
                f"arguments. AccoOptimizer options: {sorted(_OPTIONS - _SET_BY_STRATEGY)}"
            )
        fixed = sorted(set(options) & _SET_BY_STRATEGY)
        if fixed:
            raise TypeError(
                f"AccoStrategy sets {fixed} from the Trainer: accumulate_grad_batches is the micro-batches per "
                "update, gradient_clip_val is max_grad_norm, the model's buffers are kept in sync, the process "
                "group is Lightning's, and Lightning's loop calls step() once per update (accumulating while "
                "communicating needs a step() after every micro-batch). Set them on the Trainer instead"
            )
        super().__init__(timeout=timeout if timeout is not None else timedelta(minutes=30), **strategy_args)
        self.mode = mode
        self.acco_options: Dict[str, Any] = {**options, **({"timeout": timeout} if timeout is not None else {})}
        self._views = contextlib.ExitStack()
        self._clip: Optional[Any] = None  # the Trainer's gradient_clip_val, while fit() runs

    # ------------------------------------------------------------------ the model and the optimizer

    @property
    def acco_optimizer(self) -> Optional[AccoOptimizer]:
        """The AccoOptimizer (None before fit() has set it up)."""
        for opt in self.optimizers:
            opt = getattr(opt, "_optimizer", opt)  # a LightningOptimizer wraps it
            if isinstance(opt, AccoOptimizer):
                return opt
        return None

    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return model  # no DistributedDataParallel: the optimizer communicates (and broadcasts at construction)

    def _register_ddp_hooks(self) -> None:
        """Nothing: DDP communication hooks attach to a DistributedDataParallel, and there is none (on CUDA,
        DDPStrategy asserts there is one). The optimizer's rounds are the communication."""

    def setup(self, trainer: "pl.Trainer") -> None:
        self._check_trainer(trainer)
        super().setup(trainer)
        atexit.unregister(_release_default_group)  # once, however many fit/validate calls set the strategy up
        atexit.register(_release_default_group)

    def _check_trainer(self, trainer: "pl.Trainer") -> None:
        clip = trainer.gradient_clip_val
        algorithm = getattr(trainer.gradient_clip_algorithm, "value", trainer.gradient_clip_algorithm)
        if clip is not None and clip > 0 and algorithm not in (None, "norm"):
            raise ValueError(
                f"Trainer(gradient_clip_algorithm={algorithm!r}) with strategy='acco': clipping "
                "by value acts on each rank's local gradient, and acco averages the gradients after backward, so it "
                "cannot be honoured. Use gradient_clip_algorithm='norm' (the default: the global norm of the "
                "averaged gradient, as DDP + clip_grad_norm_), or no clipping"
            )
        steps = trainer.accumulate_grad_batches
        lm = trainer.lightning_module
        if Mode.parse(self.mode).estimates and steps < 2 and lm is not None and lm.automatic_optimization:
            raise ValueError(
                f"Trainer(accumulate_grad_batches={steps}) with strategy='acco' (mode 'acco'): ACCO takes an estimate "
                "from the first half of each update's micro-batches, so it needs accumulate_grad_batches >= 2. Set "
                "accumulate_grad_batches=2 and halve the batch size (the same batch per update), or use "
                "AccoStrategy(mode='sync') (ZeRO-1) or AccoStrategy(mode='dpu')"
            )

    def setup_optimizers(self, trainer: "pl.Trainer") -> None:
        super().setup_optimizers(trainer)  # the LightningModule's configure_optimizers, validated by Lightning
        if len(self.optimizers) != 1:
            raise ValueError(
                f"strategy='acco' wraps one optimizer; configure_optimizers returned {len(self.optimizers)}. For "
                "several classes (the Muon + AdamW split), return one: "
                "acco.AccoOptimizer.from_optimizer([muon, adamw], microbatches_per_update=...)"
            )
        plain, lm = self.optimizers[0], self.lightning_module
        if trainer.checkpoint_callbacks:  # before building one (a refused optimizer would hold its thread)
            outer = plain.options.outer.outer_every if isinstance(plain, AccoOptimizer) else None
            refuse_regions(outer or self.acco_options.get("outer_every"), "strategy='acco'",
                           "Pass Trainer(enable_checkpointing=False)")
        if isinstance(plain, AccoOptimizer):  # built by the user (the Muon + AdamW split): taken as it is
            opt = plain
            automatic = lm.automatic_optimization  # manual: the module steps, clips and accumulates itself
            check_given_optimizer(opt, "configure_optimizers()'s optimizer", mode=self.mode,
                                  mode_setting="AccoStrategy(mode)", clip=trainer.gradient_clip_val,
                                  clip_setting="Trainer(gradient_clip_val)" if automatic else None,
                                  microbatches=trainer.accumulate_grad_batches,
                                  microbatches_setting="Trainer(accumulate_grad_batches)" if automatic else None,
                                  options={k: v for k, v in self.acco_options.items() if k != "timeout"},
                                  options_setting="AccoStrategy(...)", model_buffers=lm.buffers(),
                                  held_buffers=opt.model_buffers)
        else:
            clip = trainer.gradient_clip_val
            kwargs: Dict[str, Any] = {"mode": self.mode, "max_grad_norm": clip if clip else None,
                                      "buffers": list(lm.buffers()), **self.acco_options}
            if lm.automatic_optimization:
                kwargs["microbatches_per_update"] = trainer.accumulate_grad_batches
            opt = AccoOptimizer.from_optimizer(plain, **kwargs)
            for config in self.lr_scheduler_configs:
                if config.scheduler.optimizer is plain:
                    _repoint(config.scheduler, opt)
        self.optimizers = [opt]
        if trainer.gradient_clip_val:  # the optimizer clips the averaged gradient: Lightning must not clip .grad
            self._clip, trainer.gradient_clip_val = trainer.gradient_clip_val, None

    # ------------------------------------------------------------------ committed weights

    def _enter_committed(self) -> None:
        opt = self.acco_optimizer
        if opt is not None and not opt.finished:
            self._views.enter_context(opt.committed_weights())

    def _exit_committed(self) -> None:
        self._views.close()

    def on_validation_start(self) -> None:
        super().on_validation_start()
        self._enter_committed()

    def on_validation_end(self) -> None:
        self._exit_committed()
        super().on_validation_end()

    def on_test_start(self) -> None:
        super().on_test_start()
        self._enter_committed()

    def on_test_end(self) -> None:
        self._exit_committed()
        super().on_test_end()

    def on_predict_start(self) -> None:
        super().on_predict_start()
        self._enter_committed()

    def on_predict_end(self) -> None:
        self._exit_committed()
        super().on_predict_end()

    def on_train_end(self) -> None:
        opt = self.acco_optimizer
        if opt is not None and not opt.finished:
            opt.finish()  # the model now holds the last committed weights
        super().on_train_end()

    # ------------------------------------------------------------------ checkpoints

    def lightning_module_state_dict(self) -> Dict[str, Any]:
        """The committed weights (copies: the model may hold the estimate again after the block)."""
        opt = self.acco_optimizer
        if opt is None or opt.finished:
            return super().lightning_module_state_dict()
        with opt.committed_weights():
            return {k: v.detach().clone() for k, v in super().lightning_module_state_dict().items()}

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
        """Every rank's shard, gathered to rank 0, which writes the checkpoint. Collective: Lightning asks every
        rank. On resume every rank reads the file and takes its own shard (same number of ranks)."""
        from .. import checkpoint as acco_checkpoint

        opt = getattr(optimizer, "_optimizer", optimizer)
        if not isinstance(opt, AccoOptimizer):
            return super().optimizer_state(optimizer)
        state = acco_checkpoint.gather(opt)
        return state["optimizer"] if state is not None else {}

    def teardown(self) -> None:
        self._views.close()
        trainer = getattr(self.lightning_module, "_trainer", None)
        if self._clip is not None and trainer is not None:
            trainer.gradient_clip_val, self._clip = self._clip, None
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register("acco", cls, description="ACCO: overlapped, ZeRO-1 sharded data parallelism",
                                   override=True)


def _repoint(scheduler: Any, optimizer: AccoOptimizer) -> None:
    """Make an LR scheduler built on the plain optimizer drive the AccoOptimizer: its groups (copies of the plain
    one's, ``initial_lr`` included) are the ones it edits, and its ``step()`` is tracked as torch's LRScheduler
    tracks the optimizer it was built with (so it does not warn that the scheduler steps first)."""
    scheduler.optimizer = optimizer
    if getattr(optimizer.step, "_wrapped_by_lr_sched", False):
        return
    ref = weakref.ref(optimizer)
    step = optimizer.step.__func__

    @functools.wraps(step)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        opt = ref()
        opt._opt_called = True  # what torch's LRScheduler checks before its own step()
        return step(opt, *args, **kwargs)

    wrapper._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = wrapper  # type: ignore[method-assign]


AccoStrategy.register_strategies(StrategyRegistry)


def _release_default_group() -> None:
    """At interpreter exit: destroy the default process group that Lightning created and never destroys.

    gloo's worker threads release finished work when their group is destroyed; left to interpreter
    finalisation, that can abort the process after a successful run ("terminate called without an
    active exception", pytorch/pytorch#190489). No collective: every call of the run has returned by now.
    (Lightning's own "ddp" strategy leaves the same group behind: tests/lightning_script.py destroys it
    itself for that baseline.)"""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
