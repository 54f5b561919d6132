"""A rank killed mid-training under torchrun --max-restarts=1: restart, resume, same weights."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from _dist import run_command

pytestmark = pytest.mark.slow  # make test-all only: a killed rank restarted by torchrun

SCRIPT = Path(__file__).resolve().parent / "resume_script.py"


def _torchrun(out: Path, kill_at: int) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "--max-restarts=1", "--monitor-interval=0.5", str(SCRIPT), str(out), "20", "4", str(kill_at)]
    run_command(cmd, timeout=300)
    return torch.load(out / "final.pt", weights_only=True)


def test_killed_rank_restarts_resumes_and_ends_with_the_same_weights(tmp_path):
    """Check that kill -> torchrun restart -> resume from the last checkpoint equals a run never interrupted."""
    clean = _torchrun(tmp_path / "clean", kill_at=-1)
    resumed = _torchrun(tmp_path / "killed", kill_at=11)
    assert clean["attempt"] == 0 and clean["start"] == 0
    assert resumed["attempt"] == 1 and resumed["start"] == 8  # restarted, from the checkpoint after 8 micro-batches
    assert ((resumed["w"] - clean["w"]).abs().max() / clean["w"].abs().max()).item() < 1e-6
