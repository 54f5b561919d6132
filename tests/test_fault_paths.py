"""Failure paths on 2 gloo ranks: how the surviving rank learns that its peer is gone, and how fast.

Each worker returns what the survivor saw and when: the departing rank writes the time it left to a
file, the survivor the time it raised. The process group's timeout is 60 s (tests/_dist.py) and
run_ranks gives up after 45 s, so a survivor that waited for the process group's timeout fails the test.
"""

from __future__ import annotations

import datetime
import os
import signal
import time

import pytest
import torch.distributed as dist

from _dist import run_ranks
from tinynet import loss_fn, make_model

import acco
from acco import AccoOptimizer

DEADLINE = 45  # < the process group's 60 s timeout
_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "broadcast",
                "broadcast_object_list", "barrier", "monitored_barrier", "gather_object", "reduce_scatter_tensor")


def _stamp(path: str) -> None:
    with open(path, "w") as f:
        f.write(repr(time.time()))


def _train_until_error(model, opt, rank, start=0, updates=200):
    try:
        for t in range(start, start + updates):
            for j in range(2):
                (loss_fn(model, rank, 2 * t + j) / 2).backward()
            opt.step()
        opt.finish()
    except acco.RoundFailedError as exc:
        raised = time.time()
        called = []  # every collective finish() would start with the dead peer
        saved = {n: getattr(dist, n) for n in _COLLECTIVES}
        for n in _COLLECTIVES:
            setattr(dist, n, lambda *a, _n=n, **k: called.append(_n))
        try:
            with pytest.raises(RuntimeError, match=r"finish\(\): a previous round failed"):
                opt.finish()  # no collective with the dead peer (finish()'s own guard, not the exchange's)
        finally:
            for n, f in saved.items():
                setattr(dist, n, f)
        return {"error": str(exc), "raised": raised, "collectives_in_finish": called}
    return {"error": None}


def _worker(rank: int, world: int, case: str, stamp: str) -> dict:
    model = make_model()
    kw = {"timeout": datetime.timedelta(seconds=3)} if case == "stalled" else {}
    opt = AccoOptimizer(model.parameters(), microbatches_per_update=2, lr=1e-2, **kw)
    if rank == 1:
        for t in range(3):
            for j in range(2):
                (loss_fn(model, rank, 2 * t + j) / 2).backward()
            opt.step()
        if case == "killed":
            _stamp(stamp)
            os.kill(os.getpid(), signal.SIGKILL)
        if case == "stalled":
            _stamp(stamp)
            # Alive, but no longer calling step(), until the survivor has raised (or past DEADLINE): a survivor
            # that ignores the optimizer's 3 s timeout waits here until run_ranks gives up, and fails the test.
            until = time.monotonic() + DEADLINE + 5
            while not os.path.exists(stamp + ".raised") and time.monotonic() < until:
                time.sleep(0.05)
            return {"left": True, "survivor_raised_first": os.path.exists(stamp + ".raised")}
        if case == "raises":
            try:
                raise ValueError("a bug in rank 1's own code, between two step() calls")
            except ValueError:
                _stamp(stamp)
                return {"left": True}  # the exception ends the loop; the process exits through its handlers
        _stamp(stamp)  # "exits": leaves its loop early, without finish()
        return {"left": True}
    out = _train_until_error(model, opt, rank)
    if out["error"] is not None:
        for _ in range(100):
            if os.path.exists(stamp) and os.path.getsize(stamp):
                break
            time.sleep(0.05)
        out["after_peer_left_s"] = out["raised"] - float(open(stamp).read())
        _stamp(stamp + ".raised")  # the stalled peer may leave now
    return out


@pytest.mark.parametrize("case", ["killed", *(pytest.param(c, marks=pytest.mark.slow) for c in ("stalled", "exits", "raises"))])
def test_survivor_raises_soon_after_its_peer_is_gone(case, tmp_path):
    """Check the surviving rank raises RoundFailedError (naming the likely cause) long before the process
    group's timeout, and that finish() then raises at once."""
    start = time.monotonic()
    results = run_ranks(_worker, 2, case, str(tmp_path / "left"), timeout=DEADLINE, may_die=[1])
    survivor = results[0]
    assert survivor["error"] is not None, "the survivor must notice"
    assert "peer that died or stopped calling step()" in survivor["error"], survivor["error"]
    assert survivor["collectives_in_finish"] == [], survivor  # no collective after a failure
    if case == "stalled":  # the optimizer's 3 s timeout, not the process group's 60 s: it raised while the peer
        assert results[1]["survivor_raised_first"], results  # still stalled (the peer gives up after DEADLINE)
    print(f"{case}: survivor raised {survivor['after_peer_left_s']:.2f} s after its peer left "
          f"(whole test {time.monotonic() - start:.1f} s)")
