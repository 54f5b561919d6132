"""Hands rounds to the scheduler and collects them.

:class:`RoundDriver` is the one owner of the round in flight and of what
comes back from rounds: the collected result whose weights wait for the
theta/theta~ swap (``progress.pending``), the round history behind
``round_stats()``, the CUDA path's device reports not yet read, and the
failure that ends training. It does not decide *when* a round is handed off
(``loops.py`` does) nor what a round computes (``rounds.py``).
"""

from __future__ import annotations

import statistics
from collections import OrderedDict, deque
from dataclasses import replace
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch.utils.hooks import RemovableHandle

from .agreement import COLLECTIVE_CALLS, hyper_fingerprint, waiting_failed
from .buffers import FlatBuffers
from .collectives import all_reduce_max, release_round_group
from .progress import Progress
from .rounds import (
    HyperParameterMismatchError,
    NonFiniteGradientError,
    RoundContext,
    RoundFailedError,
    RoundKind,
    RoundMismatchError,
    RoundResult,
    RoundSpec,
    mark_call,
    report_outcome,
    run_round,
)
from .scheduler import StreamScheduler
from .stats import RoundRecord

__all__ = ["RoundDriver"]

_ALL_RANKS_ALIKE = (NonFiniteGradientError, HyperParameterMismatchError, RoundMismatchError)


class RoundDriver:
    HISTORY_LIMIT = 100_000  # rounds kept for round_stats()
    EVENTS_KEPT = 64  # CUDA: rounds whose timing events and count copies are held before they are settled

    def __init__(self, ctx: RoundContext, scheduler: StreamScheduler, progress: Progress, flat: FlatBuffers,
                 rank: int, world_size: int) -> None:
        self.ctx, self.scheduler, self.progress, self.flat = ctx, scheduler, progress, flat
        self.rank, self.world_size = rank, world_size
        self.failed: Optional[BaseException] = None
        self.last_grad_norm: Optional[torch.Tensor] = None
        self.history: "deque[RoundRecord]" = deque(maxlen=self.HISTORY_LIMIT)
        self._settled = 0  # records before this index hold no events (a deque index: shifts when full)
        # CUDA path: rounds decided on the device whose reports the host has not read yet (oldest first), as
        # (round number, end event, result).
        self._unread: "deque[Tuple[int, Any, RoundResult]]" = deque()
        # and delay_correction's copy of the slice: allocated on the default stream, written by the side stream
        self._round_tensors = flat.round_tensors() + [t for t in (ctx.delay_scratch,) if t is not None]
        self.commit_hooks: "OrderedDict[int, Callable[[], None]]" = OrderedDict()  # register_commit_hook
        # compression="auto" (auto.py): a stamp at each commit hand-off below ``stamp_upto`` (commits handed off
        # before it), with the rounds collected and handed off by then: the window it measures
        self.stamp_upto = 0
        self.stamps: Dict[int, Tuple[Any, int, int]] = {}

    def check_not_failed(self) -> None:
        if self.failed is not None:
            raise RuntimeError("AccoOptimizer: a previous round failed; this optimizer cannot continue") from self.failed

    # ------------------------------------------------------------ hand-off

    def handoff(self, kind: RoundKind, local_microbatches: int, grad_scale: Optional[float],
                delay_correction: float = 0.0, unscale: Optional[torch.Tensor] = None) -> None:
        """Start round ``kind`` on the gradients accumulated so far, with ``progress.update_hyper``
        (``delay_correction``: the error feedback's ``c`` for this commit, 0 for none; ``unscale``: 1/loss scale)."""
        commits = self.progress.commits_handed_off
        if kind is RoundKind.COMMIT and commits < self.stamp_upto:  # the end of an update's compute, before waiting
            # (rounds collected, and the history index of the next round handed off: the one in flight is before it)
            collected = self._collected()
            self.stamps[commits] = (self.scheduler.stamp(), collected, collected + int(self.scheduler.in_flight))
        self.collect()
        # Round k's hand-off first reads round k-2's report: every rank raises a device-found error at the same
        # hand-off, before issuing round k, so no rank is left in a collective its peers never issue.
        self.read_reports(upto=self.progress.num_rounds - 2)
        self.install_pending()  # the previous round's weights are the model's for the micro-batches after this hand-off
        missing = self.flat.handoff(commit=kind is RoundKind.COMMIT)  # and the parameters without a gradient
        hyper = self.progress.update_hyper
        spec = RoundSpec(
            kind, local_microbatches, grad_scale, hyper, hyper_fingerprint(hyper),
            2 * self.progress.num_rounds + int(kind is RoundKind.ESTIMATE),  # the same on every rank, or all raise
            delay_correction, missing, unscale,
        )
        self.progress.round_handed_off(kind)
        ctx = replace(self.ctx)  # as of this hand-off (release_group() may clear the group later)
        # CUDA: the side stream reads ``unscale`` (made on the compute stream): recorded for it, with the rest.
        uses = self._uses(hyper) + ([unscale] if unscale is not None and self.scheduler.uses_streams else [])
        self.scheduler.submit(lambda: run_round(ctx, spec), uses=uses)

    def _uses(self, hyper: List[Dict[str, Any]]) -> List[torch.Tensor]:
        """CUDA path: what the side stream will touch that other streams may have allocated."""
        if not self.scheduler.uses_streams:
            return []
        return (self._round_tensors + [v for g in hyper for v in g.values() if torch.is_tensor(v)]
                + self.ctx.wrapped.state_tensors())

    def switch_transport(self, transport: Any) -> None:
        """Send the rounds handed off from now on in ``transport`` (``compression="auto"``'s choice). Taken
        between updates: the round in flight, if any, is a commit that keeps the transport it was handed (its
        context holds it), and a commit's weights are installed alike by every transport. No collective."""
        if self.progress.pending is RoundKind.ESTIMATE or self.progress.estimate_in_update:
            raise AssertionError("switch_transport inside an update")
        self.flat.transport = transport
        self.ctx = replace(self.ctx, transport=transport)
        self._round_tensors = self.flat.round_tensors() + [t for t in (self.ctx.delay_scratch,) if t is not None]

    def max_over_shards(self, row: List[int]) -> List[int]:
        """The elementwise max of ``row`` over the model group (DTensor parameters: the ranks holding this rank's
        other shards, whose rounds are other replica groups'), so that every shard's rounds take one decision;
        ``row`` itself without a model group. Collective on the model group, issued where the rounds run (the
        worker thread; CUDA: the side stream, after the rounds on it) with no round in flight."""
        group = self.ctx.model_group
        if group is None:
            return list(row)
        if self.scheduler.in_flight:
            raise AssertionError("max_over_shards with a round in flight")
        t = torch.tensor(row, dtype=torch.int64, device=self.scheduler.device)
        self.scheduler.submit(lambda: all_reduce_max(t, group), uses=(t,))
        self.scheduler.wait()  # compute stream waits for the exchange's end (CPU: the worker ran it)
        # Host waits for the side stream's exchange before reading its result (CUDA; once per run).
        self.scheduler.host_wait(self.scheduler.last_end_event)
        return [int(v) for v in t.tolist()]

    def _collected(self) -> int:
        """Rounds collected so far (the history's next index)."""
        return self.history[-1].index + 1 if self.history else 0

    def measure_updates(self, first: int, last: int) -> Optional[Any]:
        """What the updates after commit hand-off ``first`` up to commit hand-off ``last`` (counted from 0) took
        on this rank (``auto.Measurement``): their compute per update, the time between the two stamps less the
        waits for the rounds collected between them; and the median round of each kind among those handed off
        after the first stamp (collect the round in flight first: it is one of them). None without both stamps
        (a run resumed in between). CUDA: the host waits for the second stamp once (the window's events)."""
        from .auto import Measurement  # noqa: PLC0415 (auto.py is the one reader)

        if first not in self.stamps or last not in self.stamps:
            return None
        (start, lo, handed), (end, hi, _) = self.stamps[first], self.stamps[last]
        elapsed = self.scheduler.seconds_between(start, end)
        records = [r.as_dict() for r in self.history if r.index >= min(lo, handed)]
        waits = sum(r["wait_s"] or 0.0 for r in records if lo <= r["round"] < hi)
        rounds = {k: [r["round_s"] for r in records if r["round"] >= handed and r["kind"] == k
                      and r["round_s"] is not None] for k in ("estimate", "commit")}
        if not rounds["commit"]:
            return None
        return Measurement(max(elapsed - waits, 0.0) / (last - first),
                           statistics.median(rounds["estimate"]) if rounds["estimate"] else None,
                           statistics.median(rounds["commit"]))

    # ------------------------------------------------------------ collection

    def collect(self) -> Optional[RoundResult]:
        """Wait for the in-flight round; its weights stay pending in the round buffer."""
        if not self.scheduler.in_flight:
            return None
        try:
            result = self.scheduler.wait()
        except _ALL_RANKS_ALIKE as exc:
            self.failed = exc
            raise
        except (KeyboardInterrupt, SystemExit) as exc:  # a signal (Ctrl-C, a handler's sys.exit) stays what it is
            if not self.scheduler.in_flight:  # CUDA: it cut the round's issue short, the round group is unusable
                self.failed = exc
            raise  # CPU: it interrupted the wait, and the round is still in flight (still collectable)
        except BaseException as exc:
            self.failed = exc
            raise RoundFailedError(
                f"AccoOptimizer (rank {self.rank} of {self.world_size}): round {self.progress.num_rounds - 1} failed: "
                f"{type(exc).__name__}: {exc}. The usual cause is a peer that died or stopped calling step() "
                "(killed, out of memory, an exception in its own code, or it left its loop early): its own log "
                "says which. This optimizer cannot continue; restart from the last checkpoint."
            ) from exc
        p = self.progress
        p.round_collected(result.kind, result.total_microbatches[0], result.skipped)  # compute side, after the round
        if result.report is not None:
            self._unread.append((self.progress.num_rounds - 1, self.scheduler.last_timing.end, result))
        self.last_grad_norm = result.grad_norm
        self._record(result)
        return result

    def _record(self, result: RoundResult) -> None:
        ready = None
        if self.scheduler.uses_streams:  # the history keeps pinned host copies, not device memory
            counts = self.scheduler.host_empty((1 + self.world_size,), result.total_microbatches.dtype)
            # compute stream, after the round (wait() ordered it): no host sync; read once `ready` completes
            counts.copy_(torch.cat([result.total_microbatches, result.rank_microbatches]), non_blocking=True)
            ready = self.scheduler.mark()
            total, per_rank = counts[:1], counts[1:]
        else:
            total = result.total_microbatches.clone()  # the round's buffers are reused by the next round
            per_rank = result.rank_microbatches.clone()
        index = self.history[-1].index + 1 if self.history else 0
        if len(self.history) == self.history.maxlen:
            self._settled = max(0, self._settled - 1)  # the oldest record is about to go
        self.history.append(RoundRecord(index, result.kind.value, result.local_microbatches, total, per_rank,
                                        self.scheduler.last_timing, ready))
        # CUDA: older rounds give their events back once complete, so the history holds plain numbers.
        while self._settled < len(self.history) - self.EVENTS_KEPT and self.history[self._settled].settle():
            self._settled += 1

    def agree_on_rounds(self, call_index: int) -> None:
        """Before public collective call ``call_index`` (of ``agreement.COLLECTIVE_CALLS``): wait for this rank's
        round in flight, then exchange a call mark on the rounds' own group (``rounds.mark_call``), where a rank
        still in a round it handed off (one update ahead of the others) meets it: every rank then raises
        :class:`~acco.RoundMismatchError` saying the ranks ran different numbers of updates, instead of each
        waiting in its own collective until the timeout. Collective on the round group."""
        self.check_not_failed()
        self.collect()
        group = self.ctx.group
        if group is None:
            return
        ctx = replace(self.ctx)
        self.scheduler.submit(lambda: mark_call(ctx, call_index, 2 * self.progress.num_rounds))
        try:
            self.scheduler.wait()  # not a round: nothing recorded
        except RoundMismatchError as exc:
            self.failed = exc
            raise
        except BaseException as exc:  # a timeout, a peer gone: the rounds' group cannot be trusted any more
            self.failed = exc
            raise waiting_failed(COLLECTIVE_CALLS[call_index], exc) from exc

    def add_commit_hook(self, hook: Callable[[], None]) -> RemovableHandle:
        """``hook()`` after each committed update's weights went into the model (``register_commit_hook``)."""
        handle = RemovableHandle(self.commit_hooks)
        self.commit_hooks[handle.id] = hook
        return handle

    def install_pending(self, commits_only: bool = False) -> None:
        """theta/theta~ swap: put the collected round's weights into the model; after a commit's, the commit
        hooks run with the model holding them (on the compute side, ordered after the install)."""
        p = self.progress
        installed = None
        if p.pending is not None and (not commits_only or p.pending is RoundKind.COMMIT):
            self.flat.install(self.scheduler, estimate=p.pending is RoundKind.ESTIMATE)
            installed = p.pending
        p.installed(installed)
        if installed is RoundKind.COMMIT:
            with torch.no_grad():
                for hook in list(self.commit_hooks.values()):
                    hook()

    def read_reports(self, upto: Optional[int] = None) -> None:
        """CUDA path: read the reports of the rounds numbered up to ``upto`` (``None``: all, after the host has
        waited for the last round) and raise what the CPU path raises inside the round.

        Where an error surfaces is a point of the program, the same on every rank: never "whenever the
        device happens to be done", which differs between ranks. At hand-off ``k`` (``upto=k-2``) the host
        waits for round ``k-2``'s end event, which is complete in practice: the compute stream already waited
        for it at hand-off ``k-1``, a whole half batch earlier, so this blocks only a host running more than
        a half batch ahead of the device (``StreamScheduler.host_waits`` counts those).
        """
        if upto is None and self._unread:
            self.scheduler.synchronize()  # host waits for the last round, hence for all before it (one stream)
        while self._unread and (upto is None or self._unread[0][0] <= upto):
            _, end, result = self._unread.popleft()
            self.scheduler.host_wait(end)
            exc, skipped_on_device = report_outcome(result, self.ctx.nonfinite)
            self.progress.skipped_on_device(int(skipped_on_device))
            if exc is not None:
                self.failed = exc
                self._unread.clear()
                raise exc

    # ------------------------------------------------------------ the end

    def close(self, ok: bool) -> None:
        """Stop the scheduler: after a failure the worker may be stuck in a collective with a dead peer, so it
        is not waited for; otherwise (CUDA) the host waits for the last round's end before its group goes."""
        self.scheduler.close(wait=ok, join_timeout=10.0 if ok else 0.0)
        if not ok and self.ctx.outer is not None:  # a failed run: the outer round in flight is not waited for
            self.ctx.outer.release(abort=True)
        self.release_group()

    def close_at_exit(self) -> bool:
        """The optimizer was dropped, or the interpreter exits, without ``finish()``: let the in-flight round end,
        then release the round group. No collective. Returns whether the round ended.

        A round that does not end in time (a peer that never issued it, or a round whose issue an interrupt cut
        short) is not waited for: its group is aborted instead (NCCL: the communicator is aborted without
        waiting for its kernels; gloo: its pending work is cancelled), so the process exits promptly either way.
        """
        failed = self.failed is not None
        ended = self.scheduler.settle(timeout=1.0 if failed else 60.0)
        self.scheduler.close(wait=False, join_timeout=5.0 if ended else 0.0)  # the worker drops the round's tensors
        outer = self.ctx.outer  # outer_every: its round in flight, if a peer region issued it too, else aborted
        if outer is not None:
            outer.release(abort=not (ended and outer.settle(timeout=1.0 if failed else 60.0)))
        self.release_group(abort=not ended)
        return ended

    def release_group(self, abort: bool = False) -> None:
        """Release (destroy, keep for the next optimizer, or with ``abort`` abort) the process group the rounds
        used, now rather than during interpreter finalisation.

        gloo's worker threads release finished work (and its Python tensors)
        when the group is destroyed; if that happens during interpreter
        finalisation the process aborts ("terminate called without an active
        exception", pytorch/pytorch#190489).
        """
        group, self.ctx.group = self.ctx.group, None
        if group is not None:
            release_round_group(group, abort)
        model, self.ctx.model_group = self.ctx.model_group, None  # DTensor parameters: the norm's other group
        if model is not None:
            release_round_group(model, abort)
        if self.ctx.outer is not None:  # outer_every: the group across regions, once its round in flight has ended
            self.ctx.outer.release(abort)
