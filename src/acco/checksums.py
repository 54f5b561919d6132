"""Checksums of a checkpoint's tensors: written by ``save``, verified by ``load`` before anything changes.

A checksum is additive over slices, so a sharded entry's is the sum of its
slices' (one all-reduce) and survives resharding. Pure functions of tensors,
except where a sharded entry's slices are summed (a collective on the user's
group).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Dict

import torch
import torch.distributed as dist

if TYPE_CHECKING:  # pragma: no cover
    from .optimizer import AccoOptimizer

__all__ = ["CheckpointError", "checksums", "replicated_only", "verify"]

log = logging.getLogger("acco")


_CHUNK = 1 << 20  # words per step of a checksum: its temporaries stay small


class CheckpointError(ValueError):
    """A checkpoint that cannot be read, or whose contents do not match their checksums. Nothing was loaded."""


def _partial_checksum(t: torch.Tensor, start: int) -> torch.Tensor:
    """Sum over the tensor's bit words ``w_i`` of ``w_i * (2 (start + i) + 1)`` in wrapping int64.

    Additive over slices (a sharded tensor's checksum is the sum of its slices'), so it survives
    resharding; order-sensitive; changes with any single changed word (the weights are odd).
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


def _leaves(tree: Dict[str, Any], prefix: str = ""):
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            yield from _leaves(value, path + "/")
        elif torch.is_tensor(value):
            yield path, value


def checksums(opt: "AccoOptimizer", sd: Dict[str, Any]) -> Dict[str, torch.Tensor]:
    """One checksum per tensor of ``sd``: a sharded (DTensor) entry's over all ranks (an all-reduce on
    the user's group: collective), a plain entry's over what this rank holds."""
    out: Dict[str, torch.Tensor] = {}
    sharded = []
    offset = opt.rank * opt.layout.shard_size
    for path, t in _leaves(sd):
        if hasattr(t, "to_local"):
            out[path] = _partial_checksum(t.to_local(), offset)
            sharded.append(path)
        else:
            out[path] = _partial_checksum(t, offset if path.startswith("optim/") and _is_slice(path) else 0)
    if sharded and opt.process_group is not None and dist.is_initialized():
        parts = torch.stack([out[k] for k in sharded]).to(opt.device)
        dist.all_reduce(parts, group=opt.process_group)  # the sum of the slices' checksums: the whole tensor's
        for k, v in zip(sharded, parts.cpu()):
            out[k] = v
    return out


def replicated_only(opt: "AccoOptimizer", sums: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Drop the checksums of entries that differ across ranks (DCP keeps one rank's copy of a plain entry,
    so no single checksum would fit; e.g. BatchNorm statistics without ``buffers=``). Collective."""
    if opt.process_group is None or not dist.is_initialized():
        return sums
    keys = sorted(sums)
    mine = torch.stack([sums[k] for k in keys]).to(opt.device)
    everyone = [torch.empty_like(mine) for _ in range(opt.world_size)]
    dist.all_gather(everyone, mine, group=opt.process_group)
    differ = [k for i, k in enumerate(keys) if any(int(e[i]) != int(mine[i]) for e in everyone)]
    if differ:
        log.warning("acco.checkpoint.save: %s differ across ranks; the checkpoint keeps one rank's copy, unverified",
                    differ)
    return {k: v for k, v in sums.items() if k not in differ}


def _is_slice(path: str) -> bool:
    return path in ("optim/master", "optim/params") or path.startswith("optim/state/")


def verify(opt: "AccoOptimizer", sd: Dict[str, Any], expected: Dict[str, torch.Tensor], where: str,
           subset: bool = False) -> None:
    """Raise :class:`CheckpointError` naming the first entry whose checksum differs (``subset``: entries
    without a stored checksum pass, as :func:`save` drops those that differ across ranks). Collective if sharded."""
    got = checksums(opt, sd)
    if subset:
        got = {k: v for k, v in got.items() if k in expected}
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
