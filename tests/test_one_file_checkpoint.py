"""One checkpoint file written by one process (nanoGPT's ``master_process``): ``acco.checkpoint.gather`` and
``AccoOptimizer.from_optimizer``, the two calls the porting guide's nanoGPT diff uses."""

from __future__ import annotations

import pytest
import torch

from _dist import run_ranks
from tinynet import flat, make_model

import acco
import acco.checkpoint as ckpt
from acco import AccoOptimizer

KW = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
M = 4  # micro-batches per update


def _loss(model, rank, update, micro):
    g = torch.Generator().manual_seed(1000 * update + 10 * micro + rank)
    x, y = torch.randn(6, 5, generator=g), torch.randn(6, 3, generator=g)
    dtype = next(model.parameters()).dtype
    return ((model(x.to(dtype)) - y.to(dtype)) ** 2).float().mean()


def _updates(model, opt, rank, start, stop):
    for u in range(start, stop):
        for m in range(M):
            (_loss(model, rank, u, m) / M).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def _configure_optimizers(model):
    """What a script's own optimizer factory returns: two groups, per-group weight decay."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                             lr=1e-2, betas=(0.9, 0.95))


def _save_worker(rank, world, path, mode):
    """3 updates, the one-file checkpoint written by rank 0 only, 3 more updates (the reference)."""
    model = make_model()
    opt = AccoOptimizer.from_optimizer(_configure_optimizers(model), mode=mode, microbatches_per_update=M,
                                       max_grad_norm=1.0)
    _updates(model, opt, rank, 0, 3)
    state = ckpt.gather(opt, model=model)  # every rank; only rank 0 gets the dict
    if rank == 0:
        torch.save({"model": state["model"], "optimizer": state["optimizer"], "iter_num": 3}, path)
    with opt.committed_weights():
        committed = flat(model)
    _updates(model, opt, rank, 3, 6)
    after = flat(model)
    opt.finish()
    # The same run built the direct way: from_optimizer must not change a thing.
    direct_model = make_model()
    decay = [p for p in direct_model.parameters() if p.dim() >= 2]
    rest = [p for p in direct_model.parameters() if p.dim() < 2]
    direct = AccoOptimizer([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                           torch.optim.AdamW, mode=mode, microbatches_per_update=M, max_grad_norm=1.0,
                           lr=1e-2, betas=(0.9, 0.95))
    _updates(direct_model, direct, rank, 0, 6)
    direct.finish()
    return {"state_is_none": state is None, "committed": committed, "after": after, "final": flat(model),
            "direct_final": flat(direct_model), "saved_model": flat_dict(state["model"]) if state else None}


def flat_dict(sd):
    return torch.cat([v.reshape(-1) for v in sd.values()])


def _resume_worker(rank, world, path, mode):
    """A fresh process: the nanoGPT resume path, every rank reading the same file."""
    model = make_model(seed=99)
    checkpoint = torch.load(path, weights_only=True)
    model.load_state_dict(checkpoint["model"])
    opt = AccoOptimizer.from_optimizer(_configure_optimizers(model), mode=mode, microbatches_per_update=M,
                                       max_grad_norm=1.0)
    opt.load_state_dict(checkpoint["optimizer"])
    _updates(model, opt, rank, checkpoint["iter_num"], 6)
    after = flat(model)
    opt.finish()
    return {"after": after, "final": flat(model)}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Mode acco (the model holds the estimate between updates): the reference run and its checkpoint."""
    path = str(tmp_path_factory.mktemp("one_file") / "ckpt.pt")
    return path, run_ranks(_save_worker, 2, path, "acco")


def test_one_file_checkpoint_resumes_bit_identically(saved):
    path, ref = saved
    assert [r["state_is_none"] for r in ref] == [False, True]  # the dict on rank 0 only
    assert torch.equal(ref[0]["saved_model"], ref[0]["committed"])  # the committed weights, not the estimate
    assert not torch.equal(ref[0]["committed"], ref[0]["after"])  # (the run went on after the save)
    got = run_ranks(_resume_worker, 2, path, "acco")
    for r in range(2):
        assert torch.equal(got[r]["after"], ref[r]["after"]), f"rank {r}: the model after resuming differs"
        assert torch.equal(got[r]["final"], ref[r]["final"]), f"rank {r}: the committed weights differ"


def test_one_file_checkpoint_on_another_world_size_is_refused_naming_dcp(saved):
    path, _ = saved
    model = make_model()
    opt = AccoOptimizer.from_optimizer(_configure_optimizers(model), microbatches_per_update=M)  # one process
    before = flat(model)
    with pytest.raises(ValueError, match=r"2 rank\(s\).*this run has 1.*acco.checkpoint.save/load"):
        opt.load_state_dict(torch.load(path, weights_only=True)["optimizer"])
    assert torch.equal(flat(model), before)  # nothing loaded


def test_from_optimizer_equals_direct_construction(saved):
    for r in saved[1]:
        assert torch.equal(r["final"], r["direct_final"])


def test_from_optimizer_refuses_a_stepped_optimizer_and_duplicate_arguments():
    model = make_model()
    plain = _configure_optimizers(model)
    with pytest.raises(TypeError, match="optimizer_class"):
        AccoOptimizer.from_optimizer(plain, optimizer_class=torch.optim.SGD)
    with pytest.raises(TypeError, match="torch.optim.Optimizer instance"):
        AccoOptimizer.from_optimizer(torch.optim.AdamW)
    model(torch.randn(2, 5)).sum().backward()
    plain.step()
    with pytest.raises(ValueError, match="already stepped"):
        AccoOptimizer.from_optimizer(plain)


def test_gather_without_a_process_group_round_trips():
    model = make_model()
    opt = AccoOptimizer.from_optimizer(_configure_optimizers(model), microbatches_per_update=M)
    _updates(model, opt, 0, 0, 2)
    state = ckpt.gather(opt, model=model)
    assert set(state) == {"model", "optimizer"} and len(state["optimizer"]["acco_ranks"]) == 1
    model2 = make_model(seed=5)
    model2.load_state_dict(state["model"])
    opt2 = AccoOptimizer.from_optimizer(_configure_optimizers(model2), microbatches_per_update=M)
    opt2.load_state_dict(state["optimizer"])
    _updates(model, opt, 0, 2, 3)
    _updates(model2, opt2, 0, 2, 3)
    assert torch.equal(flat(model), flat(model2))
    assert acco.checkpoint.gather is ckpt.gather


def _committed_state(model, opt):
    with opt.committed_weights():
        return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_model_and_optimizer_from_different_checkpoints_are_refused(dtype):
    """nanoGPT's mix-up: the model saved when validation improved (update 3), the optimizer at every evaluation
    (update 5). Loading both must be refused, naming the optimizer's update; matching pairs load."""
    model = make_model().to(dtype)
    opt = AccoOptimizer.from_optimizer(_configure_optimizers(model), microbatches_per_update=M)
    _updates(model, opt, 0, 0, 3)
    model_at_3 = _committed_state(model, opt)
    _updates(model, opt, 0, 3, 5)
    model_at_5, estimate_at_5 = _committed_state(model, opt), {k: v.clone() for k, v in model.state_dict().items()}
    optim_at_5 = opt.state_dict()
    assert not all(torch.equal(model_at_5[k], estimate_at_5[k]) for k in model_at_5)  # mode acco: two weights

    fresh = make_model(seed=3).to(dtype)
    fresh.load_state_dict(model_at_3)
    opt2 = AccoOptimizer.from_optimizer(_configure_optimizers(fresh), microbatches_per_update=M)
    before = flat(fresh)
    with pytest.raises(ValueError, match=r"not the ones this optimizer state was saved with \(it holds 5 committed"):
        opt2.load_state_dict(optim_at_5)
    assert torch.equal(flat(fresh), before)  # nothing loaded
    assert opt2.local_optimizer.state == {} or all(not s for s in opt2.local_optimizer.state.values())
    for good in (model_at_5, estimate_at_5):  # the committed weights, or the weights saved outside the block
        fresh.load_state_dict(good)
        opt2.load_state_dict(optim_at_5)
    fresh.load_state_dict(model_at_3)
    opt2.load_state_dict(optim_at_5, restore_model=True)  # explicit: the model's weights come from the state
    assert torch.equal(flat(fresh), flat(model))
