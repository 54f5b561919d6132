"""Which parameters received a gradient: torch's ``.grad is None``, kept for a flat buffer.

A torch optimizer skips a parameter whose ``.grad`` is ``None``: it does not
move, and its state (AdamW's moments and step count) does not advance. DDP
with ``find_unused_parameters=True`` leaves ``.grad`` ``None`` where no rank
produced a gradient, and averages a gradient produced on some ranks only as if
the others had produced zeros. Here ``.grad`` is always a view of a flat
buffer, so "no gradient" is tracked apart, per parameter:

* :class:`Arrivals` (one per optimizer, owned by ``FlatBuffers``): the
  parameters whose gradient is in the accumulation since the last commit
  (``arrived``), and those whose gradient is in ``.grad`` but not yet folded
  into it (``pending``, accumulating while communicating). A parameter frozen
  after construction (``requires_grad_(False)``) gets no gradient, so it
  stops, as it does under a plain optimizer.
* The round carries this rank's set as bits in the first all-gather's row
  (:func:`pack`, 52 bits per float64, exact), so no collective is added;
  :func:`missing_everywhere` gives the parameters no rank had, which the round
  does not step (``WrappedOptimizers.without_grads``).

Pure host code: no tensor, no collective.
"""

from __future__ import annotations

from typing import FrozenSet, Iterable, List, Sequence, Set

__all__ = ["Arrivals", "WORD_BITS", "missing_everywhere", "pack", "words"]

WORD_BITS = 52  # bits per float64 word: every integer below 2**53 is exact, so the row carries them bit for bit


def words(n: int) -> int:
    """float64 words that hold one bit for each of ``n`` parameters."""
    return (n + WORD_BITS - 1) // WORD_BITS


def pack(missing: Iterable[int], n: int) -> List[float]:
    """The row's words for ``n`` parameters: bit ``i % 52`` of word ``i // 52`` is set where parameter ``i``
    has a gradient (everything but ``missing``)."""
    out = []
    for w in range(words(n)):
        width = min(WORD_BITS, n - w * WORD_BITS)
        out.append((1 << width) - 1)
    for i in missing:
        out[i // WORD_BITS] &= ~(1 << (i % WORD_BITS))
    return [float(v) for v in out]


def missing_everywhere(rows: Sequence[Sequence[float]], n: int) -> FrozenSet[int]:
    """The parameters no rank had a gradient for, from every rank's words (:func:`pack`)."""
    present = [0] * words(n)
    for row in rows:
        for w, value in enumerate(row):
            present[w] |= int(value)
    return frozenset(i for i in range(n) if not (present[i // WORD_BITS] >> (i % WORD_BITS)) & 1)


class Arrivals:
    """The parameters of ``n`` whose gradient the next round sums (see the module docstring)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.arrived: Set[int] = set()  # in the accumulation (the update loop: in ``.grad``, the same buffer)
        self.pending: Set[int] = set()  # in ``.grad``, to be folded into the accumulation at step()

    def mark(self, index: int) -> None:
        """A backward put a gradient into parameter ``index``'s ``.grad`` (its post-accumulate hook)."""
        self.pending.add(index)

    def fold(self) -> None:
        """``.grad`` was added into the accumulation (accumulating while communicating, at every step())."""
        self.arrived |= self.pending
        self.pending.clear()

    def discard(self, index: int, whole_sum: bool) -> None:
        """The user set ``p.grad`` to ``None``: this micro-batch's gradient is gone, and with it the whole
        sum where ``.grad`` is the sum (``whole_sum``)."""
        self.pending.discard(index)
        if whole_sum:
            self.arrived.discard(index)

    def zero(self, whole_sum: bool) -> None:
        """``zero_grad()``: ``.grad`` is zeroed, and the sum too where ``whole_sum``."""
        self.pending.clear()
        if whole_sum:
            self.arrived.clear()

    def drop_accumulated(self) -> None:
        self.arrived.clear()

    def clear(self) -> None:
        self.arrived.clear()
        self.pending.clear()

    def take(self, commit: bool) -> FrozenSet[int]:
        """At a hand-off: the parameters *without* a gradient in the round's sum. A commit's sum leaves the
        accumulation, so its arrivals go with it; an estimate's count again in the commit."""
        self.fold()
        # the usual case, every parameter's gradient in: no set of all of them built on the hand-off's path
        missing = frozenset() if len(self.arrived) == self.n else frozenset(range(self.n)) - self.arrived
        if commit:
            self.arrived.clear()
        return missing
