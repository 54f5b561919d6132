"""AccoOptimizer: the ``torch.optim.Optimizer`` front of the library.

This file only orchestrates: when to hand gradients to a round, which kind of
round, when a finished round's weights go into the model. The layout lives in
``layout.py``, where backward writes in ``grads.py``, the round's math in
``rounds.py``, where it runs in ``scheduler.py``. The equations are those of
``docs/algorithm.md``.

Two ways to drive it:

* **one ``step()`` per update** (the default, as with any torch optimizer):
  ``backward()`` on the update's micro-batches, then ``step()``. In mode
  ``acco`` the library hands off the estimate round itself, from an
  end-of-backward callback, once the first half of the update's micro-batches
  is done, and puts ``theta_t`` in the model for the second half.
* **accumulate while communicating** (``accumulate_while_communicating=True``,
  for loops written for it): ``step()`` after every micro-batch is a hand-off
  *point*; a round is handed off only when the previous one has finished, so a
  fast rank keeps accumulating instead of waiting.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import hashlib
import logging
import sys
import weakref
from collections import deque
from functools import partial
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from . import _validation as V
from . import checkpoint as _checkpoint
from . import ddp as _ddp
from .collectives import group_rank, group_size, ring_algorithm
from .grads import GradBinding
from .layout import FlatLayout
from .rounds import (
    HyperParameterMismatchError,
    NonFiniteGradientError,
    OptimizerSnapshot,
    RoundFailedError,
    RoundKind,
    RoundMismatchError,
    RoundReport,
    RoundResult,
    ShardBuffers,
    hyper_mismatch_message,
    nonfinite_message,
    round_kind,
    round_mismatch_message,
    run_round,
)
from .scheduler import StreamScheduler
from .stats import RoundRecord, nbytes, summarize

__all__ = ["AccoOptimizer", "hyper_fingerprint"]

log = logging.getLogger("acco")


def _digest(text: str) -> int:
    """52 bits of a SHA-256: exact in an int64 and in a float64."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "little") >> 4


def hyper_fingerprint(hyper: List[Dict[str, Any]]) -> float:
    """One float64 that differs when any numeric or other hyper-parameter of any group differs.

    Computed on the host from the hand-off's snapshot; tensors on the host are read, others (CUDA) are
    left out rather than synchronised.
    """
    def value(v: Any) -> Any:
        if torch.is_tensor(v):
            return v.tolist() if v.device.type == "cpu" else "device tensor"
        if isinstance(v, (tuple, list)):
            return [value(x) for x in v]
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        return type(v).__qualname__  # an object's repr may hold its address, which differs across ranks

    return float(_digest(repr([[(k, value(v)) for k, v in sorted(g.items())] for g in hyper])))


class AccoOptimizer(torch.optim.Optimizer):
    """ZeRO-1 sharded optimizer whose communication overlaps computation (ACCO).

    Drop-in for ``torch.optim.AdamW``: ``backward()`` on each micro-batch of an
    update, then one ``step()``, which is one optimizer update in every mode.
    The gradients of all ranks are averaged as DDP averages ``.grad`` (no
    ``DistributedDataParallel`` wrapper: the optimizer communicates), the
    update's reduce-scatter -> sharded step of ``optimizer_class`` ->
    all-gather runs in the background while the next micro-batches compute.
    In mode ``"acco"`` an update needs at least two micro-batches: the first
    half gives an estimate ``theta~`` (handed off when the backward that ends
    the first half finishes), both halves the committed update (handed off by
    ``step()``). ``"dpu"`` (delayed, uncompensated) and ``"sync"`` (plain
    ZeRO-1) are the baselines.

    Construction, ``step()`` and ``finish()`` are collective: call them on all
    ranks of ``process_group``. Construction broadcasts the parameters from the
    group's first rank (as DDP does) and checks that every rank has the same
    model, raising on all ranks if not.

    Args:
        params: ``model.parameters()`` or a list of param-group dicts.
            Parameters with ``requires_grad=False`` are ignored.
        optimizer_class: any element-wise ``torch.optim.Optimizer`` subclass
            (AdamW, Adam, SGD, ...); it runs on this rank's slice only.
        mode: ``"acco"`` | ``"dpu"`` | ``"sync"``.
        process_group: default: the WORLD group when initialised, otherwise one
            process (still asynchronous).
        microbatches_per_update: ``backward()`` calls per ``step()``. Mode acco
            needs it to split an update into halves; ``None``: learned from the
            first update, which then runs synchronously (the model holds
            ``theta_1`` after it instead of the estimate ``theta~_1``).
        accumulate_while_communicating: call ``step()`` after every
            micro-batch; a round is handed off when the previous one has
            finished (and ``min_microbatches`` are accumulated), so ranks of
            unequal speed never wait for each other. Each round then averages
            over all micro-batches of all ranks. Off by default (deterministic).
        min_microbatches, max_microbatches: with
            ``accumulate_while_communicating``: micro-batches to accumulate
            before a hand-off, and at most while a round is in flight
            (``None``: no bound).
        compute_dtype: dtype of the model's parameters (the compute copy), e.g.
            ``torch.bfloat16``; the sharded master stays fp32. ``None``: keep.
        accumulation_dtype: dtype the micro-batches' gradients are summed in,
            over micro-batches and over ranks (``None``: fp32 when the compute
            dtype is bfloat16, as Megatron does, else the compute dtype). When
            it differs from the compute dtype, each parameter's gradient is
            added into the sum as it arrives, and ``.grad`` is a compute-dtype
            buffer of its own that autograd sums into as usual (one more
            compute-dtype copy of the model; the update does not read it).
        max_grad_norm: clip the global L2 norm of the averaged gradient to
            this, as ``clip_grad_norm_`` on DDP's all-reduced gradient would.
            (Clipping ``.grad`` yourself raises: it is the local gradient here.)
        nonfinite: ``"skip"`` (default) an update whose averaged gradient holds
            inf/NaN, counting it in ``num_skipped_updates``, or ``"raise"``
            :class:`~acco.NonFiniteGradientError`; all ranks act alike.
        timeout: how long a round's collectives wait for a peer before
            raising (default: the process group default).
        buffers: the model's buffers (``model.buffers()``, e.g. BatchNorm's
            running statistics) to keep equal across ranks: broadcast from the
            group's first rank at every ``step()``, as DDP broadcasts them.
        assume_elementwise: accept an ``optimizer_class`` that acco does not
            know to be element-wise (your own); the known ones need not.
        **optimizer_kwargs: passed to ``optimizer_class`` (``lr=...``).

    Evaluate or save the committed weights inside :meth:`committed_weights`.
    Whether communication is hidden: :meth:`round_stats`,
    :meth:`overlap_summary`; memory: :meth:`memory_report`.
    """

    HISTORY_LIMIT = 100_000  # rounds kept for round_stats()
    EVENTS_KEPT = 64  # CUDA: rounds whose timing events and count copies are held before they are settled

    def __init__(
        self,
        params: Any,
        optimizer_class: type = torch.optim.AdamW,
        *,
        mode: str = "acco",
        process_group: Optional[dist.ProcessGroup] = None,
        microbatches_per_update: Optional[int] = None,
        accumulate_while_communicating: bool = False,
        min_microbatches: int = 1,
        max_microbatches: Optional[int] = None,
        compute_dtype: Optional[torch.dtype] = None,
        accumulation_dtype: Optional[torch.dtype] = None,
        max_grad_norm: Optional[float] = None,
        nonfinite: str = "skip",
        timeout: Optional[datetime.timedelta] = None,
        buffers: Optional[Iterable[torch.Tensor]] = None,
        assume_elementwise: bool = False,
        **optimizer_kwargs: Any,
    ) -> None:
        V.check_optimizer_class(optimizer_class, assume_elementwise)
        V.check_mode(mode)
        V.check_handoffs(mode, microbatches_per_update, accumulate_while_communicating, min_microbatches, max_microbatches)
        V.check_clipping(max_grad_norm, nonfinite)
        groups = V.normalize_param_groups(params)
        super().__init__(groups, dict(optimizer_kwargs))
        self._params: List[torch.Tensor] = [p for g in self.param_groups for p in g["params"]]
        V.check_params(self._params)
        V.check_dtypes(self._params[0].dtype, compute_dtype)

        self.mode = mode
        self.microbatches_per_update = microbatches_per_update
        self.accumulate_while_communicating = bool(accumulate_while_communicating)
        self.min_microbatches = min_microbatches
        self.max_microbatches = max_microbatches
        self.optimizer_class = optimizer_class
        self.max_grad_norm = max_grad_norm
        self.nonfinite = nonfinite
        self._group = V.resolve_process_group(process_group)
        self.world_size = group_size(self._group)
        self.rank = group_rank(self._group)
        device = self._params[0].device
        param_dtype = self._params[0].dtype
        self.compute_dtype = compute_dtype or param_dtype
        self.accumulation_dtype = V.check_accumulation_dtype(accumulation_dtype, self.compute_dtype)
        master_dtype = torch.float64 if param_dtype == torch.float64 else torch.float32
        self._model_buffers = V.check_buffers(buffers, device)

        self.layout = FlatLayout.build([p.shape for p in self._params], self.world_size)
        if self._group is not None:
            self._check_same_model_across_ranks()
            self._broadcast_parameters()
            # Rounds talk on a group of their own, so the user's collectives on the
            # main thread can never interleave with a round's on the worker.
            self._round_group = dist.new_group(
                ranks=dist.get_process_group_ranks(self._group),
                backend=dist.get_backend(self._group),
                timeout=timeout,
                use_local_synchronization=self._group is not dist.group.WORLD,
            )
        else:
            self._round_group = None

        # fp32 master slice, from the parameters before any cast to compute_dtype: each piece copied
        # straight from its parameter (no full-size temporary).
        master = torch.zeros(self.layout.shard_size, dtype=master_dtype, device=device)
        with torch.no_grad():
            for pc in self.layout.pieces(self.rank):
                if pc.numel:
                    flat = self._params[pc.index].detach().reshape(-1)
                    master[pc.local_start : pc.local_end].copy_(flat[pc.param_start : pc.param_end])
            if self.compute_dtype != param_dtype:
                for p in self._params:
                    p.data = p.data.to(self.compute_dtype)  # once, at construction: addresses fixed from here on

        cd = self.compute_dtype
        n = self.layout.padded_numel
        self._accum = torch.zeros(n, dtype=self.accumulation_dtype, device=device)  # gradient sum since the last commit
        ad = self.accumulation_dtype
        # Round in/out: gradients out (summed over ranks in accumulation_dtype), weights in (compute dtype,
        # in the same memory: the reduce-scatter has read the gradients before the all-gather writes).
        self._comm = torch.zeros(n, dtype=ad, device=device)
        self._comm_weights = self._comm if ad == cd else self._comm.view(torch.uint8)[: n * cd.itemsize].view(cd)
        self._comm_views = self.layout.views(self._comm_weights)
        # Where backward writes. One step() per update: straight into the accumulation buffer, unless
        # that is of another dtype (then a buffer of its own, folded into accum as each gradient arrives).
        # Accumulating while communicating: a buffer of its own, folded into accum at each step().
        self._fold_on_arrival = not self.accumulate_while_communicating and self.accumulation_dtype != cd
        separate = self.accumulate_while_communicating or self._fold_on_arrival
        self._grads = torch.zeros(n, dtype=cd, device=device) if separate else self._accum
        self._accum_views = self.layout.views(self._accum)
        self._binding = GradBinding(self._params, self.layout.views(self._grads), self._grads)
        self._buffers = ShardBuffers(
            comm=self._comm,
            weights=self._comm_weights,
            master=master,
            grad=torch.zeros_like(master),
            count=torch.zeros(1, dtype=master_dtype, device=device),
            rank_counts=torch.zeros(self.world_size, dtype=master_dtype, device=device),
            row=torch.zeros(3, dtype=torch.float64, device=device),
            rows=torch.zeros(3 * self.world_size, dtype=torch.float64, device=device),
            staging=None if cd == master_dtype else torch.zeros(self.layout.shard_size, dtype=cd, device=device),
            collectives=ring_algorithm(self._round_group),
        )
        if ad != master_dtype:  # gradients reduced in a narrower dtype than the master's: their own landing slice
            b = self._buffers
            b.grad_staging = b.staging if ad == cd else torch.zeros(self.layout.shard_size, dtype=ad, device=device)

        # The wrapped optimizer: one piece (view of the master slice) per parameter.
        self._pieces: List[torch.Tensor] = []
        local_groups = []
        pieces = self.layout.pieces(self.rank)
        k = 0
        for g in self.param_groups:
            group_pieces = []
            for _ in g["params"]:
                pc = pieces[k]
                t = master[pc.local_start : pc.local_end]
                t.grad = self._buffers.grad[pc.local_start : pc.local_end]
                group_pieces.append(t)
                k += 1
            self._pieces.extend(group_pieces)
            local_groups.append({**{key: v for key, v in g.items() if key != "params"}, "params": group_pieces})
        optimizer_kwargs = V.device_resident_state(optimizer_class, optimizer_kwargs, device)
        try:
            self.local_optimizer = optimizer_class(local_groups, **optimizer_kwargs)
        except TypeError as exc:
            raise TypeError(f"{optimizer_class.__name__} rejected optimizer_kwargs {sorted(optimizer_kwargs)}: {exc}") from exc
        # Fill every group with the wrapped optimizer's defaults: param_groups is the live truth rounds read.
        for key, value in self.local_optimizer.defaults.items():
            self.defaults.setdefault(key, value)
        for g, lg in zip(self.param_groups, self.local_optimizer.param_groups):
            for key, value in lg.items():
                if key != "params":
                    g.setdefault(key, value)

        self.scheduler = StreamScheduler(device)
        # Scratch for Opt* (mode acco), and on the CUDA path for undoing a skipped step on the device.
        self._snapshot = OptimizerSnapshot() if mode == "acco" or self.scheduler.uses_streams else None
        self._buffers.host_empty = self.scheduler.host_empty
        self._round_tensors = [t for t in vars(self._buffers).values() if torch.is_tensor(t)]
        # CUDA path: rounds decided on the device whose reports the host has not read yet (oldest first).
        self._unread: "deque[Tuple[Any, RoundResult]]" = deque()
        self._since_handoff = 0  # micro-batches folded since the last hand-off
        self._in_accum = 0  # micro-batches in the accumulation buffer
        self._finished = False
        self._failed: Optional[BaseException] = None
        self._in_committed_view = False
        self._view_swapped = False
        self.num_rounds = 0  # rounds handed off
        self.num_updates = 0  # committed updates now in the model
        self._commits_handed_off = 0
        self._holds_estimate = False  # the model's parameters are an estimate theta~
        self._estimate_in_update = False  # this update's estimate round was handed off
        self._ddp_checked = False
        self._pending: Optional[RoundKind] = None  # a collected round whose weights are not yet in the model
        self._update_hyper: List[Dict[str, Any]] = []  # hyper-parameters of the update being handed off
        self._lr_schedulers: List[Any] = []
        self._at_boundary = True  # no micro-batch since the last committed hand-off
        self.num_skipped_updates = 0
        self._last_grad_norm: Optional[torch.Tensor] = None
        self._history: "deque[RoundRecord]" = deque(maxlen=self.HISTORY_LIMIT)
        self._settled = 0  # records before this index hold no events (a deque index: shifts when full)
        self._committed_mb = torch.zeros((), dtype=torch.float64, device=device)
        self._backward_queued = -1  # id of the autograd graph task whose end-of-backward callback is queued
        self._mb_in_update = 0  # backward() calls since the last step() (one step() per update)
        # Weak references: parameters (hooks) and the exit handler must not keep the optimizer and
        # its process group alive in a cycle that only the collector breaks at exit.
        self_ref = weakref.ref(self)
        self._constructed = True  # add_param_group() from here on would change the layout: refused
        self._hook_handles = [
            p.register_post_accumulate_grad_hook(partial(_after_accumulate, self_ref, i)) for i, p in enumerate(self._params)
        ]
        if self._fold_on_arrival:  # each backward's gradient is summed in accumulation_dtype as it arrives
            self._hook_handles += [p.register_hook(partial(_before_accumulate, self_ref, i)) for i, p in enumerate(self._params)]
        _LIVE.add(self)  # closed at interpreter exit if finish() never came

    # ------------------------------------------------------------------ checks

    def _fingerprints(self) -> List[Any]:
        """(what, description) of everything that must agree across ranks: the model and every option and
        hyper-parameter that changes the math."""
        hyper = [{k: v for k, v in sorted(g.items()) if k != "params"} for g in self.param_groups]
        return [
            ("the model (parameter shapes/dtypes, param groups)",
             [len(g["params"]) for g in self.param_groups] + [f"{tuple(p.shape)}:{p.dtype}" for p in self._params]),
            ("mode", self.mode),
            ("optimizer_class", f"{self.optimizer_class.__module__}.{self.optimizer_class.__qualname__}"),
            ("microbatches_per_update / accumulate_while_communicating / min/max_microbatches",
             (self.microbatches_per_update, self.accumulate_while_communicating, self.min_microbatches,
              self.max_microbatches)),
            ("compute_dtype", str(self.compute_dtype)),
            ("accumulation_dtype", str(self.accumulation_dtype)),
            ("max_grad_norm", self.max_grad_norm),
            ("nonfinite", self.nonfinite),
            ("the hyper-parameters of the param groups (lr, betas, weight_decay, ...)", hyper_fingerprint(hyper)),
        ]

    def _all_gather_row(self, row: List[int]) -> List[List[int]]:
        """Every rank's ``row`` of ints, in rank order. Collective on the user's group."""
        mine = torch.tensor(row, dtype=torch.int64, device=self._params[0].device)
        everyone = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(everyone, mine, group=self._group)
        return [t.tolist() for t in everyone]

    def _check_same_model_across_ranks(self) -> None:
        """All-gather fingerprints of the model and options; raise on every rank if any differ. Collective."""
        fields = self._fingerprints()
        row = [len(self._params), self.layout.numel] + [_digest(repr(value)) for _, value in fields]
        rows = self._all_gather_row(row)
        if any(r != rows[0] for r in rows):
            differ = [what for i, (what, _) in enumerate(fields) if len({r[i + 2] for r in rows}) > 1]
            detail = "; ".join(f"rank {i}: {r[0]} tensors, {r[1]} elements" for i, r in enumerate(rows))
            raise RuntimeError(
                f"AccoOptimizer: the ranks disagree on {', '.join(differ) or 'the model'} ({detail}). Build the "
                "same model and AccoOptimizer arguments on every rank: each rank would otherwise step its shard "
                "with its own values."
            )

    def _broadcast_parameters(self) -> None:
        """Give every rank the first rank's parameters, as DDP does. Collective."""
        src = dist.get_global_rank(self._group, 0)
        with torch.no_grad():
            for p in self._params:
                dist.broadcast(p.data, src=src, group=self._group)

    def _sync_buffers(self) -> None:
        """Give every rank the first rank's model buffers (``buffers=``), as DDP does. Collective on the user's group."""
        if not self._model_buffers or self._group is None:
            return
        src = dist.get_global_rank(self._group, 0)
        by_dtype: Dict[torch.dtype, List[torch.Tensor]] = {}
        for b in self._model_buffers:
            by_dtype.setdefault(b.dtype, []).append(b)
        with torch.no_grad():
            for tensors in by_dtype.values():
                flat = torch.cat([t.reshape(-1) for t in tensors])
                dist.broadcast(flat, src=src, group=self._group)  # one message per dtype
                torch._foreach_copy_(tensors, [f.view_as(t) for f, t in zip(flat.split([t.numel() for t in tensors]), tensors)])

    def _check_same_round_count(self) -> None:
        """Raise on every rank if the ranks handed off different numbers of rounds. Collective."""
        if self._group is None:
            return
        counts = [row[0] for row in self._all_gather_row([self.num_rounds])]
        if len(set(counts)) > 1:
            self._failed = RuntimeError("round count mismatch")
            raise RuntimeError(
                f"AccoOptimizer.finish(): the ranks handed off different numbers of rounds {counts} "
                "(rank i at index i), so their last rounds can never complete. Make every rank run the "
                "same number of updates, e.g. loop while opt.next_update_index < total_updates."
            )

    def _read_reports(self, block: bool) -> None:
        """CUDA path: read the reports of rounds the device has finished (``block``: of all of them, waiting
        for the device) and raise what the CPU path raises inside the round. Without ``block`` this never
        waits: an error surfaces at the first ``step()`` after the device has run the round."""
        if block and self._unread:
            self.scheduler.synchronize()  # host waits for the last round, hence for all before it (one stream)
        while self._unread:
            end, result = self._unread[0]
            if not block and not end.query():
                return
            self._unread.popleft()
            values = result.report.tolist()
            kind = result.kind.value
            exc: Optional[BaseException] = None
            if values[RoundReport.ROUND_MISMATCH]:
                exc = RoundMismatchError(round_mismatch_message(values[RoundReport.IDS :]))
            elif values[RoundReport.HYPER_MISMATCH]:
                exc = HyperParameterMismatchError(hyper_mismatch_message(kind))
            elif values[RoundReport.NONFINITE]:
                if self.nonfinite == "raise":
                    exc = NonFiniteGradientError(nonfinite_message(kind, values[RoundReport.NORM]))
                elif result.kind is RoundKind.COMMIT and result.skipped is None:
                    self.num_skipped_updates += 1  # undone on the device
            if exc is not None:
                self._failed = exc
                self._unread.clear()
                raise exc

    def _check_not_failed(self) -> None:
        if self._failed is not None:
            raise RuntimeError("AccoOptimizer: a previous round failed; this optimizer cannot continue") from self._failed

    def _check_open(self) -> None:
        self._check_not_failed()
        self._read_reports(block=False)
        if self._finished:
            raise RuntimeError(
                "AccoOptimizer.step() after finish(): finish() ends training with this optimizer; "
                "build a new AccoOptimizer to train further"
            )
        if self._in_committed_view:
            raise RuntimeError(
                "AccoOptimizer: training inside opt.committed_weights(): the block is for evaluating or saving "
                "the committed weights; call backward()/step() after it"
            )

    def _check_ddp_once(self) -> None:
        if not self._ddp_checked:
            self._ddp_checked = True
            _ddp.check_not_reducing_twice(self._params)

    def _clip_hint(self) -> str:
        if self.max_grad_norm is None:
            return ("To clip the global gradient norm as clip_grad_norm_ does under DDP, pass max_grad_norm=... to "
                    "AccoOptimizer and do not clip .grad yourself (HF Trainer: acco.integrations.hf.AccoTrainer "
                    "maps max_grad_norm for you).")
        return f"This optimizer already clips with max_grad_norm={self.max_grad_norm}: do not clip .grad yourself."

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """Used by the constructor; afterwards refused: the flat layout and the shards are fixed at construction."""
        if getattr(self, "_constructed", False):
            raise RuntimeError(
                "AccoOptimizer.add_param_group(): the flat buffers and the shards of every rank are laid out at "
                "construction, so parameters added later would never be communicated or trained. Build the "
                "AccoOptimizer with all param groups (e.g. unfreeze layers before building it, or build a new one)"
            )
        super().add_param_group(param_group)

    # ------------------------------------------------------------------ gradients

    def _on_grad_accumulated(self, index: int) -> None:
        """Post-accumulate-grad hook of parameter ``index`` (inside backward)."""
        if self._in_committed_view:
            raise RuntimeError("AccoOptimizer: backward() inside opt.committed_weights(); call it after the block")
        self._binding.after_accumulate(index)
        self._at_boundary = False
        if self.accumulate_while_communicating:
            return
        task = torch._C._current_graph_task_id()
        if task != self._backward_queued:
            _refuse_reentrant_backward()
            self._backward_queued = task
            # Once per backward pass, as DDP and FSDP do: runs when the whole backward has finished.
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        """End of a backward pass: once more at the back of the queue, so that the end-of-backward work of
        others queued during this backward (DDP's copy of its buckets into .grad) is done first."""
        torch.autograd.Variable._execution_engine.queue_callback(self._after_backward)

    def _after_backward(self) -> None:
        """A micro-batch's backward has finished (one step() per update). In mode acco, the backward that
        completes the first half of the update hands off the estimate round and puts theta_t in the model."""
        self._check_ddp_once()  # before any round (an estimate may go next); DDP's own end-of-backward is done
        self._binding.mark_backward_end()
        self._mb_in_update += 1
        self._at_boundary = False
        m = self.microbatches_per_update
        if self.mode == "acco" and m is not None and not self._estimate_in_update and self._mb_in_update == m // 2:
            self._check_open()
            self._update_hyper = self._hyperparams()  # both rounds of one update use the same
            self._handoff(RoundKind.ESTIMATE, self._mb_in_update, m / (self._mb_in_update * self.world_size))
            self._estimate_in_update = True

    @torch.no_grad()
    def _fold_grads(self) -> None:
        """Accumulating while communicating: accum += this micro-batch's gradients."""
        self._binding.check_untouched(self._clip_hint, strict=False)
        self._accum.add_(self._grads)
        self._binding.zero_()
        self._at_boundary = False
        self._since_handoff += 1
        self._in_accum += 1

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Discard the gradients of the micro-batches since the last ``step()``, as torch's optimizers do.

        ``.grad`` stays bound to the library's flat buffer (zeroed in place)
        whatever ``set_to_none`` says, so no memory is reallocated. The update
        then counts its micro-batches from zero again; in mode acco, once the
        update's estimate is handed off its first half cannot be taken back:
        that raises. With ``accumulate_while_communicating`` the gradients
        already given to ``step()`` belong to the library and are kept.
        """
        if self._estimate_in_update:
            raise RuntimeError(
                "AccoOptimizer.zero_grad() in the middle of an update whose estimate round (its first "
                f"{self.microbatches_per_update // 2} micro-batches) is already handed off: those gradients cannot "
                "be discarded. Call zero_grad() after step() (or before the update's first backward())"
            )
        self._binding.zero_()
        if not self.accumulate_while_communicating:
            if self._fold_on_arrival:
                with torch.no_grad():
                    self._accum.zero_()  # the update's sum lives there
            self._mb_in_update = 0
            self._at_boundary = True

    # ------------------------------------------------------------------ rounds

    def _hyperparams(self) -> List[Dict[str, Any]]:
        return [
            {k: (v.clone() if torch.is_tensor(v) else v) for k, v in g.items() if k != "params"} for g in self.param_groups
        ]

    def _collect(self) -> Optional[RoundResult]:
        """Wait for the in-flight round; its weights stay pending in the comm buffer."""
        if not self.scheduler.in_flight:
            return None
        try:
            result = self.scheduler.wait()
        except (NonFiniteGradientError, HyperParameterMismatchError, RoundMismatchError) as exc:  # all ranks alike
            self._failed = exc
            raise
        except BaseException as exc:
            self._failed = exc
            raise RoundFailedError(
                f"AccoOptimizer (rank {self.rank} of {self.world_size}): round {self.num_rounds - 1} failed: "
                f"{type(exc).__name__}: {exc}. The usual cause is a peer that died or stopped calling step() "
                "(killed, out of memory, an exception in its own code, or it left its loop early): its own log "
                "says which. This optimizer cannot continue; restart from the last checkpoint."
            ) from exc
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
        if result.kind is RoundKind.COMMIT:
            self.num_updates += 1
            self._committed_mb += result.total_microbatches[0]  # compute side, ordered after the round
            self.num_skipped_updates += int(bool(result.skipped))
        if result.report is not None:
            self._unread.append((self.scheduler.last_timing.end, result))
        self._last_grad_norm = result.grad_norm
        index = self._history[-1].index + 1 if self._history else 0
        if len(self._history) == self._history.maxlen:
            self._settled = max(0, self._settled - 1)  # the oldest record is about to go
        self._history.append(
            RoundRecord(index, result.kind.value, result.local_microbatches, total, per_rank, self.scheduler.last_timing,
                        ready)
        )
        # CUDA: older rounds give their events back once complete, so the history holds plain numbers.
        while self._settled < len(self._history) - self.EVENTS_KEPT and self._history[self._settled].settle():
            self._settled += 1
        self._pending = result.kind
        return result

    def _install_pending(self, commits_only: bool = False) -> None:
        """theta/theta~ swap: put the collected round's weights into the model."""
        if self._pending is not None and (not commits_only or self._pending is RoundKind.COMMIT):
            self.scheduler.install(self._params, self._comm_views)
            self._holds_estimate = self._pending is RoundKind.ESTIMATE
        self._pending = None

    def _handoff(self, kind: RoundKind, local_microbatches: int, grad_scale: Optional[float]) -> None:
        """Start round ``kind`` on the gradients accumulated so far (compute side ordered first)."""
        self._collect()
        self._install_pending()  # the previous round's weights are the model's for the micro-batches after this hand-off
        with torch.no_grad():
            self._comm.copy_(self._accum)
            if kind is RoundKind.COMMIT:
                self._accum.zero_()  # an estimate's gradients count again in the commit, then go
        fn = partial(
            run_round,
            kind,
            self._buffers,
            self.local_optimizer,
            self._pieces,
            self._update_hyper,
            local_microbatches,
            self._round_group,
            self._snapshot,
            self.max_grad_norm,
            self.nonfinite,
            grad_scale,
            hyper_fingerprint(self._update_hyper),
            2 * self.num_rounds + int(kind is RoundKind.ESTIMATE),  # the same on every rank, or all raise
            self.scheduler.uses_streams,  # CUDA path: checks become device flags, no host sync
        )
        self.num_rounds += 1
        if kind is RoundKind.COMMIT:
            self._commits_handed_off += 1
        uses: List[torch.Tensor] = []
        if self.scheduler.uses_streams:  # what the side stream will touch that other streams may have allocated
            uses = self._round_tensors + [v for g in self._update_hyper for v in g.values() if torch.is_tensor(v)]
            uses += [v for st in self.local_optimizer.state.values() for v in st.values() if torch.is_tensor(v)]
        self.scheduler.submit(fn, uses=uses)

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """One optimizer update from the micro-batches' gradients since the last ``step()``.

        Hands the update's commit round off and returns; the round runs while
        the next micro-batches compute (mode sync: waits for it). After
        ``step()`` the model holds the weights for the next micro-batch (mode
        acco: the estimate ``theta~``; see :meth:`committed_weights`).
        With ``accumulate_while_communicating``: call it after every
        micro-batch; it hands off a round only when one can start.
        Collective: call on all ranks.
        """
        self._check_open()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_ddp_once()
        if self.accumulate_while_communicating:
            self._elastic_step()
        else:
            self._update_step()
        return loss

    def _update_step(self) -> None:
        m = self._mb_in_update
        if m == 0:
            raise RuntimeError(
                "AccoOptimizer.step(): no gradient reached this optimizer's parameters since the last step(). "
                "Either no backward() ran (one step() is one update of the backward() calls before it), or the "
                "model's parameters were replaced after AccoOptimizer was built (model.to() to another device "
                "type, load_state_dict(assign=True), ...): build the optimizer after moving the model"
            )
        self._binding.check_untouched(self._clip_hint)
        synchronous = self.mode == "sync"
        if self.mode == "acco" and self.microbatches_per_update is None:
            self._learn_microbatches(m)
            synchronous = True
        elif self.microbatches_per_update is not None and m > self.microbatches_per_update:
            raise RuntimeError(
                f"AccoOptimizer.step() after {m} backward() calls, but this optimizer takes "
                f"microbatches_per_update={self.microbatches_per_update} (fewer are fine, e.g. at the end of an "
                "epoch): call step() after that many, or build the optimizer with the number you run"
            )
        elif self.mode == "acco" and not self._estimate_in_update:
            synchronous = True  # a short update (fewer than half the micro-batches): no estimate, no overlap
        if not self._estimate_in_update:
            self._update_hyper = self._hyperparams()
        self._handoff(RoundKind.COMMIT, m, 1.0 / self.world_size)
        self._mb_in_update = 0
        self._estimate_in_update = False
        self._after_handoff(RoundKind.COMMIT, synchronous)

    def _learn_microbatches(self, m: int) -> None:
        """Mode acco without microbatches_per_update: the first update's count, the same on every rank."""
        counts = [row[0] for row in self._all_gather_row([m])] if self._group is not None else [m]
        if len(set(counts)) > 1:
            raise RuntimeError(
                f"AccoOptimizer.step(): the ranks ran different numbers of micro-batches in the first update "
                f"{counts} (rank i at index i); run the same number on every rank, or pass "
                "accumulate_while_communicating=True for ranks of unequal speed"
            )
        if m < 2:
            raise ValueError(V.ACCO_NEEDS_TWO.format(m=m))
        self.microbatches_per_update = m
        log.info("acco: %d micro-batches per update (learned from the first update, which ran synchronously)", m)

    def _ready_for_handoff(self) -> bool:
        if self._since_handoff < self.min_microbatches:
            return False
        if self.scheduler.done():
            return True
        # Accumulate while you communicate: keep computing unless the bound is reached.
        return self.max_microbatches is not None and self._since_handoff >= self.max_microbatches

    def _elastic_step(self) -> None:
        self._fold_grads()
        if not self._ready_for_handoff():
            return
        kind = round_kind(self.mode, self.num_rounds)
        count = self._in_accum
        if kind is RoundKind.COMMIT:
            self._in_accum = 0
        self._since_handoff = 0
        if self.mode != "acco" or kind is RoundKind.ESTIMATE:
            self._update_hyper = self._hyperparams()  # both rounds of one acco update use the same
        self._handoff(kind, count, None)
        self._after_handoff(kind, self.mode == "sync")

    def _after_handoff(self, kind: RoundKind, synchronous: bool) -> None:
        """After a hand-off, in both loops: a synchronous round completes and its weights go into the model;
        a commit ends the update (a checkpoint boundary; attached schedulers and model buffers move)."""
        if synchronous:
            self._collect()
            self._install_pending()
        if kind is RoundKind.COMMIT:
            self._at_boundary = True
            for scheduler in self._lr_schedulers:
                scheduler.step()  # schedules count committed updates
            self._sync_buffers()

    @contextlib.contextmanager
    def committed_weights(self) -> Iterator[None]:
        """Hold the last committed weights ``theta`` in the model for the block, then put back what it held.

        Evaluate or save inside it: between updates the model may hold the
        estimate ``theta~`` (mode acco) or weights one update old (mode dpu).
        Waits for the in-flight round. Local (no collective); re-entrant.
        No ``backward()``/``step()`` inside the block.
        """
        if self._in_committed_view:
            yield
            return
        self._check_not_failed()
        self._collect()
        swap = self._pending is RoundKind.COMMIT
        if swap:
            self._swap_pending()
        self._in_committed_view = True
        self._view_swapped = swap  # the comm buffer holds the model's own weights meanwhile (checkpoints read them)
        try:
            yield
        finally:
            self._in_committed_view = self._view_swapped = False
            if swap:
                self._swap_pending()

    @torch.no_grad()
    def _swap_pending(self) -> None:
        """Exchange the model's weights and the collected round's (one parameter-sized temporary at a time)."""
        for p, v in zip(self._params, self._comm_views):
            tmp = p.detach().clone()
            p.copy_(v)
            v.copy_(tmp)

    def finish(self) -> None:
        """Wait for the in-flight round; leave the last committed weights in the model.

        An in-flight estimate is dropped (the model already holds ``theta_t``),
        and so are micro-batches whose ``step()`` has not come. Idempotent.
        Optional: without it, the process still exits cleanly (the round is
        waited for at exit), but the model may hold an estimate.
        Collective: call on all ranks.
        """
        if self._failed is not None:  # no collective, no wait: a peer may be gone
            if not self._finished:
                self._finished = True
                self.scheduler.close(wait=False, join_timeout=0.0)
                self._remove_hooks()
            raise RuntimeError("AccoOptimizer.finish(): a previous round failed; nothing to finish") from self._failed
        if self._finished:
            return
        if self._in_committed_view:
            raise RuntimeError("AccoOptimizer.finish() inside opt.committed_weights(): call it after the block")
        try:
            self._check_same_round_count()
            self._collect()
            self._install_pending(commits_only=True)
            self._read_reports(block=True)  # CUDA path: errors the device found in the last rounds
        finally:
            self._finished = True
            ok = self._failed is None
            # After a failure the worker may be stuck in a collective with a dead peer: do not wait for it.
            # Otherwise (CUDA) the host waits for the last round's end before its communicator goes.
            self.scheduler.close(wait=ok, join_timeout=10.0 if ok else 0.0)
            self._release_round_group()
        with torch.no_grad():
            self._accum.zero_()
        self._in_accum = self._since_handoff = self._mb_in_update = 0
        self._holds_estimate = self._estimate_in_update = False
        self._at_boundary = True
        self._remove_hooks()

    def _remove_hooks(self) -> None:
        """A finished optimizer no longer reacts to backward (a new one may own the parameters)."""
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles = []
        _LIVE.discard(self)

    def _close_at_exit(self) -> None:
        """At interpreter exit without finish(): let the in-flight round end, then release the round group
        (gloo work freed during interpreter finalisation aborts the process). No collective."""
        if self._finished:
            return
        self._finished = True
        stuck = self._failed is not None
        if not stuck:
            self.scheduler.synchronize()  # CUDA: the last round has finished on the device before its group goes
        self.scheduler.close(wait=False, join_timeout=0.0 if stuck else 60.0)
        if not stuck and not self.scheduler.worker_alive():
            self._release_round_group()
            log.info("acco: closed at exit without finish(): the in-flight round ended, the round group released")

    def _release_round_group(self) -> None:
        """Destroy the process group the rounds used, now rather than at interpreter exit.

        gloo's worker threads release finished work (and its Python tensors)
        when the group is destroyed; if that happens during interpreter
        finalisation the process aborts ("terminate called without an active
        exception", pytorch/pytorch#190489).
        """
        group, self._round_group = self._round_group, None
        if group is not None and dist.is_initialized():
            dist.destroy_process_group(group)

    # ------------------------------------------------------------------ introspection

    @property
    def next_update_index(self) -> int:
        """0-based index of the committed update that the next hand-off contributes to.

        Set a learning-rate schedule from it (``g["lr"] = f(opt.next_update_index)``
        before ``step()``): in mode acco both halves of a mini-batch then use the
        same rate, and ranks that accumulate at different speeds agree.
        """
        return self._commits_handed_off

    @property
    def holds_committed_weights(self) -> bool:
        """Whether the model's parameters are committed weights (not an estimate theta~)."""
        return not self._holds_estimate

    @property
    def at_update_boundary(self) -> bool:
        """True right after a step() (with accumulate_while_communicating: the one that handed off a
        committed update) and before any further backward(), or before the first: where a checkpoint
        may be taken."""
        return self._at_boundary

    @property
    def last_grad_norm(self) -> Optional[float]:
        """Global L2 norm (before clipping) of the averaged gradient of the last collected round."""
        return None if self._last_grad_norm is None else float(self._last_grad_norm.item())

    def attach_lr_scheduler(self, scheduler: Any) -> Any:
        """Step ``scheduler`` once per committed update handed off (every rank alike).

        Only needed with ``accumulate_while_communicating``, where ``step()`` calls
        differ across ranks; otherwise step the scheduler after ``step()`` as usual.
        Do not also call ``scheduler.step()`` yourself. Returns ``scheduler``.
        """
        self._lr_schedulers.append(scheduler)
        return scheduler

    @property
    def committed_microbatches(self) -> int:
        """Micro-batches of all ranks in the committed updates so far (reads the device)."""
        return int(self._committed_mb.item())

    def microbatch_history(self) -> List[Dict[str, Any]]:
        """Per collected round: kind, this rank's and all ranks' micro-batch counts (reads the device)."""
        keys = ("kind", "local_microbatches", "total_microbatches", "rank_microbatches")
        return [{k: r[k] for k in keys} for r in self.round_stats()]

    def round_stats(self, last: Optional[int] = None) -> List[Dict[str, Any]]:
        """Per collected round (the last ``last``, at most ``HISTORY_LIMIT``): whether communication was hidden.

        Each entry: ``round`` (index), ``kind``, ``local_microbatches``,
        ``total_microbatches``, ``rank_microbatches`` (every rank's count),
        ``compute_s`` (compute-side time while the round was in flight),
        ``round_s`` (the round itself) and ``wait_s`` (how long the compute side
        then waited for it). See :mod:`acco.stats`. Recording costs no device
        synchronisation; this call reads the device (CUDA: timings of rounds
        whose events are still pending are ``None``). Local: no collective.
        """
        records = list(self._history)
        if last is not None:
            records = records[-last:] if last > 0 else []
        return [r.as_dict() for r in records]

    def overlap_summary(self, last: Optional[int] = None) -> Dict[str, Any]:
        """Means of :meth:`round_stats` and ``hidden``, the share of round time the compute side
        did not wait for (1.0: fully hidden; sync: 0.0). Local: no collective."""
        return summarize(self.round_stats(last))

    def memory_report(self) -> Dict[str, int]:
        """Bytes this rank holds, by buffer: the model's parameters and the library's own buffers.

        Compare with the table in ``docs/algorithm.md``: ``params``, ``grads`` (what
        backward writes: the accumulation buffer itself, so 0 extra, unless
        accumulating while communicating), ``accum`` and ``comm`` are full-size
        in the compute dtype; ``master``, ``master_grad``, ``staging``, ``optimizer_state``
        and ``estimate_scratch`` are this rank's 1/N slice. Local: no collective.
        """
        self._collect()  # the round's worker fills the state and the scratch: read them after it
        b = self._buffers
        state = [v for st in self.local_optimizer.state.values() for v in st.values()]
        scratch = [] if self._snapshot is None else self._snapshot.tensors()
        report = {
            "params": nbytes(self._params),
            "grads": 0 if self._grads is self._accum else nbytes([self._grads]),
            "accum": nbytes([self._accum]),
            "comm": nbytes([self._comm]),
            "master": nbytes([b.master]),
            "master_grad": nbytes([b.grad]),
            "staging": nbytes([b.staging]),
            "optimizer_state": nbytes(state),
            "estimate_scratch": nbytes(scratch),
        }
        report["library_total"] = sum(v for k, v in report.items() if k != "params")
        return report

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> Dict[str, Any]:
        """This rank's shard of the state, with what it is (rank, world size, mode, optimizer, layout).

        For ``torch.save`` on every rank, each its own file; for any world size
        use :mod:`acco.checkpoint` (DCP). Take it between a ``step()`` and the
        next ``backward()`` (``at_update_boundary``); it waits for the in-flight
        round. Local: no collective.
        """
        return _checkpoint.state_dict(self)

    def sharded_state_dict(self) -> Dict[str, Any]:
        """The state as 1-D DTensors for ``torch.distributed.checkpoint`` (any world size at load). Local."""
        return _checkpoint.state_dict(self, sharded=True)

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (this rank's, same world size) or :meth:`sharded_state_dict`
        (through DCP, any world size); also restores the model's parameters. Refuses anything else
        before changing any state. Collective: call on all ranks."""
        _checkpoint.load_state_dict(self, state_dict)

    def consolidated_state_dict(self) -> Dict[str, Any]:
        """Full per-parameter state in the wrapped optimizer's own format. Collective."""
        return _checkpoint.consolidated_state_dict(self)

    def load_consolidated_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Take a plain optimizer's ``state_dict()``; the master comes from the model's
        current weights. Collective: call on all ranks."""
        _checkpoint.load_consolidated_state_dict(self, state_dict)


def _after_accumulate(opt_ref: "weakref.ref[AccoOptimizer]", index: int, _param: torch.Tensor) -> None:
    opt = opt_ref()
    if opt is not None:
        opt._on_grad_accumulated(index)


_LIVE: "weakref.WeakSet[AccoOptimizer]" = weakref.WeakSet()


def _before_accumulate(opt_ref: "weakref.ref[AccoOptimizer]", index: int, grad: torch.Tensor) -> None:
    """Tensor hook on parameter ``index`` with ``accumulation_dtype`` != compute dtype: this backward's gradient
    (all its uses summed), before autograd adds it into ``p.grad``, is added into the accumulation buffer.
    ``p.grad`` itself stays what torch makes it: the compute-dtype sum (the update does not read it)."""
    opt = opt_ref()
    if opt is None or opt._finished:
        return None
    with torch.no_grad():
        view = opt._accum_views[index]
        if not opt._binding.holds(index):  # the user set p.grad to None (or another tensor): discarded, as torch does
            view.zero_()
        view.add_(grad.to_dense() if grad.is_sparse else grad)
    return None


@atexit.register
def _close_all_at_exit() -> None:
    for opt in list(_LIVE):
        opt._close_at_exit()


def _refuse_reentrant_backward() -> None:
    """Raise if this backward runs inside another one (reentrant activation checkpointing): its end would be
    taken for the end of a micro-batch. Called once per backward pass, so the stack walk costs little."""
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "backward" and code.co_filename.replace("\\", "/").endswith("torch/utils/checkpoint.py"):
            raise RuntimeError(
                "AccoOptimizer: a backward() inside another (activation checkpointing with use_reentrant=True): "
                "one step() per update counts backward passes as micro-batches. Use "
                "torch.utils.checkpoint.checkpoint(..., use_reentrant=False) (HF: "
                "gradient_checkpointing_kwargs={'use_reentrant': False})"
            )
        frame = frame.f_back
