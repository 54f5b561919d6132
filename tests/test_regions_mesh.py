"""Across regions with FSDP2 or tensor parallelism inside each region (``outer_every`` on DTensor parameters):
a ``("region", "dp", "inside")`` mesh of 2 x 1 x 2 gloo ranks, against ``tests/oracle.py::regions_run`` on the
unsharded model.

Each region is one host: FSDP2 (or tensor parallelism) shards the model over its ``inside`` ranks, ACCO runs its
rounds over ``dp`` (one host here), and ``outer_group`` (``mesh["region"]``) joins the ranks holding the same model
shard in each region. Under FSDP2 each rank reads its own micro-batches and FSDP2's reduce-scatter averages a
host's, so the oracle's region sees the mean of its two ranks' gradients; under tensor parallelism both ranks of a
region read the region's. One spawn runs every configuration and the checkpoint round trip.
"""

from __future__ import annotations

import functools

import pytest
import torch

from _dist import run_ranks
from oracle import regions_run, update_run
from tinynet import flat_list, grad_fn, loss_fn, make_model, rel_err

import acco.checkpoint
from acco import AccoOptimizer

TOL = 1e-5
UPDATES, M = 7, 2
REGIONS, FSDP = 2, 2  # FSDP: the ranks inside a region (FSDP2's or tensor parallelism's)
KW = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
# (name, mode, outer options, the region's own options)
CONFIGS = [
    ("acco/every2", "acco", dict(outer_every=2), {}),
    ("sync/every3", "sync", dict(outer_every=3), {}),
    ("acco/every3-delay1", "acco", dict(outer_every=3, outer_delay=1), {}),
    ("dpu/every2-clip", "dpu", dict(outer_every=2), {"max_grad_norm": 0.05}),
    # compressed: the slices' blocks are the local shards', which the oracle does not lay out; the regions must
    # still hold the very same weights after an undelayed merge
    ("sync/every2-int8", "sync", dict(outer_every=2, outer_compression="int8"), {"compression_block": 4}),
]
TP_CONFIGS = [("tp/acco/every2", "acco", dict(outer_every=2), {}), ("tp/sync/every3", "sync", dict(outer_every=3), {})]


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (REGIONS, 1, FSDP), mesh_dim_names=("region", "dp", "inside"))


def _inside(model, mesh, tp: bool):
    """FSDP2 over the region's ranks, or (``tp``) fc1 column- and fc2 row-parallel (``shift`` left plain)."""
    if tp:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        parallelize_module(model, mesh["inside"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    else:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=mesh["inside"])


def _build(mesh, mode, outer, options, tp=False):
    model = make_model()
    theta0 = [p.detach().clone() for p in model.parameters()]
    _inside(model, mesh, tp)
    opt = AccoOptimizer(model.parameters(), torch.optim.AdamW, mode=mode, microbatches_per_update=M,
                        process_group=mesh["dp"], outer_group=mesh["region"], estimate_dtype=None, **outer,
                        **options, **KW)
    return model, opt, theta0


def _full(model) -> torch.Tensor:
    """The whole model: DTensors gathered, a plain parameter (left out of a tensor-parallel plan) itself."""
    return torch.cat([(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().reshape(-1).to(torch.float64)
                      for p in model.parameters()])


def _train(model, opt, rank, updates):
    traj = []
    for t in updates:
        for j in range(M):
            (loss_fn(model, rank, t * M + j) / M).backward()
        opt.step()
        opt.zero_grad()
        traj.append(_full(model))
    return traj


def _region_fn(region: int, tp: bool = False):
    """Region ``region``'s gradient of micro-batch ``j``, divided by the micro-batches per update as the loop divides
    its loss: the mean of its FSDP ranks' (global ranks ``FSDP * region + k``), or (``tp``) the region's own data
    (read by every rank of it as data ``region``)."""
    def fn(_i, j, weights):
        if tp:
            return [g / M for g in grad_fn(region, j, weights)]
        grads = [grad_fn(FSDP * region + k, j, weights) for k in range(FSDP)]
        return [sum(gs) / FSDP / M for gs in zip(*grads)]
    return fn


def _worker(rank: int, world: int, folder: str) -> dict:
    mesh = _mesh()
    region = mesh.get_local_rank("region")
    out = {}
    for name, mode, outer, options in CONFIGS + TP_CONFIGS:
        tp = name.startswith("tp/")
        model, opt, theta0 = _build(mesh, mode, outer, options, tp)
        traj = _train(model, opt, region if tp else rank, range(UPDATES))
        opt.finish()
        oracle_options = dict(estimate_extrapolation=opt.estimate_extrapolation,
                              max_grad_norm=options.get("max_grad_norm"))
        make = lambda ps: torch.optim.AdamW(ps, **KW)  # noqa: E731
        ref = regions_run(theta0, make, mode, [_region_fn(r, tp) for r in range(REGIONS)], 1, UPDATES, M,
                          outer["outer_every"], outer.get("outer_delay", 0), **oracle_options)[region]
        alone = update_run(theta0, make, mode, _region_fn(region, tp), 1, UPDATES, M, **oracle_options)
        out[name] = {"errs": [rel_err(a, flat_list(b)) for a, b in zip(traj, ref[0])],
                     "final_err": rel_err(_full(model), flat_list(ref[2])),
                     "vs_alone": rel_err(_full(model), flat_list(alone[2])), "traj": traj}
    # a DCP checkpoint (acco.checkpoint) stopped with a round in flight, resumed into fresh objects
    resume = ("acco/every3-delay1", "acco", dict(outer_every=3, outer_delay=1), {})
    model, opt, _ = _build(mesh, *resume[1:])
    _train(model, opt, rank, range(UPDATES))
    opt.finish()
    straight = _full(model)
    model, opt, _ = _build(mesh, *resume[1:])
    _train(model, opt, rank, range(3))  # the outer round launched at 3 is in flight (merged at 4)
    acco.checkpoint.save(folder, opt, model=model)
    opt.finish()
    model, opt, _ = _build(mesh, *resume[1:])
    acco.checkpoint.load(folder, opt, model=model)
    _train(model, opt, rank, range(3, UPDATES))
    opt.finish()
    out["resumed"] = {"resumed": _full(model), "straight": straight}
    # an outer_group that joins different model shards of the regions (rank 0 with rank 3, 1 with 2)
    import torch.distributed as dist

    crossed = [dist.new_group([0, 3]), dist.new_group([1, 2])][rank in (1, 2)]
    model = make_model()
    _inside(model, mesh, tp=False)
    try:
        AccoOptimizer(model.parameters(), mode="sync", process_group=mesh["dp"], outer_group=crossed, outer_every=2)
    except RuntimeError as exc:
        out["crossed"] = str(exc)
    return out


@functools.lru_cache(maxsize=None)
def _results(folder: str):
    return run_ranks(_worker, REGIONS * FSDP, folder)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return _results(str(tmp_path_factory.mktemp("regions-fsdp") / "ckpt"))


@pytest.mark.parametrize("name", [c[0] for c in CONFIGS + TP_CONFIGS])
def test_fsdp2_or_tensor_parallel_inside_each_region_matches_the_oracle(results, name):
    """Every rank's whole model (its DTensor parameters gathered) after every step() and after finish() equals
    regions_run on the unsharded model within 1e-5, and the outer round changed it (the region alone ends
    elsewhere). In mode sync, undelayed: after every merge (and only then) the regions hold the very same weights
    (compressed too, where the oracle does not lay out the local shards' blocks)."""
    mode, outer = next((c[1], c[2]) for c in CONFIGS + TP_CONFIGS if c[0] == name)
    res = [r[name] for r in results]
    for rank, r in enumerate(res):
        assert r["vs_alone"] > 1e-4, (rank, r["vs_alone"])
        if outer.get("outer_compression") is None:
            assert max(r["errs"]) < TOL and r["final_err"] < TOL, (rank, r["errs"], r["final_err"])
    if mode == "sync" and not outer.get("outer_delay"):
        every = outer["outer_every"]
        for k in range(1, UPDATES + 1):
            same = torch.equal(res[0]["traj"][k - 1], res[FSDP]["traj"][k - 1])
            assert same == (k % every == 0), (name, k, same)


def test_a_dcp_checkpoint_with_fsdp2_inside_resumes_bit_identically(results):
    """acco.checkpoint.save/load with each region's model shards and outer state under its own name: every rank
    ends on the straight run's weights."""
    for rank, r in enumerate(results):
        res = r["resumed"]
        assert torch.equal(res["resumed"], res["straight"]), (rank, (res["resumed"] - res["straight"]).abs().max())


def test_an_outer_group_across_different_model_shards_is_refused(results):
    """An outer_group joining rank 0 of one region's FSDP2 ranks with rank 1 of the other's (different model
    shards): refused on every rank, naming what outer_group must join."""
    for rank, r in enumerate(results):
        assert "every region must shard the model alike" in r.get("crossed", ""), (rank, r.get("crossed"))
