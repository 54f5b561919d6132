"""Checkpoints: DCP save/load with resharding, interop with plain AdamW, safety."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from _dist import run_ranks
from tinynet import flat, make_model, rel_err

import acco.checkpoint as ckpt
from acco import AccoOptimizer

KW = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
GLOBAL_BATCH = 12  # divisible by 2 and 3: any world size sees the same global batch


def global_loss(model, rank: int, world: int, index: int) -> torch.Tensor:
    """Rank ``rank``'s equal share of global micro-batch ``index``: the run is world-size independent."""
    g = torch.Generator().manual_seed(index + 1)
    x, y = torch.randn(GLOBAL_BATCH, 5, generator=g), torch.randn(GLOBAL_BATCH, 3, generator=g)
    share = GLOBAL_BATCH // world
    x, y = x[rank * share : (rank + 1) * share], y[rank * share : (rank + 1) * share]
    return ((model(x) - y) ** 2).mean()


def _train(model, opt, rank, world, start, stop, traj=None):
    for i in range(start, stop):
        global_loss(model, rank, world, i).backward()
        opt.step()
        opt.zero_grad()
        if traj is not None:
            traj.append(flat(model))


AWC = dict(accumulate_while_communicating=True, max_microbatches=1)


def _save_worker(rank, world, mode, path, k1, k2, loop=AWC):
    """Train k1 micro-batches, checkpoint, then continue k2 more (the uninterrupted reference)."""
    model = make_model()
    opt = AccoOptimizer(model.parameters(), mode=mode, **loop, estimate_dtype=None, **KW)  # EXACT: see test_resume_on_another_world_size_continues_identically
    _train(model, opt, rank, world, 0, k1)
    assert opt.at_update_boundary
    ckpt.save(path, opt, extra={"next_index": torch.tensor(k1)})
    traj = []
    _train(model, opt, rank, world, k1, k1 + k2, traj)
    opt.finish()
    return {"traj": torch.stack(traj), "final": flat(model)}


def _load_worker(rank, world, mode, path, k2, loop=AWC):
    """Fresh model and optimizer (other init), load, continue k2 micro-batches."""
    model = make_model(seed=123)
    opt = AccoOptimizer(model.parameters(), mode=mode, **loop, estimate_dtype=None, **KW)  # EXACT: see test_resume_on_another_world_size_continues_identically
    extra = ckpt.load(path, opt, extra={"next_index": torch.tensor(0)})
    start = int(extra["next_index"])
    traj = []
    _train(model, opt, rank, world, start, start + k2, traj)
    opt.finish()
    return {"traj": torch.stack(traj), "final": flat(model), "updates": opt.num_updates}


@pytest.mark.parametrize(
    "mode,saved_on,loaded_on", [("acco", 2, 3)] + [pytest.param(*c, marks=pytest.mark.slow)
                                                   for c in [("acco", 3, 2), ("dpu", 2, 3), ("sync", 3, 2)]]
)
def test_resume_on_another_world_size_continues_identically(tmp_path, mode, saved_on, loaded_on):
    """Check that a checkpoint saved on N ranks, loaded on M, continues as the run that never stopped.

    With the paper's exact estimate (estimate_dtype=None): a bf16 estimate (the default) sums the ranks' bf16
    gradients in an order that depends on their number, so its run on M ranks differs from N's in the estimate's
    last bf16 bits (1.5e-4 relative here)."""
    path = str(tmp_path / "ckpt")
    k1, k2 = 6, 7  # acco: 6 micro-batches = 3 committed updates, a boundary
    ref = run_ranks(_save_worker, saved_on, mode, path, k1, k2)[0]
    for res in run_ranks(_load_worker, loaded_on, mode, path, k2):
        errs = [rel_err(a, b) for a, b in zip(res["traj"], ref["traj"])]
        assert len(errs) == k2 and max(errs) < 1e-6, errs
        assert rel_err(res["final"], ref["final"]) < 1e-6


@pytest.mark.slow
def test_delay_correction_resumes_on_another_world_size(tmp_path):
    """Mode dpu with delay_correction, one step() per micro-batch: the previous update's step (u_{k-1}, kept in
    the wrapped optimizer's state) is saved on 2 ranks and resharded onto 3, so the run continues as the one
    that never stopped (without it, the first update after the load would be a plain step)."""
    path, loop = str(tmp_path / "ckpt"), dict(microbatches_per_update=1, delay_correction=1.0)
    ref = run_ranks(_save_worker, 2, "dpu", path, 4, 5, loop)[0]
    for res in run_ranks(_load_worker, 3, "dpu", path, 5, loop):
        errs = [rel_err(a, b) for a, b in zip(res["traj"], ref["traj"])]
        assert len(errs) == 5 and max(errs) < 1e-6, errs


def test_checkpoint_holds_only_tensors(tmp_path):
    """Check that nothing in the checkpoint is pickled (DCP bytes entries), so loading runs no code."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    model = make_model()
    opt = AccoOptimizer(model.parameters(), mode="acco", accumulate_while_communicating=True, max_microbatches=1, **KW)
    _train(model, opt, 0, 1, 0, 4)
    ckpt.save(str(tmp_path / "c"), opt, extra={"step": torch.tensor(4)})
    meta = dcp.FileSystemReader(str(tmp_path / "c")).read_metadata().state_dict_metadata
    # one process: every parameter is one piece, keyed by its index and first element (format 3)
    assert {"optim.master.0:0", "optim.state.0:0.exp_avg", "optim.scalars.0.step", "optim.hyper.0.lr"} <= set(meta)
    assert all(isinstance(m, TensorStorageMetadata) for m in meta.values()), {k: type(m) for k, m in meta.items()}


def test_state_dict_mid_update_is_refused():
    """Check that a checkpoint between the two halves of an acco update raises a clear error."""
    model = make_model()
    opt = AccoOptimizer(model.parameters(), mode="acco", accumulate_while_communicating=True, max_microbatches=1, **KW)
    _train(model, opt, 0, 1, 0, 3)  # estimate of update 1 handed off: half a mini-batch pending
    assert not opt.at_update_boundary
    with pytest.raises(RuntimeError, match="mid-update"):
        opt.state_dict()
    opt.finish()


def test_crash_while_saving_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    """Check that a save that dies half-way leaves the previous checkpoint whole and loadable."""
    import torch.distributed.checkpoint as dcp

    path = str(tmp_path / "c")
    model = make_model()
    opt = AccoOptimizer(model.parameters(), mode="sync", **KW)
    _train(model, opt, 0, 1, 0, 2)
    ckpt.save(path, opt, extra={"i": torch.tensor(2)})
    at_save = flat(model)
    _train(model, opt, 0, 1, 2, 4)
    real_save = dcp.save

    def dying_save(sd, checkpoint_id, **kw):
        real_save(sd, checkpoint_id=checkpoint_id, **kw)
        os.remove(os.path.join(checkpoint_id, ".metadata"))  # as if killed before the end
        raise KeyboardInterrupt("killed while saving")

    monkeypatch.setattr(dcp, "save", dying_save)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save(path, opt, extra={"i": torch.tensor(4)})
    monkeypatch.setattr(dcp, "save", real_save)
    fresh_model = make_model(seed=5)
    fresh = AccoOptimizer(fresh_model.parameters(), mode="sync", **KW)
    extra = ckpt.load(path, fresh, extra={"i": torch.tensor(0)})
    assert int(extra["i"]) == 2 and torch.equal(flat(fresh_model), at_save)


def _interop_worker(rank, world):
    """plain AdamW -> AccoOptimizer(sync) and AccoOptimizer(sync) -> plain AdamW, vs plain all along."""

    def plain_steps(model, opt, start, stop):
        for i in range(start, stop):
            global_loss(model, rank, world, i).backward()
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
            opt.step()
            opt.zero_grad()

    ref = make_model()
    ref_opt = torch.optim.AdamW(ref.parameters(), **KW)
    plain_steps(ref, ref_opt, 0, 8)

    # plain for 4 steps, then acco for 4
    m1 = make_model()
    o1 = torch.optim.AdamW(m1.parameters(), **KW)
    plain_steps(m1, o1, 0, 4)
    a1 = AccoOptimizer(m1.parameters(), mode="sync", **KW)
    a1.load_consolidated_state_dict(o1.state_dict())
    _train(m1, a1, rank, world, 4, 8)
    a1.finish()

    # acco for 4 steps, then plain for 4
    m2 = make_model()
    a2 = AccoOptimizer(m2.parameters(), mode="sync", **KW)
    _train(m2, a2, rank, world, 0, 4)
    sd = a2.consolidated_state_dict()
    a2.finish()
    for p in m2.parameters():
        p.grad = None
    o2 = torch.optim.AdamW(m2.parameters(), **KW)
    o2.load_state_dict(sd)
    plain_steps(m2, o2, 4, 8)
    return {"to_acco": rel_err(flat(m1), flat(ref)), "to_plain": rel_err(flat(m2), flat(ref))}


def test_interop_with_plain_adamw_both_directions():
    """Check that optimizer state moves between torch.optim.AdamW and AccoOptimizer with no change to the run."""
    for res in run_ranks(_interop_worker, 2):
        assert res["to_acco"] < 1e-6 and res["to_plain"] < 1e-6, res


# ---- the world shrinks: the same global batch from twice the micro-batches on half the ranks

def _block_loss(model, update, micro, rank):
    """Sample block (update, micro-batch, rank) of the 2-rank run: the same tensors whoever computes them."""
    g = torch.Generator().manual_seed(100_000 * update + 100 * micro + rank + 1)
    x, y = torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g)
    return ((model(x) - y) ** 2).mean()


def _two_rank_updates(model, opt, rank, start, stop):
    for u in range(start, stop):
        for m in range(2):
            (_block_loss(model, u, m, rank) / 2).backward()
        opt.step()
        opt.zero_grad()


def _shrink_save_worker(rank, world, mode, path):
    model = make_model()
    opt = AccoOptimizer(model.parameters(), mode=mode, microbatches_per_update=2, estimate_dtype=None, **KW)  # exact
    _two_rank_updates(model, opt, rank, 0, 3)
    with opt.committed_weights():
        ckpt.save(path, opt, model=model, extra={"update": torch.tensor(3)})
    _two_rank_updates(model, opt, rank, 3, 6)
    opt.finish()
    return flat(model)


@pytest.mark.parametrize("mode", ["acco"])
@pytest.mark.slow
def test_shrink_to_one_rank_with_twice_the_microbatches_continues_the_run(tmp_path, mode):
    """2 ranks x 2 micro-batches, checkpoint, then 1 rank x 4 micro-batches of the same blocks (the first half
    of an update is micro-batch 0 of both ranks, as on 2 ranks): the run ends where the 2-rank run ends."""
    path = str(tmp_path / "ckpt")
    reference = run_ranks(_shrink_save_worker, 2, mode, path)[0]
    model = make_model(seed=9)
    opt = AccoOptimizer(model.parameters(), mode=mode, microbatches_per_update=4, estimate_dtype=None, **KW)  # one process
    with pytest.raises(ValueError, match="microbatches_per_update=2, this optimizer has 4.*allow_new_microbatches=True"):
        ckpt.load(path, opt, model=model, extra={"update": torch.tensor(0)})
    start = int(ckpt.load(path, opt, model=model, extra={"update": torch.tensor(0)}, allow_new_microbatches=True)["update"])
    assert opt.microbatches_per_update == 4
    for u in range(start, 6):
        for m, r in ((0, 0), (0, 1), (1, 0), (1, 1)):
            (_block_loss(model, u, m, r) / 4).backward()
        opt.step()
        opt.zero_grad()
    opt.finish()
    assert rel_err(flat(model), reference) < 1e-6, rel_err(flat(model), reference)
