"""The few collectives a round uses, with a single-process fallback.

Every function here is collective: call it on all ranks of ``group`` in the same
order. With ``group=None`` (no process group: one process) each reduces to a
local copy, so the same round code serves one process and many.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

__all__ = ["all_gather_flat", "all_reduce_sum", "reduce_scatter_flat", "group_size", "group_rank"]

# torch >= 2.13 names the flat collectives *_single; older releases *_tensor.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def group_size(group: Optional[dist.ProcessGroup]) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: Optional[dist.ProcessGroup]) -> int:
    return 0 if group is None else dist.get_rank(group)


def reduce_scatter_flat(out: torch.Tensor, flat: torch.Tensor, group: Optional[dist.ProcessGroup]) -> None:
    """Sum ``flat`` over ranks and keep this rank's slice in ``out``. Collective."""
    if group is None:
        out.copy_(flat)
    else:
        _reduce_scatter(out, flat, group=group)


def all_gather_flat(flat: torch.Tensor, shard: torch.Tensor, group: Optional[dist.ProcessGroup]) -> None:
    """Concatenate every rank's ``shard`` into ``flat``. Collective."""
    if group is None:
        flat.copy_(shard)
    else:
        _all_gather(flat, shard, group=group)


def all_reduce_sum(t: torch.Tensor, group: Optional[dist.ProcessGroup]) -> None:
    """Sum ``t`` over ranks in place. Collective."""
    if group is not None:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
