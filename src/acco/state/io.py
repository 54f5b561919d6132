"""Taking and restoring an optimizer's state: ``opt.state_dict()``, its DCP form, and ``opt.load_state_dict()``
with everything a load refuses (agreed on by every rank before any rank changes anything).

The entries are :mod:`acco.state.pieces`'s, their description :mod:`acco.state.format`'s; format 2 is read
through :mod:`acco.state.legacy`. The optimizer hands in the owners of its state (:class:`StateOwners`).
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from . import legacy as state_legacy
from . import outer_state
from . import residual as state_residual
from ..agreement import snapshot_hyperparams
from .checksums import checksums, verify
from ..errors import CheckpointError, RanksDisagreeError
from ..progress import Progress
from .format import (
    AccoStateDict,
    SHARD_FIX,
    ShardOfAnotherRankError,
    StateOwners,
    check_compatible,
    classify,
    decode_meta,
    describe_wire,
    encode_meta,
    hyper_entries,
    own_entry,
    restore_hyper,
    weights_codec,
)
from .pieces import Saved, entries, restore

__all__ = ["check_loadable", "load_state_dict", "require_boundary", "state_dict"]


def require_boundary(owners: StateOwners, what: str) -> None:
    failed = owners.driver.failed
    if failed is not None:
        raise RuntimeError(f"AccoOptimizer.{what}(): a previous round failed") from failed
    in_view = owners.session.in_view
    if what.startswith("load") and in_view:
        raise RuntimeError(f"AccoOptimizer.{what}() inside opt.committed_weights(): load after the block")
    if not owners.progress.at_boundary:
        pending = owners.progress.pending_microbatches()
        raise RuntimeError(
            f"AccoOptimizer.{what}() at a mid-update point: {pending} micro-batch(es) of an update are "
            "accumulated but not committed. Call it between a step() and the next backward() "
            "(when opt.at_update_boundary is True)."
        )


def _covered(body: Dict[str, Any], info: Dict[str, Any]) -> Dict[str, Any]:
    """What a per-rank state dict's checksums cover: its tensors and what it says it is (mode, optimizer, ...)."""
    return {"optim": body, "meta": encode_meta(info)}


def state_dict(owners: StateOwners, sharded: bool = False) -> Dict[str, Any]:
    """This rank's state (``sharded``: the form for DCP, without rank and checksums). Local: no collective."""
    require_boundary(owners, "state_dict")
    owners.driver.collect()  # the in-flight commit: its weights stay pending in the round buffer
    owners.driver.read_reports()  # CUDA path: the skip counter is final only once the device has run the rounds
    out: Dict[str, Any] = {**entries(owners), "hyper": hyper_entries(owners.param_groups),
                           "counters": owners.progress.to_tensor()}
    scale = owners.loss_scale.scale_to_save() if owners.loss_scale is not None else None
    if scale is not None:
        out["loss_scale"] = torch.tensor(scale, dtype=torch.float64)
    out.update(state_residual.entries(owners, sharded))  # compression: this rank's error feedback
    out.update(outer_state.entries(owners, sharded))  # outer_every: this rank's slice of the outer state
    described = {**owners.describe, **describe_wire(owners)}
    if sharded:
        out["meta"] = encode_meta(described)
    else:
        info = {**described, "rank": owners.rank, "world_size": owners.world_size}
        out["checksums"] = checksums(_covered(out, info))
        out["acco"] = info
    return AccoStateDict(out)


def _file_rank(sd: Any) -> int:
    """The rank whose ``opt.state_dict()`` this is (-1: not one rank's state dict, or unreadable)."""
    try:
        return int(sd["acco"]["rank"]) if "checksums" in sd else -1
    except Exception:
        return -1


def _agree(owners: StateOwners, error: Optional[BaseException], file_rank: int) -> None:
    """Raise on every rank if any rank refused its state dict, before any collective of the load
    (one rank loading while another refused would leave the ranks in different collectives), each naming what
    the refusing ranks were given when it is the common mix-up (one rank's file on every rank: then the rank
    whose own file it is says so too, whatever else it found wrong). Where a refusing rank found damage
    (:class:`CheckpointError`: each rank reads and verifies only its own pieces), every rank raises one, so a
    script that catches it on every rank and loads an earlier checkpoint finds every rank in that call.
    Collective."""
    code = 0 if error is None else 2 if isinstance(error, CheckpointError) else 1
    rows = owners.session.gather_row([code, file_rank], "load_state_dict() / acco.checkpoint.load()")
    refused = [r for r, row in enumerate(rows) if row[0]]
    files = {row[1] for row in rows}
    if refused and len(rows) > 1 and len(files) == 1 and min(files) >= 0:
        given = files.pop()
        if isinstance(error, ShardOfAnotherRankError):
            raise error  # this rank's own refusal says it already (another rank's shard, loaded here)
        mine = " (this rank's own file)" if given == owners.rank else ""
        raise ShardOfAnotherRankError(
            f"AccoOptimizer.load_state_dict() on rank {owners.rank}: every rank was given rank {given}'s shard"
            f"{mine}: every rank loaded one rank's file, and opt.state_dict() holds one rank's "
            f"1/{owners.world_size} of the optimizer. {SHARD_FIX}. Nothing was loaded on any rank.", given
        ) from error
    if error is not None:
        raise error
    damaged = [r for r, row in enumerate(rows) if row[0] == 2]
    if damaged:
        raise CheckpointError(
            f"AccoOptimizer.load_state_dict(): rank(s) {damaged} found what they read damaged or not this run's "
            "(their error says what). Nothing was loaded on any rank; use another checkpoint "
            "(acco.checkpoint.latest(folder) picks the newest complete one)")
    if refused:
        raise RanksDisagreeError(
            f"AccoOptimizer.load_state_dict(): rank(s) {refused} refused their state dict (their error says why); "
            "nothing was loaded on any rank"
        )


def _saved(owners: StateOwners, sd: Dict[str, Any], info: Dict[str, Any]) -> Saved:
    if state_legacy.is_legacy(info):
        return Saved(state_legacy.to_saved(owners.layout, owners.rank, sd))
    return Saved(sd)


def check_model_matches(owners: StateOwners, saved: Saved, counters: torch.Tensor, info: Dict[str, Any]) -> None:
    """Refuse a model that is not the one this optimizer state was saved with (a model and an optimizer from
    different checkpoints). Free to check: the model was saved with the committed weights, which are the fp32
    master's (in bf16 its rounding), or with the weights for the next micro-batch (``params``). Local."""
    swapped = owners.session.view_swapped
    pieces = owners.layout.pieces(owners.rank)
    diff, ok = 0.0, True
    rebuilt = _committed_reconstruction(owners, saved, pieces, _saved_codec(owners, info))
    for i, _ in owners.wrapped.held():
        pc = pieces[i]
        key = (i, pc.param_start)
        if key not in saved.master:
            continue
        model = owners.flat.model_piece(i, pc, swapped)
        master = saved.master[key].reshape(-1).to(model.device, model.dtype)
        params = saved.params[key].reshape(-1).to(model.device, model.dtype)
        committed = None if rebuilt is None else rebuilt[pc.local_start:pc.local_end]
        if not (torch.equal(model, master) or torch.equal(model, params)
                or (committed is not None and torch.equal(model, committed))):
            ok = False
            if model.numel():
                diff = max(diff, float((model.float() - master.float()).abs().max()))
    if ok:
        return
    updates = Progress.saved_field(counters, "num_updates")
    raise ValueError(
        f"AccoOptimizer.load_state_dict(): the model's weights are not the ones this optimizer state was saved "
        f"with (it holds {updates} committed update(s); largest difference from its committed weights on rank "
        f"{owners.rank}: {diff:.3g}). The model comes from another checkpoint or was not loaded, and resuming would "
        "mix two points of training. Load the model saved with this optimizer state first (saved inside "
        "opt.committed_weights(); acco.checkpoint.gather or acco.checkpoint.save(..., model=model) save both "
        "in one call), or, to take the model's weights from this optimizer state alone, call "
        "opt.load_state_dict(sd, restore_model=True). Nothing was loaded."
    )


def _saved_codec(owners: StateOwners, info: Dict[str, Any]) -> Optional[tuple]:
    """``(kind, block)`` the saved run's committed weights travelled in (``describe_weights``), None if exactly.
    A state written before its description said (``"weights"`` absent): this optimizer's own settings."""
    if "weights" in info:
        return weights_codec(info["weights"])
    return owners.flat.transport.weights_codec


def _committed_reconstruction(owners: StateOwners, saved: Saved, pieces, codec: Optional[tuple]) -> Optional[torch.Tensor]:
    """With compressed weights (``codec``: the saved run's kind and block), this rank's chunk of the committed
    weights the model held at the save when a commit had been collected: not the fp32 master but what the
    commit's all-gather rebuilt from it, the saved model weights plus the dequantized change
    (``compressed.reconstructed``; the load rebuilds the same). None without them, or for a state saved on
    another layout. Local."""
    if codec is None:
        return None
    flat = owners.flat
    master = torch.zeros(owners.layout.shard_size, dtype=flat.compute_dtype, device=flat.master.device)
    reference = torch.zeros_like(master)
    for i, _ in owners.wrapped.held():
        pc = pieces[i]
        key = (i, pc.param_start)
        if key not in saved.master or saved.master[key].numel() != pc.local_end - pc.local_start:
            return None
        master[pc.local_start:pc.local_end].copy_(saved.master[key].reshape(-1))
        reference[pc.local_start:pc.local_end].copy_(saved.params[key].reshape(-1))
    from ..compressed import reconstructed  # noqa: PLC0415 (the round's arithmetic, here for one chunk)

    return reconstructed(reference, master, *codec)


def _verify_rank_file(owners: StateOwners, sd: Dict[str, Any], info: Dict[str, Any], legacy: bool) -> None:
    """A per-rank state dict's checksums against its tensors and description; raises :class:`CheckpointError`."""
    if not isinstance(sd.get("checksums"), dict):
        raise CheckpointError("AccoOptimizer.load_state_dict(): the state dict has no checksums. Nothing was loaded.")
    body = {k: v for k, v in sd.items() if k not in ("acco", "checksums")}
    got = (state_legacy.checksums(_covered(body, info), owners.rank, owners.layout.shard_size) if legacy
           else checksums(_covered(body, info)))
    verify(got, sd["checksums"], "AccoOptimizer.load_state_dict()")


def check_loadable(owners: StateOwners, sd: Dict[str, Any], restore_model: bool = True,
                   allow_new_microbatches: bool = False, error: Optional[BaseException] = None) -> None:
    """Everything :func:`load_state_dict` refuses, checked on every rank and agreed on before any rank changes
    anything (a refusal on one rank raises on all; ``error``: what this rank already found wrong, e.g. damage in
    what it read, agreed on with the rest). Collective."""
    file_rank = _file_rank(sd)
    try:
        if error is not None:
            raise error
        sd = own_entry(sd, owners.rank, owners.world_size)
        kind = classify(sd)
        info = sd["acco"] if kind == "rank_shard" else decode_meta(sd["meta"])
        check_compatible(owners.describe, info, kind == "rank_shard", owners.rank, owners.world_size)
        legacy = state_legacy.is_legacy(info)
        if kind == "rank_shard":
            _verify_rank_file(owners, sd, info, legacy)
        elif legacy:
            listed, held = len(sd["state"]) + len(sd["scalars"]), info.get("state_entries")
            if held is not None and listed != held:
                raise ValueError(
                    f"AccoOptimizer.load_state_dict(): the checkpoint holds {held} optimizer-state entries, the "
                    f"state dict it was loaded into listed {listed}. Load with acco.checkpoint.load(path, opt), "
                    "which builds the complete target from the checkpoint. Nothing was loaded."
                )
        saved = _saved(owners, sd, info)
        saved.check_complete()
        try:
            Progress.check_saved(sd["counters"])
        except ValueError as exc:
            raise CheckpointError(f"AccoOptimizer.load_state_dict(): {exc}: written by another acco version. "
                                  "Nothing was loaded.") from None
        saved_m = Progress.saved_field(sd["counters"], "microbatches_per_update") or None
        mine_m = owners.progress.microbatches_per_update
        if saved_m is not None and mine_m not in (None, saved_m) and not allow_new_microbatches:
            raise ValueError(
                f"AccoOptimizer.load_state_dict(): the state dict was written with microbatches_per_update="
                f"{saved_m}, this optimizer has {mine_m}. To go on with {mine_m} (e.g. the same global batch on "
                "fewer ranks), pass allow_new_microbatches=True (opt.load_state_dict or acco.checkpoint.load); "
                f"otherwise build the optimizer with microbatches_per_update={saved_m}. Nothing was loaded."
            )
        in_force = mine_m if mine_m is not None else saved_m
        if in_force is not None:
            try:
                owners.check_microbatches(in_force)
            except ValueError as exc:
                raise ValueError(f"AccoOptimizer.load_state_dict(): {exc}. Nothing was loaded.") from None
        require_boundary(owners, "load_state_dict")
        state_residual.check(owners, sd, info)
        outer_state.check(owners, sd)
        if owners.auto is not None:
            owners.auto.saved_kind(info)  # a choice this acco knows
        if kind == "rank_shard" and not restore_model:
            check_model_matches(owners, saved, sd["counters"], info)
    except Exception as exc:  # whatever it is, every rank must hear of it before the load's collectives
        error = exc
    _agree(owners, error, file_rank)


def load_state_dict(owners: StateOwners, sd: Dict[str, Any], checked: bool = False, restore_model: bool = True,
                    allow_new_microbatches: bool = False) -> None:
    """Restore :func:`state_dict` output: this rank's own (same world size), or the sharded form through DCP
    (any world size: the pieces read need only cover this rank's). Refuses anything else before changing any
    state; with ``restore_model=False``, also a model that is not the one the state was saved with. Collective."""
    if not checked:
        check_loadable(owners, sd, restore_model, allow_new_microbatches)
    sd = own_entry(sd, owners.rank, owners.world_size)
    info = sd["acco"] if classify(sd) == "rank_shard" else decode_meta(sd["meta"])
    owners.driver.collect()
    restore(owners, _saved(owners, sd, info))
    flat = owners.flat
    if owners.progress.load_tensor(sd["counters"]):  # a commit collected at save time: in at the next hand-off
        from ..collectives import all_gather_flat
        from ..compressed import reconstructed

        codec = _saved_codec(owners, info)  # as the saved run's round sent it, whatever this optimizer's settings
        with torch.no_grad():
            chunk = flat.master.to(flat.compute_dtype)
            if codec is not None:  # each owner's change against the model's weights, just restored
                chunk = reconstructed(flat.model_chunk(), chunk, *codec)
            all_gather_flat(flat.comm_weights, chunk, owners.session.collective_group())
    flat.reset()
    restore_hyper(owners.param_groups, sd["hyper"])
    if owners.auto is not None:  # the saving run's format (compression="auto"), before its residual goes in
        owners.auto.loaded(info, owners.driver)
    state_residual.restore(owners, sd)
    outer_state.restore(owners, sd)  # after the master: a state without one starts the outer rounds from it
    owners.progress.take_hyper(snapshot_hyperparams(owners.param_groups))
    if owners.loss_scale is not None:
        owners.loss_scale.load(float(sd["loss_scale"]) if "loss_scale" in sd else None)
