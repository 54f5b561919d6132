"""What the ranks must agree on in a round, and what every rank raises when they do not.

A round's first collective carries each rank's row (``[micro-batch count, hyper-parameter fingerprint, round
id, arrival bits]``); :func:`check_pairs_on_host` reads those rows on the CPU path, and the CUDA path's
device report (:class:`RoundReport`) carries the same checks to the host. A public collective call meets a
rank still in a round through :func:`mark_call`. The messages name what differs and what to do.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from .collectives import all_gather_flat
from .errors import HyperParameterMismatchError, RoundMismatchError

__all__ = ["RoundReport", "call_mismatch_message", "check_pairs_on_host", "hyper_mismatch_message", "mark_call",
           "nonfinite_message", "round_mismatch_message"]


class RoundReport:
    """The fields of ``RoundResult.report``: ``[round ids differ, hyper-parameters differ, non-finite, norm,
    round id of rank 0, ..., round id of rank N-1]`` (float64)."""

    ROUND_MISMATCH, HYPER_MISMATCH, NONFINITE, NORM, IDS = 0, 1, 2, 3, 4


# The first column of a round's row is its micro-batch count (>= 0); a public collective call's exchange on the
# rounds' group (mark_call) sends -1 - its index in agreement.COLLECTIVE_CALLS there instead.
def mark_call(ctx: Any, call_index: int, round_id: int) -> None:
    """A public collective call's first exchange on the rounds' own group, shaped as a round's first
    collective: a rank still in a round it handed off (one update ahead of the others) meets it there, and
    every rank raises :class:`RoundMismatchError` naming the call. Collective on the round group."""
    b = ctx.buffers
    for i, value in enumerate((float(-1 - call_index), 0.0, float(round_id))):
        b.row[i].fill_(value)
    all_gather_flat(b.rows, b.row, ctx.group)  # every rank's [call mark or micro-batch count, ., round id]
    check_pairs_on_host(None, b.rows.view(-1, b.row.numel())[:, :3])  # a host sync: not on the hot path


def check_pairs_on_host(kind: Any, pairs: torch.Tensor) -> None:
    """CPU path: raise on every rank alike if the ranks handed off different rounds or hyper-parameters, or
    some are in a public collective call while others are in a round."""
    ids = pairs[:, 2].tolist()  # a host sync, on the round's own thread
    counts = pairs[:, 0].tolist()
    if all(c < 0 for c in counts):
        return  # every rank is in a public call: which ones, the call's own exchange on the control group says
    if any(c < 0 for c in counts):
        raise RoundMismatchError(call_mismatch_message(counts, ids))
    if len(set(ids)) > 1:
        raise RoundMismatchError(round_mismatch_message(ids))
    if not bool((pairs[:, 1] == pairs[0, 1]).all()):
        raise HyperParameterMismatchError(hyper_mismatch_message(kind.value))


def call_mismatch_message(counts: Sequence[float], ids: Sequence[float]) -> str:
    from .agreement import COLLECTIVE_CALLS

    def where(c: float, i: float) -> str:
        if c < 0:
            return f"in {COLLECTIVE_CALLS[int(-1 - c)]} (after {int(i) // 2} rounds)"
        return f"in round {int(i) // 2} ({'an estimate' if int(i) % 2 else 'a commit'}) of an update it began"

    described = ", ".join(f"rank {r} {where(c, i)}" for r, (c, i) in enumerate(zip(counts, ids)))
    calls = sorted({COLLECTIVE_CALLS[int(-1 - c)] for c in counts if c < 0})
    return (
        f"the ranks ran different numbers of updates: {described}. Every rank must run the same number of "
        f"updates (e.g. loop while opt.next_update_index < total_updates), then call {' / '.join(calls)} on "
        "every rank"
    )


def round_mismatch_message(ids: Sequence[float]) -> str:
    described = [f"round {int(i) // 2} {'estimate' if int(i) % 2 else 'commit'}" for i in ids]
    return (
        f"the ranks handed off different rounds ({described}, rank i at index i): usually some rank ran a "
        "different number of micro-batches in an update (an uneven data shard at the end of an epoch). "
        "Give every rank the same number of micro-batches per update"
    )


def hyper_mismatch_message(kind: str) -> str:
    return (
        f"{kind} round: the ranks handed it off with different hyper-parameters (lr, betas, "
        "weight_decay, ... of the param groups): a scheduler or your code changed them on some ranks only. "
        "Change them on every rank alike (e.g. step the scheduler on every rank)"
    )


def nonfinite_message(kind: str, norm: float) -> str:
    return (
        f"{kind} round: the averaged gradient's norm is {norm} (inf/NaN); "
        "pass nonfinite='skip' to skip such updates instead"
    )
