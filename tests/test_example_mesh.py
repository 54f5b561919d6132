"""examples/mesh/train.py, the recipe of docs/models-larger-than-one-device.md, launched as a user launches it:
torchrun on 4 CPU ranks (gloo), tensor parallelism then FSDP2 inside a host, ACCO across hosts, checkpoints."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from _dist import run_command
import pytest

pytestmark = pytest.mark.slow  # make test-all only: the recipe's torchrun launches

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "examples" / "mesh" / "train.py"
SMALL = ["--dim", "32", "--layers", "2", "--heads", "2", "--seq-len", "32", "--batch", "4", "--microbatches", "2"]


def _torchrun(ranks: int, *args: str) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", str(TRAIN),
           *SMALL, *args]
    return run_command(cmd, timeout=300)


def _losses(out: str) -> dict:
    return {int(u): loss for u, loss in re.findall(r"^update (\d+) loss (\S+)$", out, re.M)}


def test_the_recipe_trains_checkpoints_and_resumes_bit_identically(tmp_path):
    """(dp, shard, tp) = (2, 1, 2): a job stopped after 3 updates (checkpoint written) and started again goes on
    with the very losses of a job that never stopped; the loss falls; the checkpoint loads on one host."""
    straight = _losses(_torchrun(4, "--updates", "6"))
    ckpt = tmp_path / "ckpt"
    first = _losses(_torchrun(4, "--updates", "6", "--ckpt", str(ckpt), "--save-every", "3", "--stop-after", "3"))
    out = _torchrun(4, "--updates", "6", "--ckpt", str(ckpt))
    assert f"resumed from {ckpt}/update_0000003 at update 3" in out, out
    resumed = _losses(out)
    assert sorted(straight) == list(range(1, 7)) and sorted(first) == [1, 2, 3] and sorted(resumed) == [4, 5, 6]
    assert {**first, **resumed} == straight  # the same digits (repr)
    assert float(straight[6]) < float(straight[1]) - 0.2, straight
    one_host = _torchrun(2, "--dp", "1", "--shard", "1", "--tp", "2", "--updates", "7", "--ckpt", str(ckpt))
    assert f"resumed from {ckpt}/update_0000006 at update 6" in one_host and "update 7 loss" in one_host, one_host


def test_the_recipe_runs_with_fsdp2_alone_inside_a_host():
    """(dp, shard, tp) = (2, 2, 1): FSDP2 over 2 ranks of each host, no tensor parallelism."""
    losses = _losses(_torchrun(4, "--dp", "2", "--shard", "2", "--tp", "1", "--updates", "4"))
    assert sorted(losses) == [1, 2, 3, 4] and float(losses[4]) < float(losses[1]), losses


def test_the_recipe_with_torchtitans_llama_plan_resumes_bit_identically(tmp_path):
    """--plan torchtitan (SequenceParallel norms, Rowwise embeddings into a sequence-sharded stream,
    PrepareModuleInput, loss parallel; FSDP2 on top) on (2, 1, 2): the loss falls, and a job stopped after 2
    updates and started again goes on with the very losses of one that never stopped; every rank exits 0."""
    plan = ["--plan", "torchtitan", "--updates", "4"]
    straight = _losses(_torchrun(4, *plan))
    ckpt = tmp_path / "ckpt"
    first = _losses(_torchrun(4, *plan, "--ckpt", str(ckpt), "--save-every", "2", "--stop-after", "2"))
    out = _torchrun(4, *plan, "--ckpt", str(ckpt))
    assert f"resumed from {ckpt}/update_0000002 at update 2" in out, out
    assert {**first, **_losses(out)} == straight and sorted(straight) == [1, 2, 3, 4]
    assert float(straight[4]) < float(straight[1]) - 0.1, straight
