"""The pure pieces, on random inputs: the flat layout's tiling and the clip coefficient."""

from __future__ import annotations

import math

import pytest
import torch

from acco.policies import resolve_estimate_extrapolation
from acco.precision import resolve_estimate_dtype
from acco.modes import Mode
from acco.placement import Layout
from acco.functional import CHUNK
from acco.rounds import clip_coefficient, global_grad_norm


@pytest.mark.parametrize("seed", range(20))
def test_layout_pieces_tile_every_parameter_exactly_once(seed):
    """On random shapes (empty parameters included) and world sizes: each rank's pieces tile its shard in order,
    and together they cover every element of every parameter exactly once."""
    g = torch.Generator().manual_seed(seed)
    shapes = [tuple(int(d) for d in torch.randint(0, 7, (int(torch.randint(0, 4, (1,), generator=g)),), generator=g))
              for _ in range(int(torch.randint(1, 9, (1,), generator=g)))]
    world = int(torch.randint(1, 6, (1,), generator=g))
    layout = Layout.build(shapes, world)
    numel = sum(math.prod(s) for s in shapes)
    assert layout.numel == numel and layout.padded_numel == layout.shard_size * world >= numel
    covered = [torch.zeros(math.prod(s), dtype=torch.int64) for s in shapes]
    for rank in range(world):
        lo, hi = layout.shard_range(rank)
        assert (lo, hi) == (rank * layout.shard_size, (rank + 1) * layout.shard_size)
        pieces = layout.pieces(rank)
        assert [pc.index for pc in pieces] == list(range(len(shapes))), "one piece per parameter, in order"
        at = 0
        for pc in pieces:
            assert pc.numel == pc.param_end - pc.param_start == pc.local_end - pc.local_start >= 0
            if pc.numel:
                assert pc.local_start == at and pc.flat_start == lo + pc.local_start
                covered[pc.index][pc.param_start : pc.param_end] += 1
                at = pc.local_end
        assert at == layout.real_numel(rank) <= layout.shard_size
    assert all(bool((c == 1).all()) for c in covered)
    flat = torch.arange(layout.padded_numel, dtype=torch.float64)
    views = layout.views(flat)
    assert [tuple(v.shape) for v in views] == [tuple(s) for s in shapes]
    assert sum(v.numel() for v in views) == numel


@pytest.mark.parametrize("max_norm", [1e-3, 0.5, 1e3])
def test_clip_coefficient_scales_as_clip_grad_norm(max_norm):
    """The factor a round scales the averaged gradient by is what torch.nn.utils.clip_grad_norm_ applies."""
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(s, generator=g, dtype=torch.float64) for s in ((3, 4), (7,), (2, 2, 2))]
    params = [torch.nn.Parameter(torch.zeros_like(t)) for t in grads]
    for p, t in zip(params, grads):
        p.grad = t.clone()
    total = torch.nn.utils.clip_grad_norm_(params, max_norm)
    norm = torch.linalg.vector_norm(torch.cat([t.flatten() for t in grads]))
    assert torch.allclose(total, norm)
    coef = clip_coefficient(norm, max_norm)
    for p, t in zip(params, grads):
        assert torch.allclose(p.grad, t * coef, rtol=1e-12, atol=0)


@pytest.mark.parametrize("numel,ranges", [(1 << 24, None), (3 * CHUNK + 5, None),
                                          (1 << 24, [(0, 7), (100, (1 << 23) + 3), ((1 << 24) - CHUNK - 1, 1 << 24)])])
def test_the_rounds_norm_is_exact_on_a_long_slice(numel, ranges):
    """The norm a round clips by (one rank, no group) equals the fp64 norm of its slice to 1e-6, whole or by ranges,
    with a tail shorter than a row. One fp32 reduction over 2^24 elements on CPU is 7e-4 off (what a rank's slice
    of a 33M-parameter MoE model on 2 ranks showed against clip_grad_norm_'s per-parameter norms under torchtitan),
    and the clip coefficient with it."""
    x = torch.randn(numel, generator=torch.Generator().manual_seed(0)) * 1e-3
    parts = [x[a:b] for a, b in ranges] if ranges else [x]
    exact = math.sqrt(sum(float(p.double().pow(2).sum()) for p in parts))
    got = float(global_grad_norm(x, None, None, ranges))
    assert abs(got - exact) <= 1e-6 * exact, (got, exact)


def test_progress_round_trips_through_its_tensor():
    """Every saved counter survives to_tensor/load_tensor by name; the window is emptied; a wrong length is refused."""
    from acco.progress import Progress
    from acco.rounds import RoundKind

    for seed in range(5):
        g = torch.Generator().manual_seed(seed)
        r = lambda hi: int(torch.randint(0, hi, (1,), generator=g))  # noqa: E731
        src = Progress(torch.tensor(float(r(10_000)), dtype=torch.float64), microbatches_per_update=r(9) or None,
                       num_rounds=r(500), num_updates=r(500), num_skipped_updates=r(5), commits_handed_off=r(500),
                       holds_estimate=bool(r(2)), pending=[None, RoundKind.COMMIT, RoundKind.ESTIMATE][r(3)],
                       mb_in_update=3, estimate_in_update=True, in_accum=2, since_handoff=1, at_boundary=False)
        saved = src.to_tensor()
        assert saved.dtype == torch.int64 and saved.shape == (len(Progress.SAVED),)
        dst = Progress(torch.zeros((), dtype=torch.float64), microbatches_per_update=4)
        pending_commit = dst.load_tensor(saved)
        assert pending_commit == (src.pending is RoundKind.COMMIT)
        for name in ("num_rounds", "num_updates", "num_skipped_updates", "commits_handed_off", "holds_estimate"):
            assert getattr(dst, name) == getattr(src, name), name
        assert int(dst.committed_mb) == int(src.committed_mb)
        assert dst.microbatches_per_update == 4  # configured: kept (a different saved one is refused before, or allowed)
        learned = Progress(torch.zeros((), dtype=torch.float64), microbatches_per_update=None)
        learned.load_tensor(saved)
        assert learned.microbatches_per_update == src.microbatches_per_update  # not configured: the saved one
        assert dst.pending is (RoundKind.COMMIT if src.pending is RoundKind.COMMIT else None)
        assert (dst.mb_in_update, dst.in_accum, dst.since_handoff, dst.estimate_in_update, dst.at_boundary) == (
            0, 0, 0, False, True)
        for name in Progress.SAVED:
            assert Progress.saved_field(saved, name) == int(saved[Progress.SAVED.index(name)])
    with pytest.raises(ValueError, match="expected 8 counters"):
        Progress(torch.zeros((), dtype=torch.float64)).load_tensor(torch.zeros(5, dtype=torch.int64))


F32, BF16, F64 = torch.float32, torch.bfloat16, torch.float64


@pytest.mark.parametrize("mode,compute,reduce,world,expected", [
    ("acco", F32, F32, 2, BF16),  # an fp32 model's gradients between ranks: the estimate travels in bf16
    ("acco", F32, F32, 8, BF16),
    ("acco", F32, F32, 1, None),  # nothing travels
    ("acco", F32, BF16, 2, None),  # bf16 gradients: nothing narrower to send
    ("acco", BF16, F32, 2, None),  # a bf16 model (fp32 sums): its weights travel in bf16 already; not measured
    ("acco", F64, F64, 2, None),  # fp64: asked for, not guessed
    ("dpu", F32, F32, 2, None),  # no estimate round
    ("sync", F32, F32, 2, None),
])
def test_estimate_dtype_auto_is_bf16_only_for_an_fp32_model_with_an_estimate_round_to_send(mode, compute, reduce, world,
                                                                                            expected):
    assert resolve_estimate_dtype("auto", Mode(mode), compute, reduce, world) == expected


ADAMW, ADAM, SGD = torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD


@pytest.mark.parametrize("mode,accumulating,h,classes,expected", [
    ("acco", False, None, [ADAMW], 1.2),  # measured: fewer updates than 1.0 to DDP's loss (docs/convergence.md)
    ("acco", False, None, [ADAM, ADAMW], 1.2),  # Adam takes the same step on its moments
    ("acco", False, None, [SGD], 1.0),  # not measured
    ("acco", False, None, [torch.optim.Muon, ADAMW], 1.0),  # the Muon + AdamW split: Muon's estimate not measured
    ("acco", False, None, [torch.optim.Adafactor], 1.0),
    ("acco", False, 3, [ADAMW], 1.0),  # a later hand-off: not measured with the extrapolation
    ("acco", True, None, [ADAMW], 1.0),  # accumulate_while_communicating: an estimate of whatever arrived
    ("dpu", False, None, [ADAMW], 1.0),  # no estimate round
    ("sync", False, None, [ADAMW], 1.0),
])
def test_estimate_extrapolation_auto_is_1_2_only_where_it_was_measured(mode, accumulating, h, classes, expected):
    assert resolve_estimate_extrapolation("auto", Mode(mode), accumulating, h, classes) == expected


@pytest.mark.parametrize("given", [1.0, 0.8, 1.5])
def test_an_explicit_estimate_extrapolation_is_kept(given):
    assert resolve_estimate_extrapolation(given, Mode.ACCO, False, None, [ADAMW]) == given
    assert resolve_estimate_extrapolation(given, Mode.ACCO, True, 3, [SGD]) == given


@pytest.mark.parametrize("given", [None, torch.bfloat16])
def test_an_explicit_estimate_dtype_is_kept(given):
    assert resolve_estimate_dtype(given, Mode.ACCO, F32, F32, 2) == given
    assert resolve_estimate_dtype(None, Mode.SYNC, F32, F32, 2) is None


@pytest.mark.parametrize("seed", range(10))
def test_arrival_bits_round_trip_through_the_row(seed):
    """The arrivals' words (52 bits a float64) survive a float64 all-gather bit for bit: the parameters no rank
    had are exactly those every rank lacked, for counts of parameters on either side of a word's edge."""
    from acco import arrivals

    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 160, (1,), generator=g))
    ranks = int(torch.randint(1, 5, (1,), generator=g))
    missing = [{i for i in range(n) if torch.rand(1, generator=g) < 0.6} for _ in range(ranks)]
    rows = torch.tensor([arrivals.pack(m, n) for m in missing], dtype=torch.float64).tolist()
    assert len(rows[0]) == arrivals.words(n) == math.ceil(n / 52)
    assert arrivals.missing_everywhere(rows, n) == frozenset(set.intersection(*missing))


def test_counted_ranges_merges_neighbouring_pieces():
    """The norm's ranges: one per run of neighbouring counted pieces, not one per piece."""
    from types import SimpleNamespace

    from acco.mesh import counted_ranges

    pieces = [SimpleNamespace(index=i, numel=b - a, local_start=a, local_end=b)
              for i, (a, b) in enumerate([(0, 3), (3, 5), (5, 5), (5, 9), (9, 12), (12, 20)])]
    assert counted_ranges([True, True, True, True, False, True], pieces) == [(0, 9), (12, 20)]
    assert counted_ranges([False, True, False, True, False, True], pieces) == [(3, 9), (12, 20)]
    assert counted_ranges([True] * 6, pieces) is None


def test_a_refused_meshs_description_counts_runs_of_equal_parameters():
    """The load's refusal names both meshes; a model's parameters under one placement are one row, counted."""
    from acco.state.format import brief_mesh

    row = "('fsdp',):(2,):('S(0)',)"
    assert brief_mesh(";".join([row] * 83) + " as shard0") == f"{row} x83 as shard0"
    assert brief_mesh(f"{row};{row};('tp',):(2,):('R',);{row} as shard1") == \
        f"{row} x2;('tp',):(2,):('R',);{row} as shard1"
    assert brief_mesh("no mesh") == "no mesh"
