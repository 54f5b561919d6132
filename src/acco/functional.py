"""``Opt*`` without a snapshot: the estimate ``theta~ = Opt*(theta, g)`` computed into the all-gather's input.

An estimate round must leave the master slice and the optimizer state as they
were (``docs/algorithm.md``). The general way (``snapshot.OptimizerSnapshot``)
copies both aside, runs the real step and copies them back: ``12 Phi / N``
bytes of scratch for AdamW and six slice-sized copies per round. For the
optimizers users run, this module computes the same arithmetic as torch's
single-tensor implementation straight into the all-gather's input, reading
the master, the gradient and the state and writing nothing else, in chunks so
that its temporaries stay small.

Supported: ``torch.optim.Adam`` and ``AdamW`` (no ``amsgrad``, no
``maximize``, float hyper-parameters) and ``torch.optim.SGD`` (momentum,
dampening, nesterov, weight decay; no ``maximize``). Anything else returns
``False`` and the caller keeps the snapshot path. Pure: no collective, no
host synchronisation (step counters on the device stay there).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

__all__ = ["CHUNK", "CUDA_CHUNK", "chunk_elements", "copy_ranges", "estimate_into", "norm_temporaries_bound",
           "sum_of_squares", "supports", "temporaries_bound"]

CHUNK = 1 << 20  # elements per piece of work on the CPU: the temporaries are a few of these
CUDA_CHUNK = 1 << 22  # on a GPU: a foreach kernel over 2^20 elements is launch-bound (docs/studies/gpu-runs.md)


def chunk_elements(master: torch.Tensor) -> int:
    """Elements per batch of :func:`estimate_into`'s work for a master slice on ``master``'s device."""
    return CUDA_CHUNK if master.is_cuda else CHUNK


def supports(optimizer: torch.optim.Optimizer) -> bool:
    """Whether :func:`estimate_into` computes ``optimizer``'s step (else use the snapshot)."""
    kind = type(optimizer)
    for group in optimizer.param_groups:
        if any(torch.is_tensor(group.get(k)) for k in ("lr", "weight_decay", "momentum", "dampening")):
            return False
        if group.get("maximize") or group.get("differentiable"):
            return False
        if kind in (torch.optim.Adam, torch.optim.AdamW):
            if group.get("amsgrad") or any(torch.is_tensor(b) for b in group["betas"]):
                return False
        elif kind is not torch.optim.SGD:
            return False
    return True


def temporaries_bound(optimizer: torch.optim.Optimizer, master: torch.Tensor) -> int:
    """Bytes :func:`estimate_into` allocates at most at once (on CUDA: on the side stream, until it has run):
    a batch's lists, at most :func:`chunk_elements` elements of the master's dtype each; Adam: the weight-decayed
    gradient, zeros before the first step, m, v, the denominator, decayed weights and the result; SGD four."""
    lists = 7 if type(optimizer) in (torch.optim.Adam, torch.optim.AdamW) else 4
    return lists * min(chunk_elements(master), master.numel()) * master.element_size()


def sum_of_squares(x: torch.Tensor) -> torch.Tensor:
    """Σ x² of a 1-D slice, in fp64 slab by slab (:func:`chunk_elements` at a time: no full-size temporary, and on
    CUDA few launches): finite for every finite ``x``, so only inf/NaN skips a round. In fp32 a square overflows
    from |x| ≈ 1.8e19 (finite gradients of 1e20 were skipped as non-finite), and one fp32 reduction over a CPU
    slice of 2^24 elements is 7e-4 off (test_pure.py)."""
    sq = torch.zeros((), dtype=torch.float64, device=x.device)
    step = min(chunk_elements(x), x.numel())
    if not step:
        return sq
    # One slab and one partial sum, allocated once and reused (on CUDA, on the round's stream)
    slab = torch.empty(step, dtype=torch.float64, device=x.device)
    part = torch.empty((), dtype=slab.dtype, device=x.device)
    for a in range(0, x.numel(), step):
        s = slab[: min(step, x.numel() - a)]
        s.copy_(x[a:a + step])
        torch.dot(s, s, out=part)
        sq.add_(part)
    return sq


def norm_temporaries_bound(master: torch.Tensor) -> int:
    """Bytes :func:`sum_of_squares` allocates at once over a slice like ``master``: one fp64 slab, and a few
    fp64 scalars (the sum, a slab's, the global norm's)."""
    return 8 * min(chunk_elements(master), master.numel()) + 64


@torch.no_grad()
def estimate_into(
    out: torch.Tensor,
    optimizer: torch.optim.Optimizer,
    pieces: Sequence[torch.Tensor],
    master: torch.Tensor,
    extrapolation: float = 1.0,
    counts_differ: bool = False,
) -> None:
    """Write ``Opt*(master, pieces' .grad)`` into ``out`` (master's shape, any float dtype) where ``pieces`` lie;
    change nothing else (the caller fills the rest of ``out``: other optimizers' tensors, padding).

    ``extrapolation`` ``c`` writes ``master + c * (Opt*(master, g) - master)`` instead (``estimate_extrapolation``,
    ``docs/algorithm.md``): every step these optimizers take is linear in the learning rate, weight decay
    included, so this is the step with ``c * lr``, at no extra cost.

    ``pieces`` are the wrapped optimizer's parameters (views of ``master``,
    each with its ``.grad``), in ``optimizer.param_groups`` order. ``out``
    may be the gradients' own memory (each ``.grad`` at its piece's offset):
    every batch's gradients are read before the batch is written. Call only if
    :func:`supports`.

    The arithmetic runs as ``torch._foreach_*`` ops over batches of at most
    :func:`chunk_elements` elements (a batch holds many small pieces, a large piece
    spans several batches), so the ops issued per round grow with the number
    of batches, not of tensors.
    """
    base, size = master.data_ptr(), master.element_size()
    adam = type(optimizer) in (torch.optim.Adam, torch.optim.AdamW)
    keys = ("exp_avg", "exp_avg_sq") if adam else ("momentum_buffer",)
    for group in optimizer.param_groups:
        # A group's pieces share its hyper-parameters, and they step together (each has a .grad, a view of the
        # gradient slice) under one step count, unless some skipped a step (no gradient, ``.grad`` None: they
        # are left as they are, as torch's step leaves them). Pieces are batched by step count: a host-side
        # count is read per piece; device-side counts are taken as one, and where ``counts_differ`` each piece
        # is its own batch (no host read of the device's counts).
        batches: Dict[Any, Tuple[Any, List[List[torch.Tensor]], List[List[torch.Tensor]]]] = {}
        skipped: List[Tuple[int, torch.Tensor]] = []
        for p in group["params"]:
            if p.numel() == 0:  # a parameter outside this rank's slice (an empty view has no address)
                continue
            start = (p.data_ptr() - base) // size
            if p.grad is None:  # no gradient in this round: theta~ is theta there
                skipped.append((start, p))
                continue
            state = optimizer.state.get(p, {})
            moments = [state[k].reshape(-1) for k in keys if state.get(k) is not None]
            step = state.get("step")
            if step is None:  # no count (SGD, or before the first step)
                key = None
            elif _device_count(step, group):
                key = id(p) if counts_differ else "device"
            else:
                key = float(step)
            entry = batches.setdefault(key, (step, [], []))  # every piece of a batch has this count
            row = [out[start : start + p.numel()], p.reshape(-1), p.grad.reshape(-1), *moments]
            (entry[1] if len(moments) == len(keys) else entry[2]).append(row)
        for start, p in skipped:
            out[start : start + p.numel()].copy_(p.reshape(-1))
        for step, with_state, without_state in batches.values():
            _estimate_batches(out, group, adam, step, with_state, without_state, master, extrapolation)


def _estimate_batches(out: torch.Tensor, group: Dict[str, Any], adam: bool, step: Optional[torch.Tensor],
                      with_state: List[List[torch.Tensor]], without_state: List[List[torch.Tensor]],
                      master: torch.Tensor, extrapolation: float) -> None:
    """:func:`estimate_into` for pieces of one group that share the step count ``step``."""
    for rows, stateful in ((with_state, True), (without_state, False)):
        # Adam's bias corrections from a device-side step count (capturable, fused): once per group. Each
        # is a few scalar kernels; per batch they were a third of a round's launches on the first GPU run.
        # A host-side count gives plain numbers, computed per batch (reading the count there is also
        # where the simulated device of tests/fake_cuda.py runs the queued batches and frees their
        # temporaries, which the caching allocator would reuse on the stream at once).
        once = _adam_scalars(step, group, extrapolation) if adam and stateful and _device_count(step, group) else None
        for batch in _batches(rows, chunk_elements(master)):
            columns = [list(c) for c in zip(*batch)]
            if adam:
                scalars = once if once is not None else _adam_scalars(step if stateful else None, group,
                                                                      extrapolation)
                _adam(*columns[:3], columns[3:] if stateful else None, scalars, group, extrapolation)
            else:
                _sgd(*columns[:3], columns[3] if stateful else None, group, extrapolation)


DELAY_KEY = "acco_previous_update"  # the state entry delay_correction keeps per tensor: the last step taken


@torch.no_grad()
def correct_delay(optimizer: torch.optim.Optimizer, tensors: Sequence[torch.Tensor],
                  pieces: Sequence[Tuple[int, int]], steps: torch.Tensor, c: float) -> None:
    """Error feedback for a one-step-stale gradient (``delay_correction``, mode dpu; ``docs/algorithm.md``).

    ``steps`` is ``u_k`` over the master slice (the slice before the optimizer's step minus after it);
    ``tensors`` are the optimizer's parameters, at ``pieces`` (local start, end) of that slice. Where the state
    records a previous step ``u_{k-1}``, ``theta -= c * (u_k - u_{k-1})``; ``u_k`` is recorded in its place (the
    first corrected update is a plain step). Three foreach ops for all the tensors, as :func:`estimate_into`
    keeps a round's launches from growing with the number of tensors."""
    fed, previous, now = [], [], []
    for t, (a, b) in zip(tensors, pieces):
        if t.grad is None:  # not stepped (no gradient): no feedback, and its last step stays the one recorded
            continue
        u = steps[a:b].view_as(t)
        state = optimizer.state[t]
        if state.get(DELAY_KEY) is None:  # nothing to feed back yet
            state[DELAY_KEY] = u.clone()
        else:
            fed.append(t)
            previous.append(state[DELAY_KEY])
            now.append(u)
    if fed:
        torch._foreach_add_(fed, previous, alpha=c)  # theta_{k+1} = theta_k - u_k - c (u_k - u_{k-1})
        torch._foreach_sub_(fed, now, alpha=c)
        torch._foreach_copy_(previous, now)


def copy_ranges(out: torch.Tensor, source: torch.Tensor, ranges: Sequence[Tuple[int, int]]) -> None:
    """``out[a:b] = source[a:b]`` for every range (one foreach copy): what an estimate leaves to the master."""
    ranges = [(a, b) for a, b in ranges if b > a]
    if ranges:
        torch._foreach_copy_([out[a:b] for a, b in ranges], [source[a:b] for a, b in ranges])


def _batches(rows: List[List[torch.Tensor]], chunk: int):
    """Rows of flat tensors (one per piece, all of one length) cut into segments of at most ``chunk`` elements
    and gathered into batches of at most ``chunk`` elements, in order."""
    batch: List[List[torch.Tensor]] = []
    filled = 0
    for row in rows:
        n = row[0].numel()
        for lo in range(0, n, chunk):
            hi = min(n, lo + chunk)
            if batch and filled + hi - lo > chunk:
                yield batch
                batch, filled = [], 0
            batch.append([t[lo:hi] for t in row])
            filled += hi - lo
    if batch:
        yield batch


def _device_count(step_t: Optional[torch.Tensor], g: Dict[str, Any]) -> bool:
    """Whether Adam's step count lives on the device (``capturable`` or ``fused``), where it stays."""
    return step_t is not None and bool(g.get("capturable") or g.get("fused"))


def _adam_scalars(step_t: Optional[torch.Tensor], g: Dict[str, Any], extrapolation: float = 1.0) -> Tuple[Any, Any]:
    """Adam's ``(sqrt(1 - beta2^t), c * lr / (1 - beta1^t))`` for the step that ``step_t`` (the state's count, or
    None before the first step) is about to take: numbers, or device scalars for a device-side count (``c``,
    the extrapolation, folded into the host number ``c * lr``: no kernel of its own)."""
    beta1, beta2 = g["betas"]
    if _device_count(step_t, g):  # the counter is on the device: stay there
        step = step_t.to(torch.float32) + 1
    else:  # a host-side counter (torch keeps it on the CPU), or none yet
        step = (float(step_t) if step_t is not None else 0.0) + 1.0
    bc2_sqrt = (1 - beta2**step) ** 0.5  # a number, or a device scalar: the same arithmetic either way
    return bc2_sqrt, g["lr"] * extrapolation / (1 - beta1**step)


def _adam(outs: List[torch.Tensor], params: List[torch.Tensor], grads: List[torch.Tensor],
          moments: Optional[List[List[torch.Tensor]]], scalars: Tuple[Any, Any], g: Dict[str, Any],
          extrapolation: float = 1.0) -> None:
    """torch.optim.Adam(W)'s step (the single-tensor arithmetic), into ``outs``; ``moments``: [exp_avg's,
    exp_avg_sq's], or None before the first step; ``scalars``: :func:`_adam_scalars` of the group, with ``c``;
    ``extrapolation``: that ``c``, the step taken ``c`` times (here: in the decoupled decay)."""
    beta1, beta2 = g["betas"]
    lr, eps, wd = g["lr"], g["eps"], g["weight_decay"]
    decoupled = g.get("decoupled_weight_decay", False)
    bc2_sqrt, step_size = scalars
    if wd != 0 and not decoupled:
        grads = torch._foreach_add(grads, params, alpha=wd)
    if moments is None:  # zeros, as the state torch would create (0 * g keeps a NaN gradient's NaN, like torch)
        zeros = torch._foreach_mul(grads, 0.0)
        moments = [zeros, zeros]
    m = torch._foreach_lerp(moments[0], grads, 1 - beta1)
    v = torch._foreach_mul(moments[1], beta2)
    torch._foreach_addcmul_(v, grads, grads, value=1 - beta2)
    denom = torch._foreach_sqrt(v)
    torch._foreach_div_(denom, bc2_sqrt)
    torch._foreach_add_(denom, eps)
    torch._foreach_div_(m, denom)
    torch._foreach_mul_(m, step_size)
    theta = torch._foreach_mul(params, 1 - extrapolation * lr * wd) if wd != 0 and decoupled else params
    torch._foreach_copy_(outs, torch._foreach_sub(theta, m))  # the gradients were all read above


def _sgd(outs: List[torch.Tensor], params: List[torch.Tensor], grads: List[torch.Tensor],
         bufs: Optional[List[torch.Tensor]], g: Dict[str, Any], extrapolation: float = 1.0) -> None:
    """torch.optim.SGD's step (the single-tensor arithmetic), into ``outs``; ``bufs``: the momentum buffers,
    or None before the first step; ``extrapolation``: ``c``, the step taken ``c`` times."""
    lr, wd, mu = g["lr"], g["weight_decay"], g["momentum"]
    dampening, nesterov = g["dampening"], g["nesterov"]
    if wd != 0:
        grads = torch._foreach_add(grads, params, alpha=wd)
    if mu != 0:
        if bufs is None:
            b = grads
        else:
            b = torch._foreach_mul(bufs, mu)
            torch._foreach_add_(b, grads, alpha=1 - dampening)
        grads = torch._foreach_add(grads, b, alpha=mu) if nesterov else b
    torch._foreach_copy_(outs, torch._foreach_add(params, grads, alpha=-lr * extrapolation))  # all grads read above
