"""Parameters without a gradient, as torch treats them (issue 65, findings 3 and 4).

A parameter that no rank produced a gradient for in an update (a skipped head, an MoE expert no token chose,
a layer frozen with ``requires_grad_(False)`` after the optimizer was built) has ``.grad`` None under DDP with
``find_unused_parameters=True``: torch's optimizer does not move it, and its state does not advance. One used
on some ranks only is averaged as DDP averages it (the others count zeros). Checked against the oracle, whose
``grad_fn`` gives None for such a tensor, in every mode, and in mode sync against DDP + AdamW itself. With
compressed rounds too: the master of a layer frozen mid-run does not move, and its copy in the model follows the
oracle's rule for compressed weights (``docs/algorithm.md``, "Compressed rounds").
"""

from __future__ import annotations

import functools
import time

import pytest
import torch
from torch import nn

from _dist import run_ranks
from oracle import reference_run, update_run
from tinynet import elastic_run, flat, flat_list, rel_err

from acco import AccoOptimizer

TOL = 1e-5
UPDATES = 6
FREEZE = 3  # fc1.bias is frozen (requires_grad_(False)) before update FREEZE's first backward
OPTIMIZERS = {
    "adamw": (torch.optim.AdamW, dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)),
    "sgd_momentum": (torch.optim.SGD, dict(lr=5e-2, momentum=0.9, weight_decay=0.01)),
}
# (name, optimizer, mode, micro-batches per update, options)
CONFIGS = [
    ("adamw/sync/m2", "adamw", "sync", 2, {}),
    ("adamw/dpu/m2", "adamw", "dpu", 2, {}),
    ("adamw/acco/m2", "adamw", "acco", 2, {}),  # estimate_extrapolation "auto": 1.2 for AdamW
    ("adamw/acco/m4-paper", "adamw", "acco", 4, {"estimate_extrapolation": 1.0}),
    ("adamw/acco/m2-clip", "adamw", "acco", 2, {"max_grad_norm": 0.05}),
    ("adamw/dpu/m2-delay-correction", "adamw", "dpu", 2, {"delay_correction": 1.0}),
    ("sgd_momentum/acco/m2", "sgd_momentum", "acco", 2, {}),
    ("sgd_momentum/sync/m2", "sgd_momentum", "sync", 2, {}),
    # no zero_grad() at all (the same run for torch's optimizers here: .grad is zero after step())
    ("adamw/sync/m2-no-zero-grad", "adamw", "sync", 2, {}),
    ("adamw/acco/m2-no-zero-grad", "adamw", "acco", 2, {}),
    # compressed rounds: the residual and the weights' change (docs/algorithm.md, "Compressed rounds"). Not fp8
    # clipped in mode acco: on these data AdamW's Opt* rounds an ulp apart from the oracle's and fp8 turns that
    # ulp into a quantum of one element of theta~ (1e-3, undone by the next commit; test_compression.py says more)
    ("adamw/sync/m2-int8", "adamw", "sync", 2, {"compression": "int8"}),
    ("adamw/dpu/m2-int8", "adamw", "dpu", 2, {"compression": "int8"}),
    ("adamw/acco/m2-int8", "adamw", "acco", 2, {"compression": "int8"}),
    ("adamw/acco/m2-int8-clip", "adamw", "acco", 2, {"compression": "int8", "max_grad_norm": 0.05}),
    ("adamw/acco/m2-fp8", "adamw", "acco", 2, {"compression": "fp8"}),
    ("adamw/acco/m2-int8-gradients-only", "adamw", "acco", 2, {"compression": "int8", "compression_weights": False}),
]
BIAS_INDEX = 2  # fc1.bias among the model's parameters (expert, fc1.weight, fc1.bias, ...)


class Gated(nn.Module):
    """A trunk, a head always used, a head used in some updates only, and an "expert" one rank uses rarely."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(5, 6)
        self.head_a = nn.Linear(6, 3)
        self.head_b = nn.Linear(6, 3)
        self.expert = nn.Parameter(torch.zeros(3))

    def forward(self, x: torch.Tensor, use_b: bool, use_expert: bool) -> torch.Tensor:
        h = torch.tanh(self.fc1(x))
        out = self.head_a(h)
        if use_b:
            out = out + self.head_b(h)
        if use_expert:
            out = out * (1 + self.expert)
        return out


def make_gated() -> Gated:
    torch.manual_seed(0)
    model = Gated()
    with torch.no_grad():
        model.expert.normal_(0, 0.1)
    return model


# fc1.bias in the flattened parameters (module parameters' order: the model's own, expert, first)
BIAS = slice(3 + 30, 3 + 30 + 6)


def uses(rank: int, index: int, m: int):
    """Which optional parts micro-batch ``index`` of ``rank`` uses (``m`` micro-batches per update). head_b:
    in updates 0, 3: by rank 0 in the update's last micro-batch only (an acco estimate sees none of it); in
    updates 1, 4: by no rank (not stepped); in updates 2, 5: by every rank. The expert: by rank 1, in the first
    micro-batch of even updates only."""
    t, j = divmod(index, m)
    use_b = (t % 3 == 0 and rank == 0 and j == m - 1) or t % 3 == 2
    use_expert = rank == 1 and t % 2 == 0 and j == 0
    return use_b, use_expert


def loss_of(model: Gated, rank: int, index: int, m: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + index + 1)
    x, y = torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g)
    return ((model(x, *uses(rank, index, m)) - y) ** 2).mean() / m


def grad_fn(m: int):
    """The oracle's gradients: None where the tensor got none (unused, or frozen from update FREEZE on)."""

    def fn(rank, index, weights):
        model = Gated()
        with torch.no_grad():
            for p, w in zip(model.parameters(), weights):
                p.copy_(w)
        if index // m >= FREEZE:
            model.fc1.bias.requires_grad_(False)
        loss_of(model, rank, index, m).backward()
        return [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]

    return fn


def _masters(opt, index: int) -> dict:
    """This rank's pieces of parameter ``index``'s fp32 master weights (``opt.state_dict()``, format 3)."""
    return {k: v.clone() for k, v in opt.state_dict()["master"].items() if k.split(":")[0] == str(index)}


def _train(model, opt, rank, m, freeze=True, zero_grad=True, masters=None):
    traj, committed = [], []
    for t in range(UPDATES):
        if masters is not None and t == FREEZE:  # fc1.bias's master as it is frozen (the last commit collected)
            masters.append(_masters(opt, BIAS_INDEX))
        if freeze and t == FREEZE:
            model.fc1.bias.requires_grad_(False)
        for j in range(m):
            loss_of(model, rank, t * m + j, m).backward()
        opt.step()
        if zero_grad:
            opt.zero_grad()
        traj.append(flat(model))
        with opt.committed_weights():
            committed.append(flat(model))
    if masters is not None:
        masters.append(_masters(opt, BIAS_INDEX))  # and after the last update's commit
    return traj, committed


def _worker(rank: int, world: int) -> dict:
    out = {}
    for name, opt_name, mode, m, options in CONFIGS:
        cls, kw = OPTIMIZERS[opt_name]
        model = make_gated()
        theta0 = [p.detach().clone() for p in model.parameters()]
        exact = {} if "compression" in options else {"estimate_dtype": None}  # compressed: 8-bit estimates
        opt = AccoOptimizer(model.parameters(), cls, mode=mode, microbatches_per_update=m, **exact, **options, **kw)
        masters = []
        traj, committed = _train(model, opt, rank, m, zero_grad="no-zero-grad" not in name, masters=masters)
        opt.finish()
        ref_steps, _, ref_final = update_run(
            theta0, lambda ps: cls(ps, **kw), mode, grad_fn(m), world, UPDATES, m,
            max_grad_norm=options.get("max_grad_norm"), estimate_extrapolation=opt.estimate_extrapolation,
            delay_correction=opt.delay_correction, compression=options.get("compression"),
            compression_weights=options.get("compression_weights", True))
        out[name] = {
            # fc1.bias's master from its freeze to the end (the pieces this rank holds; some rank holds it)
            "bias_master_moved": max([(masters[1][k] - v).abs().max().item() for k, v in masters[0].items()],
                                     default=None),
            "step_err": max(rel_err(a, flat_list(b)) for a, b in zip(traj, ref_steps)),
            "final_err": rel_err(flat(model), flat_list(ref_final)),
            # the committed fc1.bias once update FREEZE - 1 (its last with a gradient) is committed, and at the end
            "bias_after_freeze": (flat(model)[BIAS] - committed[FREEZE - 1][BIAS]).abs().max().item(),
        }
    # Mode sync against DDP(find_unused_parameters=True) + torch.optim.AdamW on the same micro-batches (no freeze:
    # DDP's reducer is built for the parameters that require a gradient at construction).
    cls, kw = OPTIMIZERS["adamw"]
    ddp_model = make_gated()
    ddp = torch.nn.parallel.DistributedDataParallel(ddp_model, find_unused_parameters=True)
    ddp_opt = cls(ddp_model.parameters(), **kw)
    model = make_gated()
    opt = AccoOptimizer(model.parameters(), cls, mode="sync", microbatches_per_update=2, **kw)
    errs, b_moved = [], []
    for t in range(UPDATES):
        b_before = ddp_model.head_b.weight.detach().clone()
        for j in range(2):
            index = t * 2 + j
            loss_of(model, rank, index, 2).backward()
            with ddp.no_sync() if j == 0 else torch.enable_grad():
                g = torch.Generator().manual_seed(1000 * rank + index + 1)
                x, y = torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g)
                (((ddp(x, *uses(rank, index, 2)) - y) ** 2).mean() / 2).backward()
        opt.step()
        opt.zero_grad()
        ddp_opt.step()
        ddp_opt.zero_grad()
        errs.append(rel_err(flat(model), flat(ddp_model)))
        b_moved.append((ddp_model.head_b.weight - b_before).abs().max().item())
    opt.finish()
    out["ddp"] = {"err": max(errs), "b_moved": b_moved}
    return out


@functools.lru_cache(maxsize=None)
def _results(world: int):
    return run_ranks(_worker, world)


@pytest.mark.parametrize("world,name", [pytest.param(w, c[0], marks=() if w == 2 else pytest.mark.slow)
                                        for w in (2, 3) for c in CONFIGS])
def test_parameters_without_gradient_match_oracle(world, name):
    """Unused heads, a rarely used expert and a layer frozen mid-run: every step() against the oracle."""
    options = {c[0]: c[4] for c in CONFIGS}[name]
    compressed_weights = "compression" in options and options.get("compression_weights", True)
    held = []  # the ranks that hold a piece of fc1.bias
    for rank, res in enumerate(_results(world)):
        r = res[name]
        assert r["step_err"] < TOL, f"rank {rank}: {r}"
        assert r["final_err"] < TOL, f"rank {rank}: {r}"
        if r["bias_master_moved"] is not None:
            held.append(rank)
            assert r["bias_master_moved"] == 0.0, f"rank {rank}: the master of a parameter frozen mid-run moved: {r}"
        if not compressed_weights:
            assert r["bias_after_freeze"] == 0.0, f"rank {rank}: a parameter frozen mid-run moved: {r}"
    assert held, "no rank held fc1.bias's master"


def test_mode_sync_equals_ddp_find_unused_parameters():
    """Mode sync is DDP(find_unused_parameters=True) + AdamW, update by update, with head_b unused in some updates
    (where DDP's head_b does not move: the reference itself shows the case is exercised)."""
    for rank, res in enumerate(_results(2)):
        r = res["ddp"]
        assert r["err"] < TOL, f"rank {rank}: {r}"
        assert [moved == 0.0 for moved in r["b_moved"]] == [t % 3 == 1 for t in range(UPDATES)], r


ELASTIC_ROUNDS = 8
ELASTIC_FREEZE = 6  # fc1.bias frozen before each rank's micro-batch 6


def elastic_uses(rank: int, index: int):
    """head_b: rank 0's first three micro-batches only, so the later rounds have no gradient for it; the expert:
    rank 1's micro-batches 2 and 3."""
    return rank == 0 and index < 3, rank == 1 and index in (2, 3)


def elastic_loss(model: Gated, rank: int, index: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + index + 1)
    x, y = torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g)
    return ((model(x, *elastic_uses(rank, index)) - y) ** 2).mean()


def elastic_grad_fn(rank, index, weights):
    model = Gated()
    with torch.no_grad():
        for p, w in zip(model.parameters(), weights):
            p.copy_(w)
    if index >= ELASTIC_FREEZE:
        model.fc1.bias.requires_grad_(False)
    elastic_loss(model, rank, index).backward()
    return [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]


def _elastic_worker(rank: int, world: int, mode: str) -> dict:
    model = make_gated()
    theta0 = [p.detach().clone() for p in model.parameters()]
    opt = AccoOptimizer(model.parameters(), mode=mode, accumulate_while_communicating=True, max_microbatches=3,
                        estimate_dtype=None, lr=1e-2, weight_decay=0.1)

    def micro_batch(mb: int) -> None:
        if rank == 1:
            time.sleep(0.05)  # the slow rank: the fast one accumulates more per round
        if mb == ELASTIC_FREEZE:
            model.fc1.bias.requires_grad_(False)
        elastic_loss(model, rank, mb).backward()

    counts, traj = elastic_run(opt, ELASTIC_ROUNDS, micro_batch, lambda: flat(model))
    opt.finish()
    return {"counts": counts, "traj": torch.stack(traj), "final": flat(model), "theta0": theta0}


@pytest.mark.parametrize("mode", ["acco", pytest.param("dpu", marks=pytest.mark.slow)])
def test_accumulate_while_communicating_without_gradients_matches_oracle(mode):
    """The elastic loop, ranks of unequal speed: rounds whose sum holds no gradient of head_b, of the expert or
    of the frozen bias leave them as torch would, against the oracle fed the counts each rank recorded."""
    res = run_ranks(_elastic_worker, 2, mode)
    counts = [res[0]["counts"], res[1]["counts"]]
    ref_steps, ref_final = reference_run(res[0]["theta0"], lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
                                         mode, elastic_grad_fn, counts)
    for rank in (0, 1):
        errs = [rel_err(a, flat_list(b)) for a, b in zip(res[rank]["traj"], ref_steps[rank])]
        assert len(errs) == len(ref_steps[rank]) and max(errs) < TOL, f"rank {rank}: {max(errs):.2e} {counts}"
        assert rel_err(res[rank]["final"], flat_list(ref_final)) < TOL


def _whole_tensor_worker(rank: int, world: int, mode: str) -> dict:
    """Muon (whole tensors, each owned by one rank) for the matrices, AdamW for the rest; head_b used in update 0
    only, by rank 0."""
    model = make_gated()
    matrices = [p for n, p in model.named_parameters() if p.dim() == 2]
    rest = [p for n, p in model.named_parameters() if p.dim() != 2]
    opt = AccoOptimizer([{"params": matrices, "optimizer_class": torch.optim.Muon, "lr": 0.02, "momentum": 0.95,
                          "weight_decay": 0.01}, {"params": rest}], torch.optim.AdamW, mode=mode,
                        microbatches_per_update=2, lr=1e-2, weight_decay=0.1)
    committed = []
    for t in range(4):
        for j in range(2):
            g = torch.Generator().manual_seed(1000 * rank + 2 * t + j + 1)
            x, y = torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g)
            (((model(x, t == 0 and rank == 0, False) - y) ** 2).mean() / 2).backward()
        opt.step()
        opt.zero_grad()
        with opt.committed_weights():
            committed.append({n: p.detach().clone() for n, p in model.named_parameters()})
    opt.finish()
    return {n: [float((c[n] - committed[0][n]).abs().max()) for c in committed[1:]] for n in committed[0]}


@pytest.mark.parametrize("mode", ["sync", "acco", pytest.param("dpu", marks=pytest.mark.slow)])
def test_whole_tensor_optimizers_leave_a_parameter_without_gradient(mode):
    """Muon + AdamW: head_b (a Muon matrix and an AdamW bias) keeps its value once no rank uses it, while the
    trunk, stepped by the same two optimizers, moves."""
    for rank, moved in enumerate(run_ranks(_whole_tensor_worker, 2, mode)):
        assert moved["head_b.weight"] == [0.0] * 3 and moved["head_b.bias"] == [0.0] * 3, (rank, moved)
        assert min(moved["fc1.weight"]) > 0 and min(moved["fc1.bias"]) > 0, (rank, moved)


def _fake_cuda_worker(rank: int, world: int, opt_name: str, mode: str) -> dict:
    """The CUDA path on the simulated device (tests/fake_cuda.py), with the gated model of the oracle runs."""
    import contextlib
    import os

    import acco.device_api
    from fake_cuda import FakeCuda

    os.environ["ACCO_RING"] = "0"  # native collectives, as on NCCL
    kw = {"sgd": dict(lr=5e-2, momentum=0.9, weight_decay=0.01),
          "adamw_fused": dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, fused=True)}[opt_name]
    cls = torch.optim.SGD if opt_name == "sgd" else torch.optim.AdamW
    fake = FakeCuda(devices=1)
    acco.device_api.stream_api = lambda device: fake
    try:
        with fake:
            model = make_gated()
            theta0 = [p.detach().clone() for p in model.parameters()]
            opt = AccoOptimizer(model.parameters(), cls, mode=mode, microbatches_per_update=2, estimate_dtype=None,
                                **kw)
            traj = []
            for t in range(UPDATES):
                if t == FREEZE:
                    model.fc1.bias.requires_grad_(False)
                with fake.forbid_syncs() if t >= 1 else contextlib.nullcontext():  # after the first commit
                    for j in range(2):
                        loss_of(model, rank, 2 * t + j, 2).backward()
                    opt.step()
                    opt.zero_grad()
                    traj.append(flat(model))
            opt.finish()
            uses_streams = opt.scheduler.uses_streams
    finally:
        acco.device_api.stream_api = acco.device_api.__dict__["_real_stream_api"]
    ref_steps, _, _ = update_run(theta0, lambda ps: cls(ps, **kw), mode, grad_fn(2), world, UPDATES, 2,
                                 estimate_extrapolation=opt.estimate_extrapolation)
    return {"err": max(rel_err(a, flat_list(b)) for a, b in zip(traj, ref_steps)), "races": fake.races[:5],
            "syncs": list(fake.forbidden_syncs), "unrecorded": fake.unrecorded_side_storages()[:5],
            "uses_streams": uses_streams}


@pytest.mark.parametrize("opt_name,mode", [("sgd", "acco"), ("adamw_fused", "acco"),
                                           pytest.param("adamw_fused", "dpu", marks=pytest.mark.slow)])
def test_cuda_path_without_gradients_matches_oracle_and_syncs_only_to_read_the_bits(opt_name, mode):
    """On the simulated CUDA path: the oracle within 1e-5, no unordered access, and the only host syncs after the
    first commit are the reads of the other ranks' arrival bits, in rounds where this rank lacked a gradient."""
    for rank, r in enumerate(run_ranks(_fake_cuda_worker, 2, opt_name, mode)):
        assert r["uses_streams"], "the test must run the stream path"
        assert r["err"] < TOL, (rank, r["err"])
        assert r["races"] == [] and r["unrecorded"] == [], (rank, r["races"], r["unrecorded"])
        assert r["syncs"], "some round lacked a gradient on this rank: its bits are read on the host"
        other = [s for s in r["syncs"] if "table[:, 3:].tolist()" not in s]
        assert other == [], f"rank {rank}: a host sync other than the arrival bits' read: {other[:1]}"
