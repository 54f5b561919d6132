"""Checksums of a checkpoint's tensors: written by ``save``, verified by ``load`` before anything changes.

One checksum per entry, over the tensor as it is stored. Each rank's pieces of
the optimizer state are entries of their own (format 3), so no checksum spans
ranks; the entries every rank holds alike (the model's weights, the counters)
are kept only where every rank computed the same (:func:`replicated_only`).
Pure functions of tensors, except :func:`replicated_only` (a collective).
"""

from __future__ import annotations

import logging
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist

from ..errors import CheckpointError
from ..mesh import is_dtensor

__all__ = ["CheckpointError", "checksums", "replicated_only", "verify"]

log = logging.getLogger("acco")


_CHUNK = 1 << 20  # words per step of a checksum: its temporaries stay small


def partial_checksum(t: torch.Tensor, start: int) -> torch.Tensor:
    """Sum over the tensor's bit words ``w_i`` of ``w_i * (2 (start + i) + 1)`` in wrapping int64.

    Order-sensitive; changes with any single changed word (the weights are odd); additive over slices when
    ``start`` is each slice's offset (format 2 relied on that).
    """
    flat = t.detach().reshape(-1).contiguous()
    size = flat.element_size()
    words = flat.view(torch.int32) if size >= 4 else flat.view(torch.int16) if size == 2 else flat.view(torch.uint8)
    per = max(1, size // 4)
    total = torch.zeros((), dtype=torch.int64, device=flat.device)
    for lo in range(0, words.numel(), _CHUNK):
        w = words[lo : lo + _CHUNK].to(torch.int64)
        idx = torch.arange(start * per + lo, start * per + lo + w.numel(), dtype=torch.int64, device=flat.device)
        total += (w * (2 * idx + 1)).sum()
    return total.cpu()


def leaves(tree: Dict[str, Any], prefix: str = ""):
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            yield from leaves(value, path + "/")
        elif torch.is_tensor(value) and not is_dtensor(value):
            # A DTensor (a model's sharded entry) is left out: DCP saves it sharded, and one rank's checksum of
            # its local shard would be checked against another shard's (trained ones are checked as the
            # optimizer's pieces).
            yield path, value


def checksums(tree: Dict[str, Any]) -> Dict[str, torch.Tensor]:
    """One checksum per tensor of ``tree``, keyed by its path (``"optim/master/3:0"``)."""
    return {path: partial_checksum(t, 0) for path, t in leaves(tree)}


def replicated_only(sums: Dict[str, torch.Tensor], group: Optional[dist.ProcessGroup],
                    device: torch.device) -> Dict[str, torch.Tensor]:
    """Drop the checksums of entries that differ across ranks (DCP keeps one rank's copy of an entry every rank
    holds, so no single checksum would fit; e.g. BatchNorm statistics without ``buffers=``). ``sums``: the same
    keys on every rank. Collective on ``group``."""
    if group is None or not dist.is_initialized():
        return sums
    keys = sorted(sums)
    if not keys:
        return sums
    mine = torch.stack([sums[k] for k in keys]).to(device)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)  # every rank's checksums of the entries all ranks hold
    differ = [k for i, k in enumerate(keys) if any(int(e[i]) != int(mine[i]) for e in everyone)]
    if differ:
        log.warning("acco.checkpoint.save: %s differ across ranks; the checkpoint keeps one rank's copy, unverified",
                    differ)
    return {k: v for k, v in sums.items() if k not in differ}


def verify(got: Dict[str, torch.Tensor], expected: Dict[str, torch.Tensor], where: str, subset: bool = False) -> None:
    """Raise :class:`CheckpointError` naming the first entry whose checksum differs. ``got``: the checksums of
    what was read; ``subset``: entries without a stored checksum pass, and stored checksums of entries not read
    are not required (a rank reads only the pieces it needs)."""
    if subset:
        got = {k: v for k, v in got.items() if k in expected}
        expected = {k: v for k, v in expected.items() if k in got}
    if set(got) != set(expected):
        raise CheckpointError(
            f"{where}: the checksummed entries {sorted(set(expected) ^ set(got))} are missing on one side: the file "
            "was damaged or edited. Nothing was loaded; use another checkpoint."
        )
    for key, value in expected.items():
        if int(got[key]) != int(value):
            raise CheckpointError(
                f"{where}: entry {key!r} does not match its checksum: the file was damaged after it was written "
                "(disk, copy, truncation). Nothing was loaded; use another checkpoint."
            )
