"""The outer round's state (``outer_every``, ``outer.py``) in a state dict.

Each rank's outer state is its own slice: the anchor (the weights after the last outer round), the outer
momentum, with ``outer_compression`` the residual, and, while an outer round is in flight, the weights at its
launch and the bytes every region sent (the all-gather is waited for at the save, so nothing is in flight in
the saved state). It goes in ``opt.state_dict()`` under ``outer`` (this rank's file, covered by its checksums)
and in the DCP form (``acco.checkpoint``) under ``outer/r{rank}`` of its region's entries, and the same rank
loads it back: a resumed run goes on bit-identically, the in-flight round merged at the commit it was due.
A per-rank state saved without one (a run without ``outer_every``) loads into a run with one as a fresh start of
the outer rounds: the anchor is the loaded weights, the momentum and the residual zero (every region must load
the same weights). A run without ``outer_every`` ignores a saved outer state. Refused before anything changes: a
DCP checkpoint of another number of ranks per region (each rank's slice would be another's), an outer state of
other options or another size than this run's, or holding inf/NaN. Local: no collective (waiting for a round in
flight every region issued).
"""

from __future__ import annotations

import logging
from typing import Any, Dict

import torch

from ..errors import CheckpointError

__all__ = ["SECTION", "check", "entries", "restore", "target"]

SECTION = "outer"
log = logging.getLogger("acco")


def entries(owners: Any, sharded: bool = False) -> Dict[str, Any]:
    """This rank's outer state for its state dict (nothing without ``outer_every``); ``sharded`` (the DCP form):
    under this rank's key ``r{rank}``, as the ranks of a region each write their own."""
    outer = owners.driver.ctx.outer
    if outer is None:
        return {}
    mine = outer.state()
    return {SECTION: {f"r{owners.rank}": mine} if sharded else mine}


def _mine(owners: Any, sd: Dict[str, Any]) -> Any:
    """This rank's saved outer state: the per-rank form's section, or the DCP form's entry ``r{rank}``."""
    value = sd.get(SECTION)
    if isinstance(value, dict) and f"r{owners.rank}" in value:
        return value[f"r{owners.rank}"]
    return None if isinstance(value, dict) and any(k.startswith("r") and k[1:].isdigit() for k in value) else value


def target(owners: Any, meta: Dict[str, Any], pre: str) -> Dict[str, Any]:
    """What a DCP load reads of the outer state: this rank's; a checkpoint saved by another number of ranks per
    region is refused (:class:`CheckpointError`, on every rank alike)."""
    outer = owners.driver.ctx.outer
    head = f"{pre}{SECTION}.r"
    saved = {k[len(head):].split(".", 1)[0] for k in meta if k.startswith(head)}
    if outer is None or not saved:
        return {}
    if len(saved) != owners.world_size or str(owners.rank) not in saved:  # every rank sees the same metadata
        raise CheckpointError(
            f"acco.checkpoint.load(): the checkpoint's outer state (outer_every) was written by {len(saved)} ranks "
            f"per region, this run has {owners.world_size}: each rank's slice of it would be another's. Resume "
            "with as many ranks per region (the number of regions is the checkpoint's too). Nothing was loaded")
    mine = f"{head}{owners.rank}."
    out = {k[len(mine):]: torch.empty(tuple(meta[k].size), dtype=meta[k].properties.dtype) for k in meta
           if k.startswith(mine)}
    return {SECTION: {f"r{owners.rank}": out}}


def check(owners: Any, sd: Dict[str, Any]) -> None:
    """Refuse a saved outer state this rank would take that is not one of this run's: other entries (other outer
    options), a tensor of another size or kind, or one holding inf/NaN. Local."""
    outer, saved = owners.driver.ctx.outer, _mine(owners, sd)
    if outer is None or saved is None:
        return
    where = f"AccoOptimizer.load_state_dict() on rank {owners.rank}"
    counters = saved.get("counters") if isinstance(saved, dict) else None
    if not torch.is_tensor(counters) or counters.numel() != 2:
        raise CheckpointError(f"{where}: the saved outer state has no counters (commits, the merge due): it is "
                              "damaged. Nothing was loaded; use another checkpoint")
    in_flight = int(counters[1]) >= 0
    if in_flight and not outer.delay:
        raise CheckpointError(f"{where}: the state was saved with an outer round in flight (outer_delay > 0), this "
                              "run has outer_delay=0 and cannot merge it. Nothing was loaded; build the optimizer "
                              "with the saving run's outer_delay")
    expected = outer.layout_of_state(in_flight=in_flight)
    if set(saved) != set(expected) | {"counters"}:
        raise CheckpointError(f"{where}: the saved outer state holds {sorted(saved)}, this run's would hold "
                              f"{sorted(expected) + ['counters']}: it was saved with other outer options "
                              "(outer_compression, outer_momentum). Nothing was loaded; build the optimizer with the "
                              "saving run's outer options")
    for key, (shape, dtype) in expected.items():
        value = saved[key]
        if not torch.is_tensor(value) or tuple(value.shape) != shape or value.dtype != dtype:
            got = (tuple(value.shape), value.dtype) if torch.is_tensor(value) else type(value).__name__
            raise CheckpointError(f"{where}: the saved outer state's {key} is {got}, this run's {(shape, dtype)}: it "
                                  "is not this model's on these ranks. Nothing was loaded; use the checkpoint this run "
                                  "wrote")
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            raise CheckpointError(f"{where}: the saved outer state's {key} holds inf or NaN. Nothing was loaded; use "
                                  "an earlier checkpoint")


def restore(owners: Any, sd: Dict[str, Any]) -> None:
    """This rank's outer state from ``sd``; without one, the outer rounds start afresh from the loaded weights
    (the master slice, restored by now) at the loaded update count."""
    outer = owners.driver.ctx.outer
    if outer is None:
        return
    saved = _mine(owners, sd)
    if saved is None:
        log.info("acco: the state holds no outer state (saved without outer_every): the outer rounds start from "
                 "the loaded weights")
        outer.start_from(owners.flat.shard.master, owners.progress.num_updates)
        return
    outer.load(saved)
