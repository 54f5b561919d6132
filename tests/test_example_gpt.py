"""examples/gpt/train.py runs on 2 gloo ranks for every optimizer but dpu (a few steps)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from _dist import run_command
from extras import available

pytestmark = pytest.mark.slow  # make test-all only: the example's launches

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "examples" / "gpt" / "train.py"
TINY = ["--d-model", "32", "--layers", "2", "--heads", "2", "--seq-len", "32", "--batch", "4",
        "--steps", "4", "--eval-every", "2", "--log-every", "2", "--eval-batches", "2", "--no-progress"]


def _torchrun(tmp_path: Path, name: str, *args: str) -> dict:
    out = tmp_path / name
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(TRAIN),
           *TINY, "--out", str(out), *args]
    run_command(cmd, timeout=240)
    summary = json.loads((out / "summary.json").read_text())
    summary["metrics"] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return summary


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("corpus")
    for i in range(40):
        (d / f"f{i}.py").write_text("".join(f"def f{i}_{j}(x):\n    return x * {j} + {i}\n" for j in range(50)))
    return str(d)


# dpu is built like sync here (mode=--optimizer, the whole batch per hand-off) and commits one update late like
# acco: both are covered; the library's dpu is against the oracle (test_update_equivalence.py, test_equivalence.py)
@pytest.mark.parametrize("optimizer", ["acco", "sync", "torch-zero"])
def test_example_trains_with_each_optimizer(tmp_path, corpus, optimizer):
    """Check that each optimizer (dpu: see above) completes the requested updates with equal tokens and finite,
    falling losses."""
    s = _torchrun(tmp_path, optimizer, "--optimizer", optimizer, "--data", corpus)
    assert s["updates"] == 4 and s["world"] == 2
    assert s["tokens"] == 4 * 2 * 4 * 32  # updates x ranks x sequences per rank x sequence length
    evals = [m["eval_loss"] for m in s["metrics"] if m["eval_loss"] is not None]
    assert all(math.isfinite(e) for e in evals) and evals[-1] < evals[0]
    assert {m["step"] for m in s["metrics"]} >= {0, 2, 4}


def test_example_default_corpus_and_slow_rank_accumulation(tmp_path):
    """Check the stdlib corpus default and that a slowed rank makes the other accumulate micro-batches."""
    s = _torchrun(tmp_path, "slow", "--optimizer", "acco", "--slow-rank", "1", "--slow-factor", "3",
                  "--max-microbatches", "0")
    assert s["updates"] == 4
    fast, slow = s["mean_microbatches_per_round"]
    assert fast > slow, s["mean_microbatches_per_round"]  # the fast rank accumulated extra micro-batches


@pytest.mark.skipif(not available("transformers", "hf"), reason="needs transformers (pip install -e '.[hf]')")
def test_example_trains_hugging_face_gpt_neo(tmp_path, corpus):
    """Check the drop-in claim on a model we did not write: HF GPTNeoForCausalLM from a config."""
    s = _torchrun(tmp_path, "hf", "--optimizer", "acco", "--model", "hf-gpt-neo", "--data", corpus)
    assert s["updates"] == 4 and math.isfinite(s["final_eval_loss"])


def test_resume_keeps_the_runs_time_and_says_what_another_number_of_ranks_does(tmp_path, corpus):
    """Check a run stopped after its checkpoint at update 4 and resumed: metrics.jsonl's time goes on from the
    checkpoint's (not from 0), the summary's tokens/s is over the whole run's training time (and this attempt's
    is given apart); a resume of that 2-rank checkpoint on 1 rank says, in words, that the global batch halved
    and names --global-microbatches."""
    ckpt = str(tmp_path / "ck")
    args = ("--optimizer", "acco", "--data", corpus, "--steps", "8", "--ckpt-dir", ckpt, "--ckpt-every", "4",
            "--resume", "auto")
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(TRAIN),
           *TINY[:-3], "--out", str(out), *args]
    first = run_command(cmd + ["--stop-at", "4"], timeout=240)  # "killed" right after the checkpoint of update 4
    # every rank saves rank 0's clock: one rank's copy is kept, and another rank's could be behind metrics.jsonl's
    assert "differ across ranks" not in first, first[-3000:]
    before = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    run_command(cmd, timeout=240)
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    resumed = metrics[len(before):]
    assert resumed[0]["step"] == 4 and resumed[0]["time"] >= before[-1]["time"] > 0, (before, resumed)
    assert [m["time"] for m in resumed] == sorted(m["time"] for m in resumed)
    assert summary["time"] >= resumed[0]["time"] and summary["this_attempt"]["from_update"] == 4
    # "time" is rounded to the millisecond: on a fast machine the run takes well under a second
    assert summary["tokens_per_s"] == pytest.approx(summary["tokens"] / summary["time"],
                                                    rel=max(1e-3, 6e-4 / summary["time"]))

    one = run_command([sys.executable, str(TRAIN), *TINY[:-3], "--out", str(tmp_path / "one"), *args,
                       "--resume", ckpt + "/update_0000004"], timeout=240)
    assert "written by 2 rank(s) on 1 rank(s)" in one and "0.5x" in one and "--global-microbatches 2" in one, one[-2000:]
