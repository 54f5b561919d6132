"""A compressed round's exchanges (``compression``, ``docs/algorithm.md``, "Compressed rounds"): the gradients
(each rank's chunks quantized, one all-to-all, each owner's sum in fp32, and the commit's error feedback) and
the weights (each owner's change against what every rank holds, quantized, one all-gather).

Rank ``r`` quantizes chunk ``j`` of its buffer ``x`` (``shard_size`` elements, rank ``j``'s share) into
``packed.send``; one all-to-all hands every owner the ``N`` quantized chunks of its share, which it dequantizes
and adds in rank order, in fp32. No value is quantized twice, whatever ``N``: unlike a ring reduce-scatter,
nothing is re-quantized at a hop. On a commit, ``x`` is the gradient sum plus the rank's residual, and the
residual becomes what the quantization dropped, ``x - dequantize(quantize(x))``, once the round knows it takes
its step (a skipped round leaves it as it was).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .collectives import all_gather_flat
from .quantize import dequantize_add_, packed_size, quantize, residual_of
from .shard_buffers import Held, Packed

__all__ = ["all_gather_packed", "change_against_held", "keep_residual", "reduce_scatter_packed"]


def _chunks(x: torch.Tensor, shard_size: int, world_size: int):
    return [x[j * shard_size:(j + 1) * shard_size] for j in range(world_size)]


def reduce_scatter_packed(out: torch.Tensor, x: torch.Tensor, packed: Packed, group: Optional[dist.ProcessGroup],
                          shard_size: int) -> None:
    """``out`` (this rank's share) = the sum over ranks, in rank order, of each rank's dequantized chunk for this
    rank. Collective on ``group``: one all-to-all of ``N`` packed chunks (``None``: one process, a copy)."""
    world = packed.world
    for j, chunk in enumerate(_chunks(x, shard_size, world)):
        quantize(chunk, packed.kind, packed.block, packed.send[j * packed.chunk:(j + 1) * packed.chunk])
    if group is None:
        packed.recv.copy_(packed.send)
    else:
        # all-to-all: the j-th chunk of send to rank j; recv holds every rank's chunk for this rank, in rank order
        dist.all_to_all_single(packed.recv, packed.send, group=group)
    out.zero_()
    for j in range(world):  # in rank order, in fp32
        dequantize_add_(packed.recv[j * packed.chunk:(j + 1) * packed.chunk], packed.kind, packed.block, shard_size,
                        out)


def keep_residual(x: torch.Tensor, packed: Packed, shard_size: int, undo: Optional[torch.Tensor] = None) -> None:
    """The error feedback after a commit that steps: ``residual = x - dequantize(what was sent)``, chunk by chunk
    (slab-sized temporaries). ``undo`` (a device flag, the CUDA path): where set, the residual stays."""
    world = packed.world
    for j, (xs, rs) in enumerate(zip(_chunks(x, shard_size, world), _chunks(packed.residual, shard_size, world))):
        residual_of(xs, packed.send[j * packed.chunk:(j + 1) * packed.chunk], packed.kind, packed.block, rs,
                    keep=undo)


def reconstructed(reference: torch.Tensor, source: torch.Tensor, kind: str, block: int) -> torch.Tensor:
    """What :func:`all_gather_packed` makes of one owner's chunk, computed alone: ``reference`` (the weights every
    rank held, compute dtype) plus the dequantized change ``source - reference``. Pure; a new tensor."""
    packed = torch.empty(packed_size(reference.numel(), block), dtype=torch.uint8, device=reference.device)
    quantize(source, kind, block, packed, minus=reference)
    out = reference.clone()
    dequantize_add_(packed, kind, block, reference.numel(), out)
    return out


def all_gather_packed(weights: torch.Tensor, source: torch.Tensor, packed: Packed,
                      group: Optional[dist.ProcessGroup], shard_size: int, algorithm: str) -> None:
    """``weights`` (the round buffer, compute dtype, full) = what every rank reconstructs: the model's current
    weights (the previous round's, the same bits on every rank) plus each owner's dequantized change
    ``source - reference`` of its share. The fp32 master stays exact, and as each round's change is taken
    against what the ranks hold, the quantization's error does not build up. Collective on ``group``: one
    all-gather of one packed chunk per rank (``algorithm``: the ring or the native one, ``collectives.py``)."""
    if not packed.policy.compression_weights:  # only the gradients compressed: the weights as they are
        all_gather_flat(weights, source, group, algorithm)
        return
    # The reference, laid out as the weights are (padding zero). The model's parameters are only read here: the
    # compute side reads them too, and writes them only at the next hand-off, after this round has finished.
    weights.zero_()
    torch._foreach_copy_(packed.views, [p.detach() for p in packed.params])
    ref = weights[packed.rank * shard_size:(packed.rank + 1) * shard_size]
    mine = packed.send[:packed.chunk]
    quantize(source, packed.kind, packed.block, mine, minus=ref)  # source - ref, out of place: source may be the master
    all_gather_flat(packed.recv, mine, group, algorithm)  # every owner's packed change, in rank order
    world = packed.world
    for j, w in enumerate(_chunks(weights, shard_size, world)):  # the reference + the change, in fp32
        dequantize_add_(packed.recv[j * packed.chunk:(j + 1) * packed.chunk], packed.kind, packed.block, shard_size, w)


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
