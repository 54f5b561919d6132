"""acco.placement, pure: where every parameter lives, for both placements, on random and on real shapes."""

from __future__ import annotations

import math
import random

import pytest

from acco.placement import SLICE, WHOLE, Layout, newton_schulz_flops


def _check(layout: Layout) -> None:
    """Every parameter contiguous and inside the buffer, no two overlapping, a whole tensor inside its owner's
    chunk, padding only at a chunk's end, each rank's pieces tiling what it holds (by intervals)."""
    size = layout.shard_size
    spans = sorted((p.flat_start, p.flat_end, p.index) for p in layout.params if p.numel)
    for (a0, b0, i0), (a1, b1, i1) in zip(spans, spans[1:]):
        assert b0 <= a1, f"parameters {i0} and {i1} overlap"
    for p in layout.params:
        assert 0 <= p.flat_start <= p.flat_end <= layout.padded_numel, p
        if p.whole and p.numel:
            assert p.flat_start // size == (p.flat_end - 1) // size == p.owner, p
    for r in range(layout.world_size):
        lo, hi = r * size, (r + 1) * size
        inside = [(max(a, lo), min(b, hi), i) for a, b, i in spans if a < hi and b > lo]
        real = layout.real_numel(r)
        cursor = lo  # the parameters tile [lo, lo + real): padding only at the chunk's end
        for a, b, _ in inside:
            assert a == cursor, f"rank {r}: a gap before element {a}"
            cursor = b
        assert cursor == lo + real <= hi
        stepped = layout.stepped_by(r)
        assert stepped == sorted({i for _, _, i in inside})
        pieces = layout.pieces(r)
        assert sum(pieces[i].numel for i in stepped) == real


def _shapes(rng: random.Random):
    return [tuple(rng.randint(0 if rng.random() < 0.05 else 1, 9) for _ in range(rng.randint(1, 2)))
            for _ in range(rng.randint(1, 8))]


@pytest.mark.parametrize("seed", range(40))
def test_random_layouts_hold_every_invariant(seed):
    """On random shapes, placements and world sizes (empty parameters included)."""
    rng = random.Random(seed)
    for _ in range(25):
        shapes, world = _shapes(rng), rng.randint(1, 6)
        kinds = [rng.choice([SLICE, WHOLE]) for _ in shapes]
        _check(Layout.build(shapes, world, kinds))


@pytest.mark.parametrize("seed", range(10))
def test_sliced_parameters_alone_are_laid_end_to_end(seed):
    """Element-wise optimizers keep today's layout: parameters end to end in order, chunks of ceil(numel/N)."""
    rng = random.Random(seed)
    shapes, world = _shapes(rng), rng.randint(1, 6)
    layout = Layout.build(shapes, world)
    numels = [math.prod(s) for s in shapes]
    assert [p.flat_start for p in layout.params] == [sum(numels[:i]) for i in range(len(numels))]
    assert layout.shard_size == max(1, math.ceil(sum(numels) / world))


def gpt2_small():
    """GPT-2 small's parameter shapes in nanoGPT's order (the head is tied to the embedding)."""
    shapes = [(50304, 768), (1024, 768)]
    for _ in range(12):
        shapes += [(768,), (768,), (2304, 768), (2304,), (768, 768), (768,), (768,), (768,), (3072, 768), (3072,),
                   (768, 3072), (768,)]
    return shapes + [(768,), (768,)]


@pytest.mark.parametrize("world", [2, 4, 8])
def test_muon_adamw_split_of_gpt2_small_pads_at_most_one_percent(world):
    """The split users run (hidden matrices whole, the embeddings and 1-D tensors sliced): the AdamW slices fill
    around the matrices, so the buffer is within 1% of the model, and no rank owns more than the matrices its
    chunk can hold."""
    shapes = gpt2_small()
    kinds = [WHOLE if len(s) == 2 and i >= 2 else SLICE for i, s in enumerate(shapes)]
    costs = [newton_schulz_flops(s) if k == WHOLE else 0.0 for s, k in zip(shapes, kinds)]
    layout = Layout.build(shapes, world, kinds, costs)
    _check(layout)
    assert layout.padded_numel <= 1.01 * layout.numel, layout.padding
    load = layout.load(costs)
    # the embedding (31% of the model) fills whole chunks: the others share the Newton-Schulz work
    busy = sum(1 for x in load if x > 0)
    assert max(load) <= 1.25 * sum(load) / busy, load


@pytest.mark.parametrize("world", [2, 4, 8])
def test_every_tensor_whole_bounds_the_buffer_by_the_largest(world):
    """Adafactor on every tensor: the chunk is the fair share or the largest tensor, whichever is larger."""
    shapes = gpt2_small()
    layout = Layout.build(shapes, world, [WHOLE] * len(shapes))
    _check(layout)
    fair = math.ceil(layout.numel / world)
    assert layout.shard_size <= max(math.ceil(1.01 * fair), 50304 * 768)


def test_newton_schulz_cost_of_a_matrix():
    """5 iterations of 4 m^2 n + 2 m^3 with m the smaller side."""
    assert newton_schulz_flops((768, 3072)) == 5 * (4 * 768 * 768 * 3072 + 2 * 768 ** 3)
    assert newton_schulz_flops((3072, 768)) == newton_schulz_flops((768, 3072))
