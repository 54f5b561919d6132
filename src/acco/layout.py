"""Flat-buffer layout and shard arithmetic (pure functions, no process group).

All trainable parameters are laid end to end, in parameter-group order, in one
flat buffer of ``world_size * shard_size`` elements (the tail is zero padding).
Rank ``r`` owns elements ``[r * shard_size, (r + 1) * shard_size)``: its fp32
master weights and optimizer state cover that slice only (ZeRO-1).

Each parameter ``i`` meets every shard in a (possibly empty) contiguous range:
its *piece* on that rank. The wrapped optimizer on rank ``r`` is given exactly
one piece per parameter, empty ones included, so its parameter index ``i``
always means the user's parameter ``i``. That keeps state portable (keyed by
index, never by ``id``) and lets per-rank state be concatenated back into the
full per-parameter state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Sequence, Tuple

__all__ = ["FlatLayout", "Piece", "shard_size_for"]


def shard_size_for(numel: int, world_size: int) -> int:
    """Elements per shard: ``ceil(numel / world_size)``, at least 1."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    return max(1, math.ceil(numel / world_size))


@dataclass(frozen=True)
class Piece:
    """The part of parameter ``index`` that lies in one rank's shard.

    ``flat_start``/``flat_end`` are offsets in the full flat buffer;
    ``local_start``/``local_end`` the same range relative to the shard;
    ``param_start``/``param_end`` the range inside the flattened parameter.
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
class FlatLayout:
    """Where every parameter lives in the flat buffer, and how it is sharded."""

    shapes: Tuple[Tuple[int, ...], ...]
    offsets: Tuple[int, ...]
    numel: int
    world_size: int
    shard_size: int

    @classmethod
    def build(cls, shapes: Sequence[Sequence[int]], world_size: int) -> "FlatLayout":
        shapes_t = tuple(tuple(int(d) for d in s) for s in shapes)
        offsets, total = [], 0
        for s in shapes_t:
            offsets.append(total)
            total += math.prod(s)
        return cls(shapes_t, tuple(offsets), total, world_size, shard_size_for(total, world_size))

    @property
    def padded_numel(self) -> int:
        return self.world_size * self.shard_size

    def param_range(self, index: int) -> Tuple[int, int]:
        start = self.offsets[index]
        return start, start + math.prod(self.shapes[index])

    def shard_range(self, rank: int) -> Tuple[int, int]:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside [0, {self.world_size})")
        return rank * self.shard_size, (rank + 1) * self.shard_size

    def pieces(self, rank: int) -> List[Piece]:
        """One piece per parameter (empty where the parameter misses the shard)."""
        lo, hi = self.shard_range(rank)
        out = []
        for i in range(len(self.shapes)):
            p_lo, p_hi = self.param_range(i)
            a, b = max(lo, p_lo), min(hi, p_hi)
            if b < a:  # no overlap: an empty piece, clamped into shard and parameter
                a = b = min(max(p_lo, lo), hi)
            n = p_hi - p_lo
            ps, pe = min(max(a - p_lo, 0), n), min(max(b - p_lo, 0), n)
            out.append(Piece(i, a, b, a - lo, b - lo, ps, pe))
        return out

    def views(self, flat):
        """Per-parameter views (shaped like the parameters) into a flat buffer of at least ``numel``."""
        return [flat[a:b].view(shape) for shape, (a, b) in zip(self.shapes, map(self.param_range, range(len(self.shapes))))]

    def real_numel(self, rank: int) -> int:
        """Elements of the shard that belong to parameters (not padding)."""
        lo, hi = self.shard_range(rank)
        return max(0, min(hi, self.numel) - lo)
