"""The two ways to drive an :class:`~acco.AccoOptimizer`: when a round is handed off, and which kind.

* :class:`UpdateLoop` (the default): ``backward()`` on the update's
  micro-batches, then one ``step()``, as with any torch optimizer. In mode
  ``acco`` the backward that completes the first half of the update hands off
  the estimate round (from an end-of-backward callback) and puts ``theta_t``
  in the model for the second half; ``step()`` hands off the commit.
* :class:`ElasticLoop` (``accumulate_while_communicating=True``): ``step()``
  after every micro-batch is a hand-off *point*; a round goes only when the
  previous one has finished (and ``min_microbatches`` are in), so a fast rank
  keeps accumulating instead of waiting.

Both move the counters of ``progress.py`` and hand off through
``driver.py``; what follows a hand-off is :func:`after_handoff`. Each loop gets what it needs handed to it in a
:class:`LoopContext`, never the optimizer itself nor a callback into it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Dict, List

import torch

from .agreement import snapshot_hyperparams, sync_buffers
from .options import Options
from .policies import ACCO_NEEDS_TWO
from .rounds import RoundKind, round_kind

__all__ = ["ElasticLoop", "LoopContext", "UpdateLoop", "after_handoff"]

log = logging.getLogger("acco")


@dataclass
class LoopContext:
    """What a loop reads and calls: the configuration that decides hand-offs, the owners of the counters (``progress``),
    the rounds (``driver``) and the buffers (``flat``), and the optimizer's checks and reactions."""

    options: Options  # the resolved configuration (mode, hand-off bounds, synchronous updates, delay correction)
    world_size: int
    progress: Any
    driver: Any
    flat: Any
    round_done: Callable[[], bool]  # whether the in-flight round has finished (the scheduler's)
    session: Any  # the agreement exchange and whether training may go on (session.py)
    param_groups: List[Dict[str, Any]]  # the optimizer's live groups: each hand-off takes their values then
    lr_schedulers: List[Any]  # attached schedulers, stepped at each commit (the optimizer's list, shared)
    model_buffers: List[torch.Tensor]  # buffers= : the first rank's, at each commit
    loss_scale: Any  # what the optimizer knows of a GradScaler (amp.LossScale): the rounds' 1/scale
    auto: Any = None  # compression="auto" (auto.AutoCompression): decides at an update's first hand-off


def check_weights_kept(c: LoopContext) -> None:
    """Before the first round: refuse a model whose weights were written since the optimizer took them (a
    model-only load after construction), which the first round's master weights would silently undo."""
    if c.progress.num_rounds == 0:
        written = c.flat.weights_written()
        if written:
            raise RuntimeError(
                f"AccoOptimizer: parameter(s) {written[:8]}{' ...' if len(written) > 8 else ''} were written after "
                "the optimizer was built and before its first step() (a model-only load: load_state_dict, a "
                "pretrained or seed checkpoint). Its master weights are the ones it was built with, so the write "
                "would be lost. Call opt.take_model_weights() on every rank after writing them, or build the "
                "optimizer after loading the model")


def ranks_divisor(c: LoopContext) -> float:
    """What a round divides the ranks' summed gradients by: their number (DDP's mean), or 1
    (``divide_by_ranks=False``: a loss normalized over every rank's batch, summed across ranks); with
    ``outer_every`` too, ``1 / regions``: the loss is normalized over every region's ranks' batch (torchtitan's
    global token count), so the region's sum is its share of the region's mean."""
    if c.options.handoff.divide_by_ranks:
        return c.world_size
    outer = c.driver.ctx.outer
    return 1.0 / outer.regions if outer is not None else 1


def after_handoff(c: LoopContext, kind: RoundKind, synchronous: bool) -> None:
    """After a hand-off, in both loops: a synchronous round completes and its weights go into the model; a commit
    ends the update (a checkpoint boundary; attached schedulers step, model buffers are broadcast: collective)."""
    if synchronous:
        c.driver.collect()
        c.driver.install_pending()
    if kind is RoundKind.COMMIT:
        c.progress.commit_boundary()
        for scheduler in c.lr_schedulers:
            scheduler.step()  # schedules count committed updates
        sync_buffers(c.model_buffers, c.session.group)


class UpdateLoop:
    """One ``step()`` per update."""

    queues_end_of_backward = True  # the estimate's hand-off point is the end of a backward pass

    def __init__(self, ctx: LoopContext) -> None:
        self.ctx = ctx

    def after_backward(self) -> None:
        """A micro-batch's backward has finished: count it; in mode acco the backward that completes the first
        half of the update hands off the estimate round."""
        c, p = self.ctx, self.ctx.progress
        p.backward_done()
        m = p.microbatches_per_update
        if (c.options.estimates and m is not None and not p.estimate_in_update and p.mb_in_update == self.estimate_at(m)
                and p.commits_handed_off >= c.options.delay.synchronous_updates):
            c.session.check_open()
            check_weights_kept(c)
            p.take_hyper(snapshot_hyperparams(c.param_groups))  # both rounds of one update use the same
            self._maybe_choose_format()
            c.driver.handoff(RoundKind.ESTIMATE, p.mb_in_update, m / (p.mb_in_update * ranks_divisor(c)),
                             unscale=c.loss_scale.for_estimate())
            p.estimate_handed_off()

    def _maybe_choose_format(self) -> None:
        """At an update's first hand-off (no estimate in flight): ``compression="auto"`` decides once its window
        is measured (auto.py). Collective on the control group then, on every rank at the same update."""
        c = self.ctx
        if c.auto is not None and c.auto.due(c.progress.commits_handed_off):
            m = c.progress.microbatches_per_update
            share = self.estimate_at(m) / m if c.options.estimates and m else 0.5
            c.auto.decide(c.driver, c.session, share)

    def estimate_at(self, m: int) -> int:
        """The micro-batches of an update before its estimate's hand-off (the first "half", or
        ``estimate_microbatches``)."""
        return self.ctx.options.delay.estimate_microbatches or m // 2

    def zero_grad(self) -> None:
        """Discard the update's micro-batches so far (refused once its estimate is handed off)."""
        p = self.ctx.progress
        if p.estimate_in_update:
            h = self.estimate_at(p.microbatches_per_update)
            raise RuntimeError(
                "AccoOptimizer.zero_grad() in the middle of an update whose estimate round (its first "
                f"{h} micro-batches) is already handed off: those gradients cannot be discarded. "
                "Call zero_grad() after step() (or before the update's first backward())"
            )
        self.ctx.flat.zero_grads(update_loop=True)
        p.update_discarded()

    def step(self, grad_scaler: Any = None) -> None:
        """Hand off the update's commit round (synchronously when there is nothing to overlap it with).
        ``grad_scaler``: the ``GradScaler`` driving this step (``amp.py``)."""
        c, p = self.ctx, self.ctx.progress
        m = p.mb_in_update
        if m == 0:
            raise RuntimeError(
                "AccoOptimizer.step(): no gradient reached this optimizer's parameters since the last step(). "
                "Either no backward() ran (one step() is one update of the backward() calls before it), or the "
                "model's parameters were replaced after AccoOptimizer was built (model.to() to another device "
                "type, load_state_dict(assign=True), ...): build the optimizer after moving the model"
            )
        c.flat.check_untouched(c.options.clip_hint)
        check_weights_kept(c)
        # Collective with a scaler (inf/NaN on any rank, for its update()).
        unscale, same_scale = c.loss_scale.for_commit(grad_scaler, c.flat.accum, c.session.group, p.estimate_in_update)
        synchronous = c.options.synchronous or p.commits_handed_off < c.options.delay.synchronous_updates
        if not same_scale:
            # The estimate went out unscaled by another scale (the first scaled update of a run): its theta~
            # is not the paper's; the update runs synchronously and the model holds its committed weights.
            log.info("acco: update %d runs synchronously: its estimate was handed off before the loss scale "
                     "in use was known (GradScaler)", p.commits_handed_off)
            synchronous = True
        if c.options.estimates and p.microbatches_per_update is None:
            self._learn_microbatches(m)
            synchronous = True
        elif p.microbatches_per_update is not None and m > p.microbatches_per_update:
            raise RuntimeError(
                f"AccoOptimizer.step() after {m} backward() calls, but this optimizer takes "
                f"microbatches_per_update={p.microbatches_per_update} (fewer are fine, e.g. at the end of an "
                "epoch): call step() after that many, or build the optimizer with the number you run"
            )
        elif c.options.estimates and not p.estimate_in_update:
            synchronous = True  # a short update (fewer micro-batches than the estimate's): no estimate, no overlap
        if not p.estimate_in_update:
            p.take_hyper(snapshot_hyperparams(c.param_groups))
            self._maybe_choose_format()
        # The error feedback corrects a step taken from a stale gradient: not a synchronous update's.
        c.driver.handoff(RoundKind.COMMIT, m, 1.0 / ranks_divisor(c),
                         0.0 if synchronous else c.options.delay.delay_correction,
                         unscale)
        p.update_handed_off()
        after_handoff(c, RoundKind.COMMIT, synchronous)

    def _learn_microbatches(self, m: int) -> None:
        """Mode acco without microbatches_per_update: the first update's count, the same on every rank."""
        counts = [row[0] for row in self.ctx.session.gather_row([m], "step() (the first update)")]
        if len(set(counts)) > 1:
            raise RuntimeError(
                f"AccoOptimizer.step(): the ranks ran different numbers of micro-batches in the first update "
                f"{counts} (rank i at index i); run the same number on every rank, or pass "
                "accumulate_while_communicating=True for ranks of unequal speed"
            )
        if m < 2:
            raise ValueError(ACCO_NEEDS_TWO.format(m=m))
        self.ctx.options.check_microbatches(m)
        self.ctx.progress.learned(m)
        log.info("acco: %d micro-batches per update (learned from the first update, which ran synchronously)", m)


class ElasticLoop:
    """Accumulate while communicating: ``step()`` after every micro-batch."""

    queues_end_of_backward = False  # hand-offs happen in step() only

    def __init__(self, ctx: LoopContext) -> None:
        self.ctx = ctx

    def after_backward(self) -> None:  # pragma: no cover - never queued
        raise AssertionError("ElasticLoop hands off in step() only")

    def zero_grad(self) -> None:
        """The micro-batch's ``.grad`` only: what ``step()`` folded belongs to the library and is kept."""
        self.ctx.flat.zero_grads(update_loop=False)

    def step(self, grad_scaler: Any = None) -> None:
        """Fold this micro-batch in; hand off a round if one can start (loss scaling is refused: it would
        change the scale between the micro-batches of one sum)."""
        if grad_scaler is not None:
            raise NotImplementedError(
                "AccoOptimizer(accumulate_while_communicating=True) with a GradScaler: the scaler's update() after "
                "every micro-batch would sum micro-batches of different scales into one round. Train in bf16 "
                "(no loss scaling), or use the default loop (backward() on each micro-batch, one step() per update)")
        c, p = self.ctx, self.ctx.progress
        c.flat.fold(c.options.clip_hint)
        p.folded()
        if p.since_handoff < c.options.handoff.min_microbatches:
            return
        # Accumulate while you communicate: keep computing while the round is in flight, unless the bound is reached.
        if not c.round_done() and (c.options.handoff.max_microbatches is None or p.since_handoff < c.options.handoff.max_microbatches):
            return
        check_weights_kept(c)
        kind = round_kind(c.options.mode, p.num_rounds)
        count = p.in_accum
        p.elastic_handed_off(commit=kind is RoundKind.COMMIT)
        if not c.options.estimates or kind is RoundKind.ESTIMATE:
            p.take_hyper(snapshot_hyperparams(c.param_groups))  # both rounds of one acco update use the same
        c.driver.handoff(kind, count, None)
        after_handoff(c, kind, c.options.synchronous)
