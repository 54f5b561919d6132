"""AccoOptimizer: the ``torch.optim.Optimizer`` front of the library.

This file only orchestrates: when to hand gradients to a round, which kind of
round, when a finished round's weights go into the model. The layout lives in
``layout.py``, the round's math in ``rounds.py``, where it runs in
``scheduler.py``. The equations are those of ``algorithm.md`` (see the README).
"""

from __future__ import annotations

import datetime
import hashlib
import logging
import weakref
from collections import deque
from functools import partial
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from . import _validation as V
from . import checkpoint as _checkpoint
from .collectives import group_rank, group_size, ring_algorithm
from .layout import FlatLayout
from .rounds import OptimizerSnapshot, RoundKind, RoundResult, ShardBuffers, round_kind, run_round
from .scheduler import StreamScheduler
from .stats import RoundRecord, nbytes, summarize

__all__ = ["AccoOptimizer"]

log = logging.getLogger("acco")


class AccoOptimizer(torch.optim.Optimizer):
    """ZeRO-1 sharded optimizer whose communication overlaps computation (ACCO).

    Drop-in for ``torch.optim.AdamW`` in a loop of ``backward(); step();
    zero_grad()``: each ``step()`` hands the gradients accumulated so far to a
    communication round (reduce-scatter -> sharded step of ``optimizer_class``
    -> all-gather) that runs in the background while the next micro-batch is
    computed. In mode ``"acco"`` one mini-batch is two ``step()`` calls (two
    halves): the first gives an estimate ``theta~``, the second the committed
    update; ``"dpu"`` (delayed, uncompensated) and ``"sync"`` (plain ZeRO-1)
    are the baselines.

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
        min_microbatches: micro-batches to accumulate before a hand-off.
        max_microbatches: accumulate at most this many while a round is in
            flight, then ``step()`` waits for it; ``None``: no bound.
        compute_dtype: dtype of the model's parameters (the compute copy), e.g.
            ``torch.bfloat16``; the sharded master stays fp32. ``None``: keep.
        max_grad_norm: clip the global L2 norm of the averaged gradient to
            this, as ``clip_grad_norm_`` on the full gradient would.
        nonfinite: ``"skip"`` (default) an update whose averaged gradient holds
            inf/NaN, counting it in ``num_skipped_updates``, or ``"raise"``
            :class:`~acco.NonFiniteGradientError`; all ranks act alike.
        timeout: how long a round's collectives wait for a peer before
            raising (default: the process group default).
        **optimizer_kwargs: passed to ``optimizer_class`` (``lr=...``).

    Whether communication is hidden: :meth:`round_stats`, :meth:`overlap_summary`;
    memory: :meth:`memory_report`.
    """

    HISTORY_LIMIT = 100_000  # rounds kept for round_stats()

    def __init__(
        self,
        params: Any,
        optimizer_class: type = torch.optim.AdamW,
        *,
        mode: str = "acco",
        process_group: Optional[dist.ProcessGroup] = None,
        min_microbatches: int = 1,
        max_microbatches: Optional[int] = None,
        compute_dtype: Optional[torch.dtype] = None,
        max_grad_norm: Optional[float] = None,
        nonfinite: str = "skip",
        timeout: Optional[datetime.timedelta] = None,
        **optimizer_kwargs: Any,
    ) -> None:
        V.check_optimizer_class(optimizer_class)
        V.check_mode(mode)
        V.check_microbatches(min_microbatches, max_microbatches)
        V.check_clipping(max_grad_norm, nonfinite)
        groups = V.normalize_param_groups(params)
        super().__init__(groups, dict(optimizer_kwargs))
        self._params: List[torch.Tensor] = [p for g in self.param_groups for p in g["params"]]
        V.check_params(self._params)
        if compute_dtype is not None and not compute_dtype.is_floating_point:
            raise TypeError(f"compute_dtype must be a floating dtype such as torch.bfloat16, got {compute_dtype}")

        self.mode = mode
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
        master_dtype = torch.float64 if param_dtype == torch.float64 else torch.float32

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

        # fp32 master slice, from the parameters before any cast to compute_dtype.
        lo, hi = self.layout.shard_range(self.rank)
        master = torch.zeros(self.layout.shard_size, dtype=master_dtype, device=device)
        flat_params = torch.zeros(self.layout.padded_numel, dtype=master_dtype, device=device)
        with torch.no_grad():
            for v, p in zip(self.layout.views(flat_params), self._params):
                v.copy_(p)
            master.copy_(flat_params[lo:hi])
            del flat_params
            if self.compute_dtype != param_dtype:
                for p in self._params:
                    p.data = p.data.to(self.compute_dtype)  # once, at construction: addresses fixed from here on

        cd = self.compute_dtype
        n = self.layout.padded_numel
        self._grads = torch.zeros(n, dtype=cd, device=device)  # where backward writes (.grad views)
        self._accum = torch.zeros(n, dtype=cd, device=device)  # gradient sum since the last commit
        self._comm = torch.zeros(n, dtype=cd, device=device)  # round in/out: gradients out, weights in
        self._grad_views = self.layout.views(self._grads)
        self._comm_views = self.layout.views(self._comm)
        for p, v in zip(self._params, self._grad_views):
            if p.grad is not None:
                v.copy_(p.grad)
            p.grad = v
        self._buffers = ShardBuffers(
            comm=self._comm,
            master=master,
            grad=torch.zeros_like(master),
            count=torch.zeros(1, dtype=master_dtype, device=device),
            rank_counts=torch.zeros(self.world_size, dtype=master_dtype, device=device),
            staging=None if cd == master_dtype else torch.zeros(self.layout.shard_size, dtype=cd, device=device),
            collectives=ring_algorithm(self._round_group),
        )

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

        self._snapshot = OptimizerSnapshot() if mode == "acco" else None
        self.scheduler = StreamScheduler(device)
        self._since_handoff = 0  # micro-batches folded since the last hand-off
        self._in_accum = 0  # micro-batches in the accumulation buffer
        self._grads_dirty = False
        self._finished = False
        self._failed: Optional[BaseException] = None
        self.num_rounds = 0  # rounds handed off
        self.num_updates = 0  # committed updates now in the model
        self._pending: Optional[RoundKind] = None  # a collected round whose weights are not yet in the model
        self._update_hyper: List[Dict[str, Any]] = []  # hyper-parameters of the update being handed off
        self._lr_schedulers: List[Any] = []
        self._at_boundary = True  # no micro-batch since the last committed hand-off
        self.num_skipped_updates = 0
        self._last_grad_norm: Optional[torch.Tensor] = None
        self._history: "deque[RoundRecord]" = deque(maxlen=self.HISTORY_LIMIT)
        self._committed_mb = torch.zeros((), dtype=torch.float64, device=device)
        # A weak reference: parameters must not keep the optimizer (and its process
        # group) alive in a cycle that only the garbage collector, maybe at exit, breaks.
        self_ref = weakref.ref(self)

        def mark_grads_dirty(_param: torch.Tensor) -> None:
            opt = self_ref()
            if opt is not None:
                opt._grads_dirty = True

        self._hook_handles = [p.register_post_accumulate_grad_hook(mark_grads_dirty) for p in self._params]

    # ------------------------------------------------------------------ checks

    def _signature(self) -> str:
        parts = [self.mode, self.optimizer_class.__name__, str(self.min_microbatches), str(self.max_microbatches)]
        parts += [str(len(g["params"])) for g in self.param_groups]
        parts += [f"{tuple(p.shape)}:{p.dtype}" for p in self._params]
        return "|".join(parts)

    def _all_gather_row(self, row: List[int]) -> List[List[int]]:
        """Every rank's ``row`` of ints, in rank order. Collective on the user's group."""
        mine = torch.tensor(row, dtype=torch.int64, device=self._params[0].device)
        everyone = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(everyone, mine, group=self._group)
        return [t.tolist() for t in everyone]

    def _check_same_model_across_ranks(self) -> None:
        """All-gather a fingerprint of the model and options; raise on every rank if any differ. Collective."""
        digest = hashlib.sha256(self._signature().encode()).digest()
        rows = self._all_gather_row([len(self._params), self.layout.numel, int.from_bytes(digest[:7], "little")])
        if any(r != rows[0] for r in rows):
            detail = "; ".join(f"rank {i}: {r[0]} tensors, {r[1]} elements" for i, r in enumerate(rows))
            raise RuntimeError(
                "AccoOptimizer: the ranks disagree on the model or the options (parameter shapes/dtypes, "
                f"param groups, mode, optimizer class, min/max_microbatches): {detail}. Build the same model "
                "and AccoOptimizer arguments on every rank."
            )

    def _broadcast_parameters(self) -> None:
        """Give every rank the first rank's parameters, as DDP does. Collective."""
        src = dist.get_global_rank(self._group, 0)
        with torch.no_grad():
            for p in self._params:
                dist.broadcast(p.data, src=src, group=self._group)

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

    def _check_open(self) -> None:
        if self._failed is not None:
            raise RuntimeError("AccoOptimizer: a previous round failed; this optimizer cannot continue") from self._failed
        if self._finished:
            raise RuntimeError(
                "AccoOptimizer.step() after finish(): finish() ends training with this optimizer; "
                "build a new AccoOptimizer to train further"
            )

    # ------------------------------------------------------------------ gradients

    @torch.no_grad()
    def _fold_grads(self) -> None:
        """accum += this micro-batch's gradients, whatever became of ``.grad``."""
        for p, v in zip(self._params, self._grad_views):
            g = p.grad
            if g is None:  # set_to_none by the user: no gradient for p this micro-batch
                v.zero_()
                p.grad = v
            elif g.is_sparse:  # e.g. nn.Embedding(sparse=True) after set_to_none: densified
                v.copy_(g.to_dense())
                p.grad = v
            elif g.data_ptr() != v.data_ptr() or g.shape != v.shape:  # replaced by the user/autograd
                v.copy_(g)
                p.grad = v
        self._accum.add_(self._grads)
        self._grads.zero_()
        self._grads_dirty = False
        self._at_boundary = False
        self._since_handoff += 1
        self._in_accum += 1

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Discard gradients computed since the last ``step()``.

        The accumulation the rounds use belongs to the library and is never
        cleared here. ``.grad`` stays bound to the library's flat buffer (zeroed
        in place) whatever ``set_to_none`` says, so no memory is reallocated.
        """
        if not self._grads_dirty and all(p.grad is v for p, v in zip(self._params, self._grad_views)):
            return
        with torch.no_grad():
            self._grads.zero_()
            for p, v in zip(self._params, self._grad_views):
                p.grad = v
        self._grads_dirty = False

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
        except BaseException as exc:
            self._failed = exc
            raise
        total = result.total_microbatches.clone()  # compute side, ordered after the round: no host sync
        per_rank = result.rank_microbatches.clone()
        if result.kind is RoundKind.COMMIT:
            self.num_updates += 1
            self._committed_mb += total[0]
            self.num_skipped_updates += int(result.skipped)
        self._last_grad_norm = result.grad_norm
        index = self._history[-1].index + 1 if self._history else 0
        self._history.append(
            RoundRecord(index, result.kind.value, result.local_microbatches, total, per_rank, self.scheduler.last_timing)
        )
        self._pending = result.kind
        return result

    def _install_pending(self, commits_only: bool = False) -> None:
        """theta/theta~ swap: put the collected round's weights into the model."""
        if self._pending is not None and (not commits_only or self._pending is RoundKind.COMMIT):
            self.scheduler.install(self._params, self._comm_views)
        self._pending = None

    def _handoff(self) -> None:
        """Start the next round on the gradients accumulated so far (compute side ordered first)."""
        self._collect()
        self._install_pending()  # round k-1's weights are the model's for the micro-batches after hand-off k
        kind = round_kind(self.mode, self.num_rounds)
        with torch.no_grad():
            self._comm.copy_(self._accum)
            if kind is RoundKind.COMMIT:
                self._accum.zero_()  # the estimate's gradients count again in the commit, then go
        count = self._in_accum
        if kind is RoundKind.COMMIT:
            self._in_accum = 0
        self._since_handoff = 0
        if self.mode != "acco" or kind is RoundKind.ESTIMATE:
            self._update_hyper = self._hyperparams()  # both rounds of one acco update use the same
        fn = partial(
            run_round,
            kind,
            self._buffers,
            self.local_optimizer,
            self._pieces,
            self._update_hyper,
            count,
            self._round_group,
            self._snapshot,
            self.max_grad_norm,
            self.nonfinite,
        )
        self.num_rounds += 1
        self.scheduler.submit(fn)
        if kind is RoundKind.COMMIT:
            self._at_boundary = True
            for scheduler in self._lr_schedulers:
                scheduler.step()  # schedules count committed updates

    def _ready_for_handoff(self) -> bool:
        if self._since_handoff < self.min_microbatches:
            return False
        if self.scheduler.done():
            return True
        # Accumulate while you communicate: keep computing unless the bound is reached.
        return self.max_microbatches is not None and self._since_handoff >= self.max_microbatches

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """Take this micro-batch's gradients; hand them to a round when one can start.

        Returns at once while a round is in flight (the gradients accumulate)
        unless ``max_microbatches`` is reached. After ``step()`` the model holds
        the weights for the next micro-batch. Collective: call on all ranks.
        """
        self._check_open()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._fold_grads()
        if not self._ready_for_handoff():
            return loss
        self._handoff()
        if self.mode == "sync":
            self._collect()
            self._install_pending()
        return loss

    def finish(self) -> None:
        """Wait for the in-flight round; leave the last committed weights in the model.

        An in-flight estimate is dropped (the model already holds ``theta_t``),
        and so are micro-batches accumulated but not yet handed off. Idempotent.
        Collective: call on all ranks.
        """
        if self._finished:
            return
        try:
            self._check_same_round_count()
            self._collect()
            self._install_pending(commits_only=True)
        finally:
            self._finished = True
            # After a failure the worker may be stuck in a collective with a dead peer: do not wait for it.
            self.scheduler.close(wait=False, join_timeout=0.0 if self._failed is not None else 10.0)
            self._release_round_group()
        with torch.no_grad():
            self._accum.zero_()
        self._in_accum = self._since_handoff = 0

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
        return self.num_rounds // 2 if self.mode == "acco" else self.num_rounds

    @property
    def holds_committed_weights(self) -> bool:
        """Whether the model's parameters are committed weights (not an estimate theta~)."""
        return self.mode != "acco" or self.num_rounds % 2 == 1 or self.num_rounds == 0 or self._finished

    @property
    def at_update_boundary(self) -> bool:
        """True right after the step() that handed off a committed update (and before any
        further micro-batch), or before the first step: where a checkpoint may be taken."""
        return self._at_boundary

    @property
    def last_grad_norm(self) -> Optional[float]:
        """Global L2 norm (before clipping) of the averaged gradient of the last collected round."""
        return None if self._last_grad_norm is None else float(self._last_grad_norm.item())

    def attach_lr_scheduler(self, scheduler: Any) -> Any:
        """Step ``scheduler`` once per committed update handed off (every rank alike).

        Then a schedule counts committed updates, not ``step()`` calls (which in
        mode acco are two per update, and differ across ranks that accumulate).
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

        Compare with the table in ``algorithm.md``: ``params``, ``grads`` (what
        backward writes), ``accum`` and ``comm`` are full-size in the compute
        dtype; ``master``, ``master_grad``, ``staging``, ``optimizer_state``
        and ``estimate_scratch`` are this rank's 1/N slice. Local: no collective.
        """
        b = self._buffers
        state = [v for st in self.local_optimizer.state.values() for v in st.values()]
        scratch = [] if self._snapshot is None else self._snapshot.tensors()
        report = {
            "params": nbytes(self._params),
            "grads": nbytes([self._grads]),
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
        """Sharded state for ``torch.distributed.checkpoint`` (see :mod:`acco.checkpoint`).

        Take it at an update boundary (``at_update_boundary``); it waits for the
        in-flight round. Collective: call on all ranks.
        """
        return _checkpoint.state_dict(self)

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`, saved on any number of ranks; also restores the
        model's parameters. Collective: call on all ranks."""
        _checkpoint.load_state_dict(self, state_dict)

    def consolidated_state_dict(self) -> Dict[str, Any]:
        """Full per-parameter state in the wrapped optimizer's own format. Collective."""
        return _checkpoint.consolidated_state_dict(self)

    def load_consolidated_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Take a plain optimizer's ``state_dict()``; the master comes from the model's
        current weights. Collective: call on all ranks."""
        _checkpoint.load_consolidated_state_dict(self, state_dict)
