"""Format 2: checkpoints written before per-parameter state (acco up to commit 13d8226), read as format 3.

Format 2 held flat tensors: every parameter end to end, each rank its slice of
``ceil(numel / N)`` elements (``master``, ``params``, ``state/K``), the
per-parameter scalars as one vector per key (``scalars/K``), and the same
``hyper``, ``counters`` and description. Its optimizers were all
element-wise, whose layout format 3 keeps unchanged, so each rank's slice cuts
into the pieces of format 3 (:func:`to_saved`). Everything here is local, except
that the DCP target (:func:`dcp_target`) is made of DTensors on the user's group.
"""

from __future__ import annotations

from typing import Any, Dict

import torch
import torch.distributed as dist

from .checksums import leaves, partial_checksum
from .format import empty_sections, piece_key

__all__ = ["checksums", "dcp_checksums", "dcp_target", "is_legacy", "to_saved"]


def is_legacy(saved_info: Dict[str, Any]) -> bool:
    return saved_info.get("format") == 2


def _local(t: Any) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def to_saved(layout: Any, rank: int, sd: Dict[str, Any]) -> Dict[str, Any]:
    """This rank's format-2 slice (a state dict of its own, or what :func:`dcp_target` read) as format-3
    pieces (``pieces.Saved`` reads the result)."""
    master, params = _local(sd["master"]), _local(sd["params"])
    state = {k: _local(v) for k, v in sd["state"].items()}
    out: Dict[str, Dict[str, Any]] = empty_sections()
    for i, pc in enumerate(layout.pieces(rank)):
        out["scalars"][str(i)] = {k: v[i].reshape(()) for k, v in sd["scalars"].items()}
        if not pc.numel:
            continue
        key = piece_key(i, pc.param_start)
        out["master"][key] = master[pc.local_start : pc.local_end]
        out["params"][key] = params[pc.local_start : pc.local_end]
        out["state"][key] = {k: v[pc.local_start : pc.local_end] for k, v in state.items()}
        out["entries"][key] = torch.tensor(len(state), dtype=torch.int64)
    return out


def checksums(tree: Dict[str, Any], rank: int, shard_size: int) -> Dict[str, torch.Tensor]:
    """Format 2's checksums of a rank's own state dict: its slices weighted from the rank's offset in the flat
    buffer (so that they add up over ranks), the rest from 0."""
    out = {}
    for path, t in leaves(tree):
        sliced = path in ("optim/master", "optim/params") or path.startswith("optim/state/")
        out[path] = partial_checksum(t, rank * shard_size if sliced else 0)
    return out


def dcp_checksums(tree: Dict[str, Any], rank: int, shard_size: int, group: Any,
                  device: torch.device) -> Dict[str, torch.Tensor]:
    """Format 2's checksums of what a DCP load read: a flat (DTensor) entry's is the sum of every rank's
    slice's, weighted from its offset (one all-reduce on ``group``: collective); the rest from 0."""
    out, sharded = {}, []
    for path, t in leaves(tree):
        if hasattr(t, "to_local"):
            out[path] = partial_checksum(t.to_local(), rank * shard_size)
            sharded.append(path)
        else:
            out[path] = partial_checksum(t, 0)
    if sharded and group is not None and dist.is_initialized():
        parts = torch.stack([out[k] for k in sharded]).to(device)
        dist.all_reduce(parts, group=group)  # the sum of the slices' checksums: the whole tensor's
        for k, v in zip(sharded, parts.cpu()):
            out[k] = v
    return out


def dcp_target(layout: Any, rank: int, process_group: Any, device: torch.device, compute_dtype: torch.dtype,
               master_dtype: torch.dtype, keys: Dict[str, Any]) -> Dict[str, Any]:
    """Empty tensors of a format-2 DCP checkpoint's shapes for ``dcp.load`` to fill: flat 1-D DTensors of
    ``numel`` elements, this rank's slice local (``keys``: the checkpoint's optimizer keys and their sizes)."""
    real = layout.real_numel(rank)

    def flat(dtype):
        local = torch.zeros(real, dtype=dtype, device=device)
        if process_group is None:
            return local
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor import DTensor, Shard

        mesh = DeviceMesh.from_group(process_group, device.type)
        return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size([layout.numel]), stride=(1,))

    n = len(layout.params)
    return {
        "master": flat(master_dtype),
        "params": flat(compute_dtype),
        "state": {k: flat(master_dtype) for k in keys["state"]},
        "scalars": {k: torch.zeros(n, dtype=torch.float64) for k in keys["scalars"]},
        "hyper": {k: torch.zeros(shape, dtype=torch.float64) for k, shape in keys["hyper"].items()},
        "counters": torch.zeros(keys["counters"], dtype=torch.int64),
        "meta": {k: torch.zeros(shape, dtype=torch.int64 if len(shape) == 0 else torch.uint8)
                 for k, shape in keys["meta"].items()},
    }
