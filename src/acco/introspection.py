"""What an :class:`~acco.AccoOptimizer` tells about itself: progress, rounds, memory. Read-only, local (no
collective); each property reads the owner of its state (``progress.py``, ``driver.py``, ``buffers.py``)."""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from . import functional
from .stats import summarize

__all__ = ["Introspection"]


class Introspection:
    """Mixed into :class:`~acco.AccoOptimizer`."""

    @property
    def process_group(self) -> Any:
        """The group the optimizer averages over (``None``: one process)."""
        return self._runtime.group

    @property
    def device(self) -> Any:
        """The device of the parameters and of every buffer of the library."""
        return self._runtime.flat.master.device

    @property
    def num_rounds(self) -> int:
        """Rounds handed off."""
        return self._runtime.progress.num_rounds

    @property
    def num_updates(self) -> int:
        """Committed updates collected (their weights are, or are about to be, in the model)."""
        return self._runtime.progress.num_updates

    @property
    def num_skipped_updates(self) -> int:
        """Committed updates skipped because their averaged gradient was not finite (``nonfinite="skip"``)."""
        return self._runtime.progress.num_skipped_updates

    @property
    def next_update_index(self) -> int:
        """0-based index of the committed update that the next hand-off contributes to.

        Set a learning-rate schedule from it (``g["lr"] = f(opt.next_update_index)``
        before ``step()``): in mode acco both halves of a mini-batch then use the
        same rate, and ranks that accumulate at different speeds agree.
        """
        return self._runtime.progress.commits_handed_off

    @property
    def compression_in_use(self) -> Optional[str]:
        """The rounds' wire format now: ``None`` (uncompressed) or a kind; with ``compression="auto"``, its
        choice once made (``None`` before it, or when it keeps the rounds uncompressed)."""
        transport = self._runtime.flat.transport
        return getattr(transport, "kind", None)

    @property
    def holds_committed_weights(self) -> bool:
        """Whether the model's parameters are committed weights (not an estimate theta~)."""
        return not self._runtime.progress.holds_estimate

    @property
    def at_update_boundary(self) -> bool:
        """True right after a step() (with accumulate_while_communicating: the one that handed off a
        committed update) and before any further backward(), or before the first: where a checkpoint
        may be taken."""
        return self._runtime.progress.at_boundary

    @property
    def last_grad_norm(self) -> Optional[float]:
        """Global L2 norm (before clipping) of the averaged gradient of the last collected round."""
        norm = self._runtime.driver.last_grad_norm
        return None if norm is None else float(norm.item())

    def attach_lr_scheduler(self, scheduler: Any) -> Any:
        """Step ``scheduler`` once per committed update handed off (every rank alike).

        Only needed with ``accumulate_while_communicating``, where ``step()`` calls
        differ across ranks; otherwise step the scheduler after ``step()`` as usual.
        Do not also call ``scheduler.step()`` yourself. Returns ``scheduler``.
        """
        self._runtime.lr_schedulers.append(scheduler)
        return scheduler

    @property
    def committed_microbatches(self) -> int:
        """Micro-batches of all ranks in the committed updates so far (reads the device)."""
        return int(self._runtime.progress.committed_mb.item())

    def microbatch_history(self) -> List[Dict[str, Any]]:
        """Per collected round: kind, this rank's and all ranks' micro-batch counts (reads the device)."""
        keys = ("kind", "local_microbatches", "total_microbatches", "rank_microbatches")
        return [{k: r[k] for k in keys} for r in self.round_stats()]

    def round_stats(self, last: Optional[int] = None) -> List[Dict[str, Any]]:
        """Per collected round (the last ``last``, at most ``RoundDriver.HISTORY_LIMIT``): whether
        communication was hidden.

        Each entry: ``round`` (index), ``kind``, ``local_microbatches``,
        ``total_microbatches``, ``rank_microbatches`` (every rank's count),
        ``compute_s`` (compute-side time while the round was in flight),
        ``round_s`` (the round itself) and ``wait_s`` (how long the compute side
        then waited for it). See :mod:`acco.stats`. Recording costs no device
        synchronisation; this call reads the device (CUDA: timings of rounds
        whose events are still pending are ``None``). Local: no collective.
        """
        records = list(self._runtime.driver.history)
        if last is not None:
            records = records[-last:] if last > 0 else []
        return [r.as_dict() for r in records]

    def overlap_summary(self, last: Optional[int] = None) -> Dict[str, Any]:
        """Means of :meth:`round_stats` and ``hidden``, the share of round time the compute side
        did not wait for (1.0: fully hidden; sync: 0.0). Local: no collective."""
        return summarize(self.round_stats(last))

    def memory_report(self) -> Dict[str, int]:
        """Bytes this rank holds, by buffer: the model's parameters and the library's own buffers.

        Compare with the table in ``docs/algorithm.md``: ``params``, ``grads`` (where
        backward writes when it is not the accumulation buffer itself: 0 in the
        default loop with equal dtypes), ``accum`` and ``comm`` are full-size;
        ``master``, ``master_grad``, ``staging``, ``optimizer_state`` and
        ``estimate_scratch`` (with ``delay_correction``, its copy of the slice
        too) are this rank's 1/N slice; with ``compression``, ``residual`` (the
        error feedback, full size, accumulation dtype) and ``compressed`` (the
        packed chunks out and in, their kind's bits per element each). ``round_temporaries``:
        the most the library allocates at once during a round (on CUDA on the
        side stream, held until the stream has run it): a bound, the larger of
        the estimate's lists and the norm's fp64 slab; the wrapped optimizer's
        own step adds its temporaries (none for fused AdamW). With ``outer_every``, ``outer``: the outer state
        of this rank's slice (anchor, momentum, residual, the round's bytes). Local: no collective.
        """
        self._runtime.driver.collect()  # the round fills the state and the scratch: read them after it
        state = self._runtime.wrapped.state_values()
        snapshot = self._runtime.driver.ctx.snapshot
        master = self._runtime.flat.shard.master
        temporaries = max([functional.temporaries_bound(part.optimizer, master) for part in self._runtime.wrapped.parts
                           if self.options.estimates and functional.supports(part.optimizer)]
                          + [functional.norm_temporaries_bound(master)])  # every round's norm, at another phase
        scratch = [] if snapshot is None else snapshot.tensors()
        if self._runtime.driver.ctx.delay_scratch is not None:
            scratch.append(self._runtime.driver.ctx.delay_scratch)
        report = self._runtime.flat.memory_report(state, scratch, temporaries)
        if self._runtime.driver.ctx.outer is not None:  # outer_every: the anchor, momentum, residual, bytes
            extra = self._runtime.driver.ctx.outer.memory()
            report.update(extra)
            report["library_total"] += sum(extra.values())
        return report
