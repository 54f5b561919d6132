"""Lightning: Trainer(strategy="acco") against Lightning's own "ddp", on 2 gloo CPU ranks under torchrun.

The module (tests/lightning_script.py) is Lightning's documented shape: AdamW and a scheduler stepped every
update from configure_optimizers, accumulate_grad_batches=4, gradient_clip_val=1.0, a validation loop, and a
ModelCheckpoint saving every epoch.
"""

from __future__ import annotations

import json
import os
import sys
import warnings

import pytest
import torch

from _dist import run_command
from extras import need

need("lightning", "lightning")  # an extra: `make test` installs it and fails here without it

SCRIPT = os.path.join(os.path.dirname(__file__), "lightning_script.py")


ABORT = "terminate called without an active exception"


def _run(tmp, name, *args):
    """One run of the script on 2 ranks (faulthandler on: an abort prints every thread's Python stack).

    Guard against a defect seen twice in full-suite runs on 2026-11-25 and never reproduced since (0 in 68 runs
    of this script and file, alone and under load): a rank aborting at the end with gloo's ABORT. Its known
    cause, a gloo group left to interpreter exit (pytorch#190489), is closed for strategy="acco" by the
    strategy's exit hook and for the "ddp" baseline by the script's own shutdown. Should it come back, the run
    is retried once, with a warning carrying the aborted run's output; a second abort, and any other failure,
    fails the test."""
    out = os.path.join(tmp, f"{name}.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", SCRIPT,
           "--out", out, *args]
    env = {"PYTHONFAULTHANDLER": "1"}  # the ranks inherit it
    try:
        run_command(cmd, timeout=300, env=env)
    except AssertionError as exc:
        if ABORT not in str(exc):
            raise
        warnings.warn(f"lightning_script.py {name}: a rank aborted ({ABORT!r}); retrying once. Its output:\n"
                      f"{str(exc)[-3000:]}")
        run_command(cmd, timeout=300, env=env)
    with open(out) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("lightning"))
    ckpts = os.path.join(tmp, "ckpts")
    out = {"ddp": _run(tmp, "ddp", "--strategy", "ddp"),
           "acco": _run(tmp, "acco", "--strategy", "acco", "--ckpt-dir", ckpts)}
    epoch1 = os.path.join(ckpts, sorted(os.listdir(ckpts))[1])  # saved after the second epoch
    out["resumed"] = _run(tmp, "resumed", "--strategy", "acco", "--resume-from", epoch1)
    out["epoch1"] = epoch1
    return out


def test_acco_strategy_matches_lightnings_ddp(runs):
    """Check the held-out loss is at most 0.5% above strategy='ddp' and at most 1% below it after the same
    updates (AdamW's extrapolated estimate, the default, may end below DDP), the scheduler stepped once per update
    (4 micro-batches) in both, and the Trainer's gradient_clip_val is put back after fit."""
    ddp, acco = runs["ddp"], runs["acco"]
    assert ddp["steps"] == acco["steps"] == 32  # 4 epochs of 256 samples per rank, 8 per batch, 4 per update
    gap = (acco["val_loss"] - ddp["val_loss"]) / ddp["val_loss"]
    print(f"held-out loss: ddp {ddp['val_loss']:.5f}, acco {acco['val_loss']:.5f}, gap {gap:+.3%}")
    assert ddp["val_loss"] < 0.2, "the model must actually train (0.67 before)"
    assert -0.01 < gap < 0.005, (ddp["val_loss"], acco["val_loss"])
    lrs = acco["lrs"]  # after every batch: the rate moves at the batch that ends an update, every 4th
    assert lrs == ddp["lrs"] and [i for i in range(1, len(lrs)) if lrs[i] != lrs[i - 1]] == list(range(3, len(lrs), 4))
    assert acco["clip_after"] == 1.0


@pytest.mark.slow
def test_resume_from_ckpt_path_is_bit_identical(runs):
    """Check a fit resumed from the checkpoint of epoch 2 ends with the very weights of the run never stopped."""
    assert runs["resumed"]["steps"] == runs["acco"]["steps"]
    assert runs["resumed"]["weights"] == runs["acco"]["weights"]
    assert runs["resumed"]["val_loss"] == runs["acco"]["val_loss"]


@pytest.mark.slow
def test_checkpoint_holds_every_ranks_shard_and_the_committed_model(runs):
    """Check the .ckpt Lightning wrote on rank 0 holds both ranks' optimizer shards, and a model state dict
    equal to the committed weights the optimizer state holds (not the estimate)."""
    ckpt = torch.load(runs["epoch1"], weights_only=True)
    shards = ckpt["optimizer_states"][0]["acco_ranks"]
    assert len(shards) == 2 and {s["acco"]["rank"] for s in shards} == {0, 1}
    model = torch.cat([v.reshape(-1) for v in ckpt["state_dict"].values()])
    master = torch.cat([shards[r]["master"][k].reshape(-1) for r in range(2)
                        for k in sorted(shards[r]["master"], key=lambda k: tuple(map(int, k.split(":"))))])
    assert torch.equal(model, master)


# ----------------------------------------------------------------------------- what it refuses (one process)


def _trainer(**kw):
    import lightning.pytorch as pl

    from acco.integrations.lightning import AccoStrategy  # noqa: F401  (registers "acco")

    args = dict(accelerator="cpu", devices=1, strategy="acco", max_steps=2, logger=False, enable_progress_bar=False,
                enable_checkpointing=False, enable_model_summary=False)
    return pl.Trainer(**{**args, **kw})


def _fit(trainer, module=None):
    from torch.utils.data import DataLoader

    sys.path.insert(0, os.path.dirname(__file__))
    from lightning_script import Regression, data

    trainer.fit(module or Regression(), DataLoader(data(64, 1), batch_size=8))


class _TwoOptimizers:
    def __new__(cls):
        from lightning_script import Regression

        class Two(Regression):
            def configure_optimizers(self):
                return torch.optim.AdamW(self.net[0].parameters()), torch.optim.SGD(self.net[2].parameters(), lr=0.1)

        return Two()


@pytest.mark.parametrize("case,kwargs,error,match", [
    ("clipping by value", {"gradient_clip_val": 1.0, "gradient_clip_algorithm": "value", "accumulate_grad_batches": 2},
     ValueError, "gradient_clip_algorithm='value'.*cannot be honoured.*'norm'"),
    ("one micro-batch per update in mode acco", {}, ValueError, "accumulate_grad_batches=1.*>= 2.*mode='sync'"),
])
@pytest.mark.slow
def test_settings_it_cannot_honour_are_refused(case, kwargs, error, match):
    """Check each Trainer setting the strategy cannot honour raises at fit(), naming the fix."""
    with pytest.raises(error, match=match):
        _fit(_trainer(**kwargs))


@pytest.mark.slow
def test_several_optimizers_are_refused_naming_the_one_optimizer_way():
    """Check two optimizers from configure_optimizers are refused, naming from_optimizer for the split."""
    sys.path.insert(0, os.path.dirname(__file__))
    with pytest.raises((ValueError, RuntimeError), match="one optimizer|multiple optimizers"):
        _fit(_trainer(accumulate_grad_batches=2), _TwoOptimizers())


@pytest.mark.slow
def test_strategy_options_are_acco_options():
    """Check AccoStrategy passes AccoOptimizer options through and refuses others, naming them."""
    from acco.integrations.lightning import AccoStrategy

    s = AccoStrategy(mode="sync", estimate_dtype=None, nonfinite="raise")
    assert s.mode == "sync" and s.acco_options == {"estimate_dtype": None, "nonfinite": "raise"}
    with pytest.raises(TypeError, match="got \\['lr_warmup'\\], which are neither AccoOptimizer options"):
        AccoStrategy(lr_warmup=10)
    with pytest.raises(TypeError, match="sets \\['max_grad_norm'\\] from the Trainer.*gradient_clip_val"):
        AccoStrategy(max_grad_norm=1.0)


@pytest.mark.slow
def test_on_cuda_the_strategy_does_not_look_for_ddp_comm_hooks():
    """Check setup's hook registration on a CUDA root device: Lightning's DDPStrategy asserts its model is a
    DistributedDataParallel there (found on the first GPU run: Trainer(accelerator="gpu", strategy="acco")
    failed in setup); AccoStrategy has no DDP and no hooks to register. Runs on CPU: only the device is named."""
    from lightning.pytorch.strategies import DDPStrategy

    from acco.integrations.lightning import AccoStrategy

    for cls, fails in ((DDPStrategy, True), (AccoStrategy, False)):
        s = cls(parallel_devices=[torch.device("cuda", 0)])
        s.model = torch.nn.Linear(2, 2)
        assert s.root_device.type == "cuda"
        if fails:  # the premise: without the override, this is what a GPU user met
            with pytest.raises(AssertionError):
                s._register_ddp_hooks()
        else:
            s._register_ddp_hooks()


class _Split:
    """The Muon + AdamW split built in configure_optimizers, as one AccoOptimizer (``clip``: its max_grad_norm)."""

    def __new__(cls, clip):
        from lightning_script import Regression

        from acco import AccoOptimizer

        class Split(Regression):
            def configure_optimizers(self):
                hidden = [self.net[2].weight]
                others = [p for p in self.parameters() if p is not self.net[2].weight]
                return AccoOptimizer.from_optimizer([torch.optim.Muon(hidden, lr=0.02), torch.optim.AdamW(others)],
                                                    microbatches_per_update=2, max_grad_norm=clip)

        return Split()


class _Regions:
    """A module whose configure_optimizers builds an AccoOptimizer with an outer round across regions (one
    process: one region)."""

    def __new__(cls):
        from lightning_script import Regression

        class Regions(Regression):
            def configure_optimizers(self):
                import torch.distributed as dist

                from acco import AccoOptimizer

                return AccoOptimizer(self.parameters(), torch.optim.AdamW, microbatches_per_update=2, outer_every=2,
                                     outer_group=dist.group.WORLD)

        return Regions()


@pytest.mark.slow
def test_regions_with_checkpointing_are_refused():
    """An AccoOptimizer with outer_every from configure_optimizers: Lightning's checkpoint writes rank 0's model
    only, so with checkpointing on it is refused at fit(), naming enable_checkpointing=False; without, it trains."""
    sys.path.insert(0, os.path.dirname(__file__))
    with pytest.raises(NotImplementedError, match="outer_every=2: its checkpoints write one model.*"
                                                  "enable_checkpointing=False"):
        _fit(_trainer(accumulate_grad_batches=2, enable_checkpointing=True), _Regions())
    trainer = _trainer(accumulate_grad_batches=2)
    _fit(trainer, _Regions())
    assert trainer.global_step == 2 and trainer.strategy.acco_optimizer.finished


@pytest.mark.slow
def test_a_split_built_by_the_user_trains_and_must_agree_with_the_trainer():
    """Check the Muon + AdamW split returned from configure_optimizers is taken as it is and trains, and that one
    disagreeing with the Trainer's clipping is refused naming both settings (its clipping would be dropped)."""
    sys.path.insert(0, os.path.dirname(__file__))
    module = _Split(clip=1.0)
    trainer = _trainer(accumulate_grad_batches=2, gradient_clip_val=1.0)
    _fit(trainer, module)
    opt = trainer.strategy.acco_optimizer
    assert opt.finished and [g["optimizer_class"].__name__ for g in opt.param_groups] == ["Muon", "AdamW"]
    assert trainer.global_step == 2
    with pytest.raises(ValueError, match="has max_grad_norm=None but Trainer\\(gradient_clip_val\\)=1.0.*max_grad_norm=1.0"):
        _fit(_trainer(accumulate_grad_batches=2, gradient_clip_val=1.0), _Split(clip=None))
