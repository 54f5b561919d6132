"""Clipping, parameter groups, LR schedulers, non-finite gradients, errors across ranks."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.distributed as dist

from _dist import run_ranks
from tinynet import flat, loss_fn, make_model, record_round_lrs, rel_err

from acco import AccoOptimizer, NonFiniteGradientError

KW = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)


def _groups(model):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0, "lr": 3e-2}]


def _plain_step(model, opt, rank, world, i, max_norm=None):
    loss_fn(model, rank, i).backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= world
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm if max_norm else float("inf"))
    opt.step()
    opt.zero_grad()
    return norm.item()


def _clip_and_groups_worker(rank, world):
    out = {}
    # clipping: a max norm well below the gradient norm, so it bites on every step
    model, plain = make_model(), make_model()
    opt = AccoOptimizer(model.parameters(), mode="sync", max_grad_norm=0.05, **KW)
    popt = torch.optim.AdamW(plain.parameters(), **KW)
    errs, norms = [], []
    for i in range(6):
        loss_fn(model, rank, i).backward()
        opt.step()
        opt.zero_grad()
        ref_norm = _plain_step(plain, popt, rank, world, i, max_norm=0.05)
        norms.append((opt.last_grad_norm, ref_norm))
        errs.append(rel_err(flat(model), flat(plain)))
    opt.finish()
    out["clip_err"], out["norms"] = max(errs), norms
    # parameter groups with their own weight decay and lr
    model, plain = make_model(), make_model()
    opt = AccoOptimizer(_groups(model), mode="sync", **KW)
    popt = torch.optim.AdamW(_groups(plain), **KW)
    errs = []
    for i in range(6):
        loss_fn(model, rank, i).backward()
        opt.step()
        opt.zero_grad()
        _plain_step(plain, popt, rank, world, i)
        errs.append(rel_err(flat(model), flat(plain)))
    opt.finish()
    out["groups_err"] = max(errs)
    return out


def test_clipping_is_global_and_groups_keep_their_hyperparameters():
    """Check max_grad_norm against clip_grad_norm_ on the full gradient, and param groups against AdamW (2 ranks)."""
    for res in run_ranks(_clip_and_groups_worker, 2):
        assert res["clip_err"] < 1e-5, res
        for ours, ref in res["norms"]:
            assert ref > 0.05 and abs(ours - ref) <= 1e-5 * ref, res["norms"]  # clipping was active
        assert res["groups_err"] < 1e-5, res


def _schedulers():
    out = {
        "LambdaLR": lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda u: 1.0 / (1 + u)),
        "CosineAnnealingLR": lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=6, eta_min=1e-4),
        "OneCycleLR": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=5e-2, total_steps=8),
    }
    if importlib.util.find_spec("transformers") is not None:
        from transformers import get_cosine_schedule_with_warmup

        out["hf_cosine_with_warmup"] = lambda o: get_cosine_schedule_with_warmup(o, 2, 8)
    return out


@pytest.mark.parametrize("name", sorted(_schedulers()))
@pytest.mark.parametrize("mode", ["acco", "sync"])
def test_lr_each_round_uses_is_the_schedule_per_committed_update(name, mode, monkeypatch):
    """Check that an attached scheduler counts committed updates: both rounds of an update use its LR."""
    make = _schedulers()[name]
    updates = 6
    plain_model = make_model()
    plain = torch.optim.AdamW(plain_model.parameters(), **KW)
    sched = make(plain)
    expected = []
    for _ in range(updates):
        expected.append(plain.param_groups[0]["lr"])
        plain.step()
        sched.step()

    model = make_model()
    opt = AccoOptimizer(model.parameters(), mode=mode, accumulate_while_communicating=True, max_microbatches=1, **KW)
    opt.attach_lr_scheduler(make(opt))
    used = []
    record_round_lrs(opt, used, monkeypatch)
    per_update = 2 if mode == "acco" else 1
    for i in range(updates * per_update):
        loss_fn(model, 0, i).backward()
        opt.step()
    opt.finish()
    assert opt.num_updates == updates
    got = used[::per_update] if mode == "sync" else used[1::2]  # acco: the commit of each update
    assert got == pytest.approx(expected, rel=1e-12), (got, expected)
    if mode == "acco":
        assert used[0::2] == pytest.approx(expected, rel=1e-12)  # its estimate used the same LR


def _nonfinite_worker(rank, world, policy):
    model = make_model()
    opt = AccoOptimizer(model.parameters(), mode="acco", accumulate_while_communicating=True, max_microbatches=1, nonfinite=policy, **KW)
    try:
        for i in range(8):
            loss = loss_fn(model, rank, i)
            if rank == 1 and i == 3:
                loss = loss * float("inf")  # one rank, one micro-batch: the commit of update 1
            loss.backward()
            opt.step()
            opt.zero_grad()
        opt.finish()
    except NonFiniteGradientError as exc:
        return {"raised": str(exc)}
    return {"skipped": opt.num_skipped_updates, "updates": opt.num_updates, "w": flat(model),
            "finite": bool(torch.isfinite(flat(model)).all())}


def test_nonfinite_gradient_skips_the_update_on_every_rank():
    """Check that an inf gradient on one rank skips that update everywhere and never reaches the weights."""
    a, b = run_ranks(_nonfinite_worker, 2, "skip")
    assert a["skipped"] == b["skipped"] == 1 and a["updates"] == 4
    assert a["finite"] and torch.equal(a["w"], b["w"])


def test_nonfinite_gradient_raises_on_every_rank_when_asked():
    """Check that nonfinite='raise' raises NonFiniteGradientError on all ranks alike."""
    for res in run_ranks(_nonfinite_worker, 2, "raise"):
        assert "inf/NaN" in res.get("raised", ""), res


def _mismatch_worker(rank, world):
    model = make_model()
    opt = AccoOptimizer(model.parameters(), mode="acco", accumulate_while_communicating=True, max_microbatches=1, **KW)
    for i in range(3 + rank):  # rank 1 hands off one round more; it waits for rank 0 forever
        loss_fn(model, rank, i).backward()
        opt.step()
    try:
        opt.finish()
    except RuntimeError as exc:
        return str(exc)
    return "no error"


@pytest.mark.slow
def test_ranks_with_different_round_counts_fail_at_finish_instead_of_hanging():
    """Check that finish() reports ranks that handed off different numbers of rounds, on every rank: rank 1's
    extra round meets rank 0's finish() on the rounds' group."""
    for msg in run_ranks(_mismatch_worker, 2, timeout=90):
        assert "ran different numbers of updates: rank 0 in finish() (after 3 rounds), rank 1 in round 3" in msg, msg
