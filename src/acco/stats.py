"""What each round cost: timings and micro-batch counts, and their summary.

A round's three durations, all measured on the side that experiences them:

* ``compute_s``: compute-side time from the round's hand-off until the compute
  side asked for its result, i.e. the work done while the round was in flight.
* ``round_s``: the round itself (reduce-scatter, sharded step, all-gather).
* ``wait_s``: how long the compute side then waited for it; zero when the
  round was hidden behind computation.

On CPU these are host clocks (``time.perf_counter``). On CUDA they are CUDA
events on the two streams, read lazily once complete: recording them adds no
synchronisation, and a round whose events are still pending is reported as
unknown rather than waited for.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch

__all__ = ["CudaTiming", "HostTiming", "RoundRecord", "SettledTiming", "nbytes", "summarize", "summary_lines"]


def nbytes(tensors: Iterable[Any]) -> int:
    """Bytes held by the tensors among ``tensors`` (other items are ignored)."""
    return sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t))


@dataclass
class HostTiming:
    """Host timestamps (``time.perf_counter``) of one round."""

    submit: float = 0.0
    start: float = 0.0
    end: float = 0.0
    wait_begin: float = 0.0
    wait_end: float = 0.0

    @staticmethod
    def now() -> float:
        return time.perf_counter()

    def seconds(self) -> Optional[Tuple[float, float, float]]:
        """(compute_s, round_s, wait_s)."""
        return (self.wait_begin - self.submit, self.end - self.start, self.wait_end - self.wait_begin)


@dataclass
class CudaTiming:
    """CUDA events of one round: hand-off and waits on the compute stream, start/end on the side stream."""

    submit: Any = None
    start: Any = None
    end: Any = None
    wait_begin: Any = None
    wait_end: Any = None

    def seconds(self) -> Optional[Tuple[float, float, float]]:
        """(compute_s, round_s, wait_s), or None while an event is still pending (never blocks)."""
        events = (self.submit, self.start, self.end, self.wait_begin, self.wait_end)
        if any(e is None or not e.query() for e in events):
            return None
        ms = (
            self.submit.elapsed_time(self.wait_begin),
            self.start.elapsed_time(self.end),
            self.wait_begin.elapsed_time(self.wait_end),
        )
        return tuple(x / 1e3 for x in ms)


@dataclass
class SettledTiming:
    """A round's three durations once its events have completed (the events themselves are released)."""

    secs: Tuple[float, float, float]

    def seconds(self) -> Tuple[float, float, float]:
        return self.secs


@dataclass
class RoundRecord:
    """One collected round. Its counts are tensors (CUDA: a pinned host copy, written once ``ready``
    completes) until :meth:`settle` turns them and the timing events into plain numbers."""

    index: int
    kind: str
    local_microbatches: int
    total: Any  # tensor [1], or int once settled
    per_rank: Any  # tensor [N], or list of int once settled
    timing: Any = field(default=None, repr=False)
    ready: Any = field(default=None, repr=False)  # CUDA: event after the host copy of the counts

    def settle(self) -> bool:
        """Replace events and tensors by plain numbers if everything is complete. Never blocks."""
        if isinstance(self.timing, CudaTiming):
            if self.ready is not None and not self.ready.query():
                return False
            secs = self.timing.seconds()
            if secs is None:
                return False
            self.timing, self.ready = SettledTiming(secs), None
        if torch.is_tensor(self.total):
            self.total = int(self.total.item())
            self.per_rank = [int(x) for x in self.per_rank.tolist()]
        return True

    def as_dict(self) -> Dict[str, Any]:
        """Plain numbers (CUDA: waits for the round if it has not finished: call outside the hot loop)."""
        if self.ready is not None:
            self.ready.synchronize()
        secs = self.timing.seconds() if self.timing is not None else None
        compute_s, round_s, wait_s = secs if secs is not None else (None, None, None)
        total = int(self.total.item()) if torch.is_tensor(self.total) else self.total
        per_rank = [int(x) for x in self.per_rank.tolist()] if torch.is_tensor(self.per_rank) else self.per_rank
        return {
            "round": self.index,
            "kind": self.kind,
            "local_microbatches": self.local_microbatches,
            "total_microbatches": total,
            "rank_microbatches": per_rank,
            "compute_s": compute_s,
            "round_s": round_s,
            "wait_s": wait_s,
        }


def summarize(rounds: Iterable[Dict[str, Any]]) -> Dict[str, Any]:
    """Means over rounds (those with known timings) and the share of round time hidden.

    ``hidden`` = 1 - sum(wait_s) / sum(round_s): 1.0 when the compute side
    never waited for a round, 0.0 when it waited for all of it (sync).
    """
    rows = [r for r in rounds if r.get("round_s") is not None]
    if not rows:
        return {"rounds": 0}
    n = len(rows)
    total_round = sum(r["round_s"] for r in rows)
    total_wait = sum(r["wait_s"] for r in rows)
    per_rank = [sum(col) / n for col in zip(*(r["rank_microbatches"] for r in rows))]
    return {
        "rounds": n,
        "compute_s": sum(r["compute_s"] for r in rows) / n,
        "round_s": total_round / n,
        "wait_s": total_wait / n,
        "hidden": 1.0 - total_wait / total_round if total_round > 0 else 1.0,
        "microbatches_per_rank": per_rank,
    }


def summary_lines(summary: Dict[str, Any]) -> List[str]:
    """Human-readable lines for :func:`summarize`'s result."""
    if not summary.get("rounds"):
        return ["no timed rounds yet"]
    mb = ", ".join(f"{x:.2f}" for x in summary["microbatches_per_rank"])
    return [
        f"rounds: {summary['rounds']}",
        f"per round: compute {summary['compute_s'] * 1e3:.1f} ms, round {summary['round_s'] * 1e3:.1f} ms, "
        f"waited {summary['wait_s'] * 1e3:.1f} ms",
        f"communication hidden: {summary['hidden']:.1%}",
        f"micro-batches per round, by rank: [{mb}]",
    ]
