"""Every exception the library raises of its own, in one place.

Errors raised because the ranks disagree (on the rounds they handed off, the hyper-parameters of a round, which
rank's state each loaded, or whether to load at all) subclass ``RuntimeError``, as torch.distributed's own
errors do, so code that catches ``RuntimeError`` around a step or a load catches them too. Those about a bad
argument or file keep ``ValueError`` as well, as they always had.
"""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "HyperParameterMismatchError",
    "ModelMovedError",
    "NonFiniteGradientError",
    "RanksDisagreeError",
    "RoundFailedError",
    "RoundMismatchError",
    "ShardOfAnotherRankError",
]


class CheckpointError(ValueError):
    """A checkpoint that cannot be read, or whose contents do not match their checksums. Nothing was loaded."""


class ModelMovedError(RuntimeError):
    """A parameter changed device or dtype after the optimizer was built."""


class NonFiniteGradientError(FloatingPointError):
    """The averaged gradient of a round holds inf or NaN (raised on every rank alike)."""


class RoundFailedError(RuntimeError):
    """A round's collectives failed: usually a peer died or stalled. The optimizer cannot continue."""


class RanksDisagreeError(RuntimeError, ValueError):
    """The ranks disagree on a collective call's input (e.g. some refused the state dict they were given);
    raised on every rank, each naming what the others did. Also a ``ValueError``, as the refusals it reports."""


class RoundMismatchError(RanksDisagreeError):
    """The ranks handed off different rounds (an estimate on one, a commit on another); raised on every rank."""


class HyperParameterMismatchError(RanksDisagreeError):
    """The ranks handed off one round with different hyper-parameters (raised on every rank alike)."""


class ShardOfAnotherRankError(RanksDisagreeError):
    """``opt.state_dict()`` of rank ``saved_rank`` loaded on another rank (every rank read one rank's file)."""

    def __init__(self, message: str, saved_rank: int) -> None:
        super().__init__(message)
        self.saved_rank = saved_rank
