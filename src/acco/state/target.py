"""The target a DCP load fills: empty tensors shaped by a checkpoint's metadata, for this rank's pieces.

``acco.checkpoint.load`` reads a checkpoint's metadata, asks this module what to read for this rank (the saved
pieces that overlap its own, its scalars, the counters, hyper-parameters, loss scale and description), and lets
``dcp.load`` fill it. Local: no collective (format 2's flat target is :mod:`acco.state.legacy`'s).
"""

from __future__ import annotations

from typing import Any, Dict

import torch

from ..progress import Progress
from . import legacy as state_legacy
from . import outer_state
from . import residual as state_residual
from .format import StateOwners, empty_sections, parse_piece_key
from .pieces import wanted

__all__ = ["load_target", "meta_template"]


def meta_template(meta_keys: Dict[str, tuple]) -> Dict[str, torch.Tensor]:
    """Empty tensors for a checkpoint's description (``meta``), by the shapes its metadata lists."""
    return {k: torch.zeros(shape, dtype=torch.int64 if len(shape) == 0 else torch.uint8) for k, shape in meta_keys.items()}


def load_target(owners: StateOwners, meta: Dict[str, Any], meta_keys: Dict[str, tuple], info: Dict[str, Any],
                pre: str = "optim.") -> Dict[str, Any]:
    """Empty tensors for ``dcp.load`` to fill, from a checkpoint's metadata ``meta``: the saved pieces that
    overlap this rank's, every scalar of the parameters it steps, the hyper-parameters, counters, loss scale
    and description (``pre``: where the optimizer's entries are nested)."""
    layout, rank, flat = owners.layout, owners.rank, owners.flat
    hyper = {k[len(pre + "hyper."):]: tuple(meta[k].size) for k in meta if k.startswith(pre + "hyper.")}
    if state_legacy.is_legacy(info):
        keys = {"state": [k[len(pre + "state."):] for k in meta if k.startswith(pre + "state.")],
                "scalars": [k[len(pre + "scalars."):] for k in meta if k.startswith(pre + "scalars.")],
                "hyper": hyper, "counters": len(Progress.SAVED), "meta": meta_keys}
        return state_legacy.dcp_target(layout, rank, owners.process_group, flat.master.device,
                                       flat.compute_dtype, flat.master.dtype, keys)

    def empty(k):
        md = meta[k]
        return torch.empty(tuple(md.size), dtype=md.properties.dtype)

    saved: Dict[int, list] = {}
    for k in meta:
        if k.startswith(pre + "master."):
            i, a = parse_piece_key(k[len(pre + "master."):])
            saved.setdefault(i, []).append((a, int(torch.Size(meta[k].size).numel())))
    out: Dict[str, Any] = {**empty_sections(),
                           "hyper": {k: torch.zeros(shape, dtype=torch.float64) for k, shape in hyper.items()},
                           "counters": torch.zeros(len(Progress.SAVED), dtype=torch.int64),
                           "meta": meta_template(meta_keys)}
    if pre + "loss_scale" in meta:
        out["loss_scale"] = torch.zeros((), dtype=torch.float64)
    out.update(state_residual.target(owners, meta, pre, info))
    out.update(outer_state.target(owners, meta, pre))
    for i, a in wanted(layout, rank, saved):
        key = f"{i}:{a}"
        for section in ("master", "params", "entries"):
            out[section][key] = empty(f"{pre}{section}.{key}")
        head = f"{pre}state.{key}."
        state = {k[len(head):]: empty(k) for k in meta if k.startswith(head)}
        if state:
            out["state"][key] = state
    for i in layout.stepped_by(rank):
        head = f"{pre}scalars.{i}."
        scalars = {k[len(head):]: empty(k) for k in meta if k.startswith(head)}
        if scalars:
            out["scalars"][str(i)] = scalars
    return out
