"""An :class:`~acco.AccoOptimizer`'s configuration, checked and resolved once, then frozen.

Construction checks every argument first (:func:`check_arguments`, before the
param groups are read, so a bad option is named before anything is built), then
resolves what depends on the model and the group (the dtypes) into one
:class:`Options`. Everything downstream (the loops, the rounds, the agreement
between ranks, the state dict's description) reads that object; nothing
re-derives a setting from the raw arguments or compares mode strings of its own.
"""

from __future__ import annotations

import datetime
import dataclasses
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

import torch

from . import _validation as V
from . import precision as P
from .modes import Mode

__all__ = ["Options", "check_arguments", "resolve"]


@dataclass(frozen=True)
class Options:
    """The resolved settings (docs/options.md); ``AccoOptimizer``'s attributes of the same names read them."""

    mode: Mode  # what it implies: mode.estimates, .synchronous, .delayed (modes.py)
    optimizer_class: type
    placement: Optional[str]  # for a class acco does not know: "elementwise" | "whole"
    accumulate_while_communicating: bool
    min_microbatches: int
    max_microbatches: Optional[int]
    max_grad_norm: Optional[float]
    nonfinite: str  # "skip" | "raise"
    timeout: Optional[datetime.timedelta]
    synchronous_updates: int
    estimate_microbatches: Optional[int]  # None: the first half, M // 2
    estimate_extrapolation: float  # mode acco: theta~ = theta + c (Opt*(theta, g) - theta); "auto" resolved
    delay_correction: float  # mode dpu: c of the error feedback on each delayed update (0: none)
    compute_dtype: torch.dtype
    accumulation_dtype: torch.dtype
    reduce_dtype: torch.dtype
    estimate_dtype: Optional[torch.dtype]  # None: the estimate travels like the commit

    @property
    def estimates(self) -> bool:
        """Mode acco: each update has an estimate round (``theta~``) before its commit."""
        return self.mode.estimates

    @property
    def synchronous(self) -> bool:
        """Mode sync: every update runs to completion in ``step()`` (plain ZeRO-1)."""
        return self.mode.synchronous

    @classmethod
    def names(cls) -> List[str]:
        """Every option's name: ``AccoOptimizer`` reads each as an attribute of the same name."""
        return [f.name for f in dataclasses.fields(cls)]

    def agreed(self) -> List[Tuple[str, Any]]:
        """(name, value) of every option, as every rank must have it (``agreement.check_same_model``)."""
        return [(name, _plain(getattr(self, name))) for name in self.names()]

    def check_microbatches(self, m: int) -> None:
        """Refuse ``m`` micro-batches per update (given, learned or loaded) that leave none after the estimate's
        hand-off (``estimate_microbatches``)."""
        if self.estimate_microbatches is not None:
            V.check_estimate_within(self.estimate_microbatches, m)

    def clip_hint(self) -> str:
        """What to tell a user whose loop changed ``.grad`` (clipped it) before ``step()``."""
        if self.max_grad_norm is None:
            return ("To clip the global gradient norm as clip_grad_norm_ does under DDP, pass max_grad_norm=... to "
                    "AccoOptimizer and do not clip .grad yourself (HF Trainer: acco.integrations.hf.AccoTrainer "
                    "maps max_grad_norm for you).")
        return f"This optimizer already clips with max_grad_norm={self.max_grad_norm}: do not clip .grad yourself."


def _plain(value: Any) -> Any:
    """A value whose ``repr`` is the same on every rank that has the same option."""
    if isinstance(value, type):
        return f"{value.__module__}.{value.__qualname__}"
    if isinstance(value, Mode):
        return value.value
    if isinstance(value, (torch.dtype, datetime.timedelta)):
        return str(value)
    return value


def check_arguments(*, mode: Any, optimizer_class: Any, placement: Any, assume_elementwise: Any,
                    microbatches_per_update: Any, accumulate_while_communicating: Any, min_microbatches: Any,
                    max_microbatches: Any, max_grad_norm: Any, nonfinite: Any, timeout: Any,
                    synchronous_updates: Any, estimate_microbatches: Any, estimate_extrapolation: Any,
                    delay_correction: Any) -> dict:
    """Check the arguments that need nothing but themselves, in the order a user reads them; return the
    normalised ones (``placement``; the two numbers as floats, ``estimate_extrapolation`` or ``"auto"``) for
    :func:`resolve`. Raises with what was received and what
    to do."""
    placement = V.check_placement_option(placement, assume_elementwise)
    V.check_optimizer_class(optimizer_class)
    mode = V.check_mode(mode)
    V.check_handoffs(mode, microbatches_per_update, accumulate_while_communicating, min_microbatches, max_microbatches)
    V.check_clipping(max_grad_norm, nonfinite)
    V.check_timeout(timeout)
    V.check_synchronous_updates(accumulate_while_communicating, synchronous_updates)
    V.check_estimate_microbatches(mode, microbatches_per_update, accumulate_while_communicating, estimate_microbatches)
    return dict(
        mode=mode, optimizer_class=optimizer_class, placement=placement,
        accumulate_while_communicating=bool(accumulate_while_communicating), min_microbatches=min_microbatches,
        max_microbatches=max_microbatches, max_grad_norm=max_grad_norm, nonfinite=nonfinite, timeout=timeout,
        synchronous_updates=synchronous_updates, estimate_microbatches=estimate_microbatches,
        estimate_extrapolation=V.check_estimate_extrapolation(mode, estimate_extrapolation),
        delay_correction=V.check_delay_correction(mode, accumulate_while_communicating, delay_correction),
    )


def resolve(checked: dict, *, param_dtype: torch.dtype, world_size: int, compute_dtype: Optional[torch.dtype],
            accumulation_dtype: Optional[torch.dtype], reduce_dtype: Optional[torch.dtype],
            estimate_dtype: Any, classes: Sequence[type]) -> Options:
    """The frozen :class:`Options`: ``checked`` (from :func:`check_arguments`) with the dtypes resolved against the
    parameters' dtype and the group's size (``compute_dtype`` None: the parameters'; the accumulation dtype from
    the compute dtype; the reduce dtype from the accumulation dtype; ``estimate_dtype="auto"`` from all three),
    and ``estimate_extrapolation="auto"`` against the groups' optimizer ``classes``."""
    compute = compute_dtype or param_dtype
    accumulation = P.check_accumulation_dtype(accumulation_dtype, compute)
    reduce = P.check_reduce_dtype(reduce_dtype, accumulation, compute)
    estimate = P.resolve_estimate_dtype(estimate_dtype, checked["mode"], compute, reduce, world_size)
    extrapolation = V.resolve_estimate_extrapolation(
        checked["estimate_extrapolation"], checked["mode"], checked["accumulate_while_communicating"],
        checked["estimate_microbatches"], classes)
    return Options(**{**checked, "estimate_extrapolation": extrapolation}, compute_dtype=compute,
                   accumulation_dtype=accumulation, reduce_dtype=reduce, estimate_dtype=estimate)
