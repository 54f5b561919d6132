"""Round statistics, memory accounting and the ring reduce-scatter.

The "hidden" checks are causal, not timed: in acco the compute side only asks
for a round after that round's all-gather has returned, so it cannot have
waited; in sync it asks at once and waits for the whole round.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist

from _dist import run_ranks
from tinynet import loss_fn, make_model

from acco import AccoOptimizer
from acco import collectives, stats, transport
from acco.stats import summarize

HOLD_S = 0.2  # each round's all-gather is held this long, so rounds are long next to a wait


def _ring_worker(rank: int, world: int, numel: int) -> list:
    g = torch.Generator().manual_seed(rank + 1)
    flat = torch.randn(world * numel, dtype=torch.float64, generator=g)
    expected = flat.clone()
    dist.all_reduce(expected)
    out = torch.empty(numel, dtype=torch.float64)
    collectives.ring_reduce_scatter(out, flat, dist.group.WORLD)
    rs_err = (out - expected.view(world, -1)[rank]).abs().max().item()
    shard = torch.full((numel,), float(rank + 1), dtype=torch.float64)
    gathered = torch.zeros(world * numel, dtype=torch.float64)
    collectives.ring_all_gather(gathered, shard, dist.group.WORLD)
    ag_ok = torch.equal(gathered, torch.arange(1, world + 1, dtype=torch.float64).repeat_interleave(numel))
    return [rs_err, expected.abs().max().item(), ag_ok]


@pytest.mark.parametrize("world,numel", [(2, 7), (3, 7), (4, 7), (3, 1 << 17)])
def test_ring_collectives_equal_native(world, numel):
    """Check the ring reduce-scatter (each rank: the sum of its chunk) and all-gather (rank order),
    with one message per step and with several pieces per step."""
    for err, scale, ag_ok in run_ranks(_ring_worker, world, numel):
        assert err <= 1e-12 * scale and ag_ok


def test_ring_choice(monkeypatch):
    """Check the algorithm choice: native without gloo, overridable, bad values rejected."""
    assert collectives.ring_algorithm(None) == "native"
    monkeypatch.setenv(collectives.RING_ENV, "1")
    assert collectives.ring_algorithm(None) == "ring"
    monkeypatch.setenv(collectives.RING_ENV, "yes")
    with pytest.raises(ValueError, match="0 .native collectives. or 1 .ring., got 'yes'"):
        collectives.ring_algorithm(None)


def _algorithm_worker(rank: int, world: int, env) -> str:
    import os

    if env is not None:
        os.environ[collectives.RING_ENV] = env
    opt = AccoOptimizer(make_model().parameters(), lr=1e-2)
    algorithm = opt.runtime.flat.shard.collectives
    opt.finish()
    return algorithm


def test_gloo_rounds_use_the_ring_unless_told():
    """Check that rounds on gloo use the ring collectives, and ACCO_RING=0 the native ones."""
    assert run_ranks(_algorithm_worker, 2, None) == ["ring", "ring"]
    assert run_ranks(_algorithm_worker, 2, "0") == ["native", "native"]


def _stats_worker(rank: int, world: int, mode: str) -> list:
    orig_ag = transport.all_gather_flat  # the round's transport sends the weights
    finished = threading.Event()

    def slow_all_gather(flat, shard, group, algorithm="native"):
        orig_ag(flat, shard, group, algorithm)
        if shard.dtype != torch.float64:  # the fp32 weights (not the float64 row of counts and bits): the round ends here
            threading.Event().wait(HOLD_S)
            finished.set()

    transport.all_gather_flat = slow_all_gather
    timings = {}  # each round's host timestamps, as round_stats() reads them (to check their order, not lengths)
    seconds = stats.HostTiming.seconds

    def recorded(self):
        timings[id(self)] = (self.submit, self.start, self.end, self.wait_begin, self.wait_end)
        return seconds(self)

    stats.HostTiming.seconds = recorded
    model = make_model()
    opt = AccoOptimizer(model.parameters(), mode=mode, accumulate_while_communicating=True, max_microbatches=1, lr=1e-2)
    for mb in range(6):
        loss_fn(model, rank, mb).backward()
        if mode != "sync" and opt.num_rounds > 0:
            assert finished.wait(60)  # the in-flight round is over before this step collects it,
            for _ in range(60000):  # its end stamped too (the worker's future is done once it has stamped it)
                if opt.runtime.scheduler.done():
                    break
                threading.Event().wait(0.001)
        finished.clear()
        opt.step()
    opt.finish()
    rows = opt.round_stats()
    stats.HostTiming.seconds = seconds
    for r in rows:  # each row with the timestamps its durations came from
        r["stamps"] = [t for t in timings.values() if (t[2] - t[1], t[4] - t[3]) == (r["round_s"], r["wait_s"])][0]
    return rows


@pytest.mark.parametrize("mode", ["acco", pytest.param("sync", marks=pytest.mark.slow)])
def test_round_stats_report_hidden_and_waited(mode):
    """Check round_stats: counts per rank, timings consistent, acco rounds hidden, sync rounds waited for."""
    for rank, stats in enumerate(run_ranks(_stats_worker, 2, mode)):
        assert [r["round"] for r in stats] == list(range(len(stats))) and len(stats) >= 5
        for r in stats:
            per_rank = 2 if mode == "acco" and r["kind"] == "commit" else 1  # a commit counts both halves
            assert r["rank_microbatches"] == [per_rank] * 2 and r["total_microbatches"] == 2 * per_rank
            assert r["rank_microbatches"][rank] == r["local_microbatches"]
            submit, start, end, wait_begin, wait_end = r["stamps"]
            assert submit <= start <= end and submit <= wait_begin <= wait_end, r
        summary = summarize(stats)
        if mode == "sync":  # step() waits for the whole round: the wait begins before it and ends after it
            assert all(r["stamps"][3] <= r["stamps"][1] and r["stamps"][4] >= r["stamps"][2] for r in stats), stats
            assert summary["hidden"] <= 0.0 + 1e-9
        else:  # each round (but the last, which finish() collects) ended before the step that collected it waited
            assert all(r["stamps"][3] >= r["stamps"][2] for r in stats[:-1]), stats


def test_summarize_is_plain_arithmetic():
    """Check summarize() on hand-made rows."""
    rows = [
        {"round_s": 1.0, "wait_s": 0.5, "compute_s": 2.0, "rank_microbatches": [1, 3]},
        {"round_s": 3.0, "wait_s": 0.0, "compute_s": 4.0, "rank_microbatches": [1, 1]},
        {"round_s": None, "wait_s": None, "compute_s": None, "rank_microbatches": [9, 9]},
    ]
    s = summarize(rows)
    assert s["rounds"] == 2 and s["hidden"] == pytest.approx(1 - 0.5 / 4.0)
    assert s["compute_s"] == pytest.approx(3.0) and s["microbatches_per_rank"] == [1.0, 2.0]
    assert summarize([]) == {"rounds": 0}


@pytest.mark.parametrize("mode,dtype,estimate", [("acco", None, None), ("sync", None, None), ("acco", torch.bfloat16, None),
                                                 ("acco", None, torch.bfloat16)])
def test_memory_report_matches_algorithm_table(mode, dtype, estimate):
    """Check memory_report() against algorithm.md's table, element by element (one process). The bf16 estimate
    (the default on more than one rank) adds nothing: its slice lives in the round buffer's free bytes."""
    model = make_model()
    opt = AccoOptimizer(model.parameters(), mode=mode, compute_dtype=dtype, accumulate_while_communicating=True,
                        max_microbatches=1, lr=1e-2, estimate_dtype=estimate)
    assert opt.estimate_dtype == estimate
    if estimate is not None:  # the estimate's slice and gathered weights: views of the round buffer, disjoint
        b, comm = opt.runtime.flat.transport, opt.runtime.flat.comm
        ptr = comm.untyped_storage().data_ptr()
        assert b.low_slice.untyped_storage().data_ptr() == b.comm_low.untyped_storage().data_ptr() == ptr
        low_end = b.comm_low.data_ptr() + b.comm_low.numel() * 2
        assert low_end <= b.low_slice.data_ptr() and b.low_slice.data_ptr() + b.low_slice.numel() * 2 <= ptr + comm.nbytes
    for mb in range(4):
        loss_fn(model, 0, mb).backward() if dtype is None else model(torch.randn(2, 5, dtype=dtype)).sum().backward()
        opt.step()
    rep = opt.memory_report()
    opt.finish()
    phi, cd = opt.layout.padded_numel, (dtype or torch.float32).itemsize
    real = opt.layout.real_numel(0)
    n_params = len(list(model.parameters()))
    assert rep["params"] == 59 * cd
    assert rep["grads"] == phi * cd
    assert rep["accum"] == rep["comm"] == phi * 4  # bf16 compute: gradients summed in fp32 (the default)
    assert rep["master"] == rep["master_grad"] == opt.layout.shard_size * 4
    assert rep["staging"] == (0 if dtype is None else opt.layout.shard_size * cd)
    state = 2 * real * 4 + n_params * 4  # exp_avg, exp_avg_sq (fp32) and a scalar step per piece
    assert rep["optimizer_state"] == state
    # Opt* of AdamW is computed into the all-gather's input (acco.functional): the staging slice with bf16,
    # else the gradient slice it reads; no copy of the master or the state
    assert rep["estimate_scratch"] == 0
    # the estimate's foreach temporaries: 7 lists of at most a batch (here the whole slice) of fp32
    assert rep["round_temporaries"] == (7 * opt.layout.shard_size * 4 if mode == "acco" else 8 * opt.layout.shard_size + 64)
    assert rep["library_total"] == sum(v for k, v in rep.items()
                                       if k not in ("params", "library_total", "round_temporaries"))
