"""FSDP2's own streams on the simulated CUDA device (``tests/fake_cuda.py``): FSDP2 is made to use the fake
device through its ``_get_device_handle``, so its reduce-scatter stream is a side stream that runs only when
another stream waits for it, and the race checker sees every access.

With ``model.set_is_last_backward(False)`` on the micro-batches before an update's last (FSDP2's advice for
gradient accumulation), FSDP2 skips its end-of-backward wait on the post-reduce stream. The gradient hook that
adds FSDP2's gradient into the library's buffer runs on that stream, so the compute stream must wait for it
before it reads the buffer: at the estimate's hand-off (mode acco) and at ``step()``.
"""

from __future__ import annotations

import os

import pytest
import torch

from _dist import run_ranks
from oracle import update_run
from test_mesh import KW, M, MLP, UPDATES, _batch, _full, _host_grad_fn

from acco import AccoOptimizer

TOL = 1e-5
_FSDP_MODULES = ("_fsdp_collectives", "_fsdp_init", "_fsdp_param_group", "_fsdp_state")


def _loss(model, host: int, index: int) -> torch.Tensor:
    x, y = _batch(host, index)
    return ((model(x) - y) ** 2).mean() / M


def _worker(rank: int, world: int, mode: str, last_backward_only: bool) -> dict:
    import importlib

    import acco.device_api
    from fake_cuda import FakeCuda
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    os.environ["ACCO_RING"] = "0"  # native collectives, as on NCCL
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp", "shard"))
    fake = FakeCuda(devices=1)
    modules = [importlib.import_module(f"torch.distributed.fsdp._fully_shard.{m}") for m in _FSDP_MODULES]
    real = [m._get_device_handle for m in modules]
    acco.device_api.stream_api = lambda device: fake
    for m, r in zip(modules, real):
        m._get_device_handle = lambda kind, _r=r: fake if kind == "cpu" else _r(kind)
    try:
        with fake:
            torch.manual_seed(0)
            model = MLP()
            theta0 = [p.detach().clone() for p in model.parameters()]
            fully_shard(model, mesh=mesh["shard"])
            opt = AccoOptimizer(model.parameters(), torch.optim.AdamW, mode=mode, microbatches_per_update=M,
                                process_group=mesh["dp"], estimate_dtype=None, **KW)
            traj = []
            for t in range(UPDATES):
                for j in range(M):
                    if last_backward_only:
                        model.set_is_last_backward(j == M - 1)
                    _loss(model, rank, t * M + j).backward()
                opt.step()
                opt.zero_grad()
                traj.append([_full(p).clone() for p in model.parameters()])
            opt.finish()
            uses_streams = opt.scheduler.uses_streams
            fsdp_streams = [s.name for s in fake.side_streams]
    finally:
        acco.device_api.stream_api = acco.device_api.__dict__["_real_stream_api"]
        for m, r in zip(modules, real):
            m._get_device_handle = r
    ref_steps, _, _ = update_run(theta0, lambda ps: torch.optim.AdamW(ps, **KW), mode,
                                 lambda host, index, w: _host_grad_fn(1, host, index, w), world, UPDATES, M,
                                 estimate_extrapolation=opt.estimate_extrapolation)
    err = max(float((a - b).norm() / b.norm()) for got, ref in zip(traj, ref_steps) for a, b in zip(got, ref))
    return {"err": err, "races": fake.races[:3], "uses_streams": uses_streams, "side_streams": fsdp_streams}


@pytest.mark.parametrize("mode,last_backward_only", [("acco", True), ("sync", True), ("acco", False)])
def test_fsdp2_post_reduce_stream_is_waited_for_before_the_buffer_is_read(mode, last_backward_only):
    for rank, r in enumerate(run_ranks(_worker, 2, mode, last_backward_only)):
        assert r["uses_streams"], "the test must run the library's stream path"
        assert len(r["side_streams"]) > 1, f"FSDP2 must run on the simulated device: {r['side_streams']}"
        assert r["races"] == [], (rank, r["races"])
        assert r["err"] < TOL, (rank, r["err"])
