"""What the ranks must agree on, checked with collectives on the user's group.

Construction checks that every rank built the same model and options and
gives every rank the first rank's parameters (as DDP does); ``step()`` gives
every rank the first rank's model buffers (``buffers=``); ``finish()`` checks
that every rank handed off as many rounds. Each check raises on every rank
alike, so no rank is left waiting in a collective the others skipped.
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

__all__ = ["CALLS_AFTER_ROUNDS", "COLLECTIVE_CALLS", "all_gather_row", "broadcast_parameters", "check_same_model",
           "check_same_round_count", "digest", "fingerprints", "first_line", "hyper_fingerprint",
           "snapshot_hyperparams", "sync_buffers", "waiting_failed"]


def digest(text: str) -> int:
    """52 bits of a SHA-256: exact in an int64 and in a float64."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "little") >> 4


def snapshot_hyperparams(param_groups: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The groups' hyper-parameters as they are now, without their params (tensors cloned): what a hand-off gives
    the round, so a scheduler stepping meanwhile cannot change an update in flight."""
    return [{k: (v.clone() if torch.is_tensor(v) else v) for k, v in g.items() if k != "params"} for g in param_groups]


def hyper_fingerprint(hyper: List[Dict[str, Any]]) -> float:
    """One float64 that differs when any numeric or other hyper-parameter of any group differs.

    Computed on the host from the hand-off's snapshot; tensors on the host are read, others (CUDA) are
    left out rather than synchronised.
    """
    def value(v: Any) -> Any:
        if torch.is_tensor(v):
            return v.tolist() if v.device.type == "cpu" else "device tensor"
        if isinstance(v, (tuple, list)):
            return [value(x) for x in v]
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        return type(v).__qualname__  # an object's repr may hold its address, which differs across ranks

    return float(digest(repr([[(k, value(v)) for k, v in sorted(g.items())] for g in hyper])))


def fingerprints(param_groups: List[Dict[str, Any]], options: Sequence[Tuple[str, Any]], mesh_description: Any,
                 microbatches_per_update: Any) -> List[Tuple[str, Any]]:
    """(what, value) of everything an :class:`~acco.AccoOptimizer` needs equal on every rank: the model (its
    ``param_groups``, the mesh and placements of DTensor parameters), the micro-batches per update, every
    option (``options``: ``Options.agreed()``, one pair per field) and the hyper-parameters."""
    hyper = [{k: v for k, v in sorted(g.items()) if k != "params"} for g in param_groups]
    return [
        ("the model (parameter shapes/dtypes, param groups)",
         [len(g["params"]) for g in param_groups] + [f"{tuple(p.shape)}:{p.dtype}" for g in param_groups
                                                     for p in g["params"]]),
        ("the DeviceMesh and placements of DTensor parameters", mesh_description),
        ("microbatches_per_update", microbatches_per_update),
        *options,  # with timeout, every rank builds the control group (a collective): it must agree too
        ("the hyper-parameters of the param groups (lr, betas, weight_decay, ...)", hyper_fingerprint(hyper)),
    ]


COLLECTIVE_CALLS = ("AccoOptimizer(...) construction", "step() (the first update)", "finish()",
                    "load_state_dict() / acco.checkpoint.load()", "acco.checkpoint.save()", "acco.checkpoint.gather()",
                    "consolidated_state_dict()", "step() (compression='auto' choosing its format)")
# The calls made between updates, after the rounds: each first meets, on the rounds' group, a rank still in a round.
CALLS_AFTER_ROUNDS = COLLECTIVE_CALLS[2:]


def first_line(exc: BaseException, limit: int = 300) -> str:
    """The first line of what ``exc`` says (gloo's and DCP's messages run on with their own tracebacks)."""
    return (str(exc).strip().splitlines() or [""])[0][:limit]


def waiting_failed(call: str, exc: BaseException) -> RuntimeError:
    """gloo's "Timed out waiting ...", "Connection closed by peer" in public call ``call``, with acco's context."""
    return RuntimeError(
        f"AccoOptimizer {call}: waiting for the other ranks failed ({first_line(exc)}). {call} is collective: every rank "
        "must make this call at the same point of the loop. A rank that never makes it, or is in another "
        "collective, leaves the others waiting until the optimizer's timeout (without one, the process "
        "group's); or a peer died."
    )


def _gather(group: dist.ProcessGroup, mine: torch.Tensor, call: str) -> List[torch.Tensor]:
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    try:
        dist.all_gather(everyone, mine, group=group)  # every rank's tensor of ints, on the optimizer's control group
    except RuntimeError as exc:  # gloo's "Timed out waiting ...", "Connection closed by peer": with acco's context
        raise waiting_failed(call, exc) from exc
    return everyone


def all_gather_row(group: dist.ProcessGroup, row: List[int], device: torch.device, call: str) -> List[List[int]]:
    """Every rank's ``row`` of ints, in rank order. Collective on ``group``.

    ``call`` (one of :data:`COLLECTIVE_CALLS`) names the public call this is part of: a header of the call and
    the row's length is gathered first, so ranks in different calls (``finish()`` on one, ``load_state_dict()``
    on another) raise on every rank, naming both, instead of pairing unrelated collectives."""
    header = torch.tensor([COLLECTIVE_CALLS.index(call), len(row)], dtype=torch.int64, device=device)
    headers = [h.tolist() for h in _gather(group, header, call)]
    if len({tuple(h) for h in headers}) > 1:
        if len({h[0] for h in headers}) == 1:  # one call, at different steps of it (rows of other lengths)
            raise RuntimeError(
                f"AccoOptimizer: the ranks are at different steps of {call} (one of them left an earlier call "
                "part-way, by an exception caught on that rank alone, and made the call again). Every rank must "
                "leave a collective call the same way, at the same point of the loop."
            )
        where = ", ".join(f"rank {r} in {COLLECTIVE_CALLS[h[0]]}" for r, h in enumerate(headers))
        raise RuntimeError(
            f"AccoOptimizer: the ranks are in different collective calls ({where}). Construction, step(), "
            "finish(), load_state_dict() and acco.checkpoint.save/load/gather must be called on every rank, at "
            "the same point of the loop."
        )
    mine = torch.tensor(row, dtype=torch.int64, device=device)
    return [t.tolist() for t in _gather(group, mine, call)]


def check_same_model(group: dist.ProcessGroup, fields: Sequence[Tuple[str, Any]], numel: int, ntensors: int,
                     device: torch.device) -> None:
    """All-gather digests of ``fields`` ((what, value) pairs); raise on every rank if any differ. Collective."""
    row = [ntensors, numel] + [digest(repr(value)) for _, value in fields]
    rows = all_gather_row(group, row, device, "AccoOptimizer(...) construction")
    if any(r != rows[0] for r in rows):
        differ = [what for i, (what, _) in enumerate(fields) if len({r[i + 2] for r in rows}) > 1]
        detail = "; ".join(f"rank {i}: {r[0]} tensors, {r[1]} elements" for i, r in enumerate(rows))
        raise RuntimeError(
            f"AccoOptimizer: the ranks disagree on {', '.join(differ) or 'the model'} ({detail}). Build the "
            "same model and AccoOptimizer arguments on every rank: each rank would otherwise step its shard "
            "with its own values."
        )


def broadcast_parameters(params: Sequence[torch.Tensor], group: Optional[dist.ProcessGroup]) -> None:
    """Give every rank the group's first rank's parameters, as DDP does; one tensor at a time (no
    model-sized temporary). Collective on ``group``."""
    if group is None:
        return
    src = dist.get_global_rank(group, 0)
    with torch.no_grad():
        for p in params:
            dist.broadcast(p.data, src=src, group=group)


def sync_buffers(buffers: Sequence[torch.Tensor], group: Optional[dist.ProcessGroup]) -> None:
    """The model's buffers (``buffers=``) from the group's first rank, as DDP does at every step; one
    message per dtype. Collective on ``group``."""
    if not buffers or group is None:
        return
    src = dist.get_global_rank(group, 0)
    by_dtype: Dict[torch.dtype, List[torch.Tensor]] = {}
    for t in buffers:
        by_dtype.setdefault(t.dtype, []).append(t)
    with torch.no_grad():
        for same in by_dtype.values():
            flat = torch.cat([t.reshape(-1) for t in same])
            dist.broadcast(flat, src=src, group=group)
            torch._foreach_copy_(same, [f.view_as(t) for f, t in zip(flat.split([t.numel() for t in same]), same)])


def check_same_round_count(gather_row: Callable[[List[int], str], List[List[int]]], num_rounds: int) -> None:
    """Raise on every rank if the ranks handed off different numbers of rounds. Collective (``gather_row``: the
    optimizer's :meth:`acco.session.Session.gather_row`)."""
    counts = [row[0] for row in gather_row([num_rounds], "finish()")]
    if len(set(counts)) > 1:
        raise RuntimeError(
            f"AccoOptimizer.finish(): the ranks handed off different numbers of rounds {counts} "
            "(rank i at index i), so their last rounds can never complete. Make every rank run the "
            "same number of updates, e.g. loop while opt.next_update_index < total_updates."
        )
