"""The runtime behind :class:`~acco.AccoOptimizer`: everything the optimizer builds, owns and runs, made here.

``optimizer.py`` is the ``torch.optim.Optimizer`` front (``param_groups``, torch's hooks, the docstrings users
read); it holds one :class:`Runtime` and forwards to it. The runtime is built from the live param groups and
the checked options, once, in this order: the parameters and their local shards, the resolved
:class:`~acco.options.Options`, the layout, the process groups (the user's, the rounds' own, the model group of
DTensor parameters, the control group of the agreement gathers: made here and nowhere else), the flat buffers,
the wrapped optimizers, the scheduler, the driver, the :class:`~acco.session.Session`, the loop and the
gradient hooks. Each of those owns its state (``docs/architecture.md``); the runtime wires them and is the one
object the hooks call: a gradient goes hook -> :meth:`Runtime.on_grad_accumulated` -> buffers, and at the end of
the backward -> the loop -> the driver -> the scheduler -> the round.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from functools import partial
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import _validation as V
from . import agreement, auto, device_api, hooks, mesh, outer
from . import ddp as _ddp
from .amp import LossScale
from .buffers import FlatBuffers
from .collectives import (connect, group_rank, group_size, new_local_group, new_round_group, resolve_process_group,
                          ring_algorithm)
from .driver import RoundDriver
from .loops import ElasticLoop, LoopContext, UpdateLoop
from .mesh import LocalShards
from .options import Options
from .options import resolve as resolve_options
from .placement import Layout
from .precision import check_dtypes
from .progress import Progress
from .rounds import OptimizerSnapshot, RoundContext, RoundKind
from .scheduler import StreamScheduler
from .session import Session
from .state import consolidated as state_consolidated
from .state import io as state_io
from .state.format import FORMAT_VERSION, IMPLEMENTATION_FLAGS, StateOwners
from .wrapped import WrappedOptimizers, class_name, placement_cost, placement_of

__all__ = ["Groups", "Runtime"]

log = logging.getLogger("acco")


@dataclass
class Groups:
    """The process groups of one optimizer, made in :func:`_make_groups` and nowhere else. The rounds' own
    group and the model group are the driver's (its ``RoundContext``), which releases them at ``finish()`` or
    exit: nothing else holds them (a group alive at interpreter exit aborts the process, docs/errors.md)."""

    user: Optional[dist.ProcessGroup]  # the user's (None: one process)
    model_ranks: Optional[List[int]]  # DTensor parameters: the ranks holding the other shards of this rank's
    control: Optional[dist.ProcessGroup]  # the agreement gathers of the public collective calls
    control_device: torch.device
    rounds: Optional[dist.ProcessGroup] = None  # the rounds' own, until handed to the driver
    model: Optional[dist.ProcessGroup] = None  # the norm's over the model group, until handed to the driver
    outer: Optional[dist.ProcessGroup] = None  # outer_every: the outer round's, until handed to the driver


@dataclass
class _Placed:
    """Where every parameter goes: the layout, each group's parameter indices, and the placements."""

    layout: Layout
    index_of_group: List[List[int]]
    placements: List[str]


def _place(param_groups: List[Dict[str, Any]], classes: Sequence[type], placement: Optional[str],
           local: List[torch.Tensor], world_size: int) -> _Placed:
    """Each class's placement (a 1/N slice or whole tensors), checked, and the layout of the flat buffers."""
    kinds = {cls: placement_of(cls, placement) for cls in dict.fromkeys(classes)}
    index_of_group: List[List[int]] = []
    placements: List[str] = []
    costs: List[float] = []
    start = 0
    for g, cls in zip(param_groups, classes):
        index_of_group.append(list(range(start, start + len(g["params"]))))
        start += len(g["params"])
        V.check_whole_tensors(cls, kinds[cls], g["params"], len(placements))
        placements += [kinds[cls]] * len(g["params"])
        costs += [placement_cost(cls, local[i].shape, g) for i in index_of_group[-1]]
    layout = Layout.build([p.shape for p in local], world_size, placements, costs)
    if layout.padding > 0.1 * layout.numel:
        log.warning("acco: the flat buffer holds %d elements for %d of parameters (%.0f%% padding, sent by every "
                    "round): a tensor placed whole is larger than 1/%d of the model (docs/usage.md, placement)",
                    layout.padded_numel, layout.numel, 100 * layout.padding / layout.numel, world_size)
    return _Placed(layout, index_of_group, placements)


def _make_groups(user: Optional[dist.ProcessGroup], shards: LocalShards, options: Options, device: torch.device,
                 regions: Any) -> Tuple[Groups, Any]:
    """The outer round's group (``regions``: :func:`outer.connect_regions` but for the region and the model, given
    here), the rounds' group, the model group of DTensor parameters and the control group; and which parameters
    this rank counts in the global norm (``mesh.check_replicas``: plain ones must be alike on the model's ranks).
    Collective on ``outer_group`` (with ``outer_every``), then on ``user`` (and the model group)."""
    across = regions((group_size(user), group_rank(user)), shards, device, options.robustness.timeout)
    rounds = None
    if user is not None:
        # Rounds talk on a group of their own, so the user's collectives on the main thread can never
        # interleave with a round's.
        rounds = new_round_group(user, options.robustness.timeout)
        connect(rounds, device)  # its communicator now, from this thread, not in the first backward
    model, model_ranks = None, mesh.norm_group_ranks(shards)
    if model_ranks is not None:  # the norm over the model's other shards, on a group of the rounds' own too
        model = new_local_group(model_ranks, dist.get_backend(rounds or user), options.robustness.timeout)
        connect(model, device)
    counts = mesh.check_replicas(shards, model) if shards.any else None
    # The agreement gathers of the public collective calls (which call every rank is in, refusals, round
    # counts) run on the main thread. With ``timeout`` they get a small CPU (gloo) group of their own that
    # honours it, so a call made on some ranks only fails within ``timeout``, not the process group's.
    control, control_device = user, device
    if user is not None and options.robustness.timeout is not None:
        control = dist.new_group(ranks=dist.get_process_group_ranks(user), backend="gloo",
                                 timeout=options.robustness.timeout, use_local_synchronization=user is not dist.group.WORLD)
        control_device = torch.device("cpu")
    return Groups(user, model_ranks, control, control_device, rounds, model, across), counts


class Runtime:
    """What an :class:`~acco.AccoOptimizer` runs on: built once from its param groups and options (see the module
    docstring for the order), then driven by the front's calls and by the gradient hooks."""

    def __init__(self, param_groups: List[Dict[str, Any]], classes: Sequence[type], checked: Options,
                 optimizer_kwargs: Dict[str, Any], *, process_group: Any, buffers: Optional[Iterable[torch.Tensor]],
                 microbatches_per_update: Optional[int], owner_id: int, outer_group: Any = None) -> None:
        self.param_groups = param_groups  # the front's live groups: rounds read their values at hand-off
        self.params: List[torch.Tensor] = [p for g in param_groups for p in g["params"]]
        compute_dtype = checked.precision.compute_dtype
        V.check_params(self.params, compute_dtype)
        device = self.params[0].device
        # DTensor parameters (tensor parallel, FSDP2): ACCO works on each rank's local shards (the same storage).
        self.shards = LocalShards(self.params, device_api.stream_api(device))
        check_dtypes(self.params[0].dtype, compute_dtype)
        self.classes = list(classes)
        user = resolve_process_group(process_group)
        self.world_size, self.rank = group_size(user), group_rank(user)
        # The configuration, resolved once (dtypes against the parameters and the group): read-only from here on.
        self.options: Options = resolve_options(checked, param_dtype=self.params[0].dtype,
                                                world_size=self.world_size, classes=classes)
        o, pr = self.options, self.options.precision
        self.model_buffers = V.check_buffers(buffers, device)
        self.progress = Progress(torch.zeros((), dtype=torch.float64, device=device), microbatches_per_update)
        placed = _place(param_groups, classes, o.placement, self.shards.locals, self.world_size)
        mesh.check_supported(self.shards, user, whole="whole" in placed.placements,
                             dtypes_plain=pr.compute_dtype == pr.accumulation_dtype == self.params[0].dtype,
                             compression=pr.compression)
        self.layout = placed.layout
        if user is not None:
            agreement.check_same_model(user, self.fingerprints(), self.layout.numel, len(self.params), device)
            agreement.broadcast_parameters(self.shards.locals, user)
        self.groups, counts = _make_groups(user, self.shards, o, device,
                                           partial(outer.connect_regions, o.outer, outer_group, self.fingerprints()))
        self.flat = FlatBuffers(self.shards.locals, self.layout, self.rank, pr,
                                separate_grads=o.handoff.accumulate_while_communicating,
                                collectives=ring_algorithm(self.groups.rounds))
        self.wrapped = self._wrap(classes, optimizer_kwargs, placed.index_of_group, device)
        self.scheduler = StreamScheduler(device)
        self.flat.shard.host_empty = self.scheduler.host_empty
        self.driver = RoundDriver(self._round_context(counts), self.scheduler, self.progress, self.flat, self.rank,
                                  self.world_size)
        self.groups.rounds = self.groups.model = self.groups.outer = None  # the driver's now (it releases them)
        # compression="auto": its decision's one owner (auto.py), else None; the driver stamps the window it measures
        self.auto = auto.make(pr, self.layout, self.world_size, o.mode, o.delay.synchronous_updates,
                              self.flat.build_transport, device)
        if self.auto is not None:
            self.driver.stamp_upto = self.auto.decide_at
        # The agreement exchange, the lifecycle flags and the committed-weights view: one owner that the loop and
        # the state code are handed by reference.
        self.session = Session(user, self.groups.control, self.groups.control_device, self.driver)
        self.loss_scale = LossScale(device, owner_id)  # a GradScaler's part (amp.py): rounds unscale
        self.lr_schedulers: List[Any] = []  # attached with attach_lr_scheduler(): stepped at each commit
        self.owners = StateOwners(
            layout=self.layout, rank=self.rank, world_size=self.world_size, flat=self.flat, wrapped=self.wrapped,
            progress=self.progress, driver=self.driver, scheduler=self.scheduler, param_groups=param_groups,
            describe=self.describe(), session=self.session, process_group=user,
            check_microbatches=o.check_microbatches, loss_scale=self.loss_scale, auto=self.auto)
        self.loop = self._make_loop()
        self._ddp_checked = False
        self._backward_queued = -1  # id of the autograd graph task whose end-of-backward callback is queued
        self.hook_handles = hooks.install(self.params, self.on_grad_accumulated,
                                          self.on_incoming_grad if self.flat.fold_on_arrival else None)
        self.flat.mark_weights()  # a write into the model before the first round is refused (take_model_weights)

    def take_model_weights(self) -> None:
        """The model's weights as they are now become the master weights (``AccoOptimizer.take_model_weights``).
        Collective on the user's group (and ``outer_group``): the first rank's, as at construction."""
        if self.progress.num_rounds:
            raise RuntimeError(
                f"AccoOptimizer.take_model_weights() after {self.progress.num_rounds} round(s): only before the "
                "first step() (the weights of a running optimizer come from its rounds; load a checkpoint instead)")
        agreement.broadcast_parameters(self.shards.locals, self.groups.user)
        outer.retaken(self.driver.ctx.outer, self.shards.locals, self.flat)  # the master (outer_every: regions too)
        self.flat.mark_weights()

    def fill_defaults(self, defaults: Dict[str, Any]) -> None:
        """The front's ``defaults`` take the wrapped optimizer's where it does not set them (one class)."""
        if self.wrapped.single is not None:
            for key, value in self.wrapped.single.defaults.items():
                defaults.setdefault(key, value)

    @property
    def group(self) -> Optional[dist.ProcessGroup]:
        """The user's process group (None: one process)."""
        return self.groups.user

    def fingerprints(self) -> list:
        """What every rank must have alike (agreement.check_same_model): the model and every option."""
        return agreement.fingerprints(self.param_groups, self.options.agreed(), self.shards.describe(),
                                      self.progress.microbatches_per_update)

    def _wrap(self, classes: Sequence[type], optimizer_kwargs: Dict[str, Any], index_of_group: List[List[int]],
              device: torch.device) -> WrappedOptimizers:
        """The wrapped optimizers over this rank's share, each group with its kernel on this device, and every
        group filled with its wrapped optimizer's defaults (param_groups is the live truth rounds read)."""
        # Each group's kernel on this device (fused Adam/AdamW on CUDA), from the kernel flags it holds: its own
        # and, for optimizer_class, the keyword arguments'. In the group, as a group's keys override a constructor's.
        for g, cls in zip(self.param_groups, classes):
            g.update(V.device_kernel(cls, {k: g[k] for k in IMPLEMENTATION_FLAGS if k in g}, device))
        kwargs = {self.options.optimizer_class: dict(optimizer_kwargs)}
        wrapped = WrappedOptimizers(self.layout, self.rank, self.flat.shard.master, self.flat.shard.grad,
                                    self.param_groups, classes, kwargs, index_of_group)
        for gi, g in enumerate(self.param_groups):
            for key, value in wrapped.defaults_of_group(gi).items():
                g.setdefault(key, value)
        return wrapped

    def _round_context(self, counts: Any) -> RoundContext:
        o = self.options
        return RoundContext(
            self.flat.shard, self.wrapped, self.groups.rounds,
            # Scratch for Opt* (mode acco), and on the CUDA path for undoing a skipped step on the device.
            OptimizerSnapshot() if o.estimates or self.scheduler.uses_streams else None,
            o.robustness.max_grad_norm, o.robustness.nonfinite, device_checks=self.scheduler.uses_streams,
            extrapolation=o.delay.estimate_extrapolation, model_group=self.groups.model,
            norm_ranges=mesh.counted_ranges(counts, self.layout.pieces(self.rank)),
            delay_scratch=torch.empty_like(self.flat.shard.master) if o.delay.delay_correction else None,
            transport=self.flat.transport,
            outer=outer.made(o.outer, self.flat.shard.master, self.groups.outer, o.precision.compression_block),
        )

    def _make_loop(self) -> Any:
        o, g = self.options, self.groups
        round_done = self.scheduler.done
        if g.model_ranks is not None and o.handoff.accumulate_while_communicating:  # a model's shards hand off together
            round_done = mesh.agreed_done(round_done, new_local_group(g.model_ranks, "gloo", o.robustness.timeout))
        ctx = LoopContext(
            options=o, world_size=self.world_size, progress=self.progress, driver=self.driver, flat=self.flat,
            round_done=round_done, session=self.session, param_groups=self.param_groups,
            lr_schedulers=self.lr_schedulers, model_buffers=self.model_buffers, loss_scale=self.loss_scale,
            auto=self.auto)
        return ElasticLoop(ctx) if o.handoff.accumulate_while_communicating else UpdateLoop(ctx)

    def describe(self) -> Dict[str, Any]:
        """What a state dict of this optimizer holds, independent of the world size (format 3)."""
        classes = list(dict.fromkeys(self.classes))
        out = {"format": FORMAT_VERSION, "mode": self.options.mode.value,
               "optimizer": "+".join(class_name(c) for c in classes), "layout": self.layout.describe(),
               "dtypes": f"compute {self.options.precision.compute_dtype}, master {self.flat.master.dtype}"}
        if self.shards.any:  # the placements and this rank's model shard: another shard's state is refused
            out["mesh"] = f"{self.shards.describe()} as {self.shards.shard_name()}"
        return out

    # ------------------------------------------------------------------ gradients (the hooks call these)

    def check_ddp_once(self) -> None:
        if not self._ddp_checked:
            self._ddp_checked = True
            _ddp.check_not_reducing_twice(self.params)

    def on_grad_accumulated(self, index: int) -> None:
        """Post-accumulate-grad hook of parameter ``index`` (inside backward)."""
        if self.session.in_view:
            raise RuntimeError("AccoOptimizer: backward() inside opt.committed_weights(); call it after the block")
        if self.shards.any:
            self.shards.take_grad(index)  # the DTensor gradient's local shard into the buffer
        self.flat.binding.after_accumulate(index)
        self.flat.arrivals.mark(index)  # this parameter has a gradient in the update (torch: .grad not None)
        self.progress.gradient_arrived()
        if not self.loop.queues_end_of_backward:
            return
        task = torch._C._current_graph_task_id()
        if task != self._backward_queued:
            hooks.refuse_reentrant_backward()
            self._backward_queued = task
            # Once per backward pass, as DDP and FSDP do: runs when the whole backward has finished.
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def on_incoming_grad(self, index: int, grad: torch.Tensor) -> None:
        """Pre-hook of parameter ``index``'s gradient accumulator (``fold_on_arrival``): into the fp32 sum."""
        if not self.session.finished:
            self.flat.add_incoming(index, grad)

    def _end_of_backward(self) -> None:
        """End of a backward pass: once more at the back of the queue, so that the end-of-backward work of
        others queued during this backward (DDP's copy of its buckets into .grad) is done first."""
        torch.autograd.Variable._execution_engine.queue_callback(self._after_backward)

    def _after_backward(self) -> None:
        """A micro-batch's backward has finished (one step() per update); the loop may hand off the estimate."""
        self.check_ddp_once()  # before any round (an estimate may go next); DDP's own end-of-backward is done
        self.shards.order_grads()  # FSDP2's post-reduce stream wrote the buffer: waited for before it is read
        self.flat.binding.mark_backward_end()
        self.loop.after_backward()

    # ------------------------------------------------------------------ the front's calls

    def begin_step(self, grad_scaler: Any, attributes: Dict[str, Any]) -> None:
        """``step()``'s checks before the closure runs (``attributes``: the front's own)."""
        self.session.check_open()
        if grad_scaler is not None:
            self._check_loss_scaling()
        elif "grad_scale" in attributes or "found_inf" in attributes:
            # A GradScaler that no longer hands itself to step(): the gradients would be used scaled.
            raise RuntimeError(
                "AccoOptimizer.step(): this torch's GradScaler set optimizer.grad_scale/found_inf instead of passing "
                "grad_scaler= to step(), a protocol acco does not support yet (its rounds unscale the averaged "
                f"gradient; torch {torch.__version__}). Train in bf16 without a GradScaler, or use a torch acco "
                "was tested with (docs/fp16.md)")

    def step(self, grad_scaler: Any) -> None:
        """``step()`` after the closure ran: hand the update (or this micro-batch) to the loop."""
        self.check_ddp_once()
        if self.shards.any:
            self.shards.order_grads()
            mesh.refuse_grad_outside_autograd(self.shards)
            mesh.warn_short_update(self.options.mode, self.progress.mb_in_update,
                                   self.progress.microbatches_per_update)
        self.loop.step(grad_scaler)

    def _check_loss_scaling(self) -> None:
        """Refuse what a GradScaler cannot drive (the same on every rank: before any collective)."""
        if self.shards.any:
            raise NotImplementedError(
                "AccoOptimizer with a GradScaler on DTensor parameters (FSDP2, tensor parallelism) is not supported "
                "yet: train in bf16 (no loss scaling; torchtitan's default), or without DTensor parameters")
        if self.options.precision.compression is not None:  # "auto" too: it may switch to a kind mid-run
            raise NotImplementedError(
                f"AccoOptimizer(compression={self.options.precision.compression!r}) with a GradScaler is not "
                "supported yet: the error feedback's residual would carry one update's loss scale into the next. "
                "Train in bf16 (no loss scaling), or drop compression")
        if self.options.robustness.nonfinite == "raise":
            raise ValueError(
                "AccoOptimizer(nonfinite='raise') with a GradScaler: the scaler expects an update whose gradient is "
                "not finite to be skipped (then it lowers the scale). Build it with nonfinite='skip' (the default)")

    @contextlib.contextmanager
    def committed_weights(self) -> Iterator[None]:
        s = self.session
        if s.in_view:
            yield
            return
        self.driver.check_not_failed()
        self.driver.collect()
        swap = self.progress.pending is RoundKind.COMMIT
        if swap:
            self.flat.swap_model_and_comm()
        s.in_view = True
        s.view_swapped = swap  # the comm buffer holds the model's own weights meanwhile (checkpoints read them)
        try:
            yield
        finally:
            s.in_view = s.view_swapped = False
            if swap:
                self.flat.swap_model_and_comm()

    def finish(self, closer: Any) -> None:
        """``AccoOptimizer.finish()``; ``closer``: the handle of the close at drop or exit, detached here."""
        driver, session = self.driver, self.session
        if driver.failed is not None:  # no collective, no wait: a peer may be gone
            if not session.finished:
                session.finished = True
                driver.close_at_exit()  # no wait for a stuck round: its group is aborted
                self.remove_hooks(closer)
            raise RuntimeError("AccoOptimizer.finish(): a previous round failed; nothing to finish") from driver.failed
        if session.finished:
            return
        if session.in_view:
            raise RuntimeError("AccoOptimizer.finish() inside opt.committed_weights(): call it after the block")
        try:
            try:
                agreement.check_same_round_count(session.gather_row, self.progress.num_rounds)
            except RuntimeError as exc:  # the counts differ, or a peer is gone: no round can complete
                driver.failed = exc
                raise
            driver.collect()
            driver.install_pending(commits_only=True)
            driver.read_reports()  # CUDA path: errors the device found in the last rounds
        finally:
            session.finished = True
            driver.close(ok=driver.failed is None)
        self.flat.drop_accumulated()
        self.progress.committed_in_model()
        self.progress.start_window()
        self.remove_hooks(closer)

    def remove_hooks(self, closer: Any) -> None:
        """A finished optimizer no longer reacts to backward (a new one may own the parameters)."""
        for handle in self.hook_handles:
            handle.remove()
        self.hook_handles = []
        closer.detach()

    # ------------------------------------------------------------------ checkpoints

    def refuse_mesh(self, call: str) -> None:
        """Checkpoint forms that do not tell the model shards of DTensor parameters apart."""
        if self.shards.any:
            raise NotImplementedError(
                f"AccoOptimizer.{call} with DTensor parameters is not supported: ranks of different model shards "
                "hold different tensors under the same keys. Use acco.checkpoint.save(path, opt, model=model) and "
                "acco.checkpoint.load(path, opt, model=model), which keep each shard's apart (or "
                "torch.save(opt.state_dict(), f'optim.rank{dist.get_rank()}.pt') on every rank) "
                "(docs/models-larger-than-one-device.md)")

    def consolidated_state_dict(self) -> Dict[str, Any]:
        self.refuse_mesh("consolidated_state_dict()")
        outer.refuse_checkpoint(self.driver.ctx.outer, "consolidated_state_dict()")
        state_io.require_boundary(self.owners, "consolidated_state_dict")
        self.session.gather_row([0], "consolidated_state_dict()")  # every rank is here (not one update ahead)
        return state_consolidated.consolidated_state_dict(self.owners)

    def load_consolidated_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.refuse_mesh("load_consolidated_state_dict()")
        outer.refuse_checkpoint(self.driver.ctx.outer, "load_consolidated_state_dict()")
        state_io.require_boundary(self.owners, "load_consolidated_state_dict")
        state_consolidated.load_consolidated_state_dict(self.owners, state_dict, self.params)


def close_unfinished(driver: RoundDriver) -> None:
    """An optimizer dropped, or alive at interpreter exit, without ``finish()``: let the in-flight round end,
    then release the round group (a round left running, or gloo work freed during interpreter finalisation,
    aborts the process). No collective: the peers may be gone or elsewhere."""
    if driver.close_at_exit():
        log.info("acco: closed without finish(): the in-flight round ended, the round group released")


def make_closer(owner: Any, runtime: Runtime) -> Any:
    """Close ``runtime`` when ``owner`` (the front) is dropped or at exit without ``finish()``."""
    return hooks.close_unfinished(owner, partial(close_unfinished, runtime.driver))
