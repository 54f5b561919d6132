"""Drop-in behaviour: what a user's loop may do, and what fails loudly (one process unless said).

One step() per update; model moves; .grad changed behind the optimizer's back;
committed weights; state dicts that refuse the wrong place; DDP; buffers.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from _dist import run_ranks
from tinynet import flat, loss_fn, make_model, record_round_lrs

import acco
from acco import AccoOptimizer
from acco.grads import ModelMovedError

KW = dict(lr=1e-2, weight_decay=0.1)


def _train(model, opt, updates=4, m=2, start=0, between=None):
    for t in range(start, start + updates):
        for j in range(m):
            (loss_fn(model, 0, t * m + j) / m).backward()
            if between is not None and j == m - 1:
                between(t)
        opt.step()
        model.zero_grad()


# ----------------------------------------------------------------------------- the model may move


@pytest.mark.parametrize("mode", ["acco", "dpu", "sync"])
@pytest.mark.parametrize("move", ["cpu:0", "device cpu 0", "float", "between backward and step"])
def test_model_moved_on_the_same_device_keeps_training(mode, move):
    """Check that model.to('cpu:0') (as Trainer and accelerate do) and friends give the same run as no move."""
    ref_model = make_model()
    ref_opt = AccoOptimizer(ref_model.parameters(), mode=mode, **KW)
    _train(ref_model, ref_opt)
    ref_opt.finish()

    model = make_model()
    opt = AccoOptimizer(model.parameters(), mode=mode, **KW)
    between = None
    if move == "cpu:0":
        model.to("cpu:0")  # new storage for every parameter and .grad (Module._apply copies)
    elif move == "device cpu 0":
        model.to(torch.device("cpu", 0))
    elif move == "float":
        model.float()
    else:
        between = lambda t: model.to("cpu:0" if t % 2 == 0 else "cpu")  # noqa: E731
    _train(model, opt, between=between)
    opt.finish()
    assert (flat(model) - flat(make_model())).abs().max() > 1e-3
    assert torch.equal(flat(model), flat(ref_model))


@pytest.mark.parametrize("cast", ["double", "bfloat16", "meta device"])
def test_model_moved_to_another_dtype_or_device_raises(cast):
    """Check that a parameter cast or moved to another device after construction fails at the next backward."""
    model = make_model()
    opt = AccoOptimizer(model.parameters(), **KW)
    x = torch.randn(4, 5)
    if cast == "double":
        model.double()
        x = x.double()
    elif cast == "bfloat16":
        model.bfloat16()
        x = x.bfloat16()
    else:  # another kind of tensor: Module._apply makes new Parameter objects, the optimizer's see no gradient
        model.to("meta")
        model(x.to("meta")).sum().backward()
        with pytest.raises(RuntimeError, match="parameters were replaced.*build the optimizer after moving the model"):
            opt.step()
        return
    with pytest.raises(ModelMovedError, match="before building AccoOptimizer"):
        model(x).sum().backward()
    assert opt.num_rounds == 0


# ----------------------------------------------------------------------------- .grad is the optimizer's


def test_clipping_grad_between_backward_and_step_raises():
    """Check that clip_grad_norm_ on .grad (the local gradient here) is refused, pointing to max_grad_norm."""
    model = make_model()
    opt = AccoOptimizer(model.parameters(), mode="sync", **KW)
    loss_fn(model, 0, 0).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    with pytest.raises(RuntimeError, match="modified in place.*max_grad_norm"):
        opt.step()
    assert opt.num_rounds == 0


def test_replacing_grad_between_backward_and_step_raises():
    """Check that a .grad replaced by another tensor is refused (the optimizer reads its own buffer)."""
    model = make_model()
    opt = AccoOptimizer(model.parameters(), mode="dpu", **KW)
    loss_fn(model, 0, 0).backward()
    model.fc1.weight.grad = model.fc1.weight.grad.clone() * 2
    with pytest.raises(RuntimeError, match="replaced by another tensor"):
        opt.step()


def test_acco_with_one_backward_per_step_says_what_to_do():
    """Check that mode acco with one micro-batch per step() raises, naming the two ways out."""
    model = make_model()
    opt = AccoOptimizer(model.parameters(), **KW)
    loss_fn(model, 0, 0).backward()
    with pytest.raises(ValueError, match="two halves.*half the size.*mode='dpu' or mode='sync'"):
        opt.step()


def test_step_without_backward_raises():
    """Check that step() with no backward() since the last step() is an error, not an empty update."""
    model = make_model()
    opt = AccoOptimizer(model.parameters(), mode="sync", **KW)
    with pytest.raises(RuntimeError, match="no gradient reached"):
        opt.step()


def test_more_microbatches_than_declared_raise_and_fewer_are_a_short_update():
    """Check m > microbatches_per_update raises; m < it (end of an epoch) is one update, run synchronously."""
    model = make_model()
    opt = AccoOptimizer(model.parameters(), microbatches_per_update=4, **KW)
    _train(model, opt, updates=2, m=4)
    _train(model, opt, updates=1, m=1, start=10)  # short: fewer than half, no estimate
    assert opt.num_updates == 3 and opt.holds_committed_weights
    _train(model, opt, updates=1, m=3, start=20)  # 3 of 4: the estimate after 2, then the commit
    assert opt.num_rounds == 2 + 2 + 1 + 2
    for j in range(5):
        loss_fn(model, 0, 100 + j).backward()
    with pytest.raises(RuntimeError, match="after 5 backward.*microbatches_per_update=4"):
        opt.step()


def test_lr_scheduler_stepped_after_step_counts_updates(monkeypatch):
    """Check that a scheduler stepped after every step() moves once per update, and rounds use its rate."""
    model = make_model()
    opt = AccoOptimizer(model.parameters(), **KW)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0 / (1 + t))
    used = []
    record_round_lrs(opt, used, monkeypatch)
    for t in range(4):
        for j in range(2):
            loss_fn(model, 0, 2 * t + j).backward()
        opt.step()
        sched.step()
    opt.finish()
    # update 0 is synchronous (microbatches_per_update learned), then estimate + commit per update
    assert used == pytest.approx([1e-2, 1e-2 / 2, 1e-2 / 2, 1e-2 / 3, 1e-2 / 3, 1e-2 / 4, 1e-2 / 4])


# ----------------------------------------------------------------------------- committed weights


def test_committed_weights_block_refuses_training():
    """Check that backward() or step() inside committed_weights() raise, and the block nests."""
    model = make_model()
    opt = AccoOptimizer(model.parameters(), microbatches_per_update=2, **KW)
    _train(model, opt, updates=2)
    assert not opt.holds_committed_weights
    before = flat(model)
    with opt.committed_weights():
        inside = flat(model)
        with opt.committed_weights():
            assert torch.equal(flat(model), inside)
        with pytest.raises(RuntimeError, match="inside opt.committed_weights"):
            loss_fn(model, 0, 99).backward()
        with pytest.raises(RuntimeError, match="inside opt.committed_weights"):
            opt.step()
    assert not torch.equal(inside, before)  # theta, then theta~ back
    assert torch.equal(flat(model), before)
    opt.finish()
    assert torch.equal(flat(model), inside)  # finish() leaves the committed weights


# ----------------------------------------------------------------------------- state dicts


def _state(opt, model):
    return flat(model), opt.runtime.flat.master.clone(), opt.num_updates


@pytest.mark.parametrize("case", ["mode", "optimizer", "model", "plain adamw", "garbage"])
def test_load_state_dict_refuses_the_wrong_place_and_changes_nothing(case):
    """Check that a state dict of another mode / optimizer / model, or a plain one, is refused untouched."""
    src_model = make_model()
    src = AccoOptimizer(src_model.parameters(), mode="acco", **KW)
    _train(src_model, src, updates=2)
    sd = src.state_dict()
    match = {"mode": "mode 'acco'.*mode='acco'", "optimizer": "torch.optim.adamw.AdamW",
             "model": "same model", "plain adamw": "load_consolidated_state_dict", "garbage": "expects what"}[case]
    model = make_model(seed=1)
    if case == "model":
        model = nn.Sequential(nn.Linear(5, 7))
    opt = AccoOptimizer(model.parameters(), torch.optim.SGD if case == "optimizer" else torch.optim.AdamW,
                        mode="sync" if case == "mode" else "acco", microbatches_per_update=2, lr=1e-2)
    if case == "plain adamw":
        plain = torch.optim.AdamW(make_model().parameters())
        sd = plain.state_dict()
    elif case == "garbage":
        sd = {"model": 1}
    before = _state(opt, model)
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(sd)
    after = _state(opt, model)
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1]) and before[2] == after[2]


def test_torch_save_of_each_ranks_state_dict_resumes_exactly(tmp_path):
    """Check that torch.save(opt.state_dict()) / torch.load(weights_only=True) resumes the uninterrupted run."""
    ref_model = make_model()
    ref = AccoOptimizer(ref_model.parameters(), **KW)
    _train(ref_model, ref, updates=6)
    ref.finish()

    model = make_model()
    opt = AccoOptimizer(model.parameters(), **KW)
    _train(model, opt, updates=3)
    with opt.committed_weights():
        torch.save(model.state_dict(), tmp_path / "model.pt")  # the committed weights
    torch.save(opt.state_dict(), tmp_path / "optim.rank0.pt")
    opt.finish()

    model2 = make_model(seed=5)
    model2.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True))
    opt2 = AccoOptimizer(model2.parameters(), **KW)
    opt2.load_state_dict(torch.load(tmp_path / "optim.rank0.pt", weights_only=True))
    assert opt2.next_update_index == 3 and opt2.microbatches_per_update == 2
    _train(model2, opt2, updates=3, start=3)
    opt2.finish()
    assert torch.equal(flat(model2), flat(ref_model))


def _rank_worker(rank: int, world: int, fresh_model: bool = False) -> dict:
    model = make_model()
    opt = AccoOptimizer(model.parameters(), mode="acco", microbatches_per_update=2, **KW)
    for t in range(3):
        for j in range(2):
            (loss_fn(model, rank, 2 * t + j) / 2).backward()
        opt.step()
    sd = opt.state_dict()
    # rank 1 is handed rank 0's shard (a torch.save on rank 0 only, loaded everywhere)
    objs = [sd]
    torch.distributed.broadcast_object_list(objs, src=0)
    if fresh_model and rank == 0:  # as in a fresh process whose model was not loaded: rank 0 also refuses that
        with torch.no_grad():
            next(model.parameters()).add_(1.0)
    before = flat(model).clone(), opt.runtime.flat.master.clone()
    out = {"rank": rank}
    try:
        opt.load_state_dict(objs[0])
        out["error"] = None
    except RuntimeError as exc:  # the ranks disagree: a RuntimeError, as torch.distributed's errors
        assert isinstance(exc, ValueError), type(exc)  # and still the ValueError it always was
        out["error"] = str(exc)
    out["unchanged"] = torch.equal(before[0], flat(model)) and torch.equal(before[1], opt.runtime.flat.master)
    full = opt.consolidated_state_dict()
    opt.finish()
    after = opt.consolidated_state_dict()  # the documented way out still works after finish()
    out["consolidated_after_finish"] = all(
        torch.equal(full["state"][i][k], after["state"][i][k]) for i in full["state"] for k in ("exp_avg", "exp_avg_sq"))
    return out


@pytest.mark.parametrize("fresh_model", [False, True], ids=["same-model", "fresh-model"])
def test_a_shard_loaded_on_another_rank_is_refused_and_consolidation_works_after_finish(fresh_model):
    """Check rank 0's state dict is refused on rank 1, and on rank 0 (its own file) with the cause named on both,
    also when rank 0 finds something else wrong (its model's weights); and consolidated_state_dict() after finish()."""
    r0, r1 = run_ranks(_rank_worker, 2, fresh_model)
    assert "every rank was given rank 0's shard (this rank's own file)" in r0["error"] and r0["unchanged"], r0
    assert "model's weights" not in r0["error"], r0  # the mix-up of files, not its consequence
    assert "acco.checkpoint.gather" in r0["error"] and "optim.rank{rank}.pt" in r0["error"], r0
    assert r1["error"] is not None and "rank 0's shard" in r1["error"] and "loaded here on rank 1" in r1["error"], r1
    assert "acco.checkpoint.save" in r1["error"] and r1["unchanged"]
    assert r0["consolidated_after_finish"] and r1["consolidated_after_finish"]


# ----------------------------------------------------------------------------- DDP and buffers


class BNNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.bn, self.fc2 = nn.Linear(5, 6), nn.BatchNorm1d(6), nn.Linear(6, 3)

    def forward(self, x):
        return self.fc2(torch.tanh(self.bn(self.fc1(x))))


def _bn_loss(model, rank, i):
    g = torch.Generator().manual_seed(1000 * rank + i + 1)
    x = torch.randn(8, 5, generator=g) * (1 + rank)  # the ranks see different statistics
    return model(x).pow(2).mean()


def _profiled_updates(net, opt, rank) -> int:
    """Four updates of ``net`` with ``opt``; the all-reduces the profiler saw."""
    with torch.profiler.profile() as prof:
        for i in range(4):
            _bn_loss(net, rank, i).backward()
            opt.step()
            opt.zero_grad()
    return sum(1 for e in prof.events() if "allreduce" in e.name.lower())


def _ddp_worker(rank: int, world: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    out = {}
    # torch DDP + AdamW: the reference (it broadcasts rank 0's buffers at every forward)
    ref = DDP(BNNet())
    out["ddp_allreduces"] = _profiled_updates(ref, torch.optim.AdamW(ref.parameters(), **KW), rank)
    # DDP-wrapped, all-reduce not switched off: refused at the end of the first backward, before any round
    model = BNNet()
    opt = AccoOptimizer(model.parameters(), mode="sync", buffers=model.buffers(), **KW)
    wrapped = DDP(model)
    try:
        _bn_loss(wrapped, rank, 0).backward()
        out["refused"] = None
    except RuntimeError as exc:
        out["refused"] = str(exc)
    opt.finish()
    # DDP-wrapped with its all-reduce off: no all-reduce in backward, same run as DDP + AdamW
    model = BNNet()
    wrapped = acco.disable_gradient_allreduce(DDP(model))
    opt = AccoOptimizer(model.parameters(), mode="sync", buffers=model.buffers(), **KW)
    out["acco_allreduces"] = _profiled_updates(wrapped, opt, rank)
    opt.finish()
    out["ddp_weights_err"] = (flat(model) - flat(ref.module)).abs().max().item()
    out["stats"] = [model.bn.running_mean.clone(), ref.module.bn.running_mean.clone()]
    # no DDP at all, with and without buffers=
    for name, bufs in (("with_buffers", True), ("without_buffers", False)):
        model = BNNet()
        opt = AccoOptimizer(model.parameters(), mode="acco", microbatches_per_update=2,
                            buffers=model.buffers() if bufs else None, **KW)
        for t in range(3):
            for j in range(2):
                (_bn_loss(model, rank, 2 * t + j) / 2).backward()
            opt.step()
        opt.finish()
        out[name] = model.bn.running_mean.clone()
    return out


@pytest.mark.slow
def test_ddp_double_communication_is_refused_or_switched_off_and_buffers_follow_rank_0():
    """Check DDP + AccoOptimizer is refused unless its all-reduce is off; then it equals DDP + AdamW, buffers included."""
    r0, r1 = run_ranks(_ddp_worker, 2)
    for r in (r0, r1):
        assert r["ddp_allreduces"] > 0, "the profiler must see DDP's all-reduce for the count to mean anything"
        assert r["acco_allreduces"] == 0, r
        assert r["refused"] is not None and "disable_gradient_allreduce" in r["refused"], r["refused"]
        assert r["ddp_weights_err"] < 1e-6, r["ddp_weights_err"]
    # DDP broadcasts rank 0's buffers before every forward, acco at every step(): rank 0's statistics agree,
    # and acco's ranks end equal (DDP's other ranks differ by their last forward's update).
    assert torch.allclose(r0["stats"][0], r0["stats"][1], atol=1e-6)
    assert torch.equal(r0["stats"][0], r1["stats"][0])
    assert torch.equal(r0["with_buffers"], r1["with_buffers"])  # broadcast from rank 0
    assert not torch.allclose(r0["without_buffers"], r1["without_buffers"])  # the test can fail


@pytest.mark.slow
def test_exit_without_finish_is_clean():
    """Check that a torchrun job that never calls finish() (a round in flight at exit) exits 0.

    Without the library's exit handler both ranks abort ("terminate called without an active exception").
    """
    import os
    import sys

    from _dist import run_command

    script = os.path.join(os.path.dirname(__file__), "nofinish_script.py")
    out = run_command([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                       script, "4"], timeout=120)
    assert "terminate called" not in out and out.count("a round in flight: True") == 2, out[-2000:]
    assert out.count("closed without finish()") == 2, out[-2000:]  # the handler ran on both ranks


@pytest.mark.parametrize("reentrant", [True, False])
def test_activation_checkpointing(reentrant):
    """Check non-reentrant activation checkpointing trains as without it, and reentrant is refused clearly
    (its nested backward would be counted as a micro-batch)."""
    from torch.utils.checkpoint import checkpoint

    def run(ckpt):
        model = make_model()
        opt = AccoOptimizer(model.parameters(), microbatches_per_update=2, **KW)
        for t in range(3):
            for j in range(2):
                x = torch.randn(4, 5, generator=torch.Generator().manual_seed(10 * t + j)).requires_grad_()
                y = torch.zeros(4, 3)
                h = checkpoint(lambda z: torch.tanh(model.fc1(z)), x, use_reentrant=reentrant) if ckpt else torch.tanh(model.fc1(x))
                (((model.fc2(h) - y) ** 2).mean() / 2).backward()
            opt.step()
        opt.finish()
        return flat(model)

    if reentrant:
        with pytest.raises(RuntimeError, match="use_reentrant=False"):
            run(True)
    else:
        assert torch.equal(run(True), run(False))


def test_default_loop_holds_no_separate_grad_buffer():
    """Check .grad is the accumulation buffer's views in the default loop (three full-size buffers, not four)."""
    model = make_model()
    opt = AccoOptimizer(model.parameters(), microbatches_per_update=2, **KW)
    _train(model, opt, updates=1)
    rep = opt.memory_report()
    assert rep["grads"] == 0 and rep["accum"] == rep["comm"] == rep["params"]
    loss_fn(model, 0, 50).backward()  # after model.zero_grad(): backward's gradients land in the buffer again
    accum = opt.runtime.flat.accum.untyped_storage().data_ptr()
    assert all(p.grad.untyped_storage().data_ptr() == accum for p in model.parameters())
    opt.finish()
