"""Checkpoints: this rank's state dict (``torch.save`` on every rank), the sharded
form for torch.distributed.checkpoint (DCP, any world size), and a consolidated
per-parameter format for moving to and from a plain optimizer.

Both sharded forms hold the same entries, keyed by names and parameter
indices, never ``id(p)``::

    master    flat fp32 weights (all parameters end to end)     \\
    params    flat model weights (the compute copy, see below)   } this rank's slice
    state/K   flat optimizer state K (AdamW: exp_avg, ...)      /  (DCP: 1-D DTensors, Shard(0))
    scalars/K per-parameter scalar state (AdamW: step), one value per parameter
    hyper/G.K numeric hyper-parameter K of param group G (lr, betas, ...)
    counters  the saved progress (``progress.Progress.SAVED``, in that order)

and what they are: ``acco`` (``opt.state_dict()``: format, mode, wrapped
optimizer, layout, and the rank and world size whose slice it holds) or
``meta`` (DCP: the same less rank and world size, as tensors).
``load_state_dict`` refuses a state dict of another mode, optimizer class,
model, rank or world size, or a plain torch optimizer's, before changing
anything, and names the call to use instead.

In DCP every flat tensor has the same global length whatever the world size,
so DCP reshards a checkpoint saved on N ranks onto M ranks by itself. Nothing
is pickled: all entries are tensors, and loading executes no code.

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

from .checksums import CheckpointError, checksums, replicated_only, verify
from .shard_state import (
    FORMAT_VERSION,
    GATHERED,
    IMPLEMENTATION_FLAGS,
    check_compatible,
    check_loadable,
    consolidated_state_dict,
    decode_meta,
    describe,
    load_consolidated_state_dict,
    load_state_dict,
    meta_template,
    scalar_state,
    state_dict,
    template,
)

if TYPE_CHECKING:  # pragma: no cover
    from .optimizer import AccoOptimizer

__all__ = [
    "CheckpointError",
    "FORMAT_VERSION",
    "IMPLEMENTATION_FLAGS",
    "consolidated_state_dict",
    "describe",
    "gather",
    "latest",
    "load",
    "load_consolidated_state_dict",
    "load_state_dict",
    "resolve",
    "save",
    "scalar_state",
    "state_dict",
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
    _same_call(optimizer, "acco.checkpoint.gather()")
    group = optimizer.process_group
    own = _cpu_copy(state_dict(optimizer))  # waits for the in-flight commit, as state_dict() does
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
        optimizer._all_gather_row([0], call)


def _rank0(group) -> bool:
    return not dist.is_initialized() or dist.get_rank(group) == 0


def _barrier(group) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)


def save(path: str, optimizer: "AccoOptimizer", *, model: Optional[torch.nn.Module] = None,
         extra: Optional[Dict[str, torch.Tensor]] = None) -> None:
    """Write a checkpoint folder with DCP, each rank its own slice. Collective.

    Crash-safe: DCP writes ``PATH.tmp``; only once every rank has finished is
    it renamed to ``PATH`` (the previous checkpoint is moved aside first and
    deleted last), so a crash while saving leaves the previous checkpoint whole.
    ``extra``: tensors of your own (e.g. the data position), restored by :func:`load`.
    """
    import torch.distributed.checkpoint as dcp

    _same_call(optimizer, "acco.checkpoint.save()")
    group = optimizer.process_group
    sd: Dict[str, Any] = {"optim": state_dict(optimizer, sharded=True), "extra": dict(extra or {})}
    if model is not None:
        sd["model"] = model.state_dict()
    sd["checksums"] = replicated_only(optimizer, checksums(optimizer, sd))  # verified by load()
    tmp, old = f"{path}.tmp", f"{path}.old"
    if _rank0(group):
        shutil.rmtree(tmp, ignore_errors=True)
    _barrier(group)
    dcp.save(sd, checkpoint_id=tmp, process_group=group, no_dist=not dist.is_initialized())
    _barrier(group)  # every rank's slice is on disk
    if _rank0(group):
        with open(os.path.join(tmp, COMPLETE), "w") as f:  # written last: latest() takes only folders holding it
            f.write("every rank's slice written\n")
        if os.path.exists(path):
            shutil.rmtree(old, ignore_errors=True)
            os.rename(path, old)
        os.rename(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    _barrier(group)


COMPLETE = ".acco-complete"


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
            first = (str(inner).strip().splitlines() or [""])[0][:200]
            parts.append(f"rank {rank}: {type(inner).__name__}: {first}")
        return "; ".join(parts)
    first = (str(exc).strip().splitlines() or [""])[0][:300]
    return f"{type(exc).__name__}: {first}"


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
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

    _same_call(optimizer, "load_state_dict() / acco.checkpoint.load()")
    path = resolve(path)
    where = f"acco.checkpoint.load({path!r})"
    no_dist = not dist.is_initialized()

    def read(sd: Dict[str, Any]) -> None:
        try:
            dcp.load(sd, checkpoint_id=path, process_group=optimizer.process_group, no_dist=no_dist)
        except (Exception, CheckpointException) as exc:  # DCP's own errors say little of what to do
            raise CheckpointError(
                f"{where}: the checkpoint's files cannot be read: a file is missing, truncated or damaged "
                f"({_dcp_cause(exc)}). Nothing was loaded (the optimizer and the model are unchanged); use "
                "another checkpoint (acco.checkpoint.latest(folder) picks the newest complete one)."
            ) from exc

    try:
        meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    except Exception as exc:
        raise CheckpointError(f"{where}: its .metadata cannot be read ({type(exc).__name__}: {exc}). "
                              "Nothing was loaded.") from exc
    flat_keys = [k.split(".", 2)[2] for k in meta if k.startswith("optim.state.")]
    scalar_keys = [k.split(".", 2)[2] for k in meta if k.startswith("optim.scalars.")]
    hyper_keys = {k.split(".", 2)[2]: tuple(meta[k].size) for k in meta if k.startswith("optim.hyper.")}
    meta_keys = {k.split(".", 2)[2]: tuple(meta[k].size) for k in meta if k.startswith("optim.meta.")}
    sum_keys = [k.split(".", 1)[1] for k in meta if k.startswith("checksums.")]
    if not meta_keys:
        raise CheckpointError(f"{where}: no AccoOptimizer description (optim.meta) in it: not written by "
                              f"acco.checkpoint.save of this acco version (format {FORMAT_VERSION}). Nothing was loaded.")
    # What the checkpoint holds is checked before anything (the model included) is touched.
    head = {"optim": {"meta": meta_template(meta_keys)}}
    read(head)
    check_compatible(optimizer, decode_meta(head["optim"]["meta"]), rank_shard=False)
    sd: Dict[str, Any] = {
        "optim": template(optimizer, flat_keys, scalar_keys, hyper_keys, meta_keys),
        "extra": {k: v.clone() for k, v in (extra or {}).items()},
    }
    trained = {}  # the model's entries that are this optimizer's parameters: restored from its slices instead
    if model is not None:
        try:
            live = model.state_dict(keep_vars=True)
            mine = {id(p) for g in optimizer.param_groups for p in g["params"]}
            trained = {k: v for k, v in live.items() if id(v) in mine}
        except TypeError:  # a state_dict() override without keep_vars: every entry into a copy, as before
            live = model.state_dict()
        # The rest into copies (buffers, frozen parameters): the model changes only once everything is verified.
        sd["model"] = {k: torch.empty_like(v) for k, v in live.items() if k not in trained}
    sd["checksums"] = {k: torch.zeros((), dtype=torch.int64) for k in sum_keys}
    read(sd)
    expected = {k: v for k, v in sd.pop("checksums").items() if not (k.startswith("model/") and k[6:] in trained)}
    verify(optimizer, {k: v for k, v in sd.items()}, expected, where, subset=True)
    check_loadable(optimizer, sd["optim"], allow_new_microbatches=allow_new_microbatches)  # before the model changes
    if model is not None:
        # The trained parameters load from themselves here; load_state_dict below writes them from the
        # checkpoint's slices (all-gathered into the idle round buffer): no model-sized copy.
        model.load_state_dict({**sd["model"], **{k: v.detach() for k, v in trained.items()}})
    load_state_dict(optimizer, sd["optim"], checked=True)
    return sd["extra"]
