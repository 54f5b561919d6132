"""The nanoGPT-style loop of examples/nanogpt/, before (DDP + AdamW) and after the port (AccoOptimizer).

2 gloo ranks under torchrun, gradient accumulation 4, LR from the iteration
number, clipping, evaluation and checkpoints every 20 iterations, 60 updates.
"""

from __future__ import annotations

import difflib
import json
import os
import sys

import pytest
import torch

from _dist import run_command

pytestmark = pytest.mark.slow  # make test-all only: the ported loops

HERE = os.path.dirname(__file__)
EXAMPLE = os.path.join(HERE, "..", "examples", "nanogpt")


def _run(script: str, out_dir, *overrides: str) -> list:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(EXAMPLE, script), f"--out_dir={out_dir}", *overrides]
    run_command(cmd, timeout=300)
    with open(os.path.join(out_dir, "log.json")) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    dirs = {k: tmp_path_factory.mktemp(k) / "out" for k in ("ddp", "acco", "resumed")}  # the scripts create out_dir
    logs = {
        "ddp": _run("train_ddp.py", dirs["ddp"]),
        "acco": _run("train_acco.py", dirs["acco"]),
    }
    first = _run("train_acco.py", dirs["resumed"], "--stop_at=40")  # "killed" after the checkpoint at 40
    logs["resumed"] = first[:-1] + _run("train_acco.py", dirs["resumed"], "--init_from=resume")
    finals = {k: torch.load(os.path.join(d, "final.pt"), weights_only=True) for k, d in dirs.items()}
    return logs, finals


def test_ported_loop_matches_ddp_adamw(runs):
    """Check the final held-out loss of the ported loop is within 0.5% of DDP + AdamW at equal tokens."""
    logs, _ = runs
    ddp, acco = logs["ddp"][-1], logs["acco"][-1]
    assert ddp["iter"] == acco["iter"] == 60
    assert logs["ddp"][0]["val_loss"] - ddp["val_loss"] > 1.0, "the model must actually train"
    gap = (acco["val_loss"] - ddp["val_loss"]) / ddp["val_loss"]
    print(f"held-out loss: DDP+AdamW {ddp['val_loss']:.5f}, acco {acco['val_loss']:.5f}, gap {gap:+.3%}")
    assert abs(gap) < 0.005, (ddp, acco)


def test_resumed_run_equals_uninterrupted(runs):
    """Check that stopping after the checkpoint at iteration 40 and resuming ends bit-identical."""
    logs, finals = runs
    assert [e["iter"] for e in logs["resumed"]] == [e["iter"] for e in logs["acco"]]
    assert [e["val_loss"] for e in logs["resumed"]] == [e["val_loss"] for e in logs["acco"]]
    for name, tensor in finals["acco"].items():
        assert torch.equal(tensor, finals["resumed"][name]), name


def test_readme_states_the_port_diff_size():
    """Check the figures for the lines a user changes (the porting guide, the README's results table) are the real
    diff."""
    a = open(os.path.join(EXAMPLE, "train_ddp.py")).read().splitlines()[5:]  # past the docstrings
    b = open(os.path.join(EXAMPLE, "train_acco.py")).read().splitlines()[5:]
    changed = [line for line in difflib.unified_diff(a, b, lineterm="", n=0)
               if line[:1] in "+-" and not line.startswith(("+++", "---"))]
    added, removed = sum(x.startswith("+") for x in changed), sum(x.startswith("-") for x in changed)
    readme = open(os.path.join(HERE, "..", "README.md")).read()
    porting = open(os.path.join(HERE, "..", "docs", "porting.md")).read()
    assert f"{added} lines added and {removed} removed" in porting, (added, removed)
    assert f"{added + removed} lines ({added} added, {removed} removed)" in readme, (added, removed)


def test_porting_guide_states_the_size_of_its_nanogpt_diff():
    """Check docs/porting.md's figures for its diff against karpathy/nanoGPT's train.py are that diff's."""
    import re

    porting = open(os.path.join(HERE, "..", "docs", "porting.md")).read()
    diff = re.search(r"```diff\n(.*?)```", porting, re.S).group(1).splitlines()
    added = [x for x in diff if x.startswith("+") and not x.startswith("+++")]
    removed = [x for x in diff if x.startswith("-") and not x.startswith("---")]
    quiet = [x for x in removed if not x[1:].strip() or x[1:].strip().startswith("#")]
    assert any("acco.AccoOptimizer.from_optimizer" in x for x in added)
    assert any("acco.checkpoint.gather" in x for x in added)
    stated = f"**{len(added)} lines added, {len(removed)} removed** (of the removed, {len(quiet) - 1} are comments and 1"
    assert stated in porting, (len(added), len(removed), len(quiet))
    readme = " ".join(open(os.path.join(HERE, "..", "README.md")).read().split())
    assert f"{len(added)} lines added and {len(removed)} removed, {len(quiet)} of them comments or blank" in readme
