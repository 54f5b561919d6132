"""One process, no process group: still sharded (N=1) and still asynchronous."""

from __future__ import annotations

import threading

import pytest
import torch

from oracle import reference_run
from tinynet import batch, flat, flat_list, grad_fn, loss_fn, make_model, rel_err

from acco import AccoOptimizer


def _run(mode, steps, zero="opt", **kw):
    model = make_model()
    theta0 = [p.detach().clone() for p in model.parameters()]
    opt = AccoOptimizer(model.parameters(), mode=mode, accumulate_while_communicating=True, max_microbatches=1, lr=1e-2, weight_decay=0.1, **kw)
    threads = []
    opt.local_optimizer.register_step_pre_hook(lambda *_: threads.append(threading.current_thread().name))
    traj = []
    for i in range(steps):
        if zero == "model_none_before":
            model.zero_grad(set_to_none=True)
        loss_fn(model, 0, i).backward()
        opt.step()
        if zero == "opt":
            opt.zero_grad()
        elif zero == "model_zero_after":
            model.zero_grad(set_to_none=False)
        elif zero == "model_none_after":
            model.zero_grad(set_to_none=True)
        traj.append(flat(model))
    opt.finish()
    return theta0, traj, flat(model), threads


@pytest.mark.parametrize("mode", ["acco", "dpu", "sync"])
def test_single_process_matches_oracle_and_runs_rounds_on_a_worker_thread(mode):
    """Check that without a process group every mode equals the oracle and rounds run off the main thread."""
    theta0, traj, final, threads = _run(mode, 7)
    ref, ref_final = reference_run(theta0, lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1), mode, grad_fn, [[1] * 7])
    assert max(rel_err(a, flat_list(b)) for a, b in zip(traj, ref[0])) < 1e-5
    assert rel_err(final, flat_list(ref_final)) < 1e-5
    assert threads and all(t != "MainThread" for t in threads), threads


@pytest.mark.parametrize("zero", ["none", "opt", "model_zero_after", "model_none_after", "model_none_before"])
def test_gradients_accumulate_whatever_the_user_does_with_zero_grad(zero):
    """Check that opt.zero_grad(), model.zero_grad(set_to_none=True/False) or none at all give the same run."""
    _, traj_ref, final_ref, _ = _run("acco", 6, zero="opt")
    _, traj, final, _ = _run("acco", 6, zero=zero)
    assert torch.equal(final, final_ref)
    assert all(torch.equal(a, b) for a, b in zip(traj, traj_ref))


def test_zero_grad_between_backward_and_step_discards_that_micro_batch():
    """Check that opt.zero_grad() drops gradients not yet given to step(), as in torch, and the update's
    micro-batch count starts again (a loop skipping a bad batch)."""
    runs = []
    for discard in (True, False):
        model = make_model()
        opt = AccoOptimizer(model.parameters(), microbatches_per_update=4, lr=1e-2, weight_decay=0.0)
        for t in range(3):
            if discard:
                loss_fn(model, 0, 100 + t).backward()  # a bad batch (before the first half is complete)...
                opt.zero_grad()  # ...skipped
            for j in range(4):
                loss_fn(model, 0, 4 * t + j).backward()
            opt.step()
        opt.finish()
        runs.append(flat(model))
    assert torch.equal(runs[0], runs[1])
    model = make_model()
    opt = AccoOptimizer(model.parameters(), microbatches_per_update=2, lr=1e-2)
    loss_fn(model, 0, 0).backward()  # the estimate is handed off here
    with pytest.raises(RuntimeError, match="estimate round .* already handed off"):
        opt.zero_grad()


def test_bf16_compute_copy_with_fp32_master():
    """Check that compute_dtype=bf16 gives bf16 parameters, an fp32 master, and tracks the fp32 run."""
    model = make_model()
    theta0 = [p.detach().clone() for p in model.parameters()]
    opt = AccoOptimizer(model.parameters(), mode="sync", compute_dtype=torch.bfloat16, lr=1e-2)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert opt.runtime.flat.master.dtype == torch.float32
    ptrs = [p.data_ptr() for p in model.parameters()]
    for i in range(5):
        x, y = batch(0, i)
        ((model(x.bfloat16()).float() - y) ** 2).mean().backward()
        opt.step()
    opt.finish()
    assert [p.data_ptr() for p in model.parameters()] == ptrs  # addresses fixed after construction
    master = opt.runtime.flat.master[: opt.layout.numel]
    assert torch.equal(flat(model), master.to(torch.bfloat16).to(torch.float64))  # model = rounded master
    _, ref_final = reference_run(theta0, lambda ps: torch.optim.AdamW(ps, lr=1e-2), "sync", grad_fn, [[1] * 5])
    # bf16 gradients: AdamW normalises them, so single elements may differ by ~lr per step;
    # the update as a whole must follow the fp32 one.
    delta, ref_delta = master.double() - flat_list(theta0), flat_list(ref_final) - flat_list(theta0)
    assert ((delta - ref_delta).norm() / ref_delta.norm()).item() < 0.15  # seen: 0.082


def test_parameter_addresses_never_change():
    """Check that the theta/theta~ swap copies into the parameters instead of rebinding them."""
    model = make_model()
    ptrs = [p.data_ptr() for p in model.parameters()]
    opt = AccoOptimizer(model.parameters(), lr=1e-2)
    for i in range(5):
        loss_fn(model, 0, 2 * i).backward()
        assert [p.data_ptr() for p in model.parameters()] == ptrs  # after the estimate hand-off
        loss_fn(model, 0, 2 * i + 1).backward()
        opt.step()
        assert [p.data_ptr() for p in model.parameters()] == ptrs
    opt.finish()
    assert [p.data_ptr() for p in model.parameters()] == ptrs


def test_a_learned_update_not_longer_than_estimate_microbatches_is_refused_at_its_step():
    """Mode acco learning M from the first update: estimate_microbatches must still leave a micro-batch after the
    estimate's hand-off; the first step() says so, and a long enough update trains (the estimate after 2 of 3)."""
    for m, h in ((2, 2), (3, 2)):
        model = make_model()
        opt = AccoOptimizer(model.parameters(), estimate_microbatches=h, lr=1e-2)
        for j in range(m):
            (loss_fn(model, 0, j) / m).backward()
        if m <= h:
            with pytest.raises(ValueError, match=f"estimate_microbatches={h} with {m} micro-batches per update"):
                opt.step()
            continue
        opt.step()
        opt.zero_grad()
        for t in range(1, 3):
            for j in range(m):
                (loss_fn(model, 0, m * t + j) / m).backward()
                assert opt.num_rounds == 1 + 2 * (t - 1) + (j + 1 >= h), (t, j, opt.num_rounds)  # hand-off after h
            opt.step()
            opt.zero_grad()
        opt.finish()
        assert (opt.microbatches_per_update, opt.num_updates) == (3, 3)


def test_a_loaded_or_set_update_not_longer_than_estimate_microbatches_is_refused():
    """M can also come from a checkpoint (an optimizer that learns M takes the saved one) or be set: either way
    estimate_microbatches must stay below it, refused before anything is loaded or changed."""
    model = make_model()
    src = AccoOptimizer(model.parameters(), microbatches_per_update=2, lr=1e-2)
    for j in range(2):
        (loss_fn(model, 0, j) / 2).backward()
    src.step()
    src.finish()
    sd = src.state_dict()
    target = AccoOptimizer(make_model().parameters(), estimate_microbatches=2, lr=1e-2)
    with pytest.raises(ValueError, match="load_state_dict.*estimate_microbatches=2 with 2 micro-batches.*Nothing was loaded"):
        target.load_state_dict(sd)
    assert target.microbatches_per_update is None and target.num_updates == 0
    with pytest.raises(ValueError, match="estimate_microbatches=2 with 2 micro-batches per update"):
        target.microbatches_per_update = 2
    assert target.microbatches_per_update is None
    target.microbatches_per_update = 3  # long enough: taken
    target.finish()


def test_a_finished_optimizer_is_freed_when_dropped_without_the_garbage_collector():
    """Check that dropping a finished optimizer frees it (and its buffers) at once, with the collector off:
    no part of it (its runtime, loop, state's owners, session) refers back to it or to the runtime. Its parts once held its
    methods strongly, a cycle that kept a
    dropped optimizer's buffers (9 parameter copies at one rank) on the GPU until a collection (found
    after the first GPU run). The process's first optimizer is built and dropped first: torch's first use
    leaves a collectable cycle through it that later ones do not have."""
    import gc
    import weakref

    def run(**options):
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
        opt = AccoOptimizer(model.parameters(), lr=1e-3, **options)
        m = 1 if options.get("accumulate_while_communicating") else 2
        for _ in range(3):
            for _ in range(m):
                model(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
        if m == 2:
            opt.state_dict()  # a checkpoint's gathers go through the state's owners
        opt.finish()
        # the front, its runtime and the buffers: none may wait for the collector
        return [weakref.ref(opt), weakref.ref(opt.runtime), weakref.ref(opt.runtime.flat.master)]

    was_enabled = gc.isenabled()
    gc.disable()
    try:
        run(microbatches_per_update=2)
        gc.collect()
        for options in ({"mode": "acco", "microbatches_per_update": 2}, {"mode": "sync", "microbatches_per_update": 2},
                        {"mode": "dpu", "microbatches_per_update": 2},
                        {"mode": "acco", "accumulate_while_communicating": True, "max_microbatches": 1}):
            assert [ref() for ref in run(**options)] == [None] * 3, options
    finally:
        if was_enabled:
            gc.enable()


def test_estimate_extrapolation_auto_resolves_against_the_wrapped_optimizers():
    """``estimate_extrapolation="auto"`` (the default) is 1.2 for AdamW in mode acco with one step() per update,
    1.0 for a Muon + AdamW split, SGD, a later hand-off, mode dpu and accumulate_while_communicating; a number
    given is kept."""
    def resolved(opt):
        c = opt.estimate_extrapolation
        assert c == opt.options.delay.estimate_extrapolation
        opt.finish()
        return c

    model = make_model()
    hidden = [p for p in model.parameters() if p.ndim == 2]
    others = [p for p in model.parameters() if p.ndim != 2]
    assert resolved(AccoOptimizer(model.parameters(), microbatches_per_update=2, lr=1e-2)) == 1.2
    assert resolved(AccoOptimizer(model.parameters(), microbatches_per_update=2, estimate_extrapolation=1.0,
                                  lr=1e-2)) == 1.0
    assert resolved(AccoOptimizer(model.parameters(), torch.optim.SGD, microbatches_per_update=2, lr=1e-2)) == 1.0
    assert resolved(AccoOptimizer.from_optimizer([torch.optim.Muon(hidden, lr=0.02), torch.optim.AdamW(others)],
                                                 microbatches_per_update=2)) == 1.0
    assert resolved(AccoOptimizer.from_optimizer(torch.optim.AdamW(model.parameters()), mode="dpu",
                                                 microbatches_per_update=2)) == 1.0
    assert resolved(AccoOptimizer(model.parameters(), microbatches_per_update=4, estimate_microbatches=3,
                                  lr=1e-2)) == 1.0
    assert resolved(AccoOptimizer(model.parameters(), accumulate_while_communicating=True, max_microbatches=1,
                                  lr=1e-2)) == 1.0


def test_the_configuration_is_resolved_once_and_read_only():
    """Every option is resolved at construction into one frozen ``opt.options`` that the optimizer's attributes
    read: the dtypes against the model (``"auto"`` is None on one process), and nothing can change it later."""
    import dataclasses

    model = make_model()
    opt = AccoOptimizer(model.parameters(), mode="dpu", microbatches_per_update=2, max_grad_norm=1.0,
                        compute_dtype=torch.bfloat16, delay_correction=0.5, lr=1e-2)
    o = opt.options
    assert (o.mode, o.robustness.max_grad_norm, o.delay.delay_correction, o.delay.synchronous_updates) == (
        "dpu", 1.0, 0.5, 0)
    p = o.precision
    assert (p.compute_dtype, p.accumulation_dtype, p.reduce_dtype, p.estimate_dtype) == (
        torch.bfloat16, torch.float32, torch.float32, None)
    assert not o.estimates and not o.synchronous
    for name in ("mode", "max_grad_norm", "compute_dtype", "reduce_dtype", "estimate_dtype", "delay_correction"):
        assert getattr(opt, name) == o.value(name), name
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.mode = "sync"
    with pytest.raises(AttributeError):
        opt.max_grad_norm = 2.0
    opt.finish()
