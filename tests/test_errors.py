"""Bad input fails at construction with a message naming the value and the fix."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from _dist import run_ranks
from tinynet import loss_fn, make_model

from acco import AccoOptimizer


def _frozen():
    m = nn.Linear(2, 2)
    m.requires_grad_(False)
    return m.parameters()


CASES = [
    ("no parameters", lambda: ([],), {}, ValueError, "empty parameter list"),
    ("all frozen", lambda: (_frozen(),), {}, ValueError, "requires_grad=True"),
    ("a single tensor", lambda: (nn.Parameter(torch.ones(2)),), {}, TypeError, "iterable of Tensors"),
    ("not tensors", lambda: ([1.0, 2.0],), {}, TypeError, "expected torch.Tensor"),
    ("integer parameter", lambda: ([torch.zeros(3, dtype=torch.int64)],), {}, TypeError, "floating-point"),
    ("sparse parameter", lambda: ([torch.zeros(3, 3).to_sparse().requires_grad_()],), {}, TypeError, "dense"),
    ("two devices", lambda: ([nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2, device="meta"))],), {}, ValueError, "one device"),
    ("two dtypes", lambda: ([nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2, dtype=torch.float64))],), {}, TypeError, "one dtype"),
    ("optimizer instance", lambda: (make_model().parameters(), torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=1)), {}, TypeError, "Optimizer subclass"),
    ("optimizer not a class", lambda: (make_model().parameters(), "adamw"), {}, TypeError, "optimizer_class"),
    ("unknown mode", lambda: (make_model().parameters(),), {"mode": "fast"}, ValueError, "'fast'"),
    ("min > max", lambda: (make_model().parameters(),), {"min_microbatches": 3, "max_microbatches": 2, "accumulate_while_communicating": True}, ValueError, "min_microbatches=3 > max_microbatches=2"),
    ("min < 1", lambda: (make_model().parameters(),), {"min_microbatches": 0, "accumulate_while_communicating": True}, ValueError, "min_microbatches"),
    ("bad kwarg", lambda: (make_model().parameters(),), {"momentum": 0.9}, TypeError, "momentum"),
    ("max_grad_norm <= 0", lambda: (make_model().parameters(),), {"max_grad_norm": 0.0}, ValueError, "max_grad_norm"),
    ("unknown nonfinite policy", lambda: (make_model().parameters(),), {"nonfinite": "ignore"}, ValueError, "'ignore'"),
    ("acco with one micro-batch per update", lambda: (make_model().parameters(),), {"microbatches_per_update": 1}, ValueError, "two halves.*mode='dpu'"),
    ("microbatches_per_update 0", lambda: (make_model().parameters(),), {"mode": "sync", "microbatches_per_update": 0}, ValueError, "microbatches_per_update"),
    ("max_microbatches without accumulating", lambda: (make_model().parameters(),), {"max_microbatches": 2}, ValueError, "only with accumulate_while_communicating=True"),
    ("per-update count while accumulating", lambda: (make_model().parameters(),), {"microbatches_per_update": 2, "accumulate_while_communicating": True}, ValueError, "one or the other"),
    ("accumulate flag not a bool", lambda: (make_model().parameters(),), {"accumulate_while_communicating": "yes"}, TypeError, "True or False"),
    ("buffers a single tensor", lambda: (make_model().parameters(),), {"buffers": torch.zeros(2)}, TypeError, "model.buffers"),
    ("buffers not tensors", lambda: (make_model().parameters(),), {"buffers": [1.0]}, TypeError, "model.buffers"),
    ("int compute dtype", lambda: (make_model().parameters(),), {"compute_dtype": torch.int8}, TypeError, "compute_dtype"),
]


@pytest.mark.parametrize("name,args,kwargs,exc,match", CASES, ids=[c[0] for c in CASES])
def test_bad_input_raises_clear_error(name, args, kwargs, exc, match):
    """Check that each bad input raises the right exception type with a message naming the value."""
    with pytest.raises(exc, match=match):
        AccoOptimizer(*args(), **kwargs)


def test_step_after_finish_raises():
    """Check that step() after finish() raises instead of training on a closed optimizer."""
    model = make_model()
    opt = AccoOptimizer(model.parameters(), mode="sync", lr=1e-2)
    loss_fn(model, 0, 0).backward()
    opt.step()
    opt.finish()
    opt.finish()  # idempotent
    with pytest.raises(RuntimeError, match="after finish"):
        opt.step()


def test_world_size_without_process_group_raises(monkeypatch):
    """Check that WORLD_SIZE>1 without an initialised process group is an error, not a silent single-process run."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match="init_process_group"):
        AccoOptimizer(make_model().parameters(), lr=1e-2)


def _mismatch_worker(rank: int, world: int) -> str:
    model = nn.Linear(4, 3 + rank)  # rank 1 has a different model
    try:
        AccoOptimizer(model.parameters(), lr=1e-2)
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def test_models_that_differ_across_ranks_fail_on_every_rank():
    """Check that a model mismatch is reported on every rank at construction instead of hanging."""
    for msg in run_ranks(_mismatch_worker, 2, timeout=120):
        assert "disagree" in msg and "rank 0" in msg and "rank 1" in msg, msg


def _failing_worker(rank: int, world: int) -> None:
    model = make_model()
    opt = AccoOptimizer(model.parameters(), mode="dpu", lr=1e-2)
    for i in range(100):
        if rank == 1 and i == 2:
            raise ValueError("rank 1 breaks down")
        loss_fn(model, rank, i).backward()
        opt.step()  # rank 0's round waits in a collective for rank 1
    opt.finish()


def test_a_failing_rank_fails_the_test_fast():
    """Check that the spawn helper reports a failing rank at once, not at the process-group timeout."""
    with pytest.raises(AssertionError, match="rank 1 failed"):
        run_ranks(_failing_worker, 2, timeout=50)  # a TimeoutError here would mean it hung


def test_frozen_parameters_are_ignored():
    """Check that parameters with requires_grad=False are neither updated nor part of the flat buffers."""
    model = make_model()
    model.fc1.requires_grad_(False)
    frozen = model.fc1.weight.detach().clone()
    opt = AccoOptimizer(model.parameters(), mode="sync", lr=1e-2)
    assert len(opt._params) == 3 and opt.layout.numel == 18 + 3 + 2
    loss_fn(model, 0, 0).backward()
    opt.step()
    assert torch.equal(model.fc1.weight, frozen) and model.fc1.weight.grad is None


@pytest.mark.parametrize("zero", ["opt", "model_none"])
def test_sparse_gradients_are_densified(zero):
    """Check that nn.Embedding(sparse=True) trains exactly as the dense embedding (gradients densified)."""
    finals = []
    for sparse in (False, True):
        torch.manual_seed(0)
        emb = nn.Embedding(10, 3, sparse=sparse)
        opt = AccoOptimizer(emb.parameters(), mode="sync", lr=1e-2)
        for i in range(4):
            if zero == "model_none":
                emb.zero_grad(set_to_none=True)  # then autograd hands over a sparse tensor
            emb(torch.tensor([i, i + 1, 1])).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
        opt.finish()
        finals.append(emb.weight.detach().clone())
    assert torch.equal(finals[0], finals[1])
