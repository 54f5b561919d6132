"""Accumulate while communicating on a mesh (issue 65, finding 2): tensor parallelism inside a host, ACCO
across hosts, one host slower than the other.

The ranks that hold one replica's shards run their forwards together, so they must hand off at the same
micro-batch: the hand-off is agreed over them (the host's fast link). Every rank's gathered weights after every
step() must equal the oracle fed the counts each host recorded, and the shards of one host the same bits.
"""

from __future__ import annotations

import time

import pytest
import torch

from _dist import run_ranks
from oracle import reference_run
from test_mesh import M, _tp_model
from test_mesh import _grad_fn as mesh_grad_fn
from test_mesh import _loss as mesh_loss
from tinynet import elastic_run

from acco import AccoOptimizer

TOL = 1e-5
ROUNDS = 8
KW = dict(lr=2e-2, betas=(0.9, 0.95), weight_decay=0.1)


def _loss(model, host: int, index: int) -> torch.Tensor:
    """A micro-batch's own loss (test_mesh's divides by its M, a power of two: undone exactly)."""
    return mesh_loss(model, host, index) * M


def _grad_fn(host: int, index: int, weights):
    return [g * M for g in mesh_grad_fn(host, index, weights)]


def _full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if hasattr(p, "full_tensor") else p


def _worker(rank: int, world: int, mode: str, slow_tp_rank: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    import acco.transport as transport

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    host, tp = mesh.get_local_rank("dp"), mesh.get_local_rank("tp")
    if tp == slow_tp_rank:  # the rounds of this shard's data-parallel group take longer than its peer's
        real = transport.reduce_scatter_flat  # the round's transport's reduce-scatter

        def slow_reduce_scatter(*args, **kwargs):
            time.sleep(0.04)
            return real(*args, **kwargs)

        transport.reduce_scatter_flat = slow_reduce_scatter
    model, theta0 = _tp_model(mesh["tp"])
    opt = AccoOptimizer(model.parameters(), torch.optim.AdamW, mode=mode, accumulate_while_communicating=True,
                        max_microbatches=None, process_group=mesh["dp"], estimate_dtype=None, **KW)

    def micro_batch(mb: int) -> None:
        # host 1 is the slow one; and one shard's rounds end later than its peer's: only an agreed hand-off
        # keeps a host's two shards on one update
        if host == 1:
            time.sleep(0.03)
        _loss(model, host, mb).backward()

    counts, traj = elastic_run(opt, ROUNDS, micro_batch,
                               lambda: [_full(p).detach().clone() for p in model.parameters()])
    opt.finish()
    final = [_full(p).detach().clone() for p in model.parameters()]
    return {"host": host, "counts": counts, "traj": traj, "final": final, "theta0": theta0}


@pytest.mark.parametrize("mode,slow", [("acco", 0), pytest.param("acco", 1, marks=pytest.mark.slow),
                                       pytest.param("dpu", 0, marks=pytest.mark.slow)])
def test_elastic_loop_on_a_tensor_parallel_mesh_equals_the_oracle(mode, slow):
    res = run_ranks(_worker, 4, mode, slow)
    by_host = {h: [r for r in res if r["host"] == h] for h in (0, 1)}
    for h, peers in by_host.items():
        assert peers[0]["counts"] == peers[1]["counts"], f"host {h}'s shards handed off apart: {peers[0]['counts']}"
        for a, b in zip(peers[0]["traj"], peers[1]["traj"]):
            assert all(torch.equal(x, y) for x, y in zip(a, b)), f"host {h}'s shards hold different weights"
    counts = [by_host[0][0]["counts"], by_host[1][0]["counts"]]
    assert sum(counts[0]) > sum(counts[1]), f"the fast host should accumulate more: {counts}"
    ref_steps, ref_final = reference_run(res[0]["theta0"], lambda ps: torch.optim.AdamW(ps, **KW), mode, _grad_fn,
                                         counts)
    for r in res:
        steps = ref_steps[r["host"]]
        assert len(r["traj"]) == len(steps)
        err = max(float((a - b).abs().max() / b.abs().max()) for st, ref in zip(r["traj"], steps)
                  for a, b in zip(st, ref))
        assert err < TOL, (r["host"], err, counts)
        assert max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(r["final"], ref_final)) < TOL
