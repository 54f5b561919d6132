"""fp16 with loss scaling: ``torch.amp.GradScaler`` driving an AccoOptimizer (``src/acco/amp.py``).

* Mode sync under fp16 autocast equals DDP + ``torch.optim.AdamW`` + ``GradScaler``, update by update: the
  weights within 1e-5 and the scale's whole history (back-off on overflow, growth), with an overflow on one
  rank only (the flag is agreed over the ranks, as DDP's averaged gradient agrees it).
* In every mode, an fp32 model under a power-of-two scale trains exactly as the same run without a scaler
  (scaling and unscaling by 2^k are exact), skips included; the first update whose estimate went out before the
  scale was known runs synchronously.
* A resume (optimizer and scaler state dicts, fresh objects) continues bit-identically, the scale included.
* What a scaler cannot drive is refused with the fix.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn as nn

import acco
from _dist import run_ranks

M = 2  # micro-batches per update
UPDATES = 8


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def batch(rank: int, update: int, mb: int):
    g = torch.Generator().manual_seed(1000 * update + 10 * mb + rank)
    return torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)


def overflows(rank: int, update: int, mb: int) -> bool:
    """An overflow on rank 1 only, in update 5 (besides the ones a too-large initial scale gives)."""
    return rank == 1 and update == 5 and mb == 1


def fp16_loss(model: nn.Module, rank: int, update: int, mb: int) -> torch.Tensor:
    x, y = batch(rank, update, mb)
    if overflows(rank, update, mb):
        x = x * 3e4  # fp16 activations overflow: inf in this rank's gradient only
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(x)
    return nn.functional.mse_loss(out.float(), y) / M


def fp32_loss(model: nn.Module, rank: int, update: int, mb: int) -> torch.Tensor:
    x, y = batch(rank, update, mb)
    loss = nn.functional.mse_loss(model(x), y) / M
    return loss * float("inf") if overflows(rank, update, mb) else loss


def _weights(model: nn.Module):
    return [p.detach().clone() for p in model.parameters()]


def _ddp_worker(rank: int, world: int) -> dict:
    """Mode sync against DDP + AdamW + GradScaler, under fp16 autocast."""
    out: dict = {}
    for name in ("acco", "ddp"):
        model = make_model()
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 18, growth_interval=2)
        if name == "acco":
            opt = acco.AccoOptimizer(model.parameters(), lr=1e-2, weight_decay=0.1, mode="sync")
            net = model
        else:
            net = nn.parallel.DistributedDataParallel(model)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        weights, scales = [], []
        for u in range(UPDATES):
            for mb in range(M):
                if name == "ddp" and mb < M - 1:
                    with net.no_sync():
                        scaler.scale(fp16_loss(net, rank, u, mb)).backward()
                else:
                    scaler.scale(fp16_loss(net, rank, u, mb)).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            scales.append(scaler.get_scale())
            weights.append(_weights(model))
        if name == "acco":
            opt.finish()
        out[name] = {"weights": weights, "scales": scales}
    return out


def test_mode_sync_under_fp16_autocast_equals_ddp_with_grad_scaler():
    for rank, r in enumerate(run_ranks(_ddp_worker, 2)):
        a, d = r["acco"], r["ddp"]
        assert a["scales"] == d["scales"], (rank, a["scales"], d["scales"])
        # the history holds back-offs (the initial scale and rank 1's overflow in update 5) and a growth
        s = [2.0 ** 18] + d["scales"]
        assert any(b < p for p, b in zip(s, s[1:])) and any(b > p for p, b in zip(s, s[1:])), s
        assert d["scales"][5] < d["scales"][4], d["scales"]  # rank 1's overflow backs off on both ranks
        for u, (wa, wd) in enumerate(zip(a["weights"], d["weights"])):
            for x, y in zip(wa, wd):
                assert torch.allclose(x, y, rtol=1e-5, atol=1e-6), (rank, u, (x - y).abs().max())


def _train(model, opt, scaler, rank, updates, start=0, around=lambda update: contextlib.nullcontext()):
    """``updates`` updates of the fp32 model (scaled when ``scaler``), each inside ``around(update)``; the
    weights after each, and the scale after each (``scaler.get_scale()`` outside ``around``: a host read)."""
    weights, scales = [], []
    for u in range(start, start + updates):
        with around(u):
            for mb in range(M):
                loss = fp32_loss(model, rank, u, mb)
                (scaler.scale(loss) if scaler is not None else loss).backward()
            if scaler is not None:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            opt.zero_grad()
        if scaler is not None:
            scales.append(scaler.get_scale())
        weights.append(_weights(model))
    return weights, scales


def _modes_worker(rank: int, world: int, mode: str, given_m: bool) -> dict:
    kwargs = dict(lr=1e-2, weight_decay=0.1, mode=mode, microbatches_per_update=M if given_m else None)
    out = {}
    model = make_model()
    opt = acco.AccoOptimizer(model.parameters(), **kwargs)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=3)
    out["scaled"], out["scales"] = _train(model, opt, scaler, rank, UPDATES)
    out["skipped"] = opt.num_skipped_updates
    opt.finish()
    out["scaled_final"] = _weights(model)
    # the same run without a scaler; with M given, its first update synchronous as the scaled run's must be
    model = make_model()
    sync_first = 1 if given_m and mode == "acco" else 0
    opt = acco.AccoOptimizer(model.parameters(), synchronous_updates=sync_first, **kwargs)
    out["plain"], _ = _train(model, opt, None, rank, UPDATES)
    opt.finish()
    out["plain_final"] = _weights(model)
    # resumed at update 4: the optimizer's and the scaler's state dicts, into fresh objects
    model = make_model()
    opt = acco.AccoOptimizer(model.parameters(), **kwargs)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=3)
    first, first_scales = _train(model, opt, scaler, rank, 4)
    saved_opt, saved_scaler = opt.state_dict(), scaler.state_dict()
    out["saved_scale"] = float(saved_opt["loss_scale"])
    opt.finish()
    model = make_model(seed=1)  # other weights: the load puts the saved ones back
    opt = acco.AccoOptimizer(model.parameters(), **kwargs)
    opt.load_state_dict(saved_opt, restore_model=True)
    scaler = torch.amp.GradScaler("cpu")
    scaler.load_state_dict(saved_scaler)
    rest, rest_scales = _train(model, opt, scaler, rank, UPDATES - 4, start=4)
    opt.finish()
    out["resumed"], out["resumed_scales"] = first + rest, first_scales + rest_scales
    out["resumed_final"] = _weights(model)
    return out


@pytest.mark.parametrize("mode,given_m", [("acco", False), ("acco", True), ("dpu", True), ("sync", True)])
def test_power_of_two_scale_trains_as_without_a_scaler_and_resumes(mode, given_m):
    for rank, r in enumerate(run_ranks(_modes_worker, 2, mode, given_m)):
        s = [2.0 ** 10] + r["scales"]
        assert r["scales"][5] == r["scales"][4] / 2, s  # rank 1's inf in update 5 backed off on every rank
        assert any(b > p for p, b in zip(s, s[1:])), s  # and the scale grew
        assert r["skipped"] == 1, r["skipped"]
        for u, (a, b) in enumerate(zip(r["scaled"] + [r["scaled_final"]], r["plain"] + [r["plain_final"]])):
            for x, y in zip(a, b):
                assert torch.equal(x, y), (rank, u, (x - y).abs().max())
        assert r["saved_scale"] == r["scales"][3]  # the scale of update 4, after update 3's scaler.update()
        assert r["resumed_scales"] == r["scales"]
        for u, (a, b) in enumerate(zip(r["resumed"] + [r["resumed_final"]], r["scaled"] + [r["scaled_final"]])):
            for x, y in zip(a, b):
                assert torch.equal(x, y), (rank, "resumed", u, (x - y).abs().max())


def _one_process(**kwargs):
    model = make_model()
    return model, acco.AccoOptimizer(model.parameters(), lr=1e-2, **kwargs)


def _scaled_backward(model, scaler):
    x, y = batch(0, 0, 0)
    scaler.scale(nn.functional.mse_loss(model(x), y)).backward()


def test_unscale_before_step_is_refused_with_the_fix():
    model, opt = _one_process(mode="sync")
    scaler = torch.amp.GradScaler("cpu")
    _scaled_backward(model, scaler)
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match=r"leave out\s+scaler.unscale_\(optimizer\).*max_grad_norm"):
        scaler.step(opt)


def test_accumulate_while_communicating_with_a_scaler_is_refused():
    model, opt = _one_process(mode="sync", accumulate_while_communicating=True)
    scaler = torch.amp.GradScaler("cpu")
    _scaled_backward(model, scaler)
    with pytest.raises(NotImplementedError, match="bf16.*default loop"):
        scaler.step(opt)


def test_nonfinite_raise_with_a_scaler_is_refused():
    model, opt = _one_process(mode="sync", nonfinite="raise")
    scaler = torch.amp.GradScaler("cpu")
    _scaled_backward(model, scaler)
    with pytest.raises(ValueError, match="nonfinite='skip'"):
        scaler.step(opt)


def test_a_scaler_that_sets_attributes_instead_is_refused():
    """If torch's GradScaler stops passing itself (its announced protocol: grad_scale/found_inf attributes),
    step() refuses rather than use the scaled gradients."""
    model, opt = _one_process(mode="sync")
    _scaled_backward(model, torch.amp.GradScaler("cpu"))
    opt.grad_scale, opt.found_inf = torch.tensor(65536.0), torch.tensor(0.0)
    with pytest.raises(RuntimeError, match="grad_scale/found_inf instead of passing"):
        opt.step()


def test_a_single_process_scaled_step_skips_and_backs_off():
    model, opt = _one_process(mode="sync")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    before = _weights(model)
    x, y = batch(0, 0, 0)
    scaler.scale(nn.functional.mse_loss(model(x), y) * float("inf")).backward()
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 2.0 ** 7
    assert all(torch.equal(a, b) for a, b in zip(before, _weights(model)))
    assert opt.num_skipped_updates == 1
    opt.finish()


_SCRIPT = """
import torch, acco
model = torch.nn.Linear(4, 2)
opt = acco.AccoOptimizer(model.parameters(), mode="sync")
scaler = torch.amp.GradScaler("cpu")
for _ in range(2):
    scaler.scale(model(torch.randn(3, 4)).pow(2).mean()).backward()
    scaler.step(opt)
    scaler.update()
opt.finish()
print("done")
"""


def test_the_scalers_notice_about_its_own_protocol_is_not_shown():
    """A user's script (warnings at their defaults) sees no FutureWarning from scaler.step(opt)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "done" in done.stdout, done.stderr
    assert "GradScaler is going to stop" not in done.stderr, done.stderr


def _fake_cuda_worker(rank: int, world: int) -> dict:
    """Mode acco with fused AdamW on the simulated CUDA path (tests/fake_cuda.py): scaled against plain."""
    import os

    import acco.device_api
    from fake_cuda import FakeCuda

    os.environ["ACCO_RING"] = "0"  # native collectives, as on NCCL
    fake = FakeCuda(devices=1)
    acco.device_api.stream_api = lambda device: fake
    out: dict = {}
    try:
        with fake:
            for name in ("scaled", "plain"):
                model = make_model()
                opt = acco.AccoOptimizer(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
                scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=3) if name == "scaled" else None
                traj, _ = _train(model, opt, scaler, rank, UPDATES,  # no host sync after the first commit
                                 around=lambda u: fake.forbid_syncs() if u >= 1 else contextlib.nullcontext())
                opt.finish()
                out[name] = traj
                out[name + "_uses_streams"] = opt.scheduler.uses_streams
    finally:
        acco.device_api.stream_api = acco.device_api.__dict__["_real_stream_api"]
    out.update(races=fake.races[:5], syncs=list(fake.forbidden_syncs)[:5], unrecorded=fake.unrecorded_side_storages()[:5])
    return out


def test_cuda_path_with_a_scaler_trains_as_without_it_without_races_or_host_syncs():
    for rank, r in enumerate(run_ranks(_fake_cuda_worker, 2)):
        assert r["scaled_uses_streams"] and r["plain_uses_streams"], "the test must run the stream path"
        assert r["races"] == [] and r["unrecorded"] == [] and r["syncs"] == [], (rank, r)
        for u, (a, b) in enumerate(zip(r["scaled"], r["plain"])):
            for x, y in zip(a, b):
                assert torch.equal(x, y), (rank, u, (x - y).abs().max())
