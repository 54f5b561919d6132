"""The few collectives a round uses, with a single-process fallback.

Every function here is collective: call it on all ranks of ``group`` in the same
order. With ``group=None`` (no process group: one process) each reduces to a
local copy, so the same round code serves one process and many.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

__all__ = [
    "all_gather_flat",
    "all_reduce_max",
    "all_reduce_sum",
    "connect",
    "destroy_spare_round_groups",
    "group_rank",
    "group_size",
    "new_local_group",
    "new_round_group",
    "reduce_scatter_flat",
    "release_round_group",
    "ring_algorithm",
    "ring_all_gather",
    "ring_reduce_scatter",
]

# torch >= 2.13 names the flat collectives *_single; older releases *_tensor.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

RING_ENV = "ACCO_RING"
_RING_PIECES = 4  # point-to-point messages per ring step
_RING_MIN_PIECE = 1 << 16  # elements; smaller buffers go in one message


def group_size(group: Optional[dist.ProcessGroup]) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: Optional[dist.ProcessGroup]) -> int:
    return 0 if group is None else dist.get_rank(group)


def ring_algorithm(group: Optional[dist.ProcessGroup]) -> str:
    """``"ring"`` on gloo, ``"native"`` elsewhere; ``ACCO_RING=0|1`` overrides (``1`` is refused on NCCL).

    A round's reduce-scatter and all-gather. gloo runs ``reduce_scatter_tensor``
    as a full all-reduce and keeps a slice, which sends twice the bytes a
    reduce-scatter needs, and its all-gather does not use both directions of a
    link at once. :func:`ring_reduce_scatter` and :func:`ring_all_gather` send
    the minimum, ``(N-1)/N`` of the buffer per rank, in both directions at once
    (``docs/benchmarks.md`` §1 measures both).
    """
    choice = os.environ.get(RING_ENV, "").strip()
    if choice and choice not in ("0", "1"):
        raise ValueError(f"{RING_ENV} must be 0 (native collectives) or 1 (ring), got {choice!r}")
    backend = dist.get_backend(group) if group is not None else None
    if choice == "1" and backend == "nccl":
        raise ValueError(
            f"{RING_ENV}=1 asks for the point-to-point ring, but the round group's backend is nccl: NCCL requires "
            "matching irecv/isend pairs to be posted in one group, and its native reduce-scatter and all-gather "
            f"are already bandwidth-optimal rings. Unset {RING_ENV} (or set {RING_ENV}=0) on NCCL"
        )
    if choice:
        return "ring" if choice == "1" else "native"
    if backend == "gloo":
        return "ring"
    return "native"


# Round groups made by local synchronisation (over a subgroup, e.g. a DeviceMesh dimension), kept for reuse:
# torch names such a group after its ranks, and one destroyed and made again would read its predecessor's
# addresses from the store (gloo: "connectFullMesh ... Connection refused").
_SPARE: Dict[Tuple[Any, ...], List[dist.ProcessGroup]] = {}
_KEY: Dict[dist.ProcessGroup, Tuple[Any, ...]] = {}


def new_round_group(group: dist.ProcessGroup, timeout: Any) -> dist.ProcessGroup:
    """A process group of its own for rounds, over ``group``'s ranks (a spare one when a finished optimizer left
    one). Collective on ``group``'s ranks (all of WORLD's when ``group`` is WORLD)."""
    ranks, backend = dist.get_process_group_ranks(group), dist.get_backend(group)
    if group is dist.group.WORLD:
        return dist.new_group(ranks=ranks, backend=backend, timeout=timeout)
    return new_local_group(ranks, backend, timeout)


def new_local_group(ranks: List[int], backend: str, timeout: Any) -> dist.ProcessGroup:
    """A process group over ``ranks`` made by those ranks alone (a spare one when a finished optimizer left
    one). Collective on ``ranks``."""
    key = (tuple(ranks), backend, timeout)
    spare = _SPARE.get(key)
    if spare:
        return spare.pop()  # every rank of the group finished its previous optimizer alike: each pops one
    made = dist.new_group(ranks=ranks, backend=backend, timeout=timeout, use_local_synchronization=True)
    _KEY[made] = key
    return made


def release_round_group(group: dist.ProcessGroup, abort: bool = False) -> None:
    """A finished optimizer's round group: kept for the next one when made over a subgroup, else destroyed
    (``abort``: aborted, not kept: its last round may not have ended). Local: no collective."""
    if not dist.is_initialized() or group not in dist.distributed_c10d._world.pg_map:
        return  # already gone (the default group was destroyed with every group)
    if abort:
        _KEY.pop(group, None)
        dist.distributed_c10d._abort_process_group(group)  # local: cancels the group's pending work
    elif group in _KEY:
        _SPARE.setdefault(_KEY[group], []).append(group)
    else:
        dist.destroy_process_group(group)


def destroy_spare_round_groups() -> None:
    """At interpreter exit: destroy the kept round groups (gloo work freed during interpreter finalisation
    aborts the process). Local."""
    for groups in _SPARE.values():
        for group in groups:
            _KEY.pop(group, None)
            if dist.is_initialized() and group in dist.distributed_c10d._world.pg_map:
                dist.destroy_process_group(group)
    _SPARE.clear()


def connect(group: Optional[dist.ProcessGroup], device: torch.device) -> None:
    """Establish ``group``'s communicator now with one 1-element all-reduce. Collective.

    NCCL creates a communicator lazily, at its first collective. For the round group that would be the
    first estimate's hand-off, inside ``backward()`` (on autograd's device thread, while other
    communicators may be busy); called at construction, the connection is made from the training thread,
    in the same program order on every rank.
    """
    if group is not None:
        dist.all_reduce(torch.zeros(1, device=device), group=group)


def reduce_scatter_flat(
    out: torch.Tensor, flat: torch.Tensor, group: Optional[dist.ProcessGroup], algorithm: str = "native"
) -> None:
    """Sum ``flat`` over ranks and keep this rank's slice in ``out``. Collective.

    With ``algorithm="ring"`` ``flat`` is used as scratch and left holding partial sums.
    """
    if group is None:
        out.copy_(flat)
    elif algorithm == "ring":
        ring_reduce_scatter(out, flat, group)
    else:
        _reduce_scatter(out, flat, group=group)


def ring_reduce_scatter(out: torch.Tensor, flat: torch.Tensor, group: dist.ProcessGroup) -> None:
    """Reduce-scatter (sum) by a ring of point-to-point sends. Collective.

    ``flat`` holds ``N`` equal chunks; rank ``r`` ends with the sum of every
    rank's chunk ``r`` in ``out``. At step ``s`` rank ``r`` sends its partial
    sum of chunk ``r-s-1`` to rank ``r+1`` and adds the partial sum of chunk
    ``r-s-2`` received from rank ``r-1`` into its own; after ``N-1`` steps the
    chunk it holds is complete. Each rank sends ``(N-1)/N`` of ``flat``, once.
    ``out`` doubles as the receive buffer and ``flat`` is overwritten with
    partial sums.
    """
    n, r, nxt, prv = _ring_peers(group)
    if flat.numel() != n * out.numel():
        raise ValueError(f"ring_reduce_scatter: flat has {flat.numel()} elements, expected {n} x {out.numel()}")
    chunks = flat.view(n, -1)
    if n == 1:
        out.copy_(chunks[0])
        return
    for s in range(n - 1):
        send_idx, recv_idx = (r - s - 1) % n, (r - s - 2) % n
        # this rank's partial sum of chunk send_idx out; the previous rank's of chunk recv_idx in
        _exchange(chunks[send_idx], nxt, out, prv, group)
        if s < n - 2:
            chunks[recv_idx].add_(out)
        else:  # recv_idx == r: the last contribution missing is this rank's own
            out.add_(chunks[r])


def all_gather_flat(
    flat: torch.Tensor, shard: torch.Tensor, group: Optional[dist.ProcessGroup], algorithm: str = "native"
) -> None:
    """Concatenate every rank's ``shard`` into ``flat``. Collective."""
    if group is None:
        flat.copy_(shard)
    elif algorithm == "ring":
        ring_all_gather(flat, shard, group)
    else:
        _all_gather(flat, shard, group=group)


def _exchange(send: torch.Tensor, dst: int, recv: torch.Tensor, src: int, group: dist.ProcessGroup) -> None:
    """Send ``send`` to global rank ``dst`` while receiving ``recv`` from ``src``. Point-to-point.

    Receives are posted before the sends (gloo then streams both directions at
    once; docs/studies/benchmarks-overlap.md section 1 measures it against send-then-receive),
    in a few tagged pieces so that both directions stay busy.
    """
    pieces = max(1, min(_RING_PIECES, recv.numel() // _RING_MIN_PIECE))
    works = [dist.irecv(piece, src=src, group=group, tag=i) for i, piece in enumerate(recv.tensor_split(pieces))]
    works += [dist.isend(piece, dst=dst, group=group, tag=i) for i, piece in enumerate(send.tensor_split(pieces))]
    for work in works:
        work.wait()


def _ring_peers(group: dist.ProcessGroup):
    n, r = dist.get_world_size(group), dist.get_rank(group)
    return n, r, dist.get_global_rank(group, (r + 1) % n), dist.get_global_rank(group, (r - 1) % n)


def ring_all_gather(flat: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup) -> None:
    """All-gather by a ring of point-to-point sends. Collective.

    Rank ``r`` copies its ``shard`` into chunk ``r`` of ``flat``; at step ``s``
    it forwards chunk ``r-s`` to rank ``r+1`` and receives chunk ``r-s-1`` from
    rank ``r-1``. Each rank sends ``(N-1)/N`` of ``flat``, once.
    """
    n, r, nxt, prv = _ring_peers(group)
    if flat.numel() != n * shard.numel():
        raise ValueError(f"ring_all_gather: flat has {flat.numel()} elements, expected {n} x {shard.numel()}")
    chunks = flat.view(n, -1)
    chunks[r].copy_(shard)
    for s in range(n - 1):
        _exchange(chunks[(r - s) % n], nxt, chunks[(r - s - 1) % n], prv, group)


def all_reduce_max(t: torch.Tensor, group: Optional[dist.ProcessGroup]) -> None:
    """The elementwise max of ``t`` over ranks, in place. Collective."""
    if group is not None:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)


def all_reduce_sum(t: torch.Tensor, group: Optional[dist.ProcessGroup]) -> None:
    """Sum ``t`` over ranks in place. Collective."""
    if group is not None:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)


def resolve_process_group(process_group: Optional[dist.ProcessGroup]) -> Optional[dist.ProcessGroup]:
    """The group to use (a 1-D ``DeviceMesh``, e.g. ``mesh["dp"]``, stands for its group); ``None`` means one
    process without collectives."""
    if type(process_group).__name__ == "DeviceMesh":
        if process_group.ndim != 1:
            raise ValueError(
                f"process_group is a {process_group.ndim}-D DeviceMesh {process_group.mesh_dim_names}: pass the one "
                "data-parallel dimension ACCO runs over, e.g. mesh['dp'] (tensor parallelism stays on mesh['tp'])")
        process_group = process_group.get_group()
    if process_group is not None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("process_group given but torch.distributed is not initialised: call "
                               "torch.distributed.init_process_group(...) first")
        if dist.get_rank(process_group) < 0:
            raise ValueError(
                f"this process (global rank {dist.get_rank()}) is not a member of the given process_group "
                f"(ranks {dist.get_process_group_ranks(process_group)}): build AccoOptimizer only on the group's "
                "ranks, with the group's own handle"
            )
        return process_group
    if dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    world = os.environ.get("WORLD_SIZE")
    if world is not None and world.isdigit() and int(world) > 1:
        raise RuntimeError(
            f"WORLD_SIZE={world} but torch.distributed is not initialised: call "
            "torch.distributed.init_process_group(...) before building AccoOptimizer (with a Hugging Face "
            "Trainer, use acco.integrations.hf.AccoTrainer: it builds the optimizer once TrainingArguments has "
            "initialised torch.distributed)"
        )
    return None
