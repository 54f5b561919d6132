"""The GPU review's defects that can be shown without streams: checkpoint device policy, NCCL ring refusal,
bf16 accumulation, the bounded event history. (Stream ordering: ``test_stream_protocol.py``.)"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import acco.collectives as collectives
from acco import AccoOptimizer
from acco.checkpoint import scalar_state
from acco.stats import CudaTiming, RoundRecord, SettledTiming
from tinynet import flat, loss_fn, make_model, master_of


@pytest.mark.parametrize("flags", [{}, {"fused": True}, {"capturable": True}])
@pytest.mark.parametrize("key", ["step", "eta"])
def test_scalar_state_follows_torch_load_policy(flags, key):
    """Where a loaded per-parameter scalar lives, against torch's own Optimizer.load_state_dict policy.
    The piece is on the meta device, standing for a GPU: only the device and dtype matter."""
    piece = torch.empty(4, device="meta")
    group = {"params": [0], **flags}
    ours = scalar_state(key, 3.0, piece, group)
    theirs = torch.optim.Optimizer._process_value_according_to_param_policy(
        piece, torch.tensor(3.0), 0, [group], key)
    assert (ours.device, ours.dtype) == (theirs.device, theirs.dtype)


def test_fused_adamw_resumes_exactly():
    """AdamW(fused=True) (runs on CPU in torch 2.13): save -> load into a new optimizer -> continue, bit-identical."""
    def run(model, opt, start, stop):
        for i in range(start, stop):
            loss_fn(model, 0, 2 * i).backward()
            loss_fn(model, 0, 2 * i + 1).backward()
            opt.step()
            opt.zero_grad()

    kw = dict(mode="acco", microbatches_per_update=2, lr=1e-2, weight_decay=0.1, fused=True)
    model = make_model()
    opt = AccoOptimizer(model.parameters(), torch.optim.AdamW, **kw)
    run(model, opt, 0, 3)
    saved = opt.state_dict()
    run(model, opt, 3, 6)
    opt.finish()
    reference = flat(model)

    model2 = make_model(seed=7)
    opt2 = AccoOptimizer(model2.parameters(), torch.optim.AdamW, **kw)
    opt2.load_state_dict(saved, restore_model=True)  # a fresh model: its weights come from the state
    step = next(iter(opt2.local_optimizer.state.values()))["step"]
    assert step.dtype == torch.float32 and step.device == opt2.runtime.flat.master.device
    run(model2, opt2, 3, 6)
    opt2.finish()
    assert torch.equal(flat(model2), reference)


def test_ring_is_refused_on_nccl(monkeypatch):
    monkeypatch.setenv("ACCO_RING", "1")
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    with pytest.raises(ValueError, match="ACCO_RING=1.*nccl.*Unset ACCO_RING"):
        collectives.ring_algorithm(object())
    monkeypatch.setenv("ACCO_RING", "0")
    assert collectives.ring_algorithm(object()) == "native"
    monkeypatch.delenv("ACCO_RING")
    assert collectives.ring_algorithm(object()) == "native"


def _bf16_update(accumulation_dtype, micro_batches=32, reduce_dtype=None, report=None):
    """One update of mode sync, SGD(lr=1) over ``micro_batches`` bf16 backward passes: the fp32 master moves
    by exactly the averaged gradient, which is compared with the fp64 sum of the same bf16 gradients."""
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64).bfloat16()
    data = [(torch.randn(8, 64).bfloat16(), torch.randn(8, 64).bfloat16()) for _ in range(micro_batches)]

    def loss(m, x, y):
        return ((m(x).float() - y.float()) ** 2).mean()

    reference = [torch.zeros(p.shape, dtype=torch.float64) for p in model.parameters()]
    for x, y in data:  # the same bf16 gradients, summed in fp64
        model.zero_grad()
        loss(model, x, y).backward()
        for r, p in zip(reference, model.parameters()):
            r += p.grad.double()
    model.zero_grad(set_to_none=True)
    opt = AccoOptimizer(model.parameters(), torch.optim.SGD, mode="sync", lr=1.0, reduce_dtype=reduce_dtype,
                        accumulation_dtype=accumulation_dtype, microbatches_per_update=micro_batches)
    if report is not None:
        report.update(opt.memory_report())
    before = master_of(opt).double().clone()
    for x, y in data:
        loss(model, x, y).backward()
    opt.step()
    after = master_of(opt).double()
    opt.finish()
    got = before - after  # the summed gradient (DDP's .grad average over one rank: the sum)
    want = torch.cat([r.flatten() for r in reference])
    return ((got[: want.numel()] - want).norm() / want.norm()).item()


def test_bf16_gradients_are_accumulated_in_fp32():
    """32 micro-batches of bf16 gradients: fp32 accumulation (the default) vs bf16, against fp64."""
    fp32 = _bf16_update(None)
    bf16 = _bf16_update(torch.bfloat16)
    print(f"relative error of the summed gradient: fp32 accumulation {fp32:.2e}, bf16 accumulation {bf16:.2e}")
    assert fp32 < 1e-5  # summed over micro-batches and ranks in fp32: only fp32 rounding is left
    assert bf16 > 100 * fp32


def test_reduce_dtype_casts_the_fp32_sum_once():
    """reduce_dtype=bf16 (the paper's bytes): the micro-batches are still summed in fp32, and the sum is cast to
    bf16 once for the reduce-scatter: one bf16 rounding (at most 2^-9 relative per element), far less than
    summing in bf16, and a round buffer of 2 bytes per element instead of 4."""
    fp32_report, bf16_report = {}, {}
    fp32 = _bf16_update(None, report=fp32_report)
    reduced = _bf16_update(None, reduce_dtype=torch.bfloat16, report=bf16_report)
    summed_in_bf16 = _bf16_update(torch.bfloat16)
    print(f"relative error: fp32 reduce {fp32:.2e}, bf16 reduce {reduced:.2e}, bf16 accumulation {summed_in_bf16:.2e}")
    assert fp32 < 1e-5
    assert 1e-5 < reduced < 2 ** -9 and reduced < summed_in_bf16 / 3
    assert bf16_report["comm"] * 2 == fp32_report["comm"]
    assert bf16_report["accum"] == fp32_report["accum"]  # the sum over micro-batches stays fp32


def test_fp32_accumulation_keeps_the_grad_contract():
    """With bf16 compute and fp32 accumulation, .grad is a bf16 buffer that autograd sums into as usual;
    changing it in place before step() still raises, and zero_grad() discards the update."""
    model = make_model().bfloat16()
    opt = AccoOptimizer(model.parameters(), mode="sync", lr=1e-2, microbatches_per_update=2)
    x = torch.randn(4, 5).bfloat16()
    model(x).sum().backward()
    first = [p.grad.clone() for p in model.parameters()]
    model(x).sum().backward()
    assert all(torch.equal(p.grad, 2 * g) for p, g in zip(model.parameters(), first)), ".grad: the sum, as torch's"
    assert all(p.grad.dtype == torch.bfloat16 for p in model.parameters())
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    with pytest.raises(RuntimeError, match="modified in place"):
        opt.step()
    opt.zero_grad()
    assert opt.runtime.flat.accum.abs().sum() == 0
    opt._failed = None
    opt.finish()


@pytest.mark.parametrize("discard", ["p.grad = None", "model.zero_grad()", "model.zero_grad(set_to_none=False)"])
def test_fp32_accumulation_discards_like_torch(discard):
    """Setting .grad to None between backward passes discards the earlier ones, with fp32 accumulation exactly
    as with the accumulation buffer bound to .grad: the update is the later backward's gradient only."""
    torch.manual_seed(0)
    x0, x1 = torch.randn(4, 5).bfloat16(), torch.randn(4, 5).bfloat16()
    moves = {}
    for accumulation in (None, torch.bfloat16):
        model = make_model().bfloat16()
        opt = AccoOptimizer(model.parameters(), torch.optim.SGD, mode="sync", lr=1.0, microbatches_per_update=2,
                            accumulation_dtype=accumulation)
        before = master_of(opt).clone()
        model(x0).sum().backward()
        if discard == "p.grad = None":
            for p in model.parameters():
                p.grad = None
        else:
            model.zero_grad(set_to_none=not discard.endswith("False)"))
        model(x1).sum().backward()
        opt.step()
        moves[accumulation] = before - master_of(opt)
        opt.finish()
    reference = make_model().bfloat16()
    reference(x1).sum().backward()
    want = torch.cat([p.grad.float().flatten() for p in reference.parameters()])
    for got in moves.values():
        assert torch.allclose(got[: want.numel()], want, rtol=1e-2, atol=1e-2), (got[: want.numel()] - want).abs().max()


def test_grad_with_fp32_accumulation_is_the_updates_bf16_sum_and_zero_after_step():
    """bf16 compute, fp32 accumulation: p.grad (for logging) is the bf16 sum of the update's micro-batches so far,
    and zero after step(), as in the loop where .grad is the accumulation buffer itself."""
    model = torch.nn.Linear(4, 1, bias=False)
    opt = AccoOptimizer(model.parameters(), mode="sync", microbatches_per_update=2, compute_dtype=torch.bfloat16, lr=0.1)
    x = torch.ones(1, 4, dtype=torch.bfloat16)
    for _ in range(2):  # no zero_grad() at all
        for k in (1, 2):
            model(x).sum().backward()
            assert torch.equal(model.weight.grad, torch.full((1, 4), float(k), dtype=torch.bfloat16))
        opt.step()
        assert not model.weight.grad.any()
    opt.finish()


@pytest.mark.parametrize("case", ["model.to(cpu:0) between micro-batches", "p.grad = None before step()",
                                  "torch.autograd.grad between micro-batches", "built under no_grad()"])
def test_fp32_accumulation_follows_grad_like_the_bound_buffer(case):
    """bf16 compute: with the separate fp32 sum (default) the update equals the one with .grad bound to the
    accumulation buffer (accumulation_dtype=bf16) whatever the loop does to .grad, up to bf16 rounding."""
    torch.manual_seed(0)
    xs = [torch.randn(4, 5).bfloat16() for _ in range(2)]
    moves = {}
    for accumulation in (None, torch.bfloat16):
        model = make_model().bfloat16()
        kw = dict(mode="sync", lr=1.0, microbatches_per_update=2, accumulation_dtype=accumulation)
        if case == "built under no_grad()":
            with torch.no_grad():
                opt = AccoOptimizer(model.parameters(), torch.optim.SGD, **kw)
        else:
            opt = AccoOptimizer(model.parameters(), torch.optim.SGD, **kw)
        before = master_of(opt).clone()
        model(xs[0]).sum().backward()
        if case.startswith("model.to"):
            model.to("cpu:0")
        elif case.startswith("torch.autograd.grad"):
            torch.autograd.grad(model(xs[1]).square().sum(), list(model.parameters()))  # not a micro-batch
        model(xs[1]).sum().backward()
        if case.startswith("p.grad = None"):
            next(model.parameters()).grad = None
        opt.step()
        moves[accumulation] = before - master_of(opt)
        opt.finish()
    assert moves[None].abs().sum() > 0
    assert torch.allclose(moves[None], moves[torch.bfloat16], rtol=2e-2, atol=2e-2), (moves[None] - moves[torch.bfloat16]).abs().max()


def _ddp_bucket_view_worker(rank, world):
    from torch.nn.parallel import DistributedDataParallel

    import acco

    out = {}
    ddp = DistributedDataParallel(make_model(), gradient_as_bucket_view=True)
    try:
        acco.disable_gradient_allreduce(ddp)
    except ValueError as exc:
        out["disable"] = str(exc)
    opt = AccoOptimizer(ddp.parameters(), mode="sync", lr=1e-2, microbatches_per_update=1)
    try:
        loss_fn(ddp, rank, 0).backward()
    except ValueError as exc:
        out["backward"] = str(exc)
    opt._failed = RuntimeError("test")  # finish() without the collective
    try:
        opt.finish()
    except RuntimeError:
        pass
    return out


def test_ddp_with_gradient_as_bucket_view_is_refused():
    """DDP(gradient_as_bucket_view=True) would make p.grad its own bucket: refused, by the helper and by the
    optimizer at the first backward (before any round)."""
    from _dist import run_ranks

    (out,) = run_ranks(_ddp_bucket_view_worker, 1)
    assert "gradient_as_bucket_view=False" in out["disable"]
    assert "gradient_as_bucket_view=False" in out["backward"]


class _Event:
    def __init__(self, done):
        self.done = done

    def query(self):
        return self.done

    def elapsed_time(self, other):
        return 2.0


def test_round_record_settles_without_blocking():
    """A CUDA round's record gives its events and host copies back only once they are complete."""
    timing = CudaTiming(*[_Event(True) for _ in range(5)])
    rec = RoundRecord(0, "commit", 2, torch.tensor([4.0]), torch.tensor([2.0, 2.0]), timing, ready=_Event(False))
    assert not rec.settle() and rec.timing is timing  # the host copy is not written yet: keep everything
    rec.ready.done = True
    assert rec.settle()
    assert isinstance(rec.timing, SettledTiming) and rec.ready is None
    assert rec.as_dict()["total_microbatches"] == 4 and rec.as_dict()["rank_microbatches"] == [2, 2]
    assert rec.as_dict()["round_s"] == pytest.approx(2e-3)


def test_cuda_step_counters_live_on_the_device():
    """On CUDA a param group keeps its step counter on the device: Adam and AdamW as their fused kernel, other
    classes capturable; a kernel flag the group holds (the user's) is kept; on CPU nothing is added."""
    from acco._validation import device_kernel

    cuda = torch.device("cuda", 0)
    assert device_kernel(torch.optim.AdamW, {}, cuda) == {"fused": True}
    assert device_kernel(torch.optim.Adam, {}, cuda) == {"fused": True}
    assert device_kernel(torch.optim.AdamW, {"differentiable": False}, cuda) == {"fused": True}
    assert device_kernel(torch.optim.AdamW, {"fused": True}, cuda) == {}
    assert device_kernel(torch.optim.AdamW, {"fused": False}, cuda) == {"capturable": True}
    assert device_kernel(torch.optim.AdamW, {"foreach": True}, cuda) == {"capturable": True}
    assert device_kernel(torch.optim.AdamW, {"capturable": True}, cuda) == {}
    assert device_kernel(torch.optim.AdamW, {"capturable": False}, cuda) == {}
    assert device_kernel(torch.optim.AdamW, {"differentiable": True}, cuda) == {}
    assert device_kernel(torch.optim.RMSprop, {}, cuda) == {"capturable": True}
    assert device_kernel(torch.optim.Adagrad, {}, cuda) == {}
    assert device_kernel(torch.optim.SGD, {}, cuda) == {}
    subclass = type("MyAdamW", (torch.optim.AdamW,), {})  # a subclass may change the step: not the fused kernel
    assert device_kernel(subclass, {}, cuda) == {"capturable": True}
    assert device_kernel(torch.optim.AdamW, {}, torch.device("cpu")) == {}


def test_the_device_kernel_reaches_the_wrapped_optimizers_groups(monkeypatch):
    """What the wrapped optimizers run, end to end, with the device taken for CUDA (fused AdamW also runs on CPU):
    from_optimizer of a torch AdamW built with its defaults (which it stores as fused=None, capturable=False in
    every group, and which would override a constructor argument) runs fused; so does the AdamW part of a Muon +
    AdamW split whose first class is Muon; a group's own flags are kept and decide for that group alone; the
    keyword arguments' flags are optimizer_class's, not another class's; an explicit capturable=False is kept."""
    import acco._validation as V

    real = V.device_kernel
    monkeypatch.setattr(V, "device_kernel", lambda cls, chosen, device: real(cls, chosen, torch.device("cuda")))

    def flags(optimizer):
        return [(g.get("fused"), g.get("capturable"), g.get("foreach")) for g in optimizer.param_groups]

    model = make_model()
    opt = AccoOptimizer.from_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), mode="acco",
                                       microbatches_per_update=2)
    assert flags(opt.local_optimizer) == [(True, False, None)]
    for j in range(2):
        loss_fn(model, 0, j).backward()
    opt.step()  # the fused kernel, on CPU
    opt.finish()

    params = list(make_model().parameters())
    matrices, rest = [params[i] for i in (1, 3)], [p for i, p in enumerate(params) if i not in (1, 3)]
    opt = AccoOptimizer.from_optimizer([torch.optim.Muon(matrices, lr=0.02), torch.optim.AdamW(rest, lr=1e-2)],
                                       mode="acco", microbatches_per_update=2)
    muon, adamw = opt.local_optimizers
    assert isinstance(adamw, torch.optim.AdamW) and flags(adamw) == [(True, False, None)]
    opt.finish()

    params = list(make_model().parameters())
    opt = AccoOptimizer([{"params": params[:2], "foreach": True}, {"params": params[2:]}], torch.optim.AdamW,
                        mode="acco", microbatches_per_update=2, lr=1e-2)
    assert flags(opt.local_optimizer) == [(None, True, True), (True, False, None)]
    opt.finish()

    # AdamW's foreach=True and capturable=False are AdamW's: the Adam and RMSprop groups take the device's kernel
    params = list(make_model().parameters())
    opt = AccoOptimizer([{"params": params[:2]}, {"params": params[2:3], "optimizer_class": torch.optim.Adam},
                         {"params": params[3:], "optimizer_class": torch.optim.RMSprop}], torch.optim.AdamW,
                        mode="acco", microbatches_per_update=2, lr=1e-2, foreach=True, capturable=False)
    assert [flags(o) for o in opt.local_optimizers] == [[(None, False, True)], [(True, False, None)],
                                                        [(None, True, None)]]
    opt.finish()


def test_a_plain_state_dict_keeps_this_runs_kernel():
    """load_consolidated_state_dict of a plain (foreach) AdamW's state dict into a fused ACCO: the groups keep
    fused=True (the saved fused=None, foreach=None would switch the kernel off), the step count is where the
    fused kernel reads it, and training goes on."""
    model = make_model()
    plain = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for j in range(2):
        loss_fn(model, 0, j).backward()
        plain.step()
        plain.zero_grad()
    opt = AccoOptimizer(model.parameters(), torch.optim.AdamW, mode="acco", microbatches_per_update=2, lr=1e-2,
                        fused=True)
    opt.load_consolidated_state_dict(plain.state_dict())
    assert [g["fused"] for g in opt.local_optimizer.param_groups] == [True]
    step = next(iter(opt.local_optimizer.state.values()))["step"]
    assert step.item() == 2 and step.dtype == torch.float32
    for j in range(2):
        loss_fn(model, 0, 2 + j).backward()
    opt.step()
    opt.finish()
    assert next(iter(opt.local_optimizer.state.values()))["step"].item() == 3
    assert [g["fused"] for g in opt.param_groups + opt.local_optimizer.param_groups] == [True, True]


def test_implementation_flags_are_not_checkpointed():
    """capturable (set on CUDA), fused, foreach: how this run computes, not what; a GPU checkpoint must load on
    a CPU, so they are neither saved nor restored."""
    model = make_model()
    opt = AccoOptimizer(model.parameters(), mode="sync", microbatches_per_update=1, lr=1e-2)
    loss_fn(model, 0, 0).backward()
    opt.step()
    opt.zero_grad()
    opt.param_groups[0]["capturable"] = True  # as a CUDA run's group would say
    sd = opt.state_dict()
    opt.param_groups[0]["capturable"] = False
    assert not any(k.split(".", 1)[1] in ("capturable", "fused", "foreach", "differentiable") for k in sd["hyper"])
    assert any(k.endswith(".lr") for k in sd["hyper"])
    opt.load_state_dict(sd)
    assert opt.param_groups[0]["capturable"] is False
    loss_fn(model, 0, 1).backward()
    opt.step()
    opt.finish()


def _reduce_dtype_worker(rank: int, world: int) -> dict:
    out = {}
    for name, rd in (("fp32", None), ("bf16", torch.bfloat16)):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
        opt = AccoOptimizer(model.parameters(), torch.optim.AdamW, compute_dtype=torch.bfloat16, reduce_dtype=rd,
                            microbatches_per_update=2, lr=1e-3)
        g = torch.Generator().manual_seed(rank)
        for _ in range(4):
            for _ in range(2):
                x = torch.randn(8, 32, generator=g).bfloat16()
                (model(x).float().pow(2).mean() / 2).backward()
            opt.step()
            opt.zero_grad()
        opt.finish()
        out[name] = torch.cat([p.detach().float().flatten() for p in model.parameters()])
        out[name + "_comm"] = opt.memory_report()["comm"]
    return out


def test_reduce_dtype_bf16_across_ranks():
    """Two gloo ranks (the ring reduce-scatter in bf16): the ranks agree, the run stays close to the fp32
    reduction's (differences of bf16 rounding only) without being it, and the round buffer is halved."""
    from _dist import run_ranks

    r0, r1 = run_ranks(_reduce_dtype_worker, 2, timeout=120)
    assert torch.equal(r0["bf16"], r1["bf16"]) and torch.equal(r0["fp32"], r1["fp32"])
    diff = ((r0["bf16"] - r0["fp32"]).norm() / r0["fp32"].norm()).item()
    assert 0 < diff < 1e-2, diff
    assert r0["bf16_comm"] * 2 == r0["fp32_comm"]
