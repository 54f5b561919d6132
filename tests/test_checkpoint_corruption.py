"""Damaged checkpoints are refused with a clear error, and the optimizer and the model stay as they were.

One process (DCP without a process group): a checkpoint of an acco run is damaged in one way, then loaded
into a second run that has trained differently; everything that run holds is compared before and after.
"""

from __future__ import annotations

import glob
import os

import pytest
import torch
from torch import nn

import acco.checkpoint
from acco import AccoOptimizer, CheckpointError

KW = dict(lr=1e-2, weight_decay=0.1)


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(48, 48), nn.Tanh(), nn.Linear(48, 8))


def _train(model, opt, updates, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(updates):
        for _ in range(2):
            (model(torch.randn(4, 48, generator=g)).pow(2).mean() / 2).backward()
        opt.step()


def _everything(model, opt):
    st = opt.local_optimizer.state
    return ([t.detach().clone() for t in model.state_dict().values()] + [opt.runtime.flat.master.clone()]
            + [v.clone() for _, t in opt.runtime.wrapped.held() for v in st.get(t, {}).values() if torch.is_tensor(v)]
            + [torch.tensor([opt.num_rounds, opt.num_updates, opt.next_update_index])])


def _same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.fixture()
def saved(tmp_path):
    model = _model(0)
    opt = AccoOptimizer(model.parameters(), **KW)
    _train(model, opt, 3, seed=1)
    with opt.committed_weights():
        acco.checkpoint.save(str(tmp_path / "ckpt"), opt, model=model)
    master = opt.runtime.flat.master[: opt.layout.numel].clone()
    opt.finish()
    return tmp_path / "ckpt", master


def _victim():
    model = _model(5)
    opt = AccoOptimizer(model.parameters(), **KW)
    _train(model, opt, 2, seed=9)
    with opt.committed_weights():
        pass  # the in-flight commit collected: nothing changes in the background from here on
    return model, opt


def _shard_file(path) -> str:
    files = glob.glob(os.path.join(path, "*.distcp"))
    assert len(files) == 1, files
    return files[0]


def _damage(path, how: str, master: torch.Tensor) -> None:
    shard = _shard_file(path)
    data = bytearray(open(shard, "rb").read())
    if how == "truncated":
        open(shard, "wb").write(data[: len(data) // 2])
    elif how == "flipped byte in a tensor":
        needle = master[:8].numpy().tobytes()  # the master weights' bytes, as stored
        at = bytes(data).find(needle)
        assert at >= 0, "the stored master weights must be found for the test to mean anything"
        data[at + 5] ^= 0x40
        open(shard, "wb").write(data)
    elif how == "missing shard file":
        os.remove(shard)
    elif how == "damaged metadata":
        meta = os.path.join(path, ".metadata")
        raw = bytearray(open(meta, "rb").read())
        raw[len(raw) // 2 : len(raw) // 2 + 16] = b"\x00" * 16
        open(meta, "wb").write(raw)


@pytest.mark.parametrize("how", ["truncated", "flipped byte in a tensor", "missing shard file", "damaged metadata"])
def test_damaged_checkpoint_is_refused_and_changes_nothing(saved, how):
    """Check each kind of damage raises CheckpointError and leaves the optimizer and the model unchanged."""
    path, master = saved
    _damage(path, how, master)
    model, opt = _victim()
    before = _everything(model, opt)
    with pytest.raises(CheckpointError, match="Nothing was loaded") as info:
        acco.checkpoint.load(str(path), opt, model=model)
    message = str(info.value)
    assert message.startswith(f"acco.checkpoint.load({str(path)!r}): ") and "Traceback" not in message, message
    assert len(message) < 1200, message  # what is wrong, not DCP's tracebacks (those are in __cause__)
    assert _same(before, _everything(model, opt))
    _train(model, opt, 1, seed=3)  # and it still trains
    opt.finish()


def test_undamaged_checkpoint_loads(saved):
    """Check the same load succeeds on an undamaged checkpoint (the refusals above are the damage's)."""
    path, master = saved
    model, opt = _victim()
    acco.checkpoint.load(str(path), opt, model=model)
    assert torch.equal(opt.runtime.flat.master[: opt.layout.numel], master)
    opt.finish()


def test_checkpoint_of_another_mode_is_refused_and_changes_nothing(saved):
    """Check a checkpoint written in mode acco is refused by a sync optimizer, before the model is touched."""
    path, _ = saved
    model = _model(5)
    opt = AccoOptimizer(model.parameters(), mode="sync", **KW)
    before = _everything(model, opt)
    with pytest.raises(ValueError, match="mode 'acco'"):
        acco.checkpoint.load(str(path), opt, model=model)
    assert _same(before, _everything(model, opt))
    opt.finish()


def test_tampered_rank_state_dict_is_refused(tmp_path):
    """Check opt.state_dict() carries checksums: a changed value is refused on load, nothing changes."""
    model = _model(0)
    opt = AccoOptimizer(model.parameters(), **KW)
    _train(model, opt, 2, seed=1)
    torch.save(opt.state_dict(), tmp_path / "optim.pt")
    opt.finish()
    sd = torch.load(tmp_path / "optim.pt", weights_only=True)
    sd["state"]["0:0"]["exp_avg"].view(-1)[7] += 1e-3  # parameter 0's piece (one process: the whole parameter)
    model, opt = _victim()
    before = _everything(model, opt)
    with pytest.raises(CheckpointError, match="'optim/state/0:0/exp_avg' does not match its checksum"):
        opt.load_state_dict(sd)
    assert _same(before, _everything(model, opt))
    opt.finish()


def test_edited_description_is_refused(tmp_path):
    """Check what a state dict says it is (mode, optimizer, ...) is covered by its checksums: a sync state dict
    relabelled as acco is refused on load, nothing changes."""
    model = _model(0)
    opt = AccoOptimizer(model.parameters(), mode="sync", **KW)
    _train(model, opt, 2, seed=1)
    sd = opt.state_dict()
    opt.finish()
    sd["acco"]["mode"] = "acco"
    model, opt = _victim()
    before = _everything(model, opt)
    with pytest.raises(CheckpointError, match="'meta/mode' does not match its checksum"):
        opt.load_state_dict(sd, restore_model=True)
    assert _same(before, _everything(model, opt))
    opt.finish()


def test_dcp_load_into_a_fresh_optimizers_template_is_refused(tmp_path):
    """Check a raw dcp.load into a fresh optimizer's sharded_state_dict() (which lists no optimizer state, so
    DCP skips it) is refused instead of training on without AdamW's moments; acco.checkpoint.load works."""
    import torch.distributed.checkpoint as dcp

    model = _model(0)
    opt = AccoOptimizer(model.parameters(), **KW)
    _train(model, opt, 2, seed=1)
    with opt.committed_weights():
        acco.checkpoint.save(str(tmp_path / "ckpt"), opt, model=model)
    opt.finish()
    model2 = _model(5)
    fresh = AccoOptimizer(model2.parameters(), **KW)
    target = {"optim": fresh.sharded_state_dict()}
    assert target["optim"]["state"] == {}
    dcp.load(target, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    before = _everything(model2, fresh)
    with pytest.raises(ValueError, match=r"holds 8 optimizer-state entries.*listed 0.*acco.checkpoint.load"):
        fresh.load_state_dict(target["optim"])
    assert _same(before, _everything(model2, fresh))
    acco.checkpoint.load(str(tmp_path / "ckpt"), fresh, model=model2)
    assert set(next(iter(fresh.local_optimizer.state.values()))) == {"step", "exp_avg", "exp_avg_sq"}
    fresh.finish()
