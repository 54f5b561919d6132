"""Checkpoints of format 2 (acco before per-parameter state) load and resume exactly.

``tests/fixtures/format2/`` was written by acco at commit 13d8226 (``make.py`` there says how): 2 ranks, TinyNet
in two param groups, AdamW, mode acco, saved after 3 updates as a DCP folder, one file per rank and one gathered
file, and the 3 updates after it. Today's acco loads each, goes on, and must give those same weights (up to the
rounding of the CPU that wrote them).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from _dist import run_ranks
from tinynet import flat, make_model

import acco

HERE = os.path.join(os.path.dirname(__file__), "fixtures", "format2")
sys.path.insert(0, HERE)
from make import groups, loss  # noqa: E402


def _continue(model, opt, rank, world):
    after = []
    for t in range(3, 6):
        for k in range(2):
            (loss(model, rank, world, 2 * t + k) / 2).backward()
        opt.step()
        opt.zero_grad()
        after.append(flat(model))
    opt.finish()
    return {"after_step": torch.stack(after), "final": flat(model)}


def _forms(rank, world, forms):
    return {form: _worker(rank, world, form) for form in forms}


def _worker(rank, world, form):
    model = make_model(seed=5)  # another initialisation: everything must come from the checkpoint
    # the estimate the checkpoints were written with (commit 13d8226, before estimate_dtype="auto" and
    # estimate_extrapolation="auto")
    opt = acco.AccoOptimizer(groups(model), torch.optim.AdamW, microbatches_per_update=2, lr=1e-2, betas=(0.9, 0.95),
                             estimate_dtype=None, estimate_extrapolation=1.0)
    if form == "dcp":
        acco.checkpoint.load(os.path.join(HERE, "dcp"), opt, model=model)
    elif form == "rank":
        model.load_state_dict(torch.load(os.path.join(HERE, "model.pt"), weights_only=True))
        opt.load_state_dict(torch.load(os.path.join(HERE, f"rank{rank}.pt"), weights_only=True))
    else:
        state = torch.load(os.path.join(HERE, "gathered.pt"), weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
    assert opt.num_updates == 3
    with opt.committed_weights():
        loaded = flat(model)
    return {"loaded": loaded, **_continue(model, opt, rank, world)}


# The fixture's float results came from the CPU that wrote them; another CPU's kernels (AVX-512 and AMX here,
# 2026-12-05) round a few elements an ulp apart in the updates after the load (3e-8 on weights of ~0.3).
FIXTURE_ROUNDING = 1e-6


def test_format2_checkpoint_loads_bit_for_bit_and_resumes():
    """Each format-2 form (DCP, one file per rank, the gathered file), loaded on the 2 ranks that saved it, holds
    the saved committed weights bit for bit; the three forms go on to the very same weights, bit for bit, and
    those are the saving run's (``expected.pt``) up to the rounding of the CPU that wrote the fixture."""
    expected = torch.load(os.path.join(HERE, "expected.pt"), weights_only=True)
    saved = torch.load(os.path.join(HERE, "model.pt"), weights_only=True)
    saved = torch.cat([v.reshape(-1).to(torch.float64) for v in saved.values()])
    for outs in run_ranks(_forms, 2, ("dcp", "rank", "gathered")):
        assert sorted(outs) == ["dcp", "gathered", "rank"], outs
        for form, out in outs.items():
            assert torch.equal(out["loaded"], saved), form
            assert torch.equal(out["after_step"], outs["dcp"]["after_step"]), form
            assert torch.equal(out["final"], outs["dcp"]["final"]), form
            assert (out["after_step"] - expected["after_step"]).abs().max() < FIXTURE_ROUNDING, form
            assert (out["final"] - expected["final"]).abs().max() < FIXTURE_ROUNDING, form


@pytest.mark.parametrize("world", [1, pytest.param(3, marks=pytest.mark.slow)])
def test_format2_dcp_checkpoint_reshards(world):
    """Check the format-2 DCP folder loads on 1 and on 3 ranks and continues as the 2-rank run did (the data is
    each rank's share of a global batch, so the run does not depend on the number of ranks)."""
    expected = torch.load(os.path.join(HERE, "expected.pt"), weights_only=True)
    for out in run_ranks(_worker, world, "dcp"):
        assert (out["final"] - expected["final"]).abs().max() < FIXTURE_ROUNDING


def test_format2_state_dict_of_another_rank_is_refused():
    """Check rank 1's format-2 file loaded on rank 0 is refused as before, naming the rank."""
    model = make_model()
    opt = acco.AccoOptimizer(groups(model), torch.optim.AdamW, microbatches_per_update=2, lr=1e-2, estimate_dtype=None)
    with pytest.raises(ValueError, match="shard of rank 1 of 2"):
        opt.load_state_dict(torch.load(os.path.join(HERE, "rank1.pt"), weights_only=True))
    opt.finish()
