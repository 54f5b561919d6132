"""A compressed round's exchanges (``compression``, ``docs/algorithm.md``, "Compressed rounds"): the gradients
(each rank's chunks quantized, one all-to-all, each owner's sum in fp32, and the commit's error feedback) and
the weights (each owner's change against what every rank holds, quantized, one all-gather).

Rank ``r`` quantizes chunk ``j`` of its buffer ``x`` (``shard_size`` elements, rank ``j``'s share) into
``packed.send``; one all-to-all hands every owner the ``N`` quantized chunks of its share, which it dequantizes
and adds in rank order, in fp32. No value is quantized twice, whatever ``N``: unlike a ring reduce-scatter,
nothing is re-quantized at a hop. On a commit, ``x`` is the gradient sum plus the rank's residual, and the
residual becomes what the quantization dropped, ``x - dequantize(quantize(x))``, once the round knows it takes
its step (a skipped round leaves it as it was). An estimate round, whose step is thrown away, may travel in a
kind of its own (``estimate_compression``: fewer bits), gradients and weights' change alike.

:class:`Quantized` is this wire format's :class:`~acco.transport.Transport`: it owns the packed chunks out and
in (sized by ``quantize.packed_size`` for its kind), the residual, and the exchanges below.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from .collectives import all_gather_flat
from .placement import Layout
from .quantize import dequantize_add_, packed_size, quantize, residual_of
from .shard_buffers import ShardBuffers
from .stats import nbytes
from .transport import Transport

__all__ = ["Quantized", "all_gather_packed", "keep_residual", "reconstructed", "reduce_scatter_packed"]


class Quantized(Transport):
    """``compression``: quantized blocks of ``kind`` (``quantize.KINDS``) with a scale each, both ways.

    It owns ``send``, this rank's ``N`` packed chunks end to end (``chunk`` bytes each, the chunk for rank ``j``
    at ``j * chunk``), and ``recv``, every rank's chunk for this rank in rank order (the all-gather of the weights
    uses the first chunk of ``send`` and all of ``recv`` the same way); ``residual``, this rank's error feedback,
    full size, in the accumulation dtype (what its commits' quantization has not yet sent, zero at the start);
    and reads ``params`` at ``views`` (their places in the round buffer's weights: the reference every rank holds
    alike). ``weights``: the weights travel as their quantized change too (``compression_weights``), else in the
    compute dtype. ``rank``: this rank's place in the round group (its chunk of the weights). ``estimate_kind``:
    the estimate round's kind (``None``: ``kind``); the buffers fit the wider of the two."""

    def __init__(self, kind: str, block: int, weights: bool, layout: Layout, rank: int,
                 accumulation_dtype: torch.dtype, params: List[torch.Tensor], views: List[torch.Tensor],
                 estimate_kind: Optional[str] = None) -> None:
        device = params[0].device
        self.kind, self.block, self.weights, self.rank = kind, block, weights, rank
        self.estimate_kind = estimate_kind or kind
        self.world = layout.world_size  # ranks of the round group: ``send`` holds one chunk for each
        self.chunk = packed_size(layout.shard_size, block, kind)  # bytes of one packed chunk of shard_size elements
        self.estimate_chunk = packed_size(layout.shard_size, block, self.estimate_kind)
        n = layout.world_size * max(self.chunk, self.estimate_chunk)
        self.send = torch.zeros(n, dtype=torch.uint8, device=device)
        self.recv = torch.zeros(n, dtype=torch.uint8, device=device)
        self._residual = torch.zeros(layout.padded_numel, dtype=accumulation_dtype, device=device)
        self.params, self.views = params, views

    def codec(self, commit: bool) -> Tuple[str, int]:
        """A round's kind and the bytes of one of its packed chunks: the commit's, or the estimate's."""
        return (self.kind, self.chunk) if commit else (self.estimate_kind, self.estimate_chunk)

    @property
    def residual(self) -> torch.Tensor:
        return self._residual

    @property
    def weights_codec(self) -> Optional[Tuple[str, int]]:
        return (self.kind, self.block) if self.weights else None

    def reduce_scatter(self, b: ShardBuffers, commit: bool, group: Optional[dist.ProcessGroup]) -> None:
        """Collective on ``group``: one all-to-all of quantized chunks, each owner's sum in fp32; a commit sends
        its residual with its gradients (the estimate quantizes without feedback)."""
        if commit:
            b.comm.add_(self._residual)  # error feedback: what the earlier commits' quantization dropped
        reduce_scatter_packed(b.grad, b.comm, self, group, b.grad.numel(), commit)

    def keep_residual(self, b: ShardBuffers, undo: Optional[torch.Tensor]) -> None:
        """``comm`` still holds what was sent: the residual becomes what its quantization dropped. No
        collective."""
        keep_residual(b.comm, self, b.grad.numel(), undo)

    def all_gather(self, b: ShardBuffers, source: torch.Tensor, commit: bool,
                   group: Optional[dist.ProcessGroup]) -> None:
        """Collective on ``group``: each owner's change against the weights every rank holds, one all-gather of
        packed chunks (:func:`all_gather_packed`)."""
        all_gather_packed(b.weights, source, self, group, b.master.numel(), b.collectives, commit)

    def tensors(self) -> List[torch.Tensor]:
        """The packed chunks, the residual, and the parameters the weights' change is taken against."""
        return [self.send, self.recv, self._residual, *self.params]

    def memory(self) -> Dict[str, int]:
        """The quantized chunks out and in, and the error feedback's residual (full size)."""
        return {"compressed": nbytes([self.send, self.recv]), "residual": nbytes([self._residual])}


def _chunks(x: torch.Tensor, shard_size: int, world_size: int):
    return [x[j * shard_size:(j + 1) * shard_size] for j in range(world_size)]


def reduce_scatter_packed(out: torch.Tensor, x: torch.Tensor, packed: Quantized, group: Optional[dist.ProcessGroup],
                          shard_size: int, commit: bool = True) -> None:
    """``out`` (this rank's share) = the sum over ranks, in rank order, of each rank's dequantized chunk for this
    rank, in the commit's kind or the estimate's. Collective on ``group``: one all-to-all of ``N`` packed chunks
    (``None``: one process, a copy)."""
    world, (kind, chunk) = packed.world, packed.codec(commit)
    send, recv = packed.send[:world * chunk], packed.recv[:world * chunk]  # the round's kind's bytes
    for j, part in enumerate(_chunks(x, shard_size, world)):
        quantize(part, kind, packed.block, send[j * chunk:(j + 1) * chunk])
    if group is None:
        recv.copy_(send)
    else:
        # all-to-all: the j-th chunk of send to rank j; recv holds every rank's chunk for this rank, in rank order
        dist.all_to_all_single(recv, send, group=group)
    out.zero_()
    for j in range(world):  # in rank order, in fp32
        dequantize_add_(recv[j * chunk:(j + 1) * chunk], kind, packed.block, shard_size, out)


def keep_residual(x: torch.Tensor, packed: Quantized, shard_size: int, undo: Optional[torch.Tensor] = None) -> None:
    """The error feedback after a commit that steps: ``residual = x - dequantize(what was sent)``, chunk by chunk
    (slab-sized temporaries). ``undo`` (a device flag, the CUDA path): where set, the residual stays."""
    world = packed.world
    for j, (xs, rs) in enumerate(zip(_chunks(x, shard_size, world), _chunks(packed.residual, shard_size, world))):
        residual_of(xs, packed.send[j * packed.chunk:(j + 1) * packed.chunk], packed.kind, packed.block, rs,
                    keep=undo)


def reconstructed(reference: torch.Tensor, source: torch.Tensor, kind: str, block: int) -> torch.Tensor:
    """What :func:`all_gather_packed` makes of one owner's chunk, computed alone: ``reference`` (the weights every
    rank held, compute dtype) plus the dequantized change ``source - reference``. Pure; a new tensor."""
    packed = torch.empty(packed_size(reference.numel(), block, kind), dtype=torch.uint8, device=reference.device)
    quantize(source, kind, block, packed, minus=reference)
    out = reference.clone()
    dequantize_add_(packed, kind, block, reference.numel(), out)
    return out


def all_gather_packed(weights: torch.Tensor, source: torch.Tensor, packed: Quantized,
                      group: Optional[dist.ProcessGroup], shard_size: int, algorithm: str, commit: bool = True) -> None:
    """``weights`` (the round buffer, compute dtype, full) = what every rank reconstructs: the model's current
    weights (the previous round's, the same bits on every rank) plus each owner's dequantized change
    ``source - reference`` of its share. The fp32 master stays exact, and as each round's change is taken
    against what the ranks hold, the quantization's error does not build up. Collective on ``group``: one
    all-gather of one packed chunk per rank (``algorithm``: the ring or the native one, ``collectives.py``)."""
    if not packed.weights:  # only the gradients compressed: the weights as they are
        all_gather_flat(weights, source, group, algorithm)
        return
    # The reference, laid out as the weights are (padding zero). The model's parameters are only read here: the
    # compute side reads them too, and writes them only at the next hand-off, after this round has finished.
    weights.zero_()
    torch._foreach_copy_(packed.views, [p.detach() for p in packed.params])
    ref = weights[packed.rank * shard_size:(packed.rank + 1) * shard_size]
    world, (kind, chunk) = packed.world, packed.codec(commit)
    mine, recv = packed.send[:chunk], packed.recv[:world * chunk]
    quantize(source, kind, packed.block, mine, minus=ref)  # source - ref, out of place: source may be the master
    all_gather_flat(recv, mine, group, algorithm)  # every owner's packed change, in rank order
    for j, w in enumerate(_chunks(weights, shard_size, world)):  # the reference + the change, in fp32
        dequantize_add_(recv[j * chunk:(j + 1) * chunk], kind, packed.block, shard_size, w)

