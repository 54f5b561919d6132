"""A plain, slow, single-process transcription of ``algorithm.md``.

No sharding, no threads, no process group: ``N`` ranks are simulated in a loop,
the wrapped optimizer runs on full tensors. The fast path is tested against it.
"""

from __future__ import annotations

import copy
from typing import Callable, List, Optional, Sequence

import torch

Tensors = List[torch.Tensor]
# (rank, micro-batch index on that rank, weights) -> gradients; None for a tensor that got no gradient there
GradFn = Callable[[int, int, Tensors], List[Optional[torch.Tensor]]]
MakeOpt = Callable[[Tensors], torch.optim.Optimizer]


class Split:
    """Several torch optimizers over one list of full tensors, as one (the Muon + AdamW split):
    ``parts`` are ``(optimizer class, indices into the tensors, keyword arguments)``."""

    def __init__(self, theta: Tensors, parts) -> None:
        self.parts = [cls([theta[i] for i in idx], **kw) for cls, idx, kw in parts]
        self.param_groups = [g for p in self.parts for g in p.param_groups]

    def step(self) -> None:
        for p in self.parts:
            p.step()

    def state_dict(self):
        return [p.state_dict() for p in self.parts]

    def load_state_dict(self, sds) -> None:
        for p, sd in zip(self.parts, sds):
            p.load_state_dict(sd)


def grads_at(model: torch.nn.Module, weights: Tensors, loss: Callable[[torch.nn.Module], torch.Tensor]) -> Tensors:
    """The gradient of ``loss(model)`` with ``model`` (a fresh, unsharded copy) set to ``weights``: what the
    tests' ``grad_fn`` returns to the oracle for one micro-batch."""
    with torch.no_grad():
        for p, w in zip(model.parameters(), weights):
            p.copy_(w)
    loss(model).backward()
    return [p.grad.detach().clone() for p in model.parameters()]


def clipped(grads: Tensors, max_grad_norm: Optional[float]) -> Tensors:
    """The averaged gradient scaled as ``clip_grad_norm_`` scales the full gradient (fp64 sum of squares)."""
    if max_grad_norm is None:
        return grads
    norm = torch.stack([torch.linalg.vector_norm(g).double().pow(2) for g in grads]).sum().sqrt()
    coef = (max_grad_norm / (norm + 1e-6)).clamp(max=1.0)
    return [g * coef.to(g.dtype) for g in grads]


def _opt_step(opt: torch.optim.Optimizer, theta: Tensors, grads: Tensors,
              present: Optional[Sequence[bool]] = None) -> None:
    """Opt(theta, g): one committed step. ``present[i]`` False: tensor ``i`` got no gradient in the round on any
    rank, so its ``.grad`` is None and torch's step skips it (it does not move, its state does not advance)."""
    for i, (t, g) in enumerate(zip(theta, grads)):
        t.grad = g.clone() if present is None or present[i] else None
    opt.step()


def _opt_star(opt: torch.optim.Optimizer, make_opt: MakeOpt, theta: Tensors, grads: Tensors,
              extrapolation: float = 1.0, present: Optional[Sequence[bool]] = None) -> Tensors:
    """Opt*(theta, g): the same step on a scratch copy; theta and opt untouched. ``extrapolation`` c:
    ``theta + c * (Opt*(theta, g) - theta)`` (``estimate_extrapolation``)."""
    scratch = [t.detach().clone() for t in theta]
    tmp = make_opt(scratch)
    tmp.load_state_dict(copy.deepcopy(opt.state_dict()))
    _opt_step(tmp, scratch, grads, present)
    if extrapolation != 1.0:
        return [t + extrapolation * (s - t) for t, s in zip(theta, scratch)]
    return scratch


def reference_run(
    theta0: Tensors,
    make_opt: MakeOpt,
    mode: str,
    grad_fn: GradFn,
    counts: Sequence[Sequence[int]],
    estimate_extrapolation: float = 1.0,
):
    """Simulate ``len(counts)`` ranks; ``counts[r][k]`` micro-batches of rank ``r`` in hand-off ``k``.

    Returns ``(after_step, final)``: ``after_step[r]`` lists the model weights
    on rank ``r`` after each of its ``step()`` calls, ``final`` the weights after
    ``finish()`` (the same on every rank).
    """
    n_ranks, n_handoffs = len(counts), len(counts[0])
    assert all(len(c) == n_handoffs for c in counts), "every rank hands off the same number of rounds"
    theta = [t.detach().clone() for t in theta0]  # committed weights theta_t
    opt = make_opt(theta)
    model = [t.clone() for t in theta]  # P: what the model holds (identical on all ranks)
    accum = [torch.zeros_like(t) for t in theta]
    seen = [False] * len(theta)  # whether tensor i got a gradient in the sum since the last commit, on any rank
    accum_count = 0
    pending = None  # (weights, kind) of the round in flight
    next_mb = [0] * n_ranks
    after_step: List[List[Tensors]] = [[] for _ in range(n_ranks)]

    for k in range(n_handoffs):
        for r in range(n_ranks):
            for j in range(counts[r][k]):
                for i, (a, g) in enumerate(zip(accum, grad_fn(r, next_mb[r], model))):
                    if g is not None:
                        a += g
                        seen[i] = True
                next_mb[r] += 1
                accum_count += 1
                if j < counts[r][k] - 1:  # no hand-off: the model keeps its weights
                    after_step[r].append([t.clone() for t in model])
        # Hand-off k: the previous round's weights become the model's.
        if pending is not None:
            model = [t.clone() for t in pending[0]]
        kind = "estimate" if mode == "acco" and k % 2 == 0 else "commit"
        mean = [a / accum_count for a in accum]
        if kind == "estimate":
            # theta~_{t+1}; gradients kept
            result = _opt_star(opt, make_opt, theta, mean, estimate_extrapolation, list(seen))
        else:
            _opt_step(opt, theta, mean, seen)  # theta_{t+1}
            result = [t.detach().clone() for t in theta]
            accum = [torch.zeros_like(t) for t in theta]
            seen = [False] * len(theta)
            accum_count = 0
        pending = (result, kind)
        if mode == "sync":
            model, pending = [t.clone() for t in result], None
        for r in range(n_ranks):
            after_step[r].append([t.clone() for t in model])

    if pending is not None and pending[1] == "commit":
        model = pending[0]
    return after_step, [t.clone() for t in model]


def quantized(x: torch.Tensor, kind: str, block: int, n_ranks: int) -> torch.Tensor:
    """What a rank's flat buffer ``x`` stands for after the 8-bit trip of ``algorithm.md`` ("Compressed rounds"):
    cut into ``n_ranks`` chunks of ``ceil(numel / n_ranks)`` (zero padding at the end), each chunk into blocks of
    ``block`` (the last one shorter); every block scaled by its largest magnitude over 127 (int8, rounded to
    nearest even and clamped), over 7 (int4, the same) or over 448 (fp8 e4m3), a block of zeros by 1, no scale
    below 2^-126, and back as ``q * s`` in fp32."""
    top = {"int8": 127.0, "int4": 7.0, "fp8": 448.0}[kind]
    size = -(-x.numel() // n_ranks)
    padded = torch.zeros(size * n_ranks, dtype=torch.float32, device=x.device)
    padded[: x.numel()] = x
    out = torch.empty_like(padded)
    for c in range(n_ranks):
        for a in range(c * size, (c + 1) * size, block):
            b = min(a + block, (c + 1) * size)
            v = padded[a:b]
            peak = float(v.abs().max())
            s = (torch.tensor(peak, dtype=torch.float32) / top if peak > 0 else torch.tensor(1.0)).to(x.device)
            s = torch.clamp(s, min=torch.finfo(torch.float32).tiny)  # never an underflowed 0 (denormal blocks)
            if kind in ("int8", "int4"):
                q = torch.clamp(torch.round(v / s), -top, top)
            else:
                q = torch.clamp(v / s, -top, top).to(torch.float8_e4m3fn).float()
            out[a:b] = q * s
    return out[: x.numel()]


def _flat(ts: Tensors) -> torch.Tensor:
    return torch.cat([t.reshape(-1).float() for t in ts])


def _unflat(x: torch.Tensor, like: Tensors) -> Tensors:
    out, at = [], 0
    for t in like:
        out.append(x[at: at + t.numel()].view_as(t).to(t.dtype))
        at += t.numel()
    return out


def _updates(
    theta0: Tensors,
    make_opt: MakeOpt,
    mode: str,
    grad_fn: GradFn,
    n_ranks: int,
    n_updates: int,
    m: int,
    learned: bool = False,
    lr_at: Optional[Callable[[int], float]] = None,
    synchronous_updates: int = 0,
    estimate_dtype: Optional[torch.dtype] = None,
    max_grad_norm: Optional[float] = None,
    estimate_microbatches: Optional[int] = None,
    estimate_extrapolation: float = 1.0,
    delay_correction: float = 0.0,
    compression: Optional[str] = None,
    compression_block: int = 256,
    compression_weights: bool = True,
    divide_by_ranks: bool = True,
    segments: Optional[List[torch.Tensor]] = None,
    compression_from: int = 0,
    estimate_compression: Optional[str] = None,
):
    """One ``step()`` per update of ``m`` micro-batches per rank (``algorithm.md``, "Hand-offs in the user's loop").

    ``grad_fn`` gives the gradient of the user's loss as the user scales it. An
    update's gradient is the ranks' mean of their summed ``.grad`` (what DDP
    all-reduces); an estimate extrapolates its ``h = m // 2`` (or ``estimate_microbatches``) micro-batches to
    ``m``. ``learned``: mode acco learned ``m`` from a first update that ran
    synchronously. ``lr_at(t)``: the learning rate of update ``t`` (a scheduler
    stepped after each ``step()``). ``synchronous_updates``: the
    first updates run as in mode sync (acco and dpu). ``estimate_dtype``: each
    rank's sum of its first ``h`` gradients is cast to it and the ranks' sums
    are added in it, in rank order (a ring's order for 2 ranks), and the
    estimate comes back as the model's weights plus its change against them cast to it. ``max_grad_norm``: each round's averaged gradient is clipped by its global
    norm. ``estimate_microbatches``: ``h``, when not the first half. ``estimate_extrapolation``: ``c``, the
    estimate is ``theta + c * (Opt*(theta, g) - theta)`` (before the cast to ``estimate_dtype``).
    ``delay_correction``: ``c`` of mode dpu's error feedback, ``theta_{k+1} = theta_k - u_k - c (u_k - u_{k-1})``
    with ``u`` the optimizer's steps, on every update that is not synchronous and follows one that was not.
    ``compression``: each rank's sum travels :func:`quantized`, the ranks' dequantized sums added in rank order;
    a commit's sum first takes the rank's residual, which becomes what its quantization dropped (the estimate's
    has none); and a round's weights arrive as the model's weights during the round plus the quantized change
    (``compression_weights=False``: exactly). ``compression_from``: the first update that compresses
    (``compression="auto"``'s switch, from a zero residual); the updates before it travel uncompressed, with
    ``estimate_dtype``. ``estimate_compression``: the estimate round's kind (gradients and weights' change),
    where it is not ``compression``'s. ``segments``: the flat vectors the library quantizes, as indices
    into the flattened model (its tensors in order), each cut into ``n_ranks`` chunks of its own: on a mesh, one
    per FSDP2 shard, its parameters' local pieces in order (default: the whole model, one vector). The average
    multiplies the ranks' sum by ``1/n_ranks`` (an estimate's by ``m/(h n_ranks)``;
    ``divide_by_ranks=False``: by ``1`` and ``m/h``, the ranks' gradients added, not averaged), in
    the float the library uses, so that exact sums give the very same inputs to an optimizer that rounds
    (Muon orthogonalises in bf16).

    Returns ``(after_step, committed, final)``: the model after each ``step()``
    (the same on every rank), the committed weights after each ``step()``
    (``opt.committed_weights()``), and the model after ``finish()``.
    """
    theta = [t.detach().clone() for t in theta0]
    opt = make_opt(theta)
    model = [t.clone() for t in theta]
    pending = None  # the in-flight commit's result
    nxt = [0] * n_ranks
    after_step: List[Tensors] = []
    committed: List[Tensors] = []
    h = estimate_microbatches or m // 2  # micro-batches before the estimate's hand-off
    ranks = n_ranks if divide_by_ranks else 1  # what the ranks' sum is divided by
    previous: List[Optional[torch.Tensor]] = [None] * len(theta)  # delay_correction: u_{k-1} of each tensor
    seen = [False] * len(theta)  # whether tensor i got a gradient in the update so far, on any rank

    own: List[Tensors] = []  # compression: each rank's sum of the update so far
    residual = [torch.zeros(sum(t.numel() for t in theta), device=theta[0].device) for _ in range(n_ranks)]

    def accumulate(accum: Tensors, count: int) -> None:
        for r in range(n_ranks):
            for _ in range(count):
                for i, (a, o, g) in enumerate(zip(accum, own[r], grad_fn(r, nxt[r], model))):
                    if g is not None:
                        a += g
                        o += g
                        seen[i] = True
                nxt[r] += 1

    def trip(x: torch.Tensor, commit: bool) -> torch.Tensor:
        """The flat ``x`` through the quantized trip (the commit's kind or the estimate's), each of ``segments`` on
        its own."""
        kind = active if commit or estimate_compression is None else estimate_compression
        if segments is None:
            return quantized(x, kind, compression_block, n_ranks)
        out = torch.full_like(x, float("nan"))  # an index no segment covers shows as NaN
        for idx in segments:
            out[idx] = quantized(x[idx], kind, compression_block, n_ranks)
        return out

    def arrived(weights: Tensors, reference: Tensors, commit: bool = True) -> Tensors:
        """A round's weights as every rank gets them: exactly, or (compression) the weights every rank held
        during the round plus the quantized trip of the change, per owner's chunk, in fp32."""
        if active is None or not compression_weights:
            return [w.detach().clone() for w in weights]
        ref = _flat(reference)
        return _unflat(ref + trip(_flat(weights) - ref, commit), reference)

    def travelled(accum: Tensors, commit: bool) -> Tensors:
        """The ranks' sum as the round sums it: ``accum`` itself, or each rank's through the quantized trip."""
        if active is None:
            return accum
        total = None
        for r in range(n_ranks):
            x = _flat(own[r]) + (residual[r] if commit else 0.0)
            sent = trip(x, commit)
            if commit:
                residual[r] = x - sent
            total = sent if total is None else total + sent
        return _unflat(total, accum)

    for t in range(n_updates):
        if lr_at is not None:
            for g in opt.param_groups:
                g["lr"] = lr_at(t)
        accum = [torch.zeros_like(x) for x in theta]
        own[:] = [[torch.zeros_like(x) for x in theta] for _ in range(n_ranks)]
        seen[:] = [False] * len(theta)
        synchronous = t < synchronous_updates or (learned and t == 0)
        active = compression if t >= compression_from else None  # the update's wire format
        narrow = estimate_dtype if active is None else None
        if mode == "acco" and not synchronous:
            if narrow is None:
                accumulate(accum, h)
                first = travelled(accum, commit=False)
            else:  # per rank, then summed over ranks in estimate_dtype
                accumulate(accum, h)
                first = None
                for r in range(n_ranks):
                    low = [o.to(narrow) for o in own[r]]
                    first = low if first is None else [f + x for f, x in zip(first, low)]
                first = [f.to(theta[0].dtype) for f in first]
            if pending is not None:  # hand-off of the estimate: theta_t into the model
                model, pending = [x.clone() for x in pending], None
            estimate = _opt_star(opt, make_opt, theta, clipped([a * (m / (h * ranks)) for a in first], max_grad_norm),
                                 estimate_extrapolation, list(seen))
            if narrow is not None:  # the change against the weights every rank holds (theta_t), cast
                estimate = [r + (x - r).to(narrow).to(theta[0].dtype) for x, r in zip(estimate, model)]
            accumulate(accum, m - h)
            model = arrived(estimate, model, commit=False)  # step(): theta~_{t+1} into the model, the commit in flight
            _opt_step(opt, theta, clipped([a * (1.0 / ranks) for a in travelled(accum, True)], max_grad_norm),
                      seen)
            yield t, theta  # the commit's step is done: regions_run's outer round reads and moves theta here
            pending = arrived(theta, model)
        else:
            accumulate(accum, m)
            if mode == "dpu" and pending is not None:
                model = [x.clone() for x in pending]
            before = [x.detach().clone() for x in theta]
            _opt_step(opt, theta, clipped([a * (1.0 / ranks) for a in travelled(accum, True)], max_grad_norm),
                      seen)
            if mode == "dpu" and delay_correction and not synchronous:
                for i, (b, x) in enumerate(zip(before, theta)):
                    if not seen[i]:  # not stepped: no feedback, its last step stays recorded
                        continue
                    u = b - x  # u_k
                    if previous[i] is not None:
                        with torch.no_grad():
                            x -= delay_correction * (u - previous[i])
                    previous[i] = u
            yield t, theta  # the commit's step is done: regions_run's outer round reads and moves theta here
            pending = arrived(theta, model)
            if mode == "sync" or synchronous:
                model, pending = pending, None
        after_step.append([x.clone() for x in model])
        committed.append([x.clone() for x in (pending if pending is not None else model)])
    final = pending if pending is not None else model
    return after_step, committed, [x.clone() for x in final]


def update_run(*args, **kwargs):
    """One region's run: see :func:`_updates` (its arguments and what it returns)."""
    return _drained(_updates(*args, **kwargs))


def _drained(run):
    """Run a :func:`_updates` generator to its end; its result."""
    while True:
        try:
            next(run)
        except StopIteration as stop:
            return stop.value


def regions_run(theta0: Tensors, make_opt: MakeOpt, mode: str, grad_fns: List[GradFn], n_ranks: int,
                n_updates: int, m: int, every: int, delay: int = 0, outer_lr: float = 0.7,
                outer_momentum: float = 0.9, outer_compression: Optional[str] = None, compression_block: int = 256,
                **kwargs):
    """``len(grad_fns)`` regions of ``n_ranks`` ranks (``grad_fns[r]``: region ``r``'s ``grad_fn``), each
    :func:`update_run`'s loop (``kwargs``: its options), and the outer round of ``algorithm.md`` ("Across
    regions") after the commit of every ``every``-th update: ``Δ_r = A − θ_r`` (quantized with region ``r``'s
    residual, cut into ``n_ranks`` chunks as the ranks' slices are, with ``outer_compression`` in blocks of
    ``compression_block``, the regions' own block too), the mean over
    regions in region order, merged ``delay`` commits later: ``A ← SGD(A, mean)`` (Nesterov with
    ``outer_momentum``), ``θ_r ← θ_r + (A − θ_r at the launch)`` (``delay`` 0: ``θ_r ← A``). The outer step runs
    on the whole flat model: SGD is elementwise, so it equals the ranks' steps on their slices.

    Returns each region's ``(after_step, committed, final)``, in region order."""
    runs = [_updates(theta0, make_opt, mode, fn, n_ranks, n_updates, m, compression_block=compression_block, **kwargs)
            for fn in grad_fns]
    regions = len(runs)
    anchor = _flat(theta0).clone()
    outer = torch.optim.SGD([anchor], lr=outer_lr, momentum=outer_momentum, nesterov=outer_momentum > 0)
    residual = [torch.zeros_like(anchor) for _ in runs]
    flight = None  # (the commit that merges it, the regions' mean, each region's theta at the launch)

    def merge(thetas, mean, bases):
        anchor.grad = mean
        outer.step()
        anchor.grad = None
        for theta, base in zip(thetas, bases):
            new = anchor.clone() if delay == 0 else _flat(theta) + (anchor - base)
            for x, v in zip(theta, _unflat(new, theta)):
                with torch.no_grad():
                    x.copy_(v)

    for k in range(1, n_updates + 1):
        thetas = [next(run)[1] for run in runs]  # every region after the step of its k-th commit
        if flight is not None and flight[0] == k:
            merge(thetas, flight[1], flight[2])
            flight = None
        if k % every == 0:
            total = torch.zeros_like(anchor)
            for r, theta in enumerate(thetas):
                delta = anchor - _flat(theta)
                if outer_compression is not None:
                    x = delta + residual[r]
                    delta = quantized(x, outer_compression, compression_block, n_ranks)
                    residual[r] = x - delta
                total += delta
            flight = (k + delay, total / regions, [_flat(theta).clone() for theta in thetas])
            if delay == 0:
                merge(thetas, flight[1], flight[2])
                flight = None
    return [_drained(run) for run in runs]
