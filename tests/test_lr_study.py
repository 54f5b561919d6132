"""examples/nanogpt/study.py, the learning-rate study of docs/studies/lr-study.md: a 2-LR, 1-seed smoke.

The study runs the nanoGPT-style loops (DDP + AdamW and AccoOptimizer) under torchrun, appends one record
per run, and writes its tables from the records alone. The test checks the numbers in the report against the
records, then changes a record and checks the report follows it.
"""

from __future__ import annotations

import json
import os
import re
import sys

from _dist import run_command
from _examples import load_example
import pytest

pytestmark = pytest.mark.slow  # make test-all only: the study's smoke

STUDY = os.path.join(os.path.dirname(__file__), "..", "examples", "nanogpt", "study.py")
TINY = ["--methods", "ddp,acco", "--lrs", "1e-3,3e-3", "--seeds", "0", "--iters", "12", "--warmup", "2",
        "--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--block-size", "32", "--batch-size", "4",
        "--eval-interval", "6", "--eval-iters", "2", "--no-plots"]


def _cells(doc: str) -> dict:
    """(lr, column) -> mean final loss, from the report's first table."""
    lines = doc.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("| peak LR |"))
    columns = [c.strip() for c in lines[head].strip("|").split("|")][1:]
    out = {}
    for line in lines[head + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        for name, cell in zip(columns, cells[1:]):
            out[float(cells[0]), name] = float(re.match(r"([0-9.]+) ±", cell).group(1))
    return out


def test_study_smoke_reports_what_its_records_hold(tmp_path):
    """Two LRs, one seed, DDP and acco: four records, and every loss in the report is a record's."""
    records, doc = tmp_path / "records.jsonl", tmp_path / "convergence.md"
    doc.write_text("# Convergence\n\nkept above\n")
    run_command([sys.executable, STUDY, "--records", str(records), "--doc", str(doc), *TINY], timeout=600)
    rows = [json.loads(line) for line in records.read_text().splitlines()]
    assert sorted((r["method"], r["lr"]) for r in rows) == [("acco", 1e-3), ("acco", 3e-3), ("ddp", 1e-3), ("ddp", 3e-3)]
    for r in rows:
        assert len(r["train_loss"]) == 12 and r["val"][-1] == [12, r["final_val_loss"]]
        assert r["tokens_per_update"] == 2 * 4 * 4 * 32
    assert all(len(r["estimate_gap"]) == 12 for r in rows if r["method"] == "acco")
    text = doc.read_text()
    assert text.startswith("# Convergence\n\nkept above") and "lr-study:begin" in text
    cells = _cells(text)
    assert cells == {(r["lr"], r["method"]): round(r["final_val_loss"], 4) for r in rows}
    best = min((r for r in rows if r["method"] == "ddp"), key=lambda r: r["final_val_loss"])
    assert f"DDP's best LR: {best['lr']:g} (loss {best['final_val_loss']:.4f})" in text

    # The study resumes: nothing runs again. The report follows the records: change one, report again.
    edited = [dict(r, final_val_loss=9.8765) if (r["method"], r["lr"]) == ("acco", 1e-3) else r for r in rows]
    records.write_text("".join(json.dumps(r) + "\n" for r in edited))
    out = run_command([sys.executable, STUDY, "--records", str(records), "--doc", str(doc), *TINY], timeout=120)
    assert "0 to run" in out
    assert _cells(doc.read_text())[1e-3, "acco"] == 9.8765
    assert doc.read_text().count("lr-study:begin") == 1


def test_the_plan_runs_each_method_where_the_study_needs_it(tmp_path):
    """The default plan: DDP and acco at every LR and seed, DPU at seed 0, the remedy at --remedy-lrs only."""
    study = load_example(STUDY, "nanogpt_study")
    args = study.parse(["--records", str(tmp_path / "none.jsonl")])
    runs = study.plan(args)
    by_method = {m: sorted((lr, seed) for mm, lr, seed in runs if mm == m) for m in args.methods}
    lrs, seeds = [1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2], [0, 1, 2]
    assert by_method["ddp"] == by_method["acco"] == [(lr, s) for lr in lrs for s in seeds]
    assert by_method["dpu"] == [(lr, 0) for lr in lrs]
    assert by_method["acco-sync20"] == [(lr, s) for lr in (2e-3, 4e-3) for s in seeds]
    assert len(runs) == len(set(runs)) == 41
    assert [m for m, _, _ in runs][-5:] == ["dpu"] * 5  # the uncompensated reference runs last
