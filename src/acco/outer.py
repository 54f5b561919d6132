"""The outer round across regions: every ``H`` updates, DiLoCo's outer step, sharded as the optimizer is.

A *region* is one ``process_group``: its ranks run the rounds of ``rounds.py`` (any mode). ``outer_group`` joins
this rank to the rank of the same index in every other region, which owns the same slice of the flat buffer (the
regions' layouts are one). At the commit of every ``H``-th update, inside that commit's round and after its step
(``docs/algorithm.md``, "Across regions"):

1. this rank's slice of the region's pseudo-gradient ``Δ = A − θ`` (``A``: the anchor, the weights after the last
   outer round) travels to the other regions, fp32 or quantized with error feedback (``outer_compression``);
2. ``outer_delay`` (``τ``) commits later (the same commit for ``τ = 0``) the regions' mean ``Δ̄`` is the outer
   optimizer's gradient: ``A' = OuterOpt(A, Δ̄)`` (SGD with Nesterov momentum, DiLoCo's), and the master slice
   moves by what the outer step changed, ``θ ← θ + (A' − θ_launch)`` (``τ = 0``: ``θ ← A'``), before the commit
   publishes it to the region.

Everything here is per rank and per slice: the anchor, the outer momentum and the residual are ``P/N`` elements
each, 1/N of what a full copy holds. The pseudo-gradients travel with one all-gather over ``outer_group``, issued
without waiting (``async_op``): it runs behind the region's next ``τ`` updates and is waited for at the merge.
"""

from __future__ import annotations

import datetime
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from . import agreement
from .collectives import connect, group_rank, group_size, new_round_group, release_round_group, resolve_process_group
from .quantize import dequantize_add_, packed_size, quantize, residual_of
from .wrapped import local_step

__all__ = ["OuterRound", "connect_regions", "made", "mean_of_sent", "merged", "pseudo_gradient_sent",
           "refuse_checkpoint", "retaken"]


def refuse_checkpoint(outer: Optional["OuterRound"], call: str) -> None:
    """The checkpoint forms that cannot tell the regions apart (gathered, consolidated, the bare DCP entries):
    refused with ``outer_every``. Local."""
    if outer is not None:
        raise NotImplementedError(
            f"AccoOptimizer {call} with outer_every: the regions hold different weights and states under the same "
            "keys in this form. Use acco.checkpoint.save/load (each region's entries under its name), or "
            "torch.save(opt.state_dict(), ...) on every rank of every region (docs/regions.md)")


def connect_regions(policy: Any, outer_group: Any, fields: List[Tuple[str, Any]], region: Tuple[int, int],
                    shards: Any, device: torch.device, timeout: Any) -> Optional[dist.ProcessGroup]:
    """The outer round's own group over ``outer_group`` (None without ``outer_every``), once every region has the
    same model, options and region shape (``region``: the region's size and this rank's index in it; with
    DTensor parameters, checked with the model shard this rank holds) and the first region's weights.
    Collective on ``outer_group``."""
    if policy.outer_every is None:
        if outer_group is not None:
            raise ValueError("outer_group= without outer_every: the group would carry no outer round. Pass "
                             "outer_every=H (updates between outer rounds), or drop outer_group")
        return None
    if outer_group is None:
        raise ValueError(f"outer_every={policy.outer_every} without outer_group=: pass the group of this rank's peers "
                         "in the other regions (e.g. mesh.get_group('region') of a ('region', 'dp') DeviceMesh)")
    if type(outer_group).__name__ == "DeviceMesh" and outer_group.ndim != 1:
        raise ValueError(f"outer_group is a {outer_group.ndim}-D DeviceMesh {outer_group.mesh_dim_names}: pass its "
                         "regions' dimension, e.g. mesh['region'] of a ('region', 'dp') mesh")
    group = resolve_process_group(outer_group)
    assert group is not None
    # Every region must lay the model out alike: the same model and options, and rank i of a region must meet
    # rank i of the others (the same slice of the flat buffer); with DTensor parameters (FSDP2 or tensor
    # parallelism inside), also the same model shard: the same index among the ranks holding the model's parts
    holders = shards.model_ranks if shards.any else [dist.get_rank()]
    shape = ("the region (its process_group's size and this rank's index in it, and with DTensor parameters the "
             "number of ranks holding the model's shards and this rank's index among them: outer_group must join "
             "rank i of every region, and every region must shard the model alike)",
             (*region, len(holders), holders.index(dist.get_rank())))
    agreement.check_same_model(group, [*fields, shape], sum(t.numel() for t in shards.locals), len(shards.locals),
                               device)
    # every region starts from the first region's weights (a DTensor's local shard from the same shard's rank)
    agreement.broadcast_parameters(shards.locals, group)
    rounds = new_round_group(group, timeout)  # the outer rounds' own group, issued from the rounds' thread
    connect(rounds, device)
    return rounds


def pseudo_gradient_sent(anchor: torch.Tensor, theta: torch.Tensor, kind: Optional[str], block: int,
                         out: torch.Tensor, residual: Optional[torch.Tensor]) -> None:
    """What this rank sends of its slice's pseudo-gradient ``A − θ`` into ``out`` (bytes): fp32 as it is, or
    (``kind``) ``A − θ + e`` quantized, the residual ``e`` becoming what the quantization dropped. Pure but for
    ``out`` and ``residual``."""
    delta = anchor.float() - theta.float()
    if kind is None:
        out.view(torch.float32).copy_(delta)
        return
    delta.add_(residual)
    quantize(delta, kind, block, out)
    residual_of(delta, out, kind, block, residual)


def mean_of_sent(received: torch.Tensor, regions: int, n: int, kind: Optional[str], block: int) -> torch.Tensor:
    """The regions' mean pseudo-gradient from every region's bytes (``received``, in region order): summed in
    fp32 in region order, so every region computes the same bits. A new tensor of ``n`` elements."""
    total = torch.zeros(n, dtype=torch.float32, device=received.device)
    for piece in received.view(regions, -1):
        if kind is None:
            total.add_(piece.view(torch.float32))
        else:
            dequantize_add_(piece, kind, block, n, total)
    return total.div_(regions)


def merged(theta: torch.Tensor, anchor: torch.Tensor, base: torch.Tensor, delay: int) -> None:
    """``θ`` (in place) after the outer step moved the anchor to ``anchor``: ``θ + (A' − θ_launch)``, the updates
    taken since the launch (``base``: θ then) kept; with ``delay`` 0, ``A'`` itself (every region the same)."""
    if delay == 0:
        theta.copy_(anchor)
    else:
        theta.add_(anchor.to(theta.dtype) - base)


def retaken(outer: Optional["OuterRound"], params: List[torch.Tensor], flat: Any) -> None:
    """``take_model_weights()``: the master from the model's weights, which every region takes from the first
    region's (as at construction), and with ``outer_every`` the outer rounds start afresh from them (the anchor,
    the momentum and the residual). Collective on ``outer_group``."""
    if outer is not None:
        agreement.broadcast_parameters(params, outer.group)
    flat.master_from_model(swapped=False)
    if outer is not None:
        outer.start_from(flat.shard.master, 0)


def made(policy: Any, master: torch.Tensor, group: Optional[dist.ProcessGroup], block: int) -> Optional["OuterRound"]:
    """The outer round over ``group`` (from :func:`connect_regions`), or None without one."""
    return None if group is None else OuterRound(policy, master, group, block)


class OuterRound:
    """One rank's outer state and its in-flight outer round; :meth:`after_commit` runs inside each commit round.

    Owns: the anchor slice and the outer optimizer's momentum (its state), the residual, the bytes out and in, the
    in-flight work, and the count of commits. The rounds' thread (CPU) or stream's issuing thread (CUDA) is the
    only caller, between a commit's step and its all-gather."""

    def __init__(self, policy: Any, master: torch.Tensor, group: dist.ProcessGroup, block: int) -> None:
        self.every, self.delay, self.kind, self.block = (policy.outer_every, policy.outer_delay,
                                                          policy.outer_compression, block)
        self.group = group
        self.regions, self.region = group_size(group), group_rank(group)  # this rank's region: its index in group
        n = master.numel()
        self.anchor = master.detach().clone()  # A: the weights after the last outer round (θ_0 at first)
        momentum = float(policy.outer_momentum)
        self.optimizer = torch.optim.SGD([self.anchor], lr=float(policy.outer_lr), momentum=momentum,
                                         nesterov=momentum > 0)
        if momentum > 0:  # held from the start (memory_report); torch's first step makes it the gradient either way
            self.optimizer.state[self.anchor]["momentum_buffer"] = torch.zeros_like(self.anchor)
        self.residual = torch.zeros(n, dtype=torch.float32, device=master.device) if self.kind else None
        # θ at the launch of the round in flight, kept until its merge: only with outer_delay > 0
        self.base = torch.empty_like(self.anchor) if self.delay else torch.empty(0, device=master.device)
        width = packed_size(n, block, self.kind) if self.kind else 4 * n
        self.send = torch.empty(width, dtype=torch.uint8, device=master.device)
        self.recv = torch.empty(self.regions * width, dtype=torch.uint8, device=master.device)
        self.work: Any = None  # the in-flight all-gather
        self.commits = 0  # commits seen (one per update, skipped or not: the same count in every region)
        self.merge_at: Optional[int] = None

    @property
    def momentum(self) -> Optional[torch.Tensor]:
        """The outer optimizer's momentum buffer (made at construction when ``outer_momentum > 0``), else None."""
        return self.optimizer.state[self.anchor].get("momentum_buffer")

    def after_commit(self, master: torch.Tensor) -> None:
        """A commit's step is done and ``master`` (this rank's slice) holds ``θ_t``: merge the round in flight if
        it is due, launch one if ``t`` is a multiple of ``H``."""
        self.commits += 1
        if self.merge_at == self.commits:
            self._merge(master)
        if self.commits % self.every == 0:
            self._launch(master)
            if self.delay == 0:
                self._merge(master)

    def _launch(self, master: torch.Tensor) -> None:
        """Collective on ``outer_group`` (an all-gather of every region's bytes, not waited for here)."""
        if self.delay:
            self.base.copy_(master)
        pseudo_gradient_sent(self.anchor, master, self.kind, self.block, self.send, self.residual)
        self.work = dist.all_gather_into_tensor(self.recv, self.send, group=self.group, async_op=True)
        self.merge_at = self.commits + self.delay

    def _merge(self, master: torch.Tensor) -> None:
        """Wait for the in-flight all-gather, take the outer step on the anchor, move ``master`` by it."""
        if self.work is not None:
            self.work.wait()  # CUDA: orders the round's stream after the all-gather (NCCL); CPU: blocks this thread
        self.work = self.merge_at = None
        mean = mean_of_sent(self.recv, self.regions, self.anchor.numel(), self.kind, self.block)  # fp32, as sent
        self.anchor.grad = mean.to(self.anchor.dtype)
        local_step(self.optimizer)  # the optimizer's own hooks only, not torch's global ones
        self.anchor.grad = None
        merged(master, self.anchor, self.base, self.delay)

    def state(self) -> Dict[str, torch.Tensor]:
        """This rank's outer state, copied (``state/outer_state.py``): waits for a round in flight (every region
        issued it at the same commit) and keeps its bytes and launch weights for the merge it is due."""
        if self.work is not None:
            self.work.wait()
            self.work = None
        out = {"anchor": self.anchor, "momentum": self.momentum, "residual": self.residual}
        if self.merge_at is not None:
            out.update(base=self.base, received=self.recv)
        out = {k: v.detach().clone() for k, v in out.items() if v is not None}
        out["counters"] = torch.tensor([self.commits, -1 if self.merge_at is None else self.merge_at])
        return out

    def layout_of_state(self, in_flight: bool) -> Dict[str, Tuple[Tuple[int, ...], torch.dtype]]:
        """The shape and dtype of each tensor :meth:`state` saves (``in_flight``: with a round in flight)."""
        like = (tuple(self.anchor.shape), self.anchor.dtype)
        out = {"anchor": like}
        if self.momentum is not None:
            out["momentum"] = like
        if self.residual is not None:
            out["residual"] = (tuple(self.residual.shape), self.residual.dtype)
        if in_flight:
            out.update(base=(tuple(self.base.shape), self.base.dtype),
                       received=(tuple(self.recv.shape), self.recv.dtype))
        return out

    def load(self, saved: Dict[str, torch.Tensor]) -> None:
        """Take :meth:`state`'s output (checked by ``state/outer_state.check``)."""
        self.settle()
        with torch.no_grad():
            self.anchor.copy_(saved["anchor"])
            if self.momentum is not None:
                self.momentum.copy_(saved["momentum"])
            if self.residual is not None:
                self.residual.copy_(saved["residual"])
            commits, merge_at = (int(v) for v in saved["counters"].tolist())
            self.commits, self.merge_at = commits, None if merge_at < 0 else merge_at
            if self.merge_at is not None:
                self.base.copy_(saved["base"])
                self.recv.copy_(saved["received"])

    def start_from(self, master: torch.Tensor, updates: int) -> None:
        """The outer rounds afresh from ``master`` after ``updates`` updates: a loaded state without one."""
        self.settle()
        with torch.no_grad():
            self.anchor.copy_(master)
            for t in (self.momentum, self.residual):
                if t is not None:
                    t.zero_()
        self.commits = updates

    def settle(self, timeout: Optional[float] = None) -> bool:
        """Wait for an outer round still in flight (at ``finish()``; ``timeout`` seconds at most, at an exit without
        it): it is not merged (the model keeps its region's last commit), but its all-gather must end before the
        group is released. Returns whether it ended (a peer region gone: not within ``timeout``)."""
        if self.work is not None:
            try:
                if timeout is None:
                    self.work.wait()
                else:
                    self.work.wait(datetime.timedelta(seconds=timeout))
            except RuntimeError:  # gloo: the peer never issued it, or is gone
                if timeout is None:
                    raise
                return False
        self.work = self.merge_at = None
        return True

    def checkpoint_group(self, region_size: int) -> Optional[dist.ProcessGroup]:
        """The group a DCP checkpoint of every region is written and read by: the default group, which the regions
        must make up exactly (DCP names its files by rank)."""
        if self.regions * region_size != dist.get_world_size():
            raise NotImplementedError(
                f"acco.checkpoint with outer_every: {self.regions} regions of {region_size} ranks are not the "
                f"{dist.get_world_size()} ranks of the default group, which writes the checkpoint. Save "
                "opt.state_dict() per rank instead (docs/regions.md)")
        return dist.group.WORLD

    def release(self, abort: bool = False) -> None:
        """Release the outer group (a group of the optimizer's own), after the round in flight has ended unless
        ``abort`` (a failed run: a peer may be gone, its pending work is cancelled). Local: no collective."""
        if not abort:
            self.settle()
            if self.recv.is_cuda:  # wait() only ordered the stream: the all-gather ends before its group goes
                torch.cuda.synchronize(self.recv.device)
        group, self.group, self.work = self.group, None, None
        if group is not None:
            release_round_group(group, abort)

    def memory(self) -> Dict[str, int]:
        """Bytes of the outer state on this rank: the anchor, the momentum, the residual and the round's bytes."""
        tensors = [self.anchor, self.base, self.send, self.recv, self.residual, self.momentum]
        return {"outer": sum(t.numel() * t.element_size() for t in tensors if t is not None)}
