"""Gradients at the ends of fp32's range are stepped, never skipped as non-finite (issue 78, items 1 and 2).

* A block whose gradient stays exactly zero (embedding rows of tokens no longer seen, a dead expert) keeps an
  error-feedback residual that each commit shrinks; once its peak fell below about 3e-43 the fp8 scale
  (peak / 448) underflowed to 0, the block became 0/0, and every later update was skipped. Denormal gradients
  did the same from the start. Now a scale is never below 2^-126 (``quantize.TINY``).
* Finite gradients of 1e20 and 1e30 overflowed the fp32 squared norm and were skipped as non-finite; the norm
  is now summed in fp64, and such an update is stepped as ``torch.optim.AdamW`` steps the same average.
"""

from __future__ import annotations

import pytest
import torch

from _dist import run_ranks

from acco import AccoOptimizer
from acco.quantize import dequantize, packed_size, quantize
from acco.rounds import global_grad_norm

VOCAB, WIDTH, UPDATES = 64, 16, 200


class _Embedder(torch.nn.Module):
    """Next-token prediction from an embedding: rows of tokens not drawn get exactly zero gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, WIDTH)
        self.out = torch.nn.Linear(WIDTH, VOCAB)

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(self.out(self.emb(tokens[:-1])), tokens[1:])


class _DeadExpert(torch.nn.Module):
    """Two experts mixed by a softmax gate; after update 0 the second's logit is -inf, so its weight is exactly
    0 and its gradient exactly zero (it still takes part: a zero gradient, not a missing one)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, WIDTH)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH) for _ in range(2))
        self.out = torch.nn.Linear(WIDTH, VOCAB)
        self.register_buffer("gate", torch.zeros(2))

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens[:-1])
        w = torch.softmax(self.gate, dim=0)
        h = sum(w[i] * torch.tanh(e(h)) for i, e in enumerate(self.experts))
        return torch.nn.functional.cross_entropy(self.out(h), tokens[1:])


def _tokens(rank: int, t: int, j: int) -> torch.Tensor:
    """Update 0 draws every token; later updates only the first quarter of the vocabulary."""
    g = torch.Generator().manual_seed(10_000 * rank + 10 * t + j)
    return torch.randint(0, VOCAB if t == 0 else VOCAB // 4, (33,), generator=g)


def _train(rank: int, world: int, model_name: str, compression) -> dict:
    torch.manual_seed(0)
    model = {"embedder": _Embedder, "dead-expert": _DeadExpert}[model_name]()
    opt = AccoOptimizer(model.parameters(), torch.optim.AdamW, mode="acco", microbatches_per_update=2, lr=1e-2,
                        compression=compression)
    for t in range(UPDATES):
        if model_name == "dead-expert" and t == 1:
            model.gate[1] = float("-inf")
        for j in range(2):
            (model.loss(_tokens(rank, t, j)) / 2).backward()
        opt.step()
        opt.zero_grad()
    opt.finish()
    with torch.no_grad():
        held_out = sum(float(model.loss(_tokens(7, UPDATES + 1, j))) for j in range(8)) / 8
    return {"skipped": opt.num_skipped_updates, "loss": held_out}


@pytest.mark.parametrize("model_name", ["embedder", "dead-expert"])
def test_blocks_without_gradients_are_never_skipped_under_compression(model_name):
    """200 updates on 2 ranks with rows (or an expert) whose gradient stays zero after update 0: int8 and fp8
    skip no update and end within 0.5% of the uncompressed run's held-out loss. Before the scale floor fp8
    skipped most updates from about the 24th on."""
    plain = run_ranks(_train, 2, model_name, None)[0]
    assert plain["skipped"] == 0
    for kind in ("int8", "fp8"):
        got = run_ranks(_train, 2, model_name, kind)
        assert [r["skipped"] for r in got] == [0, 0], (kind, got)
        assert abs(got[0]["loss"] / plain["loss"] - 1) <= 0.005, (kind, got[0]["loss"], plain["loss"])


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("value", [1e-41, 1e-44, 3e-43])
def test_a_denormal_block_comes_back_finite(kind, value):
    """A block of denormal values and zeros quantizes to finite values, within one scale (2^-126 at most) of
    them (a zero over an underflowed scale was 0/0)."""
    x = torch.zeros(300)
    x[::3], x[1::3] = value, -value
    packed = torch.zeros(packed_size(300, 256), dtype=torch.uint8)
    quantize(x, kind, 256, packed)
    back = dequantize(packed, kind, 256, 300)
    assert torch.isfinite(back).all()
    assert (back - x).abs().max() <= torch.finfo(torch.float32).tiny


@pytest.mark.parametrize("value", [1e20, 1e30, 3e38])
def test_the_norm_of_huge_finite_gradients_is_finite(value):
    """The round's norm of a slice of huge finite elements is their exact norm, not inf (fp32 squares overflow)."""
    x = torch.full((1000,), value)
    got = float(global_grad_norm(x, None))
    assert got == pytest.approx(float(x[0]) * 1000 ** 0.5, rel=1e-12)


def _huge(rank: int, world: int, value: float, mode: str, compression) -> dict:
    """Every gradient element `value` on each rank (a loss linear in the weights), AdamW, 3 updates."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    start = [p.detach().clone() for p in model.parameters()]
    compressed = {} if compression is None else {"compression": compression, "compression_weights": False}
    opt = AccoOptimizer(model.parameters(), torch.optim.AdamW, mode=mode, microbatches_per_update=2, lr=1e-2,
                        estimate_dtype=None, **compressed)
    for _ in range(3):
        for _ in range(2):
            sum((p * value / 2).sum() for p in model.parameters()).backward()
        opt.step()
        opt.zero_grad()
    opt.finish()
    ref = [p.clone().requires_grad_() for p in start]
    torch_opt = torch.optim.AdamW(ref, lr=1e-2)
    for _ in range(3):
        for p in ref:
            p.grad = torch.full_like(p, value)  # the ranks' average
        torch_opt.step()
    return {"skipped": opt.num_skipped_updates,
            "err": max(float((p.detach() - r.detach()).abs().max()) for p, r in zip(model.parameters(), ref)),
            "moved": max(float((p.detach() - s).abs().max()) for p, s in zip(model.parameters(), start))}


@pytest.mark.parametrize("value", [1e20, 1e30])
@pytest.mark.parametrize("mode,compression", [("sync", None), ("acco", None), ("sync", "int8")])
def test_huge_finite_gradients_are_stepped_as_adamw_steps_them(value, mode, compression):
    """2 ranks: no update skipped, and the weights are torch.optim.AdamW's on the same averaged gradient (mode
    sync; mode acco's commits take the same gradients, every micro-batch's being the same; int8 gradients with
    the weights sent exactly). At 1e30 AdamW's second moment overflows to inf and only the weight decay moves
    the weights: torch's step, taken as torch takes it."""
    for r in run_ranks(_huge, 2, value, mode, compression):
        assert r["skipped"] == 0, r
        assert r["moved"] > (0.01 if value == 1e20 else 0.0), r
        assert r["err"] <= 1e-6, r
