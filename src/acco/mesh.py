"""DTensor parameters (FSDP2 or tensor parallelism on a ``DeviceMesh``): ACCO over the data-parallel group, on
local shards.

A model sharded the torchtitan way holds ``DTensor`` parameters whose mesh is
the intra-host dimension (``mesh["tp"]``, FSDP2's or tensor parallelism's); the data-parallel dimension
across hosts (``mesh["dp"]``) is ACCO's. Ranks of one data-parallel group hold
the same shard of every parameter, so ACCO runs unchanged on each rank's
*local* shards: the flat buffers, the theta/theta~ swap, the accumulation and
the round's reduce-scatter -> sharded step -> all-gather act on the local
tensors (which share the DTensors' storage), and the round's collectives run
on the data-parallel group only.

A model's parameters may mix DTensors on several meshes and plain tensors (a
tensor-parallel plan that leaves the norms and embeddings alone, FSDP2 after
it on another dimension): what matters is which ranks hold the same piece of
each parameter. A parameter's *signature* on a rank is the chunk it holds
along each mesh dimension it is sharded on (a plain tensor's is empty: whole,
replicated); ranks of the model group (every rank holding a part of this
rank's model: the union of the parameters' meshes) with equal signatures hold
equal values, which construction checks (:func:`check_replicas`).

Gradients: autograd (tensor parallelism) or FSDP2's reduce-scatter (which
then runs the parameter's post-accumulate hooks) puts a ``DTensor`` gradient in
each parameter's ``.grad``; the parameter's post-accumulate hook moves its
local shard into the library's buffer (:meth:`LocalShards.take_grad`) and sets
``.grad`` to ``None``, so the usual machinery sees a plain gradient.

The round's gradient norm (clipping, the non-finite check) spans the model: each
rank's sum of squares over :func:`counted_ranges` (a replicated piece counted
once, by the lowest rank holding it), summed over the data-parallel group and
then over the model group (a group of the rounds' own), so every shard clips
by the same factor and skips the same rounds.

What is not supported yet is refused at construction (:func:`check_supported`):
whole-tensor optimizers (Muon, Adafactor), dtypes other than the parameters';
a gradient that arrives without running the hooks, at ``step()``. No
collective here except :func:`check_replicas`.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .errors import ModelMovedError

__all__ = ["LocalShards", "check_replicas", "check_supported", "counted_ranges", "is_dtensor", "norm_group_ranks",
           "refuse_grad_outside_autograd", "signature", "warn_short_update"]


def is_dtensor(p: Any) -> bool:
    """Whether ``p`` is a ``torch.distributed.tensor.DTensor`` (without importing it for plain models)."""
    return any(c.__name__ == "DTensor" for c in type(p).__mro__)


class LocalShards:
    """The user's parameters, and the plain tensor ACCO works on for each: a DTensor's local shard (the same
    storage, so writes into it are the DTensor's), or the plain parameter itself."""

    def __init__(self, params: Sequence[torch.Tensor], streams: Any = None) -> None:
        self.params = list(params)
        self._streams = streams  # the device's stream API (device_api.py); None on CPU
        self._hook_streams: List[Any] = []  # CUDA: the streams take_grad wrote the buffer on since the last wait
        self.sharded = [is_dtensor(p) for p in self.params]
        self.any = any(self.sharded)
        self.locals: List[torch.Tensor] = [p._local_tensor if s else p for p, s in zip(self.params, self.sharded)]
        meshes = {id(p.device_mesh): p.device_mesh for p, s in zip(self.params, self.sharded) if s}
        # Every rank holding a part of this rank's model (the union of the parameters' meshes), sorted.
        self.model_ranks: List[int] = sorted({r for m in meshes.values() for r in m.mesh.flatten().tolist()})
        self.signatures = [signature(p) if s else () for p, s in zip(self.params, self.sharded)]

    @torch.no_grad()
    def take_grad(self, index: int) -> None:
        """Post-accumulate hook of DTensor parameter ``index``: add its local gradient into the local tensor's
        ``.grad`` (the library's buffer) and drop the DTensor gradient."""
        p = self.params[index]
        if not self.sharded[index] or p.grad is None:
            return
        local = self.locals[index]
        if p._local_tensor is not local:
            raise ModelMovedError(
                f"AccoOptimizer: parameter {index}'s local shard was replaced after the optimizer was built (FSDP2 "
                "replaces it when the model's state is loaded into it or its storage is reset), so the optimizer's "
                "updates would no longer reach the model. Build AccoOptimizer after loading the model's weights.")
        grad = p.grad
        if tuple(grad.placements) != tuple(p.placements):
            # The gradient is not laid out as the parameter, as FSDP2 also finds it: a Replicate parameter's
            # gradient may be a Partial sum over a mesh dimension (a SequenceParallel norm's weight, a Rowwise
            # bias with sequence-sharded output), whose local piece is only part of the sum (one all-reduce
            # over that dimension, the fast link inside a host, issued in backward in the same order on its
            # ranks); a Shard(0) embedding's may come Replicate (this rank's rows taken, no communication).
            grad = grad.redistribute(grad.device_mesh, p.placements)
        grad = grad.to_local()
        if local.grad is None:
            local.grad = grad.clone()
        else:
            local.grad.add_(grad)
        p.grad = None
        if self._streams is not None:
            # FSDP2 runs this hook on its post-reduce stream, and waits for that stream at the end of backward
            # only when the backward is the last (set_is_last_backward): the buffer's readers wait instead.
            stream = self._streams.current_stream()
            if not any(stream == s for s in self._hook_streams):
                self._hook_streams.append(stream)

    def order_grads(self) -> None:
        """CUDA: make the current (compute) stream wait for the streams ``take_grad`` added gradients on (FSDP2's
        post-reduce stream) since the last call, before anything reads the buffer: the estimate's hand-off at the
        end of a backward, ``step()``'s fold or commit."""
        if not self._hook_streams:
            return
        current = self._streams.current_stream()
        for stream in self._hook_streams:
            if not stream == current:
                current.wait_stream(stream)  # stream hand-off: the hooks' adds into the buffer, then its readers
        self._hook_streams.clear()

    def shard_name(self) -> Optional[str]:
        """This rank's model shard, by its place in the model group (``"shard1"``):
        the namespace of its pieces in a DCP checkpoint, where ranks of one data-parallel group share one
        shard and ranks of different shards hold different tensors under the same piece keys. ``None``
        without a mesh."""
        if not self.any:
            return None
        return f"shard{self.model_ranks.index(dist.get_rank())}"

    def checkpoint_group(self, group: Optional[dist.ProcessGroup]) -> Optional[dist.ProcessGroup]:
        """The group a DCP checkpoint of DTensor parameters is written and read by: every rank of the
        data-parallel group times the model group, which must be the default group (DCP names its files by
        rank, so two data-parallel groups writing one folder apart would overwrite each other's)."""
        if not self.any:
            return group
        world, inside = dist.get_world_size(), len(self.model_ranks)
        covered = (dist.get_world_size(group) if group is not None else 1) * inside
        if covered != world:
            raise NotImplementedError(
                f"acco.checkpoint with DTensor parameters: the data-parallel group ({covered // inside} "
                f"ranks) times the parameters' meshes ({inside} ranks) covers {covered} of the "
                f"{world} ranks (pipeline stages or other groups beside it?); a checkpoint is written by every "
                "rank of the default group, so it must be exactly that. Save opt.state_dict() per rank instead "
                "(docs/models-larger-than-one-device.md)")
        return dist.group.WORLD

    def describe(self) -> str:
        """What the mesh and the placements are, for the fingerprint every rank must agree on."""
        if not self.any:
            return "no mesh"
        rows = [f"{tuple(p.device_mesh.mesh_dim_names or ())}:{p.device_mesh.shape}:{tuple(map(str, p.placements))}"
                for p, s in zip(self.params, self.sharded) if s]
        return ";".join(rows)


def signature(p: Any) -> tuple:
    """Which piece of DTensor ``p`` this rank holds: ``(mesh dimension, tensor dimension, chunk)`` for each mesh
    dimension it is sharded on (the dimension by name where the mesh has names). Ranks with equal signatures
    hold the same piece."""
    mesh, coordinate = p.device_mesh, p.device_mesh.get_coordinate()
    names = mesh.mesh_dim_names or tuple(range(mesh.ndim))
    # Any placement but Replicate splits the tensor (FSDP2 over tensor parallelism on the same dimension
    # places _StridedShard, which is_shard() does not count).
    return tuple(sorted((str(names[d]), getattr(pl, "dim", -1), coordinate[d]) for d, pl in enumerate(p.placements)
                        if not pl.is_replicate()))


def norm_group_ranks(shards: LocalShards) -> Optional[List[int]]:
    """The ranks a round's gradient norm is summed over (``shards.model_ranks``: every rank holding a part of this
    rank's model), or ``None`` when this rank holds the whole model and its norm is already global."""
    if not shards.any or len(shards.model_ranks) == 1:
        return None
    return shards.model_ranks


def check_replicas(shards: LocalShards, group: Optional[dist.ProcessGroup]) -> List[bool]:
    """Whether this rank counts each parameter in the global norm (the lowest rank of the model group holding
    its piece does), after checking that the ranks holding the same piece hold the same values (a plain
    parameter left out of the tensor-parallel plan must be the same on every rank of it). Collective on
    ``group`` (the model group's ranks; None: this rank alone)."""
    sums = [float(t.detach().double().sum()) + float(t.detach().double().abs().sum()) if not s else 0.0
            for t, s in zip(shards.locals, shards.sharded)]
    mine = (dist.get_rank(), shards.signatures, sums)
    everyone = [mine]
    if group is not None:
        everyone = [None] * dist.get_world_size(group)
        # all_gather_object: every rank's (rank, signatures, plain parameters' sums), once at construction.
        dist.all_gather_object(everyone, mine, group=group)
    counts = []
    for i, sig in enumerate(shards.signatures):
        holders = sorted((r, sm[i]) for r, sg, sm in everyone if sg[i] == sig)
        if len({v for _, v in holders}) > 1:
            raise ValueError(
                f"AccoOptimizer: parameter {i} is a plain tensor whose values differ across ranks "
                f"{[r for r, _ in holders]}, which hold it whole (tensor parallelism replicates a parameter it "
                "leaves out of its plan): give every rank the same initial weights (seed the model alike before "
                "parallelize_module), or make it a DTensor in the plan")
        counts.append(holders[0][0] == dist.get_rank())
    return counts


def counted_ranges(counts: Optional[List[bool]], pieces: Sequence[Any]) -> Optional[List[Tuple[int, int]]]:
    """The ranges of this rank's gradient slice (``pieces``: the layout's, of this rank) whose squares count in
    the global norm: those of the parameters it counts (:func:`check_replicas`). ``None``: the whole slice.
    Neighbouring pieces are merged into one range: the norm launches a few kernels per range, every round."""
    if counts is None or all(counts):
        return None
    merged: List[Tuple[int, int]] = []
    for pc in pieces:
        if not (pc.numel and counts[pc.index]):
            continue
        if merged and merged[-1][1] == pc.local_start:
            merged[-1] = (merged[-1][0], pc.local_end)
        else:
            merged.append((pc.local_start, pc.local_end))
    return merged


def agreed_done(done: Callable[[], bool], group: dist.ProcessGroup) -> Callable[[], bool]:
    """``done`` (whether this rank's round has finished), agreed over ``group``, the ranks holding the other
    shards of this rank's model (accumulating while communicating on a mesh): true only when every one's has.
    Their forwards run together (tensor parallelism, FSDP2's all-gathers), so they must hand off at the same
    micro-batch, or a forward would mix shards of different updates and their collectives would be issued in
    different orders. The loop asks at the same step() on each (the same count since the last hand-off)."""

    def ask() -> bool:
        flag = torch.tensor([1 if done() else 0], dtype=torch.int32)
        # Collective on ``group`` (gloo, CPU: the host decides hand-offs): the least of the peers' answers.
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
        return bool(flag.item())

    return ask


def replicated_inside(shards: LocalShards) -> List[int]:
    """The parameters of which other ranks of this rank's model group hold the same piece: a plain one beside
    DTensors (tensor parallelism leaves it whole on every rank of its group) or a DTensor ``Replicate`` on a
    mesh dimension (a row-parallel bias). Local."""
    if len(shards.model_ranks) <= 1:
        return []
    return [i for i, (p, s) in enumerate(zip(shards.params, shards.sharded))
            if not s or any(pl.is_replicate() for pl in p.placements)]


def check_supported(shards: LocalShards, group: Optional[dist.ProcessGroup], *, whole: bool,
                    dtypes_plain: bool, compression: Optional[str] = None) -> None:
    """Refuse, before anything is built, what DTensor parameters do not support yet, naming what works."""
    if not shards.any:
        return
    works = ("What works: FSDP2 (fully_shard(model, mesh=mesh['tp'])) or tensor parallelism (parallelize_module "
             "on mesh['tp']) inside a host, with AccoOptimizer over "
             "process_group=mesh['dp'] (or mesh['dp'].get_group()), an element-wise optimizer (AdamW, Adam, SGD), "
             "the parameters' own dtype, max_grad_norm, nonfinite='skip' or 'raise' "
             "(docs/models-larger-than-one-device.md)")
    if whole:
        raise NotImplementedError(
            f"AccoOptimizer: an optimizer that steps whole tensors (Muon, Adafactor) on DTensor parameters is not "
            f"supported yet (each rank holds shards only). {works}")
    if not dtypes_plain:
        raise NotImplementedError(
            f"AccoOptimizer: compute_dtype/accumulation_dtype other than the parameters' dtype with DTensor "
            f"parameters is not supported yet. {works}")
    replicated = replicated_inside(shards) if compression is not None else []
    if replicated:
        # Each rank quantizes its own flat buffer in blocks that span its neighbouring shards: the copies of a
        # replicated parameter would be rounded differently on each rank holding one, and drift apart.
        raise NotImplementedError(
            f"AccoOptimizer(compression={compression!r}): parameter(s) {replicated[:8]} are replicated on the ranks "
            f"of the model's mesh (a plain parameter tensor parallelism leaves out of its plan, or a Replicate "
            f"placement), and compressed rounds would round each rank's copy differently, so that the copies "
            f"drift apart. Compression works with FSDP2 inside a host (every parameter sharded) and on plain data "
            f"parallelism; with tensor parallelism, drop compression. {works}")
    if group is not None:
        mine = set(dist.get_process_group_ranks(group))
        model = set(shards.model_ranks)
        if len(mine & model) > 1:
            raise ValueError(
                f"AccoOptimizer: process_group (ranks {sorted(mine)}) spans the DTensor parameters' mesh (ranks "
                f"{sorted(model)}): ACCO would average shards of different tensors, or reduce twice what FSDP2 on "
                f"a 2-D (HSDP) mesh already reduces across hosts. Give FSDP2/tensor parallelism the intra-host "
                f"dimension only and ACCO the data-parallel one, e.g. process_group=mesh['dp'] for a ('dp', 'tp') "
                f"mesh. {works}")


def warn_short_update(mode: Any, seen: int, expected: Optional[int]) -> None:
    """At ``step()`` in mode acco: an update whose gradients reached the optimizer in fewer backward passes than
    ``microbatches_per_update`` has no estimate round (it commits synchronously, as a short update at the end
    of an epoch does). With FSDP2 the usual cause is ``set_requires_gradient_sync(False)``: its gradients
    arrive at the last micro-batch only, so every update loses ACCO's overlap."""
    if mode.estimates and expected is not None and 0 < seen < expected:
        warnings.warn(
            f"AccoOptimizer: this update's gradients arrived in {seen} backward pass(es), not "
            f"microbatches_per_update={expected}: it has no estimate round and commits synchronously. With "
            "FSDP2, do not call set_requires_gradient_sync(False) on the first micro-batches (ACCO needs each "
            "micro-batch's gradient as it arrives, and accumulates it itself); modes sync and dpu accept it "
            "(docs/models-larger-than-one-device.md)", stacklevel=3)


def refuse_grad_outside_autograd(shards: LocalShards) -> None:
    """At ``step()``: a DTensor gradient that no post-accumulate hook took (it arrived without running the
    hooks): refused, as it would be lost."""
    for i, (p, s) in enumerate(zip(shards.params, shards.sharded)):
        if s and p.grad is not None:
            raise NotImplementedError(
                f"AccoOptimizer.step(): parameter {i}'s DTensor gradient arrived without running its "
                "post-accumulate hooks (FSDP2 of a torch older than 2.13 assigns .grad after its reduce-scatter "
                "without them), so it would be lost: use torch >= 2.13, or tensor parallelism inside the host "
                "(docs/models-larger-than-one-device.md)")
