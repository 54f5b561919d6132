"""Optimizers that need whole tensors (Muon, Adafactor) and the Muon + AdamW split, against the oracle.

The oracle (``oracle.update_run``) runs the real torch optimizers on whole tensors in one process. The model
has a matrix larger than 1/N of it for every N tested, and uneven numbers of tensors per rank. Its gradients
are multiples of 2^-12 (a quantising backward), so every sum of them is exact in fp32 whatever its order:
the library (a ring sums the ranks) and the oracle (a loop) hand the optimizers the very same gradients, and
Muon's bf16 orthogonalisation the very same input. One spawn per world size runs every configuration.
"""

from __future__ import annotations

import functools
import math
from typing import Dict, List, Tuple

import pytest
import torch
from torch import nn

from _dist import run_ranks
from oracle import Split, update_run

from acco import AccoOptimizer

TOL = 1e-5
UPDATES = 5
SHAPES: Dict[str, Tuple[int, ...]] = {"emb": (10, 4), "big": (24, 16), "w1": (8, 12), "b1": (12,), "w2": (12, 8),
                                      "w3": (5, 6), "gain": (3,), "table": (64, 8)}
ALL = ("emb", "big", "w1", "b1", "w2", "w3", "gain")  # the model of the oracle runs
RESHARD = ALL + ("table",)  # the checkpoint runs: an AdamW table that every layout cuts across chunks
MATRICES = ("emb", "big", "w1", "w2", "w3")  # the model of the Muon-only runs (Muon steps 2-D matrices only)
HIDDEN = ("big", "w1", "w2", "w3")  # Muon's share of the split; the embedding and the 1-D tensors go to AdamW
MUON = dict(lr=0.02, momentum=0.95, weight_decay=0.01)
ADAMW = dict(lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
ADAFACTOR = dict(lr=1e-2)


class _Quantise(torch.autograd.Function):
    """Identity forward; the backward rounds the gradient to a multiple of 2^-12 in [-8, 8]."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return (g * 4096).round().clamp(-32768, 32768) / 4096


class Net(nn.Module):
    def __init__(self, names, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.names = list(names)
        for n in self.names:
            self.register_parameter(n, nn.Parameter(torch.randn(SHAPES[n], generator=g) * 0.5))

    def loss(self, rank: int, index: int, scale: float) -> torch.Tensor:
        """Micro-batch ``index`` of ``rank``, times ``scale``: an element-wise fit of each tensor to a target."""
        total = 0.0
        for k, n in enumerate(self.names):
            p = getattr(self, n)
            g = torch.Generator().manual_seed(10_000 * rank + 100 * index + k + 1)
            a, y = torch.randn(p.shape, generator=g), torch.randn(p.shape, generator=g) * 0.5
            a, y = a.to(p.device), y.to(p.device)  # the same data on any device (tests/test_cuda.py)
            total = total + ((torch.tanh(_Quantise.apply(p) * a) - y) ** 2).sum() * scale
        return total


def _grad_fn(names, scale: float, device: str = "cpu"):
    def grad_fn(rank, index, weights):
        net = Net(names).to(device)
        with torch.no_grad():
            for p, w in zip(net.parameters(), weights):
                p.copy_(w)
        net.loss(rank, index, scale).backward()
        return [p.grad.detach().clone() for p in net.parameters()]
    return grad_fn


def _setup(setup: str, names):
    """(AccoOptimizer param groups, its optimizer_class and kwargs; the oracle's make_opt) for ``setup``."""
    idx = {n: i for i, n in enumerate(names)}
    if setup == "muon":
        return (lambda net: (net.parameters(), torch.optim.Muon, MUON)), lambda ps: torch.optim.Muon(ps, **MUON)
    if setup == "adafactor":
        return (lambda net: (net.parameters(), torch.optim.Adafactor, ADAFACTOR),
                lambda ps: torch.optim.Adafactor(ps, **ADAFACTOR))
    hidden = [idx[n] for n in names if n in HIDDEN]
    rest = [idx[n] for n in names if n not in HIDDEN]

    def acco_groups(net):
        params = list(net.parameters())
        return ([{"params": [params[i] for i in hidden], "optimizer_class": torch.optim.Muon, **MUON},
                 {"params": [params[i] for i in rest]}], torch.optim.AdamW, ADAMW)
    return acco_groups, lambda ps: Split(ps, [(torch.optim.Muon, hidden, MUON), (torch.optim.AdamW, rest, ADAMW)])


# (name, setup, mode, micro-batches per update, AccoOptimizer options)
CONFIGS = [(f"{s}/{mode}", s, mode, 2, {}) for s in ("muon", "adafactor", "split") for mode in ("acco", "dpu", "sync")]
CONFIGS += [
    ("split/acco/m4-clip-sync1", "split", "acco", 4, {"max_grad_norm": 3.0, "synchronous_updates": 1}),
    ("muon/acco/m4-clip", "muon", "acco", 4, {"max_grad_norm": 2.0}),
    # the estimate's gradients in bf16: compared at 2 ranks, where the ranks' bf16 sum has one order
    ("split/acco/estimate-bf16", "split", "acco", 2, {"estimate_dtype": torch.bfloat16}),
]
BF16_WORLDS = (2,)


def _flat(ts) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).double() for t in ts])


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def _worker(rank: int, world: int) -> dict:
    out = {}
    for name, setup, mode, m, options in CONFIGS:
        if "estimate_dtype" in options and world not in BF16_WORLDS:
            continue
        names = MATRICES if setup == "muon" else ALL
        net = Net(names)
        theta0 = [p.detach().clone() for p in net.parameters()]
        acco_groups, make_opt = _setup(setup, names)
        groups, cls, kw = acco_groups(net)
        options = {"estimate_dtype": None, **options}  # the oracle's exact estimate, unless the config names one
        opt = AccoOptimizer(groups, cls, mode=mode, microbatches_per_update=m, **options, **kw)
        traj, committed = [], []
        for t in range(UPDATES):
            for j in range(m):
                net.loss(rank, t * m + j, 1.0 / m).backward()
            opt.step()
            opt.zero_grad()
            traj.append(_flat(net.parameters()))
            with opt.committed_weights():
                committed.append(_flat(net.parameters()))
        report = opt.memory_report()
        layout = opt.layout
        opt.finish()
        ref_steps, ref_committed, ref_final = update_run(
            theta0, make_opt, mode, _grad_fn(names, 1.0 / m), world, UPDATES, m,
            synchronous_updates=options.get("synchronous_updates", 0), estimate_dtype=options.get("estimate_dtype"),
            max_grad_norm=options.get("max_grad_norm"), estimate_extrapolation=opt.estimate_extrapolation)
        big = [id(p) for g in opt.param_groups for p in g["params"]].index(id(net.big))  # its index in the layout
        out[name] = {
            "step_err": max(_rel(a, _flat(b)) for a, b in zip(traj, ref_steps)),
            "committed_err": max(_rel(a, _flat(b)) for a, b in zip(committed, ref_committed)),
            "final_err": _rel(_flat(net.parameters()), _flat(ref_final)),
            "moved": (_flat(net.parameters()) - _flat(theta0)).abs().max().item(),
            "big_owner": layout.params[big].owner, "big_whole": layout.params[big].whole,
            "big_numel": layout.params[big].numel, "numel": layout.numel,
            "updates": opt.num_updates, "state_bytes": report["optimizer_state"],
        }
    return out


@functools.lru_cache(maxsize=None)
def _results(world: int):
    return run_ranks(_worker, world)


@pytest.mark.parametrize("world,name", [pytest.param(w, c[0], marks=() if w == 2 else pytest.mark.slow)
                                        for w in (2, 3, 4) for c in CONFIGS
                                        if "estimate_dtype" not in c[4] or w in BF16_WORLDS])
def test_whole_tensor_optimizers_match_the_oracle(world, name):
    """Check the model after every step(), the committed weights and the model after finish() against the real
    torch optimizers on whole tensors, with a matrix larger than 1/N of the model placed whole."""
    for rank, r in enumerate(_results(world)):
        res = r[name]
        assert res["updates"] == UPDATES
        assert res["moved"] > 1e-2, "the weights must actually change for the comparison to mean anything"
        assert res["big_whole"] and res["big_numel"] > res["numel"] / world, "a matrix over 1/N, placed whole"
        assert res["step_err"] < TOL, f"rank {rank}: {res}"
        assert res["committed_err"] < TOL, f"rank {rank}: {res}"
        assert res["final_err"] < TOL, f"rank {rank}: {res}"
    assert len({r[name]["big_owner"] for r in _results(world)}) == 1, "one owner, the same on every rank"


# ----------------------------------------------------------------------------- checkpoints, both placements


def _split_opt(net, world_mode="acco", **options):
    groups, cls, kw = _setup("split", tuple(net.names))[0](net)
    return AccoOptimizer(groups, cls, mode=world_mode, microbatches_per_update=2, **options, **kw)


def _train(net, opt, rank, start, stop, traj=None):
    for t in range(start, stop):
        for j in range(2):
            net.loss(rank, 2 * t + j, 0.5).backward()
        opt.step()
        opt.zero_grad()
        if traj is not None:
            traj.append(_flat(net.parameters()))


def _consolidated(opt) -> dict:
    full = opt.consolidated_state_dict()
    return {(i, k): (v.detach().cpu().clone() if torch.is_tensor(v) else torch.tensor(float(v)))
            for i, st in full["state"].items() for k, v in st.items()}


def _save_worker(rank, world, path):
    net = Net(RESHARD)
    opt = _split_opt(net)
    _train(net, opt, rank, 0, 3)
    acco_ckpt.save(path, opt, model=net)
    gathered = acco_ckpt.gather(opt, model=net)
    if rank == 0:
        torch.save(gathered, path + ".gathered.pt")
    state = _consolidated(opt)
    with opt.committed_weights():
        committed = _flat(net.parameters())
    traj = []
    _train(net, opt, rank, 3, 5, traj)
    out = {"state": state, "committed": committed, "traj": torch.stack(traj), "table_cuts": _table_cuts(opt, net)}
    opt.finish()
    return out


def _table_cuts(opt, net):
    """The first elements of the table's pieces, over all ranks (where this layout cuts it)."""
    i = [id(p) for g in opt.param_groups for p in g["params"]].index(id(net.table))
    p, size = opt.layout.params[i], opt.layout.shard_size
    return sorted({p.piece(r, size).param_start for r in p.ranks(size)})


def _load_forms(rank, world, path, forms):
    return {form: _load_worker(rank, world, path, form) for form in forms}


def _load_worker(rank, world, path, form):
    net = Net(RESHARD, seed=7)
    opt = _split_opt(net)
    if form == "dcp":
        acco_ckpt.load(path, opt, model=net)
    else:
        gathered = torch.load(path + ".gathered.pt", weights_only=True)
        net.load_state_dict(gathered["model"])
        opt.load_state_dict(gathered["optimizer"])
    state = _consolidated(opt)
    with opt.committed_weights():
        committed = _flat(net.parameters())
    traj = []
    _train(net, opt, rank, 3, 5, traj)
    out = {"state": state, "committed": committed, "traj": torch.stack(traj), "table_cuts": _table_cuts(opt, net)}
    opt.finish()
    return out


import acco.checkpoint as acco_ckpt  # noqa: E402


@functools.lru_cache(maxsize=None)
def _saved_on_three(path: str):
    return run_ranks(_save_worker, 3, path)[0]


@pytest.mark.parametrize("world", [pytest.param(w, marks=pytest.mark.slow) for w in (3, 2, 4, 1)])
def test_split_checkpoint_reshards_every_tensor_exactly(tmp_path_factory, world):
    """Check a Muon + AdamW checkpoint saved on 3 ranks: on 1, 2 and 4 ranks (whole tensors change owners, the
    AdamW table is cut at other elements) every parameter's full state and the committed weights come back bit-identical; on 3
    ranks (DCP, or the one file of acco.checkpoint.gather) the run goes on bit-identically."""
    path = str(tmp_path_factory.getbasetemp() / "split-ckpt")
    saved = _saved_on_three(path)
    forms = ("dcp", "gathered") if world == 3 else ("dcp",)
    for out in [o for outs in run_ranks(_load_forms, world, path, forms) for o in outs.values()]:
        if world != 3:
            assert out["table_cuts"] != saved["table_cuts"], "the table is cut elsewhere: a reshard cuts and joins"
        assert set(out["state"]) == set(saved["state"])
        for key, value in saved["state"].items():
            assert torch.equal(out["state"][key], value), key
        assert torch.equal(out["committed"], saved["committed"])
        if world == 3:
            assert torch.equal(out["traj"], saved["traj"])


def test_consolidated_state_round_trips_through_a_new_optimizer():
    """Check consolidated_state_dict() of the split loads into a fresh AccoOptimizer (after the model's weights)
    and the two then take the same next step (one process)."""
    net = Net(RESHARD)
    opt = _split_opt(net, world_mode="sync")
    _train(net, opt, 0, 0, 3)
    full = opt.consolidated_state_dict()
    weights = {k: v.detach().clone() for k, v in net.state_dict().items()}
    net2 = Net(RESHARD, seed=3)
    net2.load_state_dict(weights)
    opt2 = _split_opt(net2, world_mode="sync")
    opt2.load_consolidated_state_dict(full)
    _train(net, opt, 0, 3, 4)
    _train(net2, opt2, 0, 3, 4)
    assert torch.equal(_flat(net.parameters()), _flat(net2.parameters()))
    opt.finish()
    opt2.finish()


# ----------------------------------------------------------------------------- the rest of the loop, placed whole


def test_nonfinite_gradient_of_a_whole_tensor_is_skipped_on_every_rank():
    """Check an inf in a Muon matrix's gradient skips the update (counted), leaves the weights, and training goes
    on (one process, mode acco: both the estimate and the commit see it)."""
    net = Net(MATRICES)
    opt = AccoOptimizer(net.parameters(), torch.optim.Muon, microbatches_per_update=2, **MUON)
    _train(net, opt, 0, 0, 2)
    with opt.committed_weights():
        before = _flat(net.parameters())
    for j in range(2):
        loss = net.loss(0, 100 + j, 0.5)
        if j == 1:  # an inf in one element of the big matrix's gradient (past the quantising backward)
            loss = loss + net.big[3, 4] * float("inf")
        loss.backward()
    opt.step()
    opt.zero_grad()
    with opt.committed_weights():
        assert torch.equal(_flat(net.parameters()), before)
    assert opt.num_skipped_updates == 1
    _train(net, opt, 0, 3, 5)
    opt.finish()
    assert opt.num_updates == 5 and torch.isfinite(_flat(net.parameters())).all()


def _accumulate_worker(rank, world):
    """Accumulate while communicating with the split: step() after every micro-batch; the rounds' counts."""
    from oracle import reference_run

    names = RESHARD
    net = Net(names)
    theta0 = [p.detach().clone() for p in net.parameters()]
    groups, cls, kw = _setup("split", names)[0](net)
    opt = AccoOptimizer(groups, cls, accumulate_while_communicating=True, max_microbatches=1, estimate_dtype=None, **kw)
    after = []
    for i in range(6):
        net.loss(rank, i, 1.0).backward()
        opt.step()
        opt.zero_grad()
        after.append(_flat(net.parameters()))
    opt.finish()
    _, ref_final = reference_run(theta0, _setup("split", names)[1], "acco", _grad_fn(names, 1.0),
                                 [[1] * 6 for _ in range(world)])
    return _rel(_flat(net.parameters()), _flat(ref_final))


def test_accumulate_while_communicating_with_the_split_matches_the_oracle():
    """Check the elastic loop (one micro-batch per hand-off) with Muon + AdamW against the oracle's rounds."""
    assert max(run_ranks(_accumulate_worker, 2)) < TOL


def test_memory_report_counts_the_state_of_the_tensors_each_rank_steps():
    """Check optimizer_state in memory_report(): Muon's momentum for the matrices this rank owns, AdamW's two
    moments for its slices, and nothing for what it does not step."""
    results = _results(3)
    totals = [r["split/sync"]["state_bytes"] for r in results]
    # Muon: one fp32 buffer per matrix element (owned by one rank); AdamW: two per element plus a step each
    muon = sum(math.prod(SHAPES[n]) for n in HIDDEN) * 4
    adamw = sum(math.prod(SHAPES[n]) for n in ALL if n not in HIDDEN) * 8
    steps = sum(totals) - muon - adamw
    assert 0 <= steps <= 4 * 3 * len(ALL), (totals, muon, adamw)  # a 4-byte step per AdamW piece


def test_from_optimizer_takes_the_split_users_already_build():
    """Check from_optimizer([Muon, AdamW]) builds one AccoOptimizer whose groups keep their classes and
    hyper-parameters, and that it steps the same as the same split built from param groups."""
    def built(kind):
        net = Net(RESHARD)
        hidden = [p for n, p in net.named_parameters() if n in HIDDEN]
        rest = [p for n, p in net.named_parameters() if n not in HIDDEN]
        if kind == "from_optimizer":
            opt = AccoOptimizer.from_optimizer([torch.optim.Muon(hidden, **MUON), torch.optim.AdamW(rest, **ADAMW)],
                                               mode="sync", microbatches_per_update=2)
        else:
            opt = AccoOptimizer([{"params": hidden, "optimizer_class": torch.optim.Muon, **MUON}, {"params": rest}],
                                torch.optim.AdamW, mode="sync", microbatches_per_update=2, **ADAMW)
        _train(net, opt, 0, 0, 2)
        assert [type(o).__name__ for o in opt.local_optimizers] == ["Muon", "AdamW"]
        assert opt.param_groups[0]["lr"] == MUON["lr"] and opt.param_groups[1]["betas"] == ADAMW["betas"]
        assert "betas" not in opt.param_groups[0], "AdamW's hyper-parameters stay out of the Muon group"
        opt.finish()
        return _flat(net.parameters())

    assert torch.equal(built("from_optimizer"), built("groups"))
