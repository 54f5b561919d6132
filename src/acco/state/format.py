"""What an :class:`~acco.AccoOptimizer` state dict is: its entries, its description, and what a load refuses.

Format 3 (per parameter). Every entry is keyed by a *piece*, ``"i:a"``: the
elements ``[a, a + n)`` of flattened parameter ``i`` that one rank held (a
parameter placed whole is one piece, ``"i:0"``). Keys are parameter indices,
never ``id(p)``::

    master/i:a        the fp32 master weights of the piece (1-D)
    params/i:a        the model's weights for the next micro-batch, same elements (compute dtype)
    state/i:a/K       the wrapped optimizer's state K of the piece, as it holds it (AdamW's exp_avg 1-D,
                      Muon's momentum_buffer in the matrix's shape, Adafactor's row_var, step 0-d ...)
    entries/i:a       how many state entries the piece has (a load target that lists fewer is refused)
    hyper/G.K         numeric hyper-parameter K of param group G (lr, betas, ...)
    counters          the saved progress (``progress.Progress.SAVED``, in that order)
    loss_scale        the GradScaler's scale for the next update (fp64, 0-d), where one drives the optimizer
                      (mode acco's first estimate after a load unscales by it)
    residual          with compression: this rank's error-feedback residual, full size (``residual/r{rank}``
                      in the DCP form; :mod:`acco.state.residual`)

and what it is: ``acco`` (``opt.state_dict()``: format, mode, wrapped
optimizer(s), layout, dtypes, and the rank and world size it was taken on) or
``meta`` (the sharded form for DCP: the same less rank and world size, as
tensors). Each rank's pieces have keys of their own, so DCP writes every piece
once, from the rank that holds it, and any number of ranks reads back the
pieces that overlap its own (:mod:`acco.state.pieces`). Format 2 (flat
tensors of all parameters end to end, before whole-tensor placement) is read
by :mod:`acco.state.legacy`.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..errors import ShardOfAnotherRankError

__all__ = ["AccoStateDict", "FORMAT_VERSION", "PER_RANK_SECTIONS", "PIECE_SECTIONS", "empty_sections", "GATHERED", "ShardOfAnotherRankError", "SHARD_FIX", "IMPLEMENTATION_FLAGS", "StateOwners", "check_compatible", "classify",
           "decode_meta", "encode_meta", "hyper_entries", "own_entry", "piece_key", "parse_piece_key",
           "restore_hyper", "describe_weights", "describe_wire", "weights_codec"]

FORMAT_VERSION = 3
# The per-piece sections of a state dict (format 3), in this order wherever they are written or read.
PIECE_SECTIONS = ("master", "params", "state", "entries", "scalars")
# The sections whose entries differ between ranks (the pieces, compression's residuals, state/residual.py, and
# outer_every's slices, state/outer_state.py): each rank writes, and checksums, its own.
PER_RANK_SECTIONS = (*PIECE_SECTIONS, "residual", "outer")
GATHERED = "acco_ranks"  # acco.checkpoint.gather(): every rank's state_dict(), in rank order

# Param-group keys that choose how the wrapped optimizer computes, not what: neither saved nor restored, so a
# checkpoint taken on a GPU (fused or capturable there, see _validation.device_kernel) resumes on a CPU.
IMPLEMENTATION_FLAGS = frozenset({"foreach", "fused", "capturable", "differentiable"})


@dataclass
class StateOwners:
    """What the state dict code reads and restores, handed to it by the optimizer: the owners of the state.

    ``layout`` (where every parameter lives), ``flat`` (the buffers), ``wrapped`` (the wrapped optimizers),
    ``progress`` (the counters), ``driver`` (the round in flight), ``param_groups`` (the live groups),
    ``describe`` (what this optimizer is: mode, optimizer classes, layout, dtypes) and ``session``
    (the agreement exchange of the public collective calls, the group checkpoints' collectives use, and whether
    the call is made inside ``committed_weights()`` with the round buffer holding the model's weights)."""

    layout: Any
    rank: int
    world_size: int
    flat: Any
    wrapped: Any
    progress: Any
    driver: Any
    scheduler: Any
    param_groups: List[Dict[str, Any]]
    describe: Dict[str, Any]
    session: Any  # the agreement exchange, the collectives' group, the committed-weights view (session.py)
    process_group: Any
    # Options.check_microbatches: refuses a loaded microbatches_per_update the options cannot run with
    check_microbatches: Any = None
    loss_scale: Any = None  # what the optimizer knows of a GradScaler (amp.LossScale): its scale is saved
    auto: Any = None  # compression="auto" (auto.AutoCompression): its choice is saved and taken back


NOT_A_TORCH_STATE = (
    "this is an AccoOptimizer's state dict (one rank's shard, keyed by parameter pieces), not a torch optimizer's: "
    "it has no 'param_groups'. To go on with a plain torch optimizer, take opt.consolidated_state_dict() on every "
    "rank (the wrapped optimizer's own format, every parameter's full state) and load that; to resume an "
    "AccoOptimizer, load it with AccoOptimizer.load_state_dict (docs/checkpointing.md)"
)


class _NotATorchState(KeyError):
    """A torch optimizer's ``load_state_dict`` asked an AccoOptimizer state dict for ``'param_groups'``."""

    def __str__(self) -> str:
        return NOT_A_TORCH_STATE


class AccoStateDict(dict):
    """What ``opt.state_dict()`` returns: a plain mapping to ``torch.save`` (pickled as an ``OrderedDict``, as a
    module's state dict is, so ``torch.load`` with ``weights_only=True`` reads it anywhere, without acco), which, handed in memory to a torch optimizer's ``load_state_dict``
    (it reads ``'param_groups'`` first, from a shallow ``copy()``), says what to do instead of a bare
    ``KeyError``. A file read back is a plain OrderedDict: torch then raises ``KeyError: 'param_groups'``."""

    def __missing__(self, key: Any) -> Any:
        if key == "param_groups":
            raise _NotATorchState(key)
        raise KeyError(key)

    def copy(self) -> "AccoStateDict":
        return AccoStateDict(self)

    def __reduce_ex__(self, protocol: Any) -> Any:
        # As a module's state dict pickles (an OrderedDict is one of weights_only's allowed globals; dict is not)
        return (OrderedDict, (), None, None, iter(self.items()))


def empty_sections() -> Dict[str, Dict[str, Any]]:
    """The per-piece sections, empty (:data:`PIECE_SECTIONS`)."""
    return {k: {} for k in PIECE_SECTIONS}


def piece_key(index: int, start: int) -> str:
    return f"{index}:{start}"


def parse_piece_key(key: str) -> tuple:
    index, start = key.split(":")
    return int(index), int(start)


# ------------------------------------------------------------------ description


def describe_weights(codec: Optional[Tuple[str, int]]) -> str:
    """How the rounds' weights travel now (``codec``: the transport's ``weights_codec``), for a state's
    description (``"weights"``): ``"exact"``, or ``"KIND block B"`` with compressed weights. The committed
    weights a checkpoint holds are rebuilt at a load the way they travelled, whatever the loading optimizer's
    own settings (``compression`` may change)."""
    if codec is None:
        return "exact"
    return f"{codec[0]} block {codec[1]}"


def describe_wire(owners: "StateOwners") -> Dict[str, Any]:
    """The description's entries that the run's rounds set (a state is saved with them): how the committed
    weights travelled, and ``compression="auto"``'s choice so far (``"undecided"`` before it)."""
    out = {"weights": describe_weights(owners.flat.transport.weights_codec)}
    if owners.auto is not None:
        out["auto"] = owners.auto.decided or "undecided"
    return out


def weights_codec(text: Optional[str]) -> Optional[Tuple[str, int]]:
    """``(kind, block)`` of :func:`describe_weights`'s text, None for ``"exact"``."""
    if text is None or text == "exact":
        return None
    kind, _, block = text.split()
    return kind, int(block)


def encode_meta(meta: Dict[str, Any]) -> Dict[str, torch.Tensor]:
    """Strings and ints as tensors (DCP stores tensors only; nothing is pickled)."""
    return {k: torch.tensor(v, dtype=torch.int64) if isinstance(v, int) else torch.tensor(list(str(v).encode()), dtype=torch.uint8)
            for k, v in meta.items()}


def decode_meta(meta: Dict[str, torch.Tensor]) -> Dict[str, Any]:
    return {k: int(v.item()) if v.dtype == torch.int64 else bytes(v.tolist()).decode() for k, v in meta.items()}


def classify(sd: Any) -> str:
    """``"rank_shard"`` (``opt.state_dict()``) or ``"sharded"`` (the DCP form); raises for anything else."""
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


SHARD_FIX = (
    "Save one file per rank and load each rank its own (torch.save(opt.state_dict(), f'optim.rank{rank}.pt'), then "
    "torch.load(f'optim.rank{rank}.pt')), or save every rank's shard in one file with "
    "acco.checkpoint.gather(opt, model=model) on every rank (load that file on every rank: each takes its own), "
    "or use acco.checkpoint.save/load (any number of ranks)"
)


def brief_mesh(mesh: str) -> str:
    """A state's mesh description (one ``;``-separated row per parameter) with runs of equal rows written once
    and counted: a model's 83 parameters under one FSDP2 placement are one row, not 83."""
    body, sep, shard = mesh.rpartition(" as ") if " as " in mesh else (mesh, "", "")
    rows: List[List[Any]] = []
    for row in body.split(";"):
        if rows and rows[-1][0] == row:
            rows[-1][1] += 1
        else:
            rows.append([row, 1])
    return ";".join(f"{row} x{n}" if n > 1 else row for row, n in rows) + sep + shard


def check_compatible(mine: Dict[str, Any], saved: Dict[str, Any], rank_shard: bool, rank: int, world_size: int) -> None:
    """Refuse a state dict that another optimizer, model, mode or rank wrote, before any state changes."""
    if saved.get("format") not in (2, FORMAT_VERSION):
        raise ValueError(
            f"AccoOptimizer state dict of format {saved.get('format')!r}; this acco reads formats 2 and "
            f"{FORMAT_VERSION}: it was written by another acco version. Nothing was loaded."
        )
    # The placements first: another intra-host parallelism changes the local shapes (the layout) too.
    if saved.get("mesh", "no mesh") != mine.get("mesh", "no mesh"):
        raise ValueError(
            f"AccoOptimizer.load_state_dict(): the state was written with DTensor parameters "
            f"{brief_mesh(saved.get('mesh', 'no mesh'))!r}; this optimizer's are "
            f"{brief_mesh(mine.get('mesh', 'no mesh'))!r} (placements on the parameters' mesh, and this "
            "rank's model shard). Resume with the same intra-host parallelism (the same FSDP2/tensor-parallel "
            "plan on a mesh of the same shape; the number of hosts may change with acco.checkpoint), and with "
            "each rank's own file for opt.state_dict(). Nothing was loaded."
        )
    for key, fix in (("mode", "build the AccoOptimizer with mode={!r} to resume it"),
                     ("optimizer", "build the AccoOptimizer around {} to resume it"),
                     ("layout", "resume with the same model (the same trainable parameters, in the same order, "
                                "with the same optimizer classes): {}"),
                     ("dtypes", "build the AccoOptimizer with the same compute_dtype ({})")):
        if saved.get(key) != mine[key]:
            raise ValueError(
                f"AccoOptimizer.load_state_dict(): the state dict was written with {key} {saved.get(key)!r}, this "
                f"optimizer has {mine[key]!r}: {fix.format(saved.get(key))}. Nothing was loaded."
            )
    if rank_shard and (saved.get("rank"), saved.get("world_size")) != (rank, world_size):
        if saved.get("world_size") == world_size and isinstance(saved.get("rank"), int):
            other = saved["rank"]
            raise ShardOfAnotherRankError(
                f"AccoOptimizer.load_state_dict() on rank {rank}: this state dict is rank {other}'s shard "
                f"(opt.state_dict() holds one rank's 1/{world_size} of the optimizer), loaded here on rank {rank}: "
                f"every rank read rank {other}'s file. {SHARD_FIX}. Nothing was loaded.", other
            )
        raise ValueError(
            f"AccoOptimizer.load_state_dict(): this state dict holds the optimizer shard of rank {saved.get('rank')} "
            f"of {saved.get('world_size')} (opt.state_dict() is this rank's 1/N slice), but this is rank "
            f"{rank} of {world_size}. Save and load it on every rank, each its own file "
            "(torch.save(opt.state_dict(), f'optim.rank{rank}.pt')), or use acco.checkpoint.save/load (any number "
            "of ranks), or opt.consolidated_state_dict() on all ranks. Nothing was loaded."
        )


def own_entry(sd: Any, rank: int, world_size: int) -> Any:
    """This rank's state dict: ``sd`` itself, or its entry of a gathered one (``acco.checkpoint.gather``)."""
    if not (isinstance(sd, dict) and GATHERED in sd):
        return sd
    entries = sd[GATHERED]
    if not isinstance(entries, (list, tuple)) or len(entries) != world_size:
        n = len(entries) if isinstance(entries, (list, tuple)) else type(entries).__name__
        raise ValueError(
            f"AccoOptimizer.load_state_dict(): the checkpoint holds the optimizer state of {n} rank(s) "
            f"(acco.checkpoint.gather), this run has {world_size}. Resume on {n} rank(s), or save with "
            "acco.checkpoint.save/load (DCP), which load on any number of ranks. Nothing was loaded."
        )
    return entries[rank]


# ------------------------------------------------------------------ hyper-parameters


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


def hyper_entries(param_groups: List[Dict[str, Any]]) -> Dict[str, torch.Tensor]:
    """``"G.K"`` -> the numeric hyper-parameters of every group (not the implementation flags)."""
    out = {}
    for gi, group in enumerate(param_groups):
        for key, value in group.items():
            t = None if key in ("params", "optimizer_class") or key in IMPLEMENTATION_FLAGS else _numeric_hyper(value)
            if t is not None:
                out[f"{gi}.{key}"] = t
    return out


def _restore_value(current: Any, saved: torch.Tensor) -> Any:
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
    if current is None:  # a key this group lacks (a scheduler's initial_lr, when the state is loaded first)
        return float(saved.item()) if saved.dim() == 0 else tuple(saved.tolist())
    return current


def restore_hyper(param_groups: List[Dict[str, Any]], hyper: Dict[str, torch.Tensor]) -> None:
    for key, value in hyper.items():
        gi, name = key.split(".", 1)
        if name in IMPLEMENTATION_FLAGS:  # how this run's optimizer computes (its device's choice), not what
            continue
        group = param_groups[int(gi)]
        group[name] = _restore_value(group.get(name), value)  # a key the group lacks is added, as torch's load does
