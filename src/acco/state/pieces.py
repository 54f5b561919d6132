"""This rank's pieces of the state (format 3, :mod:`acco.state.format`): taking them, and putting back any set
of saved pieces that covers this rank's, whatever layout and number of ranks saved them (resharding).

Local (no collective), except :func:`restore`, which all-gathers the model's weights.
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch

from .checksums import CheckpointError
from ..collectives import all_gather_flat
from .format import StateOwners, empty_sections, parse_piece_key, piece_key

__all__ = ["Saved", "entries", "restore", "scalar_state", "wanted"]

Key = Tuple[int, int]  # (parameter index, first element of the piece in the flattened parameter)


def entries(owners: StateOwners) -> Dict[str, Dict[str, Any]]:
    """This rank's state, new tensors: per non-empty piece ``"i:a"`` its ``master``, ``params`` (the model's
    weights for the next micro-batch), ``state`` (the wrapped optimizer's tensors, 1-D for a slice, their own
    shape for a tensor placed whole) and ``entries`` (how many); per parameter this rank steps ``"i"``, its
    ``scalars`` (AdamW's ``step``: the same in every piece of a parameter, so on every rank that steps one)."""
    swapped = owners.session.view_swapped
    pieces = owners.layout.pieces(owners.rank)
    out: Dict[str, Dict[str, Any]] = empty_sections()
    for i, _ in owners.wrapped.held():
        pc = pieces[i]
        tensors, scalars = {}, {}
        for k, v in owners.wrapped.state_of(i).items():
            if torch.is_tensor(v) and v.dim() >= 1:
                tensors[k] = v.detach().clone()
            elif torch.is_tensor(v) or (isinstance(v, (int, float)) and not isinstance(v, bool)):
                scalars[k] = v.detach().clone().reshape(()) if torch.is_tensor(v) else torch.tensor(float(v), dtype=torch.float64)
            else:
                raise TypeError(f"cannot checkpoint optimizer state {k!r} of type {type(v).__name__}")
        if scalars:
            out["scalars"][str(i)] = scalars
        key = piece_key(i, pc.param_start)
        out["master"][key] = owners.flat.master[pc.local_start : pc.local_end].clone()
        out["params"][key] = owners.flat.model_piece(i, pc, swapped).clone()
        if tensors:
            out["state"][key] = tensors
        out["entries"][key] = torch.tensor(len(tensors), dtype=torch.int64)
    return out


def scalar_state(key: str, value: Any, tensor: torch.Tensor, group: Dict[str, Any]) -> torch.Tensor:
    """A 0-d entry of the wrapped optimizer's state, where torch's own ``load_state_dict`` puts it.

    ``step``: a float32 tensor on the CPU, except with ``fused=True`` or ``capturable=True``, whose kernels read
    it on the parameter's device. Any other scalar (ASGD's ``eta``, ``mu``): on the parameter's device, in its
    dtype.
    """
    value = value if torch.is_tensor(value) else torch.tensor(float(value), dtype=torch.float64)
    if key == "step":
        on_device = group.get("fused") or group.get("capturable")
        return value.detach().to(device=tensor.device if on_device else "cpu", dtype=torch.float32).clone()
    return value.detach().to(device=tensor.device, dtype=tensor.dtype).clone()


class Saved:
    """Saved pieces, as read: ``master``, ``params``, ``entries`` and ``state`` (``{K: tensor}``) keyed by
    (parameter, first element), ``scalars`` (``{K: 0-d tensor}``) by parameter."""

    def __init__(self, sd: Dict[str, Any]) -> None:
        def keyed(d):
            return {parse_piece_key(k): v for k, v in (d or {}).items()}

        self.master: Dict[Key, torch.Tensor] = keyed(sd.get("master"))
        self.params: Dict[Key, torch.Tensor] = keyed(sd.get("params"))
        self.state: Dict[Key, Dict[str, torch.Tensor]] = keyed(sd.get("state"))
        self.entries: Dict[Key, torch.Tensor] = keyed(sd.get("entries"))
        self.scalars: Dict[int, Dict[str, torch.Tensor]] = {int(k): v for k, v in (sd.get("scalars") or {}).items()}

    def pieces_of(self, index: int) -> List[Key]:
        return sorted(k for k in self.master if k[0] == index)

    def check_complete(self) -> None:
        """Every piece with a count of state entries holds that many (a DCP load target made from a fresh
        optimizer lists none: DCP skipped them, and training would go on without them)."""
        held = sum(int(c) for c in self.entries.values())
        listed = sum(len(self.state.get(k, {})) for k in self.entries)
        if listed != held:
            raise ValueError(
                f"AccoOptimizer.load_state_dict(): the checkpoint holds {held} optimizer-state entries for these "
                f"pieces, the state dict it was loaded into listed {listed} (a fresh optimizer's "
                "sharded_state_dict() lists none, so dcp.load skipped them and training would go on without "
                "them). Load with acco.checkpoint.load(path, opt), which builds the complete target from the "
                "checkpoint. Nothing was loaded."
            )


def _cut(saved: Dict[Key, torch.Tensor], keys: List[Key], lo: int, hi: int, what: str, index: int) -> torch.Tensor:
    """Elements ``[lo, hi)`` of flattened parameter ``index``, from its saved pieces ``keys`` (sorted)."""
    parts, cursor = [], lo
    for key in keys:
        t = saved[key].reshape(-1)
        a, b = key[1], key[1] + t.numel()
        if b <= cursor or a >= hi:
            continue
        if a > cursor:
            break
        parts.append(t[cursor - a : min(hi, b) - a])
        cursor = min(hi, b)
        if cursor == hi:
            break
    if cursor != hi:
        raise CheckpointError(
            f"AccoOptimizer.load_state_dict(): the checkpoint holds no {what} for elements {cursor}..{hi} of "
            f"parameter {index}: some of its pieces are missing (a file of another checkpoint, or a damaged one). "
            "Nothing was loaded."
        )
    return torch.cat(parts) if len(parts) != 1 else parts[0]


def wanted(layout: Any, rank: int, saved_pieces: Dict[int, List[Tuple[int, int]]]) -> List[Key]:
    """The saved pieces (``saved_pieces[i]``: (first element, elements) of each of parameter ``i``'s) that rank
    ``rank``'s pieces of ``layout`` overlap."""
    out = []
    for i in layout.stepped_by(rank):
        pc = layout.params[i].piece(rank, layout.shard_size)
        if pc.numel:
            out += [(i, a) for a, n in sorted(saved_pieces.get(i, [])) if a < pc.param_end and a + n > pc.param_start]
    return out


def restore(owners: StateOwners, saved: Saved) -> None:
    """Put the saved pieces back into this rank's master slice, wrapped optimizers and model (all-gathered
    through the idle round buffer: no model-sized temporary). Collective (the all-gather): call on every rank."""
    layout, flat, wrapped = owners.layout, owners.flat, owners.wrapped
    pieces = layout.pieces(owners.rank)
    master = flat.master
    loaded = {}
    for i, _ in wrapped.held():  # everything first: a missing piece raises before anything changes
        pc, keys = pieces[i], saved.pieces_of(i)
        m = _cut(saved.master, keys, pc.param_start, pc.param_end, "master weights", i)
        w = _cut(saved.params, keys, pc.param_start, pc.param_end, "model weights", i)
        loaded[i] = (m, w, _state_for(saved, keys, pc, layout.params[i].whole, i))
    chunk = torch.zeros(layout.shard_size, dtype=flat.compute_dtype, device=master.device)  # this rank's weights
    with torch.no_grad():
        master.zero_()
        wrapped.clear_state()
        for i, t in wrapped.held():
            pc = pieces[i]
            m, w, st = loaded[i]
            master[pc.local_start : pc.local_end].copy_(m)
            chunk[pc.local_start : pc.local_end].copy_(w)
            group = wrapped.group_of(i)
            state = {k: scalar_state(k, v, t, group) if v.dim() == 0
                     else v.to(master.device, master.dtype if v.is_floating_point() else v.dtype).clone()
                     for k, v in st.items()}
            if state:
                wrapped.set_state(i, state)
        # every rank's pieces of the model's weights, into the idle round buffer, then into the parameters
        all_gather_flat(flat.comm_weights, chunk, owners.session.collective_group())
        flat.install(owners.scheduler)


def _state_for(saved: Saved, keys: List[Key], pc: Any, whole: bool, index: int) -> Dict[str, torch.Tensor]:
    """Piece ``pc``'s state: the parameter's scalars, and each tensor cut from the saved pieces ``keys`` to the
    piece's elements (placed whole: the saved tensor as it is)."""
    out = dict(saved.scalars.get(index, {}))
    names = {k for key in keys for k in saved.state.get(key, {})}
    for name in sorted(names):
        per = {key: saved.state[key][name] for key in keys if name in saved.state.get(key, {})}
        if whole:
            out[name] = next(iter(per.values()))
        else:
            out[name] = _cut(per, sorted(per), pc.param_start, pc.param_end, f"optimizer state {name!r}", index)
    return out
