"""How a round's gradients and weights travel: one :class:`Transport` per wire format, chosen once.

FSDP2 keeps its collectives as parts (``_fsdp_collectives.py``: an ``AllGather`` and a ``ReduceScatter``, each
owning its buffers); a round here does the same. A transport owns the buffers of its wire format (allocated when
the round buffers are built, sized by its own byte count), the packing before a collective, the collectives
themselves and the unpacking after them. The phases of a round (``rounds.py``) call it and never ask which
format it is: a new format is a new implementation, chosen in one place (``buffers.choose_transport``).

Here, the two that send the round buffer as it is (``compressed.py`` holds the quantized one):

* :class:`FullWidth`: the gradients in ``reduce_dtype`` (the accumulation dtype unless narrowed), the weights
  in the compute dtype, both ways through the round buffer ``comm`` (``collectives.py``: the ring on gloo);
* :class:`NarrowEstimate`: the commit as :class:`FullWidth`; the estimate round in ``estimate_dtype``, through
  the first bytes of ``comm`` and a slice after them (no memory of its own), its weights as the change against
  the weights every rank holds when that dtype is narrower than the compute dtype
  (:func:`change_against_held`).

Every method that communicates says so in its docstring, and is collective on the ``group`` it is handed (the
world is a value handed in at each call, not one kept here).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from .collectives import all_gather_flat, reduce_scatter_flat
from .placement import Layout, Piece
from .shard_buffers import ShardBuffers

__all__ = ["FullWidth", "Held", "NarrowEstimate", "Transport", "change_against_held"]


class Transport:
    """One wire format's part of a round (the interface). ``b`` is the round's buffers on this rank
    (:class:`~acco.shard_buffers.ShardBuffers`: the round buffer ``comm``/``weights``, the master slice and its
    gradient ``grad``); ``commit``: a commit round (else an estimate)."""

    def gradients_in(self, comm: torch.Tensor, commit: bool) -> torch.Tensor:
        """Where the hand-off copies the gradient sum to (``comm``, or a view of its bytes). No collective."""
        return comm

    def reduce_scatter(self, b: ShardBuffers, commit: bool, group: Optional[dist.ProcessGroup]) -> None:
        """``b.grad`` = this rank's slice of the gradient sum over ranks (not yet divided). Collective on
        ``group``."""
        raise NotImplementedError(f"{type(self).__name__} does not define reduce_scatter")

    def keep_residual(self, b: ShardBuffers, undo: Optional[torch.Tensor]) -> None:
        """After the reduce-scatter of a commit that takes its step: keep what this format dropped for the next
        commit (error feedback; ``undo``, a device flag: where set, as if no step). No collective."""

    def all_gather(self, b: ShardBuffers, source: torch.Tensor, commit: bool,
                   group: Optional[dist.ProcessGroup]) -> None:
        """Every rank's new slice (``source``: this rank's, master dtype or compute dtype) into the full weights
        the round leaves for :meth:`install`. Collective on ``group``."""
        raise NotImplementedError(f"{type(self).__name__} does not define all_gather")

    def install_views(self, comm_views: List[torch.Tensor], estimate: bool) -> Tuple[List[torch.Tensor], bool]:
        """What the theta/theta~ swap installs into the parameters: the views of the round's weights (one per
        parameter), and whether they are a change to add to the weights held (else the weights, copied)."""
        return comm_views, False

    def tensors(self) -> List[torch.Tensor]:
        """The tensors a round touches that this transport allocated or reads (the CUDA path records them on
        its stream)."""
        return []

    def memory(self) -> Dict[str, int]:
        """Bytes of this transport's own persistent buffers: ``compressed`` (packed chunks out and in) and
        ``residual`` (the error feedback); zero where it has none."""
        return {"compressed": 0, "residual": 0}

    @property
    def residual(self) -> Optional[torch.Tensor]:
        """This rank's error-feedback residual (checkpointed per rank), None where the format keeps none."""
        return None

    @property
    def weights_codec(self) -> Optional[Tuple[str, int]]:
        """``(kind, block)`` the committed weights travel in, None when they travel exactly (checkpoints record
        it: ``state.format.describe_weights``)."""
        return None


class FullWidth(Transport):
    """The round buffer as it is: gradients in ``comm``'s dtype (``reduce_dtype``), landing in
    ``b.grad_staging`` when that differs from the master's; weights in the compute dtype."""

    def reduce_scatter(self, b: ShardBuffers, commit: bool, group: Optional[dist.ProcessGroup]) -> None:
        """Collective on ``group``: one reduce-scatter of ``comm`` (gloo: the ring, ``comm`` left as scratch)."""
        if b.grad_staging is None:
            reduce_scatter_flat(b.grad, b.comm, group, b.collectives)  # this rank's slice of the gradient sum
        else:
            reduce_scatter_flat(b.grad_staging, b.comm, group, b.collectives)
            b.grad.copy_(b.grad_staging)

    def all_gather(self, b: ShardBuffers, source: torch.Tensor, commit: bool,
                   group: Optional[dist.ProcessGroup]) -> None:
        """Collective on ``group``: one all-gather of this rank's slice into ``b.weights``."""
        all_gather_flat(b.weights, source, group, b.collectives)  # every rank's new slice -> full weights


@dataclass
class Held:
    """The weights every rank holds during a round (the model's parameters: the previous round's result, the
    same bits on every rank), as this rank's chunk sees them: its ``pieces`` (those with elements) of ``params``.
    The bf16 estimate of an fp32 model sends its weights as the change against them
    (:func:`change_against_held`)."""

    params: List[torch.Tensor]
    pieces: List[Piece]


class NarrowEstimate(FullWidth):
    """``estimate_dtype``: the commit at full width; the estimate round's gradients out and weights back in the
    first ``P`` elements of ``estimate_dtype`` of ``comm``'s bytes (``comm_low``), this rank's slice (the
    reduce-scatter's output, the all-gather's input) in the bytes after them (``low_slice``). An estimate round
    leaves at least half of ``comm``'s bytes free (``estimate_dtype`` is narrower than ``reduce_dtype``, so at
    most half as wide), and ``P/N <= P``: no memory of its own. Narrower than the compute dtype (``held``), the
    weights travel as the change against those every rank holds, added to them at the swap."""

    def __init__(self, comm: torch.Tensor, layout: Layout, rank: int, estimate_dtype: torch.dtype,
                 params: List[torch.Tensor], compute_dtype: torch.dtype) -> None:
        n, s = layout.padded_numel, layout.shard_size
        low_bytes = n * estimate_dtype.itemsize
        raw = comm.view(torch.uint8)
        self.comm_low = raw[:low_bytes].view(estimate_dtype)
        self.low_slice = raw[low_bytes : low_bytes + s * estimate_dtype.itemsize].view(estimate_dtype)
        self.comm_low_views = layout.views(self.comm_low)
        # the estimate's weights travel as the change against the model's (a bf16 model's: as they are)
        self.held = (Held(params, [pc for pc in layout.pieces(rank) if pc.numel])
                     if estimate_dtype.itemsize < compute_dtype.itemsize else None)

    def gradients_in(self, comm: torch.Tensor, commit: bool) -> torch.Tensor:
        """A commit's sum into ``comm``, an estimate's into ``comm_low`` (cast by the copy). No collective."""
        return comm if commit else self.comm_low

    def reduce_scatter(self, b: ShardBuffers, commit: bool, group: Optional[dist.ProcessGroup]) -> None:
        """Collective on ``group``: a commit as :class:`FullWidth`; an estimate, one reduce-scatter of
        ``comm_low`` into ``low_slice`` (half the bytes)."""
        if commit:
            super().reduce_scatter(b, commit, group)
            return
        reduce_scatter_flat(self.low_slice, self.comm_low, group, b.collectives)
        b.grad.copy_(self.low_slice)

    def all_gather(self, b: ShardBuffers, source: torch.Tensor, commit: bool,
                   group: Optional[dist.ProcessGroup]) -> None:
        """Collective on ``group``: a commit as :class:`FullWidth`; an estimate, one all-gather in
        ``estimate_dtype`` into ``comm_low``, as the change against the weights every rank holds (a model of
        that dtype: as its weights)."""
        if commit:
            super().all_gather(b, source, commit, group)
            return
        sent = self.low_slice.copy_(source) if self.held is None else change_against_held(self.low_slice, source,
                                                                                           self.held)
        all_gather_flat(self.comm_low, sent, group, b.collectives)

    def install_views(self, comm_views: List[torch.Tensor], estimate: bool) -> Tuple[List[torch.Tensor], bool]:
        """An estimate's weights from ``comm_low``: a change to add when ``held``, else the weights."""
        if not estimate:
            return comm_views, False
        return self.comm_low_views, self.held is not None

    def tensors(self) -> List[torch.Tensor]:
        """The views of ``comm`` it sends through, and the parameters the estimate's change is taken against."""
        return [self.comm_low, self.low_slice] + ([] if self.held is None else list(self.held.params))


def change_against_held(out: torch.Tensor, source: torch.Tensor, held: Held) -> torch.Tensor:
    """``out`` (``estimate_dtype``) = ``source - W`` over this rank's pieces, with ``W`` the weights every rank
    holds (``held``: the model's, theta_t during an estimate round), computed in ``source``'s dtype and cast
    once: the estimate's weights travel as this change, so the cast rounds the change, never a weight, and every
    rank adds it to its ``W`` at the swap (``FlatBuffers.install``; ``docs/algorithm.md``, ``estimate_dtype``).
    The padding is left as it is: it is never installed. The parameters are only read (the compute side writes
    them only at the next hand-off, after the round). No collective. Returns ``out``."""
    for pc in held.pieces:
        w = held.params[pc.index].detach().reshape(-1)[pc.param_start:pc.param_end]
        torch.sub(source[pc.local_start:pc.local_end], w, out=out[pc.local_start:pc.local_end])
    return out
