"""AccoOptimizer: the ``torch.optim.Optimizer`` front of the library.

This file is what users read: the class, its arguments and their docstrings,
``param_groups``, torch's optimizer hooks (state-dict pre/post hooks, the
global step hooks). Everything the optimizer builds, owns and runs is the
:class:`~acco.runtime.Runtime` (``runtime.py``), which the front holds and
forwards to; ``docs/architecture.md`` says which object owns what. The
equations are those of ``docs/algorithm.md``.

Two ways to drive it:

* **one ``step()`` per update** (the default, as with any torch optimizer):
  ``backward()`` on the update's micro-batches, then ``step()``. In mode
  ``acco`` the library hands off the estimate round itself, from an
  end-of-backward callback, once the first half of the update's micro-batches
  is done (or ``estimate_microbatches`` of them), and puts ``theta_t`` in the
  model for the rest.
* **accumulate while communicating** (``accumulate_while_communicating=True``,
  for loops written for it): ``step()`` after every micro-batch is a hand-off
  *point*; a round is handed off only when the previous one has finished, so a
  fast rank keeps accumulating instead of waiting.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import weakref
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional

import torch
import torch.distributed as dist

from . import _validation as V
from .agreement import hyper_fingerprint
from .driver import RoundDriver
from .introspection import Introspection
from .options import Options, check_arguments, keyword_signature, split_keywords
from .outer import refuse_checkpoint
from .policies import DelayPolicy, HandoffPolicy, OuterPolicy, PrecisionPolicy, RobustnessPolicy
from .runtime import Runtime, make_closer
from .state import io as state_io
from .torch_hooks import load_with_hooks, state_dict_with_hooks


__all__ = ["AccoOptimizer", "hyper_fingerprint"]

log = logging.getLogger("acco")


def _option(name: str) -> property:
    """A read-only attribute of the resolved configuration, :attr:`AccoOptimizer.options` (docs/options.md)."""
    return property(lambda self: self.options.value(name), doc=f"The option ``{name}``, resolved at construction.")


class AccoOptimizer(Introspection, torch.optim.Optimizer):
    """ZeRO-1 sharded optimizer whose communication overlaps computation (ACCO).

    Drop-in for ``torch.optim.AdamW``: ``backward()`` on each micro-batch of an
    update, then one ``step()``, which is one optimizer update in every mode.
    The gradients of all ranks are averaged as DDP averages ``.grad`` (no
    ``DistributedDataParallel`` wrapper: the optimizer communicates), the
    update's reduce-scatter -> sharded step of ``optimizer_class`` ->
    all-gather runs in the background while the next micro-batches compute.
    In mode ``"acco"`` an update needs at least two micro-batches: the first
    half gives an estimate ``theta~`` (handed off when the backward that ends
    the first half finishes; ``estimate_microbatches`` moves that point), both
    halves the committed update (handed off by ``step()``). ``"dpu"`` (delayed, uncompensated) and ``"sync"`` (plain
    ZeRO-1) are the baselines.

    Construction, ``step()`` and ``finish()`` are collective: call them on all
    ranks of ``process_group``. Construction broadcasts the parameters from the
    group's first rank (as DDP does) and checks that every rank has the same
    model, raising on all ranks if not.

    Args:
        params: ``model.parameters()`` or a list of param-group dicts.
            Parameters with ``requires_grad=False`` are ignored.
        optimizer_class: the wrapped ``torch.optim.Optimizer`` subclass; it runs on this rank's share only.
            Element-wise ones (AdamW, Adam, SGD, ...) step a ``1/N`` slice; Muon and Adafactor whole tensors,
            each owned by one rank. A param group may name its own (``"optimizer_class"``: the Muon + AdamW
            split); ``**optimizer_kwargs`` are this class's.
        mode: ``"acco"`` | ``"dpu"`` | ``"sync"``.
        process_group: default: the WORLD group when initialised, otherwise one
            process (still asynchronous).
        microbatches_per_update: ``backward()`` calls per ``step()``. Mode acco
            needs it to split an update into halves; ``None``: learned from the
            first update, which then runs synchronously (the model holds
            ``theta_1`` after it instead of the estimate ``theta~_1``).
        buffers: the model's buffers (``model.buffers()``, e.g. BatchNorm's
            running statistics) to keep equal across ranks: broadcast from the
            group's first rank at every ``step()``, as DDP broadcasts them.
        placement: how to shard a class acco does not know (your own): ``"elementwise"`` (a ``1/N`` slice of
            the flattened parameters, for a step that treats every element on its own) or ``"whole"`` (each
            tensor whole on one rank). The classes acco knows need none; LBFGS and SparseAdam are refused.
        assume_elementwise: the same as ``placement="elementwise"`` (kept for existing code).
        handoff, robustness, delay, precision, outer: the policies (``acco.HandoffPolicy``, ``RobustnessPolicy``,
            ``DelayPolicy``, ``PrecisionPolicy``, ``OuterPolicy``; their fields, defaults and what each does: ``help()`` on each,
            or ``docs/options.md``). Each field is also a keyword of its own, the shorthand most code uses
            (``inspect.signature(AccoOptimizer)`` lists them): ``max_grad_norm=1.0`` is
            ``robustness=RobustnessPolicy(max_grad_norm=1.0)``, ``compression="int8"`` is
            ``precision=PrecisionPolicy(compression="int8")``.
        outer_group: with ``outer_every=H``: this rank's peers in the other regions (the same rank of each
            region's ``process_group``, e.g. ``mesh.get_group("region")`` of a ``("region", "dp")`` mesh). Every
            ``H`` updates an outer round averages the regions' progress over it (``docs/regions.md``).
        **optimizer_kwargs: passed to ``optimizer_class`` (``lr=...``).

    Evaluate or save the committed weights inside :meth:`committed_weights`.
    Whether communication is hidden: :meth:`round_stats`,
    :meth:`overlap_summary`; memory: :meth:`memory_report`.
    """

    HISTORY_LIMIT = RoundDriver.HISTORY_LIMIT  # rounds kept for round_stats()
    EVENTS_KEPT = RoundDriver.EVENTS_KEPT  # CUDA: rounds whose events are held before they are settled

    # torch.amp.GradScaler.step(opt) leaves .grad alone and hands itself to step(grad_scaler=...): the round
    # unscales the averaged gradient (amp.py).
    _step_supports_amp_scaling = True

    # The constructor's arguments as resolved (``self.options``, frozen), each an attribute of its name
    # (opt.mode, opt.max_grad_norm, ...): made below from the fields of Options.

    def __init__(
        self, params: Any, optimizer_class: type = torch.optim.AdamW, *, mode: str = "acco",
        process_group: Optional[dist.ProcessGroup] = None, microbatches_per_update: Optional[int] = None,
        buffers: Optional[Iterable[torch.Tensor]] = None, placement: Optional[str] = None,
        assume_elementwise: bool = False, handoff: Optional[HandoffPolicy] = None,
        robustness: Optional[RobustnessPolicy] = None, delay: Optional[DelayPolicy] = None,
        precision: Optional[PrecisionPolicy] = None, outer: Optional[OuterPolicy] = None,
        outer_group: Optional[dist.ProcessGroup] = None, **keywords: Any,
    ) -> None:
        # Each keyword is a policy's field (shorthand) or the wrapped optimizer's (lr=...): split once, checked once.
        policies, optimizer_kwargs = split_keywords(
            dict(handoff=handoff, robustness=robustness, delay=delay, precision=precision, outer=outer), keywords)
        checked = check_arguments(mode=mode, optimizer_class=optimizer_class, placement=placement,
                                  assume_elementwise=assume_elementwise,
                                  microbatches_per_update=microbatches_per_update, policies=policies)
        groups, classes, given = V.prepare_groups(params, optimizer_class)
        super().__init__(groups, dict(optimizer_kwargs))
        V.drop_foreign_defaults(self.param_groups, given, classes, optimizer_class, optimizer_kwargs)
        self._runtime = rt = Runtime(
            self.param_groups, classes, checked, optimizer_kwargs, process_group=process_group, buffers=buffers,
            microbatches_per_update=microbatches_per_update, owner_id=id(self), outer_group=outer_group)
        rt.fill_defaults(self.defaults)  # the wrapped optimizer's defaults fill this one's
        self.options: Options = rt.options  # the configuration, resolved once: read-only from here on
        self.rank, self.world_size, self.layout, self.scheduler = rt.rank, rt.world_size, rt.layout, rt.scheduler
        self._constructed = True  # add_param_group() from here on would change the layout: refused
        self._closer = make_closer(self, rt)  # if finish() never comes

    @classmethod
    def from_optimizer(cls, optimizer: Any, **options: Any) -> "AccoOptimizer":
        """An ``AccoOptimizer`` over fresh torch optimizers' parameters, groups and hyper-parameters.

        For scripts that build their optimizer in a function of their own (nanoGPT's
        ``model.configure_optimizers(...)``, a framework's ``create_optimizer()``)::

            opt = AccoOptimizer.from_optimizer(model.configure_optimizers(...), microbatches_per_update=4)

        A list of optimizers over disjoint parameters becomes one ``AccoOptimizer`` (each group keeps its
        class: the Muon + AdamW split, as torch's Muon documentation builds it)::

            opt = AccoOptimizer.from_optimizer([torch.optim.Muon(hidden, lr=0.02),
                                                torch.optim.AdamW(others, lr=3e-4)], microbatches_per_update=4)

        ``options`` are the ``AccoOptimizer`` keyword arguments (``mode``, ``max_grad_norm``, ...). The given
        optimizers are only read: the (first) class becomes ``optimizer_class``, their param groups (with their
        per-group ``lr``, ``weight_decay``, ``fused`` ...) and defaults are passed on. They must not have stepped
        yet: their state would be lost (load a checkpoint into the ``AccoOptimizer`` instead). Collective, as
        construction is.
        """
        groups, optimizer_class, kwargs = V.from_optimizers(optimizer, options)
        return cls(groups, optimizer_class, **kwargs)

    # ------------------------------------------------------------------ state owned elsewhere

    @property
    def runtime(self) -> Runtime:
        """The library's runtime behind this front (``acco/runtime.py``): what acco's own modules (checkpoints,
        integrations) work on. Not a stable API for user code."""
        return self._runtime

    @property
    def finished(self) -> bool:
        """Whether :meth:`finish` has ended training with this optimizer (a later ``step()`` raises)."""
        return self._runtime.session.finished

    @property
    def local_optimizer(self) -> torch.optim.Optimizer:
        """The wrapped torch optimizer on this rank (its parameters: this rank's share of the master weights).
        With several classes (``"optimizer_class"`` in param groups): :attr:`local_optimizers`."""
        single = self._runtime.wrapped.single
        if single is None:
            raise AttributeError(
                "AccoOptimizer.local_optimizer: this optimizer wraps several classes "
                f"({', '.join(type(p.optimizer).__name__ for p in self._runtime.wrapped.parts)}); use local_optimizers"
            )
        return single

    @property
    def local_optimizers(self) -> List[torch.optim.Optimizer]:
        """The wrapped torch optimizers on this rank, one per class, in the order of their first param group."""
        return [part.optimizer for part in self._runtime.wrapped.parts]

    @property
    def model_buffers(self) -> List[torch.Tensor]:
        """The model buffers kept equal across ranks (``buffers=``): the first rank's, at every commit."""
        return list(self._runtime.model_buffers)

    @property
    def microbatches_per_update(self) -> Optional[int]:
        return self._runtime.progress.microbatches_per_update

    @microbatches_per_update.setter
    def microbatches_per_update(self, value: Optional[int]) -> None:
        if value is not None:
            self.options.check_microbatches(value)
        self._runtime.progress.learned(value)

    @property
    def _failed(self) -> Optional[BaseException]:
        return self._runtime.driver.failed

    @_failed.setter
    def _failed(self, exc: Optional[BaseException]) -> None:
        self._runtime.driver.failed = exc

    # ------------------------------------------------------------------ checks

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """Used by the constructor; afterwards refused: the flat layout and the shards are fixed at construction."""
        if getattr(self, "_constructed", False):
            raise RuntimeError(
                "AccoOptimizer.add_param_group(): the flat buffers and the shards of every rank are laid out at "
                "construction, so parameters added later would never be communicated or trained. Build the "
                "AccoOptimizer with all param groups (e.g. unfreeze layers before building it, or build a new one)"
            )
        super().add_param_group(param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Discard the gradients of the micro-batches since the last ``step()``, as torch's optimizers do.

        ``.grad`` stays bound to the library's flat buffer (zeroed in place)
        whatever ``set_to_none`` says, so no memory is reallocated. The update
        then counts its micro-batches from zero again; in mode acco, once the
        update's estimate is handed off its first half cannot be taken back:
        that raises. With ``accumulate_while_communicating`` the gradients
        already given to ``step()`` belong to the library and are kept.
        """
        self._runtime.loop.zero_grad()

    # ------------------------------------------------------------------ step

    def step(self, closure: Optional[Callable[[], Any]] = None, grad_scaler: Any = None) -> Any:
        """One optimizer update from the micro-batches' gradients since the last ``step()``.

        Hands the update's commit round off and returns; the round runs while
        the next micro-batches compute (mode sync: waits for it). After
        ``step()`` the model holds the weights for the next micro-batch (mode
        acco: the estimate ``theta~``; see :meth:`committed_weights`).
        With ``accumulate_while_communicating``: call it after every
        micro-batch; it hands off a round only when one can start.
        ``grad_scaler``: given by ``torch.amp.GradScaler.step(opt)`` (this optimizer handles loss scaling itself,
        ``_step_supports_amp_scaling``): the round unscales the averaged gradient, and the scaler's inf/NaN
        check is agreed by all ranks (``acco/amp.py``); leave out ``scaler.unscale_(opt)``.
        Collective: call on all ranks.
        """
        rt = self._runtime
        rt.begin_step(grad_scaler, self.__dict__)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        rt.step(grad_scaler)
        return loss

    # ------------------------------------------------------------------ the committed weights, the end

    @contextlib.contextmanager
    def committed_weights(self) -> Iterator[None]:
        """Hold the last committed weights ``theta`` in the model for the block, then put back what it held.

        Evaluate or save inside it: between updates the model may hold the
        estimate ``theta~`` (mode acco) or weights one update old (mode dpu).
        Waits for the in-flight round. Local (no collective); re-entrant.
        No ``backward()``/``step()`` inside the block.
        """
        with self._runtime.committed_weights():
            yield

    def register_commit_hook(self, hook: Callable[["AccoOptimizer"], None]) -> Any:
        """Call ``hook(optimizer)`` each time a committed update's weights ``theta`` go into the model, with the
        model holding them: the place for an EMA of the model (``AveragedModel.update_parameters(model)``),
        which after ``step()`` would average the estimate ``theta~`` (mode acco) or stale weights (mode dpu).
        In mode sync it runs inside ``step()``; in modes acco and dpu when the commit lands, at a later
        hand-off (one update behind ``step()``), and the last one at ``finish()``; after a skipped commit too
        (the weights unchanged), as a torch loop's EMA update after a skipped ``step()``. Runs under
        ``no_grad``, on the compute side. Returns a handle whose ``remove()`` unregisters it. Local."""
        owner = weakref.ref(self)  # the close at drop holds the driver: the hook must not hold the optimizer

        def call() -> None:
            opt = owner()
            if opt is not None:
                hook(opt)

        return self._runtime.driver.add_commit_hook(call)

    def take_model_weights(self) -> None:
        """Start from the model's weights as they are now: call it after writing them into the model once this
        optimizer is built and before its first ``step()`` (a model-only load: ``load_state_dict``, a pretrained
        or seed checkpoint). Without it the first round raises: its master weights are the ones the optimizer
        was built with, and the write would be lost. Collective: the first rank's weights, as construction."""
        self._runtime.take_model_weights()

    def finish(self) -> None:
        """Wait for the in-flight round; leave the last committed weights in the model.

        An in-flight estimate is dropped (the model already holds ``theta_t``),
        and so are micro-batches whose ``step()`` has not come. Idempotent.
        Optional: without it, however the process ends it exits cleanly, with
        the code it meant (the round in flight is waited for, at most 60 s,
        when the optimizer is dropped or at exit; docs/errors.md, "How a
        process ends"), but the model may hold an estimate.
        Collective: call on all ranks.
        """
        self._runtime.finish(self._closer)

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> Dict[str, Any]:
        """This rank's share of the state, with what it is (rank, world size, mode, optimizer, layout).

        For ``torch.save`` on every rank, each its own file; for any world size
        use :mod:`acco.checkpoint` (DCP). Take it between a ``step()`` and the
        next ``backward()`` (``at_update_boundary``); it waits for the in-flight
        round. Local: no collective. The hooks of ``register_state_dict_pre_hook``/``_post_hook`` run as on a
        torch optimizer.
        """
        return state_dict_with_hooks(self, lambda: state_io.state_dict(self._runtime.owners))

    def sharded_state_dict(self) -> Dict[str, Any]:
        """The state for ``torch.distributed.checkpoint``: each rank's pieces keyed by parameter and first
        element, so DCP writes each once and a load on any world size reads those it needs. Local."""
        self._runtime.refuse_mesh("sharded_state_dict()")
        refuse_checkpoint(self._runtime.driver.ctx.outer, "sharded_state_dict()")
        return state_io.state_dict(self._runtime.owners, sharded=True)

    def load_state_dict(self, state_dict: Dict[str, Any], *, restore_model: bool = False,
                        allow_new_microbatches: bool = False) -> None:
        """Restore :meth:`state_dict` (this rank's, same world size; or what :func:`acco.checkpoint.gather`
        saved) or :meth:`sharded_state_dict` (through DCP, any world size); also restores the model's
        parameters. Refuses anything else before changing any state, and a model whose weights are not the
        ones this state was saved with (load the model saved with it first; ``restore_model=True``: the
        model may hold anything, its weights come from the state alone). A state saved with another
        ``microbatches_per_update`` is refused unless ``allow_new_microbatches=True``: then training goes on
        with this optimizer's count (keep the global batch when the number of ranks changes). Checkpoints of
        format 2 (acco before per-parameter state) load too. Collective: call on all ranks. The hooks of
        ``register_load_state_dict_pre_hook``/``_post_hook`` run as on a torch optimizer."""
        load_with_hooks(self, state_dict, lambda sd: state_io.load_state_dict(
            self._runtime.owners, sd, restore_model=restore_model, allow_new_microbatches=allow_new_microbatches))

    def consolidated_state_dict(self) -> Dict[str, Any]:
        """Full per-parameter state in the wrapped optimizer's own format (with several classes: each
        parameter's state that of its class, by its index in this optimizer's groups). Collective."""
        return self._runtime.consolidated_state_dict()

    def load_consolidated_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Take a plain optimizer's ``state_dict()``; the master comes from the model's
        current weights. Call on all ranks (each keeps its share)."""
        self._runtime.load_consolidated_state_dict(state_dict)


for _name in Options.names():  # opt.mode, opt.max_grad_norm, ...: the resolved options (docs/options.md)
    setattr(AccoOptimizer, _name, _option(_name))
# help(AccoOptimizer), IDEs and inspect see every policy field as a keyword (the shorthand), as written out before.
AccoOptimizer.__init__.__signature__ = keyword_signature(inspect.signature(AccoOptimizer.__init__))
