"""Accumulate while you communicate: a slowed rank makes the fast one accumulate.

Rank 1 sleeps in every micro-batch. Rank 0 keeps computing while its round waits
for rank 1, so it hands off more micro-batches per round, up to
``max_microbatches``. The counts differ from run to run; exactness is checked by
feeding the oracle the counts each rank actually recorded.
"""

from __future__ import annotations

import functools
import time

import pytest
import torch

from _dist import run_ranks
from oracle import reference_run
from tinynet import elastic_run, flat, flat_list, grad_fn, loss_fn, make_model, rel_err

from acco import AccoOptimizer

SLOW_SECONDS = 0.1
ROUNDS = 8
KW = dict(lr=1e-2, weight_decay=0.1)


def _accumulate_worker(rank: int, world: int, mode: str, max_mb, c: float = 1.0) -> dict:
    model = make_model()
    theta0 = [p.detach().clone() for p in model.parameters()]
    opt = AccoOptimizer(model.parameters(), mode=mode, accumulate_while_communicating=True, min_microbatches=1,
                        max_microbatches=max_mb, estimate_dtype=None,  # the oracle's exact estimate
                        estimate_extrapolation=c, **KW)

    def micro_batch(mb: int) -> None:
        if rank == 1:
            time.sleep(SLOW_SECONDS)  # the slow rank
        loss_fn(model, rank, mb).backward()

    counts, traj = elastic_run(opt, ROUNDS, micro_batch, lambda: flat(model))
    opt.finish()
    return {"counts": counts, "traj": torch.stack(traj), "final": flat(model), "theta0": theta0}


@functools.lru_cache(maxsize=None)
def _results(mode: str, max_mb, c: float = 1.0):
    return run_ranks(_accumulate_worker, 2, mode, max_mb, c)


@pytest.mark.parametrize("mode", ["acco", pytest.param("dpu", marks=pytest.mark.slow)])
def test_fast_rank_accumulates_and_average_is_exact(mode):
    """Check that the fast rank hands off more micro-batches, bounded by max_microbatches, and the weighted mean is exact."""
    res = _results(mode, 3)
    fast, slow = res[0]["counts"], res[1]["counts"]
    assert len(fast) == len(slow) == ROUNDS
    assert max(fast) <= 3 and max(slow) <= 3, (fast, slow)
    assert sum(fast) > sum(slow), f"the fast rank should accumulate more: fast {fast}, slow {slow}"
    assert max(fast) > 1, fast
    ref_steps, ref_final = reference_run(
        res[0]["theta0"], lambda ps: torch.optim.AdamW(ps, **KW), mode, grad_fn, [fast, slow]
    )
    for rank in (0, 1):
        traj = res[rank]["traj"]
        assert len(traj) == len(ref_steps[rank])
        errs = [rel_err(a, flat_list(b)) for a, b in zip(traj, ref_steps[rank])]
        assert max(errs) < 1e-5, f"rank {rank}: {max(errs):.2e}"
        assert rel_err(res[rank]["final"], flat_list(ref_final)) < 1e-5


def test_unbounded_accumulation_exceeds_a_bound():
    """Check that with max_microbatches=None the fast rank accumulates past 3 and stays exact, here with the
    estimate's step extrapolated (estimate_extrapolation=1.2: every estimate round of this loop applies it)."""
    res = _results("acco", None, 1.2)
    fast, slow = res[0]["counts"], res[1]["counts"]
    assert max(fast) > 3, f"no bound, yet the fast rank never accumulated more than 3: {fast}"
    _, ref_final = reference_run(res[0]["theta0"], lambda ps: torch.optim.AdamW(ps, **KW), "acco", grad_fn, [fast, slow],
                                 estimate_extrapolation=1.2)
    assert rel_err(res[0]["final"], flat_list(ref_final)) < 1e-5
