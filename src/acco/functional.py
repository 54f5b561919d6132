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

from typing import Any, Dict, Optional, Sequence

import torch

__all__ = ["CHUNK", "estimate_into", "supports"]

CHUNK = 1 << 20  # elements per piece of work: the temporaries are a few of these


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


@torch.no_grad()
def estimate_into(
    out: torch.Tensor,
    optimizer: torch.optim.Optimizer,
    pieces: Sequence[torch.Tensor],
    master: torch.Tensor,
) -> None:
    """Write ``Opt*(master, pieces' .grad)`` into ``out`` (master's shape, any float dtype); change nothing else.

    ``pieces`` are the wrapped optimizer's parameters (views of ``master``,
    each with its ``.grad``), in ``optimizer.param_groups`` order, which is
    master order; ``master`` outside them (padding) is copied as is. ``out``
    may be the gradients' own memory (each ``.grad`` at its piece's offset):
    every chunk's gradient is read before the chunk is written. Call only if
    :func:`supports`.
    """
    base = master.data_ptr()
    size = master.element_size()
    adam = type(optimizer) in (torch.optim.Adam, torch.optim.AdamW)
    covered = 0  # pieces are in master order: what lies between them (padding) is copied as is
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.numel() == 0:  # a parameter outside this rank's slice (an empty view has no address)
                continue
            start = (p.data_ptr() - base) // size
            if start > covered:
                out[covered:start].copy_(master[covered:start])
            covered = max(covered, start + p.numel())
            target = out[start : start + p.numel()].view_as(p)
            state = optimizer.state.get(p, {})
            if adam:
                _adam(target, p, p.grad, state, group)
            else:
                _sgd(target, p, p.grad, state, group)
    if covered < master.numel():
        out[covered:].copy_(master[covered:])


def _chunks(*tensors: torch.Tensor):
    flat = [t.reshape(-1) for t in tensors]
    n = flat[0].numel()
    for lo in range(0, n, CHUNK):
        yield [t[lo : lo + CHUNK] for t in flat]


def _adam(out: torch.Tensor, param: torch.Tensor, grad: torch.Tensor, state: Dict[str, Any], g: Dict[str, Any]) -> None:
    """torch.optim.Adam(W)'s single-tensor step, into ``out``."""
    beta1, beta2 = g["betas"]
    lr, eps, wd = g["lr"], g["eps"], g["weight_decay"]
    decoupled = g.get("decoupled_weight_decay", False)
    step_t: Optional[torch.Tensor] = state.get("step")
    exp_avg, exp_avg_sq = state.get("exp_avg"), state.get("exp_avg_sq")
    if step_t is not None and (g.get("capturable") or g.get("fused")):  # the counter is on the device: stay there
        step = step_t.to(torch.float32) + 1
    else:  # a host-side counter (torch keeps it on the CPU), or none yet
        step = (float(step_t) if step_t is not None else 0.0) + 1.0
    bc2_sqrt = (1 - beta2**step) ** 0.5  # a number, or a device scalar: the same arithmetic either way
    step_size = lr / (1 - beta1**step)
    for o, p, gr, *moments in _chunks(out, param, grad, *(t for t in (exp_avg, exp_avg_sq) if t is not None)):
        m, v = moments if moments else (torch.zeros_like(p), torch.zeros_like(p))
        theta = p.clone()
        if wd != 0:
            if decoupled:
                theta.mul_(1 - lr * wd)
            else:
                gr = gr.add(p, alpha=wd)
        m = m.lerp(gr, 1 - beta1)
        v = v.mul(beta2).addcmul_(gr, gr, value=1 - beta2)
        denom = (v.sqrt() / bc2_sqrt).add_(eps)
        o.copy_(theta.sub_(m.div_(denom).mul_(step_size)))


def _sgd(out: torch.Tensor, param: torch.Tensor, grad: torch.Tensor, state: Dict[str, Any], g: Dict[str, Any]) -> None:
    """torch.optim.SGD's single-tensor step, into ``out``."""
    lr, wd, mu = g["lr"], g["weight_decay"], g["momentum"]
    dampening, nesterov = g["dampening"], g["nesterov"]
    buf = state.get("momentum_buffer")
    for o, p, gr, *rest in _chunks(out, param, grad, *([buf] if buf is not None else [])):
        if wd != 0:
            gr = gr.add(p, alpha=wd)
        if mu != 0:
            b = gr.clone() if not rest else rest[0].mul(mu).add_(gr, alpha=1 - dampening)
            gr = gr.add(b, alpha=mu) if nesterov else b
        o.copy_(p.add(gr, alpha=-lr))
