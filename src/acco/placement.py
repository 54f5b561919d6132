"""Where every parameter lives: the flat buffer's layout and each rank's share of it (pure: no process group).

The trainable parameters share one flat buffer of ``N`` equal chunks of
``shard_size`` elements (the rounds only ever see those chunks). Rank ``r`` owns
chunk ``r``: its fp32 master weights and the wrapped optimizer's state cover
that chunk only (ZeRO-1). Each parameter is contiguous in the buffer, so
``.grad`` and the weights coming back from a round are views of it, and has one
of two placements:

* ``slice`` (element-wise optimizers: AdamW, SGD, ...): the parameter may be
  cut anywhere; each rank steps the range of it that lies in its chunk. Sliced
  parameters keep their order, end to end.
* ``whole`` (optimizers that need the whole tensor: Muon orthogonalises a
  matrix, Adafactor factors its second moment): the parameter lies inside one
  chunk, its owner's, and only the owner steps it, in its own shape. Owners are
  chosen largest cost first, each to the least-loaded rank (torch's
  ``ZeroRedundancyOptimizer`` and Megatron-core's layer-wise optimizer pack
  this way), where the tensor fits in a chunk of the fair size.

Chunk ``r`` holds, in this order: the tail of the sliced parameter cut at the
previous chunk's end (if any), the whole tensors that rank ``r`` owns, then
sliced parameters, the last of which may be cut at the chunk's end; padding
fills the chunks after the last sliced parameter. With sliced parameters only,
this is every parameter end to end in order, cut into chunks of
``ceil(numel / N)``. The chunk size is ``max(ceil(numel / N), largest whole
tensor, most whole elements one rank owns)``: sliced parameters fill around
the whole tensors, so padding appears only when a whole tensor (or one rank's
share of them) outgrows the fair chunk (:attr:`Layout.padding` says how much;
``docs/layout.md``).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

__all__ = ["Layout", "ParamPlacement", "Piece", "SLICE", "WHOLE", "newton_schulz_flops", "shard_size_for"]

SLICE, WHOLE = "slice", "whole"


def shard_size_for(numel: int, world_size: int) -> int:
    """Elements per chunk of the plain layout: ``ceil(numel / world_size)``, at least 1."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    return max(1, math.ceil(numel / world_size))


def newton_schulz_flops(shape: Sequence[int], steps: int = 5) -> float:
    """FLOPs of Muon's orthogonalisation of one ``m x n`` matrix (``m <= n``): each of ``steps`` quintic
    iterations multiplies ``X X^T`` (``2 m^2 n``), squares the Gram matrix (``2 m^3``) and applies it
    (``2 m^2 n``)."""
    m, n = sorted(int(d) for d in shape)[:2] if len(shape) >= 2 else (1, math.prod(shape))
    return float(steps * (4 * m * m * n + 2 * m ** 3))


@dataclass(frozen=True)
class Piece:
    """The part of parameter ``index`` that lies in one rank's chunk (empty where it misses the chunk).

    ``flat_start``/``flat_end``: offsets in the full flat buffer; ``local_start``/``local_end``: the same range
    within the chunk; ``param_start``/``param_end``: the range inside the flattened parameter.
    """

    index: int
    flat_start: int
    flat_end: int
    local_start: int
    local_end: int
    param_start: int
    param_end: int

    @property
    def numel(self) -> int:
        return self.flat_end - self.flat_start


@dataclass(frozen=True)
class ParamPlacement:
    """Where parameter ``index`` lives: its range of the flat buffer and, placed whole, its owner."""

    index: int
    shape: Tuple[int, ...]
    placement: str  # SLICE or WHOLE
    flat_start: int
    owner: Optional[int] = None  # WHOLE: the rank whose chunk holds it

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def flat_end(self) -> int:
        return self.flat_start + self.numel

    @property
    def whole(self) -> bool:
        return self.placement == WHOLE

    def piece(self, rank: int, shard_size: int) -> Piece:
        """The part of this parameter in chunk ``rank`` (an empty piece, clamped into both, where it misses)."""
        lo, hi = rank * shard_size, (rank + 1) * shard_size
        a, b = max(lo, self.flat_start), min(hi, self.flat_end)
        if b < a:
            a = b = min(max(self.flat_start, lo), hi)
        ps, pe = min(max(a - self.flat_start, 0), self.numel), min(max(b - self.flat_start, 0), self.numel)
        return Piece(self.index, a, b, a - lo, b - lo, ps, pe)

    def ranks(self, shard_size: int) -> range:
        """The ranks whose chunk holds part of this parameter (one for a whole tensor)."""
        if self.numel == 0:
            return range(self.flat_start // shard_size, self.flat_start // shard_size)
        return range(self.flat_start // shard_size, (self.flat_end - 1) // shard_size + 1)


@dataclass(frozen=True)
class Layout:
    """Every parameter's :class:`ParamPlacement`, and the chunks: the one answer to "where is parameter i on
    rank r". Built once, the same on every rank (:meth:`build` is a pure function of shapes, placements, costs
    and ``world_size``)."""

    params: Tuple[ParamPlacement, ...]
    world_size: int
    shard_size: int

    # ------------------------------------------------------------ building

    @classmethod
    def build(cls, shapes: Sequence[Sequence[int]], world_size: int, placements: Optional[Sequence[str]] = None,
              costs: Optional[Sequence[float]] = None) -> "Layout":
        """Lay out parameters of ``shapes`` over ``world_size`` chunks; ``placements[i]`` is SLICE (default) or
        WHOLE, ``costs[i]`` what balancing whole tensors weighs (default: elements)."""
        shapes_t = tuple(tuple(int(d) for d in s) for s in shapes)
        kinds = tuple(placements) if placements is not None else (SLICE,) * len(shapes_t)
        if len(kinds) != len(shapes_t) or any(k not in (SLICE, WHOLE) for k in kinds):
            raise ValueError(f"placements must be {SLICE!r} or {WHOLE!r}, one per parameter; got {kinds!r}")
        numels = [math.prod(s) for s in shapes_t]
        total = sum(numels)
        fair = shard_size_for(total, world_size)
        whole = [i for i, k in enumerate(kinds) if k == WHOLE]
        if not whole:
            offsets = [sum(numels[:i]) for i in range(len(numels))]
            params = tuple(ParamPlacement(i, s, SLICE, o) for i, (s, o) in enumerate(zip(shapes_t, offsets)))
            return cls(params, world_size, fair)
        weight = [float(c) for c in costs] if costs is not None else [float(n) for n in numels]
        size = max(fair, max(numels[i] for i in whole))
        candidates = [_balanced(kinds, numels, weight, whole, world_size, fair, size)]
        # Chunks a little larger than fair leave room for what packing wastes: the smallest that packs.
        low, grown, packed = size - 1, size, None
        while grown <= candidates[0][2] and packed is None:
            packed = _packed(kinds, numels, weight, whole, world_size, grown)
            if packed is None:
                low, grown = grown, max(grown + 1, math.ceil(grown * 1.005))
        while packed is not None and grown - low > 1:
            middle = (low + grown) // 2
            smaller = _packed(kinds, numels, weight, whole, world_size, middle)
            low, grown, packed = (low, middle, smaller) if smaller is not None else (middle, grown, packed)
        if packed is not None:
            candidates.append(packed)

        def score(c):  # fewest padding elements first (every round sends them), then the least loaded busiest rank
            starts, owner, size = c
            load = [0.0] * world_size
            for i, r in owner.items():
                load[r] += weight[i]
            return (world_size * size, max(load))

        starts, owner, size = min(candidates, key=score)
        params = tuple(ParamPlacement(i, s, kinds[i], starts[i], owner.get(i)) for i, s in enumerate(shapes_t))
        return cls(params, world_size, size)

    # ------------------------------------------------------------ sizes

    @property
    def shapes(self) -> Tuple[Tuple[int, ...], ...]:
        return tuple(p.shape for p in self.params)

    @property
    def numel(self) -> int:
        """Elements of all parameters (no padding)."""
        return sum(p.numel for p in self.params)

    @property
    def padded_numel(self) -> int:
        """Elements of the flat buffer: ``world_size`` chunks."""
        return self.world_size * self.shard_size

    @property
    def padding(self) -> int:
        """Elements of the flat buffer that belong to no parameter (sent by every round all the same)."""
        return self.padded_numel - self.numel

    @property
    def has_whole(self) -> bool:
        return any(p.whole for p in self.params)

    def shard_range(self, rank: int) -> Tuple[int, int]:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside [0, {self.world_size})")
        return rank * self.shard_size, (rank + 1) * self.shard_size

    def param_range(self, index: int) -> Tuple[int, int]:
        p = self.params[index]
        return p.flat_start, p.flat_end

    def real_numel(self, rank: int) -> int:
        """Elements of chunk ``rank`` that belong to parameters: a prefix of the chunk (padding comes last)."""
        return sum(pc.numel for pc in self.pieces(rank))

    # ------------------------------------------------------------ one rank's share

    def pieces(self, rank: int) -> List[Piece]:
        """One piece per parameter (empty where the parameter misses chunk ``rank``), in parameter order."""
        self.shard_range(rank)  # checks the rank
        return [p.piece(rank, self.shard_size) for p in self.params]

    def stepped_by(self, rank: int) -> List[int]:
        """The parameters rank ``rank``'s wrapped optimizers step: those with elements in its chunk (a slice, or
        a whole tensor it owns), in parameter order."""
        return [p.index for p in self.params
                if p.numel and (p.owner == rank if p.whole else p.piece(rank, self.shard_size).numel > 0)]

    def views(self, flat):
        """Per-parameter views (shaped like the parameters) into a flat buffer of at least ``numel`` elements."""
        return [flat[p.flat_start : p.flat_end].view(p.shape) for p in self.params]

    # ------------------------------------------------------------ what it is

    def describe(self) -> str:
        """Shapes and placements, for checkpoints and the agreement of ranks (independent of ``world_size``)."""
        digest = hashlib.sha256(repr(self.shapes).encode()).hexdigest()[:16]
        text = f"{self.numel} elements in {len(self.params)} tensors, shapes {digest}"
        whole = [p.index for p in self.params if p.whole]
        if whole:
            text += f", whole {hashlib.sha256(repr(whole).encode()).hexdigest()[:16]}"
        return text

    def load(self, costs: Optional[Sequence[float]] = None) -> List[float]:
        """Per rank, the cost of the whole tensors it owns (``costs``: per parameter; default elements)."""
        out = [0.0] * self.world_size
        for p in self.params:
            if p.whole:
                out[p.owner] += float(costs[p.index]) if costs is not None else float(p.numel)
        return out


def _balanced(kinds, numels, weight, whole, world, fair, size):
    """Owners by cost (largest first, each to the least-loaded rank it fits), then the chunks filled around
    them; a rank whose chunk a sliced parameter runs through owns nothing, and the assignment is redone
    without it. Returns ``(starts, owner, chunk size)``."""
    excluded: set = set()
    while True:
        owner, loads = _assign(whole, numels, weight, world, excluded, size)
        chunk = max(fair, max(loads), 1)
        starts, through, placed = _fill(kinds, numels, owner, chunk, world)
        blocked = {r for r in through if loads[r]}
        if not blocked or excluded | blocked == excluded:
            assert placed, "every parameter is placed when no chunk holds a whole tensor it cannot"
            return starts, owner, chunk
        excluded |= blocked


def _packed(kinds, numels, weight, whole, world, size):
    """Chunk by chunk, after the cut sliced parameter's tail: the largest whole tensors that still fit, then
    sliced parameters. Keeps large sliced parameters (embeddings) in chunks of their own, without padding;
    ``None`` if some whole tensor does not fit in chunks of ``size``."""
    remaining = sorted(whole, key=lambda i: (-numels[i], -weight[i], i))
    owner: Dict[int, int] = {}

    def choose(rank: int, room: int) -> List[int]:
        taken = []
        for i in list(remaining):
            if numels[i] <= room:
                taken.append(i)
                room -= numels[i]
                remaining.remove(i)
        for i in taken:
            owner[i] = rank
        return taken

    starts, _, placed = _fill(kinds, numels, None, size, world, choose)
    return (starts, owner, size) if placed and not remaining else None


def _assign(whole: List[int], numels: List[int], weight: List[float], world: int, excluded: set,
            cap: int) -> Tuple[Dict[int, int], List[int]]:
    """Whole tensors to ranks: largest cost first, each to the least-loaded allowed rank among those where it
    keeps the rank's whole elements within ``cap`` (any allowed rank if none). Returns owners and each rank's
    whole elements."""
    allowed = [r for r in range(world) if r not in excluded] or list(range(world))
    cost, elements, owner = [0.0] * world, [0] * world, {}
    for i in sorted(whole, key=lambda i: (-weight[i], -numels[i], i)):
        fits = [r for r in allowed if elements[r] + numels[i] <= cap] or allowed
        r = min(fits, key=lambda r: (cost[r], elements[r], r))
        owner[i] = r
        cost[r] += weight[i]
        elements[r] += numels[i]
    return owner, elements


def _fill(kinds, numels, owner, size, world, choose=None):
    """Flat offsets, chunk by chunk: the tail of the sliced parameter cut at the previous chunk's end, the
    chunk's whole tensors (``owner``'s, or ``choose(rank, room)``'s), then sliced parameters until the chunk is
    full. Returns the offsets, the chunks a sliced parameter runs through (begun before, not ended in them),
    and whether every sliced parameter found room."""
    starts = [0] * len(numels)
    stream = [i for i, k in enumerate(kinds) if k == SLICE]
    through: List[int] = []
    s, done = 0, 0  # the current sliced parameter (index into stream), and its elements placed so far
    for r in range(world):
        mine = None if choose is not None else sorted(i for i, o in owner.items() if o == r)
        reserve = 0 if mine is None else sum(numels[i] for i in mine)  # owner given: room kept for its tensors
        cursor, room = r * size, size
        if done:  # the tail of the parameter cut at the previous chunk's end
            i = stream[s]
            take = min(numels[i] - done, room - reserve)
            cursor, room, done = cursor + take, room - take, done + take
            if done < numels[i]:  # it runs through this chunk: with whole tensors here, no layout (blocked)
                through.append(r)
                continue
            s, done = s + 1, 0
        for i in (mine if mine is not None else choose(r, room)):
            starts[i] = cursor
            cursor += numels[i]
            room -= numels[i]
        while s < len(stream) and (room > 0 or numels[stream[s]] == 0):
            i = stream[s]
            starts[i] = cursor
            take = min(numels[i], room)
            cursor, room = cursor + take, room - take
            if take < numels[i]:
                done = take
                break
            s += 1
    for i in stream[s:]:
        starts[i] = world * size if numels[i] == 0 else starts[i]
    return starts, through, s == len(stream) or all(numels[i] == 0 for i in stream[s:])
