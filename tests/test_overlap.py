"""The round really runs while the main thread computes the next backward (CPU/gloo).

Proved causally, not by timing: the round's first collective is held until the
main thread is inside the next micro-batch's backward, and that backward does not
finish until the round has finished. If ``step()`` ran the round itself, the
round would wait for a backward that can never start, and fail.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

import acco.rounds as rounds
import acco.transport as transport
from _dist import run_ranks
from tinynet import loss_fn, make_model

from acco import AccoOptimizer

HOLD = 30.0  # seconds a side waits for the other before declaring no overlap


def _overlap_worker(rank: int, world: int, mode: str) -> list:
    events = []
    in_backward = threading.Event()

    def note(what: str) -> None:
        events.append((what, threading.current_thread().name))

    orig_rs, orig_ag = transport.reduce_scatter_flat, transport.all_gather_flat  # the round's transport's

    def held_reduce_scatter(out, flat, group, algorithm="native"):
        if not in_backward.wait(timeout=HOLD):
            raise RuntimeError("the round never ran during a backward: no overlap")
        note("reduce_scatter_start")
        orig_rs(out, flat, group, algorithm)
        note("reduce_scatter_end")

    def logged_all_gather(flat, shard, group, algorithm="native"):
        orig_ag(flat, shard, group, algorithm)
        if shard.dtype != torch.float64:  # the (fp32) weights, not the float64 row [count, fingerprint, round id, bits]
            note("all_gather_end")

    transport.reduce_scatter_flat, transport.all_gather_flat = held_reduce_scatter, logged_all_gather
    model = make_model()
    # acco: two micro-batches per update; the end of the first one's backward hands off round 0 (the estimate).
    opt = AccoOptimizer(model.parameters(), mode=mode, lr=1e-2, microbatches_per_update=2 if mode == "acco" else None)
    opt.local_optimizer.register_step_pre_hook(lambda *_: note("opt_step_start"))
    opt.local_optimizer.register_step_post_hook(lambda *_: note("opt_step_end"))
    orig_estimate = rounds.functional.estimate_into

    def logged_estimate(*args):  # mode acco's round 0 is an estimate: Opt* without the optimizer's step()
        note("opt_step_start")
        orig_estimate(*args)
        note("opt_step_end")

    rounds.functional.estimate_into = logged_estimate

    def during_backward(grad):
        note("backward_start")
        in_backward.set()
        deadline = time.monotonic() + HOLD
        while not opt.scheduler.done():  # keep this backward open until the round is over
            if time.monotonic() > deadline:
                raise RuntimeError("round did not finish")
            time.sleep(0.001)
        note("backward_end")
        return grad

    loss_fn(model, rank, 0).backward()  # acco: hands off round 0 at the end of this backward
    if mode != "acco":
        opt.step()  # hands off round 0, returns while it is held
    note("step_returned")
    x = model.fc1.weight * 1.0  # micro-batch 1: its backward hosts round 0
    x.register_hook(during_backward)
    loss = loss_fn(model, rank, 1) + 0.0 * x.sum()
    loss.backward()
    opt.step()
    opt.finish()
    return events


def _check(events):
    names = [e[0] for e in events]
    order = [
        "step_returned",
        "backward_start",
        "reduce_scatter_start",
        "reduce_scatter_end",
        "opt_step_start",
        "opt_step_end",
        "all_gather_end",
        "backward_end",
    ]
    positions = [names.index(n) for n in order]
    assert positions == sorted(positions), f"events out of order: {names}"
    threads = {name: thread for name, thread in events}
    assert threads["backward_start"] == "MainThread"
    for n in ("reduce_scatter_start", "opt_step_start", "all_gather_end"):
        assert threads[n] != "MainThread", f"{n} ran on the main thread: {events}"


def test_round_overlaps_next_backward_acco():
    """Check that round 0's collectives and optimizer step run inside micro-batch 1's backward (2 gloo ranks)."""
    for events in run_ranks(_overlap_worker, 2, "acco"):
        _check(events)


@pytest.mark.slow
def test_round_overlaps_next_backward_dpu():
    """Check the same overlap for mode dpu."""
    for events in run_ranks(_overlap_worker, 2, "dpu"):
        _check(events)
