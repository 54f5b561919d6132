"""This rank's buffers for a round (:class:`ShardBuffers`): built by ``buffers.py``, read and written by
``rounds.py``. A plain record: no behaviour."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional

import torch

__all__ = ["Held", "Packed", "ShardBuffers"]


@dataclass
class Held:
    """The weights every rank holds during a round (the model's parameters: the previous round's result, the
    same bits on every rank), as this rank's chunk sees them: its ``pieces`` (``placement.Piece``, those with
    elements) of ``params``. The bf16 estimate of an fp32 model sends its weights as the change against them
    (``compressed.change_against_held``)."""

    params: List[torch.Tensor]
    pieces: List[Any]


@dataclass
class Packed:
    """A compressed round's buffers (``compression``, ``quantize.py``, ``compressed.py``): ``send`` holds this
    rank's ``N`` quantized chunks end to end (``chunk`` bytes each, the chunk for rank ``j`` at ``j * chunk``),
    ``recv`` every rank's chunk for this rank, in rank order (the all-gather of the weights uses their first
    chunk and all of ``recv`` the same way); ``residual``: this rank's error feedback, full size, in the
    accumulation dtype (what its commits' quantization has not yet sent); ``params`` and ``views``: the model's
    parameters and their places in the round buffer's weights (the reference every rank holds alike);
    ``policy``: the resolved ``PrecisionPolicy`` the round reads its settings from."""

    policy: Any
    rank: int  # this rank's place in the round group: its chunk of the weights
    chunk: int  # bytes of one packed chunk of shard_size elements
    send: torch.Tensor
    recv: torch.Tensor
    residual: torch.Tensor
    params: List[torch.Tensor]
    views: List[torch.Tensor]

    @property
    def kind(self) -> str:
        return self.policy.compression

    @property
    def block(self) -> int:
        return self.policy.compression_block

    @property
    def world(self) -> int:
        """Ranks of the round group: ``send`` holds one chunk for each."""
        return self.send.numel() // self.chunk


@dataclass
class ShardBuffers:
    """This rank's buffers for a round.

    ``comm``: full padded flat buffer: gradients out (accumulation dtype).
    ``weights``: ``comm``'s memory as the compute dtype (``comm`` itself when the
    dtypes agree): the all-gathered weights come back there, after the
    reduce-scatter has read the gradients.
    ``master``/``grad``: this rank's fp32 slice; the wrapped optimizer's
    parameters and their ``.grad`` are views into them.
    ``staging``: a compute-dtype slice, used only when compute and master
    dtypes differ (sends the all-gather).
    ``grad_staging``: receives the reduce-scatter when the accumulation and
    master dtypes differ (``staging`` itself when it has that dtype).
    ``count``: one element on the device, the micro-batch count over all ranks.
    ``rank_counts``: one element per rank, each rank's micro-batch count.
    ``row``/``rows``: this rank's ``[micro-batch count, hyper-parameter fingerprint,
    round id]`` and every rank's, end to end (one all-gather carries all three).
    """

    comm: torch.Tensor
    weights: torch.Tensor
    master: torch.Tensor
    grad: torch.Tensor
    count: torch.Tensor
    rank_counts: torch.Tensor
    row: Optional[torch.Tensor] = None
    rows: Optional[torch.Tensor] = None
    staging: Optional[torch.Tensor] = None
    grad_staging: Optional[torch.Tensor] = None
    collectives: str = "native"  # or "ring": the reduce-scatter and all-gather (collectives.ring_algorithm)
    # estimate_dtype: an estimate round's gradients out and weights back in the first bytes of ``comm``, through
    # a slice of that dtype (the commit round stays in full precision)
    comm_low: Optional[torch.Tensor] = None
    low_slice: Optional[torch.Tensor] = None
    host_empty: Any = None  # (shape, dtype) -> a host tensor the device writes without blocking (device checks)
    all_arrived: Optional[torch.Tensor] = None  # the row's arrival bits with every parameter's set (arrivals.pack)
    packed: Optional[Packed] = None  # compression: the gradients travel quantized (rounds.py, compressed.py)
    held: Optional[Held] = None  # estimate_dtype: what the estimate's change is taken against
