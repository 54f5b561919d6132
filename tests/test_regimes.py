"""examples/nanogpt/regimes.py (issue 77's regime matrix): what it decides to run, and what it reads off its records.

The tool's decisions are pure functions of the records: DDP's LR search (never ending at its edge; a longer T
starting around the shorter one's best), the runs left (the reach runs of decaying schedules for ACCO's methods
only), and the updates to DDP's loss under a decaying schedule (linear between the runs of T and 1.03 T).
The records here are made up, so each expectation is computed from them in the test.
"""

from __future__ import annotations

import math
import os

import pytest

from _examples import load_example

TOOL = os.path.join(os.path.dirname(__file__), "..", "examples", "nanogpt", "regimes.py")


@pytest.fixture(scope="module")
def R():
    return load_example(TOOL, "nanogpt_regimes")


def _ddp(regime, T, lr, val, n, seed=0):
    return {"method": "ddp", "regime": regime, "T": T, "lr": lr, "seed": seed, "length": n, "val_at_T": val}


def test_lr_search_goes_past_an_edge_until_the_best_is_inside(R):
    args = R.parse_args(["--T", "120", "--regimes", "wsd"])
    recs = [_ddp("wsd", 120, lr, v, 120) for lr, v in [(5e-4, 3.0), (1e-3, 2.5), (2e-3, 2.2), (4e-3, 2.1)]]
    assert R.lr_search(recs, "wsd", 120, args) == (None, [8e-3])  # the best is the largest LR run: double it
    recs.append(_ddp("wsd", 120, 8e-3, 2.05, 120))
    assert R.lr_search(recs, "wsd", 120, args) == (None, [1.6e-2])
    recs.append(_ddp("wsd", 120, 1.6e-2, 2.4, 120))
    assert R.lr_search(recs, "wsd", 120, args) == (8e-3, [])
    low = [_ddp("wsd", 120, lr, v, 120) for lr, v in [(5e-4, 2.0), (1e-3, 2.5), (2e-3, 2.6), (4e-3, 2.7)]]
    assert R.lr_search(low, "wsd", 120, args) == (None, [2.5e-4])  # the smallest: halve it


def test_a_longer_T_searches_around_the_shorter_ones_best_and_ignores_other_lengths(R):
    args = R.parse_args(["--T", "120", "500", "--regimes", "constant"])
    n120, n500 = R.length("constant", 120, args.stretch), R.length("constant", 500, args.stretch)
    assert (n120, n500) == (150, 625)  # a constant LR runs 1.25 T
    recs = [_ddp("constant", 120, lr, v, n120) for lr, v in [(5e-4, 3.0), (1e-3, 2.2), (2e-3, 2.4), (4e-3, 2.9)]]
    assert R.lr_search(recs, "constant", 500, args) == (None, [5e-4, 1e-3, 2e-3])
    recs += [_ddp("constant", 500, lr, v, n500) for lr, v in [(5e-4, 1.9), (1e-3, 1.7), (2e-3, 1.8)]]
    recs.append(_ddp("constant", 500, 4e-3, 0.1, 515))  # another length: not part of the search
    assert R.lr_search(recs, "constant", 500, args) == (1e-3, [])


def test_plan_runs_the_reach_runs_of_decaying_schedules_for_accos_methods_only(R):
    args = R.parse_args(["--T", "120", "--seeds", "0", "1"])
    recs = [_ddp(g, 120, lr, v, R.length(g, 120, args.stretch)) for g in R.REGIMES
            for lr, v in [(5e-4, 3.0), (1e-3, 2.2), (2e-3, 2.4), (4e-3, 2.9)]]
    todo = R.plan(args, recs)
    reach = [k for k in todo if k[5] == round(1.03 * 120)]
    assert {k[1] for k in reach} == {"cosine", "wsd"} and {k[0] for k in reach} == {"acco", "acco-paper"}
    assert len(reach) == 2 * 2 * 2  # regimes x methods x seeds
    assert todo.index(reach[0]) > max(todo.index(k) for k in todo if k[5] != round(1.03 * 120))
    cells = [k for k in todo if k[5] != round(1.03 * 120)]
    assert ("ddp", "constant", 120, 1e-3, 0, 150) not in cells  # recorded by the search
    assert ("ddp", "constant", 120, 1e-3, 1, 150) in cells and ("acco", "cosine", 120, 1e-3, 0, 120) in cells
    done = recs + [{"method": m, "regime": g, "T": T, "lr": lr, "seed": s, "length": n} for m, g, T, lr, s, n in todo]
    assert R.plan(args, done) == []


def test_four_rank_methods_keep_the_global_batch_and_are_held_to_ddp_on_four_ranks(R):
    """A 4-rank method (2 regions x 2 ranks) runs half the per-rank batch and is compared, seed by seed, with DDP on
    4 ranks at the LR DDP's search found on 2; it gets no reach run of its own baseline's kind."""
    assert R.ranks("regions-2x2-h30") == 4 and R.baseline("regions-2x2-h30") == "ddp-4" and R.baseline("acco") == "ddp"
    four, two = R.model_of("ddp-4"), R.model_of("ddp")
    assert four["world_size"] * four["batch_size"] == two["world_size"] * two["batch_size"]
    args = R.parse_args(["--T", "120", "--regimes", "constant", "--methods", "ddp-4", "regions-2x2-h30",
                         "--seeds", "0"])
    n = R.length("constant", 120, args.stretch)
    recs = [_ddp("constant", 120, lr, v, n) for lr, v in [(5e-4, 3.0), (1e-3, 2.2), (2e-3, 2.4), (4e-3, 2.9)]]
    assert R.plan(args, recs) == [("ddp-4", "constant", 120, 1e-3, 0, n), ("regions-2x2-h30", "constant", 120, 1e-3, 0, n)]
    val = [[0, 4.0], [120, 2.1], [150, 2.0]]
    recs += [{"method": "ddp-4", "regime": "constant", "T": 120, "lr": 1e-3, "seed": 0, "length": n, "val_at_T": 2.0,
              "val": val},
             {"method": "regions-2x2-h30", "regime": "constant", "T": 120, "lr": 1e-3, "seed": 0, "length": n,
              "val_at_T": 2.1, "val": val}]
    rows = {r["method"]: r for r in R.summarize(recs, args)}
    assert rows["regions-2x2-h30"]["gaps"] == [pytest.approx(2.1 / 2.0 - 1)]  # against ddp-4's 2.0, not ddp's 2.2
    assert rows["regions-2x2-h30"]["updates"] == [pytest.approx(150 / 120)]


def test_updates_to_ddps_loss_under_a_decaying_schedule(R):
    assert R.reach_ratio(2.00, None, 2.01, 1.03) == 1.0  # the T run is already below: "<= 1.00"
    assert R.reach_ratio(2.03, 2.02, 2.01, 1.03) is None  # the 1.03 T run is not either
    assert math.isnan(R.reach_ratio(2.03, None, 2.01, 1.03))  # not run yet: unknown, not beyond
    assert R.fmt_updates(math.nan, 1.03, True) == "…"
    at_T, at_reach, target = 2.04, 2.00, 2.01
    assert R.reach_ratio(at_T, at_reach, target, 1.03) == pytest.approx(1 + 0.03 * (at_T - target) / (at_T - at_reach))
    assert R.fmt_updates(1.0, 1.03, True) == "≤ 1.00" and R.fmt_updates(None, 1.03, True) == "> 1.03"


def test_updates_to_ddps_loss_at_a_constant_lr_reads_the_curve(R):
    val = [[0, 4.0], [10, 3.0], [20, 2.5], [30, 2.0]]
    assert R.updates_to(val, 2.75) == pytest.approx(15.0)
    assert R.updates_to(val, 1.5) is None


def test_overlap_imports_acco_from_the_tree_a_method_names(monkeypatch):
    """``acco:estimate-bf16@PATH`` runs the worker with ``PYTHONPATH=PATH`` and the variant's flags."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    import overlap

    seen = []

    def fake(worker_args, ranks, loopback, env, timeout):
        seen.append((list(worker_args), dict(env)))
        return {"method": worker_args[1], "tokens_per_s": 1.0}

    monkeypatch.setattr(overlap._launch, "run_worker", fake)
    args = overlap.parse_args(["--loopback", "--smoke", "--methods", "acco:estimate-bf16@/tmp/old/src,acco:estimate-bf16"])
    records = overlap.run_point(args, None, 0)
    (a_args, a_env), (b_args, b_env) = seen
    assert a_env == {"PYTHONPATH": os.path.abspath("/tmp/old/src")} and b_env == {}
    assert a_args == b_args and "--estimate-dtype" in a_args
    assert [r["label"] for r in records] == ["acco:estimate-bf16@/tmp/old/src", "acco:estimate-bf16"]
