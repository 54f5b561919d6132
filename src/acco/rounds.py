"""What one communication round computes, for every mode.

A round is ``reduce-scatter(gradient sum, micro-batch count) -> divide ->
sharded optimizer step -> all-gather(new weights)``. It reads the hand-off
buffer ``comm`` (this rank's gradient sum) and writes the all-gathered weights
back into the same buffer. Nothing here knows about threads or streams: the
:class:`~acco.scheduler.StreamScheduler` decides where a round runs.

Its four collectives, in this order, on the round group (``N`` ranks, ``P``
padded elements of the flat buffer, ``P/N`` per rank):

1. all-gather of one row per rank, ``[micro-batch count, hyper-parameter
   fingerprint, round id]``: 3 float64 in, ``3N`` out;
2. reduce-scatter of the gradient sum, ``P`` elements of the accumulation
   dtype in, this rank's ``P/N`` out (gloo: the ring of ``collectives.py``);
3. all-reduce of the squared gradient norm: 1 float64 (with DTensor parameters, again over the parameters' mesh);
4. all-gather of the new weights: ``P/N`` of the compute dtype in, ``P`` out,
   into the memory the gradients left (gloo: the ring).

2 and 4 are the round's transport's (``ctx.transport``, ``transport.py``): the wire format, chosen once when the
buffers are built. The dtypes and counts above are the full-width one's; ``estimate_dtype`` sends an estimate in
that dtype, ``compression`` quantized blocks (an all-to-all for 2), and the phases here never ask which.

Two kinds of round (``algorithm.md``):

* ``COMMIT``   ``theta <- Opt(theta, g)``: master weights and optimizer state move.
* ``ESTIMATE`` ``theta~ = Opt*(theta, g)``: the same step, computed into the
  all-gather's input without touching the master weights or the optimizer
  state (``functional.py``: Adam, AdamW, SGD); for other optimizers the real
  step on a snapshot (``snapshot.py``), restored afterwards. Only the
  all-gathered weights (the estimate) leave the round.

What a round needs is split in two: a :class:`RoundContext`, fixed for the
optimizer's life (buffers, wrapped optimizer, group, policies), and a
:class:`RoundSpec`, one per hand-off (kind, count, scale, hyper-parameters).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Dict, FrozenSet, List, Optional, Tuple

import torch
import torch.distributed as dist

from . import arrivals, functional
from .errors import HyperParameterMismatchError, NonFiniteGradientError, RoundFailedError, RoundMismatchError
from .collectives import all_gather_flat, all_reduce_sum
from .round_checks import (RoundReport, check_pairs_on_host, hyper_mismatch_message, mark_call, nonfinite_message,
                           round_mismatch_message)
from .shard_buffers import ShardBuffers
from .snapshot import OptimizerSnapshot, skips_in_kernel
from .transport import FullWidth, Transport
from .wrapped import WrappedOptimizers, local_step

__all__ = [
    "HyperParameterMismatchError",
    "NonFiniteGradientError",
    "OptimizerSnapshot",
    "RoundFailedError",
    "RoundKind",
    "RoundMismatchError",
    "RoundContext",
    "RoundReport",
    "RoundResult",
    "RoundSpec",
    "ShardBuffers",
    "clip_coefficient",
    "global_grad_norm",
    "mark_call",
    "report_outcome",
    "round_kind",
    "run_round",
]


class RoundKind(enum.Enum):
    COMMIT = "commit"
    ESTIMATE = "estimate"


def round_kind(mode: Any, round_index: int) -> RoundKind:
    """ACCO alternates estimate (even) / commit (odd); dpu and sync always commit (``mode``: a ``Mode``)."""
    if mode.estimates and round_index % 2 == 0:
        return RoundKind.ESTIMATE
    return RoundKind.COMMIT




@dataclass
class RoundContext:
    """What every round of one optimizer uses (built once)."""

    buffers: ShardBuffers
    wrapped: "WrappedOptimizers"  # the wrapped optimizer(s), over this rank's tensors (views of ``buffers.master``)
    group: Optional[dist.ProcessGroup]  # the rounds' own group (None: one process)
    snapshot: Optional[OptimizerSnapshot] = None  # Opt* of other optimizers; the CUDA path's undo
    max_grad_norm: Optional[float] = None
    nonfinite: str = "skip"
    device_checks: bool = False  # CUDA path: checks become device flags, no host sync
    extrapolation: float = 1.0  # estimate rounds: theta~ = theta + c * (Opt*(theta, g) - theta)
    # DTensor parameters: the group of the ranks holding the other shards of this rank's parameters (the norm is
    # summed over it too; a group of the rounds' own), and the ranges of the gradient slice that count in it
    # (mesh.counted_ranges; None: all of it).
    model_group: Optional[dist.ProcessGroup] = None
    norm_ranges: Optional[List[Tuple[int, int]]] = None
    # delay_correction (mode dpu): a copy of the master slice taken before a corrected commit's step
    delay_scratch: Optional[torch.Tensor] = None
    # the wire format (transport.py, compressed.py): chosen once, with the buffers (buffers.choose_transport)
    transport: Transport = field(default_factory=FullWidth)
    # outer_every: the outer round across regions (outer.OuterRound), run inside every commit after its step
    outer: Optional[Any] = None


@dataclass
class RoundSpec:
    """One hand-off: which round, on what."""

    kind: "RoundKind"
    local_microbatches: int  # this rank's micro-batches in the gradient sum
    grad_scale: Optional[float]  # None: divide by the count over all ranks; else multiply the sum by it
    hyperparams: List[Dict[str, Any]]  # one dict per group, taken at hand-off
    hyper_fingerprint: float = 0.0  # of ``hyperparams``: all ranks must agree
    round_id: int = 0  # 2 * rounds handed off + (1 if estimate): all ranks must agree
    delay_correction: float = 0.0  # c of the error feedback on this commit's step (mode dpu, a delayed update)
    missing: FrozenSet[int] = frozenset()  # parameters without a gradient in this rank's sum (arrivals.py)
    unscale: Optional[torch.Tensor] = None  # 1/loss scale (a GradScaler's, amp.py), 0-d on the device; None: 1


@dataclass
class RoundResult:
    kind: RoundKind
    local_microbatches: int
    total_microbatches: torch.Tensor  # on the device
    rank_microbatches: torch.Tensor  # on the device, one per rank
    grad_norm: torch.Tensor  # global L2 norm of the averaged gradient, before clipping
    skipped: Optional[bool] = False  # non-finite gradient: no update was applied (None: decided on the device)
    # Decided on the device (CUDA path): a host copy of RoundReport's fields, valid once the round's end
    # event has completed; the optimizer reads it then and raises what the CPU path raises in the round.
    report: Optional[torch.Tensor] = None


def global_grad_norm(grad_shard: torch.Tensor, group: Optional[dist.ProcessGroup],
                     model_group: Optional[dist.ProcessGroup] = None,
                     ranges: Optional[List[Tuple[int, int]]] = None) -> torch.Tensor:
    """L2 norm of the full averaged gradient from this rank's slice (``ranges`` of it; with DTensor parameters,
    and the other shards' over ``model_group``). Collective on ``group``, then on ``model_group``."""
    if ranges is None:
        sq = functional.sum_of_squares(grad_shard).reshape(1)
    else:
        sq = torch.zeros(1, dtype=torch.float64, device=grad_shard.device)
        for a, b in ranges:
            sq.add_(functional.sum_of_squares(grad_shard[a:b]))
    all_reduce_sum(sq, group)  # sum of squares over all slices
    if model_group is not None:
        all_reduce_sum(sq, model_group)  # and over the model's other shards (tensor parallel / FSDP2 ranks)
    return sq.sqrt()[0]


def clip_coefficient(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """The factor ``torch.nn.utils.clip_grad_norm_`` scales gradients by."""
    return (max_norm / (norm + 1e-6)).clamp(max=1.0)


def run_round(ctx: RoundContext, spec: RoundSpec) -> RoundResult:
    """Run one round on the current thread/stream. Collective: call on all ranks.

    ``ctx.buffers.comm`` holds this rank's gradient *sum* over ``spec.local_microbatches``
    micro-batches; on return ``ctx.buffers.weights`` (the same memory) holds the
    round's full weights (all ranks agree).
    ``hyperparams`` (one dict per group, taken at hand-off) are written into the
    wrapped optimizer's groups before its step, so schedulers act on the round
    that was handed off after they moved.

    The global norm of the averaged gradient is always computed (one scalar
    all-reduce). If it is not finite, every rank sees the same: with
    ``nonfinite="raise"`` the round raises :class:`NonFiniteGradientError`;
    with ``"skip"`` no step is taken and the unchanged weights are all-gathered.
    With ``max_grad_norm`` the gradient is scaled exactly as
    ``clip_grad_norm_`` would scale the full gradient.

    ``grad_scale=None`` divides the gradient sum by the micro-batch count over
    all ranks (accumulate while communicating: the mean per micro-batch);
    a number multiplies the sum by it instead (one ``step()`` per update:
    ``1/N``, DDP's average of the ranks' ``.grad``; an estimate's half is
    extrapolated to a whole update).

    ``delay_correction`` ``c`` (a commit of mode dpu whose gradient is a step old): after the step, error
    feedback, ``theta -= c * (u_k - u_{k-1})`` with ``u`` the optimizer's own steps (``functional.correct_delay``).

    ``hyper_fingerprint`` (of ``hyperparams``) travels with the micro-batch
    count: if the ranks' differ, every rank raises
    :class:`HyperParameterMismatchError` before any step.

    ``device_checks`` (the CUDA path): no host synchronisation. The checks
    above become device flags in ``RoundResult.report`` (a host tensor written
    without blocking, valid once the round's end event has completed; the
    optimizer raises from it at the hand-off two rounds later, on every rank
    alike). A flagged round (a non-finite gradient under either policy, or
    ranks that handed off different rounds or hyper-parameters) is undone on
    the device with ``torch.where`` over a snapshot of the master slice and the
    state, so mismatched shards never combine; while the wrapped optimizer has
    no state yet, or keeps some on the CPU, the host decides instead (one sync
    per such round).
    """
    b, kind = ctx.buffers, spec.kind
    pairs, unused = _exchange_rows(ctx, spec)  # 1. every rank's [micro-batch count, hyper fingerprint, round id]
    _reduce_gradients(ctx, spec)  # 2. this rank's slice of the averaged gradient, in b.grad
    # 3. the averaged gradient's global norm: an all-reduce of a scalar (two with DTensor parameters)
    norm = global_grad_norm(b.grad, ctx.group, ctx.model_group, ctx.norm_ranges)
    ctx.wrapped.write_hyper(spec.hyperparams)
    plan = _plan_step(ctx, kind, spec.delay_correction)
    decision = _decide(ctx, kind, pairs, norm, plan)  # 4. skip, raise, or undo on the device
    if kind is RoundKind.COMMIT and not decision.skipped:  # the transport's error feedback, if it keeps one
        ctx.transport.keep_residual(b, decision.undo)
    if ctx.max_grad_norm is not None and not decision.skipped:
        b.grad.mul_(clip_coefficient(norm, ctx.max_grad_norm).to(b.grad.dtype))
    # A parameter no rank had a gradient for is not stepped, and its state does not advance (torch's .grad None)
    with ctx.wrapped.without_grads(unused):
        snapshotted = _step(ctx, kind, plan, decision)  # 5. the optimizers that step for real (on a snapshot: Opt*)
        source = _new_slice(ctx, plan, decision, snapshotted)  # 6. this rank's new weights: theta, or theta~
    _publish(ctx, kind, plan, source, snapshotted)  # 7. all-gather them, then leave theta as Opt* found it
    return RoundResult(kind, spec.local_microbatches, b.count, b.rank_counts, norm, decision.skipped, decision.report)


@dataclass
class _StepPlan:
    """Which wrapped optimizers' step an estimate computes (``computed``, functional.py) and which step for
    real (``stepped``); ``in_kernel``: a fused kernel skips a flagged commit by itself (``found_inf``)."""

    computed: list
    stepped: list
    in_kernel: bool
    correction: float  # delay_correction's c: the step is followed by error feedback (0: none)


@dataclass
class _Decision:
    """What the checks decided: ``skipped`` (None: decided on the device), ``undo`` (a device flag: as if no
    step), ``report`` (the CUDA path's host copy of the flags, :class:`RoundReport`)."""

    skipped: Optional[bool]
    undo: Optional[torch.Tensor]
    report: Optional[torch.Tensor]


def _exchange_rows(ctx: RoundContext, spec: RoundSpec) -> Tuple[torch.Tensor, FrozenSet[int]]:
    """Phase 1. Collective on the round group (all-gather of one row per rank). Sets the micro-batch counts and,
    on the CPU path, raises on every rank alike if the ranks handed off different rounds or hyper-parameters.
    Returns the rows' first three columns and the parameters no rank had a gradient for (the row's bits)."""
    b = ctx.buffers
    # fill_ passes each value as a kernel argument: no copy from host memory. (``b.row[i] = value`` would
    # copy a pageable CPU scalar into device memory: a blocking copy that waits for the hand-off's backward.)
    for i, value in enumerate((float(spec.local_microbatches), spec.hyper_fingerprint, float(spec.round_id))):
        b.row[i].fill_(value)
    bits = b.row[3:]
    if spec.missing:  # some parameter had no gradient here: its bits from the host, word by word (fill_ as above)
        for w, value in enumerate(arrivals.pack(spec.missing, ctx.wrapped.n_params)):
            bits[w].fill_(value)
    elif bits.numel():
        bits.copy_(b.all_arrived)  # device to device
    all_gather_flat(b.rows, b.row, ctx.group)  # every rank's [count, hyper fingerprint, round id, arrival bits]
    table = b.rows.view(-1, b.row.numel())
    pairs = table[:, :3]
    b.rank_counts.copy_(pairs[:, 0])
    torch.sum(b.rank_counts, dim=0, keepdim=True, out=b.count)
    if not ctx.device_checks:
        check_pairs_on_host(spec.kind, pairs)
    unused: FrozenSet[int] = frozenset()
    if spec.missing:
        # Only a rank that lacks a gradient needs the others' bits: this rank had every other parameter's, so
        # no other can go unstepped. On CUDA this host read waits for the compute stream to reach the hand-off
        # and for the row's all-gather (no other collective of the round is issued before it): a short stall,
        # paid only in rounds where this rank lacks a gradient.
        unused = arrivals.missing_everywhere(table[:, 3:].tolist(), ctx.wrapped.n_params) & spec.missing
    return pairs, unused


def _reduce_gradients(ctx: RoundContext, spec: RoundSpec) -> None:
    """Phase 2. Collective on the round group (the transport's reduce-scatter of the gradient sum): this rank's
    slice, divided by the micro-batch count (or multiplied by ``grad_scale``), in ``b.grad``."""
    b = ctx.buffers
    ctx.transport.reduce_scatter(b, spec.kind is RoundKind.COMMIT, ctx.group)  # this rank's slice of the sum
    if spec.grad_scale is None:
        b.grad.div_(b.count)  # the mean over all micro-batches of all ranks
    else:
        b.grad.mul_(spec.grad_scale)
    if spec.unscale is not None:
        b.grad.mul_(spec.unscale)  # the loss scale out, after the sum (as DDP's scaler unscales the average)


def _plan_step(ctx: RoundContext, kind: RoundKind, delay_correction: float = 0.0) -> _StepPlan:
    """An estimate computes Opt* of Adam/AdamW/SGD straight into the all-gather's input (functional); the other
    wrapped optimizers (Muon, Adafactor, ...) take their real step on a snapshot, restored after the all-gather."""
    wrapped = ctx.wrapped
    computed = [part for part in wrapped.parts if kind is RoundKind.ESTIMATE and functional.supports(part.optimizer)]
    stepped = [part for part in wrapped.parts if part not in computed]
    in_kernel = (kind is RoundKind.COMMIT and ctx.device_checks
                 and all(skips_in_kernel(part.optimizer) for part in stepped))
    correction = delay_correction if kind is RoundKind.COMMIT else 0.0
    # A fused kernel that skips a flagged step by itself would leave the error feedback applied: undo both from
    # the snapshot instead.
    return _StepPlan(computed, stepped, in_kernel and not correction, correction)


def _decide(ctx: RoundContext, kind: RoundKind, pairs: torch.Tensor, norm: torch.Tensor,
            plan: _StepPlan) -> _Decision:
    """Phase 4. A non-finite norm skips the step (``nonfinite="skip"``) or raises (``"raise"``), on every rank
    alike. On the CUDA path (``device_checks``) every check of phase 1 and this one become device flags that undo
    the step, copied to the host without blocking."""
    b, snapshot, nonfinite, stepped = ctx.buffers, ctx.snapshot, ctx.nonfinite, plan.stepped
    report = None
    undo: Optional[torch.Tensor] = None  # device flag: as if no step (theta, the state and the estimate)
    if ctx.device_checks:
        # Everything the CPU path checks on the host, as device flags, copied to the host without
        # blocking; the optimizer reads them once this round's end event has completed.
        nonfinite_flag = ~torch.isfinite(norm)
        flags = torch.stack([(pairs[:, 2] != pairs[0, 2]).any(), (pairs[:, 1] != pairs[0, 1]).any(), nonfinite_flag])
        values = torch.cat([flags.double(), norm.double().reshape(1), pairs[:, 2].double()])
        report = b.host_empty(values.shape, values.dtype)  # pinned on CUDA
        report.copy_(values, non_blocking=True)
        skipped: Optional[bool] = None
        # Every flag undoes the step on the device, under both policies: a non-finite gradient, and ranks that
        # handed off different rounds or hyper-parameters (their shards must not combine into weights). The
        # error itself is raised from the report, on every rank at the same hand-off (driver.read_reports).
        if (not stepped or plan.in_kernel
                or (snapshot is not None and snapshot.restorable_on_device(stepped, b.master))):
            undo = flags.any()
        else:  # the first step (it creates state), or a step counter on the CPU: the host decides
            check_pairs_on_host(kind, pairs)  # a host sync here anyway: raise as the CPU path does
            skipped = bool(nonfinite_flag)
            if skipped and nonfinite == "raise":
                raise NonFiniteGradientError(nonfinite_message(kind.value, float(norm)))
    else:
        skipped = not bool(torch.isfinite(norm))  # a host sync, on the round's own thread
        if skipped and nonfinite == "raise":
            raise NonFiniteGradientError(nonfinite_message(kind.value, norm.item()))
    return _Decision(skipped, undo, report)


def _step(ctx: RoundContext, kind: RoundKind, plan: _StepPlan, decision: _Decision) -> bool:
    """Phase 5. The stepped optimizers' step on the master slice: for real on a commit, on a snapshot on an
    estimate (Opt*, restored by :func:`_publish`), undone where a device flag is set; a corrected commit's step
    followed by its error feedback (undone with it); then, on a commit, the outer round across regions
    (``ctx.outer``, ``outer.py``). Returns whether the snapshot holds theta to restore after the all-gather."""
    b, snapshot, stepped, in_kernel = ctx.buffers, ctx.snapshot, plan.stepped, plan.in_kernel
    skipped, undo = decision.skipped, decision.undo
    snapshotted = kind is RoundKind.ESTIMATE and bool(stepped) and not skipped
    restore = undo is not None and not in_kernel and bool(stepped)  # a fused kernel skips by itself
    if snapshotted or restore:
        assert snapshot is not None
        snapshot.save(stepped, b.master)
    if not skipped and stepped:
        if undo is not None and in_kernel:
            for part in stepped:
                part.optimizer.found_inf = undo.to(torch.float32)  # where set, the fused kernel takes no step at all
        before = ctx.delay_scratch.copy_(b.master) if plan.correction else None  # theta_k, for u_k
        try:
            for part in stepped:
                local_step(part.optimizer)  # its own hooks; torch's global ones fire for the AccoOptimizer
        finally:
            for part in stepped:
                part.optimizer.__dict__.pop("found_inf", None)
        if before is not None:
            steps = before.sub_(b.master)  # u_k over the whole slice: one op, whatever the number of tensors
            for part in stepped:
                functional.correct_delay(part.optimizer, part.tensors, part.pieces, steps, plan.correction)
        if snapshot is not None and not snapshotted:
            snapshot.stepped = True  # the optimizers' state exists now, for every tensor that keeps one
    if restore:
        snapshot.restore_where(undo, stepped, b.master)  # a flag was raised: as if no step
    if kind is RoundKind.COMMIT and ctx.outer is not None:  # across regions (outer.py): after the step, its undo
        ctx.outer.after_commit(b.master)  # and its error feedback; all-gather over outer_group every H commits
    return snapshotted


def _new_slice(ctx: RoundContext, plan: _StepPlan, decision: _Decision, snapshotted: bool) -> torch.Tensor:
    """Phase 6. The all-gather's input: on an estimate, Opt* (extrapolated by ``ctx.extrapolation``) of the
    computed tensors and the stepped ones' snapshot step; on a commit, the master slice as it stands."""
    b, snapshot, wrapped, computed = ctx.buffers, ctx.snapshot, ctx.wrapped, plan.computed
    skipped, undo = decision.skipped, decision.undo
    around = wrapped.complement(computed)  # the chunk's ranges outside the computed tensors: stepped, padding
    if snapshotted and ctx.extrapolation != 1.0:  # the stepped tensors' Opt*, extrapolated (undone: theta stays)
        snapshot.extrapolate(b.master, around, ctx.extrapolation)
    if computed and not skipped:
        # Opt* computed into the all-gather's input; theta and the state are only read. Without a staging
        # slice that input is the gradient slice itself: each chunk's gradient is read before it is overwritten
        # (the stepped optimizers above read theirs first). Around it, the master as it stands.
        source = b.staging if b.staging is not None else b.grad
        for part in computed:
            functional.estimate_into(source, part.optimizer, part.tensors, b.master, ctx.extrapolation,
                                     part.counts_differ)
        functional.copy_ranges(source, b.master, around)
        if undo is not None:  # a flag was raised: the estimate is theta itself
            torch.where(undo, b.master.to(source.dtype), source, out=source)
        return source
    return b.master if b.staging is None else b.staging.copy_(b.master)


def _publish(ctx: RoundContext, kind: RoundKind, plan: _StepPlan, source: torch.Tensor, snapshotted: bool) -> None:
    """Phase 7. Collective on the round group (the transport's all-gather of every rank's new slice into the full
    weights), then, for an estimate taken on a snapshot, theta and the state restored: only after the all-gather
    has read the stepped master (``source`` may be the master itself)."""
    b, snapshot, stepped = ctx.buffers, ctx.snapshot, plan.stepped
    ctx.transport.all_gather(b, source, kind is RoundKind.COMMIT, ctx.group)  # every rank's new slice -> weights
    if snapshotted:
        snapshot.restore(stepped, b.master)  # Opt*: leave theta and state untouched


def report_outcome(result: RoundResult, nonfinite: str) -> Tuple[Optional[BaseException], bool]:
    """CUDA path, once the round's end event has completed: from the host copy of its report, what the CPU
    path raises inside the round, and whether a commit was skipped (undone on the device)."""
    values = result.report.tolist()
    kind = result.kind.value
    if values[RoundReport.ROUND_MISMATCH]:
        return RoundMismatchError(round_mismatch_message(values[RoundReport.IDS :])), False
    if values[RoundReport.HYPER_MISMATCH]:
        return HyperParameterMismatchError(hyper_mismatch_message(kind)), False
    if values[RoundReport.NONFINITE]:
        if nonfinite == "raise":
            return NonFiniteGradientError(nonfinite_message(kind, values[RoundReport.NORM])), False
        return None, result.kind is RoundKind.COMMIT and result.skipped is None
    return None, False


