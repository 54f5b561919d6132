"""Checkpoints: this rank's state dict (``torch.save`` on every rank), the same for
torch.distributed.checkpoint (DCP, any world size at load), one file written by one
rank (:func:`gather`), and a consolidated format for moving to and from a plain
optimizer.

What a state dict holds is :mod:`acco.state.format` (format 3: per parameter,
each rank's pieces keyed by parameter index and first element, never
``id(p)``). ``load_state_dict`` refuses a state dict of another mode, optimizer
class, model, rank or world size, or a plain torch optimizer's, before changing
anything, and names the call to use instead. Checkpoints of format 2 (acco
before per-parameter state) still load and resume exactly.

In DCP each rank writes its own pieces; at load, each rank reads the saved
pieces that overlap its own, so a checkpoint saved on N ranks loads on M.
Nothing is pickled: all entries are tensors, and loading executes no code.

*When* a checkpoint may be taken: at an update boundary (``opt.at_update_boundary``),
i.e. between a ``step()`` and the next ``backward()``. The in-flight commit is waited for and saved; nothing is
accumulated but uncommitted, so resuming neither loses nor double-counts a
micro-batch. ``params`` holds the weights the model needs for the next
micro-batch (in mode acco the estimate theta~), so a resumed run continues
exactly where the uninterrupted one would.
"""

from __future__ import annotations

import os
import shutil
from typing import TYPE_CHECKING, Any, Dict, Optional

import torch
import torch.distributed as dist

from .state import legacy as state_legacy
from .agreement import first_line
from .outer import refuse_checkpoint
from .state.checksums import CheckpointError, checksums, replicated_only, verify
from .state.format import (FORMAT_VERSION, GATHERED, IMPLEMENTATION_FLAGS, PER_RANK_SECTIONS, check_compatible,
                           decode_meta)
from .state import io as state_io
from .state.io import check_loadable, load_state_dict
from .state.pieces import scalar_state
from .state.target import load_target, meta_template

if TYPE_CHECKING:  # pragma: no cover
    from .optimizer import AccoOptimizer

__all__ = [
    "CheckpointError",
    "FORMAT_VERSION",
    "IMPLEMENTATION_FLAGS",
    "entry_name",
    "gather",
    "latest",
    "load",
    "read_target",
    "resolve",
    "save",
    "scalar_state",
]


# ------------------------------------------------------- one file (torch.save)


def _cpu_copy(tree: Any) -> Any:
    if torch.is_tensor(tree):
        return tree.detach().to("cpu", copy=True)
    if isinstance(tree, dict):
        return {k: _cpu_copy(v) for k, v in tree.items()}
    return tree


def gather(optimizer: "AccoOptimizer", *, model: Optional[torch.nn.Module] = None, dst: int = 0
           ) -> Optional[Dict[str, Any]]:
    """Both halves of a ``torch.save`` checkpoint, on one rank: ``{"model": ..., "optimizer": ...}``. Collective.

    For loops where one process writes the checkpoint file (nanoGPT's ``master_process``)::

        state = acco.checkpoint.gather(optimizer, model=raw_model)    # every rank, at the same update
        if master_process:
            torch.save({"model": state["model"], "optimizer": state["optimizer"], ...}, "ckpt.pt")
        ...
        model.load_state_dict(ckpt["model"])          # on resume, every rank reads the same file
        optimizer.load_state_dict(ckpt["optimizer"])  # each rank takes its own shard (same world size)

    ``"model"`` is ``model.state_dict()`` with the committed weights (what ``committed_weights()`` shows),
    ``"optimizer"`` every rank's :meth:`AccoOptimizer.state_dict` in rank order, so resuming is exact, as
    with one file per rank. Model and optimizer come from one call at one update, so they cannot be saved
    under different conditions. Everything is a CPU copy (loadable with ``weights_only=True``); the
    group's rank ``dst`` gets the dict (it holds every rank's slice: the whole optimizer state), the
    others ``None``. Call it at an update boundary, on every rank; for another world size at load, use
    :func:`save`/:func:`load` (DCP) instead.
    """
    refuse_checkpoint(optimizer.runtime.driver.ctx.outer, "acco.checkpoint.gather()")
    _same_call(optimizer, "acco.checkpoint.gather()")
    group = optimizer.process_group
    own = _cpu_copy(optimizer.state_dict())  # waits for the in-flight commit
    if group is None:
        entries: Optional[list] = [own]
        rank = 0
    else:
        rank = dist.get_rank(group)
        entries = [None] * dist.get_world_size(group) if rank == dst else None
        # gather_object: this rank's state dict (pickled, CPU tensors) to the group's rank dst.
        dist.gather_object(own, entries, dst=dist.get_global_rank(group, dst), group=group)
    if rank != dst:
        return None
    out: Dict[str, Any] = {"optimizer": {GATHERED: entries}}
    if model is not None:
        with optimizer.committed_weights():
            out["model"] = _cpu_copy(model.state_dict())
    return out


# ------------------------------------------------------------- files (DCP)


def _same_call(optimizer: "AccoOptimizer", call: str) -> None:
    """Before a checkpoint call's first collective: every rank is in this call (else all raise, naming the calls)."""
    if dist.is_initialized():
        optimizer.runtime.owners.session.gather_row([0], call)


def _rank0(group) -> bool:
    return not dist.is_initialized() or dist.get_rank(group) == 0


def _barrier(group, path: str) -> None:
    """Every rank at this point of ``save(path)``. Collective: a peer that died during the save makes gloo's
    barrier fail; the error then says so with acco's context (the checkpoint being written is never used)."""
    if not dist.is_initialized():
        return
    try:
        dist.barrier(group=group)
    except RuntimeError as exc:
        raise RuntimeError(
            f"acco.checkpoint.save({path!r}): waiting for the other ranks failed ({first_line(exc)}). A peer died or left "
            "during the save: this checkpoint is incomplete and acco.checkpoint.latest() never picks it; the "
            "previous complete one is intact. Restart from it."
        ) from exc


def save(path: str, optimizer: "AccoOptimizer", *, model: Optional[torch.nn.Module] = None,
         extra: Optional[Dict[str, torch.Tensor]] = None) -> None:
    """Write a checkpoint folder with DCP, each rank its own slice. Collective.

    Crash-safe: DCP writes ``PATH.tmp``; only once every rank has finished is
    it renamed to ``PATH`` (the previous checkpoint is moved aside first and
    deleted last), so a crash while saving leaves the previous checkpoint whole.
    ``extra``: tensors of your own (e.g. the data position), restored by :func:`load`. Give every rank the same
    values (gather per-rank ones, broadcast a rank's clock): DCP keeps one rank's copy of each, and a warning names
    those that differ.
    """
    import torch.distributed.checkpoint as dcp

    _same_call(optimizer, "acco.checkpoint.save()")
    group, shard, region = _place(optimizer)
    optim = state_io.state_dict(optimizer.runtime.owners, sharded=True)
    sd: Dict[str, Any] = {"optim": {shard: optim} if shard else optim, "extra": dict(extra or {})}
    if model is not None:
        sd["model"] = _nest_model(model.state_dict(), region)
    sums = checksums(sd)  # verified by load()
    # Each rank's pieces (with DTensor parameters: its model shard's entries) are entries of its own; the rest
    # every rank holds alike (kept where they agree).
    mine = (f"optim/{shard}/", *((f"model/{region}/",) if region else ())) if shard else _PIECES
    own = {k: v for k, v in sums.items() if k.startswith(mine)}
    common = replicated_only({k: v for k, v in sums.items() if k not in own}, group if dist.is_initialized() else None,
                             optimizer.device)
    sd["checksums"] = {**own, **common}
    tmp, old = f"{path}.tmp", f"{path}.old"
    if _rank0(group):
        shutil.rmtree(tmp, ignore_errors=True)
    _barrier(group, path)
    dcp.save(sd, checkpoint_id=tmp, process_group=group, no_dist=not dist.is_initialized())
    _barrier(group, path)  # every rank's slice is on disk
    if _rank0(group):
        with open(os.path.join(tmp, COMPLETE), "w") as f:  # written last: latest() takes only folders holding it
            f.write("every rank's slice written\n")
        if os.path.exists(path):
            shutil.rmtree(old, ignore_errors=True)
            os.rename(path, old)
        os.rename(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    _barrier(group, path)


def _place(optimizer: "AccoOptimizer") -> tuple:
    """The group that writes and reads a checkpoint, the name its optimizer entries are nested under, and the
    name its model entries are: the optimizer's group and none; with DTensor parameters, every rank of the mesh
    (the default group) and this rank's model shard (``"shard1"``), as ranks of different shards hold different
    tensors under the same piece keys; with ``outer_every``, every rank of every region (the default group) and
    this rank's region (``"region1"``, the model's too: regions hold different weights), with DTensor parameters
    inside a region ``"region1-shard0"`` for the optimizer's entries (DCP lays a region's DTensors out itself)."""
    outer, shards = optimizer.runtime.driver.ctx.outer, optimizer.runtime.shards
    if outer is not None:  # every region writes one folder: its entries under its name (regions differ)
        region, inside = f"region{outer.region}", shards.shard_name()
        per_region = optimizer.world_size * (len(shards.model_ranks) if inside else 1)
        return outer.checkpoint_group(per_region), f"{region}-{inside}" if inside else region, region
    return shards.checkpoint_group(optimizer.process_group), shards.shard_name(), None


def entry_name(optimizer: "AccoOptimizer") -> Optional[str]:
    """The name this rank's optimizer entries are nested under in a DCP checkpoint (``"shard1"``,
    ``"region0"``, ``"region0-shard1"``; None: not nested), for a tool that writes its own (torchtitan's)."""
    return _place(optimizer)[1]


def _no_optimizer_here(where: str, meta: Dict[str, Any], shard: Optional[str]) -> CheckpointError:
    """No optimizer description for this rank in the checkpoint: say whether it was written without a mesh,
    with other model shards, or not by acco."""
    plain = any(k.startswith("optim.meta.") for k in meta)
    regions = sorted({k.split(".")[1] for k in meta if k.startswith("optim.region") and k.split(".")[2:3] == ["meta"]})
    shards = sorted({k.split(".")[1] for k in meta if k.startswith("optim.shard") and k.split(".")[2:3] == ["meta"]})
    here_regions = bool(shard and shard.startswith("region"))
    if regions or ((plain or shards) and here_regions):
        here = f"this rank is in {shard}" if here_regions else "this run has no outer_every"
        saved = f"with outer_every, by regions {regions}" if regions else "without outer_every"
        return CheckpointError(
            f"{where}: written {saved}; {here}. Resume with the same regions and outer_every (a per-rank "
            "opt.state_dict() saved without outer_every loads into a run with it). Nothing was loaded.")
    if shard and plain:
        return CheckpointError(
            f"{where}: written by a run without DTensor parameters, loaded into one with them ({shard}). "
            "Resume such a checkpoint without FSDP2/tensor parallelism, or start the mesh run from the model's "
            "weights alone (load them into the model before parallelizing it) with a fresh optimizer. "
            "Nothing was loaded.")
    if shards:
        here = f"this rank is {shard}" if shard else "this run has no DTensor parameters"
        return CheckpointError(
            f"{where}: written with DTensor parameters in model shards {shards}; {here}. Resume with the same "
            "intra-host parallelism (the same FSDP2/tensor-parallel plan on a mesh of the same shape; the number "
            "of hosts may change). Nothing was loaded.")
    return CheckpointError(f"{where}: no AccoOptimizer description (optim.meta) in it: not written by "
                           f"acco.checkpoint.save (format {FORMAT_VERSION} or 2). Nothing was loaded.")


COMPLETE = ".acco-complete"
_PIECES = tuple(f"optim/{k}/" for k in PER_RANK_SECTIONS)  # each rank's own entries


def latest(root: str) -> Optional[str]:
    """The newest complete checkpoint folder directly under ``root`` (by name: use zero-padded update numbers,
    e.g. ``root/update_0000100``), or ``None``. Complete: :func:`save` wrote its marker after every rank's slice,
    and renamed it into place; a save cut off leaves only ``*.tmp`` / ``*.old`` folders, which are skipped."""
    if not os.path.isdir(root):
        return None
    done = sorted(d for d in os.listdir(root)
                  if not d.endswith((".tmp", ".old")) and os.path.exists(os.path.join(root, d, COMPLETE)))
    return os.path.join(root, done[-1]) if done else None


def _dcp_cause(exc: BaseException) -> str:
    """The first line of what each rank's DCP failure says, without DCP's tracebacks (they are in the cause)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        parts = []
        for rank, failure in sorted(failures.items()):
            inner = failure[0] if isinstance(failure, tuple) else failure
            parts.append(f"rank {rank}: {type(inner).__name__}: {first_line(inner, 200)}")
        return "; ".join(parts)
    return f"{type(exc).__name__}: {first_line(exc)}"


def resolve(path: str) -> str:
    """The checkpoint to read: ``PATH``, or ``PATH.old`` if a save was cut off between its renames."""
    if os.path.exists(os.path.join(path, ".metadata")):
        return path
    old = f"{path}.old"
    if os.path.exists(os.path.join(old, ".metadata")):
        return old
    raise FileNotFoundError(f"no checkpoint at {path!r} (no .metadata file there or in {old!r})")


def load(path: str, optimizer: "AccoOptimizer", *, model: Optional[torch.nn.Module] = None,
         extra: Optional[Dict[str, torch.Tensor]] = None, allow_new_microbatches: bool = False
         ) -> Dict[str, torch.Tensor]:
    """Read a checkpoint written by :func:`save` on any number of ranks. Collective.

    ``extra`` gives the names (and shapes) of your own tensors to read back;
    they are returned. Loading executes no code: every entry is a tensor.
    ``allow_new_microbatches``: accept a checkpoint saved with another ``microbatches_per_update`` and go on
    with the optimizer's (e.g. twice the micro-batches on half the ranks: the same global batch).
    """
    _same_call(optimizer, "load_state_dict() / acco.checkpoint.load()")
    path = resolve(path)
    where = f"acco.checkpoint.load({path!r})"
    no_dist = not dist.is_initialized()
    group, shard, region = _place(optimizer)

    def nest(optim: Any) -> Any:
        return {shard: optim} if shard else optim

    def unnest(tree: Dict[str, Any]) -> Any:
        return tree["optim"][shard] if shard else tree["optim"]

    read = _reader(path, group, no_dist, where)
    # What the checkpoint holds is checked before anything (the model included) is touched.
    target, info, meta = _described_target(path, optimizer, ("optim", shard) if shard else ("optim",), read, where,
                                           lambda meta: _no_optimizer_here(where, meta, shard))
    owners = optimizer.runtime.owners
    sd: Dict[str, Any] = {
        "optim": nest(target),
        "extra": {k: v.clone() for k, v in (extra or {}).items()},
    }
    trained = {}  # the model's entries that are this optimizer's parameters: restored from its slices instead
    if model is not None:
        trained, entries = _model_entries(model, optimizer)
        sd["model"] = _nest_model(entries, region)
    sd["checksums"] = {k.split(".", 1)[1]: torch.zeros((), dtype=torch.int64) for k in meta
                       if k.startswith("checksums.")}
    read(sd)
    try:
        _verify_read(sd, trained, info, owners, where)
        damage = None
    except Exception as exc:  # a damaged entry shows on the ranks that read it only: agreed on with the checks
        damage = exc
    optim = unnest(sd)
    check_loadable(owners, optim, allow_new_microbatches=allow_new_microbatches, error=damage)  # before the model changes
    if model is not None:
        # The trained parameters load from themselves here; load_state_dict below writes them from the
        # checkpoint's pieces (all-gathered into the idle round buffer): no model-sized copy.
        read_model = sd["model"][region] if region else sd["model"]
        model.load_state_dict({**read_model, **{k: v.detach() for k, v in trained.items()}})
    load_state_dict(owners, optim, checked=True)
    return sd["extra"]


def read_target(path: str, optimizer: "AccoOptimizer", nest: tuple) -> Dict[str, Any]:
    """What ``dcp.load`` must fill to restore ``optimizer`` from a DCP checkpoint another tool wrote (torchtitan's
    checkpointer), its entries nested under the keys ``nest`` (``("optimizer", "acco", "shard1")``): the saved
    pieces that overlap this rank's, with the wrapped optimizer's state that a fresh optimizer's state dict does
    not list yet. Reads the entries' description, checked against this optimizer. Collective."""
    where = f"acco.checkpoint.read_target({path!r})"
    group = _place(optimizer)[0]
    return _described_target(path, optimizer, nest, _reader(path, group, not dist.is_initialized(), where), where,
                             lambda meta: CheckpointError(f"{where}: no AccoOptimizer description under "
                                                          f"{'.'.join(nest)}.meta in it. Nothing was loaded."))[0]


def _described_target(path: str, optimizer: "AccoOptimizer", nest: tuple, read: Any, where: str,
                      missing: Any) -> tuple:
    """``(target, info, metadata)``: the checkpoint's metadata, the optimizer's description nested under ``nest``
    (read, then checked against ``optimizer``: ``missing(metadata)`` is raised where there is none), and the
    empty tensors ``dcp.load`` fills to restore it (``load_target``). Collective (``read``)."""
    import torch.distributed.checkpoint as dcp

    pre = ".".join(nest) + "."
    try:
        meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    except Exception as exc:
        raise CheckpointError(f"{where}: its .metadata cannot be read ({type(exc).__name__}: {exc}). "
                              "Nothing was loaded.") from exc
    meta_keys = {k[len(pre) + 5:]: tuple(meta[k].size) for k in meta if k.startswith(pre + "meta.")}
    if not meta_keys:
        raise missing(meta)
    head: Dict[str, Any] = {"meta": meta_template(meta_keys)}
    tree = head
    for key in reversed(nest):
        tree = {key: tree}
    read(tree)
    owners = optimizer.runtime.owners
    info = decode_meta(head["meta"])
    check_compatible(owners.describe, info, False, owners.rank, owners.world_size)
    return load_target(owners, meta, meta_keys, info, pre), info, meta


def _reader(path: str, group: Any, no_dist: bool, where: str) -> Any:
    """``read(sd)``: ``dcp.load`` of ``sd`` from ``path``, its failures as :class:`CheckpointError`. Collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

    def read(sd: Dict[str, Any]) -> None:
        try:
            dcp.load(sd, checkpoint_id=path, process_group=group, no_dist=no_dist)
        except (Exception, CheckpointException) as exc:  # DCP's own errors say little of what to do
            raise CheckpointError(
                f"{where}: the checkpoint's files cannot be read: a file is missing, truncated or damaged "
                f"({_dcp_cause(exc)}). Nothing was loaded (the optimizer and the model are unchanged); use "
                "another checkpoint (acco.checkpoint.latest(folder) picks the newest complete one)."
            ) from exc

    return read


def _nest_model(entries: Dict[str, Any], region: Optional[str]) -> Dict[str, Any]:
    """The model's entries as a checkpoint holds them: under the region's name with ``outer_every`` (regions hold
    different weights), else as they are."""
    return {region: entries} if region else entries


def _model_entries(model: torch.nn.Module, optimizer: "AccoOptimizer") -> tuple:
    """The model's entries that are this optimizer's parameters (restored from its slices, not read), and
    copies for the rest (buffers, frozen parameters) to read into: the model changes only once everything is
    verified."""
    trained = {}
    try:
        live = model.state_dict(keep_vars=True)
        mine = {id(p) for g in optimizer.param_groups for p in g["params"]}
        trained = {k: v for k, v in live.items() if id(v) in mine}
    except TypeError:  # a state_dict() override without keep_vars: every entry into a copy, as before
        live = model.state_dict()
    return trained, {k: torch.empty_like(v) for k, v in live.items() if k not in trained}


def _verify_read(sd: Dict[str, Any], trained: Dict[str, Any], info: Dict[str, Any], owners: Any, where: str) -> None:
    """The checksums of what was read against those saved (less the trained parameters' model entries, not
    read: they come from the optimizer's pieces); raises :class:`CheckpointError`. Format 2: collective."""
    # a model entry's key: "model/NAME", or with outer_every "model/REGION/NAME"
    expected = {k: v for k, v in sd.pop("checksums").items()
                if not (k.startswith("model/") and k[6:].split("/", 1)[-1] in trained)}
    if state_legacy.is_legacy(info):  # format 2: a flat entry's checksum is the sum of its slices' over ranks
        got = state_legacy.dcp_checksums(sd, owners.rank, owners.layout.shard_size, owners.process_group,
                                         owners.flat.master.device)
    else:
        got = checksums(sd)
    verify(got, expected, where, subset=True)
