"""The consolidated state: the wrapped optimizers' own format, with every parameter's full state, on every rank.

``consolidated_state_dict()`` is what ``torch.optim.AdamW(model.parameters()).state_dict()`` would hold, so a
run can leave acco for a plain optimizer; ``load_consolidated_state_dict()`` goes the other way. With several
wrapped classes (the Muon + AdamW split) it holds every parameter by its index in the ``AccoOptimizer``'s
groups, each parameter's state that of its own class. Collective: call on all ranks.
"""

from __future__ import annotations

from typing import Any, Dict, List

import torch
import torch.distributed as dist

from ..agreement import snapshot_hyperparams
from ..collectives import all_gather_flat
from .format import IMPLEMENTATION_FLAGS, StateOwners
from .pieces import scalar_state

__all__ = ["consolidated_state_dict", "load_consolidated_state_dict"]


def consolidated_state_dict(owners: StateOwners) -> Dict[str, Any]:
    """Every parameter's full state, in torch's optimizer format, on every rank. Collective: slices of 1-D state
    travel in one all-gather per key over the flat buffer; tensors placed whole and the scalars, from the rank
    that holds them (one exchange of objects)."""
    layout, wrapped, rank = owners.layout, owners.wrapped, owners.rank
    pieces = layout.pieces(rank)
    master = owners.flat.master
    sliced_keys = sorted({k for i, _ in wrapped.held() if not layout.params[i].whole
                          for k, v in wrapped.state_of(i).items() if torch.is_tensor(v) and v.dim() >= 1})
    sliced_keys = _agreed(sliced_keys, owners)
    per_param: Dict[int, Dict[str, Any]] = {}
    group = owners.session.collective_group()
    for key in sliced_keys:  # one flat all-gather per element-wise state key: each rank fills its pieces
        chunk = torch.zeros(layout.shard_size, dtype=master.dtype, device=master.device)
        for i, _ in wrapped.held():
            value = wrapped.state_of(i).get(key)
            if not layout.params[i].whole and torch.is_tensor(value):
                chunk[pieces[i].local_start : pieces[i].local_end].copy_(value.reshape(-1))
        full = torch.empty(layout.padded_numel, dtype=master.dtype, device=master.device)
        all_gather_flat(full, chunk, group)
        for p in layout.params:
            if not p.whole and p.numel:
                per_param.setdefault(p.index, {})[key] = full[p.flat_start : p.flat_end].view(p.shape).clone()
    # the rest from whoever holds it: scalars of sliced parameters (the same on every rank holding a piece),
    # and whole tensors' state, from their owner
    mine = {}
    for i, _ in wrapped.held():
        whole = layout.params[i].whole
        mine[i] = {k: (v.detach().cpu().clone() if torch.is_tensor(v) else v) for k, v in wrapped.state_of(i).items()
                   if whole or not (torch.is_tensor(v) and v.dim() >= 1)}
    for theirs in _all_objects(mine, owners):
        for i, st in theirs.items():
            for k, v in st.items():
                per_param.setdefault(int(i), {}).setdefault(k, v.to(master.device) if torch.is_tensor(v) and v.dim() >= 1 else v)
    groups, start = [], 0
    for g in owners.param_groups:
        n = len(g["params"])
        groups.append({**{k: v for k, v in g.items() if k not in ("params", "optimizer_class")},
                       "params": list(range(start, start + n))})
        start += n
    return {"state": {i: per_param[i] for i in sorted(per_param) if per_param[i]}, "param_groups": groups}


def _agreed(keys: List[str], owners: StateOwners) -> List[str]:
    """The union of every rank's ``keys`` (a rank holding no slice has none). Collective."""
    return sorted({k for ks in _all_objects(keys, owners) for k in ks})


def _all_objects(obj: Any, owners: StateOwners) -> List[Any]:
    group = owners.process_group
    if group is None or not dist.is_initialized():
        return [obj]
    out: List[Any] = [None] * owners.world_size
    dist.all_gather_object(out, obj, group=group)  # every rank's CPU copies, in rank order
    return out


def check_consolidated(owners: StateOwners, sd: Dict[str, Any], params: List[torch.Tensor]) -> None:
    """Refuse a consolidated state dict of other param groups or another model, before anything changes."""
    if len(sd["param_groups"]) != len(owners.param_groups) or any(
        len(g["params"]) != len(h["params"]) for g, h in zip(sd["param_groups"], owners.param_groups)
    ):
        raise ValueError(
            "the state dict's param groups "
            f"{[len(g['params']) for g in sd['param_groups']]} do not match this optimizer's "
            f"{[len(g['params']) for g in owners.param_groups]} (parameters per group)"
        )
    for i, st in sorted((int(k), v) for k, v in sd["state"].items()):
        if i >= len(params):
            raise ValueError(f"the state dict holds state for parameter {i}, but this optimizer has {len(params)}")
        for key, value in st.items():
            if (torch.is_tensor(value) and value.dim() >= 1 and not owners.layout.params[i].whole
                    and tuple(value.shape) != tuple(params[i].shape)):
                raise ValueError(
                    f"the state dict's {key!r} of parameter {i} has shape {tuple(value.shape)}, but parameter {i} "
                    f"of this optimizer has shape {tuple(params[i].shape)}: the state dict is of another model "
                    "(or its parameters in another order); nothing was loaded"
                )


def load_consolidated_state_dict(owners: StateOwners, sd: Dict[str, Any], params: List[torch.Tensor]) -> None:
    """Take a plain optimizer's ``state_dict()`` (same parameters, same order). The master weights come from the
    model's current weights: load them first. Local: each rank keeps its pieces."""
    check_consolidated(owners, sd, params)
    layout, wrapped, flat = owners.layout, owners.wrapped, owners.flat
    swapped = owners.session.view_swapped
    owners.driver.collect()
    owners.progress.committed_in_model()  # the master comes from the model's weights: now the committed ones
    pieces = layout.pieces(owners.rank)
    master = flat.master
    saved = {int(k): v for k, v in sd["state"].items()}
    with torch.no_grad():
        flat.master_from_model(swapped)
        wrapped.clear_state()
        for i, _ in wrapped.held():
            pc, whole = pieces[i], layout.params[i].whole
            state = {}
            for key, value in saved.get(i, {}).items():
                if torch.is_tensor(value) and value.dim() >= 1:
                    value = value if whole else value.reshape(-1)[pc.param_start : pc.param_end]
                    value = value.to(master.device, master.dtype).clone()
                elif torch.is_tensor(value):  # step where this run's kernel reads it (fused: on the device)
                    value = scalar_state(key, value, wrapped.tensor(i), wrapped.group_of(i))
                state[key] = value
            if state:
                wrapped.set_state(i, state)
    for group, saved_group in zip(owners.param_groups, sd["param_groups"]):
        for key, value in saved_group.items():
            if key != "params" and key not in IMPLEMENTATION_FLAGS:  # the kernel stays this run's (its device's)
                group[key] = value
    owners.progress.take_hyper(snapshot_hyperparams(owners.param_groups))
