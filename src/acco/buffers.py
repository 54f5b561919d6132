"""The library's memory: one owner for every flat buffer and its views, built once.

Per rank, with ``P`` the padded number of trainable elements and ``N`` ranks
(``docs/algorithm.md`` has the table in bytes):

* the model's parameters (the user's tensors, cast once to the compute dtype);
* ``accum``: the gradient sum since the last commit, in the accumulation dtype.
  In the default loop with equal dtypes, ``p.grad`` *is* a view of it
  (autograd sums micro-batches in place; no other gradient copy exists);
* ``grads``: where backward writes when it cannot be ``accum`` (a compute-dtype
  buffer of its own: accumulating while communicating, or an fp32
  accumulation of bf16 gradients, folded in as each gradient arrives);
* ``comm``: the round's buffer: gradients out (accumulation dtype), the
  all-gathered weights back in the same memory (``comm_weights``, compute
  dtype), installed into the parameters at the theta/theta~ swap; the round's transport
  (``transport.py``, chosen here once) sends it in its wire format and owns that format's own buffers;
* this rank's ``P/N`` slices (:class:`~acco.shard_buffers.ShardBuffers`): the master
  weights, the reduce-scatter's gradient slice, a compute-dtype staging slice
  when the dtypes differ, and the few scalars of a round.

No collective here; device work only (copies, zeroing).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Sequence

import torch

from . import arrivals as _arrivals
from .compressed import Quantized
from .grads import GradBinding
from .placement import Layout
from .shard_buffers import ShardBuffers
from .stats import nbytes
from .transport import FullWidth, NarrowEstimate, Transport

__all__ = ["FlatBuffers", "choose_transport"]


class FlatBuffers:
    """Built from the trainable parameters (before any cast); see the module docstring."""

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        layout: Layout,
        rank: int,
        precision: Any,
        separate_grads: bool,
        collectives: str,
    ) -> None:
        """``precision``: the resolved ``PrecisionPolicy`` (every dtype concrete; compression)."""
        self.params = list(params)
        self.layout = layout
        self.compute_dtype = compute_dtype = precision.compute_dtype
        self.rank = rank
        device = self.params[0].device
        param_dtype = self.params[0].dtype
        master_dtype = torch.float64 if param_dtype == torch.float64 else torch.float32
        cd, ad, rd = compute_dtype, precision.accumulation_dtype, precision.reduce_dtype
        n = layout.padded_numel

        master = _master_slice(self.params, layout, rank, master_dtype, cd)

        self.accum = torch.zeros(n, dtype=ad, device=device)
        # Round in/out: gradients out (cast to reduce_dtype at the hand-off, summed over ranks in it), weights in
        # (compute dtype, in the same memory: the reduce-scatter has read the gradients before the all-gather writes).
        self.comm = torch.zeros(n, dtype=rd, device=device)
        self.comm_weights = self.comm if rd == cd else self.comm.view(torch.uint8)[: n * cd.itemsize].view(cd)
        self.comm_views = layout.views(self.comm_weights)
        # Where backward writes: straight into accum, unless it is of another dtype (then a buffer of its own,
        # folded into accum as each gradient arrives) or the loop accumulates while communicating (folded at
        # each step(), so that zero_grad() after a step() cannot wipe micro-batches awaiting a hand-off).
        self.fold_on_arrival = not separate_grads and ad != cd
        separate = separate_grads or self.fold_on_arrival
        self.grads = torch.zeros(n, dtype=cd, device=device) if separate else self.accum
        self.accum_views = layout.views(self.accum)
        self._fold_task = -1  # the backward pass add_incoming last saw
        self.binding = GradBinding(self.params, layout.views(self.grads), self.grads)
        # Which parameters have a gradient in the sum (torch's ``.grad is None``): a sum that is .grad itself, or
        # is folded into as each gradient arrives, goes with .grad when the user discards or zeroes it.
        self.arrivals = _arrivals.Arrivals(len(self.params))
        self._grad_is_sum = self.grads is self.accum or self.fold_on_arrival
        self.shard = _shard_buffers(self.comm, self.comm_weights, master, layout, len(self.params), cd, rd,
                                    collectives)
        # the wire format, chosen once (compression="auto": replaced once more, auto.py): it owns its buffers,
        # packing, collectives and unpacking (transport.py)
        self.precision = precision
        self.transport = choose_transport(precision, layout, rank, self.params, self.comm, self.comm_views)

    def build_transport(self, kind: str) -> Transport:
        """The transport of ``compression="auto"``'s choice: ``"none"`` (the uncompressed rounds), or ``kind``
        quantized with this run's block and weights settings. Allocates its buffers (zero); no collective."""
        pr = self.precision
        if kind == "none":  # the rounds as compression=None sends them
            return choose_transport(dataclasses.replace(pr, compression=None), self.layout, self.rank, self.params,
                                    self.comm, self.comm_views)
        return Quantized(kind, pr.compression_block, pr.compression_weights, self.layout, self.rank,
                         pr.accumulation_dtype, self.params, self.comm_views)

    @property
    def master(self) -> torch.Tensor:
        return self.shard.master

    def round_tensors(self) -> List[torch.Tensor]:
        """Every tensor a round touches that is allocated here (the CUDA path records them on its stream), and
        the transport's own (``Transport.tensors``: with compression, the packed chunks, the residual, and the
        parameters the weights' change is taken against)."""
        return [t for t in vars(self.shard).values() if torch.is_tensor(t)] + self.transport.tensors()

    # ------------------------------------------------------------ gradients

    @torch.no_grad()
    def handoff(self, commit: bool) -> frozenset:
        """The gradient sum goes into the round buffer; a commit's leaves the accumulation (an estimate's
        gradients count again in the commit), and ``.grad`` is zero after it in every default loop. Returns the
        parameters without a gradient in that sum (``arrivals.Arrivals.take``)."""
        self.transport.gradients_in(self.comm, commit).copy_(self.accum)  # cast to the wire's dtype
        missing = self.arrivals.take(commit)
        if commit:
            self.accum.zero_()
            if self.fold_on_arrival:  # .grad is the compute-dtype sum of its own: it goes with the update too
                self.binding.zero_()
        return missing

    @torch.no_grad()
    def fold(self, clip_hint) -> None:
        """Accumulating while communicating: accum += this micro-batch's gradients, and ``.grad`` is zeroed."""
        self.binding.check_untouched(clip_hint, strict=False,
                                     on_discard=lambda i: self.arrivals.discard(i, whole_sum=False))
        self.accum.add_(self.grads)
        self.arrivals.fold()
        self.binding.zero_()

    @torch.no_grad()
    def add_incoming(self, index: int, grad: torch.Tensor) -> None:
        """``fold_on_arrival``: add parameter ``index``'s gradient from this backward into the accumulation,
        before autograd adds it into ``p.grad`` (which stays the compute-dtype sum torch makes). Called from a
        pre-hook of the parameter's gradient accumulator, so only what autograd puts into ``.grad`` counts
        (not ``torch.autograd.grad``'s results)."""
        task = torch._C._current_graph_task_id()
        if task != self._fold_task:  # the first gradient of a backward pass
            self._fold_task = task
            if self.grads._version != self.binding.version:
                # .grad was changed in place since the last backward (model.zero_grad(set_to_none=False), a
                # scaling): the sum follows it, as torch's update would read it.
                self.accum.copy_(self.grads)
        view = self.accum_views[index]
        if self.binding.discarded(index):  # the user set p.grad to None (or another tensor): discarded, as torch does
            view.zero_()
        view.add_(grad.to_dense() if grad.is_sparse else grad)

    @torch.no_grad()
    def zero_grads(self, update_loop: bool) -> None:
        """``zero_grad()``: ``.grad`` zeroed in place (still bound); in the default loop with a separate
        accumulation the update's sum lives there, so it goes too."""
        self.binding.zero_()
        if update_loop and self.fold_on_arrival:
            self.accum.zero_()
        self.arrivals.zero(whole_sum=update_loop and self._grad_is_sum)

    @torch.no_grad()
    def drop_accumulated(self) -> None:
        """The gradient sum goes (``finish()``: micro-batches whose ``step()`` never came); ``.grad`` stays."""
        self.accum.zero_()
        self.arrivals.drop_accumulated()

    @torch.no_grad()
    def reset(self) -> None:
        """Nothing accumulated, ``.grad`` zero and bound (after a load)."""
        self.accum.zero_()
        self.binding.zero_()
        self.arrivals.clear()

    def check_untouched(self, clip_hint) -> None:
        """Before a hand-off: raise if ``.grad`` was changed in place (see ``GradBinding``). With a separate
        fp32 sum, a ``.grad`` the user set to ``None`` since the last backward discards that parameter's sum too,
        as torch would see no gradient."""
        def discard(i: int) -> None:
            if self.fold_on_arrival:
                self.accum_views[i].zero_()
            self.arrivals.discard(i, whole_sum=self._grad_is_sum)

        self.binding.check_untouched(clip_hint, on_discard=discard)

    # ------------------------------------------------------------ weights

    def install(self, scheduler: Any, estimate: bool = False) -> None:
        """theta/theta~ swap: the round buffer's weights into the parameters (ordered after the round);
        ``estimate``: an estimate round's, which came back in estimate_dtype if it is set: narrower than the
        compute dtype, as the change against the weights the model holds (theta_t, installed at the estimate's
        own hand-off and not written since), added to them in the compute dtype, so the cast rounded the change,
        never the weights; as wide (a bf16 model), as the weights themselves."""
        views, change = self.transport.install_views(self.comm_views, estimate)
        if change:
            # The change added to the weights held, on the compute side after the round (the caller collected
            # it: scheduler.wait() ordered this stream after the round's end), as scheduler.install copies.
            with torch.no_grad():
                torch._foreach_add_(self.params, views)
        else:
            scheduler.install(self.params, views)

    @torch.no_grad()
    def swap_model_and_comm(self) -> None:
        """Exchange the model's weights and the round buffer's (one parameter-sized temporary at a time)."""
        for p, v in zip(self.params, self.comm_views):
            tmp = p.detach().clone()
            p.copy_(v)
            v.copy_(tmp)

    def model_piece(self, index: int, piece, swapped: bool) -> torch.Tensor:
        """The model's own weights (those for the next micro-batch) of ``piece`` of parameter ``index`` (a view).
        ``swapped``: inside ``committed_weights()`` they wait in the round buffer."""
        source = self.comm_views if swapped else self.params
        return source[index].detach().reshape(-1)[piece.param_start : piece.param_end]

    def mark_weights(self) -> None:
        """Remember the parameters' versions: the weights the master slice holds (construction, a load)."""
        self._weights_versions = [p._version for p in self.params]

    @torch.no_grad()
    def weights_written(self) -> List[int]:
        """The parameters written in place with other values since :meth:`mark_weights`, as far as this rank's
        pieces show (before the first round: by the user). A write of the same values (DDP's broadcast of the
        first rank's weights) is not one."""
        written = []
        for i, pc in enumerate(self.layout.pieces(self.rank)):
            p = self.params[i]
            if pc.numel and p._version != self._weights_versions[i]:
                held = self.master[pc.local_start : pc.local_end].to(p.dtype)
                if not torch.equal(held, self.model_piece(i, pc, swapped=False)):
                    written.append(i)
        return written

    @torch.no_grad()
    def model_chunk(self, swapped: bool = False) -> torch.Tensor:
        """This rank's chunk of the model's weights, in the compute dtype (the padding zero): a new tensor."""
        chunk = torch.zeros(self.layout.shard_size, dtype=self.compute_dtype, device=self.master.device)
        for i, pc in enumerate(self.layout.pieces(self.rank)):
            if pc.numel:
                chunk[pc.local_start : pc.local_end].copy_(self.model_piece(i, pc, swapped))
        return chunk

    @torch.no_grad()
    def master_from_model(self, swapped: bool) -> None:
        """This rank's master slice from the model's weights (the padding zero)."""
        self.master.zero_()
        for i, pc in enumerate(self.layout.pieces(self.rank)):
            if pc.numel:
                self.master[pc.local_start : pc.local_end].copy_(self.model_piece(i, pc, swapped))

    # ------------------------------------------------------------ accounting

    def memory_report(self, optimizer_state: Sequence[torch.Tensor], scratch: Sequence[torch.Tensor],
                      temporaries: int = 0) -> Dict[str, int]:
        b = self.shard
        report = {
            "params": nbytes(self.params),
            "grads": 0 if self.grads is self.accum else nbytes([self.grads]),
            "accum": nbytes([self.accum]),
            "comm": nbytes([self.comm]),
            "master": nbytes([b.master]),
            "master_grad": nbytes([b.grad]),
            "staging": nbytes([b.staging] if b.grad_staging is None or b.grad_staging is b.staging
                              else [b.staging, b.grad_staging]),  # (an estimate's low_slice lives in comm)
            "optimizer_state": nbytes(optimizer_state),
            "estimate_scratch": nbytes(scratch),
            # the transport's own: with compression, the quantized chunks out and in, and the residual (full size)
            **self.transport.memory(),
            "round_temporaries": temporaries,
        }
        # the persistent buffers; round_temporaries come and go within a round
        report["library_total"] = sum(v for k, v in report.items() if k not in ("params", "round_temporaries"))
        return report


def choose_transport(precision: Any, layout: Layout, rank: int, params: List[torch.Tensor], comm: torch.Tensor,
                     views: List[torch.Tensor]) -> Transport:
    """The round's wire format, from the resolved ``PrecisionPolicy``, once: ``compression`` (quantized blocks,
    ``compressed.Quantized``), else ``estimate_dtype`` (the estimate in that dtype through ``comm``'s bytes,
    ``transport.NarrowEstimate``), else the round buffer as it is (``transport.FullWidth``). Allocates the
    transport's buffers (zero); no collective. ``compression="auto"`` starts without compression."""
    if precision.compression not in (None, "auto"):
        return Quantized(precision.compression, precision.compression_block, precision.compression_weights, layout,
                         rank, precision.accumulation_dtype, params, views, precision.estimate_compression)
    if precision.estimate_dtype is not None:
        return NarrowEstimate(comm, layout, rank, precision.estimate_dtype, params, precision.compute_dtype)
    return FullWidth()


def _master_slice(params: List[torch.Tensor], layout: Any, rank: int, master_dtype: torch.dtype,
                  compute_dtype: torch.dtype) -> torch.Tensor:
    """This rank's master slice, from the parameters before any cast to ``compute_dtype``: each piece copied
    straight from its parameter (no full-size temporary). Then the parameters are cast, once."""
    master = torch.zeros(layout.shard_size, dtype=master_dtype, device=params[0].device)
    with torch.no_grad():
        for pc in layout.pieces(rank):
            if pc.numel:
                flat = params[pc.index].detach().reshape(-1)
                master[pc.local_start : pc.local_end].copy_(flat[pc.param_start : pc.param_end])
        if compute_dtype != params[0].dtype:
            for p in params:
                p.data = p.data.to(compute_dtype)  # once, at construction: addresses fixed from here on
    return master


def _shard_buffers(comm: torch.Tensor, comm_weights: torch.Tensor, master: torch.Tensor, layout: Any,
                   n_params: int, cd: torch.dtype, rd: torch.dtype, collectives: str) -> ShardBuffers:
    """A round's buffers on this rank: the master slice and its gradient, the counts, the row, the staging
    slices the dtypes need."""
    device, master_dtype, s = master.device, master.dtype, layout.shard_size
    row = 3 + _arrivals.words(n_params)  # [count, fingerprint, round id, the arrivals' bits]
    b = ShardBuffers(
        comm=comm,
        weights=comm_weights,
        master=master,
        grad=torch.zeros_like(master),
        count=torch.zeros(1, dtype=master_dtype, device=device),
        rank_counts=torch.zeros(layout.world_size, dtype=master_dtype, device=device),
        row=torch.zeros(row, dtype=torch.float64, device=device),
        rows=torch.zeros(row * layout.world_size, dtype=torch.float64, device=device),
        all_arrived=torch.empty(row - 3, dtype=torch.float64, device=device),
        staging=None if cd == master_dtype else torch.zeros(s, dtype=cd, device=device),
        collectives=collectives,
    )
    with torch.no_grad():  # each word filled as a kernel argument: no copy from host memory
        for w, value in enumerate(_arrivals.pack((), n_params)):
            b.all_arrived[w].fill_(value)
    if rd != master_dtype:  # gradients reduced in a narrower dtype than the master's: their own landing slice
        b.grad_staging = b.staging if rd == cd else torch.zeros(s, dtype=rd, device=device)
    return b
