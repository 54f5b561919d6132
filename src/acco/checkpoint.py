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
    counters  see _COUNTERS

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

import hashlib
import logging
import os
import shutil
from typing import TYPE_CHECKING, Any, Dict, List, Optional

import torch
import torch.distributed as dist

from .collectives import all_gather_flat
from .rounds import RoundKind

log = logging.getLogger("acco")

if TYPE_CHECKING:  # pragma: no cover
    from .optimizer import AccoOptimizer

__all__ = [
    "consolidated_state_dict",
    "load",
    "load_consolidated_state_dict",
    "load_state_dict",
    "save",
    "state_dict",
]


# --------------------------------------------------------------------- helpers


def _flat(opt: "AccoOptimizer", local: torch.Tensor):
    """Wrap this rank's slice as the 1-D global tensor (a DTensor when there is a group)."""
    if opt._group is None:
        return local
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = DeviceMesh.from_group(opt._group, local.device.type)
    n = opt.layout.numel
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size([n]), stride=(1,))


def _local(t) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _state_keys(opt: "AccoOptimizer"):
    """Per-element (same size as the piece) and scalar state keys of the wrapped optimizer."""
    flat_keys, scalar_keys = [], []
    for p in opt._pieces:
        for key, value in opt.local_optimizer.state.get(p, {}).items():
            if torch.is_tensor(value) and value.dim() >= 1:
                if key not in flat_keys:
                    flat_keys.append(key)
            elif torch.is_tensor(value) or isinstance(value, (int, float)):
                if key not in scalar_keys:
                    scalar_keys.append(key)
            else:
                raise TypeError(f"cannot checkpoint optimizer state {key!r} of type {type(value).__name__}")
    return flat_keys, scalar_keys


# Param-group keys that choose how the wrapped optimizer computes, not what: neither saved nor restored, so a
# checkpoint taken on a GPU (capturable=True there, see _validation.device_resident_state) resumes on a CPU.
IMPLEMENTATION_FLAGS = frozenset({"foreach", "fused", "capturable", "differentiable"})


def _numeric_hyper(value: Any) -> Optional[torch.Tensor]:
    if isinstance(value, bool) or value is None:
        return None if value is None else torch.tensor(float(value), dtype=torch.float64)
    if isinstance(value, (int, float)):
        return torch.tensor(float(value), dtype=torch.float64)
    if torch.is_tensor(value) and value.numel() == 1:
        return value.detach().to("cpu", torch.float64).reshape(())
    if isinstance(value, (tuple, list)) and value and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        return torch.tensor([float(v) for v in value], dtype=torch.float64)
    return None


def _restore_hyper(current: Any, saved: torch.Tensor) -> Any:
    if isinstance(current, bool):
        return bool(saved.item())
    if isinstance(current, int):
        return int(saved.item())
    if isinstance(current, float):
        return float(saved.item())
    if torch.is_tensor(current):
        return saved.to(current.device, current.dtype).reshape(current.shape)
    if isinstance(current, (tuple, list)):
        return type(current)(saved.tolist())
    return current


def _require_boundary(opt: "AccoOptimizer", what: str) -> None:
    if opt._failed is not None:
        raise RuntimeError(f"AccoOptimizer.{what}(): a previous round failed") from opt._failed
    if what.startswith("load") and opt._in_committed_view:
        raise RuntimeError(f"AccoOptimizer.{what}() inside opt.committed_weights(): load after the block")
    if not opt.at_update_boundary:
        pending = opt._mb_in_update or opt._in_accum
        raise RuntimeError(
            f"AccoOptimizer.{what}() at a mid-update point: {pending} micro-batch(es) of an update are "
            "accumulated but not committed. Call it between a step() and the next backward() "
            "(when opt.at_update_boundary is True)."
        )


def _param_slice(opt: "AccoOptimizer") -> torch.Tensor:
    """This rank's slice of the model's own weights (those for the next micro-batch), flattened end to end.
    Inside ``opt.committed_weights()`` they wait in the comm buffer."""
    pieces = opt.layout.pieces(opt.rank)
    source = opt._comm_views if opt._view_swapped else opt._params
    return torch.cat([p.detach().reshape(-1)[pc.param_start : pc.param_end] for p, pc in zip(source, pieces)])


def _local_state(opt: "AccoOptimizer", key: str) -> torch.Tensor:
    """This rank's slice of element-wise optimizer state ``key``, flattened end to end."""
    state = opt.local_optimizer.state
    return torch.cat([state[p][key].reshape(-1) for p in opt._pieces])


def _gather_full(opt: "AccoOptimizer", local: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """All ranks' slices end to end (length numel), into ``out`` (padded length) if given, else a new tensor.
    Collective on the rounds' group (the user's after finish())."""
    s = opt.layout.shard_size
    padded = torch.zeros(s, dtype=local.dtype, device=local.device)
    padded[: local.numel()] = local
    full = out if out is not None else torch.empty(opt.layout.padded_numel, dtype=local.dtype, device=local.device)
    all_gather_flat(full, padded, opt._round_group if opt._round_group is not None else opt._group)
    return full[: opt.layout.numel]


# ------------------------------------------------------------ checksums

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
    if sharded and opt._group is not None and dist.is_initialized():
        parts = torch.stack([out[k] for k in sharded]).to(opt._params[0].device)
        dist.all_reduce(parts, group=opt._group)  # the sum of the slices' checksums: the whole tensor's
        for k, v in zip(sharded, parts.cpu()):
            out[k] = v
    return out


def _replicated_only(opt: "AccoOptimizer", sums: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Drop the checksums of entries that differ across ranks (DCP keeps one rank's copy of a plain entry,
    so no single checksum would fit; e.g. BatchNorm statistics without ``buffers=``). Collective."""
    if opt._group is None or not dist.is_initialized():
        return sums
    keys = sorted(sums)
    mine = torch.stack([sums[k] for k in keys]).to(opt._params[0].device)
    everyone = [torch.empty_like(mine) for _ in range(opt.world_size)]
    dist.all_gather(everyone, mine, group=opt._group)
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


# ------------------------------------------------------------ what a state dict holds

FORMAT_VERSION = 2
_COUNTERS = ("num_rounds", "num_updates", "num_skipped_updates", "committed_microbatches", "pending_commit",
             "commits_handed_off", "holds_estimate", "microbatches_per_update")


def describe(opt: "AccoOptimizer") -> Dict[str, Any]:
    """What a state dict of ``opt`` holds, independent of the world size: format, mode, wrapped optimizer, layout."""
    cls = opt.optimizer_class
    digest = hashlib.sha256(repr(opt.layout.shapes).encode()).hexdigest()[:16]
    return {"format": FORMAT_VERSION, "mode": opt.mode, "optimizer": f"{cls.__module__}.{cls.__qualname__}",
            "layout": f"{opt.layout.numel} elements in {len(opt.layout.shapes)} tensors, shapes {digest}",
            "dtypes": f"compute {opt.compute_dtype}, master {opt._buffers.master.dtype}"}


def _encode(meta: Dict[str, Any]) -> Dict[str, torch.Tensor]:
    """Strings and ints as tensors (DCP stores tensors only; nothing is pickled)."""
    return {k: torch.tensor(v, dtype=torch.int64) if isinstance(v, int) else torch.tensor(list(str(v).encode()), dtype=torch.uint8)
            for k, v in meta.items()}


def _decode(meta: Dict[str, torch.Tensor]) -> Dict[str, Any]:
    return {k: int(v.item()) if v.dtype == torch.int64 else bytes(v.tolist()).decode() for k, v in meta.items()}


def check_compatible(opt: "AccoOptimizer", saved: Dict[str, Any], rank_shard: bool) -> None:
    """Refuse a state dict that another optimizer, model, mode or rank wrote, before any state changes."""
    mine = describe(opt)
    if saved.get("format") != FORMAT_VERSION:
        raise ValueError(f"AccoOptimizer state dict of format {saved.get('format')!r}; this acco reads format {FORMAT_VERSION}")
    for key, fix in (("mode", "build the AccoOptimizer with mode={!r} to resume it"),
                     ("optimizer", "build the AccoOptimizer around {} to resume it"),
                     ("layout", "resume with the same model (the same trainable parameters, in the same order): {}"),
                     ("dtypes", "build the AccoOptimizer with the same compute_dtype ({})")):
        if saved.get(key) != mine[key]:
            raise ValueError(
                f"AccoOptimizer.load_state_dict(): the state dict was written with {key} {saved.get(key)!r}, this "
                f"optimizer has {mine[key]!r}: {fix.format(saved.get(key))}. Nothing was loaded."
            )
    if rank_shard and (saved.get("rank"), saved.get("world_size")) != (opt.rank, opt.world_size):
        raise ValueError(
            f"AccoOptimizer.load_state_dict(): this state dict holds the optimizer shard of rank {saved.get('rank')} "
            f"of {saved.get('world_size')} (opt.state_dict() is this rank's 1/N slice), but this is rank "
            f"{opt.rank} of {opt.world_size}. Save and load it on every rank, each its own file "
            "(torch.save(opt.state_dict(), f'optim.rank{rank}.pt')), or use acco.checkpoint.save/load (any number "
            "of ranks), or opt.consolidated_state_dict() on all ranks. Nothing was loaded."
        )


def _agree(opt: "AccoOptimizer", error: Optional[BaseException]) -> None:
    """Raise on every rank if any rank refused its state dict, before any collective of the load
    (one rank loading while another refused would leave the ranks in different collectives). Collective."""
    if opt._group is None:
        if error is not None:
            raise error
        return
    refused = [r for r, row in enumerate(opt._all_gather_row([int(error is not None)])) if row[0]]
    if error is not None:
        raise error
    if refused:
        raise ValueError(
            f"AccoOptimizer.load_state_dict(): rank(s) {refused} refused their state dict (their error says why); "
            "nothing was loaded on any rank"
        )


def _classify(sd: Any) -> str:
    if isinstance(sd, dict) and isinstance(sd.get("acco"), dict):
        return "rank_shard"
    if isinstance(sd, dict) and isinstance(sd.get("meta"), dict) and "master" in sd:
        return "sharded"
    if isinstance(sd, dict) and "state" in sd and "param_groups" in sd:
        raise ValueError(
            "AccoOptimizer.load_state_dict() got a plain torch optimizer state dict ('state' and 'param_groups', "
            "e.g. from torch.optim.AdamW(...).state_dict() or opt.consolidated_state_dict()). Load the model's "
            "weights, then call opt.load_consolidated_state_dict(sd). Nothing was loaded."
        )
    keys = sorted(sd) if isinstance(sd, dict) else type(sd).__name__
    raise ValueError(f"AccoOptimizer.load_state_dict() expects what AccoOptimizer.state_dict() returns; got {keys}")


# --------------------------------------------------------------- sharded format


def state_dict(opt: "AccoOptimizer", sharded: bool = False) -> Dict[str, Any]:
    """This rank's state (see the module docstring); with ``sharded``, as DTensors for DCP. Local: no collective."""
    _require_boundary(opt, "state_dict")
    opt._collect()  # the in-flight commit: its weights stay pending in the comm buffer
    opt._read_reports(block=True)  # CUDA path: the skip counter is final only once the device has run the rounds
    real = opt.layout.real_numel(opt.rank)
    flat_keys, scalar_keys = _state_keys(opt)
    state = opt.local_optimizer.state
    wrap = (lambda t: _flat(opt, t)) if sharded else (lambda t: t)
    counters = [opt.num_rounds, opt.num_updates, opt.num_skipped_updates, opt.committed_microbatches,
                int(opt._pending is RoundKind.COMMIT), opt._commits_handed_off, int(opt._holds_estimate),
                opt.microbatches_per_update or 0]
    out: Dict[str, Any] = {
        "master": wrap(opt._buffers.master[:real].clone()),
        "params": wrap(_param_slice(opt).clone()),
        "state": {k: wrap(_local_state(opt, k).clone()) for k in flat_keys},
        "scalars": {
            k: _scalars([state[p][k] for p in opt._pieces]) for k in scalar_keys
        },
        "hyper": {},
        "counters": torch.tensor(counters, dtype=torch.int64),
    }
    for gi, group in enumerate(opt.param_groups):
        for key, value in group.items():
            t = None if key == "params" or key in IMPLEMENTATION_FLAGS else _numeric_hyper(value)
            if t is not None:
                out["hyper"][f"{gi}.{key}"] = t
    if sharded:
        out["meta"] = _encode(describe(opt))
    else:
        out["checksums"] = checksums(opt, {"optim": out})
        out["acco"] = {**describe(opt), "rank": opt.rank, "world_size": opt.world_size}
    return out


def scalar_state(key: str, value: float, piece: torch.Tensor, group: Dict[str, Any]) -> torch.Tensor:
    """A per-parameter scalar of the wrapped optimizer's state, where torch's own ``load_state_dict`` puts it.

    ``step``: a float32 tensor on the CPU, except with ``fused=True`` or
    ``capturable=True``, whose kernels read it on the parameter's device. Any
    other scalar (ASGD's ``eta``, ``mu``): on the parameter's device, in its dtype.
    """
    if key == "step":
        on_device = group.get("fused") or group.get("capturable")
        return torch.tensor(value, dtype=torch.float32, device=piece.device if on_device else "cpu")
    return torch.tensor(value, dtype=piece.dtype, device=piece.device)


def _scalars(values: List[Any]) -> torch.Tensor:
    """Per-parameter scalars as one CPU float64 tensor: one device read, not one per parameter."""
    tensors = [v for v in values if torch.is_tensor(v)]
    if len(tensors) == len(values) and len({t.device for t in tensors}) == 1:
        return torch.stack([t.reshape(()).to(torch.float64) for t in tensors]).cpu()
    return torch.tensor([float(v) for v in values], dtype=torch.float64)


def _template(opt: "AccoOptimizer", flat_keys, scalar_keys, hyper_keys, meta_keys) -> Dict[str, Any]:
    """Empty tensors of the right shapes and placement for ``dcp.load`` to fill."""
    real = opt.layout.real_numel(opt.rank)
    dev = opt._buffers.master.device
    n = len(opt._params)
    return {
        "master": _flat(opt, torch.zeros(real, dtype=opt._buffers.master.dtype, device=dev)),
        "params": _flat(opt, torch.zeros(real, dtype=opt.compute_dtype, device=dev)),
        "state": {k: _flat(opt, torch.zeros(real, dtype=opt._buffers.master.dtype, device=dev)) for k in flat_keys},
        "scalars": {k: torch.zeros(n, dtype=torch.float64) for k in scalar_keys},
        "hyper": {k: torch.zeros(shape, dtype=torch.float64) for k, shape in hyper_keys.items()},
        "counters": torch.zeros(len(_COUNTERS), dtype=torch.int64),
        "meta": _meta_template(meta_keys),
    }


def _meta_template(meta_keys) -> Dict[str, torch.Tensor]:
    return {k: torch.zeros(shape, dtype=torch.int64 if len(shape) == 0 else torch.uint8) for k, shape in meta_keys.items()}


def check_loadable(opt: "AccoOptimizer", sd: Dict[str, Any]) -> None:
    """Everything :func:`load_state_dict` refuses, checked on every rank and agreed on before any rank changes
    anything (a refusal on one rank raises on all). Collective."""
    error: Optional[BaseException] = None
    try:
        kind = _classify(sd)
        saved = sd["acco"] if kind == "rank_shard" else _decode(sd["meta"])
        check_compatible(opt, saved, rank_shard=kind == "rank_shard")
        if kind == "rank_shard":
            if not isinstance(sd.get("checksums"), dict):
                raise CheckpointError("AccoOptimizer.load_state_dict(): the state dict has no checksums. Nothing was loaded.")
            body = {k: v for k, v in sd.items() if k not in ("acco", "checksums")}
            verify(opt, {"optim": body}, sd["checksums"], "AccoOptimizer.load_state_dict()")
        saved_m = int(sd["counters"][7]) or None
        if saved_m is not None and opt.microbatches_per_update not in (None, saved_m):
            raise ValueError(
                f"AccoOptimizer.load_state_dict(): the state dict was written with microbatches_per_update="
                f"{saved_m}, this optimizer has {opt.microbatches_per_update}. Nothing was loaded."
            )
        _require_boundary(opt, "load_state_dict")
    except Exception as exc:  # whatever it is, every rank must hear of it before the load's collectives
        error = exc
    _agree(opt, error)


def load_state_dict(opt: "AccoOptimizer", sd: Dict[str, Any], checked: bool = False) -> None:
    """Restore :func:`state_dict` output: this rank's own (same world size), or the sharded form through DCP
    (any world size). Refuses anything else before changing any state. Collective."""
    if not checked:
        check_loadable(opt, sd)
    counters = [int(v) for v in sd["counters"].tolist()]
    opt._collect()
    opt._pending = None
    real = opt.layout.real_numel(opt.rank)
    pieces = opt.layout.pieces(opt.rank)
    master = opt._buffers.master
    groups = opt.local_optimizer.param_groups
    group_of = {id(t): g for g in groups for t in g["params"]}
    with torch.no_grad():
        master.zero_()
        master[:real].copy_(_local(sd["master"]))
        opt.local_optimizer.state.clear()
        for i, (p, pc) in enumerate(zip(opt._pieces, pieces)):
            st = opt.local_optimizer.state[p]
            for key, flat in sd["state"].items():
                st[key] = _local(flat)[pc.local_start : pc.local_end].to(master.dtype).clone()
            for key, values in sd["scalars"].items():
                st[key] = scalar_state(key, float(values[i]), p, group_of[id(p)])
        # The model's weights: each rank has a slice; gather them whole, then the master.
        # Gathered into the round buffer (idle between updates): no model-sized temporary.
        full = _gather_full(opt, _local(sd["params"]).to(opt.compute_dtype), out=opt._comm_weights)
        opt.scheduler.install(opt._params, opt.layout.views(full))
        opt.num_rounds, opt.num_updates, opt.num_skipped_updates = counters[:3]
        opt._committed_mb.fill_(counters[3])
        opt._commits_handed_off, opt._holds_estimate = counters[5], bool(counters[6])
        opt.microbatches_per_update = counters[7] or opt.microbatches_per_update
        if counters[4]:  # a commit was collected at save time: its weights go in at the next hand-off
            _gather_full(opt, master[:real].to(opt.compute_dtype), out=opt._comm_weights)
            opt._pending = RoundKind.COMMIT
        opt._accum.zero_()
        opt._binding.zero_()
    for key, value in sd["hyper"].items():
        gi, name = key.split(".", 1)
        if name in IMPLEMENTATION_FLAGS:  # how this run's optimizer computes (its device's choice), not what
            continue
        group = opt.param_groups[int(gi)]
        group[name] = _restore_hyper(group.get(name), value)
    opt._in_accum = opt._since_handoff = opt._mb_in_update = 0
    opt._estimate_in_update = False
    opt._at_boundary = True
    opt._update_hyper = opt._hyperparams()


# ---------------------------------------------------------- consolidated format


def consolidated_state_dict(opt: "AccoOptimizer") -> Dict[str, Any]:
    """The wrapped optimizer's own format with full per-parameter state, on every rank. Collective.

    ``torch.optim.AdamW(model.parameters(), ...).load_state_dict(...)`` accepts it,
    so a run can leave acco for a plain optimizer (with the committed weights,
    e.g. after ``finish()``).
    """
    _require_boundary(opt, "consolidated_state_dict")
    opt._collect()
    flat_keys, scalar_keys = _state_keys(opt)
    state = opt.local_optimizer.state
    per_param: Dict[int, Dict[str, Any]] = {i: {} for i in range(len(opt._params))}
    for key in flat_keys:
        for i, view in enumerate(opt.layout.views(_gather_full(opt, _local_state(opt, key)))):
            per_param[i][key] = view.clone()
    for key in scalar_keys:
        for i, p in enumerate(opt._pieces):
            value = state[p][key]
            per_param[i][key] = value.clone() if torch.is_tensor(value) else value
    groups, start = [], 0
    for group in opt.param_groups:
        n = len(group["params"])
        hyper = {k: v for k, v in group.items() if k != "params"}
        groups.append({**hyper, "params": list(range(start, start + n))})
        start += n
    return {"state": {i: s for i, s in per_param.items() if s}, "param_groups": groups}


def load_consolidated_state_dict(opt: "AccoOptimizer", sd: Dict[str, Any]) -> None:
    """Take a plain optimizer's ``state_dict()`` (same parameters, same order).

    The master weights are taken from the model's current parameters: load the
    model's weights first. Call on all ranks (each keeps its slice).
    """
    _require_boundary(opt, "load_consolidated_state_dict")
    if len(sd["param_groups"]) != len(opt.param_groups) or any(
        len(g["params"]) != len(h["params"]) for g, h in zip(sd["param_groups"], opt.param_groups)
    ):
        raise ValueError(
            "the state dict's param groups "
            f"{[len(g['params']) for g in sd['param_groups']]} do not match this optimizer's "
            f"{[len(g['params']) for g in opt.param_groups]} (parameters per group)"
        )
    opt._collect()
    opt._pending = None  # the master comes from the model's weights: those are now the committed ones
    opt._holds_estimate = False
    pieces = opt.layout.pieces(opt.rank)
    master = opt._buffers.master
    real = opt.layout.real_numel(opt.rank)
    with torch.no_grad():
        master.zero_()
        master[:real].copy_(_param_slice(opt).to(master.dtype))
        opt.local_optimizer.state.clear()
        saved = {int(k): v for k, v in sd["state"].items()}
        for i, (p, pc) in enumerate(zip(opt._pieces, pieces)):
            for key, value in saved.get(i, {}).items():
                if torch.is_tensor(value) and value.dim() >= 1:
                    value = value.reshape(-1)[pc.param_start : pc.param_end].to(master.device, master.dtype).clone()
                elif torch.is_tensor(value):
                    value = value.clone()
                opt.local_optimizer.state[p][key] = value
    for group, saved_group in zip(opt.param_groups, sd["param_groups"]):
        for key, value in saved_group.items():
            if key != "params":
                group[key] = value
    opt._update_hyper = opt._hyperparams()


# ------------------------------------------------------------- files (DCP)


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

    group = optimizer._group
    sd: Dict[str, Any] = {"optim": state_dict(optimizer, sharded=True), "extra": dict(extra or {})}
    if model is not None:
        sd["model"] = model.state_dict()
    sd["checksums"] = _replicated_only(optimizer, checksums(optimizer, sd))  # verified by load()
    tmp, old = f"{path}.tmp", f"{path}.old"
    if _rank0(group):
        shutil.rmtree(tmp, ignore_errors=True)
    _barrier(group)
    dcp.save(sd, checkpoint_id=tmp, process_group=group, no_dist=not dist.is_initialized())
    _barrier(group)  # every rank's slice is on disk
    if _rank0(group):
        if os.path.exists(path):
            shutil.rmtree(old, ignore_errors=True)
            os.rename(path, old)
        os.rename(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    _barrier(group)


def resolve(path: str) -> str:
    """The checkpoint to read: ``PATH``, or ``PATH.old`` if a save was cut off between its renames."""
    if os.path.exists(os.path.join(path, ".metadata")):
        return path
    old = f"{path}.old"
    if os.path.exists(os.path.join(old, ".metadata")):
        return old
    raise FileNotFoundError(f"no checkpoint at {path!r} (no .metadata file there or in {old!r})")


def load(path: str, optimizer: "AccoOptimizer", *, model: Optional[torch.nn.Module] = None,
         extra: Optional[Dict[str, torch.Tensor]] = None) -> Dict[str, torch.Tensor]:
    """Read a checkpoint written by :func:`save` on any number of ranks. Collective.

    ``extra`` gives the names (and shapes) of your own tensors to read back;
    they are returned. Loading executes no code: every entry is a tensor.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

    path = resolve(path)
    where = f"acco.checkpoint.load({path!r})"
    no_dist = not dist.is_initialized()

    def read(sd: Dict[str, Any]) -> None:
        try:
            dcp.load(sd, checkpoint_id=path, process_group=optimizer._group, no_dist=no_dist)
        except (Exception, CheckpointException) as exc:  # DCP's own errors say little of what to do
            raise CheckpointError(
                f"{where}: the checkpoint cannot be read ({type(exc).__name__}: {str(exc)[:500]}); a file may be "
                "missing or truncated. Nothing was loaded (the optimizer and the model are unchanged)."
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
    head = {"optim": {"meta": _meta_template(meta_keys)}}
    read(head)
    check_compatible(optimizer, _decode(head["optim"]["meta"]), rank_shard=False)
    sd: Dict[str, Any] = {
        "optim": _template(optimizer, flat_keys, scalar_keys, hyper_keys, meta_keys),
        "extra": {k: v.clone() for k, v in (extra or {}).items()},
    }
    if model is not None:  # into copies: the model changes only once everything has been verified
        sd["model"] = {k: torch.empty_like(v) for k, v in model.state_dict().items()}
    sd["checksums"] = {k: torch.zeros((), dtype=torch.int64) for k in sum_keys}
    read(sd)
    expected = sd.pop("checksums")
    verify(optimizer, {k: v for k, v in sd.items()}, expected, where, subset=True)
    check_loadable(optimizer, sd["optim"])  # before the model changes
    if model is not None:
        model.load_state_dict(sd["model"])
    load_state_dict(optimizer, sd["optim"], checked=True)
    return sd["extra"]
