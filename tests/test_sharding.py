"""Each rank holds the master weights and optimizer state of its 1/N slice only."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from _dist import run_ranks

from acco import AccoOptimizer


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(37, 29), nn.ReLU(), nn.Linear(29, 11))  # 1423 elements


def _bytes_worker(rank: int, world: int) -> dict:
    model = _model()
    numel = sum(p.numel() for p in model.parameters())
    opt = AccoOptimizer(model.parameters(), mode="acco", accumulate_while_communicating=True, max_microbatches=1, lr=1e-3)
    for _ in range(2):  # the state exists after the first committed step
        model(torch.randn(3, 37)).sum().backward()
        opt.step()
    opt.finish()
    state = [t for s in opt.local_optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    master = opt.runtime.flat.master
    return {
        "numel": numel,
        "master_numel": master.numel(),
        "master_bytes": master.numel() * master.element_size(),
        "master_dtype": str(master.dtype),
        "moment_numel": sum(t.numel() for t in state if t.dim() > 0),
        "moment_bytes": sum(t.numel() * t.element_size() for t in state if t.dim() > 0),
        "largest_state_tensor": max(t.numel() for t in state),
        "piece_numel": sum(t.numel() for _, t in opt.runtime.wrapped.held()),
        "real_numel": opt.layout.real_numel(rank),
    }


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_each_rank_holds_only_its_slice(world):
    """Check, by counting bytes, that the fp32 master and AdamW moments cover ceil(numel/N) elements per rank."""
    res = run_ranks(_bytes_worker, world)
    numel = res[0]["numel"]
    shard = math.ceil(numel / world)
    assert sum(r["real_numel"] for r in res) == numel  # the slices tile the model exactly once
    for rank, r in enumerate(res):
        assert r["master_dtype"] == "torch.float32"
        assert r["master_numel"] == shard and r["master_bytes"] == 4 * shard, r
        assert r["piece_numel"] == r["real_numel"] <= shard, r
        assert r["moment_numel"] == 2 * r["real_numel"], r  # exp_avg + exp_avg_sq of the slice, nothing more
        assert r["moment_bytes"] == 8 * r["real_numel"], r
        assert r["largest_state_tensor"] < numel / world + 1, r
    full_adamw_bytes = 12 * numel
    per_rank = max(r["master_bytes"] + r["moment_bytes"] for r in res)
    assert per_rank <= full_adamw_bytes / world + 12, (per_rank, full_adamw_bytes)
