"""The model's weights written after the optimizer is built and before its first step() (a model-only load: a
pretrained or seed checkpoint, torchtitan's initial load): refused at the first round, or taken with
``opt.take_model_weights()``. Without either, the first round's master weights silently undid the write."""

from __future__ import annotations

import pytest
import torch

from _dist import run_ranks

from acco import AccoOptimizer

WORDS = "were written after the optimizer was built and before its first step()"


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))


def _backward(model: torch.nn.Module, m: int) -> None:
    for j in range(m):
        (model(torch.randn(5, 4, generator=torch.Generator().manual_seed(j))).pow(2).mean() / m).backward()


@pytest.mark.parametrize("mode,m", [("sync", 1), ("dpu", 1), ("acco", 2)])
def test_a_write_before_the_first_step_is_refused_then_taken(mode, m):
    """SGD at lr 0: after take_model_weights() the step keeps the written weights (before the fix it put the
    constructor's back); without it the first round raises, naming the parameters and the call to make."""
    model = _net()
    opt = AccoOptimizer(model.parameters(), torch.optim.SGD, mode=mode, microbatches_per_update=m, lr=0.0,
                        estimate_dtype=None)
    with torch.no_grad():
        model[2].weight.fill_(3.0)
    with pytest.raises(RuntimeError, match=r"parameter\(s\) \[2\] " + WORDS):
        _backward(model, m)  # mode acco hands its estimate off at the end of the first half's backward
        opt.step()
    opt.zero_grad()
    opt.take_model_weights()
    for _ in range(2):
        _backward(model, m)
        opt.step()
        opt.zero_grad()
    opt.finish()
    assert torch.equal(model[2].weight, torch.full_like(model[2].weight, 3.0))


def test_a_write_of_the_same_values_is_not_one():
    """DDP's construction broadcasts the first rank's weights in place (HF Trainer builds it after the
    optimizer): the values are the ones the optimizer holds, so nothing is refused."""
    model = _net()
    opt = AccoOptimizer(model.parameters(), torch.optim.SGD, mode="sync", microbatches_per_update=1, lr=0.1)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.clone())
    _backward(model, 1)
    opt.step()
    assert opt.num_updates == 1


def test_take_model_weights_after_a_round_is_refused():
    model = _net()
    opt = AccoOptimizer(model.parameters(), torch.optim.SGD, mode="sync", microbatches_per_update=1, lr=0.1)
    _backward(model, 1)
    opt.step()
    with pytest.raises(RuntimeError, match=r"take_model_weights\(\) after 1 round\(s\): only before the first"):
        opt.take_model_weights()


def _two_ranks(rank: int, world: int) -> list:
    model = _net()
    opt = AccoOptimizer(model.parameters(), torch.optim.SGD, mode="acco", microbatches_per_update=2, lr=0.0,
                        estimate_dtype=None)
    with torch.no_grad():
        model[0].weight.fill_(1.0 + rank)  # every rank loads; rank 0's win, as at construction
    opt.take_model_weights()
    _backward(model, 2)
    opt.step()
    opt.zero_grad()
    opt.finish()
    return model[0].weight.flatten().tolist()


def test_take_model_weights_gives_every_rank_the_first_ranks():
    assert run_ranks(_two_ranks, 2) == [[1.0] * 12] * 2


def test_divide_by_ranks_false_is_refused_with_accumulate_while_communicating():
    with pytest.raises(ValueError, match="divide_by_ranks=False does not apply with accumulate_while_communicating"):
        AccoOptimizer(_net().parameters(), torch.optim.SGD, lr=0.1, accumulate_while_communicating=True,
                      divide_by_ranks=False)
