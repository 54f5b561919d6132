"""examples/nanogpt/study.py's report, in process on records made here: which records reach the page's block.

A run of one method or one seed (the pages' "next runs" lines) reports as well as runs. The block must keep every
method of the configuration's records, not only the ones that command named; a record of another configuration,
or of a method the tool no longer knows, stays out.
"""

from __future__ import annotations

import json
import os

from _examples import load_example
from test_lr_study import _cells

HERE = os.path.join(os.path.dirname(__file__), "..", "examples", "nanogpt")
ITERS = 12


def _study():
    """The study's module by path (examples/gpt has a study.py too, which another test may have imported)."""
    return load_example(os.path.join(HERE, "study.py"), "nanogpt_study")


def _record(study, args, method: str, lr: float, seed: int, loss: float, config=None) -> dict:
    """A finished run as run_one writes it, with a final held-out loss chosen here."""
    train = [3.0 - 0.1 * i * (1 + 0.01 * seed) for i in range(ITERS)]
    return {"method": method, "lr": lr, "seed": seed, "config": config or study.config_of(args),
            "final_val_loss": loss, "val": [[0, 3.0], [ITERS, loss]], "train_loss": train,
            "estimate_gap": [0.01] * ITERS, "update_norm": [0.5] * ITERS,
            "wall_s": 10.0, "tokens_per_update": 1024}


def test_a_subset_run_reports_every_method_of_its_configuration(tmp_path):
    study = _study()
    records, doc = tmp_path / "records.jsonl", tmp_path / "page.md"
    doc.write_text("# Page\n")
    flags = ["--records", str(records), "--doc", str(doc), "--iters", str(ITERS), "--no-plots", "--report-only"]
    args = study.parse(flags + ["--methods", "ddp,dpu", "--seeds", "1", "--dpu-seeds", "1"])
    other = dict(study.config_of(args), n_embd=999)
    rows = [_record(study, args, "ddp", 1e-3, 0, 2.00), _record(study, args, "ddp", 1e-3, 1, 2.02),
            _record(study, args, "acco", 1e-3, 0, 2.04), _record(study, args, "acco", 1e-3, 1, 2.06),
            _record(study, args, "dpu", 1e-3, 1, 2.50),
            _record(study, args, "acco-estimate3", 1e-3, 0, 7.0),          # a method the tool dropped
            _record(study, args, "acco", 1e-3, 2, 8.0, config=other)]     # another configuration
    records.write_text("".join(json.dumps(r) + "\n" for r in rows))

    study.main(flags + ["--methods", "ddp,dpu", "--seeds", "1", "--dpu-seeds", "1"])

    cells = _cells(doc.read_text())
    assert cells == {(1e-3, "ddp"): 2.01, (1e-3, "acco"): 2.05, (1e-3, "dpu"): 2.5}
