"""Opt* without a snapshot (acco.functional) against the optimizer's own step, on random shapes: it writes the
pieces only (the round copies the rest of the slice from the master)."""

from __future__ import annotations

import pytest
import torch

from acco import functional

CASES = [
    ("adamw", torch.optim.AdamW, dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)),
    ("adamw-no-decay", torch.optim.AdamW, dict(lr=3e-3, weight_decay=0.0, eps=1e-6)),
    ("adamw-fused", torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1, fused=True)),
    ("adam-l2", torch.optim.Adam, dict(lr=1e-2, weight_decay=0.05)),
    ("sgd", torch.optim.SGD, dict(lr=0.1)),
    ("sgd-momentum", torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=0.01)),
    ("sgd-nesterov", torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True)),
    ("sgd-dampening", torch.optim.SGD, dict(lr=0.1, momentum=0.8, dampening=0.3)),
]


def _setup(cls, kw, seed, chunk):
    g = torch.Generator().manual_seed(seed)
    shapes = [tuple(int(x) for x in torch.randint(1, 9, (int(torch.randint(1, 4, (1,), generator=g)),), generator=g))
              for _ in range(4)]
    n = sum(torch.Size(s).numel() for s in shapes)
    master = torch.randn(n + 3, generator=g)  # 3 elements of padding after the pieces
    grad = torch.randn(n + 3, generator=g)
    pieces, lo = [], 0
    for s in shapes:
        k = torch.Size(s).numel()
        p = master[lo : lo + k].view(s)
        p.grad = grad[lo : lo + k].view(s)
        pieces.append(p)
        lo += k
    return master, grad, pieces, cls([{"params": pieces[:2]}, {"params": pieces[2:], "lr": kw["lr"] / 2}], **kw)


@pytest.mark.parametrize("name,cls,kw", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("steps_before", [0, 3])
@pytest.mark.parametrize("into_grad", [False, True], ids=["own-output", "into-grad"])
@pytest.mark.parametrize("c", [1.0, 1.3, 0.4], ids=["step", "extrapolated-1.3", "damped-0.4"])
def test_estimate_equals_the_optimizers_step_and_changes_nothing(name, cls, kw, steps_before, into_grad, c, monkeypatch):
    """Opt*, or with ``c`` (estimate_extrapolation) ``theta + c * (Opt* - theta)``, against the real step."""
    monkeypatch.setattr(functional, "CHUNK", 5)  # several chunks per piece
    for seed in range(3):
        master, grad, pieces, opt = _setup(cls, kw, seed, 5)
        for _ in range(steps_before):  # some state
            opt.step()
            grad.mul_(0.7).add_(0.1)
        assert functional.supports(opt)
        before_master = master.clone()
        grad_before = grad.clone()
        before_state = {id(p): {k: (v.clone() if torch.is_tensor(v) else v) for k, v in opt.state[p].items()}
                        for p in pieces}
        n = master.numel() - 3
        if into_grad:  # the round's fp32 case: Opt* overwrites the gradient slice it reads
            functional.estimate_into(grad, opt, pieces, master, c)
            assert torch.equal(grad[n:], grad_before[n:]), "only the pieces are written"
            out = grad.clone()
            grad.copy_(grad_before)
        else:
            out = torch.full_like(master, float("nan"))
            functional.estimate_into(out, opt, pieces, master, c)
            assert bool(out[n:].isnan().all()) and not bool(out[:n].isnan().any()), "only the pieces are written"
        functional.copy_ranges(out, master, [(n, n + 3)])  # the round copies the rest (padding) from the master
        assert torch.equal(master, before_master), "theta must not move"
        for p in pieces:
            for k, v in before_state[id(p)].items():
                assert torch.equal(opt.state[p][k], v) if torch.is_tensor(v) else opt.state[p][k] == v
        opt.step()  # the real step: what the estimate must equal (extrapolated by c)
        want = before_master + c * (master - before_master)
        assert torch.allclose(out, want, rtol=1e-6, atol=1e-7 if c == 1.0 else 1e-6), (out - want).abs().max()


@pytest.mark.parametrize("cls,kw", [(torch.optim.AdamW, dict(amsgrad=True)), (torch.optim.Adam, dict(maximize=True)),
                                    (torch.optim.RMSprop, {}), (torch.optim.AdamW, dict(lr=torch.tensor(1e-3)))])
def test_unsupported_optimizers_keep_the_snapshot_path(cls, kw):
    p = torch.nn.Parameter(torch.ones(3))
    assert not functional.supports(cls([p], **kw))


ROUND_CASES = [
    ("rmsprop-momentum (snapshot)", torch.optim.RMSprop, dict(lr=1e-2, momentum=0.9, weight_decay=0.01)),
    ("adamw-amsgrad (snapshot)", torch.optim.AdamW, dict(lr=1e-2, amsgrad=True)),
    ("adagrad (snapshot)", torch.optim.Adagrad, dict(lr=1e-1)),
    ("adamw (functional)", torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    ("sgd-nesterov (functional)", torch.optim.SGD, dict(lr=1e-1, momentum=0.9, nesterov=True)),
]


@pytest.mark.parametrize("name,cls,kw", ROUND_CASES, ids=[c[0] for c in ROUND_CASES])
@pytest.mark.parametrize("c", [1.0, 1.2, 0.4], ids=["step", "extrapolated-1.2", "damped-0.4"])
def test_estimate_round_equals_the_oracles_opt_star(name, cls, kw, c):
    """A whole ESTIMATE round (one process: the collectives are copies) gives the oracle's Opt*(theta, g), by the
    snapshot or the functional way, and leaves the master slice and the optimizer state as they were."""
    from oracle import _opt_star

    from acco.rounds import OptimizerSnapshot, RoundContext, RoundKind, RoundSpec, ShardBuffers, run_round
    from acco.wrapped import WrappedOptimizers

    g = torch.Generator().manual_seed(3)
    n = 37
    master = torch.randn(n, generator=g)
    grad = torch.zeros(n)
    master.grad = grad
    opt = cls([master], **kw)
    for _ in range(2):  # some state
        grad.copy_(torch.randn(n, generator=g))
        opt.step()
    assert functional.supports(opt) == name.endswith("(functional)")
    gradient_sum = torch.randn(n, generator=g)  # this rank's sum over 2 micro-batches
    want = _opt_star(opt, lambda ps: cls(ps, **kw), [master.detach()], [gradient_sum * 0.5], c)[0]
    before_master = master.detach().clone()
    before_state = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in opt.state[master].items()}
    f64 = dict(dtype=torch.float64)
    buffers = ShardBuffers(comm=gradient_sum.clone(), weights=torch.full((n,), float("nan")), master=master, grad=grad,
                           count=torch.zeros(1), rank_counts=torch.zeros(1), row=torch.zeros(3, **f64),
                           rows=torch.zeros(3, **f64))
    hyper = [{k: v for k, v in opt.param_groups[0].items() if k != "params"}]
    run_round(RoundContext(buffers, WrappedOptimizers.around(opt, master), None, OptimizerSnapshot(), extrapolation=c),
              RoundSpec(RoundKind.ESTIMATE, 2, 0.5, hyper))
    assert torch.allclose(buffers.weights, want, rtol=1e-6, atol=1e-7), (buffers.weights - want).abs().max()
    assert torch.equal(master.detach(), before_master), "theta must not move"
    for k, v in before_state.items():
        assert torch.equal(opt.state[master][k], v) if torch.is_tensor(v) else opt.state[master][k] == v, k


def estimate_round_ops(n_tensors: int, c: float = 1.0, fused: bool = False) -> int:
    """Ops the simulated device's side stream runs for one estimate round (AdamW, one process) of a model
    of ``n_tensors`` parameter tensors of 64 elements each."""
    import acco.device_api
    from fake_cuda import FakeCuda

    from acco import AccoOptimizer

    fake = FakeCuda()
    acco.device_api.stream_api = lambda device: fake
    try:
        with fake:
            params = [torch.nn.Parameter(torch.randn(64)) for _ in range(n_tensors)]
            opt = AccoOptimizer(params, torch.optim.AdamW, microbatches_per_update=2, lr=1e-3, estimate_extrapolation=c,
                                fused=fused)

            def half():
                sum((p * p).sum() for p in params).backward()

            for _ in range(2):  # the optimizer's state exists after the first commit
                half(), half(), opt.step(), opt.zero_grad()
            side = fake.side_streams[0]
            before = side.issued
            half()  # the first half: its end-of-backward hands off the estimate round
            ops = side.issued - before
            half(), opt.step()
            opt.finish()
    finally:
        acco.device_api.stream_api = acco.device_api.__dict__["_real_stream_api"]
    return ops


@pytest.mark.slow
def test_estimate_round_ops_do_not_grow_with_the_number_of_tensors():
    """The estimate's arithmetic runs as foreach ops over batches of pieces: a model of 200 tensors issues
    about as many ops per estimate round as one of 20 (both fit in one batch), not 10 times as many."""
    small, large = estimate_round_ops(20), estimate_round_ops(200)
    print(f"side-stream ops per estimate round: 20 tensors {small}, 200 tensors {large}")
    assert large <= small + 10, (small, large)


@pytest.mark.parametrize("fused", [False, True], ids=["host-count", "fused-device-count"])
def test_an_extrapolated_estimate_issues_the_same_ops(fused):
    """estimate_extrapolation on the functional path is the step with c * lr: an estimate round issues exactly
    the ops of the paper's estimate (its cost is nil by construction, not by a timing), also where Adam's step
    count is on the device (fused, AdamW's default on CUDA; or capturable) and its scalars are device tensors."""
    assert estimate_round_ops(20, 1.2, fused) == estimate_round_ops(20, 1.0, fused)


def test_round_temporaries_bound_what_a_round_allocates_on_the_side_stream(monkeypatch):
    """memory_report()['round_temporaries'] bounds the memory an estimate round's ops allocate on the side
    stream (measured by the simulated device: the most alive at once above what was alive before), with
    several batches per slice."""
    import acco.device_api
    from fake_cuda import FakeCuda

    from acco import AccoOptimizer

    monkeypatch.setattr(functional, "CHUNK", 256)
    fake = FakeCuda()
    monkeypatch.setattr(acco.device_api, "stream_api", lambda device: fake)
    with fake:
        params = [torch.nn.Parameter(torch.randn(n)) for n in (300, 64, 900, 7)]
        opt = AccoOptimizer(params, torch.optim.AdamW, microbatches_per_update=2, lr=1e-3, weight_decay=0.1)
        for t in range(3):
            for j in range(2):
                if (t, j) == (2, 0):  # the state exists: measure the steady state's estimate round alone
                    before = fake.side_peak_bytes = fake.side_live_bytes()  # the state, allocated by side ops
                sum((p * p).sum() for p in params).backward()  # j == 0: hands off the estimate round
                if (t, j) == (2, 0):
                    peak = fake.side_peak_bytes - before
            opt.step()
            opt.zero_grad()
        bound = opt.memory_report()["round_temporaries"]
        opt.finish()
    print(f"estimate round: at most {peak} bytes allocated on the side stream at once, round_temporaries {bound}")
    assert 0 < peak <= bound
