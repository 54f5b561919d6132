"""The error-feedback residuals of compressed rounds (``compression``) in a state dict.

A residual is one rank's own (what its commits' quantization has not yet sent), full size, so it is saved per
rank: ``residual`` in ``opt.state_dict()`` (the same rank loads it back), and ``residual/r{rank}`` in the DCP
form (``acco.checkpoint``), each rank writing and reading its own key. A resumed run on the same ranks goes on
bit-identically. On another number of ranks (resharding ``N -> M``) the ranks' chunks change owners, and no
rank's residual is another's: every rank starts from a zero residual (the few updates' worth of dropped bits
are lost, as after a fresh start) and the load says so in the log. A run without compression ignores saved
residuals; a compressed run given none starts from zero. What is refused, before anything changes: a residual
of another size than this run's, or holding inf/NaN (every later update would be skipped), and a DCP
checkpoint that lacks some of the residuals it was written with (its checksums list them all). Local: no
collective.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, Optional

import torch

from ..errors import CheckpointError

__all__ = ["SECTION", "check", "entries", "restore", "target"]

SECTION = "residual"
log = logging.getLogger("acco")


def _residual(owners: Any) -> Optional[torch.Tensor]:
    """This rank's residual, owned by the round's transport (None: its wire format keeps none)."""
    return owners.flat.transport.residual


def _expected(owners: Any, info: Dict[str, Any], device: Any = "meta") -> Optional[torch.Tensor]:
    """The residual a load of a state described by ``info`` fills: this run's, or, with ``compression="auto"``,
    one like the format the load takes (``AutoCompression.saved_kind``: the saving run's choice; on ``device``,
    ``"meta"`` for its shape alone), None for none."""
    auto = owners.auto
    if auto is None:
        return _residual(owners)
    if auto.saved_kind(info) == "none":
        return None
    return _residual(owners) if _residual(owners) is not None else auto.residual_like(device)


def entries(owners: Any, sharded: bool) -> Dict[str, Any]:
    """This rank's residual for its state dict (nothing without compression)."""
    residual = _residual(owners)
    if residual is None:
        return {}
    mine = residual.detach().clone()
    return {SECTION: {f"r{owners.rank}": mine} if sharded else mine}


def _ranks(keys, head: str) -> set:
    return {k[len(head):] for k in keys if k.startswith(head)}


def target(owners: Any, meta: Dict[str, Any], pre: str, info: Dict[str, Any]) -> Dict[str, Any]:
    """What a DCP load reads of the residuals: this rank's, where the checkpoint was saved on as many ranks.
    Raises :class:`CheckpointError` (on every rank alike: the metadata is the same) where some of the residuals
    the checkpoint's checksums list, one per rank that saved it, are not in it (a run without compression
    ignores them). ``info``: the checkpoint's description."""
    residual = _expected(owners, info, device=None)  # DCP reads into it
    saved = _ranks(meta, f"{pre}{SECTION}.r")
    listed = _ranks(meta, f"checksums.{pre.replace('.', '/')}{SECTION}/r")
    if residual is not None and listed and saved != listed:
        missing = sorted(int(r) for r in listed - saved)
        raise CheckpointError(
            f"acco.checkpoint.load(): the checkpoint lists the error-feedback residuals of ranks "
            f"{sorted(int(r) for r in listed)}, but those of rank(s) {missing} are not in it: it is damaged. "
            "Nothing was loaded; use another checkpoint (acco.checkpoint.latest(folder) picks the newest complete one)")
    if residual is None or not saved:
        return {}
    if len(saved) != owners.world_size or str(owners.rank) not in saved:
        log.info("acco: the checkpoint's error-feedback residuals were written by %d ranks, this run has %d: "
                 "every rank starts from a zero residual", len(saved), owners.world_size)
        return {}
    return {SECTION: {f"r{owners.rank}": torch.empty_like(residual)}}


def _mine(owners: Any, sd: Dict[str, Any]) -> Any:
    value = sd.get(SECTION)
    return value.get(f"r{owners.rank}") if isinstance(value, dict) else value


def check(owners: Any, sd: Dict[str, Any], info: Dict[str, Any]) -> None:
    """Refuse a saved residual this rank would take that is not one of this run's: another size, or holding
    inf/NaN (a skipped update keeps the residual, so every later update would be skipped). ``info``: the
    state's description. Local."""
    residual, value = _expected(owners, info), _mine(owners, sd)
    if residual is None or value is None:
        return
    where = f"AccoOptimizer.load_state_dict() on rank {owners.rank}"
    if not torch.is_tensor(value) or value.shape != residual.shape:
        got = tuple(value.shape) if torch.is_tensor(value) else type(value).__name__
        raise CheckpointError(
            f"{where}: the saved error-feedback residual has shape {got}, this run's has "
            f"{tuple(residual.shape)}: it is not this model's on these ranks (edited, or saved with another "
            "model). Nothing was loaded; use the checkpoint this run wrote")
    if not bool(torch.isfinite(value).all()):
        raise CheckpointError(
            f"{where}: the saved error-feedback residual holds inf or NaN: every update after the load would be "
            "skipped as non-finite. Nothing was loaded; use an earlier checkpoint")


def restore(owners: Any, sd: Dict[str, Any]) -> None:
    """This rank's residual from ``sd``, zero when it holds none for this rank (see the module docstring).
    ``compression="auto"`` has taken the saved format by now (``AutoCompression.loaded``)."""
    residual = _residual(owners)
    if residual is None:
        return
    value = _mine(owners, sd)
    if value is None:  # none saved for this rank (without compression, or on other ranks): from zero
        residual.zero_()
        return
    residual.copy_(value.to(residual.device, residual.dtype))
