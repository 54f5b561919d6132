"""A tiny model and deterministic data shared by the tests.

59 trainable elements (a prime), so shards are uneven for 2 and 3 ranks and
parameters straddle shard boundaries.
"""

from __future__ import annotations

from typing import List

import torch
from torch import nn


class TinyNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(5, 6)
        self.fc2 = nn.Linear(6, 3)
        self.shift = nn.Parameter(torch.zeros(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.fc2(torch.tanh(self.fc1(x)))
        return out + torch.cat([self.shift, self.shift.new_zeros(1)])


def make_model(seed: int = 0) -> TinyNet:
    torch.manual_seed(seed)
    return TinyNet()


def batch(rank: int, index: int, n: int = 4):
    """Micro-batch ``index`` of ``rank``: the same on every run and process."""
    g = torch.Generator().manual_seed(1000 * rank + index + 1)
    x = torch.randn(n, 5, generator=g)
    y = torch.randn(n, 3, generator=g)
    return x, y


def loss_fn(model: nn.Module, rank: int, index: int) -> torch.Tensor:
    x, y = batch(rank, index)
    return ((model(x) - y) ** 2).mean()


def grad_fn(rank: int, index: int, weights: List[torch.Tensor]) -> List[torch.Tensor]:
    """Gradient of micro-batch ``(rank, index)`` at ``weights`` (for the oracle)."""
    from oracle import grads_at

    return grads_at(TinyNet(), weights, lambda model: loss_fn(model, rank, index))


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).to(torch.float64) for p in model.parameters()])


def flat_list(ts: List[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).to(torch.float64) for t in ts])


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest element-wise error relative to the reference's scale."""
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def record_round_lrs(opt, used: List[float], monkeypatch) -> None:
    """Append the learning rate every round of ``opt`` uses to ``used``: commits through the wrapped optimizer's
    step(), estimates through acco.functional (Opt* computed without a step() for Adam, AdamW and SGD)."""
    from acco import functional

    opt.local_optimizer.register_step_pre_hook(lambda o, *_: used.append(o.param_groups[0]["lr"]))
    real = functional.estimate_into

    def estimate_into(out, optimizer, *args):
        used.append(optimizer.param_groups[0]["lr"])
        return real(out, optimizer, *args)

    monkeypatch.setattr(functional, "estimate_into", estimate_into)


def master_of(opt) -> torch.Tensor:
    """This rank's fp32 master weights from ``opt.state_dict()``: its pieces end to end, in parameter order."""
    pieces = opt.state_dict()["master"]
    return torch.cat([pieces[k] for k in sorted(pieces, key=lambda k: tuple(int(x) for x in k.split(":")))])


def elastic_run(opt, rounds: int, micro_batch, snapshot):
    """The tests' loop for ``accumulate_while_communicating``: ``micro_batch(mb)`` runs micro-batch ``mb``'s
    forward and backward, then ``step()`` and ``zero_grad()``, until ``rounds`` rounds are handed off. Returns the
    micro-batches of each hand-off (what the oracle is fed) and ``snapshot()`` after every ``step()``."""
    counts, traj, mb, since = [], [], 0, 0
    while opt.num_rounds < rounds:  # every rank hands off exactly ``rounds`` rounds
        micro_batch(mb)
        before = opt.num_rounds
        opt.step()
        opt.zero_grad()
        mb, since = mb + 1, since + 1
        if opt.num_rounds > before:
            counts.append(since)
            since = 0
        traj.append(snapshot())
    return counts, traj
