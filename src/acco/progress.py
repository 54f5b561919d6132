"""Where training stands: one owner for every counter and hand-off flag of an :class:`~acco.AccoOptimizer`.

Two kinds of field:

* **saved** (:data:`Progress.SAVED`, in that order): what a checkpoint
  carries, as one int64 tensor (:meth:`Progress.to_tensor` /
  :meth:`Progress.load_tensor`). A new counter is added here, and only here.
* **window**: what happened since the last hand-off or update boundary
  (micro-batches accumulated, whether the update's estimate is out, the
  hyper-parameters of the update in flight). A checkpoint is taken at an
  update boundary, where the window is empty, so it is not saved:
  :meth:`Progress.start_window` empties it.

Every field changes through a named transition below (a hand-off, a collect, a backward, a restore): the
invariants live in this file, and no other module assigns a field. Pure bookkeeping: no collective, no device work except the one device scalar
``committed_mb`` (micro-batches of all ranks in the committed updates, summed
on the device so that counting never synchronises).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch

from .rounds import RoundKind

__all__ = ["Progress"]


@dataclass
class Progress:
    committed_mb: torch.Tensor  # float64 scalar on the device
    microbatches_per_update: Optional[int] = None  # learned from the first update when not given
    num_rounds: int = 0  # rounds handed off
    num_updates: int = 0  # committed updates now collected
    num_skipped_updates: int = 0  # commits whose gradient was not finite (nonfinite="skip")
    commits_handed_off: int = 0  # the index of the update the next hand-off contributes to
    holds_estimate: bool = False  # the model's parameters are an estimate theta~
    pending: Optional[RoundKind] = None  # a collected round whose weights are not yet in the model
    # ---- the window (not saved)
    mb_in_update: int = 0  # backward() calls since the last step() (one step() per update)
    estimate_in_update: bool = False  # this update's estimate round was handed off
    in_accum: int = 0  # micro-batches in the accumulation buffer (accumulating while communicating)
    since_handoff: int = 0  # micro-batches folded since the last hand-off (accumulating while communicating)
    at_boundary: bool = True  # no micro-batch since the last committed hand-off
    update_hyper: List[Dict[str, Any]] = field(default_factory=list)  # of the update being handed off

    SAVED = ("num_rounds", "num_updates", "num_skipped_updates", "committed_microbatches", "pending_commit",
             "commits_handed_off", "holds_estimate", "microbatches_per_update")

    def to_tensor(self) -> torch.Tensor:
        """The saved fields, in :data:`SAVED` order, as one CPU int64 tensor (reads the device once)."""
        values = {
            "num_rounds": self.num_rounds,
            "num_updates": self.num_updates,
            "num_skipped_updates": self.num_skipped_updates,
            "committed_microbatches": int(self.committed_mb.item()),
            "pending_commit": int(self.pending is RoundKind.COMMIT),
            "commits_handed_off": self.commits_handed_off,
            "holds_estimate": int(self.holds_estimate),
            "microbatches_per_update": self.microbatches_per_update or 0,
        }
        return torch.tensor([values[k] for k in self.SAVED], dtype=torch.int64)

    @classmethod
    def saved_field(cls, saved: torch.Tensor, name: str) -> int:
        """One field of a :meth:`to_tensor` tensor, without loading it."""
        return int(saved[cls.SAVED.index(name)])

    @classmethod
    def check_saved(cls, saved: torch.Tensor) -> None:
        """Raise ``ValueError`` unless ``saved`` is a :meth:`to_tensor` tensor of this version's fields."""
        if tuple(saved.shape) != (len(cls.SAVED),):
            raise ValueError(f"progress: expected {len(cls.SAVED)} counters {cls.SAVED}, got shape {tuple(saved.shape)}")

    def load_tensor(self, saved: torch.Tensor) -> bool:
        """Take the saved fields back and empty the window. Returns whether a commit was collected and not yet
        installed at save time (the caller puts its weights back in the round buffer)."""
        self.check_saved(saved)
        v = dict(zip(self.SAVED, (int(x) for x in saved.tolist())))
        self.num_rounds, self.num_updates = v["num_rounds"], v["num_updates"]
        self.num_skipped_updates = v["num_skipped_updates"]
        self.committed_mb.fill_(v["committed_microbatches"])
        self.commits_handed_off, self.holds_estimate = v["commits_handed_off"], bool(v["holds_estimate"])
        # the optimizer's own count when it was given one (the load allowed a change); else the checkpoint's
        self.microbatches_per_update = self.microbatches_per_update or v["microbatches_per_update"] or None
        self.pending = RoundKind.COMMIT if v["pending_commit"] else None
        self.start_window()
        return self.pending is RoundKind.COMMIT

    def start_window(self) -> None:
        """An update boundary: nothing accumulated, no estimate handed off."""
        self.mb_in_update = self.in_accum = self.since_handoff = 0
        self.estimate_in_update = False
        self.at_boundary = True

    def pending_microbatches(self) -> int:
        """Micro-batches accumulated but not committed (for error messages)."""
        return self.mb_in_update or self.in_accum

    # ------------------------------------------------------------ transitions: the only writers of the fields

    def backward_done(self) -> None:
        """The update loop: a micro-batch's backward has ended."""
        self.mb_in_update += 1
        self.at_boundary = False

    def gradient_arrived(self) -> None:
        """A parameter's gradient reached the buffer: no longer at an update boundary."""
        self.at_boundary = False

    def estimate_handed_off(self) -> None:
        """The update loop handed off this update's estimate (its hyper-parameters: :meth:`take_hyper`)."""
        self.estimate_in_update = True

    def take_hyper(self, hyper: List[Dict[str, Any]]) -> None:
        """The hyper-parameters of the update (or round) about to be handed off."""
        self.update_hyper = hyper

    def update_handed_off(self) -> None:
        """The update loop handed off this update's commit: its window closes."""
        self.mb_in_update = 0
        self.estimate_in_update = False

    def update_discarded(self) -> None:
        """``zero_grad()`` before the update's estimate: its micro-batches so far are gone."""
        self.mb_in_update = 0
        self.at_boundary = True

    def commit_boundary(self) -> None:
        """A commit was handed off: a checkpoint may be taken here."""
        self.at_boundary = True

    def learned(self, microbatches_per_update: Optional[int]) -> None:
        """The update's micro-batch count, learned from the first update or set by the user."""
        self.microbatches_per_update = microbatches_per_update

    def folded(self) -> None:
        """Accumulating while communicating: a micro-batch folded into the sum."""
        self.at_boundary = False
        self.since_handoff += 1
        self.in_accum += 1

    def elastic_handed_off(self, commit: bool) -> None:
        """Accumulating while communicating: a round handed off (a commit takes the sum with it)."""
        if commit:
            self.in_accum = 0
        self.since_handoff = 0

    def round_handed_off(self, kind: RoundKind) -> None:
        """The driver handed off a round."""
        self.num_rounds += 1
        if kind is RoundKind.COMMIT:
            self.commits_handed_off += 1

    def round_collected(self, kind: RoundKind, total_microbatches: torch.Tensor, skipped: Optional[bool]) -> None:
        """The driver collected a round: a commit counts as an update; its weights wait for the swap."""
        if kind is RoundKind.COMMIT:
            self.num_updates += 1
            self.committed_mb += total_microbatches  # compute side, ordered after the round
            self.num_skipped_updates += int(bool(skipped))
        self.pending = kind

    def skipped_on_device(self, count: int) -> None:
        """CUDA path: commits the device skipped, read from their reports."""
        self.num_skipped_updates += count

    def installed(self, kind: Optional[RoundKind]) -> None:
        """The pending round's weights went into the model (``kind``), or were dropped (None)."""
        if kind is not None:
            self.holds_estimate = kind is RoundKind.ESTIMATE
        self.pending = None

    def committed_in_model(self) -> None:
        """The model holds committed weights and nothing is pending (``finish()``, a consolidated load)."""
        self.pending = None
        self.holds_estimate = False
