"""The optimizer's state as tensors: this rank's shard (``opt.state_dict()``), the same as 1-D DTensors
for DCP (any world size at load), and the consolidated per-parameter format of a plain torch optimizer.

What the entries are is described in :mod:`acco.checkpoint`. Everything here
reads and restores the optimizer through the owners of its state: the flat
buffers (``opt._flat``), the progress counters (``opt._progress``) and the
round driver (``opt._driver``), plus the wrapped optimizer's own state.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any, Dict, List, Optional

import torch

from .checksums import CheckpointError, checksums, verify
from .collectives import all_gather_flat
from .progress import Progress

if TYPE_CHECKING:  # pragma: no cover
    from .optimizer import AccoOptimizer

__all__ = ["FORMAT_VERSION", "IMPLEMENTATION_FLAGS", "check_compatible", "check_loadable", "consolidated_state_dict",
           "decode_meta", "describe", "load_consolidated_state_dict", "load_state_dict", "meta_template",
           "scalar_state", "state_dict", "template"]


# --------------------------------------------------------------------- helpers


def _flat(opt: "AccoOptimizer", local: torch.Tensor):
    """Wrap this rank's slice as the 1-D global tensor (a DTensor when there is a group)."""
    if opt.process_group is None:
        return local
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = DeviceMesh.from_group(opt.process_group, local.device.type)
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
    failed = opt._driver.failed
    if failed is not None:
        raise RuntimeError(f"AccoOptimizer.{what}(): a previous round failed") from failed
    if what.startswith("load") and opt._in_committed_view:
        raise RuntimeError(f"AccoOptimizer.{what}() inside opt.committed_weights(): load after the block")
    if not opt.at_update_boundary:
        pending = opt._progress.pending_microbatches()
        raise RuntimeError(
            f"AccoOptimizer.{what}() at a mid-update point: {pending} micro-batch(es) of an update are "
            "accumulated but not committed. Call it between a step() and the next backward() "
            "(when opt.at_update_boundary is True)."
        )


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
    group = opt._driver.ctx.group  # the rounds' (idle at a boundary); the user's after finish()
    all_gather_flat(full, padded, group if group is not None else opt.process_group)
    return full[: opt.layout.numel]


# ------------------------------------------------------------ what a state dict holds

FORMAT_VERSION = 2

def describe(opt: "AccoOptimizer") -> Dict[str, Any]:
    """What a state dict of ``opt`` holds, independent of the world size: format, mode, wrapped optimizer, layout."""
    cls = opt.optimizer_class
    digest = hashlib.sha256(repr(opt.layout.shapes).encode()).hexdigest()[:16]
    return {"format": FORMAT_VERSION, "mode": opt.mode, "optimizer": f"{cls.__module__}.{cls.__qualname__}",
            "layout": f"{opt.layout.numel} elements in {len(opt.layout.shapes)} tensors, shapes {digest}",
            "dtypes": f"compute {opt.compute_dtype}, master {opt._flat.master.dtype}",
            # how many optimizer-state entries it holds: a DCP load target that lists fewer is refused
            "state_entries": sum(len(keys) for keys in _state_keys(opt))}


def _encode(meta: Dict[str, Any]) -> Dict[str, torch.Tensor]:
    """Strings and ints as tensors (DCP stores tensors only; nothing is pickled)."""
    return {k: torch.tensor(v, dtype=torch.int64) if isinstance(v, int) else torch.tensor(list(str(v).encode()), dtype=torch.uint8)
            for k, v in meta.items()}


def _covered(body: Dict[str, Any], info: Dict[str, Any]) -> Dict[str, Any]:
    """What a per-rank state dict's checksums cover: its tensors and what it says it is (mode, optimizer, ...)."""
    return {"optim": body, "meta": _encode(info)}


def decode_meta(meta: Dict[str, torch.Tensor]) -> Dict[str, Any]:
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
    rows = opt._all_gather_row([int(error is not None)], "load_state_dict() / acco.checkpoint.load()")
    refused = [r for r, row in enumerate(rows) if row[0]]
    if error is not None:
        raise error
    if refused:
        raise ValueError(
            f"AccoOptimizer.load_state_dict(): rank(s) {refused} refused their state dict (their error says why); "
            "nothing was loaded on any rank"
        )


GATHERED = "acco_ranks"  # acco.checkpoint.gather(): every rank's state_dict(), in rank order


def own_entry(opt: "AccoOptimizer", sd: Any) -> Any:
    """This rank's state dict: ``sd`` itself, or its entry of a gathered one (``acco.checkpoint.gather``)."""
    if not (isinstance(sd, dict) and GATHERED in sd):
        return sd
    entries = sd[GATHERED]
    if not isinstance(entries, (list, tuple)) or len(entries) != opt.world_size:
        n = len(entries) if isinstance(entries, (list, tuple)) else type(entries).__name__
        raise ValueError(
            f"AccoOptimizer.load_state_dict(): the checkpoint holds the optimizer state of {n} rank(s) "
            f"(acco.checkpoint.gather), this run has {opt.world_size}. Resume on {n} rank(s), or save with "
            "acco.checkpoint.save/load (DCP), which load on any number of ranks. Nothing was loaded."
        )
    return entries[opt.rank]


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
    opt._driver.collect()  # the in-flight commit: its weights stay pending in the round buffer
    opt._driver.read_reports()  # CUDA path: the skip counter is final only once the device has run the rounds
    real = opt.layout.real_numel(opt.rank)
    flat_keys, scalar_keys = _state_keys(opt)
    state = opt.local_optimizer.state
    pieces = opt._pieces
    wrap = (lambda t: _flat(opt, t)) if sharded else (lambda t: t)
    out: Dict[str, Any] = {
        "master": wrap(opt._flat.master[:real].clone()),
        "params": wrap(opt._flat.model_slice(opt._view_swapped)),
        "state": {k: wrap(_local_state(opt, k).clone()) for k in flat_keys},
        "scalars": {
            k: _scalars([state[p][k] for p in pieces]) for k in scalar_keys
        },
        "hyper": {},
        "counters": opt._progress.to_tensor(),
    }
    for gi, group in enumerate(opt.param_groups):
        for key, value in group.items():
            t = None if key == "params" or key in IMPLEMENTATION_FLAGS else _numeric_hyper(value)
            if t is not None:
                out["hyper"][f"{gi}.{key}"] = t
    if sharded:
        out["meta"] = _encode(describe(opt))
    else:
        info = {**describe(opt), "rank": opt.rank, "world_size": opt.world_size}
        out["checksums"] = checksums(opt, _covered(out, info))
        out["acco"] = info
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


def template(opt: "AccoOptimizer", flat_keys, scalar_keys, hyper_keys, meta_keys) -> Dict[str, Any]:
    """Empty tensors of the right shapes and placement for ``dcp.load`` to fill."""
    real = opt.layout.real_numel(opt.rank)
    dev, master_dtype = opt.device, opt._flat.master.dtype
    n = len(opt._pieces)
    return {
        "master": _flat(opt, torch.zeros(real, dtype=master_dtype, device=dev)),
        "params": _flat(opt, torch.zeros(real, dtype=opt.compute_dtype, device=dev)),
        "state": {k: _flat(opt, torch.zeros(real, dtype=master_dtype, device=dev)) for k in flat_keys},
        "scalars": {k: torch.zeros(n, dtype=torch.float64) for k in scalar_keys},
        "hyper": {k: torch.zeros(shape, dtype=torch.float64) for k, shape in hyper_keys.items()},
        "counters": torch.zeros(len(Progress.SAVED), dtype=torch.int64),
        "meta": meta_template(meta_keys),
    }


def meta_template(meta_keys) -> Dict[str, torch.Tensor]:
    return {k: torch.zeros(shape, dtype=torch.int64 if len(shape) == 0 else torch.uint8) for k, shape in meta_keys.items()}


def check_model_matches(opt: "AccoOptimizer", sd: Dict[str, Any]) -> None:
    """Refuse a model that is not the one this optimizer state was saved with (a model and an optimizer from
    different checkpoints). Free to check: the model was saved with the committed weights, which are the fp32
    master's (in bf16 its rounding), or with the weights for the next micro-batch (``params``). Local."""
    model = opt._flat.model_slice(opt._view_swapped)
    master = _local(sd["master"]).to(model.device, model.dtype)
    params = _local(sd["params"]).to(model.device, model.dtype)
    if torch.equal(model, master) or torch.equal(model, params):
        return
    updates = Progress.saved_field(sd["counters"], "num_updates")
    diff = float((model.float() - master.float()).abs().max()) if model.numel() else 0.0
    raise ValueError(
        f"AccoOptimizer.load_state_dict(): the model's weights are not the ones this optimizer state was saved "
        f"with (it holds {updates} committed update(s); largest difference from its committed weights on rank "
        f"{opt.rank}: {diff:.3g}). The model comes from another checkpoint or was not loaded, and resuming would "
        "mix two points of training. Load the model saved with this optimizer state first (saved inside "
        "opt.committed_weights(); acco.checkpoint.gather or acco.checkpoint.save(..., model=model) save both "
        "in one call), or, to take the model's weights from this optimizer state alone, call "
        "opt.load_state_dict(sd, restore_model=True). Nothing was loaded."
    )


def check_loadable(opt: "AccoOptimizer", sd: Dict[str, Any], restore_model: bool = True,
                   allow_new_microbatches: bool = False) -> None:
    """Everything :func:`load_state_dict` refuses, checked on every rank and agreed on before any rank changes
    anything (a refusal on one rank raises on all). Collective."""
    error: Optional[BaseException] = None
    try:
        sd = own_entry(opt, sd)
        kind = _classify(sd)
        saved = sd["acco"] if kind == "rank_shard" else decode_meta(sd["meta"])
        check_compatible(opt, saved, rank_shard=kind == "rank_shard")
        if kind == "rank_shard":
            if not isinstance(sd.get("checksums"), dict):
                raise CheckpointError("AccoOptimizer.load_state_dict(): the state dict has no checksums. Nothing was loaded.")
            body = {k: v for k, v in sd.items() if k not in ("acco", "checksums")}
            verify(opt, _covered(body, sd["acco"]), sd["checksums"], "AccoOptimizer.load_state_dict()")
        else:
            listed, held = len(sd["state"]) + len(sd["scalars"]), saved.get("state_entries")
            if held is not None and listed != held:
                raise ValueError(
                    f"AccoOptimizer.load_state_dict(): the checkpoint holds {held} optimizer-state entries, the "
                    f"state dict it was loaded into listed {listed} (a fresh optimizer's sharded_state_dict() "
                    "lists none, so dcp.load skipped them and training would go on without them). Load with "
                    "acco.checkpoint.load(path, opt), which builds the complete target from the checkpoint. "
                    "Nothing was loaded."
                )
        try:
            Progress.check_saved(sd["counters"])
        except ValueError as exc:
            raise CheckpointError(f"AccoOptimizer.load_state_dict(): {exc}: written by another acco version. "
                                  "Nothing was loaded.") from None
        saved_m = Progress.saved_field(sd["counters"], "microbatches_per_update") or None
        if saved_m is not None and opt.microbatches_per_update not in (None, saved_m) and not allow_new_microbatches:
            raise ValueError(
                f"AccoOptimizer.load_state_dict(): the state dict was written with microbatches_per_update="
                f"{saved_m}, this optimizer has {opt.microbatches_per_update}. To go on with "
                f"{opt.microbatches_per_update} (e.g. the same global batch on fewer ranks), pass "
                "allow_new_microbatches=True (opt.load_state_dict or acco.checkpoint.load); otherwise build the "
                f"optimizer with microbatches_per_update={saved_m}. Nothing was loaded."
            )
        _require_boundary(opt, "load_state_dict")
        if kind == "rank_shard" and not restore_model:
            check_model_matches(opt, sd)
    except Exception as exc:  # whatever it is, every rank must hear of it before the load's collectives
        error = exc
    _agree(opt, error)


def load_state_dict(opt: "AccoOptimizer", sd: Dict[str, Any], checked: bool = False, restore_model: bool = True,
                    allow_new_microbatches: bool = False) -> None:
    """Restore :func:`state_dict` output: this rank's own (same world size), or the sharded form through DCP
    (any world size). Refuses anything else before changing any state; with ``restore_model=False``, also a
    model that is not the one the state was saved with (:func:`check_model_matches`). Collective."""
    if not checked:
        check_loadable(opt, sd, restore_model, allow_new_microbatches)
    sd = own_entry(opt, sd)
    opt._driver.collect()
    pieces = opt.layout.pieces(opt.rank)
    flat = opt._flat
    groups = opt.local_optimizer.param_groups
    group_of = {id(t): g for g in groups for t in g["params"]}
    with torch.no_grad():
        flat.load_master(_local(sd["master"]))
        opt.local_optimizer.state.clear()
        for i, (p, pc) in enumerate(zip(opt._pieces, pieces)):
            st = opt.local_optimizer.state[p]
            for key, values in sd["state"].items():
                st[key] = _local(values)[pc.local_start : pc.local_end].to(flat.master.device, flat.master.dtype).clone()
            for key, values in sd["scalars"].items():
                st[key] = scalar_state(key, float(values[i]), p, group_of[id(p)])
        # The model's weights: each rank has a slice; gathered whole into the round buffer (idle between
        # updates: no model-sized temporary), then into the parameters.
        _gather_full(opt, _local(sd["params"]).to(opt.device, opt.compute_dtype), out=flat.comm_weights)
        flat.install(opt.scheduler)
        if opt._progress.load_tensor(sd["counters"]):  # a commit collected at save time: in at the next hand-off
            _gather_full(opt, flat.master[: opt.layout.real_numel(opt.rank)].to(opt.compute_dtype), out=flat.comm_weights)
        flat.reset()
    for key, value in sd["hyper"].items():
        gi, name = key.split(".", 1)
        if name in IMPLEMENTATION_FLAGS:  # how this run's optimizer computes (its device's choice), not what
            continue
        group = opt.param_groups[int(gi)]
        group[name] = _restore_hyper(group.get(name), value)
    opt._progress.update_hyper = opt._hyperparams()


# ---------------------------------------------------------- consolidated format


def consolidated_state_dict(opt: "AccoOptimizer") -> Dict[str, Any]:
    """The wrapped optimizer's own format with full per-parameter state, on every rank. Collective.

    ``torch.optim.AdamW(model.parameters(), ...).load_state_dict(...)`` accepts it,
    so a run can leave acco for a plain optimizer (with the committed weights,
    e.g. after ``finish()``).
    """
    _require_boundary(opt, "consolidated_state_dict")
    opt._driver.collect()
    flat_keys, scalar_keys = _state_keys(opt)
    state = opt.local_optimizer.state
    pieces = opt._pieces
    per_param: Dict[int, Dict[str, Any]] = {i: {} for i in range(len(pieces))}
    for key in flat_keys:
        for i, view in enumerate(opt.layout.views(_gather_full(opt, _local_state(opt, key)))):
            per_param[i][key] = view.clone()
    for key in scalar_keys:
        for i, p in enumerate(pieces):
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
    for i, st in sorted((int(k), v) for k, v in sd["state"].items()):
        if i >= len(opt._params):
            raise ValueError(f"the state dict holds state for parameter {i}, but this optimizer has {len(opt._params)}")
        for key, value in st.items():
            if torch.is_tensor(value) and value.dim() >= 1 and tuple(value.shape) != tuple(opt._params[i].shape):
                raise ValueError(
                    f"the state dict's {key!r} of parameter {i} has shape {tuple(value.shape)}, but parameter {i} "
                    f"of this optimizer has shape {tuple(opt._params[i].shape)}: the state dict is of another model "
                    "(or its parameters in another order); nothing was loaded"
                )
    opt._driver.collect()
    opt._progress.pending = None  # the master comes from the model's weights: those are now the committed ones
    opt._progress.holds_estimate = False
    pieces = opt.layout.pieces(opt.rank)
    master = opt._flat.master
    with torch.no_grad():
        opt._flat.load_master(opt._flat.model_slice(opt._view_swapped).to(master.dtype))
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
    opt._progress.update_hyper = opt._hyperparams()
