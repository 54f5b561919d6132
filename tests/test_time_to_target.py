"""examples/nanogpt/time_to_target.py: a one-seed smoke of the real loops, and the report against its records.

The smoke runs DDP's trunk and branch and ACCO's trunk and search under torchrun with a tiny model. The test
then computes every method's updates to target from the records itself (the interpolation between the two
branches that bracket DDP's loss) and checks the report's row, and the composed time against a speed file.
Editing a record changes the report: its numbers come from the records, not from the run that wrote them.
"""

from __future__ import annotations

import json
import os
import re
import sys

import pytest

from _dist import run_command
from _examples import load_example

pytestmark = pytest.mark.slow  # make test-all only: the study's smoke

HERE = os.path.dirname(__file__)
TOOL = os.path.join(HERE, "..", "examples", "nanogpt", "time_to_target.py")
TINY = ["--methods", "ddp,acco", "--seeds", "0", "--warmups", "2", "--lengths", "12", "--floors", "0",
        "--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--block-size", "32", "--batch-size", "4",
        "--accum", "2", "--eval-interval", "6", "--eval-iters", "2", "--no-plots", "--lr", "0.002", "--ddp-lrs", "",
        "--acco-lrs", ""]


def _tool():
    """The study's module, by path: ``benchmarks/time_to_target.py`` has the same name and may be imported first."""
    return load_example(TOOL, "nanogpt_time_to_target")


def expected_ratio(branches: dict, target: float, t_ddp: int):
    """Updates to target over ``t_ddp``, from {T: fully decayed loss}: linear between the bracketing lengths."""
    ts = sorted(branches)
    for a, b in zip(ts, ts[1:]):
        la, lb = branches[a], branches[b]
        if la > target >= lb:
            return (a + (b - a) * (la - target) / (la - lb)) / t_ddp
    return None


def _row(doc: str, method: str, t: int) -> list:
    """The updates-to-target row of ``method`` at the LR 0.002 (its LR cell left out: method, warm-up, T, ...)."""
    line = next(x for x in doc.splitlines() if x.startswith(f"| {method} | 0.002 | 2 | {t} | 0 | s0"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    return cells[:1] + cells[2:]


def _speed(path, ddp_tps, acco_tps):
    path.write_text("".join(json.dumps({"label": lab, "method": lab, "repeat": rep, "rate_mbit": 67.0,
                                        "tokens_per_s": tps}) + "\n"
                            for rep, (d, a) in enumerate(zip(ddp_tps, acco_tps)) for lab, tps in (("ddp", d), ("acco", a))))


def test_smoke_runs_the_search_and_reports_what_its_records_hold(tmp_path):
    records, doc, speed = tmp_path / "ttt.jsonl", tmp_path / "convergence.md", tmp_path / "speed.jsonl"
    doc.write_text("# Convergence\n\nkept above\n")
    _speed(speed, [100.0, 100.0, 90.0], [125.0, 110.0, 120.0])  # DDP/ACCO per repeat: 0.8, 0.909, 0.75
    common = ["--records", str(records), "--doc", str(doc), "--speed", str(speed), "--workdir", str(tmp_path / "w")]
    run_command([sys.executable, TOOL, *common, *TINY], timeout=900)
    rs = [json.loads(line) for line in records.read_text().splitlines()]
    kinds = [(r["kind"], r["method"]) for r in rs]
    assert kinds[:3] == [("trunk", "ddp"), ("branch", "ddp"), ("trunk", "acco")], kinds
    ddp = next(r for r in rs if r["kind"] == "branch" and r["method"] == "ddp")
    assert (ddp["T"], ddp["start"], ddp["val"][-1]) == (12, 10, [12, ddp["final_val_loss"]])
    acco = {r["T"]: r["final_val_loss"] for r in rs if r["kind"] == "branch" and r["method"] == "acco"}
    assert 12 in acco and set(acco) <= {11, 12, 13, 14, 16, 18}, acco
    for r in rs:
        if r["kind"] == "branch":  # a branch resumes the trunk's checkpoint at 80% and cools down to its T
            assert r["start"] == round(0.8 * r["T"]) and len(r["train_loss"]) == r["T"] - r["start"]
    ratio = expected_ratio(acco, ddp["final_val_loss"], 12)
    text = doc.read_text()
    assert text.startswith("# Convergence\n\nkept above") and "time-to-target:begin" in text
    row = _row(text, "ACCO", 12)
    if ratio is None:  # the target lies outside the lengths searched: a bound, and the search went to the end
        assert re.fullmatch(r"s0 [<>] \d\.\d{3}", row[4]), row
        assert set(acco) in ({11, 12}, {12, 13, 14, 16, 18}), acco
    else:
        assert row[4] == f"s0 {ratio:.3f}" and row[5] == f"{ratio:.3f} (1 seed)", row
        composed = next(x for x in text.splitlines() if x.startswith("| ACCO | 0.002 | 2 | 12 | 0 | 0.800 [0.750–0.909]"))
        assert f"s0 {ratio * 0.8:.3f}" in composed, composed
    assert f"{(acco[12] - ddp['final_val_loss']) / ddp['final_val_loss']:+.2%}" == row[7]

    # Nothing runs again; the report follows edited records: ACCO's branches made to bracket DDP's target.
    target = ddp["final_val_loss"]
    edited = [dict(r, final_val_loss=target + 0.3) if r["kind"] == "branch" and r["method"] == "acco" and r["T"] == 12
              else dict(r, final_val_loss=target - 0.1) if r["kind"] == "branch" and r["method"] == "acco" else r
              for r in rs]
    if not any(r["kind"] == "branch" and r["method"] == "acco" and r["T"] == 13 for r in rs):
        extra = next(r for r in rs if r["kind"] == "branch" and r["method"] == "acco")
        edited.append(dict(extra, T=13, start=10, final_val_loss=target - 0.1))
    records.write_text("".join(json.dumps(r) + "\n" for r in edited))
    out = run_command([sys.executable, TOOL, *common, *TINY, "--report-only"], timeout=120)
    assert "report:" in out
    row = _row(doc.read_text(), "ACCO", 12)
    assert row[4] == f"s0 {(12 + 0.3 / 0.4) / 12:.3f}", row  # 12 + (13 - 12) * 0.3 / 0.4 updates


@pytest.mark.parametrize("losses,expect,mean", [({11: 2.2, 12: 2.1, 13: 2.05, 14: 2.01, 16: 2.005, 18: 2.001},
                                                 "s0 > 1.500", "≥ 1.500 (1 seed)"),
                                                ({11: 1.9, 12: 1.95}, "s0 < 0.917", "≤ 0.917 (1 seed)"),
                                                ({12: 2.1, 13: 1.9}, "s0 1.042", "1.042 (1 seed)"),
                                                ({12: 2.1, 13: 2.05, 14: 2.01, 16: 1.99}, "s0 1.250", "1.250 (1 seed)"),
                                                # a search a session left unfinished: what the lengths run say so far
                                                ({12: 2.1, 13: 2.05, 14: 2.01}, "s0 > 1.167 (searching)",
                                                 "≥ 1.167 (1 seed)"),
                                                ({12: 1.95}, "s0 < 1.000 (searching)", "≤ 1.000 (1 seed)")])
def test_search_outcomes_in_the_report(tmp_path, losses, expect, mean):
    """Beyond the lengths searched the report says so with a bound, and the mean is a bound; inside, it
    interpolates."""
    ttt = _tool()
    args = ttt.parse([*TINY, "--records", str(tmp_path / "r.jsonl"), "--doc", str(tmp_path / "d.md"),
                      "--speed", str(tmp_path / "none.jsonl")])
    config = ttt.config_of(args)
    base = {"lr": 2e-3, "warmup": 2, "seed": 0, "config": config, "floor": 0.0, "val": [], "train_loss": [],
            "wall_s": 1.0}
    rs = [dict(base, kind="branch", method="ddp", T=12, start=10, final_val_loss=2.0)]
    rs += [dict(base, kind="branch", method="acco", T=t, start=round(0.8 * t), final_val_loss=v) for t, v in losses.items()]
    s = ttt.summarize(rs, args)
    text = ttt.report_markdown(s, args, {})
    assert _row(text, "ACCO", 12)[4] == expect and _row(text, "ACCO", 12)[5] == mean


def test_cap_first_asks_for_the_longest_length_after_ddps_and_ends_there_if_it_misses():
    """--cap-first: above the target at DDP's length, the longest length (18 of 12) comes next, and the trunk runs
    to its start at once; a longest length above the target ends the search with the full walk's bound, whether or
    not the flag ran it; one below leaves the walk as it was (13, then 14, ...). Without the flag nothing moves."""
    ttt = _tool()
    state = lambda losses, cap_first: ttt.search_state(losses, 2.0, 12, 0.0, cap_first)  # noqa: E731
    assert state({(12, 0.0): 2.1}, False) == (13, ttt.beyond(">", 1.0, searching=True))
    assert state({(12, 0.0): 2.1}, True) == (18, ttt.beyond(">", 1.0, searching=True))
    assert state({(12, 0.0): 1.9}, True) == (11, ttt.beyond("<", 1.0, searching=True))  # below: as before
    for flag in (False, True):  # the cap missed: done, as the walk through 13, 14 and 16 would end
        assert state({(12, 0.0): 2.1, (18, 0.0): 2.01}, flag) == (None, ttt.beyond(">", 18 / 12))
    assert state({(12, 0.0): 2.1, (18, 0.0): 1.99}, True)[0] == 13  # the cap reached it: the walk goes on
    for flag in (False, True):  # a length between below the target (losses that do not fall): the walk's bracket
        t, done = state({(12, 0.0): 2.1, (13, 0.0): 1.95, (18, 0.0): 2.05}, flag)
        assert (t, done["bracket"]) == (None, [12, 13])
    t, done = state({(12, 0.0): 2.1, (13, 0.0): 2.05, (14, 0.0): 2.02, (16, 0.0): 2.01, (18, 0.0): 1.99}, True)
    assert (t, done["bracket"], done["updates"]) == (None, [16, 18], pytest.approx(17.0))  # 16 + 2 * 0.01 / 0.02
    args = ttt.parse([*TINY])
    line = next(x for x in ttt.lines(args) if x["method"] == "acco")
    capped = ttt.parse([*TINY, "--cap-first"])
    assert (ttt.trunk_length(args, line), ttt.trunk_length(capped, line)) == (11, 14)  # 14: 18's start
    records = [{"kind": "branch", "method": "ddp", "lr": 2e-3, "warmup": 2, "seed": 0, "config": ttt.config_of(args),
                "T": 12, "floor": 0.0, "final_val_loss": 2.0},
               {"kind": "trunk", "method": "acco", "lr": 2e-3, "warmup": 2, "seed": 0, "config": ttt.config_of(args)},
               {"kind": "branch", "method": "acco", "lr": 2e-3, "warmup": 2, "seed": 0, "config": ttt.config_of(args),
                "T": 12, "floor": 0.0, "final_val_loss": 2.1}]
    records.insert(1, {**records[1], "method": "ddp"})
    assert (ttt.next_job(args, records)["T"], ttt.next_job(capped, records)["T"]) == (13, 18)


def test_mean_over_seeds_with_a_bound():
    """Check the mean of an exact seed and a bounded one is a bound on that side, and both sides give none."""
    ttt = _tool()
    exact, below, above = {"ratio": 1.1, "updates": 550}, ttt.beyond("<", 11 / 12), ttt.beyond(">", 1.5)
    assert ttt.mean_bounded([exact, below]) == (pytest.approx((1.1 + 11 / 12) / 2), "<")
    assert ttt.mean_cell([exact, below]) == f"≤ {(1.1 + 11 / 12) / 2:.3f}"
    assert ttt.mean_cell([exact, above], fmt=lambda x: f"{x * 500 - 500:+.0f}") == f"≥ {((1.1 + 18 / 12) / 2) * 500 - 500:+.0f}"
    assert ttt.mean_cell([below, above]) == "—" and ttt.mean_cell([exact]) == "1.100"


def test_the_ddp_loops_chain_follows_the_schedule_after_a_resume(monkeypatch):
    """Check a resumed DDP branch cools down: the rate the loop sets through Chain.param_groups reaches the torch
    optimizers after load_state_dict (which replaces their group dicts; a list of groups taken at construction
    kept the checkpoint's peak rate for the whole branch), for AdamW alone and the Muon + AdamW split."""
    import torch

    monkeypatch.syspath_prepend(os.path.join(HERE, "..", "examples", "nanogpt"))
    before = sys.modules.pop("optim", None)  # this folder's optim, and not left behind for other tests
    try:
        from optim import Chain
    finally:
        sys.modules.pop("optim", None)
        if before is not None:
            sys.modules["optim"] = before

    for two in (False, True):
        params = [torch.nn.Parameter(torch.ones(3, 3)), torch.nn.Parameter(torch.ones(3))]
        optimizers = [torch.optim.AdamW(params[1:], lr=2e-3)]
        if two:
            optimizers.insert(0, torch.optim.Muon(params[:1], lr=2e-3))
        chain = Chain(optimizers)
        saved = chain.state_dict()
        chain.load_state_dict(saved)  # a branch resumed from the trunk's checkpoint
        for g in chain.param_groups:
            g["lr"] = 1e-4  # the cool-down's rate
        assert [g["lr"] for o in optimizers for g in o.param_groups] == [1e-4] * len(optimizers)


def test_the_report_says_where_the_trunks_gap_is_made(tmp_path):
    """The trunks' gap over update ranges (warm-up 2: updates 0, 1, 2–3, 4–7): train, each seed's gap of range
    means against DDP's trunk of the same seed; held-out, the gap of the evaluation after the range; averaged
    over seeds. A trunk too short leaves its ranges out, a seed without DDP's trunk is left out."""
    ttt = _tool()
    args = ttt.parse([*TINY, "--records", str(tmp_path / "r.jsonl"), "--doc", str(tmp_path / "d.md"),
                      "--speed", str(tmp_path / "none.jsonl")])
    config = ttt.config_of(args)
    base = {"kind": "trunk", "lr": 2e-3, "warmup": 2, "config": config, "floor": None, "wall_s": 1.0,
            "final_val_loss": 1.0}
    ddp_val = [[0, 4.0], [2, 3.0], [4, 2.5], [8, 2.0]]
    rs = [dict(base, method="ddp", seed=s, train_loss=[2.0] * 8, val=ddp_val) for s in (0, 1)]
    rs += [dict(base, method="acco", seed=0, train_loss=[2.0, 2.2, 2.0, 2.4, 2.0, 2.0, 2.0, 2.8],
                val=[[0, 4.0], [2, 3.3], [4, 2.6], [8, 2.1]]),
           dict(base, method="acco", seed=1, train_loss=[2.0, 2.1, 2.2, 2.2, 2.1],  # stops at update 4
                val=[[0, 4.0], [2, 3.15], [4, 2.75]]),
           dict(base, method="acco", seed=2, train_loss=[3.0] * 8, val=[[8, 9.0]])]  # no DDP trunk: left out
    text = ttt.report_markdown(ttt.summarize(rs, args), args, {})
    assert "| method | updates 0–0 | updates 1–1 | updates 2–3 | updates 4–7 |" in text

    def cells(prefix):
        line = next(x for x in text.splitlines() if x.startswith(prefix))
        return [c.strip() for c in line.strip("|").split("|")][1:]

    assert cells("| ACCO, train |") == [
        "+0.00% [+0.00%–+0.00%] (2)",     # update 0: equal
        "+7.50% [+5.00%–+10.00%] (2)",    # update 1: +10% and +5%
        "+10.00% [+10.00%–+10.00%] (2)",  # updates 2–3: (2.0+2.4)/2 and (2.2+2.2)/2 against 2.0
        "+10.00% [+10.00%–+10.00%] (1)"]  # updates 4–7: seed 0 only, 8.8/4 against 2.0
    assert cells("| ACCO, held-out at the end |") == [
        "—", "+7.50% [+5.00%–+10.00%] (2)",  # no evaluation after update 0; after update 1: 3.3 and 3.15 vs 3.0
        "+7.00% [+4.00%–+10.00%] (2)",       # after update 3: 2.6 and 2.75 against 2.5
        "+5.00% [+5.00%–+5.00%] (1)"]        # after update 7: 2.1 against 2.0


def test_gap_ranges_halve_the_warmup_then_double_to_the_trunks_end():
    ttt = _tool()
    assert ttt.gap_ranges(100, 1200) == [(0, 50), (50, 100), (100, 200), (200, 400), (400, 800), (800, 1200)]
    assert ttt.gap_ranges(100, 400) == [(0, 50), (50, 100), (100, 200), (200, 400)]
    assert ttt.gap_ranges(1, 5) == [(0, 1), (1, 2), (2, 4), (4, 5)]
    assert ttt.gap_ranges(20, 10) == [(0, 10)]


def _composed(tmp_path, acco_losses: dict, speed: dict) -> str:
    """The report of one seed at LR 0.002: DDP's branch of 12 updates ending at 2.0, and ACCO's branches
    ``{T: loss}``, composed with ``speed``."""
    ttt = _tool()
    args = ttt.parse([*TINY, "--records", str(tmp_path / "r.jsonl"), "--doc", str(tmp_path / "d.md"),
                      "--speed", str(tmp_path / "none.jsonl")])
    base = {"lr": 2e-3, "warmup": 2, "seed": 0, "config": ttt.config_of(args), "floor": 0.0, "val": [],
            "train_loss": [], "wall_s": 1.0}
    rs = [dict(base, kind="branch", method="ddp", T=12, start=10, final_val_loss=2.0)]
    rs += [dict(base, kind="branch", method="acco", T=t, start=round(0.8 * t), final_val_loss=v)
           for t, v in acco_losses.items()]
    return ttt.report_markdown(ttt.summarize(rs, args), args, speed)


@pytest.mark.parametrize("losses,asks_time", [({12: 2.1, 13: 1.9}, "0.720"),                 # 12.5 / 12 updates
                                              ({11: 2.2, 12: 2.1, 13: 2.05, 14: 2.01, 16: 2.005, 18: 2.001},
                                               "≤ 0.500")])  # ≥ 18 / 12
def test_the_report_says_what_the_time_goal_asks_of_each_side(tmp_path, losses, asks_time):
    """The composed-time table's last two columns: the time per update that 0.75x DDP's time to target would
    need at the measured mean updates ratio (0.75 / ratio: a bound where the ratio is one, on the other side),
    and the updates ratio it would need at the measured median time per update (0.75 / 0.85)."""
    speed = {"ddp": [{"time_per_update": 1.0, "min": 1.0, "max": 1.0, "repeats": 3, "rate_mbit": 67.0}],
             "acco": [{"time_per_update": 0.85, "min": 0.8, "max": 0.9, "repeats": 3, "rate_mbit": 67.0}]}
    text = _composed(tmp_path, losses, speed)
    assert "| 0.75x asks: time per update | 0.75x asks: updates ratio |" in text
    row = next(x for x in text.splitlines() if x.startswith("| ACCO | 0.002 | 2 | 12 | 0 | 0.850 [0.800–0.900]"))
    assert [c.strip() for c in row.strip("|").split("|")][-2:] == [asks_time, "0.882"], row


def test_speeds_from_several_files_compare_each_method_with_ddp_in_its_own_file(tmp_path):
    """Each file is one benchmark run (its own link, machine and DDP): a method's time per update is its
    per-repeat ratio to that file's DDP; a method in two files has an entry for each, in the files' order; an
    absent file is skipped."""
    ttt = _tool()
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    _speed(first, [100.0, 100.0, 90.0], [125.0, 110.0, 120.0])  # acco: 0.8, 0.909, 0.75
    rows = [("ddp", 50.0, 0), ("acco", 100.0, 0), ("acco-bf16", 62.5, 0), ("ddp", 40.0, 1), ("acco-bf16", 50.0, 1)]
    second.write_text("".join(json.dumps({"method": m, "repeat": rep, "rate_mbit": 37.0, "tokens_per_s": tps}) + "\n"
                              for m, tps, rep in rows))
    sp = ttt.speeds([tmp_path / "absent.jsonl", first, second])
    assert [(e["time_per_update"], e["repeats"], e["file"], e["rate_mbit"]) for e in sp["acco"]] == [
        (0.8, 3, "a.jsonl", 67.0), (0.5, 1, "b.jsonl", 37.0)]
    assert [(e["time_per_update"], e["min"], e["rate_mbit"]) for e in sp["acco-bf16"]] == [(0.8, 0.8, 37.0)]
    assert [e["file"] for e in sp["ddp"]] == ["a.jsonl", "b.jsonl"] and "acco-bf16-h3" not in sp


def test_the_composed_table_has_a_row_per_link_a_method_was_timed_at(tmp_path):
    """A method timed in two benchmark runs (two links) gets a composed row for each, each with that run's time
    per update: the report never picks one link's figure for a method and another's for its rival."""
    speed = {"acco": [{"time_per_update": 0.8, "min": 0.8, "max": 0.8, "repeats": 3, "rate_mbit": 67.0},
                      {"time_per_update": 0.7, "min": 0.7, "max": 0.7, "repeats": 3, "rate_mbit": 37.0}]}
    text = _composed(tmp_path, {11: 2.02, 12: 2.01, 13: 1.99}, speed)
    rows = [x for x in text.splitlines() if x.startswith("| ACCO | 0.002 | 2 | 12 | 0 | 0.")]
    assert [r.split("|")[6].strip() for r in rows] == ["0.800 [0.800–0.800] (67 Mbit/s, 3 repeats)",
                                                       "0.700 [0.700–0.700] (37 Mbit/s, 3 repeats)"], rows
    # 12.5 updates of DDP's 12: ratio 1.0417, times each link's time per update
    assert [r.split("|")[8].strip() for r in rows] == ["0.833", "0.729"], rows


def test_a_trunk_run_again_for_a_branch_is_recorded(tmp_path, monkeypatch):
    """A branch whose trunk checkpoint is gone runs the trunk again; that run is recorded too (it may be longer
    than the recorded one, whose gaps the report then reads), before the branch's own record."""
    ttt = _tool()
    records = tmp_path / "r.jsonl"
    args = ttt.parse([*TINY, "--records", str(records), "--workdir", str(tmp_path / "w")])
    line = next(x for x in ttt.lines(args) if x["method"] == "acco")
    monkeypatch.setattr(ttt, "run_trunk", lambda a, ln, length: {"kind": "trunk", "method": ln["method"], "T": length})
    launched = []
    monkeypatch.setattr(ttt, "launch", lambda *a: launched.append(a) or ([{"iter": 12, "val_loss": 2.0}], [], None, 1.0))
    branch = ttt.run_branch(args, {"kind": "branch", "line": line, "T": 12, "floor": 0.0}, tmp_path)
    assert ttt.trunk_length(args, line) == 11  # the start of the longest first branch, 14 (of DDP's 12)
    assert [json.loads(x) for x in records.read_text().splitlines()] == [{"kind": "trunk", "method": "acco", "T": 11}]
    assert (branch["kind"], branch["T"], branch["start"], len(launched)) == ("branch", 12, 10, 1)
    # a search beyond the first lengths (18 of 12 starts its cool-down at 14): the trunk runs on to that start
    branch = ttt.run_branch(args, {"kind": "branch", "line": line, "T": 18, "floor": 0.0}, tmp_path)
    assert json.loads(records.read_text().splitlines()[-1]) == {"kind": "trunk", "method": "acco", "T": 14}
    assert (branch["T"], branch["start"], f"--resume_from={(ttt.trunk_dir(args, line) / 'ckpt-14.pt').resolve()}"
            in launched[-1][2]) == (18, 14, True)


def test_a_trunk_goes_on_from_the_latest_checkpoint_a_recorded_shorter_trunk_kept(tmp_path, monkeypatch):
    """A longer trunk resumes from the latest kept checkpoint that a recorded trunk of the same line covers, and
    its record holds the whole trunk (the earlier record's updates, then this run's); without such a checkpoint
    it runs from scratch in an emptied folder."""
    ttt = _tool()
    records = tmp_path / "r.jsonl"
    args = ttt.parse([*TINY, "--lengths", "12,18", "--records", str(records), "--workdir", str(tmp_path / "w")])
    line = next(x for x in ttt.lines(args) if x["method"] == "ddp")
    assert ttt.trunk_length(args, line) == 14
    folder = ttt.trunk_dir(args, line)
    folder.mkdir(parents=True)
    for k in (6, 10, 14, 20):
        (folder / f"ckpt-{k}.pt").write_bytes(b"")
    (folder / "ckpt.pt").write_bytes(b"")
    earlier = {"kind": "trunk", "method": "ddp", "lr": 0.002, "warmup": 2, "seed": 0, "config": ttt.config_of(args),
               "val": [[0, 5.0], [6, 4.0], [10, 3.5]], "train_loss": [float(i) for i in range(10)], "train_s": 20.0}
    other_seed = {**earlier, "seed": 1, "train_loss": [0.0] * 30}
    records.write_text(json.dumps(other_seed) + "\n" + json.dumps(earlier) + "\n")
    launched = []

    def fake_launch(script, flags, overrides, out):
        launched.append(overrides)
        return [{"iter": 12, "val_loss": 3.0}, {"iter": 14, "val_loss": 2.9}], \
            [{"iter": i, "train_loss": 100.0 + i, "time": 3.0 * (i - 9)} for i in range(10, 14)], None, 7.0

    monkeypatch.setattr(ttt, "launch", fake_launch)
    record = ttt.run_trunk(args, line)
    assert f"--resume_from={(folder / 'ckpt-10.pt').resolve()}" in launched[-1] and "--max_iters=14" in launched[-1]
    assert record["val"] == [[0, 5.0], [6, 4.0], [10, 3.5], [12, 3.0], [14, 2.9]]
    assert record["train_loss"] == [float(i) for i in range(10)] + [110.0, 111.0, 112.0, 113.0]
    assert (record["extends"], record["train_s"], record["wall_s"], record["T"]) == (10, 32.0, 7.0, 14)
    assert (folder / "ckpt-6.pt").exists()

    records.write_text(json.dumps({**earlier, "train_loss": earlier["train_loss"][:8]}) + "\n")
    ttt.run_trunk(args, line)  # the record covers 8 updates: ckpt-10 is not its, ckpt-6 is
    assert f"--resume_from={(folder / 'ckpt-6.pt').resolve()}" in launched[-1]
    record = ttt.run_trunk(args, line, 18)  # longer than the default's 14 (a search beyond the first lengths)
    assert (record["T"], "--max_iters=18" in launched[-1]) == (18, True)  # the record says the length it ran

    records.write_text(json.dumps(other_seed) + "\n")
    record = ttt.run_trunk(args, line)  # no trunk of this line recorded: from scratch, in an emptied folder
    assert not any(o.startswith(("--init_from", "--resume_from")) for o in launched[-1])
    assert "extends" not in record and not folder.exists()


def test_the_screened_estimates_change_the_estimate_as_documented(monkeypatch):
    """instrument.py's study-only candidate (--estimate-blend) changes what the library's Opt* writes, by the
    formula of its docstring, and leaves it alone at 1.0, also with the library's estimate_extrapolation (the
    candidate the screen ran first, now an option): checked on AdamW's state after two real steps, against
    torch's own step on a copy."""
    import copy

    import torch

    from acco import functional

    monkeypatch.syspath_prepend(os.path.join(HERE, "..", "examples", "nanogpt"))
    import instrument

    torch.manual_seed(0)
    master = torch.randn(64)
    p = torch.nn.Parameter(master[:40].view(5, 8))
    q = torch.nn.Parameter(master[40:])
    opt = torch.optim.AdamW([p, q], lr=1e-2, weight_decay=0.1)
    for _ in range(2):
        for t in (p, q):
            t.grad = torch.randn_like(t)
        opt.step()
    g = torch.randn(64)
    p.grad, q.grad = g[:40].view(5, 8), g[40:]
    m = torch.cat([opt.state[t]["exp_avg"].reshape(-1) for t in (p, q)])

    def torch_step(grad):  # torch's AdamW step on a copy, from the same state, with this gradient
        twin = copy.deepcopy(opt)
        (tp, tq) = twin.param_groups[0]["params"]
        tp.grad, tq.grad = grad[:40].view(5, 8).clone(), grad[40:].clone()
        twin.step()
        return torch.cat([tp.detach().reshape(-1), tq.detach().reshape(-1)])

    def estimate(blend, extrapolate):
        monkeypatch.setattr(functional, "_adam", plain)  # undone after the test, like the screen itself
        if blend != 1.0:
            instrument.screen_estimate(blend)
        out = torch.empty(64)
        functional.estimate_into(out, opt, [p, q], master, extrapolate)
        return out

    plain = functional._adam
    theta = master.clone()
    exact = torch_step(g)
    torch.testing.assert_close(estimate(1.0, 1.0), exact)
    torch.testing.assert_close(estimate(0.5, 1.0), torch_step(0.5 * g + 0.5 * m))
    torch.testing.assert_close(estimate(0.0, 1.0), torch_step(m))  # the momentum-only prediction
    torch.testing.assert_close(estimate(1.0, 1.2), theta + 1.2 * (exact - theta))
    assert not torch.allclose(estimate(0.5, 1.0), exact)
    torch.testing.assert_close(master, theta)  # Opt* wrote nothing else
    # the study's path (fp32 master, no staging slice): Opt* is written over the gradients it reads
    monkeypatch.setattr(functional, "_adam", plain)
    instrument.screen_estimate(0.5)
    memory = g.clone()
    p.grad, q.grad = memory[:40].view(5, 8), memory[40:]
    functional.estimate_into(memory, opt, [p, q], master, 1.2)
    torch.testing.assert_close(memory, theta + 1.2 * (torch_step(0.5 * g + 0.5 * m) - theta))


def test_every_acco_method_of_the_studies_names_its_estimate_extrapolation():
    """The studies' records in mode acco were made before ``estimate_extrapolation="auto"`` (1.2 for AdamW) became
    the default: a method that left it to the default would compute something else than its records when a study
    resumes. Every method of both tools that runs an estimate round names it."""
    study = load_example(os.path.join(HERE, "..", "examples", "nanogpt", "study.py"), "nanogpt_study")
    for tool in (_tool(), study):
        for name, (script, settings, flags) in tool.METHODS.items():
            if script == "train_acco.py" and not any(s.startswith("--mode=") for s in settings):
                named = [f for f in flags if f.startswith("--acco-option=estimate_extrapolation=")]
                assert len(named) == 1, (tool.__name__, name, flags)
    assert _tool().METHODS["acco-bf16"][2][-1] == "--acco-option=estimate_extrapolation=1.0"


def test_other_lrs_run_every_method_and_each_is_judged_against_ddp_at_its_lr(tmp_path):
    """--acco-lrs: DDP and every ACCO method get lines at each LR after the main LR's, and the report gives a row
    per LR whose ratio is against DDP's loss at that LR (DDP's best LR moved with the warm-up, docs/studies/time-to-target.md)."""
    ttt = _tool()
    args = ttt.parse([*TINY, "--acco-lrs", "0.004", "--records", str(tmp_path / "r.jsonl"), "--doc",
                      str(tmp_path / "d.md"), "--speed", str(tmp_path / "none.jsonl")])
    plan = [(x["method"], x["lr"]) for x in ttt.lines(args) if x["warmup"] == 2]
    assert plan == [("ddp", 2e-3), ("acco", 2e-3), ("ddp", 4e-3), ("acco", 4e-3)], plan
    # another warm-up can move DDP's best LR: there DDP and the first ACCO method run at both LRs too
    other = ttt.parse([*TINY, "--methods", "ddp,acco,acco-bf16", "--warmups", "2,1", "--acco-lrs", "0.004"])
    plan = [(x["method"], x["lr"]) for x in ttt.lines(other) if x["warmup"] == 1]
    assert plan == [("ddp", 2e-3), ("acco", 2e-3), ("ddp", 4e-3), ("acco", 4e-3)], plan
    base = {"warmup": 2, "seed": 0, "config": ttt.config_of(args), "floor": 0.0, "val": [], "train_loss": [],
            "wall_s": 1.0, "kind": "branch"}
    rs = [dict(base, lr=2e-3, method="ddp", T=12, start=10, final_val_loss=2.0),
          dict(base, lr=4e-3, method="ddp", T=12, start=10, final_val_loss=1.8)]
    for lr, losses in ((2e-3, {12: 2.1, 13: 1.9}), (4e-3, {12: 1.9, 13: 1.7})):
        rs += [dict(base, lr=lr, method="acco", T=t, start=round(0.8 * t), final_val_loss=v) for t, v in losses.items()]
    text = ttt.report_markdown(ttt.summarize(rs, args), args, {})
    assert "| 2 | 12 | 0 | 2.0000 [2.0000–2.0000] (1) | 1.8000 [1.8000–1.8000] (1) |" in text
    rows = [[c.strip() for c in x.strip("|").split("|")] for x in text.splitlines() if x.startswith("| ACCO | ")]
    assert [r[1] for r in rows] == ["0.002 (DDP's best: 0.004)", "0.004"], rows  # one row per LR, main LR first
    assert rows[0][5] == "s0 1.042" and rows[1][5] == "s0 1.042", rows  # 12.5 / 12 at each LR
    assert rows[0][8] == "+5.00%" and rows[1][8] == "+5.56%", rows  # 2.1 / 2.0, 1.9 / 1.8
    assert "warm-up 2, T 12, floor 0: 0.004 (of 0.002, 0.004)." in text


def test_ddps_best_lr_is_judged_on_the_seeds_both_lrs_share():
    """Seed 1 ran at 2e-3 only: comparing its loss with 4e-3's seed 0 would pick an LR by the seeds run."""
    ttt = _tool()
    row = {"warmup": 100, "T": 500, "floor": 0.0}
    ddp = [dict(row, lr=2e-3, seed=0, loss=1.35), dict(row, lr=2e-3, seed=1, loss=1.20),
           dict(row, lr=4e-3, seed=0, loss=1.29)]
    assert ttt.ddp_best_lrs(ddp) == {(100, 500, 0.0): (4e-3, [2e-3, 4e-3])}  # 1.29 < 1.35, not 1.29 > 1.275
    assert ttt.lr_cell(2e-3, (4e-3, [2e-3, 4e-3])) == "0.002 (DDP's best: 0.004)"
    assert ttt.lr_cell(4e-3, (4e-3, [2e-3, 4e-3])) == "0.004"


def test_a_niced_studys_ranks_give_their_niceness_to_their_own_session(monkeypatch, tmp_path):
    """torchrun starts each rank in a session of its own; with Linux's autogroup scheduling ``nice`` then orders
    nothing against the tests beside the study. instrument.py writes the rank's niceness to its autogroup (here a
    file standing in for /proc/self/autogroup), and leaves it alone for a rank that is not niced."""
    monkeypatch.syspath_prepend(os.path.join(HERE, "..", "examples", "nanogpt"))
    import instrument

    group = tmp_path / "autogroup"
    group.write_text("/autogroup-7 nice 0\n")
    monkeypatch.setattr(instrument.os, "nice", lambda inc: 0)
    instrument.nice_in_own_session(str(group))
    assert group.read_text() == "/autogroup-7 nice 0\n"
    monkeypatch.setattr(instrument.os, "nice", lambda inc: 19)
    instrument.nice_in_own_session(str(group))
    assert group.read_text() == "19"
    instrument.nice_in_own_session(str(tmp_path / "absent"))  # no autogroup: nothing to do, no error
    assert not (tmp_path / "absent").exists()


def test_instruments_acco_options_read_words_as_well_as_numbers_dtypes_and_none(monkeypatch):
    """--acco-option=KEY=VALUE reads each kind of value an option takes; a word such as ``auto`` (the default of
    estimate_extrapolation and estimate_dtype) is passed on as it is, for AccoOptimizer to check."""
    import torch

    monkeypatch.syspath_prepend(os.path.join(HERE, "..", "examples", "nanogpt"))
    import instrument

    values = {"None": None, "bfloat16": torch.bfloat16, "20": 20, "1.2": 1.2, "1e-3": 1e-3, "auto": "auto"}
    for text, value in values.items():
        read = instrument.option_value(text)
        assert read == value and type(read) is type(value), (text, read)
    # a compression kind is a word, though torch has dtypes of those names (torch.int8, torch.int4)
    for key in ("compression", "estimate_compression"):
        for kind in ("int8", "int4"):
            assert instrument.acco_option(f"--acco-option={key}={kind}") == (key, kind)
    assert instrument.acco_option("--acco-option=estimate_dtype=bfloat16") == ("estimate_dtype", torch.bfloat16)


def test_muon_runs_the_split_with_muons_lr_on_the_line_and_adamws_as_the_schedules_peak(tmp_path, monkeypatch):
    """With --optimizer muon a line's LR is Muon's: the loops get --optimizer_name=muon --muon_lr=<line LR>, the
    schedule's peak (learning_rate, and min_lr in a trunk and a branch) is --adamw-lr, the records say so in their
    config (so Muon's and AdamW's never mix), the trunks have folders of their own, and the records and the
    report default to Muon's own files."""
    ttt = _tool()
    args = ttt.parse(["--optimizer", "muon", "--adamw-lr", "0.002", "--lr", "0.04", "--workdir", str(tmp_path)])
    assert args.records.name == "ttt_muon.jsonl" and args.doc.name == "time-to-target-muon.md"
    assert ttt.config_of(args)["optimizer"] == "muon" and ttt.config_of(args)["adamw_lr"] == 0.002
    assert "optimizer" not in ttt.config_of(ttt.parse(["--workdir", str(tmp_path)]))
    line = {"method": "acco-bf16", "lr": 0.04, "warmup": 100, "seed": 1, "branches": [], "search": [(50, 0.1)]}
    flags = ttt.overrides_of(args, line)
    assert "--learning_rate=0.002" in flags and "--optimizer_name=muon" in flags and "--muon_lr=0.04" in flags
    assert ttt.trunk_dir(args, line).name.endswith("-muon")

    launched = []
    monkeypatch.setattr(ttt, "launch", lambda script, flags, overrides, out: launched.append(overrides) or (
        [{"iter": 0, "val_loss": 1.0}], [{"train_loss": 1.0, "time": 1.0}], None, 1.0))
    monkeypatch.setattr(ttt, "extendable", lambda *a: None)
    ttt.run_trunk(args, line, 40)
    ckpt = ttt.trunk_dir(args, line) / f"ckpt-{ttt.start_of(50, args.cooldown_frac)}.pt"
    ckpt.parent.mkdir(parents=True, exist_ok=True)
    ckpt.touch()
    ttt.run_branch(args, {"kind": "branch", "line": line, "T": 50, "floor": 0.1}, tmp_path)
    trunk, branch = launched
    assert "--min_lr=0.002" in trunk and "--muon_lr=0.04" in trunk
    assert any(f.startswith("--min_lr=0.0002") for f in branch) and "--muon_lr=0.04" in branch


@pytest.mark.parametrize("optimizer,names", [("adamw", ["DDP + AdamW, fully decayed"]),
                                             ("muon", ["DDP + Muon (the Muon + AdamW split), fully decayed",
                                                       "(Muon's; the AdamW groups' peak 0.003)"])])
def test_the_report_names_the_optimizer_ddp_ran(tmp_path, optimizer, names):
    """A Muon study's block must not call its target DDP + AdamW (the first Muon block did), and it says which
    peak the AdamW groups had."""
    ttt = _tool()
    args = ttt.parse([*TINY, "--optimizer", optimizer, "--adamw-lr", "3e-3", "--records", str(tmp_path / "r.jsonl"),
                      "--doc", str(tmp_path / "d.md"), "--speed", str(tmp_path / "none.jsonl")])
    base = {"lr": 2e-3, "warmup": 2, "seed": 0, "config": ttt.config_of(args), "floor": 0.0, "val": [],
            "train_loss": [], "wall_s": 1.0}
    rs = [dict(base, kind="branch", method="ddp", T=12, start=10, final_val_loss=2.0),
          dict(base, kind="branch", method="acco", T=12, start=10, final_val_loss=1.9)]
    text = ttt.report_markdown(ttt.summarize(rs, args), args, {})
    for name in names:
        assert name in text, text[:600]
    assert ("DDP + AdamW, fully decayed" in text) == (optimizer == "adamw")
