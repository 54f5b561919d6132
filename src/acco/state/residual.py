"""The error-feedback residuals of compressed rounds (``compression``) in a state dict.

A residual is one rank's own (what its commits' quantization has not yet sent), full size, so it is saved per
rank: ``residual`` in ``opt.state_dict()`` (the same rank loads it back), and ``residual/r{rank}`` in the DCP
form (``acco.checkpoint``), each rank writing and reading its own key. A resumed run on the same ranks goes on
bit-identically. On another number of ranks (resharding ``N -> M``) the ranks' chunks change owners, and no
rank's residual is another's: every rank starts from a zero residual (the few updates' worth of dropped bits
are lost, as after a fresh start) and the load says so in the log. A run without compression ignores saved
residuals; a compressed run given none starts from zero. Local: no collective.
"""

from __future__ import annotations

import logging
from typing import Any, Dict

import torch

__all__ = ["SECTION", "entries", "restore", "target"]

SECTION = "residual"
log = logging.getLogger("acco")


def _packed(owners: Any) -> Any:
    return owners.flat.shard.packed


def entries(owners: Any, sharded: bool) -> Dict[str, Any]:
    """This rank's residual for its state dict (nothing without compression)."""
    packed = _packed(owners)
    if packed is None:
        return {}
    mine = packed.residual.detach().clone()
    return {SECTION: {f"r{owners.rank}": mine} if sharded else mine}


def target(owners: Any, meta: Dict[str, Any], pre: str) -> Dict[str, Any]:
    """What a DCP load reads of the residuals: this rank's, where the checkpoint was saved on as many ranks."""
    packed = _packed(owners)
    saved = [k for k in meta if k.startswith(f"{pre}{SECTION}.r")]
    if packed is None or not saved:
        return {}
    if len(saved) != owners.world_size or f"{pre}{SECTION}.r{owners.rank}" not in meta:
        log.info("acco: the checkpoint's error-feedback residuals were written by %d ranks, this run has %d: "
                 "every rank starts from a zero residual", len(saved), owners.world_size)
        return {}
    return {SECTION: {f"r{owners.rank}": torch.empty_like(packed.residual)}}


def restore(owners: Any, sd: Dict[str, Any]) -> None:
    """This rank's residual from ``sd``, zero when it holds none for this rank (see the module docstring)."""
    packed = _packed(owners)
    if packed is None:
        return
    value = sd.get(SECTION)
    if isinstance(value, dict):
        value = value.get(f"r{owners.rank}")
    if value is None or value.shape != packed.residual.shape:
        packed.residual.zero_()
        return
    packed.residual.copy_(value.to(packed.residual.device, packed.residual.dtype))
