"""HF Trainer (acco.integrations.hf.AccoTrainer) and the accelerate recipe, each against the framework's own
AdamW + DDP run: 2 gloo ranks under torchrun, a tiny GPT-2, 30 updates of 2 micro-batches per rank.

For each: the held-out loss within 0.5% of AdamW + DDP at equal tokens, no gradient all-reduce inside
backward (AdamW + DDP: one per update, counted the same way), and a run resumed from the checkpoint taken
at update 10 (Trainer) / 10 (accelerate) ending bit-identical to the uninterrupted one.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Dict, Optional

import pytest
import torch

from _dist import run_command
from extras import need

need("transformers", "hf")  # make test installs the extras and fails here without them (tests/extras.py)
need("accelerate", "hf")

HERE = os.path.dirname(__file__)


def _torchrun(script: str, *args: str, nproc: int = 2, env: Optional[Dict[str, str]] = None) -> None:
    run_command([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                 os.path.join(HERE, script), *map(str, args)], timeout=300, env=env)


def _result(out) -> dict:
    with open(os.path.join(out, "result.json")) as f:
        res = json.load(f)
    res["final"] = torch.load(os.path.join(out, "final.pt"), weights_only=True)
    return res


def _check(base: dict, acco: dict, resumed: dict) -> None:
    gap = (acco["eval_loss"] - base["eval_loss"]) / base["eval_loss"]
    print(f"held-out loss: AdamW+DDP {base['eval_loss']:.5f}, acco {acco['eval_loss']:.5f}, gap {gap:+.3%}")
    assert abs(gap) < 0.005, (base["eval_loss"], acco["eval_loss"])
    assert base["allreduces"] > 0, "the count must see DDP's all-reduce to mean anything"
    assert acco["allreduces"] == 0, acco["allreduces"]
    assert resumed["eval_loss"] == acco["eval_loss"]
    for name, tensor in acco["final"].items():
        assert torch.equal(tensor, resumed["final"][name]), name


def test_hf_trainer(tmp_path):
    """Check AccoTrainer against Trainer's own AdamW: loss, one communication, exact resume_from_checkpoint."""
    dirs = {k: tmp_path / k for k in ("adamw", "acco", "resumed")}
    _torchrun("hf_trainer_script.py", dirs["adamw"], "adamw")
    _torchrun("hf_trainer_script.py", dirs["acco"], "acco")
    _torchrun("hf_trainer_script.py", dirs["resumed"], "acco", dirs["acco"] / "checkpoint-10")
    assert (dirs["acco"] / "checkpoint-10" / "acco_optimizer" / ".metadata").exists()
    _check(_result(dirs["adamw"]), _result(dirs["acco"]), _result(dirs["resumed"]))


@pytest.mark.slow
def test_hf_trainer_with_int8_rounds(tmp_path):
    """AccoTrainer(acco_kwargs={"compression": "int8"}): the held-out loss within 0.5% of Trainer's AdamW + DDP,
    no all-reduce inside backward, and resume_from_checkpoint (the residuals in the checkpoint) bit-identical."""
    dirs = {k: tmp_path / k for k in ("adamw", "int8", "resumed")}
    _torchrun("hf_trainer_script.py", dirs["adamw"], "adamw")
    _torchrun("hf_trainer_script.py", dirs["int8"], "acco-int8")
    _torchrun("hf_trainer_script.py", dirs["resumed"], "acco-int8", dirs["int8"] / "checkpoint-10")
    int8 = _result(dirs["int8"])
    assert int8["residual_bytes"] > 0, int8["residual_bytes"]  # the rounds were compressed (error feedback held)
    _check(_result(dirs["adamw"]), int8, _result(dirs["resumed"]))


def test_accelerate_recipe(tmp_path):
    """Check the accelerate recipe of docs/integrations.md against accelerate's own AdamW loop, and save_state/load_state."""
    dirs = {k: tmp_path / k for k in ("adamw", "acco", "resumed")}
    _torchrun("accelerate_script.py", dirs["adamw"], "adamw")
    _torchrun("accelerate_script.py", dirs["acco"], "acco", "--save-at", "10")
    _torchrun("accelerate_script.py", dirs["resumed"], "acco", "--resume", dirs["acco"] / "ckpt")
    _check(_result(dirs["adamw"]), _result(dirs["acco"]), _result(dirs["resumed"]))


@pytest.mark.slow
def test_acco_trainer_names_gradient_accumulation_steps(tmp_path):
    """AccoTrainer in mode acco with gradient_accumulation_steps=1 says which TrainingArguments field to set and
    which acco_mode to choose instead, at construction."""
    from transformers import TrainingArguments

    from acco.integrations.hf import AccoTrainer

    args = TrainingArguments(output_dir=str(tmp_path), gradient_accumulation_steps=1, report_to=[], use_cpu=True)
    with pytest.raises(ValueError, match="gradient_accumulation_steps=1.*gradient_accumulation_steps=2.*acco_mode='sync'"):
        AccoTrainer(model=torch.nn.Linear(2, 2), args=args)


def test_acco_trainer_refuses_regions_with_checkpoints(tmp_path):
    """AccoTrainer with outer_every (an outer round across regions) and Trainer's checkpoints, which write rank 0's
    model only: refused at construction, naming save_strategy='no'; without checkpoints it is built."""
    from transformers import TrainingArguments

    from acco.integrations.hf import AccoTrainer

    args = TrainingArguments(output_dir=str(tmp_path), gradient_accumulation_steps=2, report_to=[], use_cpu=True)
    with pytest.raises(NotImplementedError, match="AccoTrainer with outer_every=3: its checkpoints write one model.*"
                                                  "save_strategy='no'"):
        AccoTrainer(model=torch.nn.Linear(2, 2), args=args, acco_kwargs={"outer_every": 3})
    args = TrainingArguments(output_dir=str(tmp_path), gradient_accumulation_steps=2, report_to=[], use_cpu=True,
                             save_strategy="no")
    AccoTrainer(model=torch.nn.Linear(2, 2), args=args, acco_kwargs={"outer_every": 3})


def _accelerate_regions(rank: int, world: int) -> str:
    """acco.integrations.accelerate.prepare of an optimizer with outer_every (each rank a region of its own)."""
    import torch.distributed as dist

    from acco import AccoOptimizer
    from acco.integrations import accelerate

    alone = [dist.new_group([r]) for r in range(world)][rank]
    model = torch.nn.Linear(2, 2)
    opt = AccoOptimizer(model.parameters(), mode="sync", process_group=alone, outer_group=dist.group.WORLD,
                        outer_every=2)
    try:
        accelerate.prepare(None, model, opt)
    except NotImplementedError as exc:
        return str(exc)
    finally:
        opt.finish()
    return "not refused"


def test_accelerate_prepare_refuses_regions():
    """prepare() registers save_state, which writes rank 0's model only: with outer_every it is refused on every
    rank, naming what to call instead."""
    from _dist import run_ranks

    for out in run_ranks(_accelerate_regions, 2):
        assert "prepare with outer_every=2: its checkpoints write one model" in out, out
        assert "acco.disable_gradient_allreduce(model) instead of prepare" in out, out


@pytest.mark.parametrize("mode,steps", [("sync", 1), ("dpu", 3), ("acco", 2)])
@pytest.mark.slow
def test_acco_trainer_builds_the_optimizer_with_gradient_accumulation_steps_in_every_mode(tmp_path, mode, steps):
    """The optimizer AccoTrainer builds takes Trainer's gradient_accumulation_steps as its micro-batches per update
    in every mode (docs/integrations.md), so a step() after more backward() calls than that is refused in dpu and
    sync too, as in Lightning's strategy."""
    from transformers import TrainingArguments

    from acco.integrations.hf import AccoTrainer

    args = TrainingArguments(output_dir=str(tmp_path), gradient_accumulation_steps=steps, report_to=[], use_cpu=True)
    trainer = AccoTrainer(model=torch.nn.Linear(2, 2), args=args, acco_mode=mode)
    opt = trainer.create_optimizer()
    assert opt.mode == mode and opt.microbatches_per_update == steps


@pytest.mark.slow
def test_hf_integration_reports_the_real_import_error(monkeypatch):
    """transformers present but its Trainer failing to import (a broken dependency) is reported as that failure,
    not as 'transformers is missing'."""
    import importlib
    import types

    broken = types.ModuleType("transformers")

    def getattr_(name):
        raise ImportError("No module named 'safetensors'", name="safetensors")

    broken.__getattr__ = getattr_
    monkeypatch.setitem(sys.modules, "transformers", broken)
    monkeypatch.delitem(sys.modules, "acco.integrations.hf", raising=False)
    with pytest.raises(ImportError, match="importing transformers.Trainer failed.*safetensors") as info:
        importlib.import_module("acco.integrations.hf")
    assert "pip install" not in str(info.value)
    monkeypatch.delitem(sys.modules, "acco.integrations.hf", raising=False)


@pytest.mark.slow
def test_import_acco_reaches_the_integrations():
    """The accelerate snippet of docs/integrations.md writes acco.integrations.accelerate.prepare after `import acco` alone."""
    out = run_command([sys.executable, "-c", "import acco; print(acco.integrations.accelerate.prepare.__name__, "
                       "acco.integrations.hf.AccoTrainer.__name__)"], timeout=120)
    assert "prepare AccoTrainer" in out


def _split(model, **options):
    """The Muon + AdamW split as one AccoOptimizer (2-D weights of the blocks to Muon), in one process."""
    from acco import AccoOptimizer

    hidden = [p for n, p in model.named_parameters() if p.ndim == 2 and ".h." in n]
    others = [p for n, p in model.named_parameters() if not (p.ndim == 2 and ".h." in n)]
    return AccoOptimizer.from_optimizer([torch.optim.Muon(hidden, lr=0.02), torch.optim.AdamW(others, lr=1e-3)],
                                        **options)


@pytest.mark.slow
def test_acco_trainer_takes_a_split_built_by_the_user(tmp_path):
    """Check AccoTrainer(optimizers=(split, None)) trains with the Muon + AdamW split as it was built, and refuses
    one whose clipping or micro-batches disagree with TrainingArguments (Trainer no longer clips .grad, so its
    max_grad_norm would be dropped without a word), naming the setting to change."""
    sys.path.insert(0, HERE)
    from bytes_data import Bytes
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

    from acco.integrations.hf import AccoTrainer

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=64, n_embd=32, n_layer=1, n_head=2))
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, per_device_train_batch_size=2,
                             gradient_accumulation_steps=2, max_steps=3, report_to=[], save_strategy="no",
                             disable_tqdm=True)
    with pytest.raises(ValueError, match="has max_grad_norm=None but TrainingArguments\\(max_grad_norm\\)=1.0"):
        AccoTrainer(model=model, args=args, optimizers=(_split(model, microbatches_per_update=2), None))
    with pytest.raises(ValueError, match="microbatches_per_update=4 but TrainingArguments\\(gradient_accumulation_"
                                         "steps\\)=2: build it with microbatches_per_update=2"):
        AccoTrainer(model=model, args=args,
                    optimizers=(_split(model, microbatches_per_update=4, max_grad_norm=1.0), None))
    with pytest.raises(ValueError, match="mode='sync' but AccoTrainer\\(acco_mode\\)='acco'"):
        AccoTrainer(model=model, args=args, optimizers=(_split(model, mode="sync", max_grad_norm=1.0), None))
    with pytest.raises(ValueError, match="AccoTrainer\\(acco_kwargs\\) also got \\['nonfinite'\\].*pass them to the one"):
        AccoTrainer(model=model, args=args, acco_kwargs={"nonfinite": "raise"},
                    optimizers=(_split(model, microbatches_per_update=2, max_grad_norm=1.0), None))
    opt = _split(model, microbatches_per_update=2, max_grad_norm=1.0)
    trainer = AccoTrainer(model=model, args=args, train_dataset=Bytes(0, 16), optimizers=(opt, None))
    before = [p.detach().clone() for p in model.parameters()]
    trainer.train()
    assert trainer.acco_optimizer is opt and opt.finished and trainer.state.global_step == 3
    assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters()) if p.ndim == 2)
    with pytest.raises(RuntimeError, match="finished by the previous train\\(\\).*trainer.optimizer"):
        trainer.train()  # not silently replaced by one built from args.optim (the split would be lost)


_BN = torch.nn.BatchNorm1d(3)


@pytest.mark.parametrize("opt,kw,match", [
    (dict(mode="acco", max_grad_norm=None, accumulate_while_communicating=False, microbatches_per_update=None),
     dict(clip=1.0, clip_setting=None, microbatches_setting=None), None),  # manual optimisation: the module's say
    (dict(mode="acco", max_grad_norm=None, accumulate_while_communicating=False, microbatches_per_update=2),
     dict(clip=-1.0), None),  # a clipping <= 0 is none, as AccoTrainer's own path reads it
    (dict(mode="acco", max_grad_norm=None, accumulate_while_communicating=True, microbatches_per_update=None),
     dict(), "accumulate_while_communicating=True, which needs a step\\(\\) after every micro-batch.*"
             "microbatches_per_update=2"),
    (dict(mode="dpu", max_grad_norm=None, accumulate_while_communicating=False, microbatches_per_update=None),
     dict(), "mode='dpu' but M='acco'"),
    (dict(mode="acco", max_grad_norm=None, accumulate_while_communicating=False, microbatches_per_update=2),
     dict(model_buffers=torch.nn.BatchNorm1d(3).buffers()),  # running mean and var (float), batches seen (int)
     "the model has 2 floating-point buffer\\(s\\).*buffers=model.buffers\\(\\)"),
    (dict(mode="acco", max_grad_norm=None, accumulate_while_communicating=False, microbatches_per_update=2),
     dict(model_buffers=list(_BN.buffers()), held_buffers=list(_BN.buffers())), None),
])
@pytest.mark.slow
def test_given_optimizer_check(opt, kw, match):
    """Check the comparison of a user-built AccoOptimizer with a framework's settings, case by case."""
    from types import SimpleNamespace

    from acco.integrations._given import check_given_optimizer

    args = dict(mode="acco", mode_setting="M", clip=None, clip_setting="C", microbatches=2, microbatches_setting="A",
                options={}, options_setting="O")
    call = lambda: check_given_optimizer(SimpleNamespace(**opt), "W", **{**args, **kw})  # noqa: E731
    if match is None:
        call()
    else:
        with pytest.raises(ValueError, match=match):
            call()
