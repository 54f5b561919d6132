"""This rank's buffers for a round (:class:`ShardBuffers`): built by ``buffers.py``, read and written by
``rounds.py`` and the round's transport (``transport.py``), which owns the buffers of its wire format. A plain
record: no behaviour."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

__all__ = ["ShardBuffers"]


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
    host_empty: Any = None  # (shape, dtype) -> a host tensor the device writes without blocking (device checks)
    all_arrived: Optional[torch.Tensor] = None  # the row's arrival bits with every parameter's set (arrivals.pack)
