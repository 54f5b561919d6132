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
``driver.py``; what follows a hand-off is the optimizer's ``_after_handoff``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from . import _validation as V
from .rounds import RoundKind, round_kind

if TYPE_CHECKING:  # pragma: no cover
    from .optimizer import AccoOptimizer

__all__ = ["ElasticLoop", "UpdateLoop"]

log = logging.getLogger("acco")


class UpdateLoop:
    """One ``step()`` per update."""

    queues_end_of_backward = True  # the estimate's hand-off point is the end of a backward pass

    def __init__(self, opt: "AccoOptimizer") -> None:
        self.opt = opt

    def after_backward(self) -> None:
        """A micro-batch's backward has finished: count it; in mode acco the backward that completes the first
        half of the update hands off the estimate round."""
        opt, p = self.opt, self.opt._progress
        p.mb_in_update += 1
        p.at_boundary = False
        m = p.microbatches_per_update
        if (opt.mode == "acco" and m is not None and not p.estimate_in_update and p.mb_in_update == self.estimate_at(m)
                and p.commits_handed_off >= opt.synchronous_updates):
            opt._check_open()
            p.update_hyper = opt._hyperparams()  # both rounds of one update use the same
            opt._driver.handoff(RoundKind.ESTIMATE, p.mb_in_update, m / (p.mb_in_update * opt.world_size))
            p.estimate_in_update = True

    def estimate_at(self, m: int) -> int:
        """The micro-batches of an update before its estimate's hand-off (the first "half")."""
        return m // 2

    def zero_grad(self) -> None:
        """Discard the update's micro-batches so far (refused once its estimate is handed off)."""
        p = self.opt._progress
        if p.estimate_in_update:
            h = self.estimate_at(p.microbatches_per_update)
            raise RuntimeError(
                "AccoOptimizer.zero_grad() in the middle of an update whose estimate round (its first "
                f"{h} micro-batches) is already handed off: those gradients cannot be discarded. "
                "Call zero_grad() after step() (or before the update's first backward())"
            )
        self.opt._flat.zero_grads(update_loop=True)
        p.mb_in_update = 0
        p.at_boundary = True

    def step(self) -> None:
        """Hand off the update's commit round (synchronously when there is nothing to overlap it with)."""
        opt, p = self.opt, self.opt._progress
        m = p.mb_in_update
        if m == 0:
            raise RuntimeError(
                "AccoOptimizer.step(): no gradient reached this optimizer's parameters since the last step(). "
                "Either no backward() ran (one step() is one update of the backward() calls before it), or the "
                "model's parameters were replaced after AccoOptimizer was built (model.to() to another device "
                "type, load_state_dict(assign=True), ...): build the optimizer after moving the model"
            )
        opt._flat.check_untouched(opt._clip_hint)
        synchronous = opt.mode == "sync" or p.commits_handed_off < opt.synchronous_updates
        if opt.mode == "acco" and p.microbatches_per_update is None:
            self._learn_microbatches(m)
            synchronous = True
        elif p.microbatches_per_update is not None and m > p.microbatches_per_update:
            raise RuntimeError(
                f"AccoOptimizer.step() after {m} backward() calls, but this optimizer takes "
                f"microbatches_per_update={p.microbatches_per_update} (fewer are fine, e.g. at the end of an "
                "epoch): call step() after that many, or build the optimizer with the number you run"
            )
        elif opt.mode == "acco" and not p.estimate_in_update:
            synchronous = True  # a short update (fewer than half the micro-batches): no estimate, no overlap
        if not p.estimate_in_update:
            p.update_hyper = opt._hyperparams()
        opt._driver.handoff(RoundKind.COMMIT, m, 1.0 / opt.world_size)
        p.mb_in_update = 0
        p.estimate_in_update = False
        opt._after_handoff(RoundKind.COMMIT, synchronous)

    def _learn_microbatches(self, m: int) -> None:
        """Mode acco without microbatches_per_update: the first update's count, the same on every rank."""
        opt = self.opt
        counts = [row[0] for row in opt._all_gather_row([m], "step() (the first update)")]
        if len(set(counts)) > 1:
            raise RuntimeError(
                f"AccoOptimizer.step(): the ranks ran different numbers of micro-batches in the first update "
                f"{counts} (rank i at index i); run the same number on every rank, or pass "
                "accumulate_while_communicating=True for ranks of unequal speed"
            )
        if m < 2:
            raise ValueError(V.ACCO_NEEDS_TWO.format(m=m))
        opt._progress.microbatches_per_update = m
        log.info("acco: %d micro-batches per update (learned from the first update, which ran synchronously)", m)


class ElasticLoop:
    """Accumulate while communicating: ``step()`` after every micro-batch."""

    queues_end_of_backward = False  # hand-offs happen in step() only

    def __init__(self, opt: "AccoOptimizer") -> None:
        self.opt = opt

    def after_backward(self) -> None:  # pragma: no cover - never queued
        raise AssertionError("ElasticLoop hands off in step() only")

    def zero_grad(self) -> None:
        """The micro-batch's ``.grad`` only: what ``step()`` folded belongs to the library and is kept."""
        self.opt._flat.zero_grads(update_loop=False)

    def step(self) -> None:
        """Fold this micro-batch in; hand off a round if one can start."""
        opt, p = self.opt, self.opt._progress
        opt._flat.fold(opt._clip_hint)
        p.at_boundary = False
        p.since_handoff += 1
        p.in_accum += 1
        if p.since_handoff < opt.min_microbatches:
            return
        # Accumulate while you communicate: keep computing while the round is in flight, unless the bound is reached.
        if not opt.scheduler.done() and (opt.max_microbatches is None or p.since_handoff < opt.max_microbatches):
            return
        kind = round_kind(opt.mode, p.num_rounds)
        count = p.in_accum
        if kind is RoundKind.COMMIT:
            p.in_accum = 0
        p.since_handoff = 0
        if opt.mode != "acco" or kind is RoundKind.ESTIMATE:
            p.update_hyper = opt._hyperparams()  # both rounds of one acco update use the same
        opt._driver.handoff(kind, count, None)
        opt._after_handoff(kind, opt.mode == "sync")
